"""The MoE feed-forward: router, dropless sort-based dispatch, SwiGLU experts.

Router (float32 throughout; the released bias values are several units large
and bf16 rounding would change the choice):
  s = sigmoid(x @ router)               (or softmax for the gating ablation)
  chosen = top_k(s + bias)              the bias only *chooses*
  weights = s[chosen] / sum(s[chosen])  un-biased, renormalised, * scaling

Dispatch: every (token, choice) pair is sorted by expert, the experts run as
two grouped matmuls (`kernels.gmm`: gate and up projections fused with the
SwiGLU, then the down projection), and the outputs are unsorted and
combined with the weights in float32. No token is ever dropped (unless an
expert-parallel capacity factor is set, see below).

Under a mesh with an "expert" axis (m2jax.sharding.use_mesh) the dispatch,
experts and combine run inside `jax.shard_map`: tokens travel to the devices
that own their experts and back (m2jax.model.expert_parallel), each expert's
FFN dimension is split over "tensor"; a capacity factor
(`Settings.capacity_factor`) bounds the receive buffer and counts what it
drops in RoutingStats.dropped. Without a mesh nothing changes.

Which kernels run, with which tiles, and how tokens are exchanged is
`config.settings` (m2jax.settings): this module reads gmm_backend,
gmm_tiles, interpret, all_to_all, capacity_factor and exchange_chunks.

The expert bias lives in the non-trainable collection "expert_bias"; it is
updated outside the gradient by `update_expert_bias` from the per-expert
load the model returns (DeepSeek-V3's aux-loss-free balancing). The small
sequence-wise balance loss that remains (`summarize_routing`) treats each
document (segment) of a packed row as its own sequence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels.gmm import gmm, gmm_swiglu
from m2jax.config import BIAS_UPDATES, ModelConfig
from m2jax.settings import Settings
from m2jax.model import expert_parallel
from m2jax.model.expert_parallel import EXPERT_AXIS, TENSOR_AXIS
from m2jax.model.layers import constrain, dtype_of, param_init

EXPERT_BIAS = "expert_bias"


class Routing(NamedTuple):
  """The router's decision for T tokens (all float32 except indices)."""
  scores_TxE: jax.Array     # un-biased gate scores s
  experts_TxK: jax.Array    # chosen expert ids (int32)
  weights_TxK: jax.Array    # combine weights (un-biased, renormalised)


def _bf16_pieces(a, n: int):
  """n bfloat16 arrays that add up to float32 `a` to ~8n of its 24 bits."""
  pieces = []
  for _ in range(n):
    piece = a.astype(jnp.bfloat16)
    pieces.append(piece)
    a = a - piece.astype(jnp.float32)
  return pieces


def _dot_of_pieces(a, b_pieces):
  """a @ sum(b_pieces) in float32: one bf16 matmul against [b0 | b1 | ..]."""
  out = jnp.dot(a, jnp.concatenate(b_pieces, axis=-1),
                preferred_element_type=jnp.float32)
  parts = jnp.split(out, len(b_pieces), axis=-1)
  total = parts[-1]
  for part in parts[-2::-1]:  # the smallest first
    total = total + part
  return total


def router_logits(x_TxD, router_DxE):
  """x @ router at float32 precision (router float32).

  A bfloat16 x takes bfloat16 tensor-core matmuls: x is exact in one piece
  and the float32 router in three (hi + mid + lo, 24 bits), so x @ [hi |
  mid | lo] summed is the float32 product up to accumulation order, at bf16
  matmul speed and without a float32 copy of x. The gradients split the
  same way: d router = x^T @ [three pieces of g] (float32-exact), dx = g @
  router^T from two pieces of each side (16 bits, for a bfloat16 dx). Any
  other x takes the float32 matmul.
  """
  if x_TxD.dtype == jnp.bfloat16:
    return _router_logits_bf16(x_TxD, router_DxE)
  return jnp.dot(x_TxD.astype(jnp.float32), router_DxE,
                 precision=jax.lax.Precision.HIGHEST)


@jax.custom_vjp
def _router_logits_bf16(x_TxD, router_DxE):
  return _dot_of_pieces(x_TxD, _bf16_pieces(router_DxE, 3))


def _router_logits_fwd(x_TxD, router_DxE):
  return _router_logits_bf16(x_TxD, router_DxE), (x_TxD, router_DxE)


