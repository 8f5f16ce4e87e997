"""Context parallelism: attention over rows split along T (mesh "sequence").

For rows longer than one device holds (the paper's 192K context stage) the
mesh axis "sequence" splits every activation's length axis into n equal
parts (m2jax.sharding's logical rules: "act_length", and "act_tokens" for
the MoE's flattened tokens). Every per-token op (norms, RoPE, MoE, lm_head,
losses) is left to XLA's SPMD partitioner; only attention, which mixes
tokens, runs here, inside `jax.shard_map` over "sequence":

  1. each device holds T/n consecutive queries, keys and values of a row
     (after RoPE and the QK norm) and their segment ids and positions;
  2. all-gather keys, values, segment ids and positions along T;
  3. the local queries attend to the whole row, masked with their global
     token indices: shard s holds queries s*T/n .. (s+1)*T/n - 1.

The backward pass of the all-gather is a reduce-scatter of dK and dV, which
autodiff derives. Routing statistics stay global: they are computed
outside the shard_map, on arrays XLA partitions.

The per-shard attention is `m2jax.model.attention.shard_attention`: the
tree kernels on the shard's query rows where the whole row would run them,
else the blockwise flash kernel (no [T/n, T] array) past DENSE_MAX_LEN
tokens and the dense mask below.

A causal row gives later shards more pairs: of two shards, the second holds
3/4 of them, and the first waits for it. With `balance`
(Settings.sequence_balance) the queries are gathered too and each device
computes two of the row's 2n chunks, an early and a late one (chunks s and
2n-1-s: the zig-zag placement), so every device gets the same share of a
causal row's pairs; the outputs are gathered back and each device keeps its
own T/n rows. It costs two more all-gathers a layer (queries and outputs,
their reduce-scatters in the backward) and needs T divisible by 2n.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.errors import UserError

# The mesh axis this module reads (m2jax.sharding builds meshes with it).
SEQUENCE_AXIS = "sequence"


class ContextParallelError(UserError, ValueError):
  """A row (or row layout) that context parallelism cannot split."""


def _mesh_axes(names: tuple, mesh) -> jax.P:
  """The PartitionSpec the logical rules give `names`, restricted to the
  axes of `mesh`."""
  spec = nn.logical_to_mesh_axes(names)
  out = []
  for axes in (spec if spec is not None else (None,) * len(names)):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a in mesh.axis_names)
    out.append(axes if len(axes) > 1 else (axes[0] if axes else None))
  return jax.P(*out)


def sequence_shards() -> int:
  """How many parts the current mesh and rules split a row into (1: none).

  More than 1 only under a mesh whose "sequence" axis is larger than 1 and
  rules that map "act_length" to it (m2jax.sharding.use_mesh).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or SEQUENCE_AXIS not in mesh.axis_names:
    return 1
  axes = _mesh_axes(("act_length",), mesh)[0]
  if SEQUENCE_AXIS not in ((axes,) if isinstance(axes, str) else axes or ()):
    return 1
  return mesh.shape[SEQUENCE_AXIS]


def check_length(length: int, balance: bool = False) -> None:
  """Raise ContextParallelError unless rows of `length` tokens split evenly
  over the "sequence" axis (before any constraint asks XLA to split them);
  with `balance`, into 2n equal chunks."""
  n = sequence_shards()
  if length % n:
    raise ContextParallelError(
        f"row length T={length} is not divisible by the mesh axis "
        f"{SEQUENCE_AXIS}={n}: context parallelism splits every row into "
        f"{n} equal parts (choose seq_len a multiple of {n})")
  if balance and n > 1 and length % (2 * n):
    raise ContextParallelError(
        f"row length T={length} is not divisible by {2 * n}: "
        f"Settings.sequence_balance splits every row into 2 x "
        f"{SEQUENCE_AXIS}={n} chunks (choose seq_len a multiple of {2 * n}, "
        f"or --nosequence_balance)")


# (q_local, k_full, v_full, q_segment_ids, kv_segment_ids, q_positions,
#  kv_positions, q_offset) -> out_local [B, T/n, N, H]
ShardAttention = Callable[..., jax.Array]


def attention(attend: ShardAttention, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
              segment_ids_BxT, positions_BxT, *, balance: bool = False):
  """Self-attention of rows split over "sequence" (module docstring).

  Arguments are global arrays in the logical layout of
  m2jax.model.attention (rows over the batch axes, T over "sequence",
  heads over "tensor"). `attend` computes the output of a run of queries
  from them and the gathered row; q_offset is the row index of its first
  query (a traced scalar). `balance`: the zig-zag placement (module
  docstring).
  """
  mesh = jax.sharding.get_abstract_mesh()
  n, T = mesh.shape[SEQUENCE_AXIS], q_BxTxNxH.shape[1]
  check_length(T, balance)
  q_spec = _mesh_axes(("act_batch", "act_length", "act_heads", None), mesh)
  kv_spec = _mesh_axes(("act_batch", "act_length", "act_kv_heads", None),
                       mesh)
  t_spec = _mesh_axes(("act_batch", "act_length"), mesh)
  gather = lambda x: jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1, tiled=True)

  def body(q, k, v, segment_ids, positions):
    s = jax.lax.axis_index(SEQUENCE_AXIS)
    k, v = gather(k), gather(v)
    row_segment_ids, row_positions = gather(segment_ids), gather(positions)
    if not balance:
      return attend(q, k, v, segment_ids, row_segment_ids, positions,
                    row_positions, s * (T // n))
    row_q, c = gather(q), T // (2 * n)
    outs = []
    for chunk in (s, 2 * n - 1 - s):  # an early and a late chunk
      part = lambda x, chunk=chunk: jax.lax.dynamic_slice_in_dim(
          x, chunk * c, c, axis=1)
      outs.append(attend(part(row_q), k, v, part(row_segment_ids),
                         row_segment_ids, part(row_positions), row_positions,
                         chunk * c))
    # Every device's two chunks [n, B, c, ...]: chunks 0 .. n-1 are the
    # devices' early ones in device order, n .. 2n-1 their late ones in
    # reverse order. This device keeps its own T/n rows of the row.
    early, late = (jax.lax.all_gather(o, SEQUENCE_AXIS) for o in outs)
    row = jnp.concatenate([early, late[::-1]], axis=0)
    row = jnp.moveaxis(row, 0, 1).reshape(q.shape[:1] + (T,) + q.shape[2:])
    return jax.lax.dynamic_slice_in_dim(row, s * (T // n), T // n, axis=1)

  # check_vma=False: the blockwise kernel's loops start from fresh zeros,
  # which the varying-axis check rejects against the varying queries. The
  # body's only collective is the all-gather, whose transpose (a
  # reduce-scatter) autodiff derives without the types.
  return jax.shard_map(
      body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, t_spec, t_spec),
      out_specs=q_spec, check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                         segment_ids_BxT, positions_BxT)
