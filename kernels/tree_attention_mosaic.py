"""Hopper tree attention in Pallas Mosaic GPU (wgmma + TMA, warp specialised).

Same contract as kernels/tree_attention_triton.py (the portable Triton
kernels): forward -> (out, lse in base 2), backward_dq, backward_dkv, each
fed by the tile lists of kernels/tree_attention.py. Only the lowering
differs: every program has the three warpgroups of
kernels/mosaic_pipeline.py,

  warpgroup 2      the producer: walks the program's tile list and TMA-copies
                   the tiles it names into a ring of `stages` shared-memory
                   slots, waiting only for a slot to be released;
  warpgroups 0, 1  the consumers: each owns 64 rows of the program's
                   128-row tile (q rows forward and dq, k rows dk/dv), runs
                   wgmma with register accumulators over the tiles the
                   producer delivers, full tiles with no mask code, partial
                   tiles masked from the key vectors (subtree_end, segment).

Lists are built per program tile (128 rows), so both consumers see the same
tile sequence; a partial tile masks each consumer's half on its own.

Forward (grid heads x batch x q tiles, heavy q tiles first): the two
consumers alternate through a schedule barrier (one runs softmax while the
other's matmuls own the tensor cores), as FlashAttention-3 does.
dq (same grid) recomputes p and dp per k tile; dk/dv (grid kv heads x batch
x k tiles) walks the G query heads of its KV head and, per head, the q tiles
that read its k tile, so the GQA sum stays in registers. Products that do not
depend on each other are issued back to back and awaited once.

In Pallas' GPU interpreter (interpret=True, for CPU tests) the products into
register accumulators become float32 dots (`_accumulate`); that path and the
wgmma register layouts are only exercised on a GPU.

Masked entries get -inf logits; running maxima start at a finite -1e30, so a
row that has seen only masked keys keeps p = 0 and never forms inf - inf.
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import mosaic_pipeline as pipeline

_HALF = pipeline.ROWS_PER_CONSUMER  # rows per compute warpgroup
_WGS = pipeline.CONSUMERS  # compute warpgroups per program
TILE = pipeline.TILE_ROWS  # rows per program: the list granularity there
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite: exp2(-inf - _M_INIT) = 0 for fully masked rows
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column


def _smem(shape, dtype):
  """Shared memory for a wgmma operand: 8 x 64 tiles, 128-byte swizzle."""
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(128)))


# Grids list the fastest-launched axis first: consecutive programs are the
# heads of one (batch row, tile), which share K/V in L2; the tile axis is the
# slowest, so the heavy tiles of every batch row start first.
_Q_GRID = ("heads", "batch", "q_seq")


def _call(body, out_type, scratch, grid, names, interpret):
  return pipeline.kernel(
      body, out_type, scratch_types=scratch, grid=grid, grid_names=names,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret)


def _producer(n_steps, stages, loads):
  """The producer's walk over `n_steps` steps and, after it, the wait for
  the consumers' last releases (kernels/mosaic_pipeline.py)."""
  pipeline.produce(n_steps, stages, loads)
  pipeline.drain(n_steps, stages, [free for free, _ in loads])


def _accumulate(products, accs, interpret, overlap=None):
  """`accs[i] += lhs @ rhs` for each (i, lhs, rhs) of `products`, issued as
  wgmmas into register accumulators; `overlap()` runs while they execute.
  lhs is a register value, rhs a shared-memory ref (wgmma's register-A
  form). Pallas' GPU interpreter has no `pl.run_state` and takes
  shared-memory operands only, so there the same sums are plain float32
  dots."""
  if interpret:
    out = list(accs)
    for i, a, b in products:
      out[i] = out[i] + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    if overlap is not None:
      overlap()
    return tuple(out)

  def issue(refs):
    for i, a, b in products:
      plgpu.wgmma(refs[i], a, b)
    if overlap is not None:
      overlap()
  return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))


