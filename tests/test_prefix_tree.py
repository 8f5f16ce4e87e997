"""Prefix-tree merging: the packed layout, the batch shapes Forge produces,
per-token log-probs at M2's vocabulary, CISPO against the seeds' objective,
and exactness of the merged RL step (CISPO + MTP gradients) against the
unmerged batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.tree_attention import TreeAttentionConfig, tree_mask
from m2jax import config as config_lib
from m2jax import model
from m2jax.rl import cispo
from m2jax.rl import prefix_tree as pt
from m2jax.rl import step as rl_step
from m2jax.settings import Settings


# ------------------------------------------------------------ batches ------

def grpo_group(rng, prompt_len, num_responses, response_len, vocab=50):
  """One prompt, G responses; some responses share their first tokens."""
  prompt = list(rng.integers(1, vocab, prompt_len))
  stems = [list(rng.integers(1, vocab, 2)) for _ in range(2)]
  return [prompt + stems[g % 2] + list(rng.integers(1, vocab, response_len))
          for g in range(num_responses)]


def agent_trajectory(rng, steps, rewrite_at=None, vocab=50):
  """Samples (state_t + action_t, loss mask on the action). state_{t+1} =
  state_t + action_t + observation_t, except at `rewrite_at`, where the
  context manager keeps only the first half of the state and a summary."""
  state = list(rng.integers(1, vocab, 6))
  samples, masks = [], []
  for t in range(steps):
    action = list(rng.integers(1, vocab, int(rng.integers(1, 4))))
    samples.append(state + action)
    masks.append([False] * len(state) + [True] * len(action))
    obs = list(rng.integers(1, vocab, int(rng.integers(1, 4))))
    state = state + action + obs
    if t == rewrite_at:
      state = state[:len(state) // 2] + [vocab + 1]
  return samples, masks


def check_layout(trees, seqs):
  """Every sample is recovered exactly: its tokens, positions 0..L-1, a
  parent chain along its path, and its last token sees exactly its own
  tokens (nothing of any other branch)."""
  R, T = trees.tokens.shape
  mask = np.asarray(tree_mask(jnp.asarray(trees.subtree_end),
                              jnp.asarray(trees.segment_ids)))
  for s, seq in enumerate(seqs):
    idx = trees.sample_index[s, :len(seq)]
    assert np.all(trees.sample_index[s, len(seq):] == -1)
    row, cols = idx[0] // T, idx % T
    assert np.all(idx // T == row)
    np.testing.assert_array_equal(trees.tokens[row, cols], seq)
    np.testing.assert_array_equal(trees.positions[row, cols],
                                  np.arange(len(seq)))
    assert trees.parent[row, cols[0]] == -1
    np.testing.assert_array_equal(trees.parent[row, cols[1:]], cols[:-1])
    assert np.all(trees.segment_ids[row, cols] == trees.segment_ids[row,
                                                                   cols[0]])
    assert trees.segment_ids[row, cols[0]] > 0
    np.testing.assert_array_equal(np.nonzero(mask[row, cols[-1]])[0],
                                  np.sort(cols))
  real = trees.segment_ids != 0
  idx = np.arange(T)[None]
  assert np.all(trees.subtree_end[real] > np.broadcast_to(idx, (R, T))[real])
  assert np.all(trees.subtree_end <= T)


# -------------------------------------------------------------- layout -----

def test_grpo_group_shares_the_prompt():
  rng = np.random.default_rng(0)
  seqs = grpo_group(rng, prompt_len=10, num_responses=6, response_len=5)
  trees = pt.pack(seqs, row_len=64)
  check_layout(trees, seqs)
  assert trees.tokens.shape[0] == 1
  # prompt once, two shared 2-token stems, then 6 distinct 5-token tails.
  assert trees.num_tokens == 10 + 2 * 2 + 6 * 5
  unmerged = pt.pack(seqs, row_len=64, merge=False)
  check_layout(unmerged, seqs)
  assert unmerged.num_tokens == sum(map(len, seqs))
  assert trees.attention_entries() < unmerged.attention_entries()


def test_agent_trajectory_is_one_chain_until_a_rewrite():
  rng = np.random.default_rng(1)
  seqs, masks = agent_trajectory(rng, steps=8)
  trees = pt.pack(seqs, row_len=256, loss_masks=masks)
  check_layout(trees, seqs)
  # No rewrite: every step is a prefix of the next, so one chain as long
  # as the last sample.
  assert trees.num_tokens == len(seqs[-1])
  np.testing.assert_array_equal(trees.parent[0, 1:trees.num_tokens],
                                np.arange(trees.num_tokens - 1))

  seqs, masks = agent_trajectory(rng, steps=8, rewrite_at=3)
  trees = pt.pack(seqs, row_len=256, loss_masks=masks)
  check_layout(trees, seqs)
  children = np.bincount(trees.parent[trees.parent >= 0])
  assert children.max() == 2 and (children == 2).sum() == 1  # one fork


def test_loss_masks_and_payloads_stay_per_sample():
  """The same token is an action (trained) in step t and context in step
  t+1: masks and payloads are kept in each sample's layout."""
  rng = np.random.default_rng(2)
  seqs, masks = agent_trajectory(rng, steps=4)
  old = [rng.standard_normal(len(s)).astype(np.float32) for s in seqs]
  trees = pt.pack(seqs, row_len=128, loss_masks=masks,
                  payloads={"old_logprobs": old})
  for s in range(len(seqs)):
    n = len(seqs[s])
    np.testing.assert_array_equal(trees.loss_mask[s, :n], masks[s])
    np.testing.assert_array_equal(trees.payloads["old_logprobs"][s, :n],
                                  old[s])
    assert not trees.loss_mask[s, n:].any()
  # Step 0's action tokens are context (mask False) in step 1.
  n0 = len(seqs[0])
  assert trees.loss_mask[0, n0 - 1] and not trees.loss_mask[1, n0 - 1]
  assert trees.sample_index[0, n0 - 1] == trees.sample_index[1, n0 - 1]


