"""Long rows: attention over packed documents without a mask array, the
chunked lm_head + cross-entropy (fused and recomputing), and a train step
with no [T, T] array."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.blockwise_attention import blockwise_attention
from kernels.tree_attention import TreeAttentionConfig, chain_subtree_end
from m2jax import config as config_lib
from m2jax import model
from m2jax.model import attention
from m2jax.settings import Settings
from m2jax.train import losses
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

B, T, N, K, H = 2, 40, 6, 2, 8


def _rows():
  """Two packed rows: documents of 13, 17, 7 tokens and 3 of padding (0);
  and of 25 and 15 tokens. Positions restart at each document."""
  seg = np.zeros((B, T), np.int32)
  seg[0, :13], seg[0, 13:30], seg[0, 30:37] = 1, 2, 3
  seg[1, :25], seg[1, 25:] = 5, 7
  pos = np.zeros_like(seg)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
  return jnp.asarray(seg), jnp.asarray(pos)


SEG, POS = _rows()
_R = np.random.default_rng(0)
Q, KEY, VAL, COT = (jnp.asarray(_R.normal(size=s), jnp.float32) for s in
                    ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))


def _dense(q, k, v, window, sinks=0, subtree_end=None):
  """The model's dense path: attention_mask into the XLA reference."""
  mask = attention.attention_mask(SEG, POS, window=window,
                                  num_sink_tokens=sinks,
                                  subtree_end_BxT=subtree_end)
  return attention.dot_product_attention_xla(q, k, v, mask)


def _value_and_grads(f):
  """f(q, k, v) and the gradients of <f, COT> for q, k, v (jitted)."""
  def run(q, k, v, cot):
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(cot)
  return jax.jit(run)(Q, KEY, VAL, COT)


def _assert_close(got, want, tol=2e-5):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize("window, sinks", [(None, 0), (5, 2)])
def test_blockwise_attention_equals_the_dense_mask(window, sinks):
  """Values and gradients of q, k, v on packed rows (three documents and
  padding; GQA 6:2), full and windowed with sinks, with tiles that cut
  documents (8 x 16)."""
  got = _value_and_grads(lambda q, k, v: blockwise_attention(
      q, k, v, SEG, POS, window=window, num_sink_tokens=sinks, block_q=8,
      block_k=16))
  want = _value_and_grads(lambda q, k, v: _dense(q, k, v, window, sinks))
  _assert_close(got, want)


def test_packed_attention_impls_agree_and_shards_see_global_indices():
  """Every implementation of packed_attention gives the dense result on a
  packed row ("tree" through the chain subtree_end), and a shard of the
  queries with q_offset and the whole row's keys gives its rows of it (the
  call a sequence-parallel shard makes)."""
  tree = TreeAttentionConfig(backend="xla")

  @jax.jit
  def run(q, k, v):
    whole = [attention.packed_attention(q, k, v, SEG, POS, window=None,
                                        impl=impl, tree_config=tree)
             for impl in ("tree", "blockwise", "xla", "auto")]
    shard = [attention.packed_attention(
        q[:, 24:], k, v, SEG[:, 24:], POS[:, 24:], window=None, impl=impl,
        kv_segment_ids_BxS=SEG, kv_positions_BxS=POS, q_offset=24)
             for impl in ("blockwise", "xla")]
    return _dense(q, k, v, None), whole, shard

  want, whole, shard = run(Q, KEY, VAL)
  _assert_close(whole, [want] * len(whole))
  _assert_close(shard, [want[:, 24:]] * len(shard))


def test_blockwise_attention_follows_a_prefix_tree():
  """With subtree_end a query sees its ancestors only: in row 0's first
  document, tokens 4..7 are a branch that tokens 8..12 (the other branch
  after the shared prefix 0..3) must not see. Values and gradients against
  the dense tree mask."""
  se = np.array(chain_subtree_end(SEG))
  se[0, 4:8] = 8
  se = jnp.asarray(se)
  got = _value_and_grads(lambda q, k, v: blockwise_attention(
      q, k, v, SEG, POS, subtree_end_BxS=se, block_q=8, block_k=8))
  want = _value_and_grads(lambda q, k, v: _dense(q, k, v, None,
                                                 subtree_end=se))
  _assert_close(got, want)
  # The branch matters: without it token 8 would read tokens 4..7.
  plain = blockwise_attention(Q, KEY, VAL, SEG, POS, block_q=8, block_k=8)
  assert not np.allclose(plain[0, 8:13], got[0][0, 8:13], atol=1e-3)


