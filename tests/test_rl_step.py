"""The merged RL step (m2jax.rl.step): micro-batches of packed rows with
whole-batch weights, and the train step that accumulates them.

Exactness of the merged loss and gradients against the unmerged batch is in
tests/test_prefix_tree.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.rl import cispo
from m2jax.rl import prefix_tree as pt
from m2jax.rl import step as rl_step
from m2jax.settings import Settings
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

# One layer and the MTP module: two MoE blocks (the main layer's, the MTP
# block's) for the step's per-block sums; the depth adds only compile time.
CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=1,
                              settings=Settings(attention="xla"))
RL = rl_step.RLConfig(cispo=cispo.CISPOConfig(eps_low=0.2, eps_high=0.3),
                      mtp_depth=1)
# A large Adam eps keeps the first update linear in the gradient, so float
# rounding in tiny gradients cannot flip its sign; the routers at the full
# rate move enough to compare at the tolerance of the micro-batch test.
TCFG = TrainConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-3,
                   router_lr_scale=1.0)
# Rows per micro-batch: 2 splits the 5 rows of _batch into three
# micro-batches, the last with a padding row; None: one batch of all rows.
ROWS = (2, None)


@functools.lru_cache(maxsize=None)
def _jit_train_step():
  """rl_step.train_step jitted once for the tests below: they share its two
  programs (one per micro-batch layout in ROWS)."""
  return jax.jit(functools.partial(rl_step.train_step, model_config=CFG,
                                   train_config=TCFG, config=RL))


def _batch(seed=0, vocab=60):
  """Three prompt groups of 2-4 responses in 5 rows of 20 tokens; the row
  budget splits groups over rows."""
  rng = np.random.default_rng(seed)
  seqs, masks, groups = [], [], []
  for g, (n_prompt, G) in enumerate(((9, 4), (5, 2), (7, 3))):
    prompt = list(rng.integers(1, vocab, n_prompt))
    for _ in range(G):
      resp = list(rng.integers(1, vocab, int(rng.integers(2, 7))))
      seqs.append(prompt + resp)
      masks.append([False] * n_prompt + [True] * len(resp))
      groups.append(g)
  payloads = {
      "old_logprobs": [rng.normal(-np.log(CFG.vocab_size), 0.4, len(s))
                       for s in seqs],
      "advantages": [np.full(len(s), rng.normal()) for s in seqs]}
  trees = pt.pack(seqs, row_len=20, loss_masks=masks, payloads=payloads)
  return seqs, trees, groups


@pytest.mark.parametrize("rows_per_batch", [1, 2])
def test_make_batches_keeps_each_sample_whole_with_batch_weights(
    rows_per_batch):
  seqs, trees, groups = _batch()
  R, T = trees.tokens.shape
  row_of_sample = trees.sample_index[:, 0] // T
  assert R == 5 and len(set(row_of_sample[np.array(groups) == 0])) > 1
  batches = rl_step.make_batches(trees, groups, RL,
                                 rows_per_batch=rows_per_batch)
  assert len(batches) == -(-R // rows_per_batch)
  assert len({jax.tree.map(np.shape, b) for b in batches}) == 1
  weights = cispo.token_weights(trees.loss_mask, groups, RL.cispo)
  seen = []
  for b in batches:
    for slot in range(b.sample_index.shape[0]):
      index = b.sample_index[slot]
      if index[0] < 0:                       # an empty slot weighs nothing
        assert not b.weights[slot].any() and not b.mtp_weights[:, slot].any()
        continue
      n = int((index >= 0).sum())
      s = next(s for s, seq in enumerate(seqs) if len(seq) == n and np.all(
          b.tokens.reshape(-1)[index[:n]] == seq) and s not in seen)
      seen.append(s)
      np.testing.assert_array_equal(b.weights[slot], weights[s])
      np.testing.assert_array_equal(b.old_logprobs[slot],
                                    trees.payloads["old_logprobs"][s])
      parent = b.parent.reshape(-1)[index[1:n]]
      np.testing.assert_array_equal(parent, index[:n - 1] % T)
  assert sorted(seen) == list(range(len(seqs)))
  total = sum(b.weights.sum() for b in batches)
  np.testing.assert_allclose(total, 1.0, rtol=1e-6)
  np.testing.assert_allclose(sum(b.mtp_weights.sum() for b in batches), 1.0,
                             rtol=1e-6)
  last = batches[-1]
  if R % rows_per_batch:                     # a padding row
    assert not last.segment_ids[-1].any() and np.all(last.parent[-1] == -1)
    np.testing.assert_array_equal(last.subtree_end[-1], np.arange(1, T + 1))


def test_make_batches_rejects_bad_input():
  _, trees, groups = _batch()
  with pytest.raises(ValueError, match="samples_per_batch"):
    rl_step.make_batches(trees, groups, RL, rows_per_batch=1,
                         samples_per_batch=1)
  with pytest.raises(ValueError, match="advantages"):
    rl_step.make_batches(pt.pack([[1, 2, 3]], row_len=4,
                                 payloads={"old_logprobs": [[0, 0, 0]]}),
                         [0], RL)
  for field, value in (("mtp_depth", -1), ("mtp_weight", float("nan")),
                       ("mtp_loss", "kl"), ("mtp_topk", 0),
                       ("mtp_tail", "drop")):
    with pytest.raises(ValueError, match=f"RLConfig.{field}"):
      rl_step.RLConfig(**{field: value})


def test_train_step_over_rows_equals_one_batch():
  """One policy update with the rows as three micro-batches (scan, the last
  padded) equals the update with all rows at once: loss, the MTP metrics,
  parameters and the expert bias (loads summed over micro-batches) of the
  main and MTP blocks."""
  _, trees, groups = _batch(seed=1)
  variables = model.init(CFG, jax.random.key(0))
  step = _jit_train_step()
  results = []
  for rows in ROWS:
    state = state_lib.init_state(CFG, TCFG, variables)
    batches = rl_step.stack_batches(rl_step.make_batches(
        trees, groups, RL, rows_per_batch=rows))
    results.append(step(state, batches))
  (rows_state, rows_m), (one_state, one_m) = results
  assert int(rows_state.step) == 1
  # The KL (about 1e-2) sums terms about as large: its rounding is larger.
  for key, rtol in (("loss", 1e-5), ("policy/loss", 1e-5), ("mtp/kl", 1e-4),
                    ("mtp/ce", 1e-5), ("mtp/accept_prob", 1e-5),
                    ("grad_norm", 1e-5)):
    np.testing.assert_allclose(rows_m[key], one_m[key], rtol=rtol,
                               err_msg=key)
  assert float(one_m["mtp/ce"]) > 0 and float(one_m["policy/tokens"]) > 0
  assert float(one_m["mtp/kl"]) > 0 and 0 < float(one_m["mtp/accept_prob"]) < 1
  for (path, a), b, p0 in zip(
      jax.tree_util.tree_leaves_with_path(rows_state.params),
      jax.tree_util.tree_leaves(one_state.params),
      jax.tree_util.tree_leaves(variables["params"])):
    moved = float(jnp.abs(b - p0).max())
    assert moved > 0, path
    assert float(jnp.abs(a - b).max()) <= 1e-4 * moved, path
  jax.tree.map(np.testing.assert_array_equal, rows_state.expert_bias,
               one_state.expert_bias)
  bias = one_state.expert_bias
  assert float(jnp.abs(bias["layers_0"]["moe"]["bias"]).max()) > 0
  assert float(jnp.abs(bias["mtp_0"]["block_0"]["moe"]["bias"]).max()) > 0


def test_routing_means_over_micro_batches_equal_the_one_batch_value():
  """The router entropy (a mean over tokens) and aux loss (a mean over
  documents) of a step over micro-batches are the one-batch values, not
  their sum; the loads add up."""
  # The previous test's batch layout and programs (another init): these
  # metrics are the forward pass's, whatever the optimizer settings.
  _, trees, groups = _batch(seed=1)
  variables = model.init(CFG, jax.random.key(1))
  step = _jit_train_step()
  state = state_lib.init_state(CFG, TCFG, variables)
  metrics = [step(state, rl_step.stack_batches(rl_step.make_batches(
      trees, groups, RL, rows_per_batch=rows)))[1] for rows in ROWS]
  assert int(trees.tokens.shape[0]) > 2  # at least two micro-batches
  for key in ("router/entropy", "router/aux_loss", "router/load_cv",
              "mtp/router/entropy", "mtp/router/aux_loss"):
    np.testing.assert_allclose(metrics[0][key], metrics[1][key], rtol=1e-5,
                               err_msg=key)
  # Meaningful values: the aux loss is about 1 when balanced.
  assert 0.5 < float(metrics[1]["router/aux_loss"]) < 4
  assert float(metrics[1]["router/entropy"]) > 0


@pytest.mark.parametrize("algorithm", rl_step.ALGORITHMS)
def test_policy_loss_reports_the_behaviour_logprob_gap(algorithm):
  """policy/logp_gap is the weighted mean |log pi - old log pi| over the
  trained tokens: 0 on-policy, the gap where the two differ (the check
  that the trainer reproduces the rollout's log-probs), untrained tokens
  (weight 0) ignored whatever their log-probs."""
  config = rl_step.RLConfig(algorithm=algorithm)
  old = np.log(np.array([[0.5, 0.25, 0.9, 0.3], [0.6, 0.7, 0.2, 0.1]],
                        np.float32))
  weights = np.array([[0.25, 0.25, 0.0, 0.0], [0.0, 0.25, 0.25, 0.0]],
                     np.float32)
  shift = np.array([[0.1, -0.3, 5.0, 5.0], [9.0, 0.2, -0.4, 9.0]],
                   np.float32)
  advantages = np.ones_like(old)
  _, same = rl_step.policy_loss(jnp.asarray(old), old, advantages, weights,
                                config=config)
  assert float(same["policy/logp_gap"]) == 0.0
  _, moved = rl_step.policy_loss(jnp.asarray(old + shift), old, advantages,
                                 weights, config=config)
  np.testing.assert_allclose(float(moved["policy/logp_gap"]),
                             0.25 * (0.1 + 0.3 + 0.2 + 0.4), rtol=1e-5)
