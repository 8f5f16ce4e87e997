"""Hopper grouped matmuls in Pallas Mosaic GPU (wgmma + TMA, warp specialised).

Two kernels share one persistent, warp-specialised skeleton:

* `gmm(lhs[M, K], rhs[G, K, N]) -> [M, N]` (and `rhs` read transposed, for the
  lhs gradient): rows are cut into tiles that start at their group's first row
  (rounded down to 8), so only a group's last tile is partial (JAX's
  `ragged_dot_mgpu` aligns tiles to a global grid and pays a whole extra tile
  at every group boundary).
* `tgmm(lhs[M, K], grad[M, N]) -> [G, K, N]`: the weight gradient; each group's
  rows are the contraction, read straight from `lhs` (no transpose in HBM).

Skeleton (one CTA per SM, the three warpgroups of kernels/mosaic_pipeline.py):
warpgroup 2 only issues TMA loads into a ring of `stages` shared-memory slots
and never waits for an epilogue, so it runs into the next tile while
warpgroups 0 and 1 drain theirs. Each compute warpgroup owns half of the
tile's rows (64 x tile_n accumulator); when a partial tile leaves a half
empty, that warpgroup skips its wgmmas.

The tile schedule (which group, first row, valid rows) is computed by a few
XLA ops before the kernel, so the kernel never searches group boundaries.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import mosaic_pipeline as pipeline

_ROW_ALIGN = 8  # TMA row offsets into 8-row-tiled smem
_HALF = pipeline.ROWS_PER_CONSUMER  # rows of the tile per compute warpgroup
_NUM_COMPUTE_WGS = pipeline.CONSUMERS


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tile shape of one CTA work item.

  tile_n: output columns per work item (wgmma N; a multiple of 64, <= 256).
  tile_k: contraction per pipeline stage (64 = one 128-byte swizzle row).
  stages: shared-memory ring depth (>= 1).
  Frozen and hashable: the jitted kernels take it as a static argument.
  """
  tile_n: int = 256
  tile_k: int = 64
  stages: int = 3
  no_auto_barriers: bool = True

  def __post_init__(self):
    if self.tile_n % 64 or not 64 <= self.tile_n <= 256:
      raise ValueError(f"TileConfig.tile_n must be 64, 128, 192 or 256, got "
                       f"{self.tile_n}")
    if self.tile_k <= 0 or self.tile_k % 64:
      raise ValueError(f"TileConfig.tile_k must be a positive multiple of 64, "
                       f"got {self.tile_k}")
    if self.stages < 1:
      raise ValueError(f"TileConfig.stages must be >= 1, got {self.stages}")

  @property
  def tile_m(self) -> int:
    return _NUM_COMPUTE_WGS * _HALF


def pick_config(n: int, k: int, *, stages: int | None = None) -> TileConfig:
  """Widest tile that divides N, with a ring that leaves room for a whole-tile
  epilogue buffer (256 x 3 stages won the H200 sweep at every M2 shape, see
  benchmarks/notes/gmm.md)."""
  tile_n = next((t for t in (256, 192, 128, 64) if n % t == 0), None)
  if tile_n is None or k % 64:
    raise ValueError(
        f"gmm mosaic backend needs N % 64 == 0 and K % 64 == 0, got N={n}, "
        f"K={k}")
  if stages is None:
    stages = 3 if tile_n > 128 else 4
  return TileConfig(tile_n=tile_n, tile_k=64, stages=stages)


def _num_sms(interpret: bool) -> int:
  if interpret:
    return 4  # a few simulated SMs keep the interpreter fast
  try:
    return jax.devices("gpu")[0].core_count
  except RuntimeError:  # lowering for a GPU from a CPU-only host
    return 132


def _swizzled(shape, dtype, *, row_tile=8):
  swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((row_tile, elems)),
      plgpu.SwizzleTransform(swizzle)))


def _kernel_call(body, out_type, *, interpret, cfg):
  params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
      unsafe_no_auto_barriers=cfg.no_auto_barriers)
  return pipeline.kernel(body, out_type, grid=(_num_sms(interpret),),
                         grid_names=("sm",), compiler_params=params,
                         interpret=interpret)


