"""Model configuration: one frozen dataclass and the named presets.

`ModelConfig` holds every field of the MiniMax-M2 hub config that changes the
computation, plus the ablation knobs the paper argues about (sliding-window vs
full attention, sigmoid vs softmax gating, routing bias, fine vs coarse experts,
dense FFN, MTP depth). It validates itself at construction and names the field
that is wrong. How a step runs (kernels and their tiles, the expert exchange,
remat) is not part of the model: it is the `settings` field, an
m2jax.settings.Settings, which saved configs leave out.

Presets:
  minimax_m2  exactly the public hub config (228.7B params, 9.8B active).
  m2_small    M2's ratios at a size that trains on one 80 GB H100.
  tiny        CPU tests and the demo.
"""

from __future__ import annotations

import dataclasses
import warnings

from m2jax.errors import UserError
from m2jax.settings import Settings

# Attention kinds for `attention_pattern`.
FULL = "full"
SLIDING = "sliding"
ATTENTION_KINDS = (FULL, SLIDING)
GATINGS = ("sigmoid", "softmax")
BIAS_UPDATES = ("sign", "proportional")
FFN_TYPES = ("moe", "dense")
DTYPES = ("float32", "bfloat16", "float16")


# MiniMax-M2's hub config.json `router_aux_loss_coef` (also HF's
# MiniMaxM2Config default): the weight of the routers' balance loss.
M2_ROUTER_AUX_LOSS_COEF = 0.001


class ConfigError(UserError, ValueError):
  """A config field (or the flag that sets it) holds a value outside its
  allowed range, or a checkpoint was made with another config."""


