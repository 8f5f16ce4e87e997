"""Model semantics on tiny shapes: causality, GQA, RoPE, routing, MoE, MTP."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.model import attention, layers, moe

CFG = config_lib.TINY.replace(num_layers=2, num_mtp_modules=2)


@functools.lru_cache(maxsize=None)
def _variables(cfg, seed=0):
  v = model.init(cfg, jax.random.key(seed))
  # Non-zero bias so the routing path with a bias is exercised.
  return jax.tree_util.tree_map_with_path(
      lambda p, x: (jax.random.normal(jax.random.key(7), x.shape) * 0.1
                    if p[0].key == model.EXPERT_BIAS else x), v)


@functools.lru_cache(maxsize=None)
def _forward(cfg, mtp_depth=0):
  return jax.jit(functools.partial(model.forward, cfg, mtp_depth=mtp_depth))


def _tokens(shape, seed=1, vocab=CFG.vocab_size):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def test_shapes_and_dtypes():
  v = _variables(CFG)
  tok = _tokens((2, 12))
  out = _forward(CFG, 2)(v, tok)
  chex.assert_shape(out.logits, (2, 12, CFG.vocab_size))
  assert out.logits.dtype == jnp.float32
  assert len(out.mtp_logits) == 2
  chex.assert_shape(out.routing.load_E, (CFG.num_layers, CFG.num_experts))
  # Every valid token makes top_k assignments in every layer.
  np.testing.assert_allclose(out.routing.load_E.sum(-1),
                             2 * 12 * CFG.num_experts_per_tok)
  chex.assert_tree_all_finite(out)


# ---------------------------------------------------------------------------
# An independent float64 forward pass (SPEC §1 "Forward"), one row at a time.

def _np_rms(x, scale, eps, ndim=1):
  axes = tuple(range(x.ndim - ndim, x.ndim))
  return x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps) * scale


def _np_rope(x_TxNxH, pos_T, rd, theta):
  half = rd // 2
  angle = pos_T[:, None] * theta ** (-2 * np.arange(half) / rd)
  cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
  x1, x2 = x_TxNxH[..., :half], x_TxNxH[..., half:rd]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin,
                         x_TxNxH[..., rd:]], axis=-1)


def _np_block(cfg, p, bias_E, x_TxD, seg_T, pos_T):
  eps, N, K, H = (cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
                  cfg.head_dim)
  a, T = p["attn"], x_TxD.shape[0]
  h = _np_rms(x_TxD, p["attn_norm"]["scale"], eps)
  q = np.einsum("td,dnh->tnh", h, a["q_proj"])
  k = np.einsum("td,dkh->tkh", h, a["k_proj"])
  v = np.einsum("td,dkh->tkh", h, a["v_proj"])
  q = _np_rms(q, a["q_norm"]["scale"], eps, ndim=2)  # the whole projection
  k = _np_rms(k, a["k_norm"]["scale"], eps, ndim=2)
  q = _np_rope(q, pos_T, cfg.rotary_dim, cfg.rope_theta)
  k = _np_rope(k, pos_T, cfg.rotary_dim, cfg.rope_theta)
  allowed = np.tril(np.ones((T, T), bool)) & (seg_T[:, None] == seg_T[None])
  o = np.zeros((T, N, H))
  for n in range(N):
    kv = n // (N // K)
    s = np.where(allowed, q[:, n] @ k[:, kv].T / np.sqrt(H), -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o[:, n] = w / w.sum(-1, keepdims=True) @ v[:, kv]
  x = x_TxD + np.einsum("tnh,nhd->td", o, a["o_proj"])
  h = _np_rms(x, p["ffn_norm"]["scale"], eps)
  m = p["moe"]
  scores = 1 / (1 + np.exp(-(h @ m["router"])))
  y = np.zeros_like(h)
  for t in range(T):
    chosen = np.argsort(-(scores[t] + bias_E))[:cfg.num_experts_per_tok]
    w = scores[t, chosen] / scores[t, chosen].sum() * cfg.routed_scaling_factor
    for e, we in zip(chosen, w):
      g, u = h[t] @ m["w1"][e], h[t] @ m["w3"][e]
      y[t] += we * ((g / (1 + np.exp(-g)) * u) @ m["w2"][e])
  return x + y


def _np_forward(cfg, variables, tokens_T, seg_T, mtp_depth):
  """(logits [T, V], [MTP logits [T, V]] * mtp_depth) in float64."""
  f64 = lambda t: {k: f64(x) if isinstance(x, dict) else
                   np.asarray(x, np.float64) for k, x in t.items()}
  p, bias = f64(variables["params"]), f64(variables[model.EXPERT_BIAS])
  idx = np.arange(len(seg_T))
  starts = np.r_[True, seg_T[1:] != seg_T[:-1]]
  pos = idx - np.maximum.accumulate(np.where(starts, idx, 0))
  eps = cfg.rms_norm_eps
  head = lambda h: _np_rms(h, p["final_norm"]["scale"], eps) @ p["lm_head"]
  x = p["embedding"][tokens_T]
  for i in range(cfg.num_layers):
    x = _np_block(cfg, p[f"layers_{i}"], bias[f"layers_{i}"]["moe"]["bias"],
                  x, seg_T, pos)
  logits, mtp, h = head(x), [], x
  for k in range(1, mtp_depth + 1):
    m, b = p[f"mtp_{k - 1}"], bias[f"mtp_{k - 1}"]
    ahead = np.r_[tokens_T[k:], np.zeros(k, int)]
    h = np.concatenate(
        [_np_rms(p["embedding"][ahead], m["embed_norm"]["scale"], eps),
         _np_rms(h, m["hidden_norm"]["scale"], eps)], axis=-1) @ m["proj"]
    for j in range(cfg.mtp_transformer_layers):
      h = _np_block(cfg, m[f"block_{j}"], b[f"block_{j}"]["moe"]["bias"], h,
                    seg_T, pos)
    mtp.append(head(h))
  return logits, mtp


def test_forward_matches_float64_numpy_reference():
  """Logits and MTP logits of packed rows (two documents and padding; one
  whole row) against the reference above. Weights are scaled so attention,
  RoPE, norms gains and routing all matter: each of full-head RoPE, per-head
  QK norm, biased combine weights, GQA as h % KV, no segment mask, a swapped
  MTP concat or a wrong MTP shift moves the logits by > 0.4 (tolerance
  2e-5). The HF parity tests (test_hf.py) cover the main model against HF
  but never MTP or packed segments."""
  cfg = CFG
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)

  def fill(path, s):
    if path[-1].key == "scale":
      return jnp.asarray(1 + 0.3 * rng.normal(size=s.shape), s.dtype)
    std = {"embedding": 1.0, "bias": 0.3}.get(path[-1].key, 0.15)
    return jnp.asarray(rng.normal(0, std, s.shape), s.dtype)
  v = jax.tree_util.tree_map_with_path(fill, shapes)
  tok = np.asarray(_tokens((2, 12), seed=11))
  seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12])
  out = _forward(cfg, 2)(v, jnp.asarray(tok), segment_ids=jnp.asarray(seg))
  for b in range(2):
    ref, ref_mtp = _np_forward(cfg, v, tok[b], seg[b], 2)
    ok = seg[b] != 0
    np.testing.assert_allclose(np.asarray(out.logits[b])[ok], ref[ok],
                               atol=2e-5)
    for k in (1, 2):   # positions whose token t + k is in t's document
      ok_k = ok & (np.r_[seg[b][k:], [-1] * k] == seg[b])
      np.testing.assert_allclose(np.asarray(out.mtp_logits[k - 1][b])[ok_k],
                                 ref_mtp[k - 1][ok_k], atol=2e-5)


def test_causality_by_gradient():
  """d logits[t] / d embedding of a token placed after t is exactly zero."""
  cfg = CFG
  v = _variables(cfg)
  T = 10
  tok = jnp.arange(T)[None] + 3  # distinct tokens: one embedding row each
  t = 4

  def f(emb):
    params = dict(v["params"], embedding=emb)
    return model.logits(cfg, dict(v, params=params), tok)[0, t].sum()

  g = jax.jit(jax.grad(f))(v["params"]["embedding"])  # one compile
  row_norm = jnp.abs(g[tok[0]]).sum(-1)
  assert np.all(np.asarray(row_norm[t + 1:]) == 0.0)
  assert np.all(np.asarray(row_norm[:t + 1]) > 0.0)


def test_gqa_head_mapping():
  """Query head h reads KV head h // (H / KV)."""
  B, T, N, K, H = 2, 5, 6, 2, 8
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, T, K, H))
  v = jax.random.normal(keys[2], (B, T, K, H))
  mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
  out = attention.dot_product_attention_xla(q, k, v, mask)
  for h in range(N):
    kv = h // (N // K)
    s = jnp.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kv]) / np.sqrt(H)
    s = jnp.where(mask, s, -jnp.inf)
    ref = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v[:, :, kv])
    np.testing.assert_allclose(out[:, :, h], ref, atol=1e-5)


