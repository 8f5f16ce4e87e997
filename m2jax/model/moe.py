"""The MoE feed-forward: router, dropless sort-based dispatch, SwiGLU experts.

Router (float32 throughout; the released bias values are several units large
and bf16 rounding would change the choice):
  s = sigmoid(x @ router)               (or softmax for the gating ablation)
  chosen = top_k(s + bias)              the bias only *chooses*
  weights = s[chosen] / sum(s[chosen])  un-biased, renormalised, * scaling

Dispatch: every (token, choice) pair is sorted by expert, the experts run as
three grouped matmuls (`kernels.gmm`), and the outputs are unsorted and
combined with the weights in float32. No token is ever dropped.

The expert bias lives in the non-trainable collection "expert_bias"; it is
updated outside the gradient by `update_expert_bias` from the per-expert
load the model returns (DeepSeek-V3's aux-loss-free balancing).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from kernels.gmm import gmm
from m2jax.config import ModelConfig
from m2jax.model.layers import constrain, dtype_of, param_init

EXPERT_BIAS = "expert_bias"


class Routing(NamedTuple):
  """The router's decision for T tokens (all float32 except indices)."""
  scores_TxE: jax.Array     # un-biased gate scores s
  experts_TxK: jax.Array    # chosen expert ids (int32)
  weights_TxK: jax.Array    # combine weights (un-biased, renormalised)


def route(x_TxD, router_DxE, bias_E, *, top_k: int, gating: str,
          scaling: float) -> Routing:
  """Choose experts with the biased scores, weight them with the un-biased."""
  logits = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
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
  """Per-layer routing statistics over the valid (non-padding) tokens."""
  load_E: jax.Array       # number of (token, choice) pairs per expert
  aux_loss: jax.Array     # sequence-level balance loss (unscaled)
  entropy: jax.Array      # mean entropy of the normalised gate scores


def routing_stats(routing: Routing, valid_BxT, num_experts: int) -> RoutingStats:
  """Load per expert, the sequence-level aux loss and the router entropy.

  aux loss (DeepSeek-V3, per sequence, averaged over the batch):
    f_e = E / (K * T_b) * #{tokens of the sequence routed to e}
    P_e = mean over the sequence's tokens of s_e / sum(s)
    L   = sum_e f_e * P_e          (1.0 when perfectly balanced)
  """
  B, T = valid_BxT.shape
  K = routing.experts_TxK.shape[-1]
  valid = valid_BxT.astype(jnp.float32)
  onehot = jax.nn.one_hot(routing.experts_TxK, num_experts, dtype=jnp.float32)
  counts_BxTxE = onehot.sum(axis=1).reshape(B, T, num_experts)
  counts_BxTxE = counts_BxTxE * valid[..., None]
  load = counts_BxTxE.sum(axis=(0, 1))

  probs = routing.scores_TxE / jnp.sum(routing.scores_TxE, -1, keepdims=True)
  probs_BxTxE = probs.reshape(B, T, num_experts) * valid[..., None]
  n_b = jnp.maximum(valid.sum(axis=1), 1.0)
  f = counts_BxTxE.sum(axis=1) * num_experts / (K * n_b[:, None])
  p = probs_BxTxE.sum(axis=1) / n_b[:, None]
  aux = jnp.mean(jnp.sum(f * p, axis=-1))

  ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
  entropy = jnp.sum(ent * valid.reshape(-1)) / jnp.maximum(valid.sum(), 1.0)
  return RoutingStats(load, aux, entropy)


def update_expert_bias(bias, load, rate: float):
  """Aux-loss-free balancing: bias += rate * sign(mean_load - load).

  Works on one layer ([E]) or stacked layers ([..., E]); under-loaded experts
  move up, over-loaded ones down. Pure: returns the new bias.
  """
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return bias + rate * jnp.sign(mean - load).astype(bias.dtype)


def dispatch(x_TxD, routing: Routing, num_experts: int):
  """Sort (token, choice) pairs by expert.

  Returns the sorted token copies [T*K, D], the group sizes [E] and the
  sort order (to undo it in `combine`).
  """
  T, K = routing.experts_TxK.shape
  flat = routing.experts_TxK.reshape(T * K)
  order = jnp.argsort(flat, stable=True)
  x_sorted = jnp.take(x_TxD, order // K, axis=0)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return x_sorted, group_sizes, order


def combine(y_sorted, routing: Routing, order):
  """Undo the sort and sum each token's K expert outputs, weighted, in f32."""
  T, K = routing.experts_TxK.shape
  inverse = jnp.argsort(order)
  y_TxKxD = jnp.take(y_sorted, inverse, axis=0).reshape(T, K, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32),
                    routing.weights_TxK)


def swiglu_experts(x_sorted, group_sizes, w1, w3, w2, *, backend: str):
  """Expert e computes w2(silu(w1 x) * w3 x) on its rows of `x_sorted`."""
  cdt = x_sorted.dtype
  h1 = gmm(x_sorted, w1.astype(cdt), group_sizes,
           preferred_element_type=jnp.float32, backend=backend)
  h3 = gmm(x_sorted, w3.astype(cdt), group_sizes,
           preferred_element_type=jnp.float32, backend=backend)
  h = (jax.nn.silu(h1) * h3).astype(cdt)
  return gmm(h, w2.astype(cdt), group_sizes,
             preferred_element_type=jnp.float32, backend=backend)


class MoE(nn.Module):
  """Sparse MoE FFN. Returns (output [B, T, D], RoutingStats)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD, valid_BxT):
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
    x_sorted, group_sizes, order = dispatch(x_TxD.astype(cdt), routing, E)
    x_sorted = constrain(x_sorted, ("act_tokens", "act_embed"))
    y_sorted = swiglu_experts(x_sorted, group_sizes, w1, w3, w2,
                              backend=cfg.gmm_backend)
    y = combine(y_sorted, routing, order).astype(cdt).reshape(B, T, D)
    stats = routing_stats(routing, valid_BxT, E)
    return constrain(y, ("act_batch", "act_length", "act_embed")), stats


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
