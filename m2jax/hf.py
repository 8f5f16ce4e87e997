"""MiniMax-M2 hub checkpoints in and out (SPEC §1).

  config, variables = m2jax.hf.load("path/to/MiniMax-M2")          # hub layout
  m2jax.hf.save("out/dir", config, variables, max_shard_bytes=5 << 30)

`load` reads `config.json` and one `model.safetensors` or the shards named by
`model.safetensors.index.json`; FP8 e4m3 weights with 128x128
`weight_scale_inv` blocks are dequantised (`W = float(w8) * scale[r//128,
c//128]`, edge blocks partial). It streams tensor by tensor: each stacked
[E, ...] expert array is allocated once and filled expert by expert, so the
peak is the model plus one tensor. Variables come back as host numpy arrays
(place them with `jax.device_put(variables, shardings)`).

Dtypes. `dtype=None` keeps the checkpoint's dtype: the dtype of its
unquantised weights (`model.embed_tokens.weight`), so fp32 stays fp32 and the
released bf16+FP8 checkpoint loads as bf16 (FP8 blocks are dequantised in
float32, then cast). A float8 embedding falls back to config.json's
`dtype`/`torch_dtype`, else bf16. The router gate and the expert bias are
float32 whatever `dtype` says. `config.param_dtype` reports the result.

`save` writes the hub layout unquantised (HF transformers >= 5.18 and `load`
read it back), sharded with an index above `max_shard_bytes`, into a temp
directory renamed into place at the end. Two m2jax extensions:
  * MTP modules (none in the released checkpoint) are written under
    `mtp.{k}.` (`embed_norm.weight`, `hidden_norm.weight`, `proj.weight`
    [D, 2D], `layers.{j}.` + the decoder-layer names); HF ignores them with
    an "unexpected keys" warning, `load` reads them back.
  * A dense-FFN model (`ffn_type="dense"`) has no hub counterpart (HF's
    MiniMaxM2 is MoE in every layer): `save` refuses it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from m2jax.config import DTYPES, FULL, ModelConfig

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


class CheckpointError(ValueError):
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
  fields (compute_dtype, gmm_backend, bias_update_rate, ...) come from
  `overrides`. Raises CheckpointError for anything m2jax would compute
  differently: linear attention layers, non-per-layer QK norm, shared
  experts, tied embeddings, RoPE scaling, another activation.
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


# ----------------------------------------------------------------------------
# Reading safetensors, tensor by tensor.

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn),)


class _Reader:
  """Tensor-by-tensor access to a checkpoint's safetensors files.

  safetensors' numpy backend (0.8.0) cannot return float8 tensors, so this
  parses the format's header itself (8-byte length, JSON, raw little-endian
  data) and reads one tensor at a time from its byte offsets.
  """

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise FileNotFoundError(
          f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._where: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
    for name in files:
      self._where.update(self._header(os.path.join(directory, name)))
    if weight_map is not None:
      for name, file in weight_map.items():
        got = self._where.get(name)
        if got is None or os.path.basename(got[0]) != file:
          raise CheckpointError(f"{INDEX_FILE} maps {name!r} to {file!r}, "
                                "which does not hold it")

  @staticmethod
  def _header(path: str):
    with open(path, "rb") as f:
      (n,) = np.frombuffer(f.read(8), "<u8")
      header = json.loads(f.read(int(n)))
    base = 8 + int(n)
    for name, info in header.items():
      if name == "__metadata__":
        continue
      if info["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype "
                              f"{info['dtype']}")
      start, end = info["data_offsets"]
      dtype = np.dtype(_ST_DTYPES[info["dtype"]])
      shape = tuple(info["shape"])
      if end - start != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{path}: tensor {name!r} has a corrupt header")
      yield name, (path, dtype, shape, base + start)

  def names(self) -> set[str]:
    return set(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def dtype(self, name: str) -> np.dtype:
    return self._where[name][1]

  def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Tensor `name`; checks its shape against `shape` when given."""
    if name not in self._where:
      raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
    path, dtype, got, offset = self._where[name]
    if shape is not None and tuple(shape) != got:
      raise CheckpointError(f"tensor {name!r}: expected shape {tuple(shape)}, "
                            f"got {got}")
    count = math.prod(got)
    return np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count,
                       offset=offset).reshape(got)


# ----------------------------------------------------------------------------
# FP8 block quantisation.

