"""config.json <-> ModelConfig, the hub constants and CheckpointError."""

from __future__ import annotations

from typing import Any, Mapping

from m2jax.config import FULL, M2_ROUTER_AUX_LOSS_COEF, ModelConfig
from m2jax.errors import UserError

HUB_ARCHITECTURE = "MiniMaxM2ForCausalLM"
HUB_MODEL_TYPE = "minimax_m2"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MTP_PREFIX = "mtp"            # m2jax extension: mtp.{k}.… (see module doc)
FP8_BLOCK = (128, 128)        # hub quantization_config.weight_block_size
# Hub token ids (MiniMax-M2 config.json); written only where they fit the vocab.
M2_BOS_TOKEN_ID, M2_EOS_TOKEN_ID = 200034, 200020
DEFAULT_MAX_SHARD_BYTES = 5 << 30
PARAMS, EXPERT_BIAS = "params", "expert_bias"


class CheckpointError(UserError, ValueError):
  """A checkpoint or hub config that m2jax cannot read or write exactly."""


# ----------------------------------------------------------------------------
# config.json <-> ModelConfig

# What HF's MiniMaxM2Config / MiniMaxM2 model assume when a field is absent.
_HF_DEFAULTS = {
    "vocab_size": 200064, "hidden_size": 3072, "num_hidden_layers": 62,
    "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 1536, "num_local_experts": 256,
    "num_experts_per_tok": 8, "max_position_embeddings": 196608,
    "rms_norm_eps": 1e-6, "rope_theta": 5e6, "initializer_range": 0.02,
    "hidden_act": "silu", "tie_word_embeddings": False,
    # HF always applies per-layer QK norm, sigmoid gating and the bias.
    "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
    "use_routing_bias": True, "routed_scaling_factor": 1.0,
    "shared_intermediate_size": 0, "num_mtp_modules": 0,
    "mtp_transformer_layers": 1, "sliding_window": None,
    "router_aux_loss_coef": M2_ROUTER_AUX_LOSS_COEF,
}