def _products(pairs, shape, overlap=None):
  """Fresh float32 products lhs @ rhs of shared-memory operands, issued back
  to back as wgmmas and awaited together; `overlap()` runs meanwhile."""
  def scope(*refs):
    for ref, (a, b) in zip(refs, pairs):
      plgpu.wgmma(ref, a, b)
    if overlap is not None:
      overlap()
    return tuple(ref[...] for ref in refs)
  return pl.run_scoped(scope, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def _rows(first, size=_HALF):
  return pl.ds(pl.multiple_of(first, 8), size)


def _visible(row_ids, col_ids, se, seg_rows, seg_cols, *, keys_on_rows):
  """Tree mask of one accumulator tile (rows x cols, WGMMA layout).

  Forward/dq tiles have queries on rows and keys on columns; dk/dv tiles the
  transpose. `se` belongs to the keys, the segments to their side.
  """
  shape = (row_ids.shape[0], col_ids.shape[0])
  r = lax.broadcast_in_dim(row_ids, shape, [0])
  c = lax.broadcast_in_dim(col_ids, shape, [1])
  sr = lax.broadcast_in_dim(seg_rows, shape, [0])
  sc = lax.broadcast_in_dim(seg_cols, shape, [1])
  if keys_on_rows:  # key = row
    se_b = lax.broadcast_in_dim(se, shape, [0])
    return (r <= c) & (c < se_b) & (sr == sc)
  se_b = lax.broadcast_in_dim(se, shape, [1])
  return (c <= r) & (r < se_b) & (sr == sc)


def _gload(ref, layout):
  """A short vector straight from global memory (no optimised path exists
  for these layouts; each thread reads its own elements, L2-resident)."""
  return plgpu.load(ref, layout=layout, optimized=False)


def _iota(n, layout, start):
  return start + plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)


def _q_program(nq, count_ref):
  """Coordinates of a program of the q-major kernels (forward, dq): batch,
  head, q tile (heavy, late tiles first), warpgroup, and the tile list's
  counts (full tiles, all live tiles)."""
  b, h = lax.axis_index("batch"), lax.axis_index("heads")
  qt = nq - 1 - lax.axis_index("q_seq")
  n_full = count_ref[b, qt, 0]
  return b, h, qt, lax.axis_index("wg"), n_full, n_full + count_ref[b, qt, 1]


def _produce_kv(refs, smem, bars, frees, list_ref, b, qt, kvh, bk, n_live,
                stages):
  """Producer of the q-major kernels: the k and v tiles of the q tile's
  list, each with its own barrier so q k^T can start before v lands."""
  rows = lambda t: _rows(list_ref[b, qt, t] * bk, bk)

  def load(i):
    return (frees[i], lambda t, s: plgpu.copy_gmem_to_smem(
        refs[i].at[b, rows(t), kvh], smem[i].at[s], bars[i].at[s]))
  _producer(n_live, stages, [load(0), load(1)])


def _walk(step, n_full, n_live, carry):
  """A consumer's pass over its tile list: the full tiles [0, n_full) with
  no mask code, then the partial ones, `step(t, carry, masked)` each."""
  carry = lax.fori_loop(0, n_full, lambda t, c: step(t, c, False), carry)
  return lax.fori_loop(n_full, n_live, lambda t, c: step(t, c, True), carry)


def _mask_keys(s, q_ids, seg_q, se_ref, seg_ref, b, k0, bk):
  """A partial tile with queries on rows and keys k0.. on columns: -inf
  where the key is hidden from the row's query."""
  cols = _rows(k0, bk)
  mask = _visible(q_ids, _iota(bk, _COL, k0),
                  _gload(se_ref.at[b, cols], layout=_COL), seg_q,
                  _gload(seg_ref.at[b, cols], layout=_COL),
                  keys_on_rows=False)
  return jnp.where(mask, s, -jnp.inf)


# ---------------------------------------------------------------- forward ---