def test_tree_rows_on_a_cpu_run_blockwise_not_the_dense_reference():
  """packed_attention on tree rows with the default tree config, on a CPU
  (no tree kernel runs): the blockwise path with the tree's intervals, no
  [T, T] mask, the dense reference's values and gradients; naming
  backend="xla" still gets the dense reference."""
  se = np.array(chain_subtree_end(SEG))
  se[0, 4:8] = 8
  se = jnp.asarray(se)
  tree = lambda cfg: lambda q, k, v: attention.packed_attention(
      q, k, v, SEG, POS, window=None, impl="auto", subtree_end_BxS=se,
      tree_config=cfg)
  got = _value_and_grads(tree(None))
  _assert_close(got, _value_and_grads(
      lambda q, k, v: _dense(q, k, v, None, subtree_end=se)))
  # Lowered for a row longer than the blockwise tiles (512): no [L, L].
  L = 1536
  seg_long = jnp.ones((1, L), jnp.int32)
  pos_long = jnp.arange(L, dtype=jnp.int32)[None]
  se_long = chain_subtree_end(seg_long)
  def lowered(cfg):
    f = lambda q, k, v: attention.packed_attention(
        q, k, v, seg_long, pos_long, window=None, impl="auto",
        subtree_end_BxS=se_long, tree_config=cfg)
    spec = lambda heads: jax.ShapeDtypeStruct((1, L, heads, H), jnp.float32)
    return jax.jit(f).lower(spec(N), spec(K), spec(K)).as_text()
  assert not _big_arrays(lowered(None), L, 10**9)
  assert (1, L, L) in _big_arrays(
      lowered(TreeAttentionConfig(backend="xla")), L, 10**9)


def _assert_scaled(got, want, tol):
  """|got - want| <= tol * max|want|, leaf by leaf (bf16-sized errors on
  small gradients)."""
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.max(np.abs(g - w)) <= tol * np.max(np.abs(w)), (g, w)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5),
                                        (jnp.bfloat16, 2e-2)])
def test_chunked_losses_equal_whole_rows(dtype, tol):
  """Both chunked losses, 7 positions a chunk (which do not divide 40), on
  padded and partly masked rows with float32 or bfloat16 features: a
  weighted CE + z-loss objective, its gradients of features, lm_head and
  the CE weight, and the metrics (CE, log-sum-exp, argmax) equal those of
  the whole-row logits; the fused loss's undifferentiated values too."""
  V, D, Z = 50, 16, 0.05
  f = jnp.asarray(_R.normal(size=(B, T, D)), dtype)
  w = jnp.asarray(_R.normal(size=(D, V)) / 4, jnp.float32)
  tgt = jnp.asarray(_R.integers(0, V, (B, T)), jnp.int32)
  mask = (SEG != 0) & jnp.asarray(_R.random((B, T)) < 0.8)

  def objective(ce, lse, pred, a):
    return a * jnp.sum(ce) + Z * jnp.sum(lse ** 2), (ce, lse, pred)

  def whole(f, w, a):
    logits = jnp.einsum("btd,dv->btv", f, w.astype(f.dtype),
                        preferred_element_type=jnp.float32)
    return objective(*losses.cross_entropy(logits, tgt, mask),
                     jnp.argmax(logits, -1), a)

  def recompute(f, w, a):
    return objective(*losses.chunked_cross_entropy(f, w, tgt, mask, chunk=7),
                     a)

  def fused(f, w, a):
    loss, *metrics = losses.fused_cross_entropy(f, w, tgt, mask, ce_weight=a,
                                                z_weight=Z, chunk=7)
    return loss, tuple(metrics)

  run = jax.jit(lambda f, w, a: (
      [jax.value_and_grad(fn, (0, 1, 2), has_aux=True)(f, w, a)
       for fn in (whole, recompute, fused)], fused(f, w, a)))
  results, plain = run(f, w, jnp.float32(0.7))
  (want, want_grads) = results[0]
  for (loss, metrics), grads in results[1:] + [(plain, want_grads)]:
    _assert_close([loss, *metrics[:2]], [want[0], *want[1][:2]],
                  tol=max(tol / 10, 2e-5))
    np.testing.assert_array_equal(metrics[2], want[1][2])
    assert grads[0].dtype == dtype
    _assert_scaled(grads, want_grads, tol)


def test_one_pass_stats_equal_logsumexp_and_argmax():
  """The fused loss's one-pass reduction (running max, rescaled sum of
  exps, first index of the max) equals jax.nn.logsumexp and jnp.argmax,
  ties (the first index wins, as in jnp.argmax) and logits far apart
  included."""
  logits = jnp.asarray(_R.normal(size=(3, 5, 300)) * 30, jnp.float32)
  logits = logits.at[0, :, 7].set(500.0).at[0, :, 200].set(500.0)
  logits = logits.at[1, 2].set(-1e30).at[1, 2, 299].set(-1e30 + 1e24)
  tgt = jnp.asarray(_R.integers(0, 300, (3, 5)), jnp.int32)
  lse, picked, pred = jax.jit(losses._one_pass_stats)(logits, tgt)
  np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, -1), rtol=1e-6)
  np.testing.assert_array_equal(pred, jnp.argmax(logits, -1))
  np.testing.assert_array_equal(
      picked, jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])
  assert np.all(np.asarray(pred[0]) == 7)


TINY = config_lib.TINY.replace(attention_pattern=("sliding", "full"),
                               sliding_window=64)