def dequantize_fp8_blocks(w8: np.ndarray, scale_inv: np.ndarray,
                          block_size: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
  """float32 W[r, c] = float(w8[r, c]) * scale_inv[r // br, c // bc].

  `weight_scale_inv` is a multiplier despite its name (SPEC §1); edge blocks
  are partial, so scale_inv has shape [ceil(R / br), ceil(C / bc)].
  """
  (R, C), (br, bc) = w8.shape, block_size
  want = (-(-R // br), -(-C // bc))
  if scale_inv.shape != want:
    raise CheckpointError(f"weight_scale_inv: expected shape {want} for a "
                          f"{(R, C)} weight in {block_size} blocks, got "
                          f"{scale_inv.shape}")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0)[:R],
                    bc, axis=1)[:, :C]
  return w8.astype(np.float32) * scale


def _fp8_block_size(hf: Mapping[str, Any]) -> tuple[int, int] | None:
  """Block size from config.json's quantization_config (None: unquantised)."""
  qc = hf.get("quantization_config")
  if not qc:
    return None
  method = qc.get("quant_method")
  if method != "fp8":
    raise CheckpointError(
        f"config.json quantization_config.quant_method={method!r}: only 'fp8' "
        "(e4m3 with block weight_scale_inv) is supported")
  fmt = qc.get("fmt", "float8_e4m3fn")
  if fmt not in ("e4m3", "float8_e4m3fn"):
    raise CheckpointError(f"config.json quantization_config.fmt={fmt!r}: only "
                          "float8_e4m3fn is supported")
  block = tuple(qc.get("weight_block_size") or FP8_BLOCK)
  if len(block) != 2:
    raise CheckpointError(f"quantization_config.weight_block_size={block}: "
                          "expected [rows, cols]")
  return block


def _read_weight(reader: _Reader, name: str, shape, block) -> np.ndarray:
  """Hub tensor `name`, dequantised to float32 if it is stored as FP8."""
  x = reader.read(name, shape)
  if x.dtype not in _FP8:
    return x
  if block is None:
    raise CheckpointError(f"tensor {name!r} is float8 but config.json has no "
                          "quantization_config")
  scale_name = name + "_scale_inv"
  if scale_name not in reader:
    raise CheckpointError(f"{reader.directory}: missing tensor {scale_name!r} "
                          f"(the block scales of float8 {name!r})")
  return dequantize_fp8_blocks(x, reader.read(scale_name), block)


# ----------------------------------------------------------------------------
# load / save

def _checkpoint_dtype(reader: _Reader, hf: Mapping[str, Any]) -> np.dtype:
  name = "model.embed_tokens.weight"
  if name in reader and reader.dtype(name) not in _FP8:
    return reader.dtype(name)
  return np.dtype(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def _set(tree: dict, keys: tuple[str, ...], value) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def load(path: str, *, dtype=None, **config_overrides):
  """(ModelConfig, variables) of the hub-layout checkpoint in directory `path`.

  `dtype`: None keeps the checkpoint's dtype (module doc), otherwise every
  weight but the router and expert bias is cast to it. MTP modules are
  returned only where the checkpoint has them (`mtp.{k}.`); the config keeps
  config.json's num_mtp_modules. `config_overrides` set non-hub fields
  (e.g. compute_dtype="float32").
  """
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a hub checkpoint)")
  with open(config_path) as f:
    hf = json.load(f)
  block = _fp8_block_size(hf)
  reader = _Reader(path)
  target = np.dtype(dtype) if dtype is not None else _checkpoint_dtype(reader, hf)
  if _dtype_name(target) not in DTYPES:
    raise CheckpointError(f"weights would load as {_dtype_name(target)}, not "
                          f"one of {DTYPES}: pass dtype=")
  config = config_from_hf(hf, param_dtype=_dtype_name(target), **config_overrides)

  tensors = _main_tensors(config)
  for k in range(config.num_mtp_modules):
    if f"{MTP_PREFIX}.{k}.proj.weight" in reader:
      tensors += _mtp_tensors(config, k)
  used = set()
  variables: dict[str, dict] = {PARAMS: {}}
  for t in tensors:
    want = np.float32 if t.float32 else target
    if t.stacked:
      value = np.empty(t.shape, want)
      for e, name in enumerate(t.hub_names()):
        value[e] = t.to_m2jax(_read_weight(reader, name, t.hub_shape, block))
    else:
      value = t.to_m2jax(_read_weight(reader, t.hub, t.hub_shape, block))
      value = value.astype(want)
    used.update(t.hub_names())
    _set(variables.setdefault(t.collection, {}), t.path, value)

  if not config.use_routing_bias:
    for i in range(config.num_layers):
      name = f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"
      if name in reader:
        used.add(name)
        if np.any(reader.read(name)):
          raise CheckpointError(
              f"{name!r} is non-zero but config.json says use_routing_bias="
              "false (HF would apply it, m2jax would not)")
  used |= {n + "_scale_inv" for n in used}
  unexpected = sorted(reader.names() - used)
  if unexpected:
    more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
    raise CheckpointError(f"{path}: tensors with no m2jax counterpart: "
                          f"{unexpected[:5]}{more}")
  return config, variables


def _flatten(tree, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from _flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _save_plan(config: ModelConfig, variables):
  """[(hub name, nbytes, make)] for every variable; refuses strays."""
  leaves = dict(_flatten(variables))
  tensors = _main_tensors(config)
  params = variables.get(PARAMS, {})
  for k in range(config.num_mtp_modules):
    if f"mtp_{k}" in params:
      tensors += _mtp_tensors(config, k)
  stray = set(leaves) - {(t.collection,) + t.path for t in tensors}
  extra = sorted("/".join(p) for p in stray)
  if any(p[1].startswith("mtp_") for p in stray if len(p) > 1):
    extra.append(f"(config.num_mtp_modules={config.num_mtp_modules})")
  if stray:
    raise CheckpointError(f"variables with no hub counterpart: {extra}")

  plan = []
  for t in tensors:
    key = (t.collection,) + t.path
    if key not in leaves:
      raise CheckpointError(f"variables lack {'/'.join(key)}")
    leaf = leaves[key]
    if tuple(leaf.shape) != t.shape:
      raise CheckpointError(f"variable {'/'.join(key)}: expected shape "
                            f"{t.shape}, got {tuple(leaf.shape)}")
    dtype = np.float32 if t.float32 else np.dtype(leaf.dtype)
    nbytes = math.prod(t.hub_shape) * np.dtype(dtype).itemsize
    for e, name in enumerate(t.hub_names()):
      part = (lambda leaf=leaf, e=e: np.asarray(leaf[e])) if t.stacked else (
          lambda leaf=leaf: np.asarray(leaf))
      plan.append((name, nbytes,
                   lambda t=t, part=part, dtype=dtype:
                   t.to_hub(part()).astype(dtype, copy=False)))
  if not config.use_routing_bias:   # HF always holds the buffer: write zeros
    for i in range(config.num_layers):
      plan.append((f"model.layers.{i}.block_sparse_moe.e_score_correction_bias",
                   4 * config.num_experts,
                   lambda: np.zeros((config.num_experts,), np.float32)))
  return plan


def save(path: str, config: ModelConfig, variables, *,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         overwrite: bool = False) -> None:
  """Write `variables` as an unquantised hub checkpoint in directory `path`.

  One `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at
  most `max_shard_bytes` (a larger single tensor gets its own shard) and
  `model.safetensors.index.json`. Atomic: written to a temp directory next
  to `path` and renamed into place. Each weight keeps its dtype.
  """
  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"{path} exists (pass overwrite=True)")
  hf = config_to_hf(config)
  embedding = variables[PARAMS]["embedding"]
  hf["dtype"] = hf["torch_dtype"] = _dtype_name(np.dtype(embedding.dtype))
  plan = _save_plan(config, variables)

  shards, size = [[]], 0
  for item in plan:
    if shards[-1] and size + item[1] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += item[1]
  if len(shards) == 1:
    names = [SINGLE_FILE]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]

  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    weight_map = {}
    for file, shard in zip(names, shards):
      save_file({name: make() for name, _, make in shard},
                os.path.join(tmp, file), metadata={"format": "pt"})
      weight_map.update({name: file for name, _, _ in shard})
    if len(shards) > 1:
      index = {"metadata": {"total_size": sum(n for _, n, _ in plan)},
               "weight_map": weight_map}
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
      json.dump(hf, f, indent=2)
    if os.path.exists(path):
      trash = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-",
                               dir=parent)
      os.rename(path, os.path.join(trash, "old"))
      os.rename(tmp, path)
      shutil.rmtree(trash)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
