"""Low-precision projection inputs (fake fp8) and the higher-precision path
that GNMR's recovery selects per module (m2jax.train.gnmr).

The model computes every projection as a plain einsum or grouped matmul
inside its Attention, MoE and DenseFFN modules, so the finest place to
change a projection's input without editing the model is the module's own
input, reached with flax's `nn.intercept_methods`. Each module's input feeds
the projections of INPUT_READERS; the others (o_proj, the experts' w2, the
MTP projection, the lm_head) read activations made inside a module and are
left in full precision.

  with precision.fp8_projection_inputs(high_precision):
    out = model.forward(config, variables, tokens)

inside a jitted function quantises those inputs to float8 e4m3 with one
scale per tensor (amax / 448) and a straight-through gradient, except in
modules where `high_precision[param name]` (a traced bool, e.g. from
gnmr.Layout.leaf_any(gnmr.recovering(opt_state))) is true for one of the
parameters that read the input: those compute as usual. The number format
of the parameters, the kernels and the backend are unchanged; this is what
the GNMR stress harness (benchmarks/gnmr_stress.py) trains with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.model.attention import Attention
from m2jax.model.moe import DenseFFN, MoE

# Largest finite float8_e4m3fn value (OCP 8-bit floating point spec).
E4M3_MAX = 448.0

# The parameters that read each module's input.
INPUT_READERS = {Attention: ("q_proj", "k_proj", "v_proj"),
                 MoE: ("router", "w1", "w3"),
                 DenseFFN: ("w1", "w3")}


def fake_fp8(x):
  """`x` rounded through float8_e4m3fn with a per-tensor scale amax/448,
  returned in x's dtype; the gradient passes straight through."""
  x32 = x.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(x32)), 1e-30) / E4M3_MAX
  q = (x32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
  return x + jax.lax.stop_gradient(q.astype(x.dtype) - x)


def _readers(module) -> tuple[str, ...] | None:
  for cls, names in INPUT_READERS.items():
    if isinstance(module, cls):
      return names
  return None


@contextlib.contextmanager
def fp8_projection_inputs(high_precision: Mapping[str, jax.Array] | None =
                          None):
  """Fake-fp8 module inputs within (module docstring); `high_precision`:
  {parameter name ("layers_0/attn/q_proj"): bool} keeps a module's input
  in full precision while one of its readers is true."""
  high_precision = dict(high_precision or {})

  def intercept(next_fun, args, kwargs, context):
    readers = _readers(context.module)
    if context.method_name != "__call__" or readers is None:
      return next_fun(*args, **kwargs)
    x, *rest = args
    prefix = "/".join(context.module.path)
    keep = [high_precision[name] for name in
            (f"{prefix}/{r}" for r in readers) if name in high_precision]
    low = fake_fp8(x)
    if keep:
      low = jnp.where(jnp.any(jnp.stack(keep)), x, low)
    return next_fun(low, *rest, **kwargs)

  with nn.intercept_methods(intercept):
    yield
