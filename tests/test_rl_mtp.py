"""MTP co-training in RL (m2jax.rl.mtp_cotrain): the top-K KL against numpy,
its pairing of depth k with the policy on merged rows, the detached
gradient, and the rollout's measured acceptance.

The merged loss equals the unmerged one through the model in
tests/test_prefix_tree.py (test_merged_cispo_and_mtp_gradient_equal_unmerged
trains with the top-K KL)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.rl import mtp_cotrain
from m2jax.rl import prefix_tree as pt
from m2jax.rl import step as rl_step
from m2jax.settings import Settings


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_reference(p_logits, q_logits, topk, tail):
  """KL(p || q) on p's top-k tokens, one vector at a time, in float64."""
  lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
  top = np.argsort(-p_logits)[:topk]
  p, q = np.exp(lp[top]), np.exp(lq[top])
  if tail == "renormalize":
    p, q = p / p.sum(), q / q.sum()
  else:
    p, q = np.r_[p, 1 - p.sum()], np.r_[q, 1 - q.sum()]
  keep = p > 0
  return float(np.sum(p[keep] * np.log(p[keep] / q[keep])))


@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_topk_kl_and_its_gradient_match_numpy(tail):
  """KL and its gradient in the draft's logits against numpy; none flows to
  the policy's logits; a K past the vocabulary is the full KL."""
  rng = np.random.default_rng(0)
  V, K = 12, 4
  p = rng.normal(0, 2, (2, 3, V))
  q = rng.normal(0, 2, (2, 3, V))
  f = jax.jit(functools.partial(mtp_cotrain.topk_kl, topk=K, tail=tail))
  got = np.asarray(f(p.astype(np.float32), q.astype(np.float32)))
  want = np.vectorize(lambda i, j: _kl_reference(p[i, j], q[i, j], K, tail))(
      *np.indices((2, 3)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert (want > 1e-2).all()

  grad_p, grad_q = jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1))(
      p.astype(np.float32), q.astype(np.float32))
  assert not np.asarray(grad_p).any()          # the target is a constant
  # d KL / d q-logit j: q_j - p_j on the top-K (renormalised ones with
  # "renormalize"); outside it 0, or q_j (1 - p_rest / q_rest) with a
  # rest bucket.
  P, Q = np.exp(_log_softmax(p)), np.exp(_log_softmax(q))
  top = p >= np.sort(p, -1)[..., -K:-K + 1]
  if tail == "renormalize":
    norm = lambda x: np.where(top, x, 0) / np.sum(np.where(top, x, 0), -1,
                                                  keepdims=True)
    want_grad = norm(Q) - norm(P)
  else:
    rest = lambda x: np.sum(np.where(top, 0, x), -1, keepdims=True)
    want_grad = np.where(top, Q - P, Q * (1 - rest(P) / rest(Q)))
  np.testing.assert_allclose(grad_q, want_grad, atol=1e-6)

  full = np.asarray(mtp_cotrain.topk_kl(p, q, topk=V + 5, tail=tail))
  lp, lq = _log_softmax(p), _log_softmax(q)
  np.testing.assert_allclose(full, np.sum(np.exp(lp) * (lp - lq), -1),
                             rtol=1e-5)


def _rows():
  """A GRPO group whose responses fork at different depths and an agent
  trajectory (step 2's state extends step 1's), merged into one row, with
  the payloads the RL step reads."""
  rng = np.random.default_rng(1)
  prompt = list(rng.integers(1, 30, 5))
  seqs = [prompt + [7, 8, 9], prompt + [7, 8, 4, 2], prompt + [3, 1]]
  masks = [[0] * 5 + [1] * (len(s) - 5) for s in seqs]
  state = list(rng.integers(1, 30, 4))
  seqs += [state + [5, 6], state + [5, 6, 11, 12, 13]]
  masks += [[0] * 4 + [1] * 2, [0] * 6 + [0, 1, 1]]
  zeros = [np.zeros(len(s)) for s in seqs]
  return seqs, pt.pack(seqs, row_len=64,
                       loss_masks=[np.asarray(m, bool) for m in masks],
                       payloads={"old_logprobs": zeros, "advantages": zeros})