def forward(q, k, v, se, seg, lists, counts, *, scale, cfg):
  """out [B, T, N, H] and lse [B, N, T] (float32, base 2, scaled logits)."""
  B, T, N, H = q.shape
  G = N // k.shape[2]
  bk, stages, dtype = cfg.mosaic_block_k, cfg.mosaic_stages, q.dtype
  nq = T // TILE
  c = scale * _LOG2E

  def kernel(q_ref, k_ref, v_ref, se_ref, seg_ref, list_ref, count_ref,
             out_ref, lse_ref, qo_smem2, k_smem, v_smem, lse_smem2, q_bar,
             k_bar, v_bar, k_free, v_free, turn):
    b, h, qt, wg, n_full, n_live = _q_program(nq, count_ref)

    def take_turn():  # hand the tensor cores to the other consumer
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    def producer():
      _produce_kv((k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar),
                  (k_free, v_free), list_ref, b, qt, lax.div(h, G), bk,
                  n_live, stages)

    def consumer():
      qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
      q0 = qt * TILE + wg * _HALF
      plgpu.copy_gmem_to_smem(q_ref.at[b, _rows(q0), h], qo_smem,
                              q_bar.at[wg])
      q_ids = _iota(_HALF, _ROW, q0)
      seg_q = _gload(seg_ref.at[b, _rows(q0)], layout=_ROW)
      plgpu.barrier_wait(q_bar.at[wg])

      @pl.when(n_live > 0)
      def _():
        plgpu.barrier_wait(k_bar.at[0])

      pl.when(wg == 1)(take_turn)

      def step(t, carry, masked):
        acc, m, l = carry
        slot = lax.rem(t, stages)

        s, = _products([(qo_smem, k_smem.at[slot].T)], (_HALF, bk),
                       overlap=take_turn)
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
          s = _mask_keys(s, q_ids, seg_q, se_ref, seg_ref, b,
                         list_ref[b, qt, t] * bk, bk)
        m_new = jnp.maximum(m, s.max(axis=1) * c)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_arrive(turn)  # softmax done
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(turn)  # tensor cores free

        def wait_next_k():  # while the p @ v wgmma runs
          @pl.when(t + 1 < n_live)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(t + 1, stages)])
        acc, = _accumulate([(0, p16, v_smem.at[slot])], (acc,),
                           cfg.interpret, overlap=wait_next_k)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      carry = (plgpu.layout_cast(jnp.zeros((_HALF, H), jnp.float32), _WGMMA),
               plgpu.layout_cast(jnp.full((_HALF,), _M_INIT, jnp.float32),
                                 _ROW),
               plgpu.layout_cast(jnp.zeros((_HALF,), jnp.float32), _ROW))
      acc, m, l = _walk(step, n_full, n_live, carry)
      pl.when(wg == 0)(take_turn)

      empty = l == 0.0
      l = jnp.where(empty, 1.0, l)
      acc /= lax.broadcast_in_dim(l, acc.shape, [0])
      qo_smem[...] = acc.astype(dtype)
      lse_smem[...] = jnp.where(empty, 0.0, m + jnp.log(l) * _LOG2E)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, _rows(q0), h])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, _rows(q0)])
      plgpu.wait_smem_to_gmem(0)

    pipeline.warp_specialised(wg, producer, consumer)

  scratch = (
      _smem((_WGS, _HALF, H), dtype),
      _smem((stages, bk, H), dtype),
      _smem((stages, bk, H), dtype),
      plgpu.SMEM((_WGS, _HALF), jnp.float32),
      plgpu.Barrier(num_barriers=_WGS),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS),
  )
  out_type = (jax.ShapeDtypeStruct(q.shape, dtype),
              jax.ShapeDtypeStruct((B, N, T), jnp.float32))
  return _call(kernel, out_type, scratch, (N, B, nq), _Q_GRID,
               cfg.interpret)(
                   q, k, v, se, seg, lists, counts)


# ------------------------------------------------------------ backward dq ---