def _fail(field: str, rule: str, value) -> None:
  raise ConfigError(f"ModelConfig.{field}: {rule} (got {value!r})")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a MiniMax-M2-style sparse MoE Transformer.

  Field names follow the hub `config.json` where one exists (m2jax.hf maps
  them). Defaults are MiniMax-M2's.
  """

  # Sizes (hub: vocab_size, hidden_size, num_hidden_layers).
  vocab_size: int = 200064
  hidden_size: int = 3072
  num_layers: int = 62

  # Attention (hub: num_attention_heads, num_key_value_heads, head_dim).
  num_heads: int = 48
  num_kv_heads: int = 8
  head_dim: int = 128
  # Partial RoPE: rotate-half on dims [0, rotary_dim) of each head.
  rotary_dim: int = 64
  rope_theta: float = 5e6
  # Per-layer QK norm: one RMSNorm over the whole q (and k) projection.
  use_qk_norm: bool = True
  max_position_embeddings: int = 196608
  # Per-layer attention kinds ("full" or "sliding"), repeated cyclically over
  # the layers: ("sliding",) * 3 + ("full",) is a 3:1 SWA:full inter-layer
  # hybrid. M2 is all full.
  attention_pattern: tuple[str, ...] = (FULL,)
  sliding_window: int | None = None
  # StreamingLLM-style sinks: the first `num_sink_tokens` positions of each
  # document stay visible to every query of a sliding-window layer.
  num_sink_tokens: int = 0
  rms_norm_eps: float = 1e-6

  # Feed-forward: "moe" (M2) or a dense SwiGLU of `dense_intermediate_size`.
  ffn_type: str = "moe"
  num_experts: int = 256
  num_experts_per_tok: int = 8
  moe_intermediate_size: int = 1536
  dense_intermediate_size: int = 0
  # Router: sigmoid scores (M2) or softmax; the bias only chooses experts.
  gating: str = "sigmoid"
  use_routing_bias: bool = True
  routed_scaling_factor: float = 1.0
  # Aux-loss-free balancing (DeepSeek-V3): after each step the bias moves
  # by bias_update_rate * sign(mean - load) ("sign") or * (mean - load) /
  # mean ("proportional"; m2jax.model.moe.update_expert_bias).
  bias_update_rate: float = 1e-3
  bias_update: str = "sign"
  # Sequence-wise load-balancing loss coefficient (0 = off; hub:
  # router_aux_loss_coef), on top of the bias (m2jax.train.losses).
  aux_loss_coef: float = M2_ROUTER_AUX_LOSS_COEF

  # Multi-token prediction (hub: num_mtp_modules, mtp_transformer_layers).
  num_mtp_modules: int = 3
  mtp_transformer_layers: int = 1

  # Numerics. Router and norms always run in float32.
  param_dtype: str = "float32"
  compute_dtype: str = "bfloat16"
  initializer_range: float = 0.02

  # How a step runs (kernels, tiles, expert exchange, remat): never what it
  # computes, so never saved with the model (config_to_dict leaves it out).
  settings: Settings = dataclasses.field(default=Settings(),
                                         metadata={"saved": False})

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      if getattr(self, name) <= 0:
        _fail(name, "must be positive", getattr(self, name))
    if self.num_heads % self.num_kv_heads:
      _fail("num_heads", f"must be divisible by num_kv_heads={self.num_kv_heads}",
            self.num_heads)
    if self.rotary_dim <= 0 or self.rotary_dim % 2:
      _fail("rotary_dim", "must be a positive even number", self.rotary_dim)
    if self.rotary_dim > self.head_dim:
      _fail("rotary_dim", f"must be <= head_dim={self.head_dim}", self.rotary_dim)
    if self.rope_theta <= 0:
      _fail("rope_theta", "must be positive", self.rope_theta)
    if self.rms_norm_eps <= 0:
      _fail("rms_norm_eps", "must be positive", self.rms_norm_eps)
    if not self.attention_pattern:
      _fail("attention_pattern", "must name at least one attention kind",
            self.attention_pattern)
    for kind in self.attention_pattern:
      if kind not in ATTENTION_KINDS:
        _fail("attention_pattern", f"entries must be in {ATTENTION_KINDS}",
              self.attention_pattern)
    if SLIDING in self.attention_pattern:
      if self.sliding_window is None or self.sliding_window <= 0:
        _fail("sliding_window",
              "must be a positive int when attention_pattern has 'sliding'",
              self.sliding_window)
    elif self.sliding_window is not None and self.sliding_window <= 0:
      _fail("sliding_window", "must be positive or None", self.sliding_window)
    if self.num_sink_tokens < 0:
      _fail("num_sink_tokens", "must be >= 0", self.num_sink_tokens)
    if self.ffn_type not in FFN_TYPES:
      _fail("ffn_type", f"must be one of {FFN_TYPES}", self.ffn_type)
    if self.ffn_type == "moe":
      if self.num_experts <= 0:
        _fail("num_experts", "must be positive", self.num_experts)
      if not 0 < self.num_experts_per_tok <= self.num_experts:
        _fail("num_experts_per_tok",
              f"must be in [1, num_experts={self.num_experts}]",
              self.num_experts_per_tok)
      if self.moe_intermediate_size <= 0:
        _fail("moe_intermediate_size", "must be positive",
              self.moe_intermediate_size)
    elif self.dense_intermediate_size <= 0:
      _fail("dense_intermediate_size", "must be positive when ffn_type='dense'",
            self.dense_intermediate_size)
    if self.gating not in GATINGS:
      _fail("gating", f"must be one of {GATINGS}", self.gating)
    if self.bias_update_rate < 0:
      _fail("bias_update_rate", "must be >= 0", self.bias_update_rate)
    if self.bias_update not in BIAS_UPDATES:
      _fail("bias_update", f"must be one of {BIAS_UPDATES}", self.bias_update)
    if self.aux_loss_coef < 0:
      _fail("aux_loss_coef", "must be >= 0", self.aux_loss_coef)
    if self.routed_scaling_factor <= 0:
      _fail("routed_scaling_factor", "must be positive",
            self.routed_scaling_factor)
    if self.num_mtp_modules < 0:
      _fail("num_mtp_modules", "must be >= 0", self.num_mtp_modules)
    if self.mtp_transformer_layers < 1:
      _fail("mtp_transformer_layers", "must be >= 1",
            self.mtp_transformer_layers)
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        _fail(name, f"must be one of {DTYPES}", getattr(self, name))
    if not isinstance(self.settings, Settings):
      _fail("settings", "must be an m2jax.settings.Settings", self.settings)

  # Derived quantities.
  def layer_attention(self, layer: int) -> str:
    """Attention kind of layer `layer` ("full" or "sliding")."""
    return self.attention_pattern[layer % len(self.attention_pattern)]

  def layer_window(self, layer: int) -> int | None:
    """Sliding-window size of `layer`, or None for full attention."""
    return self.sliding_window if self.layer_attention(layer) == SLIDING else None

  def replace(self, **changes) -> "ModelConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


# MiniMax-M2, field for field from the public hub config.json.
MINIMAX_M2 = ModelConfig()

# M2's ratios (64 experts top-8, GQA 6:1, partial RoPE 0.5, per-layer QK norm)
# at 1.32B total / 0.26B active (experiments.describe): trains on one 80 GB
# H100 with AdamW, rows up to 131,072 tokens with remat (the "m2_small"
# context schedule; experiments/bench_long_rows.py).
M2_SMALL = ModelConfig(
    vocab_size=32768,
    hidden_size=1024,
    num_layers=12,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rotary_dim=64,
    rope_theta=5e6,
    max_position_embeddings=131072,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    num_mtp_modules=1,
    # Balanced by the bias alone: the ablations' baseline (SPEC §2). At
    # this size and pretraining's lr (3e-3) the router's scores spread by
    # ~0.2 within 25 steps; DeepSeek-V3's sign step of 1e-3 needs ~100
    # steps to follow and the load stays collapsed. The proportional rule
    # at 1e-2 corrects a collapse in a few steps and is quiet at balance
    # (benchmarks/notes/router.md).
    aux_loss_coef=0.0,
    bias_update="proportional",
    bias_update_rate=1e-2,
)

# CPU-sized: tests and `make demo` (byte-level vocabulary).
TINY = ModelConfig(
    vocab_size=264,
    hidden_size=64,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    rotary_dim=8,
    rope_theta=1e4,
    max_position_embeddings=4096,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_mtp_modules=1,
    aux_loss_coef=0.0,
    compute_dtype="float32",
)

def dense_counterpart(config: ModelConfig) -> ModelConfig:
  """The dense model with `config`'s active FFN width: every MoE (the MTP
  modules' too) becomes a SwiGLU of num_experts_per_tok x
  moe_intermediate_size (M2 has no shared expert); attention, embeddings
  and everything else stay. What an MoE step is timed against
  (experiments.bench_train --dense_baseline)."""
  if config.ffn_type != "moe":
    _fail("ffn_type", "the dense counterpart is of an MoE model",
          config.ffn_type)
  return config.replace(ffn_type="dense", dense_intermediate_size=(
      config.num_experts_per_tok * config.moe_intermediate_size))


PRESETS: dict[str, ModelConfig] = {
    "minimax_m2": MINIMAX_M2,
    "m2_small": M2_SMALL,
    "tiny": TINY,
}


def get_preset(name: str) -> ModelConfig:
  """The preset called `name`; raises naming the known presets otherwise."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ConfigError(
        f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None


