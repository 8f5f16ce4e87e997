"""Pure functional API over the MiniMax-M2 Flax modules.

  variables = m2jax.model.init(config, jax.random.key(0))
  logits_BxTxV = m2jax.model.logits(config, variables, tokens_BxT)
  out = m2jax.model.forward(config, variables, tokens_BxT, mtp_depth=1)
  out.mtp_logits[k - 1]     # depth k: position t predicts token t + k + 1
  out.routing.load_E        # [L, E] per-layer expert load (for the bias)

`variables` is a plain dict {"params": ..., "expert_bias": ...}: trainable
parameters and the non-trainable routing bias, never hidden state. How the
step runs (kernels and tiles, the expert exchange, remat) is
`config.settings` (m2jax.settings), part of every jit cache key.

Prefix-tree merged rows (m2jax.rl.prefix_tree) pass `subtree_end` (and
`parent` for MTP) with positions = depths:
  out = m2jax.model.forward(config, variables, trees.tokens,
                            **trees.model_inputs(), mtp_depth=1)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.config import ConfigError, ModelConfig
from m2jax.model.moe import (EXPERT_BIAS, Routing, RoutingStats, route,
                             update_expert_bias)
from m2jax.model import paged
from m2jax.model.mtp import shift_left
from m2jax.model.transformer import ModelOutput, Transformer

__all__ = [
    "EXPERT_BIAS", "ModelOutput", "Routing", "RoutingStats", "Transformer",
    "decode", "forward", "init", "logical_axes", "logits", "measure_routing",
    "mtp_decode", "mtp_logits", "paged", "route", "shift_left",
    "update_expert_bias", "update_expert_biases",
]


def _module(config: ModelConfig) -> Transformer:
  return Transformer(config)


def _init_boxed(config: ModelConfig, rng):
  tokens = jnp.zeros((1, 2), jnp.int32)
  return _module(config).init(rng, tokens,
                              mtp_depth=config.num_mtp_modules)


def init(config: ModelConfig, rng) -> dict:
  """Fresh variables: {"params": ..., "expert_bias": ...} (bias zeros)."""
  return nn.meta.unbox(jax.jit(_init_boxed, static_argnums=0)(config, rng))


def logical_axes(config: ModelConfig) -> dict:
  """Logical axis names of every variable, as a pytree of PartitionSpecs."""
  boxed = jax.eval_shape(lambda: _init_boxed(config, jax.random.key(0)))
  return nn.get_partition_spec(boxed)


def _check_mtp(config: ModelConfig, variables, mtp_depth: int):
  if not 0 <= mtp_depth <= config.num_mtp_modules:
    raise ConfigError(f"mtp_depth must be in [0, num_mtp_modules="
                      f"{config.num_mtp_modules}], got {mtp_depth}")
  missing = [k for k in range(mtp_depth)
             if f"mtp_{k}" not in variables.get("params", {})]
  if missing:
    raise ConfigError(
        f"variables have no parameters for MTP modules {missing} (hub "
        "checkpoints ship none): initialise or grow them before asking for "
        "mtp_depth > 0")


def forward(config: ModelConfig, variables, tokens_BxT, *, segment_ids=None,
            positions=None, mtp_depth: int = 0, subtree_end=None,
            parent=None, mtp_detach: bool = False,
            logits: bool = True) -> ModelOutput:
  """Full forward pass: logits, MTP logits, last hidden state, routing.

  `subtree_end` [B, T] selects the tree layout (key j visible to queries
  j .. subtree_end[j] - 1; positions are depths); `parent` [B, T] (-1 at
  roots) makes the MTP shift follow tree edges (transformer.py).
  `mtp_detach`: gradients of the MTP logits reach only the MTP modules'
  own weights (the trunk, embedding, final norm and lm_head get none).
  `logits=False`: no [B, T, V] logits; the output carries the head's inputs
  and weight instead (ModelOutput.head_inputs, .lm_head), for a loss
  computed chunk by chunk (m2jax.train.losses.fused_cross_entropy).
  """
  _check_mtp(config, variables, mtp_depth)
  return _module(config).apply(variables, tokens_BxT, segment_ids, positions,
                               mtp_depth=mtp_depth,
                               subtree_end_BxT=subtree_end, parent_BxT=parent,
                               mtp_detach=mtp_detach, logits=logits)


def decode(config: ModelConfig, variables, tokens_BxT, pages: paged.PagedKV,
           block_tables_BxM, kv_lens_B, valid_BxT):
  """The main model over the paged KV cache (generation; m2jax/model/paged.py).

  tokens_BxT are each row's T newest tokens, right-aligned (valid_BxT False
  on left padding); their keys are written into `pages` (the main layers'
  pools) and they attend to all kv_lens_B keys of their row. Returns
  (logits [B, T, V] float32, hidden [B, T, D], new pages).
  """
  return _module(config).apply(variables, tokens_BxT, pages, block_tables_BxM,
                               kv_lens_B, valid_BxT,
                               method=Transformer.decode)


def mtp_decode(config: ModelConfig, variables, depth: int, hidden_BxTxD,
               tokens_BxT, pages: paged.PagedKV, block_tables_BxM, kv_lens_B,
               valid_BxT):
  """MTP module `depth` over its own paged cache: the element at position p
  reads hidden (h^{depth-1} at p) and emb(tokens), the token at p + depth.
  Returns (logits [B, T, V], h^depth [B, T, D], new pages of its blocks)."""
  _check_mtp(config, variables, depth)
  return _module(config).apply(variables, depth, hidden_BxTxD, tokens_BxT,
                               pages, block_tables_BxM, kv_lens_B, valid_BxT,
                               method=Transformer.mtp_decode)


def logits(config: ModelConfig, variables, tokens_BxT, *, segment_ids=None,
           positions=None, subtree_end=None):
  """Next-token logits [B, T, V] in float32 (tree layout: read the logits
  predicting token t at parent[t])."""
  return forward(config, variables, tokens_BxT, segment_ids=segment_ids,
                 positions=positions, subtree_end=subtree_end).logits


def mtp_logits(config: ModelConfig, variables, tokens_BxT, *, segment_ids=None,
               positions=None, depth: int | None = None):
  """Logits of MTP depths 1..depth (default: all modules), K x [B, T, V]."""
  depth = config.num_mtp_modules if depth is None else depth
  return forward(config, variables, tokens_BxT, segment_ids=segment_ids,
                 positions=positions, mtp_depth=depth).mtp_logits


def measure_routing(config: ModelConfig, variables, tokens_BxT, *,
                    segment_ids=None, positions=None) -> RoutingStats | None:
  """Runs the forward pass and returns its per-layer routing statistics
  ([L, E] load, [L] aux loss and entropy; None without MoE layers)."""
  return forward(config, variables, tokens_BxT, segment_ids=segment_ids,
                 positions=positions).routing


def _bias_paths(config: ModelConfig, mtp_depth: int) -> list[str]:
  """Bias leaves in the order of ModelOutput.routing then .mtp_routing.

  Row i of the stacked load comes from the i-th MoE that ran: layers 0..L-1,
  then MTP module 0's blocks, module 1's, ... (transformer.Transformer).
  """
  paths = [f"layers_{i}/moe/bias" for i in range(config.num_layers)]
  paths += [f"mtp_{k}/block_{j}/moe/bias" for k in range(mtp_depth)
            for j in range(config.mtp_transformer_layers)]
  return paths


def _path_name(path) -> str:
  return "/".join(getattr(k, "key", str(k)) for k in path)


def update_expert_biases(config: ModelConfig, expert_bias, out: ModelOutput,
                         rate: float | None = None):
  """Aux-loss-free update of every bias the forward pass routed with.

  Each bias moves by its own router's load: the main layers' from
  `out.routing.load_E` [L, E], the MTP blocks' from `out.mtp_routing.load_E`
  [depth * mtp_transformer_layers, E]; biases of MTP modules that did not run
  stay as they are. Raises if a router that ran has no bias in
  `expert_bias` (a renamed module would otherwise stop balancing
  silently). Pure: returns the new "expert_bias" tree.
  """
  rate = config.bias_update_rate if rate is None else rate
  if not expert_bias or out.routing is None:
    return expert_bias
  loads = [out.routing.load_E]
  if out.mtp_routing is not None:
    loads.append(out.mtp_routing.load_E)
  load = jnp.concatenate(loads, axis=0)
  paths = _bias_paths(config, len(out.mtp_logits))
  if load.shape[0] != len(paths):
    raise ValueError(f"routing statistics have {load.shape[0]} load rows, "
                     f"the config's routers that ran are {len(paths)}")
  index = {p: i for i, p in enumerate(paths)}
  present = {_path_name(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(expert_bias)[0]}
  missing = [p for p in paths if p not in present]
  if missing:
    raise ValueError(f"expert_bias has no leaf for routers {missing}")

  def update(path, bias):
    i = index.get(_path_name(path))
    return bias if i is None else update_expert_bias(bias, load[i], rate,
                                                     config.bias_update)

  return jax.tree_util.tree_map_with_path(update, expert_bias)