def test_partial_rope_matches_direct_formula():
  B, T, N, H, rd, theta = 1, 7, 3, 12, 8, 100.0
  x = np.asarray(jax.random.normal(jax.random.key(0), (B, T, N, H)))
  pos = np.array([[0, 1, 2, 5, 9, 30, 100]])
  out = np.asarray(layers.apply_partial_rope(jnp.asarray(x), jnp.asarray(pos),
                                             rd, theta))
  ref = x.copy()
  half = rd // 2
  for t in range(T):
    for i in range(half):
      a = pos[0, t] * theta ** (-2 * i / rd)
      x1, x2 = x[0, t, :, i], x[0, t, :, i + half]
      ref[0, t, :, i] = x1 * np.cos(a) - x2 * np.sin(a)
      ref[0, t, :, i + half] = x2 * np.cos(a) + x1 * np.sin(a)
  np.testing.assert_allclose(out, ref, atol=1e-5)
  np.testing.assert_array_equal(out[..., rd:], x[..., rd:])


def test_router_bias_chooses_but_never_weights():
  # One token, identity router: gate logits are the token's features.
  x = jnp.array([[0.0, 1.0, 2.0, -1.0]])
  router = jnp.eye(4)
  s = jax.nn.sigmoid(x[0])
  plain = moe.route(x, router, None, top_k=2, gating="sigmoid", scaling=1.0)
  assert set(np.asarray(plain.experts_TxK[0])) == {1, 2}
  np.testing.assert_allclose(
      sorted(np.asarray(plain.weights_TxK[0])),
      sorted([s[1] / (s[1] + s[2]), s[2] / (s[1] + s[2])]), rtol=1e-6)

  bias = jnp.array([5.0, 0.0, 0.0, 0.0])
  biased = moe.route(x, router, bias, top_k=2, gating="sigmoid", scaling=1.0)
  chosen = list(np.asarray(biased.experts_TxK[0]))
  assert set(chosen) == {0, 2}
  expected = {0: s[0] / (s[0] + s[2]), 2: s[2] / (s[0] + s[2])}
  for e, w in zip(chosen, np.asarray(biased.weights_TxK[0])):
    np.testing.assert_allclose(w, expected[e], rtol=1e-6)
  np.testing.assert_allclose(biased.scores_TxE, plain.scores_TxE)