def test_mixture_of_groups_and_trajectories():
  rng = np.random.default_rng(3)
  seqs = grpo_group(rng, 8, 4, 3) + grpo_group(rng, 5, 3, 4)
  traj, _ = agent_trajectory(rng, steps=5, rewrite_at=2)
  seqs += traj + [list(rng.integers(1, 50, 7))]
  trees = pt.pack(seqs, row_len=96)
  check_layout(trees, seqs)
  assert trees.num_tokens < sum(map(len, seqs))


def test_row_budget_splits_a_tree_and_repeats_only_the_prefix():
  rng = np.random.default_rng(4)
  prompt = list(rng.integers(1, 50, 6))
  seqs = [prompt + list(rng.integers(50, 99, 3)) for _ in range(4)]
  # Whole tree: 6 + 12 = 18 tokens; a 12-token row holds the prompt and
  # two responses, so two rows, each with its own copy of the prompt.
  trees = pt.pack(seqs, row_len=12)
  check_layout(trees, seqs)
  assert trees.tokens.shape[0] == 2
  assert trees.num_tokens == 2 * 6 + 4 * 3


@pytest.mark.parametrize("seed", range(3))
def test_random_batches_any_budget(seed):
  rng = np.random.default_rng(10 + seed)
  seqs = grpo_group(rng, int(rng.integers(1, 12)), int(rng.integers(1, 6)),
                    int(rng.integers(0, 6)), vocab=6)
  traj, _ = agent_trajectory(rng, steps=int(rng.integers(2, 7)),
                             rewrite_at=int(rng.integers(0, 4)), vocab=6)
  seqs += traj + [list(rng.integers(1, 6, int(rng.integers(1, 9))))]
  longest = max(map(len, seqs))
  for row_len in (longest, longest + 7, 4 * longest):
    trees = pt.pack(seqs, row_len=row_len)
    check_layout(trees, seqs)


def test_sample_longer_than_a_row_is_rejected():
  with pytest.raises(ValueError, match="row_len"):
    pt.pack([[1, 2, 3, 4]], row_len=3)


# ------------------------------------------------- per-token log-probs -----

M2_VOCAB = config_lib.MINIMAX_M2.vocab_size   # 200,064
LONG_ROW = 10_800     # > 2**31 / M2_VOCAB = 10,734: parent * V overflows int32


def _random_parents(rng, R, T):
  """Parents of a random tree per row: -1 at the first token, else any
  earlier token (far jumps included)."""
  parent = (np.arange(T)[None] - rng.integers(1, T, (R, T))).astype(np.int32)
  parent = np.maximum(parent, rng.integers(-1, 1, (R, T)))
  parent[:, 0] = -1
  return parent