def backward_dq(q, k, v, do, lse, delta, se, seg, lists, counts, *, scale,
                cfg):
  """dq [B, T, N, H]: sum over live k tiles of ds @ k (times scale)."""
  B, T, N, H = q.shape
  G = N // k.shape[2]
  bk, stages, dtype = cfg.mosaic_block_k_dq, cfg.mosaic_stages, q.dtype
  nq = T // TILE
  c = scale * _LOG2E

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, se_ref,
             seg_ref, list_ref, count_ref, dq_ref, q_smem2, do_smem2, k_smem,
             v_smem, q_bar, k_bar, v_bar, k_free, v_free):
    b, h, qt, wg, n_full, n_live = _q_program(nq, count_ref)

    def producer():
      _produce_kv((k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar),
                  (k_free, v_free), list_ref, b, qt, lax.div(h, G), bk,
                  n_live, stages)

    def consumer():
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      q0 = qt * TILE + wg * _HALF
      plgpu.copy_gmem_to_smem(q_ref.at[b, _rows(q0), h], q_smem,
                              q_bar.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[b, _rows(q0), h], do_smem,
                              q_bar.at[wg])
      q_ids = _iota(_HALF, _ROW, q0)
      seg_q = _gload(seg_ref.at[b, _rows(q0)], layout=_ROW)
      lse_q = _gload(lse_ref.at[b, h, _rows(q0)], layout=_ROW)
      delta_q = _gload(delta_ref.at[b, h, _rows(q0)], layout=_ROW)
      plgpu.barrier_wait(q_bar.at[wg])

      def step(t, dq, masked):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        s, dp = _products([(q_smem, k_smem.at[slot].T),
                           (do_smem, v_smem.at[slot].T)], (_HALF, bk))
        plgpu.barrier_arrive(v_free.at[slot])
        if masked:
          s = _mask_keys(s, q_ids, seg_q, se_ref, seg_ref, b,
                         list_ref[b, qt, t] * bk, bk)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(lse_q, s.shape, [0]))
        ds = p * (dp - lax.broadcast_in_dim(delta_q, s.shape, [0]))

        dq, = _accumulate([(0, ds.astype(dtype), k_smem.at[slot])], (dq,),
                          cfg.interpret)
        plgpu.barrier_arrive(k_free.at[slot])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((_HALF, H), jnp.float32), _WGMMA)
      dq = _walk(step, n_full, n_live, dq)
      q_smem[...] = (dq * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, _rows(q0), h])
      plgpu.wait_smem_to_gmem(0)

    pipeline.warp_specialised(wg, producer, consumer)

  scratch = (
      _smem((_WGS, _HALF, H), dtype),
      _smem((_WGS, _HALF, H), dtype),
      _smem((stages, bk, H), dtype),
      _smem((stages, bk, H), dtype),
      plgpu.Barrier(num_arrivals=2, num_barriers=_WGS),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),
  )
  return _call(kernel, jax.ShapeDtypeStruct(q.shape, dtype), scratch,
               (N, B, nq), _Q_GRID, cfg.interpret)(
                   q, k, v, do, lse, delta, se, seg, lists, counts)


# ----------------------------------------------------------- backward dkv ---

