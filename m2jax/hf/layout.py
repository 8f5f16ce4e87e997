"""The layout map: each m2jax variable and the hub tensors it comes from."""

from __future__ import annotations

import dataclasses

import numpy as np

from m2jax.config import ModelConfig
from m2jax.hf.hub_config import EXPERT_BIAS, MTP_PREFIX, PARAMS

# ----------------------------------------------------------------------------
# The layout map: one entry per m2jax variable.

@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One m2jax variable and the hub tensor(s) it comes from.

  Hub tensors are torch [out, in]; `transpose` means m2jax stores the
  transpose (reshaped to `shape`). Experts: `hub` holds "{e}" and the m2jax
  array stacks `shape[0]` hub tensors.
  """
  collection: str
  path: tuple[str, ...]
  hub: str
  hub_shape: tuple[int, ...]
  shape: tuple[int, ...]
  transpose: bool = False
  stacked: bool = False
  float32: bool = False

  def hub_names(self) -> list[str]:
    if not self.stacked:
      return [self.hub]
    return [self.hub.format(e=e) for e in range(self.shape[0])]

  def to_m2jax(self, x: np.ndarray) -> np.ndarray:
    """One hub tensor -> its m2jax layout (one expert's slice if stacked)."""
    x = x.T if self.transpose else x
    return x.reshape(self.shape[1:] if self.stacked else self.shape)

  def to_hub(self, x: np.ndarray) -> np.ndarray:
    """Inverse of `to_m2jax`, contiguous."""
    if self.transpose:
      return np.ascontiguousarray(x.reshape(self.hub_shape[::-1]).T)
    return np.ascontiguousarray(x.reshape(self.hub_shape))


def _block(config: ModelConfig, hub: str, path: tuple[str, ...]) -> list[_Tensor]:
  """A decoder block (attention + MoE); hub names under prefix `hub`."""
  D, H, KV, hd = (config.hidden_size, config.num_heads, config.num_kv_heads,
                  config.head_dim)
  E, F = config.num_experts, config.moe_intermediate_size
  p = lambda *names: path + names
  out = [
      _Tensor(PARAMS, p("attn_norm", "scale"), hub + "input_layernorm.weight",
              (D,), (D,)),
      _Tensor(PARAMS, p("ffn_norm", "scale"),
              hub + "post_attention_layernorm.weight", (D,), (D,)),
      _Tensor(PARAMS, p("attn", "q_proj"), hub + "self_attn.q_proj.weight",
              (H * hd, D), (D, H, hd), transpose=True),
      _Tensor(PARAMS, p("attn", "k_proj"), hub + "self_attn.k_proj.weight",
              (KV * hd, D), (D, KV, hd), transpose=True),
      _Tensor(PARAMS, p("attn", "v_proj"), hub + "self_attn.v_proj.weight",
              (KV * hd, D), (D, KV, hd), transpose=True),
      _Tensor(PARAMS, p("attn", "o_proj"), hub + "self_attn.o_proj.weight",
              (D, H * hd), (H, hd, D), transpose=True),
  ]
  if config.use_qk_norm:
    out += [
        _Tensor(PARAMS, p("attn", "q_norm", "scale"),
                hub + "self_attn.q_norm.weight", (H * hd,), (H, hd)),
        _Tensor(PARAMS, p("attn", "k_norm", "scale"),
                hub + "self_attn.k_norm.weight", (KV * hd,), (KV, hd)),
    ]
  moe = hub + "block_sparse_moe."
  out += [
      _Tensor(PARAMS, p("moe", "router"), moe + "gate.weight", (E, D), (D, E),
              transpose=True, float32=True),
      _Tensor(PARAMS, p("moe", "w1"), moe + "experts.{e}.w1.weight", (F, D),
              (E, D, F), transpose=True, stacked=True),
      _Tensor(PARAMS, p("moe", "w3"), moe + "experts.{e}.w3.weight", (F, D),
              (E, D, F), transpose=True, stacked=True),
      _Tensor(PARAMS, p("moe", "w2"), moe + "experts.{e}.w2.weight", (D, F),
              (E, F, D), transpose=True, stacked=True),
  ]
  if config.use_routing_bias:
    out.append(_Tensor(EXPERT_BIAS, p("moe", "bias"),
                       moe + "e_score_correction_bias", (E,), (E,),
                       float32=True))
  return out


def _main_tensors(config: ModelConfig) -> list[_Tensor]:
  """The main model, in hub order (what the released checkpoint holds)."""
  D, V = config.hidden_size, config.vocab_size
  out = [_Tensor(PARAMS, ("embedding",), "model.embed_tokens.weight", (V, D),
                 (V, D))]
  for i in range(config.num_layers):
    out += _block(config, f"model.layers.{i}.", (f"layers_{i}",))
  out += [
      _Tensor(PARAMS, ("final_norm", "scale"), "model.norm.weight", (D,), (D,)),
      _Tensor(PARAMS, ("lm_head",), "lm_head.weight", (V, D), (D, V),
              transpose=True),
  ]
  return out


def _mtp_tensors(config: ModelConfig, k: int) -> list[_Tensor]:
  """MTP module k under the m2jax extension prefix `mtp.{k}.`."""
  D, hub, path = config.hidden_size, f"{MTP_PREFIX}.{k}.", (f"mtp_{k}",)
  out = [
      _Tensor(PARAMS, path + ("embed_norm", "scale"), hub + "embed_norm.weight",
              (D,), (D,)),
      _Tensor(PARAMS, path + ("hidden_norm", "scale"),
              hub + "hidden_norm.weight", (D,), (D,)),
      _Tensor(PARAMS, path + ("proj",), hub + "proj.weight", (D, 2 * D),
              (2 * D, D), transpose=True),
  ]
  for j in range(config.mtp_transformer_layers):
    out += _block(config, f"{hub}layers.{j}.", path + (f"block_{j}",))
  return out