def test_routing_scaling_and_softmax_gating():
  x = jax.random.normal(jax.random.key(0), (5, 4))
  router = jax.random.normal(jax.random.key(1), (4, 6))
  r = moe.route(x, router, None, top_k=3, gating="softmax", scaling=2.5)
  np.testing.assert_allclose(r.weights_TxK.sum(-1), 2.5, rtol=1e-6)
  np.testing.assert_allclose(r.scores_TxE.sum(-1), 1.0, rtol=1e-6)


def test_moe_equals_dense_per_expert_loop():
  cfg = CFG
  D, E = cfg.hidden_size, cfg.num_experts
  mod = moe.MoE(cfg)
  x = jax.random.normal(jax.random.key(3), (2, 6, D))
  seg = jnp.ones((2, 6), jnp.int32)
  valid = seg != 0
  v = nn.meta.unbox(jax.jit(mod.init)(jax.random.key(4), x, seg, valid))
  v = {"params": v["params"],
       "expert_bias": {"bias": jax.random.normal(jax.random.key(5), (E,))}}
  y, _ = jax.jit(mod.apply)(v, x, seg, valid)

  p, bias = v["params"], v["expert_bias"]["bias"]
  xt = np.asarray(x.reshape(-1, D), np.float64)
  scores = 1 / (1 + np.exp(-(xt @ np.asarray(p["router"], np.float64))))
  ref = np.zeros_like(xt)
  for t in range(xt.shape[0]):
    chosen = np.argsort(-(scores[t] + np.asarray(bias)))[:cfg.num_experts_per_tok]
    w = scores[t, chosen] / scores[t, chosen].sum()
    for e, we in zip(chosen, w):
      w1, w3, w2 = (np.asarray(p[n][e], np.float64) for n in ("w1", "w3", "w2"))
      a, b = xt[t] @ w1, xt[t] @ w3
      ref[t] += we * ((a / (1 + np.exp(-a)) * b) @ w2)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), ref, atol=1e-5)