def test_picked_logits_at_m2_vocab_in_a_long_row():
  """The gather at V = 200,064 and T = 10,800 (T * V > 2**31) returns the
  right element for every token. The logits are a closed form of (r, t, v)
  built inside the jitted function, so XLA fuses them into the gather and
  the 17 GB array never exists; every coordinate shifts the value."""
  R, T, V = 2, LONG_ROW, M2_VOCAB
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (R, T)).astype(np.int32)
  tokens[:, -4:] = V - 1          # the largest coordinates in every axis
  parent = _random_parents(rng, R, T)
  parent[:, -2:] = T - 3

  def closed_form(r, t, v):  # exact integers in float32 (< 2**23)
    return ((31 * v + 17 * t + 5 * r) & (2**23 - 1)).astype(np.float32)

  def picked(tokens, parent):
    r, t, v = (jax.lax.broadcasted_iota(jnp.int32, (R, T, V), d)
               for d in range(3))
    return pt.picked_logits(closed_form(r, t, v), tokens, parent)

  compiled = jax.jit(picked).lower(tokens, parent).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 2**26
  got = np.asarray(compiled(tokens, parent))
  r = np.arange(R)[:, None]
  want = closed_form(r, np.maximum(parent, 0), tokens.astype(np.int64))
  np.testing.assert_array_equal(got, want)
  # The whole log-prob traces at this shape (it used to overflow here).
  shape = jax.eval_shape(
      pt.token_logprobs, jax.ShapeDtypeStruct((R, T, V), jnp.float32),
      jax.ShapeDtypeStruct((R, T), jnp.int32),
      jax.ShapeDtypeStruct((R, T), jnp.int32))
  assert shape.shape == (R, T)


def test_token_logprobs_values_gradients_and_memory():
  """Against log_softmax at the parent on random trees: values, the
  gradient of a weighted sum, and no second [R, T, V] array in the forward
  (the compiled temporaries stay far below one copy of the logits)."""
  R, T, V = 2, 48, 301
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 3, (R, T, V)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, (R, T)), jnp.int32)
  parent = jnp.asarray(_random_parents(rng, R, T))
  w = jnp.asarray(rng.normal(size=(R, T)), jnp.float32)

  def reference(logits):
    lp = jax.nn.log_softmax(logits, -1)
    lp = lp[jnp.arange(R)[:, None], jnp.maximum(parent, 0), tokens]
    return jnp.where(parent >= 0, lp, 0.0)

  got = jax.jit(pt.token_logprobs)(logits, tokens, parent)
  np.testing.assert_allclose(got, jax.jit(reference)(logits), rtol=1e-6,
                             atol=1e-6)
  assert np.all(np.asarray(got)[np.asarray(parent) < 0] == 0)
  g = jax.jit(jax.grad(
      lambda x: jnp.sum(w * pt.token_logprobs(x, tokens, parent))))
  g_ref = jax.jit(jax.grad(lambda x: jnp.sum(w * reference(x))))
  np.testing.assert_allclose(g(logits), g_ref(logits), rtol=1e-5, atol=1e-6)
  compiled = jax.jit(pt.token_logprobs).lower(logits, tokens,
                                              parent).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < logits.nbytes // 8


# --------------------------------------------------------------- CISPO -----

def test_group_advantages_are_standardised():
  a = cispo.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0, 1.0]))
  np.testing.assert_allclose(a.mean(), 0.0, atol=1e-6)
  np.testing.assert_allclose(a.std(), 1.0, atol=1e-5)


def test_cispo_reweights_but_never_drops_a_token():
  """d loss / d logprob = -clip(ratio) * A / n for every trained token, also
  where the ratio is clipped (PPO would give zero there)."""
  cfg = cispo.CISPOConfig(eps_low=1.0, eps_high=0.2)
  lp = jnp.array([[-1.0, -0.5, -2.0, -1.0]])
  old = jnp.array([[-1.0, -1.5, -1.0, -1.0]])      # ratios 1, e, 1/e, 1
  adv = jnp.array([[1.0, 2.0, -1.0, 5.0]])
  mask = np.array([[True, True, True, False]])
  w = jnp.asarray(cispo.token_weights(mask, [0], cfg))
  grad = jax.jit(jax.grad(
      lambda x: cispo.cispo_loss(x, old, adv, w, cfg)[0]))(lp)
  ratio = np.exp(np.asarray(lp - old))
  want = -np.clip(ratio, 0.0, 1.2) * np.asarray(adv) * mask / 3
  np.testing.assert_allclose(grad, want, rtol=1e-6)
  assert np.all(np.asarray(grad)[0, :3] != 0)


