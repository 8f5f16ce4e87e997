"""Tree attention: the Pallas kernels (interpret mode) against the reference.

Both Pallas backends: the portable (Triton) kernels on small float32 tiles,
and the Mosaic GPU kernels (bf16, their fixed 128-row programs) in Pallas'
GPU interpreter, plus a CUDA cross-lowering of the Mosaic kernels at model
shapes; the "xla" backend is the reference itself.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import tree_attention as ta

# 16-row tiles keep the interpreter fast and still give several tiles per row.
CFG = ta.TreeAttentionConfig(backend="triton", block_q=16, block_k=16,
                             block_q_dq=16, block_k_dq=16, block_q_dkv=16,
                             block_k_dkv=16, interpret=True)
N, K, H = 4, 2, 16


def random_forest(rng, T, max_pop=3):
  """A random forest in depth-first order: (subtree_end, segment_ids).

  Each new token pops a random number of path tokens (closing branches)
  before becoming a child of the top of the path; an empty path starts a
  new tree, which gets a new segment id.
  """
  parent = np.full(T, -1)
  seg = np.zeros(T, np.int32)
  path, tree = [], 0
  for i in range(T):
    for _ in range(rng.integers(0, max_pop + 1) if rng.random() < 0.3 else 0):
      if path:
        path.pop()
    if not path:
      tree += 1
    parent[i] = path[-1] if path else -1
    seg[i] = tree
    path.append(i)
  end = np.arange(T) + 1
  for i in reversed(range(T)):  # children come after parents in DFS order
    if parent[i] >= 0:
      end[parent[i]] = max(end[parent[i]], end[i])
  return end.astype(np.int32), seg


def _qkv(seed, B, T):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32)
               for n in (N, K, K))


@functools.lru_cache(maxsize=None)
def _fns(shape):
  """Jitted (kernel, reference) forward and gradient functions."""
  del shape  # one cache entry (one compilation) per input shape
  w = jnp.sin(jnp.arange(H, dtype=jnp.float32))

  def grads(fn):
    loss = lambda q, k, v, se, seg: jnp.sum(fn(q, k, v, se, seg) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  kernel = lambda q, k, v, se, seg: ta.tree_attention(q, k, v, se, seg,
                                                      config=CFG)
  ref = ta.tree_attention_reference
  return jax.jit(kernel), jax.jit(ref), grads(kernel), grads(ref)


def _compare(q, k, v, se, seg, atol=2e-5):
  kernel, ref, dkernel, dref = _fns(q.shape)
  np.testing.assert_allclose(kernel(q, k, v, se, seg), ref(q, k, v, se, seg),
                             atol=atol, rtol=1e-5)
  for got, want in zip(dkernel(q, k, v, se, seg), dref(q, k, v, se, seg)):
    np.testing.assert_allclose(got, want, atol=atol * 10, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trees_match_reference(seed):
  """Forward and all three gradients on random forests, ragged T (not a
  multiple of the tile), GQA, several trees (segments) per row."""
  rng = np.random.default_rng(seed)
  B, T = 2, 75
  se, seg = zip(*(random_forest(rng, T) for _ in range(B)))
  q, k, v = _qkv(seed, B, T)
  _compare(q, k, v, jnp.asarray(np.stack(se)), jnp.asarray(np.stack(seg)))


def test_single_chain_is_causal_attention():
  B, T = 2, 75
  q, k, v = _qkv(3, B, T)
  se = jnp.full((B, T), T, jnp.int32)
  out = _fns(q.shape)[0](q, k, v, se, jnp.zeros((B, T), jnp.int32))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      implementation="xla")
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)


def test_chain_subtree_end_packs_documents():
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]])
  np.testing.assert_array_equal(ta.chain_subtree_end(seg),
                                [[3, 3, 3, 5, 5, 6, 8, 8]])
  mask = ta.tree_mask(ta.chain_subtree_end(seg), seg)
  i, j = np.tril_indices(8)
  causal = np.zeros((8, 8), bool)
  causal[i, j] = True
  same = np.asarray(seg[0, :, None] == seg[0, None, :])
  np.testing.assert_array_equal(mask[0], causal & same)


def test_empty_branches_and_rows():
  """Keys nobody may read (subtree_end[j] == j), so some queries see nothing
  at all, and tiles whose lists are empty: zero output, finite gradients,
  still equal to the reference."""
  rng = np.random.default_rng(5)
  B, T = 2, 75
  se, seg = zip(*(random_forest(rng, T, max_pop=6) for _ in range(B)))
  se = np.stack(se)
  hidden = rng.random((B, T)) < 0.3
  se = np.where(hidden, np.arange(T)[None], se).astype(np.int32)
  q, k, v = _qkv(4, B, T)
  se, seg = jnp.asarray(se), jnp.asarray(np.stack(seg))
  _compare(q, k, v, se, seg)
  out = _fns(q.shape)[0](q, k, v, se, seg)
  nothing_visible = ~np.asarray(ta.tree_mask(se, seg)).any(-1)
  assert nothing_visible.any()
  assert np.all(np.asarray(out)[nothing_visible] == 0.0)


def test_ragged_lengths():
  """T below one tile (the other tests use T = 75, not a multiple of 16):
  padded inside the wrapper, padding invisible to real queries."""
  rng = np.random.default_rng(7)
  T = 9
  se, seg = zip(*(random_forest(rng, T) for _ in range(2)))
  q, k, v = _qkv(T, 2, T)
  se, seg = jnp.asarray(np.stack(se)), jnp.asarray(np.stack(seg))
  kernel, ref = _fns(q.shape)[:2]
  np.testing.assert_allclose(kernel(q, k, v, se, seg), ref(q, k, v, se, seg),
                             atol=2e-5, rtol=1e-5)


def test_tile_classes_are_sound_and_skip_branches():
  """live covers every tile with a visible entry, full tiles are entirely
  visible, and sibling branches are skipped (fewer live tiles than causal)."""
  # A GRPO-shaped tree: prompt of 40 tokens, 4 responses of 22.
  T, bq, bk = 128, 16, 8
  se = np.full(T, T, np.int32)
  starts = 40 + 22 * np.arange(4)
  for a in starts:
    se[a:a + 22] = a + 22
  seg = np.ones(T, np.int32)
  live, full = ta.block_classes(jnp.asarray(se[None]), jnp.asarray(seg[None]),
                                bq, bk)
  mask = np.asarray(ta.tree_mask(jnp.asarray(se[None]),
                                 jnp.asarray(seg[None])))[0]
  tiles = mask.reshape(T // bq, bq, T // bk, bk).transpose(0, 2, 1, 3)
  any_t, all_t = tiles.any((2, 3)), tiles.all((2, 3))
  live, full = np.asarray(live[0]), np.asarray(full[0])
  assert np.all(live[any_t]) and np.all(all_t[full])
  assert full.any() and (live & ~full).any()
  causal_tiles = sum(1 for a in range(T // bq) for c in range(T // bk)
                     if c * bk <= a * bq + bq - 1)
  assert live.sum() < causal_tiles
  lists, counts = ta.block_lists(jnp.asarray(live), jnp.asarray(full))
  for row in range(T // bq):
    n_full, n_part = np.asarray(counts[row])
    got = np.asarray(lists[row])
    assert set(got[:n_full]) == set(np.nonzero(full[row])[0])
    assert set(got[n_full:n_full + n_part]) == set(
        np.nonzero(live[row] & ~full[row])[0])


def test_live_entries_counts_visible_pairs():
  rng = np.random.default_rng(3)
  se, seg = random_forest(rng, 40)
  mask = np.asarray(ta.tree_mask(jnp.asarray(se[None]),
                                 jnp.asarray(seg[None])))
  assert ta.live_entries(se[None])[0] == mask.sum()


def _rows_only(fn, start, stop):
  """fn's output with the rows outside start..stop-1 zeroed."""
  def out(*args):
    y = fn(*args)
    i = jnp.arange(y.shape[1])[None, :, None, None]
    return jnp.where((i >= start) & (i < stop), y, 0.0)
  return out


