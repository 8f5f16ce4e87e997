"""Grouped matrix multiplication: the entry point the MoE experts call.

`gmm(lhs[M, K], rhs[G, K, N], group_sizes[G]) -> [M, N]` multiplies rows
`[start_g, start_g + group_sizes[g])` of `lhs` by `rhs[g]`, with
`jax.lax.ragged_dot` semantics: rows past `sum(group_sizes)` give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "xla", "pallas")


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, backend="auto",
        interpret=None):
  """Grouped matmul. See the module docstring for semantics."""
  del interpret
  if backend not in BACKENDS:
    raise ValueError(f"gmm backend must be one of {BACKENDS}, got {backend!r}")
  return jax.lax.ragged_dot(
      lhs, rhs, group_sizes.astype(jnp.int32),
      preferred_element_type=preferred_element_type)