def _router_logits_bwd(res, g_TxE):
  x_TxD, router_DxE = res
  g_pieces = _bf16_pieces(g_TxE, 3)
  g_hi, g_lo = g_pieces[:2]
  r_hi, r_lo = _bf16_pieces(router_DxE, 2)
  # g @ r^T ~ g_hi r_hi + g_hi r_lo + g_lo r_hi: one matmul over 3E.
  dx = jnp.dot(jnp.concatenate([g_hi, g_hi, g_lo], axis=-1),
               jnp.concatenate([r_hi, r_lo, r_hi], axis=-1).T,
               preferred_element_type=jnp.float32)
  drouter = _dot_of_pieces(x_TxD.T, g_pieces)
  return dx.astype(x_TxD.dtype), drouter


_router_logits_bf16.defvjp(_router_logits_fwd, _router_logits_bwd)


# The named scopes (router, routing_stats, dispatch, combine, experts) name
# these ops in profiles: benchmarks.train_profile_table sorts time by them.
@jax.named_scope("router")
def route(x_TxD, router_DxE, bias_E, *, top_k: int, gating: str,
          scaling: float) -> Routing:
  """Choose experts with the biased scores, weight them with the un-biased."""
  logits = router_logits(x_TxD, router_DxE.astype(jnp.float32))
  if gating == "sigmoid":
    scores = jax.nn.sigmoid(logits)
  else:
    scores = jax.nn.softmax(logits, axis=-1)
  choice = scores if bias_E is None else scores + bias_E.astype(jnp.float32)
  _, experts = jax.lax.top_k(choice, top_k)
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True) * scaling
  return Routing(scores, experts.astype(jnp.int32), weights)


class RoutingStats(NamedTuple):
  """Per-layer routing statistics over the counted (non-padding) tokens."""
  load_E: jax.Array       # number of (token, choice) pairs per expert
  aux_loss: jax.Array     # sequence-wise balance loss, mean over documents
  entropy: jax.Array      # mean entropy of the normalised gate scores
  # (token, choice) pairs that found no room in an expert-parallel capacity
  # buffer (int32, all devices); 0 unless a capacity factor is set.
  dropped: jax.Array = 0
  # Documents the aux loss averages over (int32): with load_E (K x the
  # counted tokens, which entropy averages over) what it takes to combine
  # the means of several micro-batches (m2jax.rl.step).
  documents: jax.Array = 0


def document_slots(doc_ids_BxT):
  """Each token's document as an index in [0, T) of its own row [B, T].

  Tokens of a row that share an id share a slot; ids need not be small or
  contiguous (attention groups tokens by equality of id, and so does this).
  """
  B = doc_ids_BxT.shape[0]
  order = jnp.argsort(doc_ids_BxT, axis=1, stable=True)
  ids = jnp.take_along_axis(doc_ids_BxT, order, axis=1)
  starts = jnp.concatenate([jnp.ones((B, 1), bool), ids[:, 1:] != ids[:, :-1]],
                           axis=1)
  rank = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
  return jnp.take_along_axis(rank, jnp.argsort(order, axis=1), axis=1)


@jax.named_scope("routing_stats")
def summarize_routing(routing: Routing, doc_ids_BxT, num_experts: int,
                      dropped=None) -> RoutingStats:
  """Load per expert, the sequence-wise aux loss and the router entropy.

  `doc_ids_BxT` are the segment ids of the tokens that count (0 = not
  counted: padding, or MTP positions past their document's end). A
  "sequence" of the balance loss is one document: the tokens of one row that
  share an id, never the whole packed row (in the prefix-tree layout, one
  tree, each shared token counted once).

  aux loss (DeepSeek-V3's sequence-wise balance loss, E experts, top-K):
    for each document d of n_d counted tokens,
      f_e = E / (K * n_d) * #{(t, k): t in d, expert_k(t) = e}
      P_e = 1 / n_d * sum_{t in d} s_{t,e} / sum_e' s_{t,e'}
      L_d = sum_e f_e * P_e        (1.0 when perfectly balanced)
    aux = mean of L_d over the documents of the batch (every document
    weighs the same, whatever its length or row; 0 with no document).

  Tokens are summed into at most T document slots per row (a segment sum),
  so the cost is [B*T, E] like the load, never [T, T].
  """
  B, T = doc_ids_BxT.shape
  K = routing.experts_TxK.shape[-1]
  E = num_experts
  counted = (doc_ids_BxT != 0).reshape(B * T).astype(jnp.float32)
  onehot = jax.nn.one_hot(routing.experts_TxK, E, dtype=jnp.float32)
  counts_TxE = onehot.sum(axis=1) * counted[:, None]
  load = counts_TxE.sum(axis=0)

  probs = routing.scores_TxE / jnp.sum(routing.scores_TxE, -1, keepdims=True)
  row_start = T * jnp.arange(B, dtype=jnp.int32)[:, None]
  slot = (document_slots(doc_ids_BxT) + row_start).reshape(B * T)
  per_doc = lambda x: jax.ops.segment_sum(x, slot, num_segments=B * T)
  n_S = per_doc(counted)
  n = jnp.maximum(n_S, 1.0)[:, None]
  f_SxE = per_doc(counts_TxE) * E / (K * n)
  p_SxE = per_doc(probs * counted[:, None]) / n
  num_docs = jnp.sum(n_S > 0)
  aux = jnp.sum(f_SxE * p_SxE) / jnp.maximum(num_docs, 1)

  ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
  entropy = jnp.sum(ent * counted) / jnp.maximum(counted.sum(), 1.0)
  dropped = jnp.zeros((), jnp.int32) if dropped is None else dropped
  return RoutingStats(load, aux, entropy, dropped,
                      num_docs.astype(jnp.int32))


