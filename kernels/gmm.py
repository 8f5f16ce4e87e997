"""Grouped matrix multiplication: the entry point the MoE experts call.

`gmm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> [M, N]` multiplies rows
`[start_g, start_g + group_sizes[g])` of `lhs` by `rhs[g]`, with
`jax.lax.ragged_dot` semantics: rows past `sum(group_sizes)` give zeros,
groups may be empty, accumulation is float32.

Backends (the same names as kernels/tree_attention.py: each names a lowering):
  "xla"     `jax.lax.ragged_dot` (kernels/gmm_ref.py, the reference),
            differentiated by JAX.
  "mosaic"  the Hopper kernels (kernels/gmm_mosaic.py: wgmma + TMA, warp
            specialised) with a custom VJP: dlhs = gmm(grad, rhs^T),
            drhs = tgmm(lhs, grad).
  "triton"  the portable Pallas kernels of the same row schedule
            (kernels/gmm_triton.py), same custom VJP; interpret=True only
            (the CPU check of the tiling: Triton fails to compile its
            dynamic loop bounds on an H100 with jax 0.11.2).
  "auto"    "mosaic" where it runs (a GPU, or interpret=True) and the shapes
            suit it, else "xla".
`interpret=True` runs the chosen Pallas backend on CPU (slow, tiny shapes):
"mosaic" in Pallas' Mosaic GPU interpreter, "triton" in the portable one.
`tiles` (a `gmm_mosaic.TileConfig`) fixes the Mosaic kernels' tiles for the
forward and both gradient kernels; None picks them per shape. Only the
"mosaic" kernels read it.

Example:
  out_MxN = gmm(x_MxK, w_GxKxN, group_sizes_G)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import gmm_mosaic
from kernels import gmm_ref
from kernels import gmm_triton

BACKENDS = ("auto", "xla", "mosaic", "triton")
# Names used before the backends were named after their lowering.
_RENAMED = {"pallas": "mosaic"}
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

# The kernels behind one jit each: every layer calling them with the same
# shapes gets the same traced jaxpr, which JAX lowers once per program (a
# shared function), so Mosaic builds and compiles each kernel once per train
# step instead of once per layer and use.
_STATIC = ("transpose_rhs", "out_dtype", "config", "interpret", "epilogue_fn")
_mosaic_gmm = jax.jit(gmm_mosaic.gmm, static_argnames=_STATIC)
_mosaic_tgmm = jax.jit(gmm_mosaic.tgmm,
                       static_argnames=("out_dtype", "config", "interpret"))


@dataclasses.dataclass(frozen=True)
class _Kernels:
  """The Pallas kernels a call runs (a static argument of the custom VJPs)."""
  backend: str  # "mosaic" or "triton"
  interpret: bool
  tiles: gmm_mosaic.TileConfig | None


def check_backend(backend: str) -> None:
  """Raises a one-line error unless `backend` is one of BACKENDS."""
  if backend in _RENAMED:
    raise ValueError(f"gmm backend {backend!r} is now called "
                     f"{_RENAMED[backend]!r}; choose one of {BACKENDS}")
  if backend not in BACKENDS:
    raise ValueError(f"gmm backend must be one of {BACKENDS}, got {backend!r}")


def _on_gpu():
  return jax.default_backend() == "gpu"


def _kernel_supported(lhs, k, n, n_multiple):
  # K % 128: the weight-gradient kernel tiles K by 128 output rows.
  return lhs.dtype in _KERNEL_DTYPES and k % 128 == 0 and n % n_multiple == 0


def _resolve(backend, interpret, tiles, lhs, k, n, n_multiple=64):
  """The kernels to run, or None for the XLA reference."""
  check_backend(backend)
  if not isinstance(interpret, bool):
    raise ValueError(f"gmm interpret must be True or False, got {interpret!r} "
                     f"(the portable interpreter is backend='triton', "
                     f"interpret=True)")
  if tiles is not None and not isinstance(tiles, gmm_mosaic.TileConfig):
    raise ValueError(f"gmm tiles must be a gmm_mosaic.TileConfig or None, got "
                     f"{tiles!r}")
  if backend == "xla":
    return None
  supported = _kernel_supported(lhs, k, n, n_multiple)
  runs = interpret or _on_gpu()
  if backend == "auto":
    return _Kernels("mosaic", interpret, tiles) if runs and supported else None
  if not supported:
    raise ValueError(
        f"gmm backend={backend!r} needs bf16/f16 inputs with K % 128 == 0 and "
        f"N % {n_multiple} == 0; got {lhs.dtype}, K={k}, N={n}")
  if not runs:
    raise ValueError(f"gmm backend={backend!r} needs a GPU or interpret=True")
  if backend == "triton" and not interpret:
    raise ValueError(
        "gmm backend='triton' (kernels/gmm_triton.py, the portable check of "
        "the row schedule) runs only with interpret=True: Triton rejects its "
        "compiled form (dynamic loop bounds; H100, jax 0.11.2); use 'mosaic' "
        "or 'xla' on a GPU")
  return _Kernels(backend, interpret, tiles)


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


def _fwd_kernel(kern, lhs, rhs, gs, out_dtype, transpose_rhs=False):
  if kern.backend == "triton":
    return gmm_triton.gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs,
                          out_dtype=out_dtype, interpret=kern.interpret)
  return _mosaic_gmm(lhs, rhs, gs, transpose_rhs=transpose_rhs,
                     out_dtype=out_dtype, config=kern.tiles,
                     interpret=kern.interpret)


def _tgmm_kernel(kern, lhs, grad, gs, out_dtype):
  if kern.backend == "triton":
    return gmm_triton.tgmm(lhs, grad, gs, out_dtype=out_dtype,
                           interpret=kern.interpret)
  return _mosaic_tgmm(lhs, grad, gs, out_dtype=out_dtype, config=kern.tiles,
                      interpret=kern.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_kernel(lhs, rhs, group_sizes, out_dtype, kern):
  return _fwd_kernel(kern, lhs, rhs, group_sizes, out_dtype)


def _gmm_kernel_fwd(lhs, rhs, group_sizes, out_dtype, kern):
  out = _fwd_kernel(kern, lhs, rhs, group_sizes, out_dtype)
  return out, (lhs, rhs, group_sizes)


def _gmm_kernel_bwd(out_dtype, kern, res, grad):
  del out_dtype
  lhs, rhs, group_sizes = res
  # The tensor cores take both operands in one dtype: the cotangent is cast to
  # the input dtype (bf16), accumulation stays float32.
  grad = grad.astype(lhs.dtype)
  dlhs = _fwd_kernel(kern, grad, rhs, group_sizes, lhs.dtype,
                     transpose_rhs=True)
  drhs = _tgmm_kernel(kern, lhs, grad, group_sizes, rhs.dtype)
  dgs = np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)
  return dlhs, drhs, dgs


_gmm_kernel.defvjp(_gmm_kernel_fwd, _gmm_kernel_bwd)


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, backend="auto",
        interpret: bool = False,
        tiles: gmm_mosaic.TileConfig | None = None):
  """Grouped matmul [M, K] x [G, K, N] -> [M, N]. See the module docstring."""
  _validate(lhs, rhs, group_sizes)
  kern = _resolve(backend, interpret, tiles, lhs, rhs.shape[1], rhs.shape[2])
  if kern is None:
    return gmm_ref.gmm_ref(lhs, rhs, group_sizes,
                           preferred_element_type=preferred_element_type)
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"gmm backend={kern.backend!r} needs equal dtypes, got "
                     f"{lhs.dtype} and {rhs.dtype}")
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  return _gmm_kernel(lhs, rhs, group_sizes.astype(jnp.int32), out_dtype, kern)


def tgmm(lhs, grad, group_sizes, *, preferred_element_type=None,
         backend="auto", interpret: bool = False,
         tiles: gmm_mosaic.TileConfig | None = None):
  """Transposed grouped matmul [M, K] x [M, N] -> [G, K, N] (weight gradient).

  out[g] = lhs[rows of g]^T @ grad[rows of g]; empty groups give zeros.
  """
  if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
    raise ValueError(f"tgmm expects lhs [M, K] and grad [M, N]; got "
                     f"{lhs.shape}, {grad.shape}")
  k, n = lhs.shape[1], grad.shape[1]
  kern = _resolve(backend, interpret, tiles, lhs, k, n)
  if kern is None:
    return gmm_ref.tgmm_ref(lhs, grad, group_sizes,
                            preferred_element_type=preferred_element_type)
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  return _tgmm_kernel(kern, lhs, grad.astype(lhs.dtype),
                      group_sizes.astype(jnp.int32), out_dtype)


def gmm_swiglu(lhs, w1, w3, group_sizes, *, backend="auto",
               interpret: bool = False,
               tiles: gmm_mosaic.TileConfig | None = None):
  """silu(gmm(lhs, w1)) * gmm(lhs, w3): the experts' gated up-projection.

  The "mosaic" backend computes both products in one kernel (lhs tiles read
  once, the gate applied in the epilogue; `tiles.tile_n` counts the columns
  of both weights); "triton" runs the two products unfused. Under
  differentiation the forward kernel also writes both products (in lhs's
  dtype) for the backward, which recomputes no matmul: the two products'
  gradients go side by side through one lhs-gradient matmul over 2F and one
  weight-gradient matmul for both weights. The backward's SwiGLU derivative
  thus reads a and b rounded to lhs's dtype, where the forward used them in
  float32 (an error of the size of the bf16 rounding that d a and d b get
  anyway, cast to lhs's dtype for the matmuls).
  """
  _validate(lhs, w1, group_sizes)
  if w1.shape != w3.shape:
    raise ValueError(f"gmm_swiglu: w1 {w1.shape} and w3 {w3.shape} differ")
  # The fused kernel takes 128 columns of each weight per work item.
  kern = _resolve(backend, interpret, tiles, lhs, w1.shape[1], w1.shape[2],
                  n_multiple=128)
  if kern is None:
    f32 = jnp.float32
    a = gmm_ref.gmm_ref(lhs, w1, group_sizes, preferred_element_type=f32)
    b = gmm_ref.gmm_ref(lhs, w3, group_sizes, preferred_element_type=f32)
    return _swiglu_epilogue(a, b).astype(lhs.dtype)
  return _swiglu_kernel(lhs, w1, w3, group_sizes.astype(jnp.int32), kern)


def _swiglu_epilogue(a, b):
  return a * jax.nn.sigmoid(a) * b


def _swiglu_and_products(a, b):
  return _swiglu_epilogue(a, b), a, b


def _swiglu_products(lhs, w1, w3, group_sizes, kern):
  """(silu(a) * b, a, b) in lhs's dtype, a = lhs @ w1 and b = lhs @ w3."""
  if kern.backend == "triton":  # unfused: the portable path checks the VJP
    f32 = jnp.float32
    a = _fwd_kernel(kern, lhs, w1, group_sizes, f32)
    b = _fwd_kernel(kern, lhs, w3, group_sizes, f32)
    return tuple(v.astype(lhs.dtype) for v in _swiglu_and_products(a, b))
  return _mosaic_gmm(lhs, w1, group_sizes, rhs2=w3,
                     epilogue_fn=_swiglu_and_products, config=kern.tiles,
                     interpret=kern.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _swiglu_kernel(lhs, w1, w3, group_sizes, kern):
  if kern.backend == "triton":
    return _swiglu_products(lhs, w1, w3, group_sizes, kern)[0]
  return _mosaic_gmm(lhs, w1, group_sizes, rhs2=w3,
                     epilogue_fn=_swiglu_epilogue, config=kern.tiles,
                     interpret=kern.interpret)


def _swiglu_fwd(lhs, w1, w3, group_sizes, kern):
  h, a, b = _swiglu_products(lhs, w1, w3, group_sizes, kern)
  return h, (lhs, w1, w3, group_sizes, a, b)


def _swiglu_bwd(kern, res, grad):
  lhs, w1, w3, gs, a, b = res
  f32 = jnp.float32
  a, b, grad = a.astype(f32), b.astype(f32), grad.astype(f32)
  sig = jax.nn.sigmoid(a)
  da = grad * b * sig * (1 + a * (1 - sig))
  db = grad * a * sig
  # [da | db] @ [w1 | w3]^T is dlhs, and lhs^T @ [da | db] is [dw1 | dw3].
  dab = jnp.concatenate([da, db], axis=-1).astype(lhs.dtype)
  dlhs = _fwd_kernel(kern, dab, jnp.concatenate([w1, w3], axis=-1), gs,
                     lhs.dtype, transpose_rhs=True)
  dw13 = _tgmm_kernel(kern, lhs, dab, gs, w1.dtype)
  f = w1.shape[-1]
  return (dlhs, dw13[..., :f], dw13[..., f:],
          np.zeros(gs.shape, dtype=jax.dtypes.float0))


_swiglu_kernel.defvjp(_swiglu_fwd, _swiglu_bwd)