def test_the_kl_pairs_depth_k_with_the_policy_on_each_branch():
  """On merged rows: a draft equal to the policy at every element has KL 0
  and acceptance 1; the loss of each depth is, for every trained token
  l >= k + 1 of every sample, the KL of the element at its parent (its
  own branch, not the next column of the row), token-mean weighted."""
  seqs, trees = _rows()
  assert trees.num_tokens < sum(map(len, seqs))
  R, T = trees.tokens.shape
  V, depth = 10, 2
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(0, 2, (R, T, V)), jnp.float32)
  (batch,) = rl_step.make_batches(trees, list(range(len(seqs))),
                                  rl_step.RLConfig(mtp_depth=depth))
  run = jax.jit(functools.partial(mtp_cotrain.mtp_loss, loss="topk_kl",
                                  topk=3, tail="bucket"))
  args = (batch.tokens, batch.parent, batch.sample_index, batch.mtp_weights)
  term, metrics = run(logits, (logits, logits), *args)
  assert abs(float(term)) < 1e-6
  np.testing.assert_allclose(metrics["mtp/accept_prob"], 1.0, rtol=1e-5)

  drafts = tuple(jnp.asarray(rng.normal(0, 2, (R, T, V)), jnp.float32)
                 for _ in range(depth))
  term, metrics = run(logits, drafts, *args)
  flat = lambda x: np.asarray(x).reshape(R * T, V)
  for k in (1, 2):
    total, n = 0.0, 0
    for s, seq in enumerate(seqs):
      for l in range(k + 1, len(seq)):
        if trees.loss_mask[s, l]:
          at = trees.sample_index[s, l - 1]    # the element predicting l
          total += _kl_reference(flat(logits)[at], flat(drafts[k - 1])[at],
                                 3, "bucket")
          n += 1
    np.testing.assert_allclose(metrics[f"mtp/kl_{k}"], total / n, rtol=1e-5)
  np.testing.assert_allclose(
      term, (metrics["mtp/kl_1"] + metrics["mtp/kl_2"]) / 2, rtol=1e-6)
  assert 0 < float(metrics["mtp/accept_prob"]) < 1


# One layer and the MTP module: two MoE blocks (the main layer's, the MTP
# block's) for the step's per-block sums; the depth adds only compile time.
CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=1,
                              settings=Settings(attention="xla"))


def test_the_mtp_term_trains_the_mtp_module_only():
  """With mtp_detach (the default) the KL's gradient is zero on every
  parameter outside the MTP module (the policy: trunk, embedding, final
  norm, lm_head) and nonzero on every one inside it."""
  seqs, trees = _rows()
  config = rl_step.RLConfig(mtp_depth=1, mtp_topk=8)
  (batch,) = rl_step.make_batches(trees, list(range(len(seqs))), config)
  variables = model.init(CFG, jax.random.key(0))

  def mtp_kl(params):
    _, (metrics, _) = rl_step.loss_fn(params, variables[model.EXPERT_BIAS],
                                      batch, model_config=CFG, config=config)
    return metrics["mtp/kl"]

  kl, grads = jax.jit(jax.value_and_grad(mtp_kl))(variables["params"])
  assert float(kl) > 0
  for (path, g) in jax.tree_util.tree_leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    if "mtp_0" in name:
      assert np.abs(np.asarray(g)).max() > 0, name
    else:
      assert not np.asarray(g).any(), name


def test_mtp_weight_zero_freezes_the_mtp_module():
  """experiments.rl --mtp_weight=0 (the arm without co-training): the
  total RL loss has no gradient on the MTP module, so Adam leaves it as it
  was; at the default weight it has one."""
  seqs, trees = _rows()
  variables = model.init(CFG, jax.random.key(0))

  def mtp_grad_max(weight):
    config = rl_step.RLConfig(mtp_depth=1, mtp_topk=8, mtp_weight=weight)
    (batch,) = rl_step.make_batches(trees, list(range(len(seqs))), config)
    loss = lambda p: rl_step.loss_fn(p, variables[model.EXPERT_BIAS], batch,
                                     model_config=CFG, config=config)[0]
    grads = jax.jit(jax.grad(loss))(variables["params"])
    return max(float(np.abs(np.asarray(g)).max())
               for g in jax.tree.leaves(grads["mtp_0"]))

  assert mtp_grad_max(0.0) == 0.0
  assert mtp_grad_max(rl_step.MTP_WEIGHT) > 0


def test_rollout_acceptance_over_one_step():
  before = {"drafted": 30, "accepted": 20, "accepted_at_1": 9,
            "accepted_at_2": 6, "accepted_at_3": 5}
  after = {"drafted": 90, "accepted": 50, "accepted_at_1": 26,
           "accepted_at_2": 15, "accepted_at_3": 9}
  got = mtp_cotrain.rollout_acceptance(before, after, 3)
  assert got == {"mtp/acceptance": 0.5, "mtp/rounds": 20.0,
                 "mtp/acceptance_at_1": 17 / 20,
                 "mtp/acceptance_at_2": 9 / 20,
                 "mtp/acceptance_at_3": 4 / 20}
  idle = mtp_cotrain.rollout_acceptance(after, after, 3)
  assert np.isnan(idle["mtp/acceptance"]) and idle["mtp/rounds"] == 0
  assert mtp_cotrain.rollout_acceptance({}, after, 0) == {}
  stats = {"drafted": 4, "decode_tokens": 9}
  assert mtp_cotrain.engine_counters(stats, 1) == {
      "drafted": 4, "accepted": 0, "accepted_at_1": 0}