def _rotary_dim(hub: Mapping[str, Any], head_dim: int, rope: Mapping) -> int:
  """rotary_dim with HF's precedence: rope_parameters > top level > rotary_dim."""
  factor = rope.get("partial_rotary_factor", hub.get("partial_rotary_factor"))
  from_factor = None if factor is None else int(head_dim * float(factor))
  rotary_dim = hub.get("rotary_dim")
  if rotary_dim is not None and from_factor is not None and (
      int(rotary_dim) != from_factor):
    raise CheckpointError(
        f"config.json: rotary_dim={rotary_dim} disagrees with "
        f"partial_rotary_factor={factor} (x head_dim={head_dim} = {from_factor})")
  if from_factor is not None:
    return from_factor
  return head_dim if rotary_dim is None else int(rotary_dim)


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """ModelConfig of a hub config.json dict.

  Absent fields mean what HF transformers assumes. Fields that are not hub
  fields (compute_dtype, bias_update_rate, settings, ...) come from
  `overrides`. `router_aux_loss_coef` becomes `aux_loss_coef`: the same
  role (the balance loss's weight), applied by m2jax to DeepSeek-V3's
  sequence-wise loss (HF applies it, only with output_router_logits, to a
  Switch-style loss over the whole batch). Raises CheckpointError for
  anything m2jax would compute differently: linear attention layers,
  non-per-layer QK norm, shared experts, tied embeddings, RoPE scaling,
  another activation.
  """
  model_type = hf.get("model_type", HUB_MODEL_TYPE)
  if model_type != HUB_MODEL_TYPE:
    raise CheckpointError(
        f"config.json model_type={model_type!r}; only {HUB_MODEL_TYPE!r} is "
        "supported")
  hub = {**_HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None
                            or k == "sliding_window"}}
  L = int(hub["num_hidden_layers"])
  head_dim = int(hub["head_dim"])

  def refuse(field, rule):
    raise CheckpointError(f"config.json {field}={hub.get(field)!r}: {rule}")

  attn_types = hub.get("attn_type_list")
  if attn_types is not None:
    if len(attn_types) != L:
      refuse("attn_type_list", f"must have num_hidden_layers={L} entries")
    if any(int(t) != 1 for t in attn_types):
      refuse("attn_type_list", "0 marks a linear (lightning) attention layer, "
             "which m2jax does not implement; MiniMax-M2 is all 1 (full)")
  if hub["qk_norm_type"] != "per_layer":
    refuse("qk_norm_type", "only 'per_layer' (one RMSNorm over the whole q/k "
           "projection) is supported")
  if int(hub["shared_intermediate_size"] or 0) != 0:
    refuse("shared_intermediate_size", "shared experts are not supported (M2: 0)")
  if hub["tie_word_embeddings"]:
    refuse("tie_word_embeddings", "must be false (M2 has an untied lm_head)")
  if hub["hidden_act"] != "silu":
    refuse("hidden_act", "only 'silu' (SwiGLU experts) is supported")
  rope = dict(hub.get("rope_parameters") or hub.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise CheckpointError(f"config.json rope_type={rope_type!r}: only plain "
                          "RoPE ('default', no scaling) is supported")
  use_mtp = hub.get("use_mtp", True)

  fields = dict(
      vocab_size=int(hub["vocab_size"]),
      hidden_size=int(hub["hidden_size"]),
      num_layers=L,
      num_heads=int(hub["num_attention_heads"]),
      num_kv_heads=int(hub["num_key_value_heads"]),
      head_dim=head_dim,
      rotary_dim=_rotary_dim(hub, head_dim, rope),
      rope_theta=float(rope.get("rope_theta", hub["rope_theta"])),
      use_qk_norm=bool(hub["use_qk_norm"]),
      max_position_embeddings=int(hub["max_position_embeddings"]),
      attention_pattern=(FULL,),
      sliding_window=hub["sliding_window"],
      rms_norm_eps=float(hub["rms_norm_eps"]),
      ffn_type="moe",
      num_experts=int(hub["num_local_experts"]),
      num_experts_per_tok=int(hub["num_experts_per_tok"]),
      moe_intermediate_size=int(hub["intermediate_size"]),
      gating=hub["scoring_func"],
      use_routing_bias=bool(hub["use_routing_bias"]),
      routed_scaling_factor=float(hub["routed_scaling_factor"]),
      num_mtp_modules=int(hub["num_mtp_modules"]) if use_mtp else 0,
      mtp_transformer_layers=int(hub["mtp_transformer_layers"]),
      initializer_range=float(hub["initializer_range"]),
      aux_loss_coef=float(hub["router_aux_loss_coef"]),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The hub config.json dict of `config` (MiniMax-M2 field names).

  Writes `rotary_dim` (the released checkpoint's field) and
  `rope_parameters` with `partial_rotary_factor` (what HF >= 5 reads).
  Refuses what the hub format cannot express: dense FFN, sliding-window
  layers, sink tokens. HF ignores scoring_func and routed_scaling_factor
  (always sigmoid, 1.0); they are written for m2jax and the original code.
  """
  if config.ffn_type != "moe":
    raise CheckpointError(
        f"ffn_type={config.ffn_type!r} has no MiniMax-M2 hub layout (HF's "
        "MiniMaxM2 is MoE in every layer); keep such models in m2jax "
        "checkpoints")
  if any(config.layer_attention(i) != FULL for i in range(config.num_layers)):
    raise CheckpointError(
        f"attention_pattern={config.attention_pattern!r}: the hub format "
        "(attn_type_list) has no sliding-window layers")
  if config.num_sink_tokens:
    raise CheckpointError(f"num_sink_tokens={config.num_sink_tokens}: the hub "
                          "format has no attention sinks")
  fits = config.vocab_size > M2_BOS_TOKEN_ID
  return {
      "architectures": [HUB_ARCHITECTURE],
      "model_type": HUB_MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rotary_dim": config.rotary_dim,
      "rope_theta": config.rope_theta,
      "rope_parameters": {
          "rope_type": "default", "rope_theta": config.rope_theta,
          "partial_rotary_factor": config.rotary_dim / config.head_dim},
      "use_qk_norm": config.use_qk_norm,
      "qk_norm_type": "per_layer",
      "rms_norm_eps": config.rms_norm_eps,
      "num_local_experts": config.num_experts,
      "num_experts_per_tok": config.num_experts_per_tok,
      "intermediate_size": config.moe_intermediate_size,
      "shared_intermediate_size": 0,
      "scoring_func": config.gating,
      "use_routing_bias": config.use_routing_bias,
      "routed_scaling_factor": config.routed_scaling_factor,
      "router_aux_loss_coef": config.aux_loss_coef,
      "use_mtp": config.num_mtp_modules > 0,
      "num_mtp_modules": config.num_mtp_modules,
      "mtp_transformer_layers": config.mtp_transformer_layers,
      "attn_type_list": [1] * config.num_layers,
      "sliding_window": config.sliding_window,
      "max_position_embeddings": config.max_position_embeddings,
      "tie_word_embeddings": False,
      "initializer_range": config.initializer_range,
      "bos_token_id": M2_BOS_TOKEN_ID if fits else None,
      "eos_token_id": M2_EOS_TOKEN_ID if fits else None,
      "dtype": config.param_dtype,
  }
