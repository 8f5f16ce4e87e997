"""Grouped-matmul benchmark cases (used by experiments/bench_gmm.py).

Routing generators, our kernels and the peer implementations wrapped to one
calling convention, and float32 references of sampled outputs (the timer and
the error metric are benchmarks/timing.py). Every candidate is a function
`(x[M,K], w[G,K,N], group_sizes, cot[M,N]) -> outputs`; forward candidates
return out[M,N], forward+backward ones return (out, dx, dw).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import tokamax_ops
from kernels import gmm as gmm_lib
from kernels import gmm_mosaic

# ---------------------------------------------------------------------------
# Routing: group sizes of top-k routing of T tokens over E experts.


def group_sizes(tokens, experts, top_k, routing, seed=0, zipf_s=1.0):
  """Per-expert row counts; every token picks top_k distinct experts.

  "uniform": experts drawn uniformly; "zipf": expert e drawn with weight
  1 / (e + 1)**zipf_s (Gumbel top-k sampling without replacement).
  """
  rng = np.random.default_rng(seed)
  logits = np.zeros(experts)
  if routing == "zipf":
    logits = -zipf_s * np.log(np.arange(1, experts + 1))
  elif routing != "uniform":
    raise ValueError(f"routing must be uniform or zipf, got {routing!r}")
  counts = np.zeros(experts, np.int64)
  for lo in range(0, tokens, 4096):
    n = min(4096, tokens - lo)
    keys = logits + rng.gumbel(size=(n, experts))
    picks = np.argsort(-keys, axis=1)[:, :top_k]
    counts += np.bincount(picks.ravel(), minlength=experts)
  return counts.astype(np.int32)


# ---------------------------------------------------------------------------
# Candidates.


def ours_fwd(config=None):
  """kernels.gmm with the Mosaic tiles `config` (None: its own pick)."""
  def f(x, w, gs, cot):
    del cot
    return gmm_lib.gmm(x, w, gs, backend="mosaic", tiles=config)
  return f


def ours_fwdbwd():
  def f(x, w, gs, cot):
    out, vjp = jax.vjp(lambda a, b: gmm_lib.gmm(a, b, gs, backend="mosaic"),
                       x, w)
    return (out, *vjp(cot))
  return f


def ours_swiglu_fwd():
  """Fused silu(x@w1)*(x@w3) with w1 = w, w3 = w (same flops as 2 gmms)."""
  def f(x, w, gs, cot):
    del cot
    return gmm_lib.gmm_swiglu(x, w, w, gs, backend="mosaic")
  return f


def unfused_swiglu_fwd():
  def f(x, w, gs, cot):
    del cot
    a = gmm_lib.gmm(x, w, gs, backend="mosaic")
    b = gmm_lib.gmm(x, w, gs, backend="mosaic")
    return jax.nn.silu(a.astype(jnp.float32)).astype(a.dtype) * b
  return f


def dense_fwd():
  def f(x, w, gs, cot):
    del gs, cot
    return jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype)
  return f


def dense_fwdbwd():
  def f(x, w, gs, cot):
    del gs
    out, vjp = jax.vjp(lambda a, b: jnp.dot(a, b), x, w[0])
    return (out, *vjp(cot))
  return f


def xla_fwd():
  def f(x, w, gs, cot):
    del cot
    return jax.lax.ragged_dot(x, w, gs)
  return f


def xla_fwdbwd():
  def f(x, w, gs, cot):
    out, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), x, w)
    return (out, *vjp(cot))
  return f


def tokamax_fwd(config=None):
  import tokamax
  op = tokamax_ops.ragged_dot_op(config)

  def f(x, w, gs, cot):
    del cot
    return tokamax.ragged_dot(x, w, gs, implementation=[op])
  return f


def tokamax_fwdbwd(config=None):
  """Forward with `config`; tokamax's own VJP (its default configs)."""
  import tokamax
  op = tokamax_ops.ragged_dot_op(config)

  def f(x, w, gs, cot):
    out, vjp = jax.vjp(
        lambda a, b: tokamax.ragged_dot(a, b, gs, implementation=[op]), x, w)
    return (out, *vjp(cot))
  return f


def jax_mgpu_fwd(block_m, block_n, steps, grid_block_n, transpose=False):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  def f(x, w, gs, cot):
    if transpose:  # dlhs = cot @ w^T: w read as [G, N_out=K, K_in=N]
      x = cot
    return ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=gs, block_m=block_m, block_n=block_n, block_k=64,
        max_concurrent_steps=steps, grid_block_n=grid_block_n,
        transpose_rhs=transpose)
  return f


def jax_mgpu_tgmm(block_m, block_n, steps):
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t

  def f(x, w, gs, cot):
    del w
    return t.transposed_ragged_dot(
        x, cot, group_sizes=gs, block_m=block_m, block_n=block_n, block_k=64,
        max_concurrent_steps=steps, grid_block_n=1)
  return f


def ours_tgmm(config=None):
  def f(x, w, gs, cot):
    del w
    return gmm_mosaic.tgmm(x, cot, gs, config=config)
  return f


def ours_dlhs(config=None):
  def f(x, w, gs, cot):
    del x
    return gmm_mosaic.gmm(cot, w, gs, transpose_rhs=True, config=config)
  return f


# ---------------------------------------------------------------------------
# References.


@functools.partial(jax.jit, static_argnums=(4,))
def sampled_reference(x, w, gs, rows, transpose=False):
  """float32 reference of rows `rows` of gmm(x, w) (of x @ w^T if transpose)."""
  ends = jnp.cumsum(gs)
  gid = jnp.searchsorted(ends, rows, side="right")
  valid = gid < gs.shape[0]
  wg = w[jnp.minimum(gid, gs.shape[0] - 1)].astype(jnp.float32)
  xr = x[rows].astype(jnp.float32)
  spec = "rn,rkn->rk" if transpose else "rk,rkn->rn"
  return jnp.where(valid[:, None], jnp.einsum(spec, xr, wg), 0.0)


@jax.jit
def group_reference(x, cot, start, size):
  """float32 x[rows]^T @ cot[rows] for one group, rows [start, start+size)."""
  r = jnp.arange(x.shape[0])
  keep = ((r >= start) & (r < start + size))[:, None]
  xs = jnp.where(keep, x.astype(jnp.float32), 0.0)
  return xs.T @ cot.astype(jnp.float32)