def test_expert_bias_update_rule():
  load = jnp.array([[10.0, 2.0, 6.0, 6.0]])
  bias = jnp.zeros((1, 4))
  new = model.update_expert_bias(bias, load, 0.01)
  np.testing.assert_allclose(new, [[-0.01, 0.01, 0.0, 0.0]])


def test_bias_update_balances_load():
  """Repeated updates from the model's own load statistics reduce imbalance."""
  cfg = CFG.replace(num_mtp_modules=0, bias_update_rate=0.01)
  v = jax.tree.map(lambda x: x, _variables(cfg))  # a copy we may mutate
  tok = _tokens((4, 32), seed=9)
  fwd = _forward(cfg)

  def cv(load):
    return float(jnp.mean(jnp.std(load, -1) / jnp.mean(load, -1)))

  start = cv(fwd(v, tok).routing.load_E)
  for _ in range(20):
    load = fwd(v, tok).routing.load_E
    for i in range(cfg.num_layers):
      b = v["expert_bias"][f"layers_{i}"]["moe"]["bias"]
      v["expert_bias"][f"layers_{i}"]["moe"]["bias"] = model.update_expert_bias(
          b, load[i], cfg.bias_update_rate)
  assert cv(fwd(v, tok).routing.load_E) < 0.5 * start


def test_segment_isolation_and_padding():
  """Packed documents give the same logits as each document alone."""
  cfg = CFG
  v = _variables(cfg)
  a, b = _tokens((1, 5), seed=2), _tokens((1, 6), seed=3)
  fwd = _forward(cfg)
  alone_a, alone_b = fwd(v, a).logits, fwd(v, b).logits
  packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], axis=1)
  seg = jnp.array([[1] * 5 + [2] * 6 + [0] * 3])
  out = fwd(v, packed, segment_ids=seg)
  np.testing.assert_allclose(out.logits[:, :5], alone_a, atol=1e-5)
  np.testing.assert_allclose(out.logits[:, 5:11], alone_b, atol=1e-5)
  # Padding is excluded from the routing load.
  np.testing.assert_allclose(out.routing.load_E.sum(-1),
                             11 * cfg.num_experts_per_tok)


def test_mtp_depth_k_sees_exactly_tokens_up_to_t_plus_k():
  """Depth k at position t predicts token t+k+1, so it may read t+k, not t+k+1."""
  cfg = CFG
  v = _variables(cfg)
  fwd = _forward(cfg, 2)
  tok = _tokens((1, 12), seed=4)
  base = fwd(v, tok).mtp_logits
  t = 3
  for k in (1, 2):
    seen = tok.at[0, t + k].set((tok[0, t + k] + 1) % cfg.vocab_size)
    unseen = tok.at[0, t + k + 1].set((tok[0, t + k + 1] + 1) % cfg.vocab_size)
    changed = fwd(v, seen).mtp_logits[k - 1]
    same = fwd(v, unseen).mtp_logits[k - 1]
    assert not np.allclose(changed[0, t], base[k - 1][0, t], atol=1e-6)
    np.testing.assert_allclose(same[0, : t + 1], base[k - 1][0, : t + 1],
                               atol=1e-6)