def update_expert_bias(bias, load, rate: float, rule: str = "sign"):
  """Aux-loss-free balancing: move under-loaded experts up, over-loaded down.

    sign          bias += rate * sign(mean_load - load)  (DeepSeek-V3)
    proportional  bias += rate * (mean_load - load) / mean_load

  Works on one layer ([E]) or stacked layers ([..., E]). Pure: returns the
  new bias. "proportional" moves each expert by its relative load error:
  a collapsed router (one expert at K x the mean) is corrected in a few
  steps, and at balance the step shrinks to the load noise instead of
  jittering by `rate` (benchmarks/notes/router.md).
  """
  load = load.astype(jnp.float32)
  mean = jnp.mean(load, axis=-1, keepdims=True)
  if rule == "sign":
    step = jnp.sign(mean - load)
  elif rule == "proportional":
    step = (mean - load) / jnp.maximum(mean, 1e-9)
  else:
    raise ValueError(f"bias update rule must be one of {BIAS_UPDATES}, "
                     f"got {rule!r}")
  return bias + (rate * step).astype(bias.dtype)


class Sort(NamedTuple):
  """The dispatch's sort of the T*K (token, choice) pairs by expert: row i
  of the sorted rows is pair order[i]; pair j is sorted row inverse[j]."""
  order: jax.Array
  inverse: jax.Array


@jax.named_scope("dispatch")
def dispatch(x_TxD, routing: Routing, num_experts: int):
  """Sort (token, choice) pairs by expert.

  Returns the sorted token copies [T*K, D], the group sizes [E] and the
  `Sort` (what `combine`, and the gradients, undo the sort with).
  """
  T, K = routing.experts_TxK.shape
  flat = routing.experts_TxK.reshape(T * K)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.argsort(order)
  x_sorted = token_copies(K, x_TxD, order, inverse)
  # A compare-and-count, not jnp.bincount: that is a scatter-add, which the
  # GPU runs with atomics (0.12 ms a layer at m2_small's 32K tokens).
  group_sizes = jnp.sum(flat[:, None] == jnp.arange(num_experts), axis=0,
                        dtype=jnp.int32)
  return x_sorted, group_sizes, Sort(order, inverse)


def token_copies(K: int, x_TxD, order, inverse):
  """x_TxD[order // K]: row i is a copy of token order[i] // K, `order` a
  permutation of the T*K (token, choice) pairs and `inverse` its inverse.
  Its gradient gathers each token's K rows and sums them, no scatter-add
  (expert_parallel.pair_rows)."""
  return expert_parallel.pair_rows(x_TxD, order, inverse.reshape(-1, K))


@jax.named_scope("combine")
def combine(y_sorted, routing: Routing, sort: Sort, dtype=jnp.float32):
  """Undo the sort (from `dispatch`) and sum each token's K expert outputs,
  weighted, in f32, returned in `dtype`: each token gathers its K rows and
  sums them in one pass, and the gradients are gathers too
  (expert_parallel.sum_rows), never a scatter."""
  return expert_parallel.sum_rows(
      y_sorted, routing.weights_TxK,
      sort.inverse.reshape(routing.weights_TxK.shape), sort.order, dtype)


