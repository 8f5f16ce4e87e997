"""Paged decode attention: the Pallas kernels (interpret mode) against the
reference, and the reference against attention written out per query.

Every batch mixes rows of different lengths: an empty padding row
(kv_lens 0), a row holding only the new tokens (kv_lens == T), partially
filled last pages. The pool is poisoned with NaN wherever a row must not
look: the unfilled tail of each row's last page and every page that no row
uses, which the block tables point at past each row's pages. So a kernel
that reads past a row's keys, or lets p = 0 meet a NaN value, fails.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import paged_attention as pa


def paged_inputs(seed, *, lens, T, N, K, H, S, M, dtype=jnp.float32):
  """q [B, T, N, H], a pool of pages [P, S, K, H] (NaN where no row may
  read), block tables [B, M] (rows' pages in a shuffled order, then random
  ids of unused pages) and kv_lens [B]."""
  rng = np.random.default_rng(seed)
  B = len(lens)
  used = [-(-n // S) for n in lens]
  P = sum(used) + 3  # three pages no row owns
  k = rng.standard_normal((P, S, K, H)).astype(np.float32)
  v = rng.standard_normal((P, S, K, H)).astype(np.float32)
  order = rng.permutation(P)
  spare = order[sum(used):]
  k[spare] = v[spare] = np.nan
  tables = rng.choice(spare, (B, M)).astype(np.int32)
  start = 0
  for b, (n, pages) in enumerate(zip(lens, used)):
    tables[b, :pages] = order[start:start + pages]
    start += pages
    if n % S:  # the unfilled tail of the last page
      k[tables[b, pages - 1], n % S:] = np.nan
      v[tables[b, pages - 1], n % S:] = np.nan
  q = rng.standard_normal((B, T, N, H))
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(tables), jnp.asarray(np.array(lens, np.int32)))


def attention_per_query(q, k_pages, v_pages, tables, lens):
  """Float64 numpy, one query at a time: query t of row b (position
  lens[b] - T + t) over the row's keys 0 .. its position."""
  q, k_pages, v_pages = (np.asarray(x, np.float64)
                         for x in (q, k_pages, v_pages))
  B, T, N, H = q.shape
  S, K = k_pages.shape[1:3]
  out = np.zeros_like(q)
  for b in range(B):
    key = np.arange(int(lens[b]))
    page = np.asarray(tables)[b, key // S]
    k, v = k_pages[page, key % S], v_pages[page, key % S]  # [L, K, H]
    for t in range(T):
      seen = int(lens[b]) - T + t + 1
      for n in range(N):
        if seen <= 0:
          continue
        s = k[:seen, n // (N // K)] @ q[b, t, n] * H ** -0.5
        p = np.exp(s - s.max())
        out[b, t, n] = p @ v[:seen, n // (N // K)] / p.sum()
  return out


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), "non-finite output"
  return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("T, N", [(1, 2), (3, 6)])
def test_reference_matches_attention_per_query(T, N):
  """The reference's gather, causal mask among the new tokens and GQA
  mapping, written independently; NaN garbage does not leak; rows of
  kv_lens 0 are zeros."""
  args = paged_inputs(0, lens=[0, T, 13, 45], T=T, N=N, K=2, H=16, S=8,
                      M=7)
  got = pa.paged_attention_reference(*args)
  np.testing.assert_allclose(got, attention_per_query(*args), atol=1e-5,
                             rtol=1e-5)
  assert np.all(np.asarray(got)[0] == 0.0)


# block_k 16 with pages of 8 (two pages per block) or 32 (half a page).
TRITON_CASES = {
    "decode_mha_one_split": dict(T=1, N=2, S=8, splits=1),
    "verify_gqa3_three_splits": dict(T=3, N=6, S=8, splits=3),
    "verify_gqa2_half_pages_bf16": dict(T=4, N=4, S=32, splits=2,
                                        dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernel_matches_reference(case):
  """The portable kernel in Pallas' interpreter. Lengths 0, T, 45 and 77
  are not multiples of a page, a 16-key block or a split (77 keys = 5
  blocks over 3 splits); with T > 1 the last block is masked causally."""
  c = dict(TRITON_CASES[case])
  splits, dtype = c.pop("splits"), c.pop("dtype", jnp.float32)
  args = paged_inputs(1, lens=[0, c["T"], 45, 77], K=2, H=16, M=10,
                      dtype=dtype, **c)
  cfg = pa.PagedAttentionConfig(backend="triton", block_k=16,
                                num_splits=splits, interpret=True)
  got = pa.paged_attention(*args, config=cfg)
  assert got.dtype == dtype and got.shape == args[0].shape
  f32 = (x.astype(jnp.float32) if x.dtype == dtype else x for x in args)
  want = attention_per_query(*f32)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  assert _rel(got, want) < tol
  assert np.all(np.asarray(got)[0] == 0.0)


@pytest.mark.parametrize("T, N, S, lens, splits", [
    (3, 4, 16, [0, 3, 37, 300], 2),
    (8, 18, 128, [8, 0, 200], 1),
])
def test_mosaic_kernel_matches_reference(T, N, S, lens, splits):
  """The Hopper kernel in Pallas' Mosaic GPU interpreter: bf16, head dim
  64, 64-key steps, a ring of one slot per consumer. GQA 4/2 with T = 3
  (6 query rows padded to 64), pages of 16 (four TMA copies per step), two
  splits: the 300-key row's split 0 runs steps 0-2 (step 2 reuses
  consumer 0's slot), split 1 steps 3-4, the last of them zeroing the
  value tail in shared memory. GQA 18/2 with T = 8: 72 query rows, two
  row blocks of 64, each its own program over the same pages; pages of
  128, so a step copies half a page (from slot 0 or 64)."""
  args = paged_inputs(2, lens=lens, T=T, N=N, K=2, H=64, S=S,
                      M=-(-max(lens) // S), dtype=jnp.bfloat16)
  cfg = pa.PagedAttentionConfig(backend="mosaic", num_splits=splits,
                                mosaic_stages=1, interpret=True)
  got = pa.paged_attention(*args, config=cfg)
  want = attention_per_query(*(x.astype(jnp.float32)
                               if x.dtype == jnp.bfloat16 else x
                               for x in args))
  assert _rel(got, want) < 1e-2
  empty = np.asarray(args[4]) == 0
  assert np.all(np.asarray(got, np.float32)[empty] == 0.0)


def _lower(config, B, T, N, K, H, S, M):
  spec = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  f = lambda *a: pa.paged_attention(*a, config=config)
  return jax.jit(f).trace(
      spec((B, T, N, H), bf16), spec((B * M, S, K, H), bf16),
      spec((B * M, S, K, H), bf16), spec((B, M), jnp.int32),
      spec((B,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape, tiles", [
    (dict(T=1, N=12, K=2, H=128, S=64), dict()),  # m2_small decode
    (dict(T=16, N=48, K=8, H=128, S=16),  # M2, 96 rows: two row blocks
     dict(mosaic_block_k=128, mosaic_stages=1)),
    (dict(T=4, N=8, K=2, H=64, S=128), dict(mosaic_stages=3)),
])
def test_mosaic_kernel_lowers_for_cuda(shape, tiles):
  """Lowering to Mosaic GPU for CUDA on this CPU-only host, at model shapes
  and the benchmark's tiles: catches ops and layouts with no Mosaic
  lowering (the interpreter runs neither wgmma nor the layouts)."""
  cfg = pa.PagedAttentionConfig(backend="mosaic", num_splits=4, **tiles)
  text = _lower(cfg, B=2, M=8, **shape)
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_triton_kernel_lowers_for_cuda(monkeypatch):
  """The portable kernel through Pallas' Triton lowering for an abstract
  H100 (the lowering reads the GPU's compute capability)."""
  monkeypatch.setattr(pa, "_on_gpu", lambda: True)
  h100 = jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
          device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
          platform="cuda"))
  cfg = pa.PagedAttentionConfig(backend="triton", num_splits=4)
  with jax.sharding.use_abstract_mesh(h100):
    text = _lower(cfg, B=2, T=2, N=12, K=2, H=128, S=64, M=8)
  assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1


def test_xla_backend_is_the_reference():
  args = paged_inputs(3, lens=[5, 20], T=2, N=4, K=2, H=16, S=8, M=3)
  cfg = pa.PagedAttentionConfig(backend="xla")
  np.testing.assert_array_equal(pa.paged_attention(*args, config=cfg),
                                pa.paged_attention_reference(*args))


def test_combine_splits_equals_one_softmax():
  """Partial softmaxes over disjoint key ranges, merged by their
  log-sum-exp, equal one softmax over all keys; an empty split (lse -inf)
  weighs nothing and an all-empty row gives zeros."""
  rng = np.random.default_rng(4)
  s = rng.standard_normal((2, 9))  # [query rows, keys], base-2 logits
  v = rng.standard_normal((9, 3))
  parts, lse = [], []
  for keys in (slice(0, 4), slice(4, 9), slice(9, 9)):
    w = np.exp2(s[:, keys])
    parts.append(w @ v[keys] / np.maximum(w.sum(1, keepdims=True), 1e-30))
    lse.append(np.log2(w.sum(1)) if w.size else np.full(2, -np.inf))
  o = jnp.asarray(np.stack(parts)[None, None], jnp.float32)
  lse = jnp.asarray(np.stack(lse)[None, None], jnp.float32)
  want = np.exp2(s) @ v / np.exp2(s).sum(1, keepdims=True)
  np.testing.assert_allclose(pa.combine_splits(o, lse)[0, 0], want,
                             rtol=1e-5)
  empty = pa.combine_splits(o, jnp.full_like(lse, -jnp.inf))
  assert np.all(np.asarray(empty) == 0.0)


def test_automatic_splits_fill_whole_waves():
  # m2_small's 2 KV heads x batch 8 on 132 SMs: 8 splits, 128 programs.
  assert pa.splits_for(16, 32768, 64, num_sms=132) == 8
  assert pa.splits_for(64, 32768, 64, num_sms=132) == 2  # M2's 8 KV heads
  assert pa.splits_for(512, 32768, 64, num_sms=132) == 1  # a big batch
  # A short context caps the splits at 4 key blocks each.
  assert pa.splits_for(2, 1024, 64, num_sms=132) == 4
  # What a call resolves to (no GPU here: 132 SMs assumed): m2_small at
  # 32K context, T = 1, then T = 16 (96 query rows: two Mosaic row blocks,
  # twice the programs, half the splits).
  spec = jax.ShapeDtypeStruct
  k = spec((4096, 64, 2, 128), jnp.bfloat16)
  tables = spec((8, 512), jnp.int32)
  mosaic = pa.PagedAttentionConfig(backend="mosaic")
  for T, splits in ((1, 8), (16, 4)):
    q = spec((8, T, 12, 128), jnp.bfloat16)
    assert pa.resolve_config(mosaic, q, k, tables).num_splits == splits
  q = spec((8, 1, 12, 128), jnp.bfloat16)
  assert pa.resolve_config(dataclasses.replace(mosaic, num_splits=3), q, k,
                           tables).num_splits == 3


def test_backend_choice_and_config_errors(monkeypatch):
  bf16, f32 = jnp.bfloat16, jnp.float32
  resolve = lambda cfg, dts, h=128, s=64: pa._resolve_backend(
      cfg, dts, h, s).backend
  auto = pa.PagedAttentionConfig()
  monkeypatch.setattr(pa, "_on_gpu", lambda: False)
  assert resolve(auto, (bf16,) * 3) == "xla"  # no GPU: the reference
  assert resolve(pa.PagedAttentionConfig(interpret=True), (bf16,) * 3) == (
      "triton")
  monkeypatch.setattr(pa, "_on_gpu", lambda: True)
  monkeypatch.setattr(pa, "_on_hopper", lambda: True)
  assert resolve(auto, (bf16,) * 3) == "mosaic"
  assert resolve(auto, (f32,) * 3) == "triton"
  assert resolve(auto, (bf16,) * 3, h=256) == "triton"
  assert resolve(auto, (bf16,) * 3, s=4) == "triton"
  assert resolve(auto, (bf16,) * 3, h=96) == "xla"  # neither kernel fits
  monkeypatch.setattr(pa, "_on_hopper", lambda: False)
  assert resolve(auto, (bf16,) * 3) == "triton"
  with pytest.raises(ValueError, match="head_dim 64 or 128.*head_dim=256"):
    resolve(pa.PagedAttentionConfig(backend="mosaic"), (bf16,) * 3, h=256)
  with pytest.raises(ValueError, match="power of two >= 16, got 96"):
    resolve(pa.PagedAttentionConfig(backend="triton"), (bf16,) * 3, h=96)
  for bad, match in [(dict(backend="cuda"), "backend must be one of"),
                     (dict(num_splits=-1), "num_splits must be"),
                     (dict(block_k=24), "block_k must be a power of two"),
                     (dict(mosaic_block_k=32), "mosaic_block_k must be 64"),
                     (dict(mosaic_stages=0), "mosaic_stages must be >= 1"),
                     (dict(interpret=None), "interpret must be True")]:
    with pytest.raises(ValueError, match=match):
      pa.PagedAttentionConfig(**bad)
  assert pa.PagedAttentionConfig.from_string(
      "mosaic:128.1", num_splits=4) == pa.PagedAttentionConfig(
          backend="mosaic", mosaic_block_k=128, mosaic_stages=1, num_splits=4)
  assert pa.PagedAttentionConfig.from_string("triton:32.8.3").num_warps == 8
  with pytest.raises(ValueError, match="2 numbers for triton's 3"):
    pa.PagedAttentionConfig.from_string("triton:32.8")


def test_bad_shapes_are_one_line_errors():
  q, k, v, tables, lens = paged_inputs(5, lens=[4], T=1, N=4, K=2, H=16,
                                       S=8, M=2)
  cases = [((q, k, v[:, :4], tables, lens), "k_pages .* and v_pages"),
           ((q[..., :3, :], k, v, tables, lens), "multiple of num_kv_heads"),
           ((q, k[:, :6], v[:, :6], tables, lens), "power of two"),
           ((q, k, v, tables.astype(jnp.float32), lens), "block_tables"),
           ((q, k, v, tables, lens[None]), "kv_lens must be"),
           ((jnp.zeros((1, 17, 4, 16)), k, v, tables, lens), "do not fit")]
  for args, match in cases:
    with pytest.raises(ValueError, match=match):
      pa.paged_attention(*args)
  cfg = pa.PagedAttentionConfig(backend="mosaic", mosaic_block_k=128,
                                mosaic_stages=2, interpret=True)
  q, k, v, tables, lens = paged_inputs(5, lens=[4], T=1, N=4, K=2, H=128,
                                       S=8, M=2, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="shared memory .* lower mosaic_stag"):
    pa.paged_attention(q, k, v, tables, lens, config=cfg)