def test_query_rows_compute_only_those_rows():
  """query_rows (a context-parallel shard's queries against the whole row):
  those rows and all three gradients as the reference's with the other
  rows' outputs dropped; the others zero. start/stop are traced."""
  start, stop = 21, 50
  rng = np.random.default_rng(start)
  B, T = 2, 75
  se, seg = zip(*(random_forest(rng, T) for _ in range(B)))
  se, seg = jnp.asarray(np.stack(se)), jnp.asarray(np.stack(seg))
  q, k, v = _qkv(start, B, T)
  w = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

  def run(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  got = jax.jit(lambda a, b: run(lambda q, k, v: ta.tree_attention(
      q, k, v, se, seg, config=CFG, query_rows=(a, b))))(start, stop)
  # The reference compiled whole (one compile, not one per operation).
  want = jax.jit(lambda: run(_rows_only(lambda q, k, v: (
      ta.tree_attention_reference(q, k, v, se, seg)), start, stop)))()
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, atol=2e-4, rtol=1e-4)
  assert not np.asarray(got[0])[:, :start].any()
  assert not np.asarray(got[0])[:, stop:].any()


def test_query_rows_empty_tiles_outside():
  """Tiles with no query row in the range are in no kernel's list."""
  se = jnp.full((1, 64), 64, jnp.int32)
  seg = jnp.ones((1, 64), jnp.int32)
  rows = jnp.array([16, 48])
  live, _ = ta.block_classes(se, seg, 16, 16, rows)
  assert not bool(live[0, 0].any()) and not bool(live[0, 3].any())
  assert bool(live[0, 1, :2].all()) and bool(live[0, 2, :3].all())
  # What the kernels get: no tile of q rows 0-15 or 48-63 in any list.
  for kernel in ("fwd", "dq"):
    _, counts = CFG.lists(se, seg, kernel, rows)
    assert counts[0, :, :].sum(-1).tolist() == [0, 2, 3, 0], kernel
  _, counts = CFG.lists(se, seg, "dkv", rows)  # per k tile: q tiles 1, 2
  assert counts[0].sum(-1).tolist() == [2, 2, 1, 0]


