"""Parameter counting: total, activated per token, and a per-component split.

Counts come from the model's own variable shapes (`jax.eval_shape` of init,
no memory used), so they can never drift from the code. Conventions:
  total_params     every variable of the main model, expert bias included,
                   MTP modules excluded (the released checkpoint has none);
  mtp_params       the MTP modules, reported separately;
  active_params_non_embedding
                   what one token touches outside embedding and lm_head:
                   everything but the experts, plus top_k / E of the experts;
  active_params    the same plus the embedding and lm_head matrices.

For MiniMax-M2 this gives 228,689,764,864 total and 9,801,359,872 active
non-embedding. The paper's "229.9B" is 1.21B more than the config gives
(about the size of the two vocabulary matrices); we report the config's.
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
  return {
      "total_params": total,
      "active_params": active_non_emb + vocab,
      "active_params_non_embedding": active_non_emb,
      "mtp_params": sum(mtp.values()),
      "breakdown": {k: v for k, v in main.items() if v},
      "mtp_breakdown": {k: v for k, v in mtp.items() if v},
  }


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
  """Training FLOPs per token: 6 * active params + causal attention scores.

  Attention: QK^T and PV are 2 * 2 * T * H * hd multiply-adds per layer for
  a full row, halved by causality; x3 for forward + backward.
  """
  counts = count_params(config)
  attn = 0
  for layer in range(config.num_layers):
    window = config.layer_window(layer)
    span = seq_len if window is None else min(window, seq_len)
    attn += 2 * 2 * config.num_heads * config.head_dim * span / 2
  return int(6 * counts["active_params"] + 3 * attn)