@jax.named_scope("experts")
def swiglu_experts(x_sorted, group_sizes, w1, w3, w2, *, settings: Settings):
  """Expert e computes w2(silu(w1 x) * w3 x) on its rows of `x_sorted`.

  The gated up-projection is one fused grouped matmul (w1 and w3 together,
  silu(a) * b in float32 in its epilogue); outputs are in the compute dtype
  and `combine` sums them in float32. The grouped matmuls run on
  settings.gmm_backend with settings.gmm_tiles.
  """
  cdt = x_sorted.dtype
  kernel = dict(backend=settings.gmm_backend, tiles=settings.gmm_tiles,
                interpret=settings.interpret)
  h = gmm_swiglu(x_sorted, w1.astype(cdt), w3.astype(cdt), group_sizes,
                 **kernel)
  return gmm(h, w2.astype(cdt), group_sizes, preferred_element_type=cdt,
             **kernel)


def _token_axes(mesh) -> tuple[str, ...]:
  """Mesh axes the logical rules give MoE tokens ("act_tokens")."""
  spec = nn.logical_to_mesh_axes(("act_tokens",))
  axes = spec[0] if spec is not None and len(spec) else None
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(a for a in axes if a in mesh.axis_names)


def _expert_mesh(num_tokens: int):
  """(mesh, token axes) for the expert-parallel path, or None.

  None without a mesh that has an "expert" axis, and when the tokens do not
  split evenly over the token axes (e.g. one-row sampling), where the plain
  path runs and XLA partitions it.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    return None
  axes = _token_axes(mesh)
  if EXPERT_AXIS not in axes:
    raise ValueError(
        f"the logical rules must shard 'act_tokens' over the '{EXPERT_AXIS}' "
        f"mesh axis for expert parallelism; they give {axes}")
  shards = math.prod(mesh.shape[a] for a in axes)
  if num_tokens % shards:
    return None
  return mesh, axes


def sharded_experts(x_TxD, routing: Routing, w1, w3, w2, *, mesh, token_axes,
                    settings: Settings):
  """Dispatch, experts and combine, sharded over `mesh` (see module doc).

  x_TxD and routing are global arrays split over `token_axes`; w1/w3
  [E, D, F], w2 [E, F, D]. The exchange follows settings.all_to_all,
  capacity_factor and exchange_chunks. Returns (y [T, D] float32, dropped
  int32).
  """
  n_ep = mesh.shape[EXPERT_AXIS]
  n_tp = mesh.shape.get(TENSOR_AXIS, 1)
  E, _, F = w1.shape
  K = routing.experts_TxK.shape[1]
  if E % n_ep or F % n_tp:
    raise ValueError(
        f"expert parallelism needs num_experts={E} divisible by the "
        f"'{EXPERT_AXIS}' axis ({n_ep}) and moe_intermediate_size={F} by "
        f"the '{TENSOR_AXIS}' axis ({n_tp})")
  impl = expert_parallel.resolve_impl(settings.all_to_all)

  def chunk(x, experts, weights, w1, w3, w2):
    run = lambda rows, sizes: swiglu_experts(rows, sizes, w1, w3, w2,
                                             settings=settings)
    if impl == "allgather" and n_ep > 1:
      return expert_parallel.gather_exchange(
          x, experts, weights, run, num_experts=E,
          capacity_factor=settings.capacity_factor)
    local = Routing(None, experts, weights)
    x_sorted, sizes_E, sort = dispatch(x, local, E)
    if n_ep == 1:
      y_sorted, dropped = run(x_sorted, sizes_E), jnp.zeros((), jnp.int32)
    else:
      y_sorted, dropped = expert_parallel.exchange(
          x_sorted, sizes_E, run, top_k=K,
          capacity_factor=settings.capacity_factor, impl=impl)
    # Tensor parallelism adds the partial outputs in float32 (below).
    return combine(y_sorted, local, sort,
                   jnp.float32 if n_tp > 1 else x.dtype), dropped

  def body(x, experts, weights, w1, w3, w2):
    chunks = settings.exchange_chunks
    c = chunks if x.shape[0] % chunks == 0 else 1
    parts = [chunk(*(a.reshape(c, -1, *a.shape[1:])[i]
                     for a in (x, experts, weights)), w1, w3, w2)
             for i in range(c)]
    y = jnp.concatenate([p[0] for p in parts]) if c > 1 else parts[0][0]
    dropped = sum(p[1] for p in parts)
    if n_tp > 1:  # each device holds F / n_tp of every expert's FFN
      y = jax.lax.psum(y, TENSOR_AXIS)
    return y, jax.lax.psum(dropped, token_axes)

  tokens = P(token_axes)
  w_in = P(EXPERT_AXIS, None, TENSOR_AXIS if n_tp > 1 else None)
  w_out = P(EXPERT_AXIS, TENSOR_AXIS if n_tp > 1 else None, None)
  # check_vma=False: the Pallas grouped matmul's custom VJP (kernels/gmm.py)
  # returns cotangents without varying-axis types, which the check rejects.
  # The psums above are written out, so the types carry nothing needed.
  return jax.shard_map(
      body, mesh=mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
      out_specs=(tokens, P()), check_vma=False)(x_TxD, routing.experts_TxK,
                               routing.weights_TxK, w1, w3, w2)


class MoE(nn.Module):
  """Sparse MoE FFN. Returns (output [B, T, D], RoutingStats or None).

  `segment_ids_BxT` (0 = padding) and `valid_BxT` (the tokens the routing
  statistics count) only feed the statistics: every token is routed.
  `stats=False` (generation) skips the statistics and returns None.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, valid_BxT, stats=True):
    cfg = self.config
    B, T, D = x_BxTxD.shape
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    pdt, cdt = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
    # The router stays float32 whatever param_dtype says.
    router = self.param("router", param_init(cfg, ("embed", "router")),
                        (D, E), jnp.float32)
    bias = None
    if cfg.use_routing_bias:
      bias = self.variable(EXPERT_BIAS, "bias", jnp.zeros, (E,),
                           jnp.float32).value
    w1 = self.param("w1", param_init(cfg, ("expert", "embed", "expert_mlp")),
                    (E, D, F), pdt)
    w3 = self.param("w3", param_init(cfg, ("expert", "embed", "expert_mlp")),
                    (E, D, F), pdt)
    w2 = self.param("w2", param_init(cfg, ("expert", "expert_mlp", "embed")),
                    (E, F, D), pdt)

    x_TxD = x_BxTxD.reshape(B * T, D)
    routing = route(x_TxD, router, bias, top_k=cfg.num_experts_per_tok,
                    gating=cfg.gating, scaling=cfg.routed_scaling_factor)
    sharded = _expert_mesh(B * T)
    if sharded is None:
      x_sorted, group_sizes, sort = dispatch(x_TxD.astype(cdt), routing, E)
      x_sorted = constrain(x_sorted, ("act_tokens", "act_embed"))
      y_sorted = swiglu_experts(x_sorted, group_sizes, w1, w3, w2,
                                settings=cfg.settings)
      y, dropped = combine(y_sorted, routing, sort, cdt), None
    else:
      mesh, axes = sharded
      y, dropped = sharded_experts(x_TxD.astype(cdt), routing, w1, w3, w2,
                                   mesh=mesh, token_axes=axes,
                                   settings=cfg.settings)
    y = y.astype(cdt).reshape(B, T, D)
    y = constrain(y, ("act_batch", "act_length", "act_embed"))
    if not stats:  # generation: nothing reads the statistics
      return y, None
    doc_ids = jnp.where(valid_BxT, segment_ids_BxT, 0)
    return y, summarize_routing(routing, doc_ids, E, dropped)


class DenseFFN(nn.Module):
  """Dense SwiGLU FFN (the ablation without experts)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    D, F = cfg.hidden_size, cfg.dense_intermediate_size
    pdt, cdt = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
    w1 = self.param("w1", param_init(cfg, ("embed", "mlp")), (D, F), pdt)
    w3 = self.param("w3", param_init(cfg, ("embed", "mlp")), (D, F), pdt)
    w2 = self.param("w2", param_init(cfg, ("mlp", "embed")), (F, D), pdt)
    x = x_BxTxD.astype(cdt)
    h1 = jnp.einsum("btd,df->btf", x, w1.astype(cdt),
                    preferred_element_type=jnp.float32)
    h3 = jnp.einsum("btd,df->btf", x, w3.astype(cdt),
                    preferred_element_type=jnp.float32)
    h = (jax.nn.silu(h1) * h3).astype(cdt)
    y = jnp.einsum("btf,fd->btd", h, w2.astype(cdt))
    return constrain(y, ("act_batch", "act_length", "act_embed"))