# ------------------------------------------------------------ mosaic GPU ---

# The default Mosaic tiles: forward k tiles of 128, dq and dk/dv tiles of 64.
MOSAIC = ta.TreeAttentionConfig(backend="mosaic", interpret=True)


def test_mosaic_kernels_match_reference():
  """The Mosaic kernels in the GPU interpreter, bf16, GQA 4/2, head dim 128,
  T = 330 (padded to three 128-row programs with up to three 128-wide
  forward k tiles and six 64-wide dq tiles, so the 2-slot ring wraps).
  Row 0: a GRPO-shaped tree (prompt 192, two responses of 37) then a random
  forest in later segments with keys nobody reads. Row 1: a causal chain of
  128 tokens, then tokens nobody reads, so the second program's tile lists
  are empty. Full, partial and empty tiles all occur; forward and the three
  gradients against the float32 reference."""
  rng = np.random.default_rng(11)
  T, Hm = 330, 128
  se_f, seg_f = random_forest(rng, 64, max_pop=6)
  se_f = np.where(rng.random(64) < 0.3, np.arange(64), se_f)
  se0 = np.r_[np.full(192, 266), np.full(37, 229), np.full(37, 266),
              266 + se_f].astype(np.int32)
  seg0 = np.r_[np.ones(266), 1 + seg_f].astype(np.int32)
  se1 = np.r_[np.full(128, 128), np.full(T - 128, 128)].astype(np.int32)
  se = jnp.asarray(np.stack([se0, se1]))
  seg = jnp.asarray(np.stack([seg0, np.ones(T, np.int32)]))
  live, full = ta.block_classes(se[:, :256], seg[:, :256], 128, 64)
  assert bool((live & ~full).any()) and bool(full[0].any())
  assert not bool(live[1, 1].any())  # row 1, second program: empty list
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(kk, (2, T, n, Hm), jnp.bfloat16)
             for kk, n in zip(keys, (N, K, K)))
  w = jax.random.normal(keys[3], (2, T, N, Hm), jnp.float32)

  def run(fn, *args):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    return fn(*args), jax.grad(loss, argnums=(0, 1, 2))(*args)

  got = run(lambda q, k, v: ta.tree_attention(q, k, v, se, seg,
                                              config=MOSAIC), q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  # The reference compiled whole (one compile, not one per operation).
  want = jax.jit(functools.partial(run, lambda q, k, v: (
      ta.tree_attention_reference(q, k, v, se, seg))))(*f32)
  causal = jax.nn.dot_product_attention(*(x[1:, :128] for x in f32),
                                        is_causal=True, implementation="xla")
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b)
                           / jnp.linalg.norm(b))
  assert rel(got[0][1:, :128], causal) < 1e-2
  assert rel(got[0], want[0]) < 1e-2
  for g, r in zip(got[1], want[1]):
    assert rel(g, r) < 2e-2, (rel(g, r))
  nothing_visible = ~np.asarray(ta.tree_mask(se, seg)).any(-1)
  assert nothing_visible[1, 128:].all() and nothing_visible[0, 266:].any()
  assert np.all(np.asarray(got[0], np.float32)[nothing_visible] == 0.0)


