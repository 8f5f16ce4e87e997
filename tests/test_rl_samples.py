"""The synthetic RL batches of the prefix-tree benchmark (benchmarks/
rl_samples.py): the prefixes they share are the ones the benchmark claims
to merge."""

import numpy as np
import pytest

from benchmarks import rl_samples
from m2jax.rl import prefix_tree


def _is_prefix(a, b):
  return len(a) <= len(b) and np.array_equal(a, b[:len(a)])


def test_grpo_groups_share_their_prompt_and_train_the_responses():
  rng = np.random.default_rng(0)
  seqs, masks, group_ids = rl_samples.grpo_samples(
      rng, 50, groups=2, group_size=3, prompt_len=5, response_len=4)
  assert group_ids == [0, 0, 0, 1, 1, 1]
  for s, m in zip(seqs, masks):
    assert len(s) == 9 and s.min() >= 1 and s.max() < 50
    np.testing.assert_array_equal(m, [False] * 5 + [True] * 4)
  assert all(np.array_equal(seqs[0][:5], s[:5]) for s in seqs[:3])
  assert not np.array_equal(seqs[0][:5], seqs[3][:5])
  # Merged, each group stores its prompt once: 2 * (5 + 3 * 4) tokens.
  trees = prefix_tree.pack(seqs, row_len=64, merge=True, loss_masks=masks)
  assert trees.num_tokens == 2 * (5 + 3 * 4)


def test_agent_trajectories_are_chains_until_the_rewrite():
  rng = np.random.default_rng(1)
  seqs, masks, group_ids = rl_samples.agent_samples(
      rng, 50, steps=[4, 8], start_len=10, final_len=90, rewrite_last=True)
  assert group_ids == [0] * 4 + [1] * 8
  for s, m in zip(seqs, masks):
    state = s[~m]
    assert m.any() and not m[:len(state)].any()   # state first, then action
  # Sample t + 1 extends sample t (state + action + observation) ...
  chained = [_is_prefix(seqs[t], seqs[t + 1]) for t in range(11) if t != 3]
  # ... except right after the last trajectory's rewrite at step 3 * 8 // 4.
  assert chained == [True] * 9 + [False]
  # States grow by (90 - 10) // steps a step; the rewrite keeps half of the
  # 80-token state plus a 5-token summary.
  states = [int((~m).sum()) for m in masks]
  assert states == [10, 30, 50, 70] + [10, 20, 30, 40, 50, 60, 70, 45]
  without = rl_samples.agent_samples(
      np.random.default_rng(1), 50, steps=[4, 8], start_len=10, final_len=90,
      rewrite_last=False)[0]
  assert all(_is_prefix(without[t], without[t + 1]) for t in range(4, 11))
  with pytest.raises(ValueError, match="start_len < final_len"):
    rl_samples.agent_samples(rng, 50, steps=[4], start_len=10, final_len=10,
                             rewrite_last=False)


def test_payloads_are_per_token_with_group_relative_advantages():
  rng = np.random.default_rng(2)
  seqs, _, group_ids = rl_samples.grpo_samples(
      rng, 1000, groups=3, group_size=4, prompt_len=3, response_len=2)
  payloads = rl_samples.rollout_payloads(rng, seqs, group_ids, 1000)
  adv = np.array([a[0] for a in payloads["advantages"]])
  for s, a, lp in zip(seqs, payloads["advantages"], payloads["old_logprobs"]):
    assert len(a) == len(lp) == len(s) and (a == a[0]).all()
  for g in range(3):
    group = adv[np.array(group_ids) == g]
    assert abs(group.mean()) < 1e-5 and abs(group.std() - 1) < 1e-3
  assert abs(np.mean(np.concatenate(payloads["old_logprobs"]))
             + np.log(1000)) < 0.5
