"""Config validation, presets, overrides and parameter counts."""

import math

import jax
import pytest

from m2jax import config as config_lib
from m2jax import model, params
from m2jax.config import ConfigError, ModelConfig


@pytest.mark.parametrize("changes,field", [
    ({"num_heads": 48, "num_kv_heads": 7}, "num_heads"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"rotary_dim": 63}, "rotary_dim"),
    ({"rotary_dim": 256}, "rotary_dim"),
    ({"attention_pattern": ("sliding",), "sliding_window": 0}, "sliding_window"),
    ({"attention_pattern": ("sliding",)}, "sliding_window"),
    ({"attention_pattern": ("local",)}, "attention_pattern"),
    ({"gating": "relu"}, "gating"),
    ({"ffn_type": "dense"}, "dense_intermediate_size"),
    ({"compute_dtype": "int8"}, "compute_dtype"),
    ({"num_sink_tokens": -1}, "num_sink_tokens"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_validation_names_the_field(changes, field):
  with pytest.raises(ConfigError, match=f"ModelConfig.{field}"):
    ModelConfig(**changes)


def test_minimax_m2_preset_is_the_hub_config():
  c = config_lib.get_preset("minimax_m2")
  assert (c.num_layers, c.hidden_size, c.vocab_size) == (62, 3072, 200064)
  assert (c.num_heads, c.num_kv_heads, c.head_dim) == (48, 8, 128)
  assert (c.rotary_dim, c.rope_theta, c.rms_norm_eps) == (64, 5e6, 1e-6)
  assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
      256, 8, 1536)
  assert c.gating == "sigmoid" and c.use_routing_bias and c.use_qk_norm
  assert c.num_mtp_modules == 3 and c.max_position_embeddings == 196608
  assert all(c.layer_attention(i) == "full" for i in range(62))
  small = config_lib.get_preset("m2_small")
  assert small.num_experts >= 64 and small.num_experts_per_tok == 8
  assert small.num_heads // small.num_kv_heads == 6
  assert small.rotary_dim * 2 == small.head_dim
  with pytest.raises(ConfigError, match="known presets"):
    config_lib.get_preset("gpt2")


def test_overrides_parse_by_field_type():
  c = config_lib.apply_overrides(config_lib.TINY, [
      "num_layers=4", "attention_pattern=sliding,full", "sliding_window=16",
      "use_qk_norm=false", "rope_theta=1e5"])
  assert (c.num_layers, c.attention_pattern, c.sliding_window) == (
      4, ("sliding", "full"), 16)
  assert c.use_qk_norm is False and c.rope_theta == 1e5
  assert [c.layer_window(i) for i in range(4)] == [16, None, 16, None]
  with pytest.raises(ConfigError, match="FIELD=VALUE"):
    config_lib.apply_overrides(config_lib.TINY, ["no_such_field=1"])
  with pytest.raises(ConfigError, match="num_layers"):
    config_lib.apply_overrides(config_lib.TINY, ["num_layers=abc"])


def test_minimax_m2_parameter_counts():
  counts = params.count_params(config_lib.MINIMAX_M2)
  assert counts["total_params"] == 228_689_764_864
  assert counts["active_params_non_embedding"] == 9_801_359_872
  b = counts["breakdown"]
  assert b["embedding"] == b["lm_head"] == 614_596_608
  assert b["attention"] == 62 * 44_040_192
  assert b["experts"] == 62 * 256 * 14_155_776
  assert b["router"] == 62 * 786_432 and b["expert_bias"] == 62 * 256
  assert b["norms"] == 62 * 13_312 + 3072
  # Three MTP modules, each one MoE block plus its projection and norms.
  assert counts["mtp_params"] == 3 * (3_668_718_848 + 2 * 3072 * 3072 + 2 * 3072)


def test_counts_match_the_initialised_variables():
  cfg = config_lib.TINY
  v = model.init(cfg, jax.random.key(0))
  leaves = jax.tree_util.tree_flatten_with_path(v)[0]
  main = sum(math.prod(x.shape) for p, x in leaves
             if not p[1].key.startswith("mtp_"))
  mtp = sum(math.prod(x.shape) for p, x in leaves
            if p[1].key.startswith("mtp_"))
  counts = params.count_params(cfg)
  assert counts["total_params"] == main and counts["mtp_params"] == mtp
  experts = counts["breakdown"]["experts"]
  assert counts["active_params_non_embedding"] == (
      main - 2 * cfg.vocab_size * cfg.hidden_size - experts
      + experts * cfg.num_experts_per_tok // cfg.num_experts)