@pytest.mark.parametrize("tiles", [dict(), dict(mosaic_block_k_dq=128),
                                   dict(mosaic_block_k=64, mosaic_stages=3)])
def test_mosaic_kernels_lower_for_cuda(tiles):
  """Forward and backward lower to Mosaic GPU for CUDA at model shapes
  (GQA 8/2, head dim 128, bf16) on a CPU-only host, for the benchmark's tile
  configs: catches ops with no Mosaic lowering (e.g. an unoptimised load
  layout) and tiles that overflow shared memory, without a GPU."""
  T, Hm = 512, 128
  se = jnp.asarray(np.r_[np.full(128, T), np.repeat([256, 384, 512], 128)],
                   jnp.int32)[None]
  spec = lambda n: jax.ShapeDtypeStruct((1, T, n, Hm), jnp.bfloat16)
  cfg = ta.TreeAttentionConfig(backend="mosaic", **tiles)

  def f(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: ta.tree_attention(q, k, v, se,
                                                         config=cfg), q, k, v)
    return (out,) + vjp(do)
  text = jax.jit(f).trace(spec(8), spec(2), spec(2), spec(8)).lower(
      lowering_platforms=("cuda",)).as_text()
  # forward, dq, dk/dv: three Mosaic GPU kernels, no fallback
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


