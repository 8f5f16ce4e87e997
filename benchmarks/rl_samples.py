"""Synthetic RL batches for the prefix-tree benchmark (experiments/
bench_prefix_tree.py, model section): GRPO groups, agent trajectories and
their rollout payloads.

A sample is (token ids [L], loss mask [L] bool, group id); samples of one
group share a prefix, which prefix-tree packing (m2jax.rl.prefix_tree)
stores once. Token ids are uniform in [1, vocab): the benchmark times the
layouts, not what the model learns. Every function draws from the `rng` it
is given, in a fixed order, so one seed gives one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from m2jax.rl import cispo

Samples = tuple[list[np.ndarray], list[np.ndarray], list[int]]


def grpo_samples(rng: np.random.Generator, vocab: int, *, groups: int,
                 group_size: int, prompt_len: int, response_len: int
                 ) -> Samples:
  """`groups` GRPO groups: each one prompt and `group_size` responses.

  Returns (sequences [prompt_len + response_len] each, loss masks on the
  responses, group ids), group by group.
  """
  for name, value in (("groups", groups), ("group_size", group_size),
                      ("prompt_len", prompt_len),
                      ("response_len", response_len)):
    if value < 1:
      raise ValueError(f"grpo_samples: {name} must be >= 1, got {value}")
  seqs, masks, group_ids = [], [], []
  for g in range(groups):
    prompt = rng.integers(1, vocab, prompt_len)
    for _ in range(group_size):
      seqs.append(np.concatenate([prompt, rng.integers(1, vocab,
                                                       response_len)]))
      masks.append(np.arange(prompt_len + response_len) >= prompt_len)
      group_ids.append(g)
  return seqs, masks, group_ids


def agent_samples(rng: np.random.Generator, vocab: int, *,
                  steps: Sequence[int], start_len: int, final_len: int,
                  rewrite_last: bool) -> Samples:
  """Agent trajectories, one group each, `steps[i]` samples in the i-th.

  Sample t is state_t + action_t and trains the action; state_{t+1} =
  state_t + action_t + observation_t, growing from `start_len` tokens by
  (final_len - start_len) // steps a step (the action 20-40% of it). With
  `rewrite_last`, the last trajectory's context is rewritten once, at 3/4 of
  its steps: the state keeps its first half plus a summary (1/16 of its
  length), so its chain branches there.
  """
  if not steps or min(steps) < 1:
    raise ValueError(f"agent_samples: steps must be >= 1 each, got {steps}")
  if not 0 < start_len < final_len:
    raise ValueError(f"agent_samples: need 0 < start_len < final_len, got "
                     f"{start_len} and {final_len}")
  seqs, masks, group_ids = [], [], []
  for i, n_steps in enumerate(steps):
    rewrite = (3 * n_steps // 4 if rewrite_last and i == len(steps) - 1
               else None)
    growth = (final_len - start_len) // n_steps
    state = rng.integers(1, vocab, start_len)
    for t in range(n_steps):
      n_act = int(growth * rng.uniform(0.2, 0.4))
      action = rng.integers(1, vocab, n_act)
      seqs.append(np.concatenate([state, action]))
      masks.append(np.arange(len(state) + n_act) >= len(state))
      group_ids.append(i)
      state = np.concatenate([state, action,
                              rng.integers(1, vocab, growth - n_act)])
      if t == rewrite:
        state = np.concatenate([state[:len(state) // 2],
                                rng.integers(1, vocab, len(state) // 16)])
  return seqs, masks, group_ids


def rollout_payloads(rng: np.random.Generator, seqs: Sequence[np.ndarray],
                     group_ids: Sequence[int], vocab: int
                     ) -> dict[str, list[np.ndarray]]:
  """Per-token payloads of `seqs` for prefix_tree.pack.

  "old_logprobs": rollout log-probs near an untrained model's (about
  -log vocab, std 0.5); "advantages": group-relative advantages
  (cispo.group_advantages) of uniform random rewards, constant along each
  sample.
  """
  rewards = rng.random(len(seqs))
  adv = np.zeros(len(seqs), np.float32)
  for g in set(group_ids):
    members = [i for i, x in enumerate(group_ids) if x == g]
    adv[members] = cispo.group_advantages(rewards[members])
  return {"old_logprobs": [rng.normal(-np.log(vocab), 0.5, len(s))
                           for s in seqs],
          "advantages": [np.full(len(s), a) for s, a in zip(seqs, adv)]}
