"""Parameter counting: total, activated per token, and a per-component split.

Counts come from the model's own variable shapes (`jax.eval_shape` of init,
no memory used), so they can never drift from the code. Conventions:
  total_params     every variable of the main model, expert bias included,
                   MTP modules excluded (the released checkpoint has none);
  mtp_params       the MTP modules, reported separately;
  active_params_non_embedding
                   what one token touches outside embedding and lm_head:
                   everything but the experts, plus top_k / E of the experts;
  active_params    the same plus the embedding and lm_head matrices;
  mtp_active_params_per_module
                   what one token touches in one MTP module (its
                   projection, norms and blocks, top_k / E of its experts).

For MiniMax-M2 this gives 228,689,764,864 total and 9,801,359,872 active
non-embedding. The paper's "229.9B" is 1.21B more than the config gives
(about the size of the two vocabulary matrices); we report the config's.

FLOPs are counted here, once, for MFU and for every benchmark: model FLOPs
(the MFU convention of PaLM, Chowdhery et al. 2022, App. B): 2 per
multiply-add, the backward pass twice the forward (gradients of the inputs
and of the weights), recomputation (remat, the scores an attention backward
recomputes) not counted. Hence one factor, FWD_BWD = 3, for weights and
attention alike.
"""

from __future__ import annotations

import math

import jax

from m2jax import model
from m2jax.config import ModelConfig

COMPONENTS = ("embedding", "lm_head", "attention", "norms", "router",
              "expert_bias", "experts", "dense_mlp", "mtp_proj")


def _component(path: tuple[str, ...]) -> str:
  leaf = path[-1]
  if leaf == "embedding":
    return "embedding"
  if leaf == "lm_head":
    return "lm_head"
  if leaf == "scale":
    return "norms"
  if leaf == "bias":
    return "expert_bias"
  if leaf == "router":
    return "router"
  if leaf in ("w1", "w2", "w3"):
    return "experts" if "moe" in path else "dense_mlp"
  if leaf == "proj":
    return "mtp_proj"
  if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
    return "attention"
  raise ValueError(f"parameter {'/'.join(path)} has no counting component")


def count_params(config: ModelConfig) -> dict:
  """Total / active counts and the per-component breakdown (see module doc)."""
  shapes = jax.eval_shape(lambda: model.init(config, jax.random.key(0)))
  main = dict.fromkeys(COMPONENTS, 0)
  mtp = dict.fromkeys(COMPONENTS, 0)
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    path = tuple(getattr(k, "key", str(k)) for k in key_path)[1:]
    n = math.prod(leaf.shape)
    bucket = mtp if path[0].startswith("mtp_") else main
    bucket[_component(path)] += n
  total = sum(main.values())
  vocab = main["embedding"] + main["lm_head"]
  experts_active = 0
  if config.ffn_type == "moe":
    experts_active = (main["experts"] * config.num_experts_per_tok
                      // config.num_experts)
  active_non_emb = total - vocab - main["experts"] + experts_active
  mtp_active = 0
  if config.num_mtp_modules:  # the modules are alike
    mtp_experts_active = (mtp["experts"] * config.num_experts_per_tok
                          // config.num_experts)
    mtp_active = ((sum(mtp.values()) - mtp["experts"] + mtp_experts_active)
                  // config.num_mtp_modules)
  return {
      "total_params": total,
      "active_params": active_non_emb + vocab,
      "active_params_non_embedding": active_non_emb,
      "mtp_params": sum(mtp.values()),
      "mtp_active_params_per_module": mtp_active,
      "breakdown": {k: v for k, v in main.items() if v},
      "mtp_breakdown": {k: v for k, v in mtp.items() if v},
  }


# Forward + backward FLOPs in units of forward FLOPs (module docstring).
FWD_BWD = 3


def matmul_flops(rows: int, k: int, n: int, *, backward: bool = False) -> int:
  """[rows, k] @ [k, n]: 2 * rows * k * n, x FWD_BWD with the backward (the
  grouped matmuls count only their real rows)."""
  return 2 * rows * k * n * (FWD_BWD if backward else 1)


def attention_product_flops(entries, num_heads: int, head_dim: int,
                            products: int = 2) -> float:
  """`products` matmuls over `entries` visible (query, key) pairs per head,
  2 * head_dim FLOPs each per pair; a forward is 2 (q k^T and p v)."""
  return 2.0 * products * num_heads * head_dim * entries


def attention_flops(entries, num_heads: int, head_dim: int, *,
                    backward: bool = False) -> float:
  """Model FLOPs of attention over `entries` visible (query, key) pairs:
  4 * num_heads * head_dim per pair forward, x FWD_BWD with the backward.
  Causal attention over T tokens has T (T + 1) / 2 entries; a prefix tree,
  kernels.tree_attention.live_entries."""
  return (attention_product_flops(entries, num_heads, head_dim)
          * (FWD_BWD if backward else 1))


def train_flops(config: ModelConfig, tokens: int,
                attention_entries: int) -> float:
  """Model FLOPs of one forward + backward over `tokens` tokens whose
  attention sees `attention_entries` (query, key) pairs in every layer
  (a sliding-window layer is counted as if full): 2 x FWD_BWD per active
  parameter per token, plus attention."""
  counts = count_params(config)
  attn = config.num_layers * attention_flops(
      attention_entries, config.num_heads, config.head_dim, backward=True)
  return 2 * FWD_BWD * counts["active_params"] * tokens + attn


def flops_per_token(config: ModelConfig, seq_len: int, *,
                    mtp_depth: int) -> int:
  """Training FLOPs per token of full rows of `seq_len` causal tokens:
  2 x FWD_BWD per active parameter plus attention, where a token sees on
  average half its row (or half its window) in each layer. Each of the
  `mtp_depth` MTP modules a step trains (TrainConfig.mtp_depth) adds its
  active parameters, the shared lm_head it predicts through (its embedding
  read is a lookup, not a matmul) and its blocks' full causal attention."""
  if not 0 <= mtp_depth <= config.num_mtp_modules:
    raise ValueError(f"flops_per_token: mtp_depth must be in [0, "
                     f"{config.num_mtp_modules}] (the model's MTP modules), "
                     f"got {mtp_depth}")
  counts = count_params(config)
  entries = 0
  for layer in range(config.num_layers):
    window = config.layer_window(layer)
    span = seq_len if window is None else min(window, seq_len)
    entries += span / 2
  entries += mtp_depth * config.mtp_transformer_layers * seq_len / 2
  attn = attention_flops(entries, config.num_heads, config.head_dim,
                         backward=True)
  weights = counts["active_params"] + mtp_depth * (
      counts["mtp_active_params_per_module"]
      + counts["breakdown"].get("lm_head", 0))
  return int(2 * FWD_BWD * weights + attn)


def mfu(tokens_per_sec: float, flops_per_token: float,
        peak_flops_per_device: float | None,
        num_devices: int = 1) -> float | None:
  """Model FLOPs utilisation: the model FLOP/s achieved (`flops_per_token`
  from flops_per_token) over the dense peak of the `num_devices` devices
  that ran them; None where the peak is unknown (a CPU)."""
  if not peak_flops_per_device:
    return None
  return (tokens_per_sec * flops_per_token
          / (peak_flops_per_device * num_devices))