def test_mtp_missing_params_is_a_clear_error():
  v = _variables(CFG)
  params = {k: x for k, x in v["params"].items() if not k.startswith("mtp_")}
  with pytest.raises(ValueError, match="MTP modules"):
    model.forward(CFG, dict(v, params=params), _tokens((1, 4)), mtp_depth=1)
  # Without MTP the same variables still give logits.
  _forward(CFG)(dict(v, params=params), _tokens((1, 4)))


def _brute_mask(seg, pos, window, sinks):
  T = len(seg)
  m = np.zeros((T, T), bool)
  for i in range(T):
    for j in range(T):
      ok = j <= i and seg[i] == seg[j]
      if window is not None:
        ok = ok and (pos[i] - pos[j] < window or pos[j] < sinks)
      m[i, j] = ok
  return m


@pytest.mark.parametrize("window,sinks", [(None, 0), (3, 0), (3, 2), (1, 1)])
def test_attention_mask(window, sinks):
  seg = np.array([1, 1, 1, 1, 1, 1, 2, 2, 2, 0])
  pos = np.asarray(layers.positions_from_segments(jnp.asarray(seg[None])))[0]
  np.testing.assert_array_equal(pos, [0, 1, 2, 3, 4, 5, 0, 1, 2, 0])
  got = attention.attention_mask(jnp.asarray(seg[None]), jnp.asarray(pos[None]),
                                 window=window, num_sink_tokens=sinks)[0]
  np.testing.assert_array_equal(got, _brute_mask(seg, pos, window, sinks))


def test_sliding_window_layer_differs_only_beyond_window():
  full = CFG.replace(num_mtp_modules=0)
  swa = full.replace(attention_pattern=("sliding", "full"), sliding_window=4)
  v = _variables(full)
  tok = _tokens((1, 10), seed=5)
  a, b = _forward(full)(v, tok).logits, _forward(swa)(v, tok).logits
  np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-5)
  assert not np.allclose(a[:, 4:], b[:, 4:], atol=1e-4)


def test_dense_ffn_variant_and_bf16():
  cfg = CFG.replace(ffn_type="dense", dense_intermediate_size=48,
                    num_mtp_modules=0)
  v = model.init(cfg, jax.random.key(0))
  assert "mlp" in v["params"]["layers_0"] and "expert_bias" not in v
  tok = _tokens((1, 6))
  out = _forward(cfg)(v, tok)
  assert out.routing is None

  # The FFN itself against w2(silu(w1 x) * w3 x) in float64, with weights
  # large enough that silu is far from linear.
  D, F = cfg.hidden_size, cfg.dense_intermediate_size
  rng = np.random.default_rng(0)
  w1, w3 = (rng.normal(0, 1.5 / np.sqrt(D), (D, F)) for _ in range(2))
  w2 = rng.normal(0, 1 / np.sqrt(F), (F, D))
  x = rng.normal(size=(2, 5, D))
  silu = lambda a: a / (1 + np.exp(-a))
  ref = silu(x @ w1) * (x @ w3) @ w2
  params = {"params": {n: jnp.asarray(w, jnp.float32)
                       for n, w in (("w1", w1), ("w3", w3), ("w2", w2))}}
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b)
                           / np.linalg.norm(b))
  ffn = lambda c: moe.DenseFFN(c).apply(params, jnp.asarray(x, jnp.float32))
  assert rel(ffn(cfg), ref) < 1e-5
  # bf16 compute: about 2^-8 relative rounding; a wrong FFN is far outside.
  bf = cfg.replace(compute_dtype="bfloat16")
  assert rel(ffn(bf), ref) < 2e-2
  for wrong in (silu(x @ w3) * (x @ w1) @ w2,        # gate and up swapped
                (x @ w1) * (x @ w3) @ w2,            # no silu
                silu(x @ w1) @ w2):                  # no up projection
    assert rel(wrong, ref) > 0.3

  # Whole model, bf16 against float32: dropping the FFN moves the logits by
  # about 0.1 relative, bf16 rounding by about 0.007.
  logits_bf = _forward(bf)(v, tok).logits
  assert rel(logits_bf, np.asarray(out.logits, np.float64)) < 2e-2
  no_ffn = jax.tree_util.tree_map_with_path(
      lambda p, w: jnp.zeros_like(w) if any(
          getattr(k, "key", None) == "mlp" for k in p) else w, v)
  assert rel(_forward(cfg)(no_ffn, tok).logits,
             np.asarray(out.logits, np.float64)) > 5e-2