def _to_json(x):
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return config_to_dict(x)  # a nested config (RLConfig's clip ranges)
  return [_to_json(v) for v in x] if isinstance(x, (tuple, list)) else x


def _from_json(x):
  return tuple(_from_json(v) for v in x) if isinstance(x, list) else x


def _saved_fields(config_or_cls):
  return [f for f in dataclasses.fields(config_or_cls)
          if f.metadata.get("saved", True)]


def config_to_dict(config) -> dict:
  """A JSON-ready dict of a frozen config dataclass (tuples become lists,
  nested configs dicts).

  Fields marked `saved=False` (ModelConfig.settings: how a step runs) are
  left out: a saved config says what the model is.
  """
  return {f.name: _to_json(getattr(config, f.name))
          for f in _saved_fields(config)}


def config_from_dict(cls, d: dict):
  """The inverse of config_to_dict (lists become tuples, a dict where the
  field's default is a config becomes that config; validated again);
  unsaved fields take their defaults.

  A model config saved before a field moved to Settings (_MOVED_TO_SETTINGS:
  how a step runs, which each run now chooses) still reads: the field is
  dropped with a warning. (An --override naming it is refused instead:
  apply_overrides.)
  """
  d = without_moved_fields(cls, d)
  known = {f.name for f in _saved_fields(cls)}
  unknown = sorted(set(d) - known)
  if unknown:
    raise ConfigError(f"{cls.__name__}: unknown fields {unknown} in a saved "
                      f"config (known: {sorted(known)})")
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}

  def value(name, v):
    nested = defaults.get(name)
    if isinstance(v, dict) and dataclasses.is_dataclass(nested):
      return config_from_dict(type(nested), v)
    return _from_json(v)

  return cls(**{k: value(k, v) for k, v in d.items()})