def _cispo_reference(lp, old, adv, mask, groups, eps_low, eps_high,
                     normalize):
  """The seeds' objective written out per group (numpy, float64): loss and
  its gradient with respect to the log-probs."""
  coef = np.clip(np.exp(lp - old), 1 - eps_low, 1 + eps_high) * adv * mask
  if normalize == "batch":
    return -np.sum(coef * lp) / mask.sum(), -coef / mask.sum()
  labels = sorted({g for g, m in zip(groups, mask) if m.any()})
  loss, grad = 0.0, np.zeros_like(lp)
  for g in labels:
    rows = np.array([x == g for x in groups])
    n_g = mask[rows].sum()
    loss -= np.sum(coef[rows] * lp[rows]) / n_g / len(labels)
    grad[rows] = -coef[rows] / n_g / len(labels)
  return loss, grad


@pytest.mark.parametrize("normalize", ["group", "batch"])
def test_cispo_matches_the_objective_per_group_or_per_batch(normalize):
  """Three prompts with 3, 2 and 4 responses of different lengths (so
  groups hold different token counts), a fourth whose responses train no
  token, eps_low < 1 with ratios below 1 - eps_low, advantages of both
  signs: loss and gradient equal the numpy objective, and the weights
  split over any partition of the samples (rows) add up to the batch."""
  rng = np.random.default_rng(5)
  groups = [7, 7, 7, 2, 2, 9, 9, 9, 9, 4, 4]
  S, L = len(groups), 12
  lengths = rng.integers(2, L + 1, S)
  mask = (np.arange(L)[None] < lengths[:, None]) & (rng.random((S, L)) < 0.8)
  mask[[9, 10]] = False
  lp = rng.normal(-2.0, 1.0, (S, L))
  old = lp + rng.normal(0.0, 0.7, (S, L))
  adv = np.repeat(rng.normal(0.0, 1.0, (S, 1)), L, axis=1)
  cfg = cispo.CISPOConfig(eps_low=0.2, eps_high=0.3, normalize=normalize)
  ratio = np.exp(lp - old)[mask]
  assert (ratio < 0.8).any() and (ratio > 1.3).any() and (adv < 0).any()

  w = cispo.token_weights(mask, groups, cfg)
  np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss_fn = lambda x, w: cispo.cispo_loss(x, f32(old), f32(adv), f32(w),
                                          cfg)[0]
  loss, grad = jax.jit(jax.value_and_grad(loss_fn))(f32(lp), w)
  want_loss, want_grad = _cispo_reference(lp, old, adv, mask, groups, 0.2,
                                          0.3, normalize)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  other = "batch" if normalize == "group" else "group"
  assert abs(want_loss - _cispo_reference(lp, old, adv, mask, groups, 0.2,
                                          0.3, other)[0]) > 1e-2
  part = rng.random(S) < 0.5                      # two "rows"
  parts = sum(loss_fn(f32(lp), np.where(p[:, None], w, 0)) for p in
              (part, ~part))
  np.testing.assert_allclose(parts, loss, rtol=1e-6)


def test_cispo_config_names_the_bad_field():
  with pytest.raises(ValueError, match="CISPOConfig.normalize"):
    cispo.CISPOConfig(normalize="sample")
  with pytest.raises(ValueError, match="CISPOConfig.eps_low"):
    cispo.CISPOConfig(eps_low=1.5)


# ----------------------------------------------------------- exactness -----

# One layer and the MTP module: every layer runs the same attention over the
# merged rows, and the interpreted kernel and each compile cost per layer.
CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=1,
                              compute_dtype="float32",
                              settings=Settings(attention="xla"))
# The same model with tree attention through the Pallas kernel (interpreted).
CFG_KERNEL = CFG.replace(settings=Settings(
    attention="xla", tree_attention=TreeAttentionConfig(backend="triton"),
    interpret=True))
