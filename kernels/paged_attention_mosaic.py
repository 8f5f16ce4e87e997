"""Hopper paged decode attention in Pallas Mosaic GPU (TMA + wgmma, warp
specialised): the "mosaic" backend of kernels/paged_attention.py.

Decode is bandwidth bound: a program's work is to stream its share of one
row's K and V pages through shared memory at full rate, with several
copies in flight, and to do the little arithmetic per byte on the way.
One program (CTA) per (KV head x 64-row query block, batch row, key split)
runs the three warpgroups of kernels/mosaic_pipeline.py:

  warpgroup 2      the producer: loads the program's 64 query rows once,
                   then walks the split's steps of `block_k` keys; for
                   each step it reads the page ids from the block table
                   (scalar reads of the table in global memory) and
                   TMA-copies each page's slots [chunk of min(S, block_k)
                   rows, H] for K and V into a ring of 2 * stages slots.
                   Key indices past the row's last key are clamped to its
                   last chunk, so table entries past the row's pages are
                   never read and every slot row holds real page data.
  warpgroups 0, 1  the consumers: they take alternate steps (step i goes to
                   warpgroup i % 2 and ring slot i % (2 * stages), so each
                   slot and its barriers belong to one warpgroup) and keep
                   their own online softmax over all 64 query rows:
                   s = q k^T (wgmma, both operands in shared memory), p in
                   float32, acc += p v (wgmma, p from registers). Each
                   writes its own normalised partial and log-sum-exp, so a
                   program yields two of the partial results that
                   `paged_attention.combine_splits` merges.

The query rows of a program are the G query heads of its KV head times the
T new tokens (r = t * G + g), zero-padded to 64, the wgmma M: at G * T = 6
rows most of each product is padding, which costs tensor-core time the
kernel has to spare (about 64 FLOP per byte read against the H100's ~300)
but no memory traffic. More than 64 rows (e.g. T = 16 at G = 6) take
several row blocks, each its own program reading the same pages (from L2
when they run together: the row-block index is the fastest grid axis).

Steps before the causal edge of the new tokens run without a mask; the last
ones mask the logits, and in the step holding the row's last key the
consumer zeroes the value rows past kv_len in shared memory (the unfilled
tail of the last page may hold anything, even NaN, and p = 0 does not
cancel a NaN in p @ v).

In Pallas' GPU interpreter (interpret=True, CPU tests) the register-operand
product becomes a float32 dot (`_accumulate`); the wgmma layouts are only
exercised on a GPU and by the CUDA cross-lowering test.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import mosaic_pipeline as pipeline

ROWS = pipeline.ROWS_PER_CONSUMER  # query rows per program: one wgmma M
_CONSUMERS = pipeline.CONSUMERS
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: exp2(-inf - _M_INIT) = 0 for rows with no key yet
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
# Shared memory per CTA on an H100 (227 KiB).
SMEM_BYTES = 232448


def padded_rows(rows: int) -> int:
  """Query rows of a (batch row, KV head): whole 64-row blocks."""
  return -(-rows // ROWS) * ROWS


def stored_rows(rows: int) -> int:
  """Rows of a row block the kernel writes back: R rounded up to 8 (one
  shared-memory tile) when one block holds them all, else the block."""
  return min(ROWS, -(-rows // 8) * 8)


def smem_bytes(head_dim: int, itemsize: int, block_k: int,
               stages: int) -> int:
  """Shared memory of one program: the queries, the K and V ring, and each
  consumer's float32 output tile and log-sum-exp (barriers not counted)."""
  ring = 2 * _CONSUMERS * stages * block_k * head_dim * itemsize
  return (ROWS * head_dim * itemsize + ring
          + _CONSUMERS * ROWS * (head_dim + 1) * 4)


def _smem(shape, dtype):
  """Shared memory for a wgmma operand or a TMA tile: 8-row tiles of 128
  bytes, 128-byte swizzle."""
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(128)))


def _scores(q_smem, k_smem):
  """s = q k^T [64, block_k] float32, both operands in shared memory."""
  def scope(acc):
    plgpu.wgmma(acc, q_smem, k_smem.T)
    return acc[...]
  return pl.run_scoped(scope, plgpu.ACC((ROWS, k_smem.shape[0]), jnp.float32))