def backward_dkv(q, k, v, do, lse, delta, se, seg, lists, counts, *, scale,
                 cfg):
  """dk, dv [B, T, K, H]; `lists` are the transposed (per k tile) lists."""
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  bq, stages, dtype = cfg.mosaic_block_q_dkv, cfg.mosaic_stages_dkv, q.dtype
  nk = T // TILE
  c = scale * _LOG2E

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, se_ref,
             seg_ref, list_ref, count_ref, dk_ref, dv_ref, k_smem2, v_smem2,
             q_smem, do_smem, lse_smem, delta_smem, kv_bar, tile_bar,
             tile_free):
    b, kvh = lax.axis_index("batch"), lax.axis_index("heads")
    kt = lax.axis_index("k_seq")
    wg = lax.axis_index("wg")
    n_full = count_ref[b, kt, 0]
    n_live = n_full + count_ref[b, kt, 1]

    def at(step):  # step -> (query head, q rows)
      g = lax.div(step, jnp.maximum(n_live, 1))
      t = lax.rem(step, jnp.maximum(n_live, 1))
      return kvh * G + g, _rows(list_ref[b, kt, t] * bq, bq)

    def producer():
      def load(step, s):  # q, do and their row vectors: one barrier
        h, rows = at(step)
        for src, dst in ((q_ref.at[b, rows, h], q_smem),
                         (do_ref.at[b, rows, h], do_smem),
                         (lse_ref.at[b, h, rows], lse_smem),
                         (delta_ref.at[b, h, rows], delta_smem)):
          plgpu.copy_gmem_to_smem(src, dst.at[s], tile_bar.at[s])
      _producer(G * n_live, stages, [(tile_free, load)])

    def consumer():
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      k0 = kt * TILE + wg * _HALF
      plgpu.copy_gmem_to_smem(k_ref.at[b, _rows(k0), kvh], k_smem,
                              kv_bar.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[b, _rows(k0), kvh], v_smem,
                              kv_bar.at[wg])
      k_ids = _iota(_HALF, _ROW, k0)
      se_k = _gload(se_ref.at[b, _rows(k0)], layout=_ROW)
      seg_k = _gload(seg_ref.at[b, _rows(k0)], layout=_ROW)
      plgpu.barrier_wait(kv_bar.at[wg])

      def step(g, t, carry, masked):
        dk, dv = carry
        st = g * n_live + t
        slot = lax.rem(st, stages)
        plgpu.barrier_wait(tile_bar.at[slot])
        s, dp = _products([(k_smem, q_smem.at[slot].T),
                           (v_smem, do_smem.at[slot].T)], (_HALF, bq))
        if masked:
          q0 = list_ref[b, kt, t] * bq
          mask = _visible(k_ids, _iota(bq, _COL, q0), se_k, seg_k,
                          _gload(seg_ref.at[b, _rows(q0, bq)], layout=_COL),
                          keys_on_rows=True)
          s = jnp.where(mask, s, -jnp.inf)
        lse_q = plgpu.load(lse_smem.at[slot], layout=_COL)
        delta_q = plgpu.load(delta_smem.at[slot], layout=_COL)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(lse_q, s.shape, [1]))
        ds = p * (dp - lax.broadcast_in_dim(delta_q, s.shape, [1]))
        dv, dk = _accumulate([(0, p.astype(dtype), do_smem.at[slot]),
                              (1, ds.astype(dtype), q_smem.at[slot])],
                             (dv, dk), cfg.interpret)
        plgpu.barrier_arrive(tile_free.at[slot])
        return dk, dv

      def head(g, carry):
        return _walk(lambda t, cr, masked: step(g, t, cr, masked), n_full,
                     n_live, carry)

      zeros = plgpu.layout_cast(jnp.zeros((_HALF, H), jnp.float32), _WGMMA)
      dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
      k_smem[...] = (dk * scale).astype(dtype)
      v_smem[...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, _rows(k0), kvh],
                              commit_group=False)
      plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, _rows(k0), kvh],
                              commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    pipeline.warp_specialised(wg, producer, consumer)

  scratch = (
      _smem((_WGS, _HALF, H), dtype),
      _smem((_WGS, _HALF, H), dtype),
      _smem((stages, bq, H), dtype),
      _smem((stages, bq, H), dtype),
      plgpu.SMEM((stages, bq), jnp.float32),
      plgpu.SMEM((stages, bq), jnp.float32),
      plgpu.Barrier(num_arrivals=2, num_barriers=_WGS),
      plgpu.Barrier(num_arrivals=4, num_barriers=stages),
      plgpu.Barrier(num_arrivals=_WGS, num_barriers=stages),
  )
  kv = jax.ShapeDtypeStruct(k.shape, k.dtype)
  return _call(kernel, (kv, kv), scratch, (K, B, nk),
               ("heads", "batch", "k_seq"), cfg.interpret)(
                   q, k, v, do, lse, delta, se, seg, lists, counts)