# MTP co-training by the top-K KL with the MTP module detached from the
# policy (the defaults); K well below the vocabulary, so the rest of the
# mass is a large outcome of its own.
RL = rl_step.RLConfig(cispo=cispo.CISPOConfig(eps_low=0.2, eps_high=0.3),
                      mtp_depth=1, mtp_weight=0.5, mtp_topk=8)


@functools.lru_cache(maxsize=None)
def _variables():
  return model.init(CFG, jax.random.key(0))


def _exactness_batch(rng):
  """A GRPO group (group 0) and an agent trajectory (group 1): different
  token counts. Old log-probs scatter around the initial model's (about
  -log V), so ratios fall below 1 - eps_low, inside, and above 1 + eps_high;
  advantages of both signs."""
  vocab = CFG.vocab_size - 2  # the rewrite marker is vocab + 1
  seqs = grpo_group(rng, 9, 4, 4, vocab=vocab)
  traj, traj_masks = agent_trajectory(rng, steps=4, rewrite_at=1, vocab=vocab)
  seqs += traj
  masks = [[False] * 9 + [True] * (len(s) - 9) for s in seqs[:4]] + traj_masks
  old = [rng.normal(-np.log(CFG.vocab_size), 0.4, len(s)).astype(np.float32)
         for s in seqs]
  adv = [np.full(len(s), a, np.float32) for a, s in
         zip(rng.normal(0.0, 1.0, len(seqs)), seqs)]
  groups = [0] * 4 + [1] * len(traj)
  return seqs, masks, {"old_logprobs": old, "advantages": adv}, groups


def _topk_kl(p_logits, q_logits, k):
  """KL(p || q) over p's top-k tokens and the rest as one outcome, p under
  stop-gradient (m2jax.rl.mtp_cotrain), written with a gather."""
  lp = jax.nn.log_softmax(jax.lax.stop_gradient(p_logits), -1)
  lq = jax.nn.log_softmax(q_logits, -1)
  idx = jax.lax.top_k(lp, k)[1]
  lp_k = jnp.take_along_axis(lp, idx, -1)
  lq_k = jnp.take_along_axis(lq, idx, -1)
  p_rest = 1 - jnp.exp(lp_k).sum(-1)
  q_rest = 1 - jnp.exp(lq_k).sum(-1)
  return (jnp.sum(jnp.exp(lp_k) * (lp_k - lq_k), -1)
          + p_rest * (jnp.log(p_rest) - jnp.log(q_rest)))


def _unmerged_loss(params, seqs, trees, groups):
  """Reference: one padded row per sample through the model's ordinary
  causal path; CISPO with group weights plus the depth-1 MTP top-K KL
  (token mean over trained tokens l >= 2; depth 1 at position l - 2 pulled
  to the policy at l - 1, both predicting token l), written out here.
  Returns (loss, (depth 1's KL, its CE)), metrics of the merged step."""
  S, L = trees.loss_mask.shape
  tokens = np.zeros((S, L), np.int32)
  seg = np.zeros((S, L), np.int32)
  for s, seq in enumerate(seqs):
    tokens[s, :len(seq)], seg[s, :len(seq)] = seq, 1
  out = model.forward(CFG, dict(_variables(), params=params),
                      jnp.asarray(tokens), segment_ids=jnp.asarray(seg),
                      mtp_depth=1, mtp_detach=RL.mtp_detach)
  tok = jnp.asarray(tokens)
  lp = jax.nn.log_softmax(out.logits, -1)
  lp = jnp.take_along_axis(lp[:, :-1], tok[:, 1:, None], -1)[..., 0]
  lp_SxL = jnp.pad(lp, ((0, 0), (1, 0)))                  # token l from l-1
  mtp = jax.nn.log_softmax(out.mtp_logits[0], -1)
  mtp = jnp.take_along_axis(mtp[:, :-2], tok[:, 2:, None], -1)[..., 0]
  mtp_SxL = jnp.pad(mtp, ((0, 0), (2, 0)))                # token l from l-2
  weights = cispo.token_weights(trees.loss_mask, groups, RL.cispo)
  loss = cispo.cispo_loss(lp_SxL, trees.payloads["old_logprobs"],
                          trees.payloads["advantages"], weights, RL.cispo)[0]
  kl = _topk_kl(out.logits[:, 1:-1], out.mtp_logits[0][:, :-2], RL.mtp_topk)
  kl_SxL = jnp.pad(kl, ((0, 0), (2, 0)))                  # token l from l-2
  mtp_mask = trees.loss_mask & (np.arange(L)[None] >= 2)
  mean = lambda x: jnp.sum(jnp.where(mtp_mask, x, 0.0)) / mtp_mask.sum()
  return loss + RL.mtp_weight * mean(kl_SxL), (mean(kl_SxL), -mean(mtp_SxL))