def _parse_value(field: dataclasses.Field, current, text: str):
  """Parse `text` for `field`, guided by the type of its current value."""
  kind = field.type if isinstance(field.type, str) else getattr(
      field.type, "__name__", str(field.type))
  if text.lower() in ("none", "null") and "None" in kind:
    return None
  if isinstance(current, bool) or kind == "bool":
    if text.lower() not in ("true", "false", "1", "0"):
      raise ConfigError(f"{field.name}: expected true/false, got {text!r}")
    return text.lower() in ("true", "1")
  if isinstance(current, tuple) or kind.startswith("tuple"):
    return tuple(s for s in text.split(",") if s)
  if isinstance(current, int) or kind.startswith("int"):
    return int(text)
  if isinstance(current, float) or kind.startswith("float"):
    return float(text)
  return text


# ModelConfig fields that became Settings fields (m2jax.settings).
_MOVED_TO_SETTINGS = {"gmm_backend": "gmm_backend",
                      "attention_impl": "attention", "remat": "remat"}


def without_moved_fields(cls, d: dict, *, warn: bool = True) -> dict:
  """`d`, a saved config of `cls`, without the ModelConfig fields that
  moved to Settings (saved by runs made before the move), with a warning
  naming them unless `warn` is False."""
  moved = sorted(k for k in d if k in _MOVED_TO_SETTINGS)
  if cls is not ModelConfig or not moved:
    return d
  if warn:
    warnings.warn(
        f"ModelConfig: ignoring {moved} of a saved config: how a step runs "
        f"is now m2jax.settings.Settings "
        f"({', '.join(_MOVED_TO_SETTINGS[k] for k in moved)}), chosen by "
        f"each run's flags", stacklevel=3)
  return {k: v for k, v in d.items() if k not in moved}


def apply_overrides(config, overrides) -> object:
  """`config` with "field=value" strings applied (validated again).

  Works for any of m2jax's frozen config dataclasses, e.g.
  apply_overrides(TINY, ["num_layers=4", "attention_pattern=sliding,full"]).
  """
  fields = {f.name: f for f in _saved_fields(config)}
  changes = {}
  for item in overrides or ():
    name, sep, text = item.partition("=")
    name = name.strip()
    if sep and name in _MOVED_TO_SETTINGS:
      raise ConfigError(
          f"override {item!r}: {name} says how a step runs, not what the "
          f"model is: set Settings.{_MOVED_TO_SETTINGS[name]} (the "
          f"--{_MOVED_TO_SETTINGS[name]} flag of the training scripts)")
    if not sep or name not in fields:
      raise ConfigError(
          f"override {item!r}: expected FIELD=VALUE with FIELD one of "
          f"{sorted(fields)}")
    try:
      changes[name] = _parse_value(fields[name], getattr(config, name),
                                   text.strip())
    except ValueError as e:
      raise ConfigError(f"{type(config).__name__}.{name}: cannot parse "
                        f"{text!r} ({e})") from None
  return dataclasses.replace(config, **changes)