def test_auto_attention_picks_cudnn_only_for_half_precision_on_a_gpu():
  """cuDNN's fused attention refuses float32: "auto" must fall back to the
  XLA reference for a float32 model on a GPU (the tiny preset loaded by
  sft.load_init there failed before), and to XLA everywhere off a GPU.
  Full layers in half precision on a GPU run the mask-free tree kernels;
  long rows never get a dense [T, T] mask; windows never reach "tree"."""
  pick = attention.attention_impl
  w = dict(window=64)
  assert pick("auto", jnp.bfloat16, "gpu") == "tree"
  assert pick("auto", jnp.bfloat16, "gpu", **w) == "cudnn"
  assert pick("auto", jnp.float16, "gpu", **w) == "cudnn"
  assert pick("auto", jnp.float32, "gpu") == "xla"
  assert pick("auto", jnp.bfloat16, "cpu") == "xla"
  long = dict(length=attention.DENSE_MAX_LEN + 1)
  assert pick("auto", jnp.float32, "cpu", **long) == "blockwise"
  # On a CPU the dense path is the slower one past one blockwise tile.
  cpu_long = dict(length=attention.CPU_DENSE_MAX_LEN + 1)
  assert pick("auto", jnp.float32, "cpu", **cpu_long) == "blockwise"
  assert pick("auto", jnp.float32, "cpu",
              length=attention.CPU_DENSE_MAX_LEN) == "xla"
  assert pick("auto", jnp.bfloat16, "gpu", **w, **cpu_long) == "cudnn"
  assert pick("auto", jnp.bfloat16, "gpu", **w, **long) == "blockwise"
  assert pick("auto", jnp.float32, "gpu", **long) == "blockwise"
  assert pick("cudnn", jnp.float32, "gpu") == "cudnn"   # asked for: kept
  assert pick("xla", jnp.bfloat16, "gpu", **long) == "xla"
  assert pick("tree", jnp.bfloat16, "gpu", **w) == "blockwise"
  assert pick("xla", jnp.float32, "cpu", tree=True) == "tree"


def test_cudnn_mask_gets_every_head_only_under_vmap(monkeypatch):
  """JAX's batching rule for cuDNN attention reshapes a mapped mask to
  [V * B, N, T, S] and fails on a one-head mask (a vmapped sweep with a
  sliding-window layer crashed on a GPU). The mask cuDNN sees: one head
  unmapped, every head under vmap (also under grad), same values. cuDNN
  itself is replaced by the XLA implementation (no GPU here)."""
  seen = []
  real = jax.nn.dot_product_attention

  def fake(q, k, v, *, mask, implementation):
    assert implementation == "cudnn"
    seen.append(mask.shape)
    return real(q, k, v, mask=mask, implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
  B, T, N, K, H, V = 2, 8, 4, 2, 16, 3
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (V, B, T, N, H))
  k, v = (jax.random.normal(x, (V, B, T, K, H)) for x in keys[1:])
  pos = jnp.arange(T)
  mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 3)
  masks = jnp.stack([jnp.broadcast_to(mask, (B, T, T)) & (pos < T - i)
                     for i in range(V)])   # [V, B, T, T], mapped
  attend = functools.partial(attention.dot_product_attention, impl="cudnn")
  want = jax.vmap(functools.partial(attention.dot_product_attention,
                                    impl="xla"))(q, k, v, masks)
  got = jax.vmap(attend)(q, k, v, masks)
  assert seen[-1] == (B, N, T, T)
  np.testing.assert_allclose(got, want, atol=1e-5)
  grad = jax.jit(jax.vmap(jax.grad(lambda q, m: attend(q, k[0], v[0], m)
                                   .sum())))(q, masks)
  assert seen[-1] == (B, N, T, T) and grad.shape == q.shape
  attend(q[0], k[0], v[0], masks[0])   # unmapped: the shared one-head mask
  assert seen[-1] == (B, 1, T, T)
  jax.vmap(attend, in_axes=(0, 0, 0, None))(q, k, v, masks[0])
  assert seen[-1] == (B, 1, T, T)       # a mask shared by the mapped models


