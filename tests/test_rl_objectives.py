"""The policy objectives (m2jax.rl.objectives, m2jax.rl.step.policy_loss):
CISPO, GRPO and DAPO with and without the KL to a reference policy against
numpy written out per group / sample / batch, group-relative advantages,
dynamic sampling, and the merged step's losses, gradients and metrics
(entropy, KL, clip fraction) over micro-batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import model
from m2jax.rl import cispo
from m2jax.rl import objectives
from m2jax.rl import prefix_tree as pt
from m2jax.rl import step as rl_step

from test_rl_step import CFG, _batch

# The clip ranges each algorithm is defined with (written here, not read
# from the library): CISPO as configured below; GRPO PPO's 0.2; DAPO's
# Clip-Higher 0.2 / 0.28 (DAPO paper).
CLIP = {"cispo": (0.2, 0.3), "grpo": (0.2, 0.2), "dapo": (0.2, 0.28)}
KL_COEF = 0.05


def _config(algorithm, kl_coef):
  return rl_step.RLConfig(
      algorithm=algorithm, kl_coef=kl_coef,
      cispo=cispo.CISPOConfig(eps_low=0.2, eps_high=0.3))


def _reference(algorithm, lp, old, adv, ref, mask, groups, kl_coef):
  """The objective written out in float64: the per-token term and its
  derivative in log pi, then each algorithm's mean. Returns loss, gradient
  [S, L] and clip fraction."""
  lo, hi = CLIP[algorithm]
  ratio = np.exp(lp - old)
  clipped = np.clip(ratio, 1 - lo, 1 + hi)
  if algorithm == "cispo":                 # sg(clip(r)) A log pi
    term, dterm = -clipped * adv * lp, -clipped * adv
    clip = clipped != ratio
  else:                                    # -min(r A, clip(r) A)
    term = -np.minimum(ratio * adv, clipped * adv)
    dterm = np.where(ratio * adv <= clipped * adv, -ratio * adv, 0.0)
    clip = clipped * adv < ratio * adv
  if kl_coef:
    d = ref - lp
    term = term + kl_coef * (np.exp(d) - d - 1)
    dterm = dterm + kl_coef * (1 - np.exp(d))
  scale = np.zeros_like(lp)                # d loss / d term per token
  if algorithm == "cispo":                 # mean over groups of token means
    labels = sorted({g for g, m in zip(groups, mask) if m.any()})
    for g in labels:
      rows = np.array([x == g for x in groups])[:, None] & mask
      scale[rows] = 1 / rows.sum() / len(labels)
  elif algorithm == "grpo":                # mean over samples of token means
    trained = [s for s in range(len(groups)) if mask[s].any()]
    for s in trained:
      scale[s, mask[s]] = 1 / mask[s].sum() / len(trained)
  else:                                    # one token mean over the batch
    scale[mask] = 1 / mask.sum()
  return (np.sum(scale * term), scale * dterm,
          np.sum(scale * clip))


@pytest.mark.parametrize("kl_coef", [0.0, KL_COEF])
@pytest.mark.parametrize("algorithm", ["cispo", "grpo", "dapo"])
def test_policy_loss_matches_numpy(algorithm, kl_coef):
  """Four prompts with 3, 2, 4 and 2 responses of different lengths (the
  last trains no token), ratios on both sides of the clip range, advantages
  of both signs (so PPO-clip drops some clipped tokens and keeps others),
  a reference policy off the current one: loss, gradient in log pi and
  clip fraction equal the numpy objective; the KL metric is the weighted
  k3 mean."""
  rng = np.random.default_rng(5)
  groups = [7, 7, 7, 2, 2, 9, 9, 9, 9, 4, 4]
  S, L = len(groups), 12
  lengths = rng.integers(2, L + 1, S)
  mask = (np.arange(L)[None] < lengths[:, None]) & (rng.random((S, L)) < 0.8)
  mask[[9, 10]] = False
  lp = rng.normal(-2.0, 1.0, (S, L))
  old = lp + rng.normal(0.0, 0.7, (S, L))
  ref = lp + rng.normal(0.0, 0.5, (S, L))
  adv = rng.normal(0.0, 1.0, (S, L))       # per token (reward-to-go)
  ratio = np.exp(lp - old)
  for sign in (1, -1):   # clipped tokens, kept and dropped by PPO-clip
    a = mask & (sign * adv > 0)
    assert (ratio[a] < 0.8).any() and (ratio[a] > 1.3).any()
  config = _config(algorithm, kl_coef)
  w = objectives.token_weights(mask, groups, config.policy.normalize)
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def loss_fn(x):
    return rl_step.policy_loss(x, f32(old), f32(adv), f32(w), f32(ref),
                               config=config)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(lp))
  want_loss, want_grad, want_clip = _reference(algorithm, lp, old, adv, ref,
                                               mask, groups, kl_coef)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["policy/clip_fraction"], want_clip,
                             rtol=1e-5)
  assert 0 < want_clip < 1
  if kl_coef:
    kl = (want_loss - _reference(algorithm, lp, old, adv, ref, mask, groups,
                                 0.0)[0]) / kl_coef
    np.testing.assert_allclose(metrics["policy/kl"], kl, rtol=1e-4)
    assert kl > 0
  else:
    assert "policy/kl" not in metrics
  np.testing.assert_allclose(metrics["policy/loss"] + kl_coef * metrics.get(
      "policy/kl", 0.0), loss, rtol=1e-6)


def test_group_advantages_per_group():
  """Groups given by string ids in any order, of unequal sizes, one of
  equal rewards and one of a single sample (both get 0)."""
  groups = ["b", "a", "b", "c", "a", "b", "c", "d", "a"]
  rewards = np.array([1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.5, 1.0, 0.25])
  for std in (True, False):
    got = objectives.group_advantages(rewards, groups, std=std)
    want = np.zeros(len(groups))
    for g in set(groups):
      rows = np.array([x == g for x in groups])
      r = rewards[rows]
      want[rows] = (r - r.mean()) / ((r.std() + 1e-6) if std else 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got.dtype == np.float32
  assert abs(objectives.group_advantages(rewards, groups)[0]) > 1.0
  with pytest.raises(ValueError, match="one group id per sample"):
    objectives.group_advantages(rewards, groups[:-1])
  with pytest.raises(ValueError, match="rewards must be finite"):
    objectives.group_advantages([1.0, np.nan], [0, 0])


def test_dynamic_sampling_drops_exactly_the_equal_reward_groups():
  """All right, all wrong, equal partial credit and a single sample are
  dropped; groups that differ anywhere (even by 0.25) are kept, samples
  interleaved across groups."""
  groups = ["q1", "q2", "q3", "q1", "q5", "q2", "q6", "q3", "q4", "q5",
            "q6", "q7", "q7", "q1"]
  rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.5, 0.0, 1.0, 0.5,
             0.75, 0.0, 0.0, 1.0]
  got = objectives.dynamic_sampling(rewards, groups)
  assert got.dropped == ["q1", "q3", "q5", "q4", "q7"]
  np.testing.assert_array_equal(
      got.keep, [g in ("q2", "q6") for g in groups])
  adv = objectives.group_advantages(rewards, groups)
  assert np.all(adv[~got.keep] == 0) and np.all(adv[got.keep] != 0)
  ints = objectives.dynamic_sampling([1.0, 0.0, 1.0, 1.0], [3, 3, 8, 8])
  assert ints.dropped == [8] and ints.keep.tolist() == [True, True, False,
                                                          False]


def test_rl_config_selects_the_algorithm():
  assert rl_step.RLConfig().policy == cispo.CISPOConfig()
  dapo = rl_step.RLConfig(algorithm="dapo")
  assert (dapo.policy.eps_low, dapo.policy.eps_high) == CLIP["dapo"]
  assert dapo.policy.normalize == "batch" and dapo.dynamic_sampling
  grpo = rl_step.RLConfig(algorithm="grpo")
  assert (grpo.policy.eps_low, grpo.policy.eps_high) == CLIP["grpo"]
  assert grpo.policy.normalize == "sequence" and not grpo.dynamic_sampling
  with pytest.raises(ValueError, match="RLConfig.algorithm"):
    rl_step.RLConfig(algorithm="ppo")
  with pytest.raises(ValueError, match="RLConfig.kl_coef"):
    rl_step.RLConfig(kl_coef=-0.1)
  with pytest.raises(ValueError, match="needs the reference log-probs"):
    x = jnp.zeros((1, 2))
    rl_step.policy_loss(x, x, x, x, config=rl_step.RLConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="PPOClipConfig.normalize"):
    objectives.PPOClipConfig(normalize="token")


def _np_logprobs_and_entropy(logits_RxTxV, batch):
  """Numpy, per sample slot: log p and entropy of the distribution token l
  was drawn from, the logits at token l - 1 of the same sample."""
  x = np.asarray(logits_RxTxV, np.float64)
  x = x.reshape(-1, x.shape[-1])
  x = x - x.max(-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  entropy = -np.sum(np.exp(logp) * logp, -1)
  tokens = np.asarray(batch.tokens).reshape(-1)
  lp, ent = np.zeros(batch.sample_index.shape), np.zeros(
      batch.sample_index.shape)
  for s, index in enumerate(np.asarray(batch.sample_index)):
    for l in range(1, len(index)):
      if index[l] >= 0:
        lp[s, l] = logp[index[l - 1], tokens[index[l]]]
        ent[s, l] = entropy[index[l - 1]]
  return lp, ent


@pytest.mark.parametrize("algorithm,kl_coef", [("grpo", 0.1), ("dapo", 0.0)])
def test_merged_step_adds_up_over_micro_batches(algorithm, kl_coef):
  """The tiny model's step on one micro-batch of merged rows against two
  micro-batches of unmerged rows (one sample per row, groups split across
  micro-batches; the same shapes, so one compilation), reference log-probs
  computed on each layout's rows: loss, every metric and the gradient of
  every parameter leaf agree. On the merged batch the loss is the numpy
  objective of the model's log-probs, the entropy metric the numpy entropy
  of its logits and the KL metric the numpy k3 mean, weighted like the
  loss."""
  seqs, merged, groups = _batch(seed=3)
  R, T = merged.tokens.shape
  S, L = merged.loss_mask.shape
  n = [len(seq) for seq in seqs]
  unmerged = pt.pack(
      seqs, row_len=T, merge=False, max_len=L,
      loss_masks=[m[:k] for m, k in zip(merged.loss_mask, n)],
      payloads={key: [v[:k] for v, k in zip(value, n)]
                for key, value in merged.payloads.items()})
  micro_of_sample = unmerged.sample_index[:, 0] // T // R
  assert micro_of_sample.max() == 1 and any(
      len(set(micro_of_sample[np.array(groups) == g])) > 1 for g in groups)
  config = _config(algorithm, kl_coef)
  variables = model.init(CFG, jax.random.key(0))
  params, bias = variables["params"], variables[model.EXPERT_BIAS]
  ref_vars = model.init(CFG, jax.random.key(1))
  value_and_grad = jax.jit(jax.value_and_grad(functools.partial(
      rl_step.loss_fn, model_config=CFG, config=config), has_aux=True))
  ref_fn = jax.jit(functools.partial(rl_step.reference_logprobs,
                                     model_config=CFG))
  results = []
  for trees in (unmerged, merged):
    batches = rl_step.make_batches(trees, groups, config, rows_per_batch=R,
                                   samples_per_batch=S)
    if kl_coef:
      b = batches[0]   # NaN until the reference pass fills them
      assert np.isnan(b.ref_logprobs[b.weights > 0]).all()
      batches = [b._replace(ref_logprobs=ref_fn(
          ref_vars["params"], ref_vars[model.EXPERT_BIAS], b))
                 for b in batches]
    parts = [value_and_grad(params, bias, b) for b in batches]
    metrics = jax.tree.map(lambda *x: sum(x), *[m for (_, (m, _)), _ in
                                                parts])
    grads = jax.tree.map(lambda *x: sum(x), *[g for _, g in parts])
    results.append((metrics, grads))
  assert len(batches) == 1
  (rows_m, rows_g), (one_m, one_g) = results
  keys = {"loss", "policy/loss", "policy/clip_fraction", "policy/entropy",
          "policy/tokens"} | ({"policy/kl"} if kl_coef else set())
  assert keys <= set(one_m)
  for key in keys:
    np.testing.assert_allclose(rows_m[key], one_m[key], rtol=1e-5,
                               err_msg=key)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(rows_g),
                          jax.tree_util.tree_leaves(one_g)):
    scale = float(jnp.abs(b).max())
    err = float(jnp.abs(a - b).max())
    assert err <= 1e-5 * scale, f"{path}: {err:.3g} vs {scale:.3g}"
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(one_g)) > 0

  (batch,) = batches
  out = parts[0][0][1][1]
  lp, entropy = _np_logprobs_and_entropy(out.logits, batch)
  w = np.asarray(batch.weights, np.float64)
  np.testing.assert_allclose(one_m["policy/entropy"], np.sum(w * entropy),
                             rtol=1e-5)
  assert 0.5 < float(one_m["policy/entropy"]) <= np.log(CFG.vocab_size) + 1e-5
  # The step's loss is the algorithm's objective on the model's log-probs
  # (one batch: slots hold the samples in order).
  want = _reference(algorithm, lp, merged.payloads["old_logprobs"],
                    merged.payloads["advantages"],
                    np.asarray(batch.ref_logprobs, np.float64),
                    merged.loss_mask, groups, kl_coef)
  np.testing.assert_allclose(one_m["loss"], want[0], rtol=1e-5)
  np.testing.assert_allclose(one_m["policy/clip_fraction"], want[2],
                             rtol=1e-5)
  assert 0 < want[2] < 1
  if kl_coef:
    # The reference pass is the policy's own log-probs on the merged rows.
    np.testing.assert_allclose(ref_fn(params, bias, batch), lp, rtol=1e-5,
                               atol=1e-6)
    d = np.asarray(batch.ref_logprobs, np.float64) - lp
    kl = np.sum(w * (np.exp(d) - d - 1))
    np.testing.assert_allclose(one_m["policy/kl"], kl, rtol=1e-4)
    assert kl > 1e-4