def test_backend_choice(monkeypatch):
  bf16, f32 = jnp.bfloat16, jnp.float32
  resolve = lambda cfg, *a: ta._resolve_backend(cfg, *a).backend
  auto = ta.TreeAttentionConfig()
  interpreted = ta.TreeAttentionConfig(interpret=True)
  monkeypatch.setattr(ta, "_on_gpu", lambda: False)
  assert resolve(auto, (bf16,) * 3, 128) == "xla"  # no GPU: the reference
  assert resolve(interpreted, (bf16,) * 3, 128) == "triton"
  monkeypatch.setattr(ta, "_on_gpu", lambda: True)
  monkeypatch.setattr(ta, "_on_hopper", lambda: True)
  assert resolve(auto, (bf16,) * 3, 128) == "mosaic"
  assert resolve(auto, (f32,) * 3, 128) == "triton"
  assert resolve(auto, (bf16,) * 3, 256) == "triton"
  assert resolve(auto, (bf16, bf16, f32), 128) == "triton"
  assert resolve(auto, (bf16,) * 3, 128, -1.0) == "triton"
  assert resolve(interpreted, (bf16,) * 3, 128) == "triton"
  assert resolve(ta.TreeAttentionConfig(backend="xla"), (bf16,) * 3, 128) == (
      "xla")
  monkeypatch.setattr(ta, "_on_hopper", lambda: False)
  assert resolve(auto, (bf16,) * 3, 128) == "triton"
  mosaic = ta.TreeAttentionConfig(backend="mosaic")
  with pytest.raises(ValueError, match="head_dim 64 or 128"):
    resolve(mosaic, (f32,) * 3, 128)
  with pytest.raises(ValueError, match="head_dim=256"):
    resolve(mosaic, (bf16,) * 3, 256)
  with pytest.raises(ValueError, match="backend must be one of"):
    ta.TreeAttentionConfig(backend="cuda")
  with pytest.raises(ValueError, match="mosaic_block_k must be 64 or 128"):
    ta.TreeAttentionConfig(mosaic_block_k=32)
  with pytest.raises(ValueError, match="mosaic_stages_dkv must be >= 1"):
    ta.TreeAttentionConfig(mosaic_stages_dkv=0)
  with pytest.raises(ValueError, match="interpret must be True or False"):
    ta.TreeAttentionConfig(interpret=None)


def test_xla_backend_is_the_reference():
  """backend="xla" runs the dense reference (float32 softmax), gradients by
  JAX, on the tests' random forests."""
  rng = np.random.default_rng(2)
  B, T = 2, 40
  se, seg = zip(*(random_forest(rng, T) for _ in range(B)))
  se, seg = jnp.asarray(np.stack(se)), jnp.asarray(np.stack(seg))
  q, k, v = _qkv(2, B, T)
  cfg = ta.TreeAttentionConfig(backend="xla")
  loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
  xla = jax.jit(lambda q, k, v: ta.tree_attention(q, k, v, se, seg,
                                                  config=cfg))
  ref = jax.jit(lambda q, k, v: ta.tree_attention_reference(q, k, v, se, seg))
  np.testing.assert_array_equal(xla(q, k, v), ref(q, k, v))
  grad = lambda fn: jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))
  for got, want in zip(grad(xla)(q, k, v), grad(ref)(q, k, v)):
    np.testing.assert_array_equal(got, want)


def test_config_from_string():
  """The short tile strings of the benchmark's --tiles flag."""
  mosaic = ta.TreeAttentionConfig.from_string("mosaic:64.128.64.3")
  assert mosaic == ta.TreeAttentionConfig(
      backend="mosaic", mosaic_block_k=64, mosaic_block_k_dq=128,
      mosaic_block_q_dkv=64, mosaic_stages=3, mosaic_stages_dkv=3)
  assert ta.TreeAttentionConfig.from_string(
      "mosaic:128.64.64.2.1").mosaic_stages_dkv == 1
  triton = ta.TreeAttentionConfig.from_string(
      "triton:128.64.32.16.64.32.8.3.4.1", interpret=True)
  assert (triton.backend, triton.block_q, triton.block_k_dq,
          triton.num_stages_bwd, triton.interpret) == ("triton", 128, 16, 1,
                                                        True)
  assert ta.TreeAttentionConfig.from_string(
      "16.16.16.16.16.16.4.2.4.2").backend == "triton"  # bare list
  assert ta.TreeAttentionConfig.from_string("xla") == ta.TreeAttentionConfig(
      backend="xla")
  with pytest.raises(ValueError, match="unknown backend 'cuda'"):
    ta.TreeAttentionConfig.from_string("cuda:1.2")
  with pytest.raises(ValueError, match="3 numbers for mosaic's 5"):
    ta.TreeAttentionConfig.from_string("mosaic:128.64.64")
  with pytest.raises(ValueError, match="mosaic_block_k must be 64 or 128"):
    ta.TreeAttentionConfig.from_string("mosaic:32.64.64.2")
