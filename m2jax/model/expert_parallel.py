"""Expert parallelism: the MoE experts sharded over the mesh axis "expert".

Inside `jax.shard_map` every device holds its tokens (the batch is split
over data x fsdp x expert) and E / n_ep experts (the "expert" axis), each
expert's FFN dimension split over "tensor". One MoE layer on one device:

  1. sort its (token, choice) pairs by expert (`moe.dispatch`);
  2. all-gather the per-expert counts over "expert": every device then knows
     the whole [source, destination, local expert] count table, so all the
     all-to-all offsets follow without further communication (`plan`);
  3. `ragged_all_to_all` sends each destination the rows of its experts,
     received into a buffer of `capacity` rows;
  4. re-sort the received rows by local expert, run the three grouped
     matmuls (`kernels.gmm`), undo the re-sort;
  5. the reverse `ragged_all_to_all` returns each row to where it came from;
     the usual weighted combine follows; a psum over "tensor" adds the
     partial sums of the split FFN dimension.

Dropless by default: the receive buffer holds the worst case,
n_ep * T_local * min(K, E / n_ep) rows. A capacity factor c > 0
(`Settings.capacity_factor`, m2jax.settings) shrinks it to c * T_local * K
rows (less memory); rows past it are dropped, whole tail first, and counted:
the drop counter of `RoutingStats.dropped`.

The exchange is `Settings.all_to_all`. Steps 2-5 above are "ragged". CPU
has no ragged all-to-all, so `all_to_all="dense"` (the default on CPU)
emulates it exactly with a dense `all_to_all` of fixed-size slabs: the same
plan, the same results, more bytes moved.

`all_to_all="allgather"` (the default off CPU; `gather_exchange` below)
moves tokens instead of (token, choice) rows: every device gathers the
tokens of its "expert" group, runs its experts on the rows routed to them
and reduce-scatters the weighted sums back. K / n_ep times fewer bytes than
the all-to-all, in dense NCCL collectives.

`all_to_all="slabs"` is the fixed-shape exchange of GShard-style MoE: each
(source, destination) pair gets a slab of S rows, S = capacity_factor x
T_local x K / n_ep (worst case T_local x min(K, E / n_ep) when the factor is
0), and one dense `all_to_all` moves n_ep x S rows per device: NCCL's
all-to-all, several times faster on GPUs than XLA's ragged all-to-all
(benchmarks/results/scaling/). Rows past a slab are dropped (tail first) and
counted, as with the capacity buffer.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


# Mesh axes this module reads (m2jax.sharding builds meshes with them).
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


def resolve_impl(impl: str) -> str:
  """The exchange to trace: "auto" picks "allgather" off CPU (on 4 x H100
  at m2_small: 0.81 weak-scaling efficiency, against 0.41 for the ragged
  all-to-all with XLA's decomposer; benchmarks/notes/scaling.md) and the
  exact all-to-all emulation on CPU."""
  if impl == "auto":
    return "dense" if jax.default_backend() == "cpu" else "allgather"
  return impl


def _rows(worst: int, wanted: float, capacity_factor: float) -> int:
  """`worst` rows, or `wanted` rounded up to a multiple of 8 (at least 8,
  at most worst) when a capacity factor is set."""
  if capacity_factor <= 0:
    return worst
  return max(8, min(worst, -(-math.ceil(wanted) // 8) * 8))


def buffer_rows(tokens: int, top_k: int, num_experts: int, n_ep: int,
                capacity_factor: float) -> int:
  """Rows of the receive buffer on one device (static)."""
  return _rows(n_ep * tokens * min(top_k, num_experts // n_ep),
               capacity_factor * tokens * top_k, capacity_factor)


def slab_rows(tokens: int, top_k: int, num_experts: int, n_ep: int,
              capacity_factor: float) -> int:
  """Rows per (source, destination) slab of the "slabs" exchange (static)."""
  return _rows(tokens * min(top_k, num_experts // n_ep),
               capacity_factor * tokens * top_k / n_ep, capacity_factor)


class Plan(NamedTuple):
  """All-to-all parameters of one device, from the gathered count table.

  Per destination d (dispatch) / per source s (return), over the "expert"
  axis; `kept_SxL` is this device's received rows per source and local
  expert, in the order they arrive.
  """
  input_offsets: jax.Array    # [n] where my rows for d start (sorted order)
  send_sizes: jax.Array       # [n] rows I send d (after capacity)
  output_offsets: jax.Array   # [n] where they land in d's buffer
  recv_sizes: jax.Array       # [n] rows I receive from s
  recv_offsets: jax.Array     # [n] where rows from s start in my buffer
  return_offsets: jax.Array   # [n] where s's rows for me start in s's order
  kept_SxL: jax.Array         # [n, E/n] rows received per (source, expert)
  dropped: jax.Array          # rows of mine that did not fit (scalar)


def plan(counts_SxE, me, capacity: int, slab: int | None = None) -> Plan:
  """All-to-all plan of device `me` from every device's per-expert counts.

  counts_SxE[s, e]: rows device s routes to expert e (all n_ep devices).
  Destination d owns experts [d * L, (d + 1) * L). It receives sources in
  order s = 0..n-1, each source's rows grouped by expert; whatever would land
  past `capacity` is not sent (a tail of each source's chunk, so what is sent
  stays contiguous). With `slab`, source s's rows land at s * slab instead
  and each (source, destination) pair keeps at most `slab` rows. Pure
  integer arithmetic, the same on every device.
  """
  n, e = counts_SxE.shape
  per_SxDxL = counts_SxE.reshape(n, n, e // n)
  if slab is None:
    # Rows arriving at d, in arrival order (source-major, then expert).
    arrive_DxR = per_SxDxL.transpose(1, 0, 2).reshape(n, -1)
    ends = jnp.cumsum(arrive_DxR, axis=1)
    kept_DxR = jnp.clip(capacity - (ends - arrive_DxR), 0, arrive_DxR)
    kept_SxDxL = kept_DxR.reshape(n, n, e // n).transpose(1, 0, 2)
  else:
    ends = jnp.cumsum(per_SxDxL, axis=2)
    kept_SxDxL = jnp.clip(slab - (ends - per_SxDxL), 0, per_SxDxL)
  sent_SxD = kept_SxDxL.sum(-1)
  full_SxD = per_SxDxL.sum(-1)
  starts_SxD = jnp.cumsum(full_SxD, axis=1) - full_SxD   # in the sender
  if slab is None:
    landing_SxD = jnp.cumsum(sent_SxD, axis=0) - sent_SxD  # in the receiver
  else:
    landing_SxD = jnp.broadcast_to(
        jnp.arange(n, dtype=sent_SxD.dtype)[:, None] * slab, (n, n))
  return Plan(
      input_offsets=starts_SxD[me],
      send_sizes=sent_SxD[me],
      output_offsets=landing_SxD[me],
      recv_sizes=sent_SxD[:, me],
      recv_offsets=landing_SxD[:, me],
      return_offsets=starts_SxD[:, me],
      kept_SxL=kept_SxDxL[:, me],
      dropped=full_SxD[me].sum() - sent_SxD[me].sum())


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                            output_offsets, recv_sizes, *, axis_name: str,
                            slab: int | None = None, landing=None):
  """`jax.lax.ragged_all_to_all` (one slice per peer) by a dense all_to_all.

  Each peer's slice travels in a slab of `slab` rows (by default
  min(len(operand), len(output)), so nothing is cut; a smaller slab needs
  send_sizes <= slab); differentiable through gathers, scatters and
  all_to_all. `landing` [n]: where each peer's slice lands here, when the
  caller knows it (the exchange plan does); otherwise the peers' output
  offsets are exchanged too.
  """
  slab = slab or min(operand.shape[0], output.shape[0])
  r = jnp.arange(slab, dtype=jnp.int32)
  src = input_offsets[:, None] + r[None, :]
  send_ok = r[None, :] < send_sizes[:, None]
  rows = jnp.take(operand, src, axis=0, mode="clip")
  send_ok = send_ok.reshape(send_ok.shape + (1,) * (operand.ndim - 1))
  rows = jnp.where(send_ok, rows, jnp.zeros((), operand.dtype))
  got = jax.lax.all_to_all(rows, axis_name, 0, 0)
  if landing is None:
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst = landing[:, None] + r[None, :]
  dst = jnp.where(r[None, :] < recv_sizes[:, None], dst, output.shape[0])
  return output.at[dst.reshape(-1)].set(got.reshape(-1, *got.shape[2:]),
                                        mode="drop")


def _all_to_all(impl, *args, slab=None, landing=None):
  if impl == "ragged":
    return jax.lax.ragged_all_to_all(*args, axis_name=EXPERT_AXIS)
  return dense_ragged_all_to_all(*args, axis_name=EXPERT_AXIS, slab=slab,
                                 landing=landing)


def permute(x, perm, inverse=None):
  """x[perm] for a permutation `perm`. Given `inverse` (perm's inverse) the
  gradient is the gather g[inverse]; without it, jnp.take's transpose, a
  scatter, which XLA emits as an atomic scatter-add on the GPU although no
  two rows collide (0.28 ms per MoE layer at m2_small's 16K tokens against
  ~0.1 ms for the gather; benchmarks/notes/train.md)."""
  if inverse is None:
    return _take_rows(x, perm)
  return _permute_pair(x, perm, inverse)


def _take_rows(x, perm):
  return jnp.take(x, perm, axis=0, mode="clip", unique_indices=True)


@jax.custom_vjp
def _permute_pair(x, perm, inverse):
  del inverse
  return _take_rows(x, perm)


def _permute_pair_fwd(x, perm, inverse):
  return _take_rows(x, perm), (perm, inverse)


def _permute_pair_bwd(residuals, g):
  perm, inverse = residuals
  return _permute_pair(g, inverse, perm), None, None


_permute_pair.defvjp(_permute_pair_fwd, _permute_pair_bwd)


def _local_order(kept_SxL, recv_offsets, rows: int):
  """Permutation sorting the received buffer by local expert (gaps last).

  Rows from source s start at recv_offsets[s] (ascending), grouped by local
  expert with counts kept_SxL[s]; anything else in the buffer is padding.
  """
  r = jnp.arange(rows, dtype=jnp.int32)
  # Sources with no rows share the next one's offset: take the last match.
  src = jnp.searchsorted(recv_offsets, r, side="right") - 1
  within = r - recv_offsets[src]
  ends_RxL = jnp.cumsum(kept_SxL, axis=1)[src]
  # L (= local experts) for rows past the source's rows: they sort last.
  expert = (within[:, None] >= ends_RxL).sum(-1)
  return jnp.argsort(expert, stable=True)


def exchange(x_sorted, sizes_E, experts_fn, *, top_k: int,
             capacity_factor: float, impl: str):
  """Run one device's sorted rows through the experts that own them.

  Call inside shard_map over a mesh with the "expert" axis. x_sorted [T*K, D]:
  this device's (token, choice) rows sorted by expert, sizes_E [E] their
  counts; experts_fn(rows, local_sizes) applies this device's E / n_ep
  experts and may return float32. Returns (y_sorted [T*K, D] in x_sorted's
  dtype, zeros for dropped rows; dropped: int32 rows of this device that
  found no room).
  """
  n_ep = jax.lax.axis_size(EXPERT_AXIS)
  rows = x_sorted.shape[0]
  args = (rows // top_k, top_k, sizes_E.shape[0], n_ep, capacity_factor)
  slab = slab_rows(*args) if impl == "slabs" else None
  capacity = n_ep * slab if slab else buffer_rows(*args)
  counts = jax.lax.all_gather(sizes_E, EXPERT_AXIS)
  p = plan(counts, jax.lax.axis_index(EXPERT_AXIS), capacity, slab=slab)
  buf = jnp.zeros((capacity,) + x_sorted.shape[1:], x_sorted.dtype)
  x_recv = _all_to_all(impl, x_sorted, buf, p.input_offsets, p.send_sizes,
                       p.output_offsets, p.recv_sizes, slab=slab,
                       landing=p.recv_offsets)
  local = _local_order(p.kept_SxL, p.recv_offsets, capacity)
  inverse = jnp.zeros_like(local).at[local].set(
      jnp.arange(capacity, dtype=local.dtype), unique_indices=True)
  y_local = experts_fn(permute(x_recv, local, inverse),
                       p.kept_SxL.sum(0).astype(jnp.int32))
  # Back in the compute dtype: half the bytes on the wire in bf16.
  y_recv = permute(y_local.astype(x_sorted.dtype), inverse, local)
  # The reverse trip: rows received from s go back to s, landing where s's
  # rows for this device started in s's sorted order.
  y_sorted = _all_to_all(impl, y_recv, jnp.zeros_like(x_sorted),
                         p.recv_offsets, p.recv_sizes, p.return_offsets,
                         p.send_sizes, slab=slab, landing=p.input_offsets)
  return y_sorted, p.dropped.astype(jnp.int32)


# The all-gather exchange -----------------------------------------------------
#
# Megatron-LM calls it the all-gather token dispatcher. Per MoE layer and
# device, with n devices on "expert", T local tokens, top-K of E experts:
#   forward   all-gather the group's tokens [n*T, D] (and their choices),
#             run the local experts on the rows routed to them, sum each
#             token's local outputs (weighted), reduce-scatter the [n*T, D]
#             partial sums back to the tokens' owners;
#   backward  the transposes: an all-gather of d out, a reduce-scatter of
#             d tokens.
# Each collective moves (n - 1) * T * D values per device, so a layer's four
# move 4 (n - 1) T D, against the all-to-all's 4 (n - 1) / n * T * K * D:
# K / n times fewer bytes (2x at K = 8, n = 4), all of them dense NCCL
# collectives, which XLA's scheduler can run beside other work. What it
# costs instead: the sort and the combine run over all n*T*K (token,
# choice) pairs of the group, not T*K, and the tokens of the whole group
# are held once ([n*T, D], twice with the partial sums).


def gather_exchange(x_TxD, experts_TxK, weights_TxK, experts_fn, *,
                    num_experts: int, capacity_factor: float):
  """Run the tokens of the "expert" group through this device's experts.

  Call inside shard_map over a mesh with the "expert" axis. x_TxD: this
  device's tokens (compute dtype); experts_TxK / weights_TxK: their
  choices and combine weights; experts_fn(rows, local_sizes) applies this
  device's E / n_ep experts. Returns (y [T, D] float32: the weighted sum of
  each token's K expert outputs, summed over the group in x's dtype;
  dropped: int32 (token, choice) pairs routed here that found no room).

  The local rows are held in a buffer of `buffer_rows` rows (the worst
  case unless capacity_factor > 0): rows past it are dropped, the tail of
  the last experts first, as in `exchange`.
  """
  n = jax.lax.axis_size(EXPERT_AXIS)
  me = jax.lax.axis_index(EXPERT_AXIS)
  T, K = experts_TxK.shape
  L = num_experts // n
  cap = buffer_rows(T, K, num_experts, n, capacity_factor)
  gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, axis=0, tiled=True)
  with jax.named_scope("dispatch"):
    x_NxD, experts_NxK, weights_NxK = (gather(a) for a in (
        x_TxD, experts_TxK, weights_TxK))
    N = n * T
    # Pairs of local experts first, by expert; the others (key L) last.
    local = experts_NxK.reshape(N * K) - me * L
    key = jnp.where((local >= 0) & (local < L), local, L)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    # Compare-and-count, not bincount's atomic scatter-add (moe.dispatch).
    sizes = jnp.sum(key[:, None] == jnp.arange(L), axis=0, dtype=jnp.int32)
    kept = jnp.clip(cap - (jnp.cumsum(sizes) - sizes), 0, sizes)
    total = kept.sum()
    # Each pair's row in the buffer, or `cap` (no row: another device's
    # expert, or dropped).
    rank = jnp.zeros_like(order).at[order].set(
        jnp.arange(N * K, dtype=jnp.int32), unique_indices=True)
    row_NxK = jnp.where(rank < total, rank, cap).reshape(N, K)
    pair_C = order[:cap]
    x_CxD = pair_rows(x_NxD, pair_C, row_NxK)
  y_CxD = experts_fn(x_CxD, kept)
  with jax.named_scope("combine"):
    y_NxD = sum_rows(y_CxD, weights_NxK, row_NxK, pair_C, x_TxD.dtype)
    y = jax.lax.psum_scatter(y_NxD, EXPERT_AXIS,
                             scatter_dimension=0, tiled=True)
  return y.astype(jnp.float32), (sizes.sum() - total).astype(jnp.int32)


# Rows of (token, choice) pairs and the tokens they come from, without a
# scatter: moe.dispatch's sorted copies and gather_exchange's buffer. Pair
# j = t*K + k; `pair_C[i]` is the pair row i holds; `row_NxK[t, k]` the row
# that holds pair (t, k), C ("no row") for a pair without one.


def _gathered_sum(rows_CxD, row_NxK, weights_NxK=None):
  """out[t] = sum_k w[t, k] * rows[row[t, k]] ("no row" adds 0), float32.

  Written as K gathers added up, which XLA fuses into one elementwise loop
  (each output element reads its K rows once): as a gather into [N, K, D]
  and a sum over K it was a reduction over a middle axis, 0.82 ms a layer
  on an H100 at m2_small's 32K tokens, four times its memory floor
  (benchmarks/notes/train.md, session h).
  """
  out = 0.0
  for k in range(row_NxK.shape[1]):
    row = jnp.take(rows_CxD, row_NxK[:, k], axis=0, mode="fill",
                   fill_value=0).astype(jnp.float32)
    out = out + (row if weights_NxK is None else weights_NxK[:, k, None] * row)
  return out


@jax.custom_vjp
def pair_rows(x_NxD, pair_C, row_NxK):
  """Row i = x[pair_C[i] // K], the token of the pair it holds (rows past
  the kept ones: whatever token, unread). The gradient gathers each token's
  rows and sums them (float32) instead of jnp.take's scatter-add, whose K
  colliding rows a token the GPU resolves with atomics (1.38 ms a layer on
  an H100 at m2_small's 16K tokens)."""
  K = row_NxK.shape[1]
  # mode="clip" (the indices are in range): jnp.take's default "fill" adds
  # a select on every element (0.456 -> 0.433 ms a layer on an H100 at
  # m2_small's 32K tokens).
  return jnp.take(x_NxD, pair_C // K, axis=0, mode="clip")


def _pair_rows_fwd(x_NxD, pair_C, row_NxK):
  return pair_rows(x_NxD, pair_C, row_NxK), row_NxK


def _pair_rows_bwd(row_NxK, g_CxD):
  # g has the rows' dtype, x's.
  return _gathered_sum(g_CxD, row_NxK).astype(g_CxD.dtype), None, None


pair_rows.defvjp(_pair_rows_fwd, _pair_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def sum_rows(y_CxD, weights_NxK, row_NxK, pair_C, dtype=jnp.float32):
  """Each token's weighted sum of its rows, summed in float32 and returned
  in `dtype`. Gradients: d rows by a gather (row i: its pair's weight x d
  out of its token), d weights by a dot of each row with its token's d out;
  no scatter.

  Return the dtype the caller casts to next (the compute dtype): the same
  values as a cast after, and the cotangent arrives in that dtype.
  """
  del pair_C
  return _gathered_sum(y_CxD, row_NxK, weights_NxK).astype(dtype)


def _sum_rows_fwd(y_CxD, weights_NxK, row_NxK, pair_C, dtype):
  out = sum_rows(y_CxD, weights_NxK, row_NxK, pair_C, dtype)
  return out, (y_CxD, weights_NxK, row_NxK, pair_C)


def _sum_rows_bwd(dtype, residuals, g_NxD):
  del dtype
  y_CxD, weights_NxK, row_NxK, pair_C = residuals
  N, K = row_NxK.shape
  C = y_CxD.shape[0]
  # Each row next to d out of its token: d rows, and (the rows read in
  # their own order) the dot that is d weights of the pair the row holds,
  # then picked for each pair by its row (0 for "no row").
  g_CxD = jnp.take(g_NxD, pair_C // K, axis=0, mode="clip").astype(jnp.float32)
  # Row i holds pair pair_C[i] if that pair points back at it.
  mine = row_NxK.reshape(N * K)[pair_C] == jnp.arange(C, dtype=pair_C.dtype)
  scale = jnp.where(mine, weights_NxK.reshape(N * K)[pair_C], 0.0)
  d_y = g_CxD * scale[:, None]
  dot_C = jnp.sum(y_CxD.astype(jnp.float32) * g_CxD, axis=-1)
  d_weights = jnp.take(dot_C, row_NxK, axis=0, mode="fill", fill_value=0)
  return d_y.astype(y_CxD.dtype), d_weights, None, None


sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)
