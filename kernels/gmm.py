"""Grouped matrix multiplication: the entry point the MoE experts call.

`gmm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> [M, N]` multiplies rows
`[start_g, start_g + group_sizes[g])` of `lhs` by `rhs[g]`, with
`jax.lax.ragged_dot` semantics: rows past `sum(group_sizes)` give zeros,
groups may be empty, accumulation is float32.

Backends:
  "xla"    `jax.lax.ragged_dot` (kernels/gmm_ref.py), differentiated by JAX.
  "pallas" the Hopper kernels (kernels/gmm_mosaic.py) with a custom VJP:
           dlhs = gmm(grad, rhs^T), drhs = tgmm(lhs, grad).
  "auto"   "pallas" on a GPU when the shapes suit it, else "xla".
`interpret=True` runs the same Mosaic GPU kernels in Pallas' GPU interpreter
(CPU, slow, tiny shapes); `interpret="portable"` runs the portable Pallas
variant of the same tiling (kernels/gmm_portable.py).

Example:
  out_MxN = gmm(x_MxK, w_GxKxN, group_sizes_G)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import gmm_mosaic
from kernels import gmm_portable
from kernels import gmm_ref

BACKENDS = ("auto", "xla", "pallas")
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

# The kernels behind one jit each: every layer calling them with the same
# shapes gets the same traced jaxpr, which JAX lowers once per program (a
# shared function), so Mosaic builds and compiles each kernel once per train
# step instead of once per layer and use.
_STATIC = ("transpose_rhs", "out_dtype", "config", "interpret", "epilogue_fn")
_mosaic_gmm = jax.jit(gmm_mosaic.gmm, static_argnames=_STATIC)
_mosaic_tgmm = jax.jit(gmm_mosaic.tgmm,
                       static_argnames=("out_dtype", "config", "interpret"))


def _check_backend(backend):
  if backend not in BACKENDS:
    raise ValueError(f"gmm backend must be one of {BACKENDS}, got {backend!r}")


def _on_gpu():
  return jax.default_backend() == "gpu"


def _pallas_supported(lhs, k, n, n_multiple):
  # K % 128: the weight-gradient kernel tiles K by 128 output rows.
  return lhs.dtype in _KERNEL_DTYPES and k % 128 == 0 and n % n_multiple == 0


def _mode(backend, interpret, lhs, k, n, n_multiple=64):
  """The implementation: xla, mosaic, mosaic_interpret or portable."""
  _check_backend(backend)
  if backend == "xla":
    return "xla"
  if interpret == "portable":
    return "portable"
  if interpret:
    return "mosaic_interpret"
  if backend == "auto":
    supported = _pallas_supported(lhs, k, n, n_multiple)
    return "mosaic" if _on_gpu() and supported else "xla"
  if not _pallas_supported(lhs, k, n, n_multiple):
    raise ValueError(
        f"gmm backend='pallas' needs bf16/f16 inputs with K % 128 == 0 and "
        f"N % {n_multiple} == 0; got {lhs.dtype}, K={k}, N={n}")
  if _on_gpu():
    return "mosaic"
  if interpret is None:
    return "mosaic_interpret"
  raise ValueError("gmm backend='pallas' needs a GPU or interpret=True")


def _validate(lhs, rhs, group_sizes):
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(
        f"gmm expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
        f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"gmm: lhs K={lhs.shape[1]} != rhs K={rhs.shape[1]}")
  if group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"gmm: {group_sizes.shape[0]} group sizes for "
                     f"{rhs.shape[0]} groups in rhs")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"gmm: group_sizes must be integers, got "
                     f"{group_sizes.dtype}")


def _fwd_kernel(mode, lhs, rhs, gs, out_dtype, transpose_rhs=False):
  if mode == "portable":
    return gmm_portable.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs,
                            out_dtype=out_dtype)
  return _mosaic_gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs,
                     out_dtype=out_dtype, interpret=mode == "mosaic_interpret")


def _tgmm_kernel(mode, lhs, grad, gs, out_dtype):
  if mode == "portable":
    return gmm_portable.tgmm(lhs, grad, gs, out_dtype=out_dtype)
  return _mosaic_tgmm(lhs, grad, gs, out_dtype=out_dtype,
                      interpret=mode == "mosaic_interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_kernel(lhs, rhs, group_sizes, out_dtype, mode):
  return _fwd_kernel(mode, lhs, rhs, group_sizes, out_dtype)


def _gmm_kernel_fwd(lhs, rhs, group_sizes, out_dtype, mode):
  out = _fwd_kernel(mode, lhs, rhs, group_sizes, out_dtype)
  return out, (lhs, rhs, group_sizes)


def _gmm_kernel_bwd(out_dtype, mode, res, grad):
  del out_dtype
  lhs, rhs, group_sizes = res
  # The tensor cores take both operands in one dtype: the cotangent is cast to
  # the input dtype (bf16), accumulation stays float32.
  grad = grad.astype(lhs.dtype)
  dlhs = _fwd_kernel(mode, grad, rhs, group_sizes, lhs.dtype,
                     transpose_rhs=True)
  drhs = _tgmm_kernel(mode, lhs, grad, group_sizes, rhs.dtype)
  dgs = np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)
  return dlhs, drhs, dgs


_gmm_kernel.defvjp(_gmm_kernel_fwd, _gmm_kernel_bwd)


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, backend="auto",
        interpret=None):
  """Grouped matmul [M, K] x [G, K, N] -> [M, N]. See the module docstring."""
  _validate(lhs, rhs, group_sizes)
  mode = _mode(backend, interpret, lhs, rhs.shape[1], rhs.shape[2])
  if mode == "xla":
    return gmm_ref.gmm_ref(lhs, rhs, group_sizes,
                           preferred_element_type=preferred_element_type)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"gmm pallas backend needs equal dtypes, got {lhs.dtype} "
                     f"and {rhs.dtype}")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  return _gmm_kernel(lhs, rhs, group_sizes.astype(jnp.int32), out_dtype, mode)


def tgmm(lhs, grad, group_sizes, *, preferred_element_type=None,
         backend="auto", interpret=None):
  """Transposed grouped matmul [M, K] x [M, N] -> [G, K, N] (weight gradient).

  out[g] = lhs[rows of g]^T @ grad[rows of g]; empty groups give zeros.
  """
  if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
    raise ValueError(f"tgmm expects lhs [M, K] and grad [M, N]; got "
                     f"{lhs.shape}, {grad.shape}")
  k, n = lhs.shape[1], grad.shape[1]
  mode = _mode(backend, interpret, lhs, k, n)
  if mode == "xla":
    return gmm_ref.tgmm_ref(lhs, grad, group_sizes,
                            preferred_element_type=preferred_element_type)
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  return _tgmm_kernel(mode, lhs, grad.astype(lhs.dtype),
                      group_sizes.astype(jnp.int32), out_dtype)


def gmm_swiglu(lhs, w1, w3, group_sizes, *, backend="auto", interpret=None):
  """silu(gmm(lhs, w1)) * gmm(lhs, w3): the experts' gated up-projection.

  The "pallas" backend computes both products in one kernel (lhs tiles read
  once, the gate applied in the epilogue); the backward recomputes the two
  products and reuses gmm/tgmm.
  """
  _validate(lhs, w1, group_sizes)
  if w1.shape != w3.shape:
    raise ValueError(f"gmm_swiglu: w1 {w1.shape} and w3 {w3.shape} differ")
  # The fused kernel takes 128 columns of each weight per work item.
  mode = _mode(backend, interpret, lhs, w1.shape[1], w1.shape[2],
               n_multiple=128)
  if mode == "xla":
    f32 = jnp.float32
    a = gmm_ref.gmm_ref(lhs, w1, group_sizes, preferred_element_type=f32)
    b = gmm_ref.gmm_ref(lhs, w3, group_sizes, preferred_element_type=f32)
    return _swiglu_epilogue(a, b).astype(lhs.dtype)
  return _swiglu_kernel(lhs, w1, w3, group_sizes.astype(jnp.int32), mode)


def _swiglu_epilogue(a, b):
  return a * jax.nn.sigmoid(a) * b


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _swiglu_kernel(lhs, w1, w3, group_sizes, mode):
  if mode == "portable":  # unfused: the portable path checks the VJP math
    f32 = jnp.float32
    a = gmm_portable.gmm(lhs, w1, group_sizes, out_dtype=f32)
    b = gmm_portable.gmm(lhs, w3, group_sizes, out_dtype=f32)
    return _swiglu_epilogue(a, b).astype(lhs.dtype)
  return _mosaic_gmm(lhs, w1, group_sizes, rhs2=w3,
                     epilogue_fn=_swiglu_epilogue,
                     interpret=mode == "mosaic_interpret")


def _swiglu_fwd(lhs, w1, w3, group_sizes, mode):
  return _swiglu_kernel(lhs, w1, w3, group_sizes, mode), (lhs, w1, w3,
                                                          group_sizes)


def _swiglu_bwd(mode, res, grad):
  lhs, w1, w3, gs = res
  f32 = jnp.float32
  a = _fwd_kernel(mode, lhs, w1, gs, f32)
  b = _fwd_kernel(mode, lhs, w3, gs, f32)
  grad = grad.astype(f32)
  sig = jax.nn.sigmoid(a)
  da = (grad * b * sig * (1 + a * (1 - sig))).astype(lhs.dtype)
  db = (grad * a * sig).astype(lhs.dtype)
  dlhs = (_fwd_kernel(mode, da, w1, gs, f32, transpose_rhs=True)
          + _fwd_kernel(mode, db, w3, gs, f32, transpose_rhs=True))
  dw1 = _tgmm_kernel(mode, lhs, da, gs, w1.dtype)
  dw3 = _tgmm_kernel(mode, lhs, db, gs, w3.dtype)
  return (dlhs.astype(lhs.dtype), dw1, dw3,
          np.zeros(gs.shape, dtype=jax.dtypes.float0))


_swiglu_kernel.defvjp(_swiglu_fwd, _swiglu_bwd)