# ---------------------------------------------------------------------------
# Schedules (plain XLA, computed before the kernel).


def group_bounds(group_sizes, m):
  """Clamped [start, end) row range of each group."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def row_tile_schedule(group_sizes, m: int, tile_m: int):
  """Row tiles from each group's first row (rounded down to 8), zero tiles.

  TMA copies of 8-row-tiled shared memory need row offsets that are multiples
  of 8, so a group's first tile may start up to 7 rows early; rows outside
  [lo, hi) of a tile are computed but never stored. Returns (group, row, lo,
  hi, num_tiles); group -1 marks a tile of rows past sum(group_sizes), which
  the kernel fills with zeros.
  """
  g = group_sizes.shape[0]
  starts, ends = group_bounds(group_sizes, m)
  total = ends[-1]
  first = starts // _ROW_ALIGN * _ROW_ALIGN
  ntiles = jnp.where(ends > starts, (ends - first + tile_m - 1) // tile_m, 0)
  tile_end = jnp.cumsum(ntiles)
  tile_begin = tile_end - ntiles
  n_group_tiles = tile_end[-1]
  tail_first = total // _ROW_ALIGN * _ROW_ALIGN
  n_tail = (m - tail_first + tile_m - 1) // tile_m * (total < m)
  max_tiles = m // tile_m + g + 2
  t = jnp.arange(max_tiles, dtype=jnp.int32)
  gi = jnp.sum(tile_end[None, :] <= t[:, None], axis=1).astype(jnp.int32)
  in_group = gi < g
  gc = jnp.minimum(gi, g - 1)
  row = jnp.where(in_group, first[gc] + (t - tile_begin[gc]) * tile_m,
                  tail_first + (t - n_group_tiles) * tile_m)
  lo = jnp.maximum(jnp.where(in_group, starts[gc], total) - row, 0)
  hi = jnp.clip(jnp.where(in_group, ends[gc], m) - row, 0, tile_m)
  group = jnp.where(in_group, gc, -1)
  num_tiles = (n_group_tiles + n_tail).reshape(1)
  return group, row, lo, hi, num_tiles


# ---------------------------------------------------------------------------
# Shared pieces of the two kernels.


def _epi_cols(dtype):
  return 128 // jnp.dtype(dtype).itemsize  # one 128-byte swizzle row


_SMEM_BYTES = 227 * 1024 - 1024  # per block, less room for the barriers


def _out_slots(n_out, dtype, ring_bytes):
  """Epilogue slots per warpgroup: one per 128-byte-wide chunk if they fit.

  With a slot per chunk the epilogue writes the whole tile, fences once and
  issues all stores; with fewer it cycles through them, waiting on stores.
  Cycling needs a slot count that divides the chunks: the wait before a
  slot's reuse counts the store groups of earlier work items too, so each
  item must start where the last one left the cycle (slot 0).
  """
  slot_bytes = _NUM_COMPUTE_WGS * _HALF * 128
  fit = (_SMEM_BYTES - ring_bytes) // slot_bytes
  if fit < 2:
    raise ValueError("gmm tile config leaves no shared memory for the "
                     "epilogue; use fewer stages or a narrower tile")
  chunks = n_out // _epi_cols(dtype)
  return max(d for d in range(1, min(chunks, fit) + 1) if chunks % d == 0)


def _out_smem(dtype, slots):
  """Store slots per compute warpgroup, tiled by single rows."""
  return _swizzled((_NUM_COMPUTE_WGS, slots, _HALF, _epi_cols(dtype)), dtype,
                   row_tile=1)


def _store_rows(src_at, dst, row0, lo, count):
  """TMA-stores rows [lo, lo+count) of a 64-row smem block to dst[row0+lo..].

  A TMA box has a static size, so a partial block goes out as a ladder of
  power-of-two row slabs (the smem side is tiled by single rows for this).
  """
  @pl.when(count == _HALF)
  def _():
    plgpu.copy_smem_to_gmem(src_at(pl.ds(0, _HALF)),
                            dst.at[pl.ds(row0, _HALF)], commit_group=False)

  @pl.when(count < _HALF)
  def _():
    off = lo
    size = _HALF // 2
    while size:
      @pl.when((count & size) != 0)
      def _(off=off, size=size):
        plgpu.copy_smem_to_gmem(src_at(pl.ds(off, size)),
                                dst.at[pl.ds(row0 + off, size)],
                                commit_group=False)
      off = off + (count & size)
      size //= 2


def _epilogue(parts, out_smem, wg, row0, lo, count):
  """Writes rows [lo, lo+count) of a warpgroup's [64, n] results to gmem.

  `parts` lists (value, dst_cols) pairs, one per output: the kernel's output
  columns go out in 128-byte chunks, `dst_cols(c)` being chunk c's columns.
  """
  epi_n, slots = out_smem.shape[-1], out_smem.shape[1]
  chunks = []
  for val, dst_cols in parts:
    val = val.astype(out_smem.dtype)
    chunks += [(val[:, c * epi_n:(c + 1) * epi_n], dst_cols(c))
               for c in range(val.shape[1] // epi_n)]

  def store(dst, slot):
    _store_rows(lambda r: out_smem.at[wg, slot, r], dst, row0, lo, count)

  @pl.when(count > 0)
  def _():
    if slots >= len(chunks):  # the whole tile at once: one fence, one wait
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for slot, (val, _) in enumerate(chunks):
        out_smem[wg, slot] = val
      plgpu.commit_smem()
      for slot, (_, dst) in enumerate(chunks):
        store(dst, slot)
      plgpu.commit_smem_to_gmem_group()
      return
    assert len(chunks) % slots == 0, (len(chunks), slots)  # _out_slots
    for c, (val, dst) in enumerate(chunks):
      plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      out_smem[wg, c % slots] = val
      plgpu.commit_smem()
      store(dst, c % slots)
      plgpu.commit_smem_to_gmem_group()


def _snake_items(num_items, num_sms, sm=None):
  """(count, item) of program `sm` (this one if None) for work items dealt
  out in a snake: wave i gives item i * num_sms + lane to each program,
  lane = sm in even waves and num_sms - 1 - sm in odd ones. With the items
  sorted by cost, largest first, every program then gets a similar total:
  round-robin would give program 0 the largest item of every wave."""
  sm = lax.axis_index("sm") if sm is None else sm
  lane = lambda i: jnp.where(lax.rem(i, 2) == 0, sm, num_sms - 1 - sm)
  full = num_items // num_sms
  count = full + (lane(full) < num_items - full * num_sms).astype(jnp.int32)
  return count, lambda i: i * num_sms + lane(i)


def _my_half(wg):
  return pl.ds(pl.multiple_of(wg * _HALF, _HALF), _HALF)


def _my_items(num_items, num_sms):
  sm = lax.axis_index("sm")
  return sm, jnp.maximum(num_items - sm + num_sms - 1, 0) // num_sms


def _pipelined_k_loop(nsteps, step0, stages, produced, consumed, mma):
  """Consumer side of the ring: wait for slot, mma, release previous slot."""
  def body(kk, _):
    s = step0 + kk
    slot = lax.rem(s, stages)
    plgpu.barrier_wait(produced.at[slot])
    mma(kk, slot)
    plgpu.wgmma_wait(1)

    @pl.when(kk > 0)
    def _():
      plgpu.barrier_arrive(consumed.at[lax.rem(s - 1, stages)])

  @pl.when(nsteps > 0)
  def _():
    lax.fori_loop(0, nsteps, body, None)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(consumed.at[lax.rem(step0 + nsteps - 1, stages)])


def _persistent(wg, my_count, stages, consumed, produce, consume):
  """The persistent loop shared by gmm and tgmm, on the warp-specialised
  split of kernels/mosaic_pipeline.py: one ring runs through all of this
  program's work items. `produce(i, step)` and `consume(i, step)` handle
  work item i, whose k loop starts at pipeline step `step`, and return its
  number of k steps."""
  loop = lambda fn: lax.fori_loop(
      0, my_count, lambda i, step: step + fn(i, step), jnp.int32(0))

  def consumer():
    loop(consume)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pipeline.warp_specialised(
      wg, lambda: pipeline.drain(loop(produce), stages, [consumed]), consumer)


# ---------------------------------------------------------------------------
# gmm: out[rows of g] = lhs[rows of g] @ rhs[g]   (rhs[g]^T if transpose_rhs)


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None,
        config: TileConfig | None = None, interpret: bool = False,
        epilogue_fn=None,
        rhs2=None):
  """Grouped matmul on Hopper. rhs is [G, K, N] ([G, N, K] if transpose_rhs).

  With `rhs2` (same shape as rhs) and `epilogue_fn`, each work item computes
  `epilogue_fn(lhs@rhs[:, :, cols], lhs@rhs2[:, :, cols])`: the fused
  SwiGLU path (tile_n/2 columns from each weight, output tile_n/2 wide).
  An `epilogue_fn` that returns a tuple gives one [M, N] output per element
  (e.g. the SwiGLU and both products, kept for the backward pass).
  """
  m, k = lhs.shape
  if transpose_rhs:
    g, n, k2 = rhs.shape
  else:
    g, k2, n = rhs.shape
  if k != k2:
    raise ValueError(
        f"gmm: contraction mismatch lhs {lhs.shape} rhs {rhs.shape}")
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  fused = rhs2 is not None
  if fused != (epilogue_fn is not None):
    raise ValueError("gmm: rhs2 and epilogue_fn go together (the fused "
                     "two-weight product and what combines it)")
  cfg = config or pick_config(2 * n if fused else n, k)
  tn, tk, stages = cfg.tile_n, cfg.tile_k, cfg.stages
  wn = tn // 2 if fused else tn  # columns of each weight per work item
  if n % wn or k % tk:
    raise ValueError(f"gmm: tile {cfg} does not divide N={n}, K={k}")
  epi_n = _epi_cols(out_dtype)
  num_sms = _num_sms(interpret)
  n_tiles_n = n // wn
  k_steps = k // tk
  m_pad = -m % _ROW_ALIGN  # the 8-row-tiled TMA view needs M % 8 == 0
  if m_pad:
    lhs = jnp.pad(lhs, ((0, m_pad), (0, 0)))
  schedule = row_tile_schedule(group_sizes, m + m_pad, cfg.tile_m)
  n_outs = 1
  if fused:  # how many outputs the epilogue gives, from its abstract value
    acc = jax.ShapeDtypeStruct((_HALF, wn), jnp.float32)
    outs = jax.eval_shape(epilogue_fn, acc, acc)
    n_outs = len(outs) if isinstance(outs, tuple) else 1

  def body(tg_ref, tr_ref, tlo_ref, thi_ref, nt_ref, lhs_ref, rhs_ref, *rest):
    rhs2_ref = rest[0] if fused else None
    out_refs = rest[1:] if fused else rest
    num_items = nt_ref[0] * n_tiles_n
    sm, my_count = _my_items(num_items, num_sms)
    b_shape = (stages, wn, tk) if transpose_rhs else (stages, tk, wn)
    ring = stages * tk * (cfg.tile_m + wn * (2 if fused else 1)) * 2
    scratch = dict(
        a_smem=_swizzled((stages, cfg.tile_m, tk), lhs.dtype),
        b_smem=_swizzled(b_shape, rhs.dtype),
        out_smem=_out_smem(out_dtype,
                           _out_slots(n_outs * wn, out_dtype, ring)),
        produced=plgpu.Barrier(num_arrivals=3 if fused else 2,
                               num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS,
                               num_barriers=stages),
    )
    if fused:
      scratch["b2_smem"] = _swizzled(b_shape, rhs.dtype)

    def item(i):
      w = sm + i * num_sms
      t = lax.div(w, n_tiles_n)
      nt = lax.rem(w, n_tiles_n)
      row = pl.multiple_of(tr_ref[t], _ROW_ALIGN)
      return nt, tg_ref[t], row, tlo_ref[t], thi_ref[t]

    def b_src(ref, grp, nt, kk):
      if transpose_rhs:
        return ref.at[grp, pl.ds(nt * wn, wn), pl.ds(kk * tk, tk)]
      return ref.at[grp, pl.ds(kk * tk, tk), pl.ds(nt * wn, wn)]

    def scoped(a_smem, b_smem, out_smem, produced, consumed, b2_smem=None):
      wg = lax.axis_index("wg")

      def produce(i, step):
        nt, grp, row0, _, _ = item(i)
        nsteps = jnp.where(grp >= 0, k_steps, 0)

        def issue(kk, slot):
          plgpu.copy_gmem_to_smem(
              lhs_ref.at[pl.ds(row0, cfg.tile_m), pl.ds(kk * tk, tk)],
              a_smem.at[slot], produced.at[slot])
          plgpu.copy_gmem_to_smem(b_src(rhs_ref, grp, nt, kk),
                                  b_smem.at[slot], produced.at[slot])
          if fused:
            plgpu.copy_gmem_to_smem(b_src(rhs2_ref, grp, nt, kk),
                                    b2_smem.at[slot], produced.at[slot])
        pipeline.produce(nsteps, stages, [(consumed, issue)], first_step=step)
        return nsteps

      def consume(i, step):
        nt, grp, row0, lo, hi = item(i)
        nsteps = jnp.where(grp >= 0, k_steps, 0)
        my_lo = jnp.clip(lo - wg * _HALF, 0, _HALF)
        my_rows = jnp.clip(hi - wg * _HALF, 0, _HALF) - my_lo

        def mma_one(acc_ref, src, slot):
          b = src.at[slot]
          if transpose_rhs:
            b = b.T
          a = a_smem.at[slot, _my_half(wg)]

          @pl.when(my_rows > 0)
          def _():
            plgpu.wgmma(acc_ref, a, b)

        def acc_scope(acc_ref, acc2_ref=None):
          def mma(kk, slot):
            del kk
            mma_one(acc_ref, b_smem, slot)
            if fused:
              mma_one(acc2_ref, b2_smem, slot)
          _pipelined_k_loop(nsteps, step, stages, produced, consumed, mma)
          if fused:
            return acc_ref[...], acc2_ref[...]
          return acc_ref[...]

        if fused:
          vals = epilogue_fn(*pl.run_scoped(
              acc_scope, plgpu.ACC((_HALF, wn)), plgpu.ACC((_HALF, wn))))
        else:
          vals = pl.run_scoped(acc_scope, plgpu.ACC((_HALF, wn)))
        vals = vals if isinstance(vals, tuple) else (vals,)

        def dst_cols(out_ref):
          return lambda c: out_ref.at[:, pl.ds(nt * wn + c * epi_n, epi_n)]
        _epilogue([(v, dst_cols(o)) for v, o in zip(vals, out_refs)],
                  out_smem, wg, row0 + wg * _HALF, my_lo, my_rows)
        return nsteps

      _persistent(wg, my_count, stages, consumed, produce, consume)

    pl.run_scoped(scoped, **scratch, collective_axes="wg")

  operands = [*schedule, lhs, rhs]
  if fused:
    operands.append(rhs2)
  out_type = jax.ShapeDtypeStruct((m + m_pad, n), out_dtype)
  call = _kernel_call(body, (out_type,) * n_outs, interpret=interpret,
                      cfg=cfg)
  outs = tuple(o[:m] if m_pad else o for o in call(*operands))
  return outs if n_outs > 1 else outs[0]


# ---------------------------------------------------------------------------
# tgmm: out[g] = lhs[rows of g]^T @ grad[rows of g]


def tgmm(lhs, grad, group_sizes, *, out_dtype=None,
         config: TileConfig | None = None, interpret: bool = False):
  """Transposed grouped matmul: [M, K] x [M, N] -> [G, K, N]."""
  m, k = lhs.shape
  m2, n = grad.shape
  if m != m2:
    raise ValueError(f"tgmm: row mismatch lhs {lhs.shape} grad {grad.shape}")
  g = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  cfg = config or pick_config(n, k)
  tn, tk, stages = cfg.tile_n, cfg.tile_k, cfg.stages
  tm = cfg.tile_m  # output rows (K of lhs) per work item
  if k % tm or n % tn:
    raise ValueError(f"tgmm: K={k} must divide by {tm} and N={n} by {tn}")
  kt_n, nt_n = k // tm, n // tn
  per_group = kt_n * nt_n
  epi_n = _epi_cols(out_dtype)
  num_sms = _num_sms(interpret)
  m_pad = -m % _ROW_ALIGN  # the 8-row-tiled TMA view needs M % 8 == 0
  if m_pad:
    lhs = jnp.pad(lhs, ((0, m_pad), (0, 0)))
    grad = jnp.pad(grad, ((0, m_pad), (0, 0)))
  starts, ends = group_bounds(group_sizes, m)
  # A work item's k loop runs over its group's rows, so uneven groups give
  # uneven items: the largest groups go first, dealt out in a snake.
  by_size = jnp.argsort(starts - ends, stable=True).astype(jnp.int32)

  def body(starts_ref, ends_ref, by_size_ref, lhs_ref, grad_ref, out_ref):
    my_count, my_item = _snake_items(g * per_group, num_sms)
    scratch = dict(
        a_smem=_swizzled((stages, tk, tm), lhs.dtype),
        b_smem=_swizzled((stages, tk, tn), grad.dtype),
        out_smem=_out_smem(out_dtype, _out_slots(
            tn, out_dtype, stages * tk * (tm + tn) * 2)),
        produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS,
                               num_barriers=stages),
    )

    def item(i):
      w = my_item(i)
      grp = by_size_ref[lax.div(w, per_group)]
      r = lax.rem(w, per_group)
      start, end = starts_ref[grp], ends_ref[grp]
      first = pl.multiple_of(lax.div(start, _ROW_ALIGN) * _ROW_ALIGN,
                             _ROW_ALIGN)
      nsteps = jnp.where(end > start, lax.div(end - first + tk - 1, tk), 0)
      return (grp, lax.div(r, nt_n), lax.rem(r, nt_n), first, start - first,
              end - first, nsteps)

    def scoped(a_smem, b_smem, out_smem, produced, consumed):
      wg = lax.axis_index("wg")

      def produce(i, step):
        _, kt, nt, first, _, _, nsteps = item(i)

        def issue(kk, slot):
          rows = pl.ds(first + kk * tk, tk)
          plgpu.copy_gmem_to_smem(lhs_ref.at[rows, pl.ds(kt * tm, tm)],
                                  a_smem.at[slot], produced.at[slot])
          plgpu.copy_gmem_to_smem(grad_ref.at[rows, pl.ds(nt * tn, tn)],
                                  b_smem.at[slot], produced.at[slot])
        pipeline.produce(nsteps, stages, [(consumed, issue)], first_step=step)
        return nsteps

      def consume(i, step):
        grp, kt, nt, _, lo, hi, nsteps = item(i)

        def acc_scope(acc_ref):
          def mma(kk, slot):
            a = a_smem.at[slot, :, _my_half(wg)]

            # Block rows outside [lo, hi) belong to the neighbouring groups
            # (or lie past M): zero this warpgroup's half of them first.
            r0 = kk * tk
            @pl.when(((kk == 0) & (lo > 0)) | (r0 + tk > hi))
            def _():
              rows = r0 + plgpu.layout_cast(
                  lax.broadcasted_iota(jnp.int32, (tk, _HALF), 0),
                  plgpu.Layout.WGMMA)
              a[...] = jnp.where((rows >= lo) & (rows < hi), a[...],
                                 jnp.zeros_like(a[...]))
              plgpu.commit_smem()
            plgpu.wgmma(acc_ref, a.T, b_smem.at[slot])
          _pipelined_k_loop(nsteps, step, stages, produced, consumed, mma)
          return acc_ref[...]

        val = pl.run_scoped(acc_scope, plgpu.ACC((_HALF, tn)))

        def dst_cols(c):
          return out_ref.at[grp, :, pl.ds(nt * tn + c * epi_n, epi_n)]
        _epilogue([(val, dst_cols)], out_smem, wg, kt * tm + wg * _HALF,
                  0, jnp.int32(_HALF))
        return nsteps

      _persistent(wg, my_count, stages, consumed, produce, consume)

    pl.run_scoped(scoped, **scratch, collective_axes="wg")

  call = _kernel_call(body, jax.ShapeDtypeStruct((g, k, n), out_dtype),
                      interpret=interpret, cfg=cfg)
  return call(starts, ends, by_size, lhs, grad)
