"""Context parallelism's per-shard attention and its checks, on one device.

The whole model on rows split over a "sequence" mesh axis of 8 fake devices
is checked against one device in tests/test_sharding.py (its subprocess);
here the shard's piece alone: queries cut into n parts, each attending to
the whole row at its offset, must give the rows of full attention.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import sharding
from m2jax.infer.engine import Engine
from m2jax.model import attention, context_parallel
from m2jax.model.layers import positions_from_segments

B, T, N, K, H = 2, 24, 4, 2, 8


def _rows():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32)
             for n in (N, K, K))
  # Documents of 7, 10 and 7 tokens (row 0) and 3, 16, 5 with padding
  # (row 1): every cut into 3 or 6 parts splits some document.
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [7, 10, 7]),
                              np.repeat([1, 2, 0], [3, 16, 5])]), jnp.int32)
  return q, k, v, seg, positions_from_segments(seg)


@pytest.mark.parametrize("window,sinks", [(None, 0), (5, 1)])
def test_shards_at_their_offsets_give_full_attention(window, sinks):
  q, k, v, seg, pos = _rows()
  mask = attention.attention_mask(seg, pos, window=window,
                                  num_sink_tokens=sinks)
  want = attention.dot_product_attention(q, k, v, mask, impl="xla")
  for n in (3, 6):
    L = T // n
    got = jnp.concatenate([attention.shard_attention(
        q[:, s * L:(s + 1) * L], k, v, seg[:, s * L:(s + 1) * L], seg,
        pos[:, s * L:(s + 1) * L], pos, s * L, window=window,
        num_sink_tokens=sinks, impl="xla") for s in range(n)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=f"n={n}")
  # An offset one token off changes the causal edge of every shard.
  wrong = attention.shard_attention(
      q[:, 8:16], k, v, seg[:, 8:16], seg, pos[:, 8:16], pos, 7,
      window=window, num_sink_tokens=sinks, impl="xla")
  assert np.abs(wrong - want[:, 8:16]).max() > 1e-3


def _shards_under(sizes, rules=sharding.LOGICAL_RULES):
  mesh = jax.sharding.AbstractMesh(sizes, sharding.AXES)
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules):
    return context_parallel.sequence_shards()


def test_rows_split_only_over_a_sequence_axis_the_rules_use():
  # No mesh, a sequence axis of 1, or rules that keep T whole: one part.
  assert context_parallel.sequence_shards() == 1
  context_parallel.check_length(7)
  assert _shards_under((2, 1, 1, 4, 1)) == 1
  whole = tuple((name, None if name == "act_length" else axes)
                for name, axes in sharding.LOGICAL_RULES)
  assert _shards_under((1, 1, 8, 1, 1), whole) == 1
  assert _shards_under((1, 1, 8, 1, 1)) == 8
  mesh = jax.sharding.AbstractMesh((2, 1, 4, 1, 1), sharding.AXES)
  with jax.sharding.use_abstract_mesh(mesh), \
      nn.logical_axis_rules(sharding.LOGICAL_RULES):
    context_parallel.check_length(64)
    with pytest.raises(context_parallel.ContextParallelError,
                       match=r"^row length T=30 is not divisible by the mesh "
                       r"axis sequence=4"):
      context_parallel.check_length(30)


def test_generation_refuses_a_sequence_axis():
  # Decoding one token per row cannot split rows: refused in one line
  # before any weights move.
  mesh = jax.sharding.AbstractMesh((1, 1, 2, 1, 1), sharding.AXES)
  with pytest.raises(sharding.MeshError, match=r"^generation does not split "
                     r"rows: the engine's mesh needs sequence=1 \(data=1,"):
    Engine(config_lib.TINY, {"params": {}}, mesh=mesh)