def test_token_copies_gradient_is_a_gather_not_a_scatter_add():
  """moe.token_copies (the dispatch's x[order // K]) equals jnp.take in
  value and gradient, and its gradient has no scatter-add: each token's K
  copies are un-permuted and summed (the GPU ran jnp.take's scatter-add
  with atomics, three quarters of the dispatch's time)."""
  T, K, D = 37, 4, 16
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  order = jnp.argsort(jnp.asarray(rng.integers(0, 8, size=T * K)),
                      stable=True)
  w = jnp.asarray(rng.normal(size=(T * K, D)), jnp.float32)
  inverse = jnp.argsort(order)
  ours = lambda x: jnp.sum(moe.token_copies(K, x, order, inverse) * w)
  take = lambda x: jnp.sum(jnp.take(x, order // K, axis=0) * w)
  np.testing.assert_array_equal(ours(x), take(x))
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(take)(x),
                             rtol=1e-6, atol=1e-6)
  primitives = lambda f: _primitives(jax.make_jaxpr(jax.grad(f))(x).jaxpr)
  assert "scatter-add" in primitives(take)  # what the custom VJP avoids
  assert not {"scatter-add", "scatter_add"} & primitives(ours)


def test_combine_gradient_is_a_gather_not_a_scatter():
  """moe.combine un-permutes the experts' rows by the sort's inverse; its
  gradient gathers by the sort's order (expert_parallel.permute with the
  inverse given) instead of jnp.take's transpose, a scatter the GPU runs
  with atomics. Same values and gradients as x[inverse]."""
  T, K, D, E = 29, 3, 8, 5
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  routing = moe.Routing(None, jnp.asarray(rng.integers(0, E, size=(T, K))),
                        jnp.asarray(rng.random((T, K)), jnp.float32))
  y_sorted, _, sort = moe.dispatch(x, routing, E)
  w = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  ours = lambda y, p: jnp.sum(moe.combine(y, routing._replace(
      weights_TxK=p), sort) * w)
  take = lambda y, p: jnp.sum(jnp.einsum(
      "tkd,tk->td", jnp.take(y, sort.inverse, axis=0).reshape(T, K, D),
      p) * w)
  args = (y_sorted, routing.weights_TxK)
  np.testing.assert_allclose(ours(*args), take(*args), rtol=1e-6)
  # Both gradients: the rows' and the routing weights' (the router learns
  # through the latter).
  for got, want in zip(jax.grad(ours, (0, 1))(*args),
                       jax.grad(take, (0, 1))(*args)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  primitives = lambda f: _primitives(
      jax.make_jaxpr(jax.grad(f, (0, 1)))(*args).jaxpr)
  assert {"scatter-add", "scatter_add", "scatter"} & primitives(take)
  assert not {"scatter-add", "scatter_add", "scatter"} & primitives(ours)


def _primitives(jaxpr) -> set[str]:
  """Every primitive's name in `jaxpr` and the jaxprs nested in it (jit,
  custom_vjp, scan, ...)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          names |= _primitives(inner)
  return names
