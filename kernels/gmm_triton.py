"""Portable Pallas grouped matmuls (Triton lowering) with the Hopper tiling.

Same row schedule as `gmm_mosaic` (row tiles of 128 from each group's first
row rounded down to 8, zero-fill tiles past sum(group_sizes), 64-row
contraction blocks for the weight gradient), written with plain refs, jnp
ops and a masked store. `interpret=True` runs it in Pallas' portable
interpreter on any host: the tests' CPU check of the tiling. It lowers for
CUDA (tests/test_gmm.py checks that), but on an H100 with jax 0.11.2
Triton refuses to compile it ("scf.for op failed to verify that all of
{lowerBound, upperBound, step} have same type": the loops' trip counts are
read from the schedule at run time), so kernels/gmm.py runs it only when
interpreting. It is the simple variant of the same schedule: no TMA ring,
no warp specialisation; tiles of at most 128 x 128.

Neighbouring row tiles overlap (a group's first tile starts up to 7 rows
early), so each tile stores only its own rows [lo, hi), under a mask: a
read-modify-write of the whole tile would race with the neighbour's on a GPU.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels import gmm_mosaic

_TILE_M = 128  # rows per tile (the Mosaic kernel's tile_m)
_TILE_K = 64  # contraction per step (one 128-byte bf16 row)


def _tile(n, cap=128):
  """The largest power of two <= cap dividing n (Triton tiles are powers of
  two)."""
  return next(t for t in (128, 64, 32, 16, 8, 4, 2, 1)
              if t <= cap and n % t == 0)


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, out_dtype=None,
        out_init=None, interpret: bool = False):
  """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g]^T if transpose_rhs).

  lhs [M, K]; rhs [G, K, N] ([G, N, K] if transpose_rhs) -> [M, N].
  out_init (optional, [M, N]) is aliased to the output, so a poisoned buffer
  shows any element the kernel fails to write.
  """
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  tn, tk = _tile(n), _tile(k, _TILE_K)
  group, row, lo, hi, num_tiles = gmm_mosaic.row_tile_schedule(
      group_sizes, m, _TILE_M)
  lhs_p = jnp.pad(lhs, ((0, _TILE_M), (0, 0)))  # tiles may run past M
  if out_init is None:
    out_init = jnp.zeros((m, n), out_dtype)
  out_p = jnp.pad(out_init.astype(out_dtype), ((0, _TILE_M), (0, 0)))

  def body(group_ref, row_ref, lo_ref, hi_ref, nt_ref, lhs_ref, rhs_ref,
           _, out_ref):
    t, j = pl.program_id(0), pl.program_id(1)
    grp, r0 = group_ref[t], row_ref[t]
    cols = pl.ds(j * tn, tn)

    def step(kk, acc):
      ks = pl.ds(kk * tk, tk)
      x = lhs_ref[pl.ds(r0, _TILE_M), ks]
      w = rhs_ref[grp, cols, ks].T if transpose_rhs else rhs_ref[grp, ks, cols]
      return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    # Zero-fill tiles (group -1) run no steps and store zeros.
    nsteps = jnp.where(grp >= 0, k // tk, 0)
    acc = lax.fori_loop(0, nsteps, step, jnp.zeros((_TILE_M, tn), jnp.float32))
    r = lax.broadcasted_iota(jnp.int32, (_TILE_M, tn), 0)
    keep = (r >= lo_ref[t]) & (r < hi_ref[t]) & (t < nt_ref[0])
    pltriton.store(out_ref.at[pl.ds(r0, _TILE_M), cols],
                   acc.astype(out_ref.dtype), mask=keep)

  out = pl.pallas_call(
      body,
      grid=(group.shape[0], n // tn),
      out_shape=jax.ShapeDtypeStruct(out_p.shape, out_dtype),
      input_output_aliases={7: 0},
      interpret=interpret,
  )(group, row, lo, hi, num_tiles, lhs_p, rhs, out_p)
  return out[:m]


def tgmm(lhs, grad, group_sizes, *, out_dtype=None, out_init=None,
         interpret: bool = False):
  """out[g] = lhs[rows of g]^T @ grad[rows of g], in 64-row blocks.

  lhs [M, K], grad [M, N] -> [G, K, N]; empty groups give zeros.
  """
  m, k = lhs.shape
  n = grad.shape[1]
  g = group_sizes.shape[0]
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  tk_out, tn = _tile(k), _tile(n)
  starts, ends = gmm_mosaic.group_bounds(group_sizes, m)
  pad = ((0, _TILE_K), (0, 0))
  lhs_p, grad_p = jnp.pad(lhs, pad), jnp.pad(grad, pad)
  if out_init is None:
    out_init = jnp.zeros((g, k, n), out_dtype)

  def body(starts_ref, ends_ref, lhs_ref, grad_ref, _, out_ref):
    gi, kt, nt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[gi], ends_ref[gi]
    first = start // 8 * 8
    nsteps = jnp.where(end > start, (end - first + _TILE_K - 1) // _TILE_K, 0)

    def step(s, acc):
      r0 = first + s * _TILE_K
      rows = r0 + lax.broadcasted_iota(jnp.int32, (_TILE_K, 1), 0)
      keep = (rows >= start) & (rows < end)
      a = lhs_ref[pl.ds(r0, _TILE_K), pl.ds(kt * tk_out, tk_out)]
      a = jnp.where(keep, a, jnp.zeros_like(a))
      b = grad_ref[pl.ds(r0, _TILE_K), pl.ds(nt * tn, tn)]
      return acc + jnp.dot(a.T, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nsteps, step, jnp.zeros((tk_out, tn), jnp.float32))
    out_ref[gi, pl.ds(kt * tk_out, tk_out), pl.ds(nt * tn, tn)] = (
        acc.astype(out_ref.dtype))

  return pl.pallas_call(
      body,
      grid=(g, k // tk_out, n // tn),
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      input_output_aliases={4: 0},
      interpret=interpret,
  )(starts, ends, lhs_p, grad_p, out_init.astype(out_dtype))
