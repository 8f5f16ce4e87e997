"""Pure-XLA references for the grouped matmuls (the "xla" backend).

`gmm_ref` is `jax.lax.ragged_dot`; `tgmm_ref` is the same op with the ragged
dimension contracted, which is what autodiff of ragged_dot produces for the
weight gradient. XLA densifies both on GPU and CPU, so they are slow and
memory hungry at M2 sizes; they define the semantics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm_ref(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """[M, K] x [G, K, N] -> [M, N]; rows past sum(group_sizes) are zero."""
  return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                            preferred_element_type=preferred_element_type)


def tgmm_ref(lhs, grad, group_sizes, *, preferred_element_type=None):
  """[M, K] x [M, N] -> [G, K, N]: out[g] = lhs[rows g]^T @ grad[rows g]."""
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(
      lhs, grad, group_sizes.astype(jnp.int32), dims,
      preferred_element_type=preferred_element_type)