def _accumulate(acc, p, v_smem, interpret):
  """acc + p @ v, p in registers (wgmma's register-A form). Pallas' GPU
  interpreter has no `pl.run_state` and takes shared-memory operands only,
  so there the same sum is a plain float32 dot."""
  if interpret:
    return acc + jnp.dot(p, v_smem[...], preferred_element_type=jnp.float32)

  def issue(acc_ref):
    plgpu.wgmma(acc_ref, p, v_smem)
  return pl.run_state(issue)(plgpu.ACC.init(acc))


def _zero_values_past(v_smem, first_key, kv_len):
  """Zeroes the rows of a V slot whose key (first_key + row) >= kv_len,
  then fences the shared-memory writes for the wgmma that reads them."""
  @pl.when(first_key + v_smem.shape[0] > kv_len)
  def _():
    v = plgpu.load(v_smem, layout=_WGMMA)
    key = first_key + plgpu.broadcasted_iota(jnp.int32, v.shape, 0,
                                             layout=_WGMMA)
    v_smem[...] = jnp.where(key < kv_len, v, jnp.zeros_like(v))
    plgpu.commit_smem()


def partials(kv_lens, tables, row_offsets, q, k_pages, v_pages, *, T, R,
             scale, cfg):
  """Per-split results of paged attention.

  kv_lens [B] int32; tables [B, M] int32; row_offsets [rows] int32
  (`paged_attention.query_row_offsets`); q [B, K, rows, H] (query rows
  r = t * G + g, zero padding to whole 64-row blocks); k_pages, v_pages
  [P, S, K, H], S a multiple of 8; splits = cfg.num_splits (>= 1).
  Returns o [B, K, 2 * splits, rows', H] float32 (each normalised over its
  own keys; rows' >= R) and lse [B, K, 2 * splits, rows'] float32 (base 2;
  -inf: no key).
  """
  B, K, rows, H = q.shape
  S = k_pages.shape[1]
  dtype = q.dtype
  rb = rows // ROWS  # row blocks
  bk, stages, splits = cfg.mosaic_block_k, cfg.mosaic_stages, cfg.num_splits
  ring = _CONSUMERS * stages
  chunk = min(S, bk)  # rows of one TMA copy: a page, or part of one
  chunks = bk // chunk
  kept = stored_rows(R)
  c = scale * _LOG2E
  need = smem_bytes(H, jnp.dtype(dtype).itemsize, bk, stages)
  if need > SMEM_BYTES:
    raise ValueError(
        f"paged attention mosaic tiles need {need} bytes of shared memory "
        f"(> {SMEM_BYTES}): lower mosaic_stages ({stages}) or mosaic_block_k "
        f"({bk}) for head_dim {H}")

  def kernel(len_ref, table_ref, off_ref, q_ref, k_ref, v_ref, o_ref,
             lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar,
             v_bar, free):
    h = lax.axis_index("heads")
    b, split = lax.axis_index("batch"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    kvh, block = lax.div(h, rb), lax.rem(h, rb)
    kv_len = len_ref[b]
    n_blocks = lax.div(kv_len + (bk - 1), bk)
    per = lax.div(n_blocks + (splits - 1), splits)
    first = jnp.minimum(split * per, n_blocks)  # the split's first step
    n = jnp.minimum(per, n_blocks - first)  # and its number of steps
    # Steps before `n_full` (local index) are visible to every query row.
    n_full = jnp.clip(lax.div(jnp.maximum(kv_len - T + 1, 0), bk) - first, 0,
                      n)
    last_chunk = lax.div(jnp.maximum(kv_len - 1, 0), chunk) * chunk
    q_rows = pl.ds(pl.multiple_of(block * ROWS, ROWS), ROWS)

    def producer():
      plgpu.copy_gmem_to_smem(q_ref.at[b, kvh, q_rows], q_smem, q_bar)

      def issue(i, slot):
        key0 = (first + i) * bk
        pages = []
        for j in range(chunks):  # all table reads first: one wait for all
          key = jnp.minimum(key0 + j * chunk, last_chunk)
          pages.append((table_ref[b, lax.div(key, S)], lax.rem(key, S)))
        # K first: q k^T can start while V is still landing.
        for ref, smem, bar in ((k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)):
          for j, (page, offset) in enumerate(pages):
            src = (page, pl.ds(pl.multiple_of(offset, chunk), chunk), kvh)
            plgpu.copy_gmem_to_smem(ref.at[src],
                                    smem.at[slot, pl.ds(j * chunk, chunk)],
                                    bar.at[slot])
      pipeline.produce(n, ring, [(free, issue)])
      pipeline.drain(n, ring, [free])

    def consumer():
      limit = kv_len + plgpu.load(off_ref.at[q_rows], layout=_ROW,
                                  optimized=False)
      plgpu.barrier_wait(q_bar)

      def step(j, carry, masked):
        acc, m, l = carry
        i = wg + 2 * j  # this warpgroup's j-th step
        slot = lax.rem(i, ring)
        key0 = (first + i) * bk
        plgpu.barrier_wait(k_bar.at[slot])
        s = _scores(q_smem, k_smem.at[slot]) * c
        if masked:
          key = key0 + plgpu.broadcasted_iota(jnp.int32, s.shape, 1,
                                              layout=_WGMMA)
          visible = key < lax.broadcast_in_dim(limit, s.shape, [0])
          s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        if masked:
          _zero_values_past(v_smem.at[slot], key0, kv_len)
        acc = _accumulate(acc, p.astype(dtype), v_smem.at[slot],
                          cfg.interpret)
        plgpu.barrier_arrive(free.at[slot])
        return acc, m_new, l

      # Local steps wg, wg + 2, ... below n (and below n_full: unmasked).
      mine = lax.div(jnp.maximum(n - wg + 1, 0), 2)
      mine_full = lax.div(jnp.maximum(n_full - wg + 1, 0), 2)
      carry = (plgpu.layout_cast(jnp.zeros((ROWS, H), jnp.float32), _WGMMA),
               plgpu.layout_cast(jnp.full((ROWS,), _M_INIT, jnp.float32),
                                 _ROW),
               plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), _ROW))
      carry = lax.fori_loop(0, mine_full,
                            lambda j, cr: step(j, cr, False), carry)
      acc, m, l = lax.fori_loop(mine_full, mine,
                                lambda j, cr: step(j, cr, True), carry)

      empty = l == 0.0
      l = jnp.where(empty, 1.0, l)
      acc /= lax.broadcast_in_dim(l, acc.shape, [0])
      o_smem.at[wg][...] = acc
      lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf,
                                       m + jnp.log(l) * _LOG2E)
      plgpu.commit_smem()
      out = (b, kvh, block, split, wg)
      plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, kept)], o_ref.at[out],
                              commit_group=False)
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[out],
                              commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    pipeline.warp_specialised(wg, producer, consumer)

  scratch = (
      _smem((ROWS, H), dtype),
      _smem((ring, bk, H), dtype),
      _smem((ring, bk, H), dtype),
      _smem((_CONSUMERS, ROWS, H), jnp.float32),
      plgpu.SMEM((_CONSUMERS, ROWS), jnp.float32),
      plgpu.Barrier(),
      plgpu.Barrier(num_arrivals=chunks, num_barriers=ring),
      plgpu.Barrier(num_arrivals=chunks, num_barriers=ring),
      plgpu.Barrier(num_barriers=ring),
  )
  out_type = (
      jax.ShapeDtypeStruct((B, K, rb, splits, _CONSUMERS, kept, H),
                           jnp.float32),
      jax.ShapeDtypeStruct((B, K, rb, splits, _CONSUMERS, ROWS), jnp.float32))
  o, lse = pipeline.kernel(
      kernel, out_type, scratch_types=scratch, grid=(K * rb, B, splits),
      grid_names=("heads", "batch", "split"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=cfg.interpret)(
          kv_lens, tables, row_offsets, q, k_pages, v_pages)
  # [B, K, rb, splits, 2, kept, .] -> [B, K, 2 * splits, rb * kept, .]
  o = o.transpose(0, 1, 3, 4, 2, 5, 6).reshape(B, K, 2 * splits, rb * kept, H)
  lse = lse[..., :kept].transpose(0, 1, 3, 4, 2, 5)
  return o, lse.reshape(B, K, 2 * splits, rb * kept)