def _batch(T_, seed=0):
  rng = np.random.default_rng(seed)
  seg = np.where(np.arange(T_) < T_ // 3, 1, 2).astype(np.int32)
  pos = np.arange(T_) - np.where(seg == 1, 0, T_ // 3)
  return {"tokens": jnp.asarray(rng.integers(0, TINY.vocab_size, (1, T_)),
                                jnp.int32),
          "segment_ids": jnp.asarray(seg[None]),
          "positions": jnp.asarray(pos[None], jnp.int32),
          "num_bytes": jnp.asarray([T_], jnp.int32)}


def test_total_loss_from_head_inputs_equals_the_logits_path():
  """The model's head inputs and weight (forward(logits=False)) give its
  logits, main and MTP; from them total_loss gives the same loss, metrics
  (MTP CE and acceptance, z-loss) and gradients as from whole logits."""
  cfg = TINY.replace(num_layers=1)
  variables = model.init(cfg, jax.random.key(0))
  batch = _batch(48)
  fwd = jax.jit(lambda v, logits: model.forward(
      cfg, v, batch["tokens"], segment_ids=batch["segment_ids"],
      positions=batch["positions"], mtp_depth=1, logits=logits),
                static_argnums=1)
  full, heads = fwd(variables, True), fwd(variables, False)
  assert heads.logits is None and len(heads.mtp_logits) == 1
  for x, logits in zip(heads.head_inputs, (full.logits,) + full.mtp_logits):
    _assert_close([x @ heads.lm_head], [logits], tol=1e-4)

  # The loss on model-shaped outputs, differentiated in features and head.
  f = [x.astype(jnp.float32) for x in heads.head_inputs]
  w = heads.lm_head

  # Fine-tuning's mask drops every third target besides the segments'.
  batch["loss_mask"] = jnp.asarray(np.arange(48)[None] % 3 != 0)

  @functools.partial(jax.jit, static_argnums=(2, 3))
  def loss(f, w, chunk, impl):
    if chunk:
      out = heads._replace(head_inputs=tuple(f), lm_head=w)
    else:
      out = heads._replace(logits=f[0] @ w, mtp_logits=(f[1] @ w,))
    return losses.total_loss(out, batch, mtp_weight=0.3, aux_coef=0.0,
                             z_coef=1e-3, chunk=chunk or 1, impl=impl)

  grad = jax.value_and_grad(loss, (0, 1), has_aux=True)
  (l0, m0), g0 = grad(f, w, 0, "fused")
  for impl in ("fused", "recompute"):
    (l1, m1), g1 = grad(f, w, 5, impl)
    assert set(m0) == set(m1) and {"mtp/acceptance_1", "z_loss"} <= set(m0)
    _assert_close([l1] + [m1[k] for k in sorted(m0)],
                  [l0] + [m0[k] for k in sorted(m0)])
    _assert_close(jax.tree.leaves(g1), jax.tree.leaves(g0))


def _big_arrays(hlo: str, length: int, vocab: int):
  """Shapes in `hlo` with two dimensions >= length, or with the vocabulary
  as a dimension and length x vocab elements or more (whole-row logits, or
  every chunk's logits stacked)."""
  found = set()
  for dims in re.findall(r"tensor<((?:\d+x)+)[a-z]", hlo):
    d = [int(x) for x in dims.rstrip("x").split("x")]
    if sum(x >= length for x in d) >= 2 or (
        vocab in d and np.prod(d) >= length * vocab):
      found.add(tuple(d))
  return found


def _lm_head_matmuls(hlo: str, vocab: int) -> int:
  """dot_generals in `hlo` with the vocabulary as a dimension of an operand
  or of the result."""
  return sum(1 for line in hlo.splitlines() if "stablehlo.dot_general" in line
             and re.search(rf"[<x]{vocab}x", line))


def test_long_row_train_step_has_no_t_by_t_array():
  """The lowered train step of a row of 4096 tokens (a sliding and a full
  layer, MTP) holds no [T, T] array and no [T, V] logits, and its loss
  multiplies by lm_head three times per head (fused: the forward's logits,
  d features and d lm_head; no recomputed logits). The dense-mask attention
  and whole-row logits, asked for, hold those arrays, and the recomputing
  loss has a fourth matmul (the checks see them)."""
  length = 4096
  batch = _batch(length)

  def hlo(mcfg, mtp_depth):
    tcfg = TrainConfig(steps=10, mtp_depth=mtp_depth)
    state = jax.eval_shape(lambda: state_lib.create_state(mcfg, tcfg))
    fn = jax.jit(lambda s, b: step_lib.train_step(
        s, b, model_config=mcfg, train_config=tcfg))
    return fn.lower(state, batch).as_text()

  fused = hlo(TINY, 1)
  assert not _big_arrays(fused, length, TINY.vocab_size)
  assert _lm_head_matmuls(fused, TINY.vocab_size) == 3 * 2
  recompute = TINY.replace(num_layers=1,
                           settings=Settings(loss_impl="recompute"))
  assert _lm_head_matmuls(hlo(recompute, 0), TINY.vocab_size) == 4
  dense = TINY.replace(num_layers=1, attention_pattern=("full",),
                       settings=Settings(attention="xla", loss_chunk=0))
  found = _big_arrays(hlo(dense, 0), length, TINY.vocab_size)
  assert (1, length, length) in found and (1, length, TINY.vocab_size) in found