def test_merged_cispo_and_mtp_gradient_equal_unmerged():
  """The tiny MoE model in float32, the library's merged RL step (CISPO
  with per-group weights + MTP depth 1 by the top-K KL): loss, the MTP
  KL and CE, and the gradient of every parameter leaf equal the unmerged
  batch's, to 1e-5 of the leaf's largest entry, from one tree in one row
  (tree attention through the Pallas kernel, interpreted) and from a tree
  split over rows by the budget and processed one row at a time (dense
  tree mask), the row gradients summed.
  Every leaf, the MTP module's included, gets a gradient."""
  rng = np.random.default_rng(0)
  seqs, masks, payloads, groups = _exactness_batch(rng)
  L = max(map(len, seqs))
  variables = _variables()
  params, bias = variables["params"], variables[model.EXPERT_BIAS]
  one_row = pt.pack(seqs, row_len=128, loss_masks=masks, payloads=payloads,
                    max_len=L)
  split = pt.pack(seqs, row_len=L + 3, loss_masks=masks, payloads=payloads,
                  max_len=L)
  assert one_row.num_tokens < sum(map(len, seqs))
  assert one_row.tokens.shape[0] == 1 and split.tokens.shape[0] > 1
  ratio = np.exp(-np.log(CFG.vocab_size) - one_row.payloads["old_logprobs"])
  ratio = ratio[one_row.loss_mask]
  assert (ratio < 0.8).any() and (ratio > 1.3).any()

  (loss_u, mtp_u), g_u = jax.jit(jax.value_and_grad(functools.partial(
      _unmerged_loss, seqs=seqs, trees=one_row, groups=groups),
                                                     has_aux=True))(params)
  assert float(mtp_u[0]) > 1e-3 and float(mtp_u[1]) > 1
  step = lambda cfg: jax.jit(functools.partial(
      rl_step.grad_step, model_config=cfg, config=RL))
  (batch,) = rl_step.make_batches(one_row, groups, RL)
  assert "pallas_call" in str(jax.make_jaxpr(functools.partial(
      model.forward, CFG_KERNEL, variables))(
          batch.tokens, segment_ids=batch.segment_ids,
          positions=batch.positions, subtree_end=batch.subtree_end))
  g_one, m_one, _ = step(CFG_KERNEL)(params, bias, batch)
  row_step = step(CFG)
  parts = [row_step(params, bias, b) for b in
           rl_step.make_batches(split, groups, RL, rows_per_batch=1)]
  g_split = jax.tree.map(lambda *x: sum(x), *[g for g, _, _ in parts])
  m_split = {k: sum(m[k] for _, m, _ in parts) for k in m_one}
  for name, m, g_m in (("one row, kernel", m_one, g_one),
                       ("rows", m_split, g_split)):
    np.testing.assert_allclose(m["loss"], loss_u, rtol=1e-5, err_msg=name)
    # The reference's rest mass 1 - p(top-K) rounds to 1e-7 in float32.
    np.testing.assert_allclose(m["mtp/kl_1"], mtp_u[0], rtol=2e-4,
                               err_msg=name)
    np.testing.assert_allclose(m["mtp/ce_1"], mtp_u[1], rtol=1e-5,
                               err_msg=name)
    for (path, gm), gu in zip(jax.tree_util.tree_leaves_with_path(g_m),
                              jax.tree_util.tree_leaves(g_u)):
      scale = float(np.abs(gu).max())
      assert scale > 0, f"{name}: no gradient at {path}"
      err = float(np.abs(np.asarray(gm) - np.asarray(gu)).max())
      assert err <= 1e-5 * scale, f"{name} {path}: {err:.3g} vs {scale:.3g}"
