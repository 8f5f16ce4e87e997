"""Hub checkpoints: config mapping, FP8 blocks, HF parity, save/load, errors.

The fixtures under tests/fixtures/hf_* are written by
scripts/make_hf_fixtures.py (HF transformers >= 5.18, float64 reference).
"""

import functools
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from m2jax import config as config_lib
from m2jax import hf, model

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FP32_SHARDED = os.path.join(FIXTURES, "hf_tiny_fp32_sharded")
FP8 = os.path.join(FIXTURES, "hf_tiny_fp8")
PARITY_ATOL = 1e-4

# The released MiniMax-M2 config.json (fields that matter, as on the hub).
M2_HUB_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536,
    "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8,
    "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
    "routed_scaling_factor": 1.0, "router_aux_loss_coef": 0.001,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_mtp": True, "use_qk_norm": True,
    "use_routing_bias": True, "vocab_size": 200064,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                   "lm_head"]},
}
TINY = config_lib.TINY.replace(num_mtp_modules=2)


def _leaves(variables):
  return {"/".join(k): v for k, v in hf._flatten(variables)}


def _assert_same_variables(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert sorted(la) == sorted(lb)
  for k in la:
    assert np.dtype(la[k].dtype) == np.dtype(lb[k].dtype), k
    np.testing.assert_array_equal(np.asarray(la[k]), np.asarray(lb[k]), k)


# One compiled forward per config, not an op-by-op one.
_jit_logits = jax.jit(model.logits, static_argnums=0)


@functools.lru_cache(maxsize=None)
def _init(cfg):
  """Random variables with exactly model.init's tree, shapes and dtypes.

  (Shapes from `jax.eval_shape`, values from numpy: no compilation.) The
  expert bias is several units, like the released one.
  """
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  return jax.tree_util.tree_map_with_path(
      lambda p, s: ((4.0 if p[0].key == model.EXPERT_BIAS else 0.0)
                    + rng.normal(size=s.shape)).astype(s.dtype), shapes)


# ---------------------------------------------------------------------------
# config.json <-> ModelConfig

def test_hub_config_is_the_minimax_m2_preset():
  assert hf.config_from_hf(M2_HUB_CONFIG) == config_lib.MINIMAX_M2
  assert config_lib.MINIMAX_M2.aux_loss_coef == 0.001


def test_router_aux_loss_coef_maps_both_ways():
  """Hub router_aux_loss_coef <-> ModelConfig.aux_loss_coef; absent = HF's."""
  assert hf.config_from_hf(
      {**M2_HUB_CONFIG, "router_aux_loss_coef": 0.25}).aux_loss_coef == 0.25
  absent = {k: v for k, v in M2_HUB_CONFIG.items()
            if k != "router_aux_loss_coef"}
  assert hf.config_from_hf(absent).aux_loss_coef == 0.001  # MiniMaxM2Config
  for coef in (0.0, 0.0123):
    cfg = TINY.replace(aux_loss_coef=coef)
    hub = json.loads(json.dumps(hf.config_to_hf(cfg)))
    assert hub["router_aux_loss_coef"] == coef
    assert hf.config_from_hf(hub, compute_dtype=cfg.compute_dtype) == cfg


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_config_round_trip(name):
  cfg = config_lib.PRESETS[name]
  hub = hf.config_to_hf(cfg)
  assert hub["architectures"] == ["MiniMaxM2ForCausalLM"]
  assert hub["model_type"] == "minimax_m2"
  # Not hub fields (how training runs, not what the model is): overrides.
  back = hf.config_from_hf(json.loads(json.dumps(hub)),
                           compute_dtype=cfg.compute_dtype,
                           bias_update_rate=cfg.bias_update_rate,
                           bias_update=cfg.bias_update)
  assert back == cfg


def test_config_to_hf_field_names():
  hub = hf.config_to_hf(config_lib.MINIMAX_M2)
  for key, value in M2_HUB_CONFIG.items():
    if key not in ("quantization_config", "torch_dtype"):
      assert hub[key] == value, key
  assert hub["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e6,
                                    "partial_rotary_factor": 0.5}


def test_config_rope_variants():
  base = {k: v for k, v in M2_HUB_CONFIG.items()
          if k not in ("rotary_dim", "rope_theta")}
  # What transformers >= 5 writes: everything inside rope_parameters.
  hf5 = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.25}}
  cfg = hf.config_from_hf(hf5)
  assert (cfg.rotary_dim, cfg.rope_theta) == (32, 1e4)
  assert hf.config_from_hf({**base, "partial_rotary_factor": 0.5}).rotary_dim == 64
  assert hf.config_from_hf(
      {**base, "rope_scaling": {"type": "default", "rope_theta": 7.0}}
  ).rope_theta == 7.0
  # No rotary_dim and no factor: HF rotates the whole head.
  assert hf.config_from_hf(base).rotary_dim == 128
  with pytest.raises(hf.CheckpointError, match="rotary_dim=64 disagrees"):
    hf.config_from_hf({**M2_HUB_CONFIG, "partial_rotary_factor": 1.0})
  assert hf.config_from_hf({**M2_HUB_CONFIG, "use_mtp": False}).num_mtp_modules == 0


@pytest.mark.parametrize("change, field", [
    ({"attn_type_list": [0] + [1] * 61}, "attn_type_list"),
    ({"attn_type_list": [1] * 3}, "attn_type_list"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"shared_intermediate_size": 1024}, "shared_intermediate_size"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"model_type": "minimax"}, "model_type"),
])
def test_config_from_hf_refuses(change, field):
  with pytest.raises(hf.CheckpointError, match=field):
    hf.config_from_hf({**M2_HUB_CONFIG, **change})


@pytest.mark.parametrize("change, field", [
    ({"ffn_type": "dense", "dense_intermediate_size": 64}, "ffn_type"),
    ({"attention_pattern": ("sliding", "full"), "sliding_window": 8},
     "attention_pattern"),
    ({"num_sink_tokens": 4}, "num_sink_tokens"),
])
def test_config_to_hf_refuses(change, field):
  with pytest.raises(hf.CheckpointError, match=field):
    hf.config_to_hf(TINY.replace(**change))


# ---------------------------------------------------------------------------
# FP8 blocks

def test_dequantize_fp8_blocks_matches_formula_with_partial_blocks():
  rng = np.random.default_rng(0)
  R, C = 300, 200                       # blocks: rows 128,128,44; cols 128,72
  w8 = rng.normal(0, 100, (R, C)).astype(ml_dtypes.float8_e4m3fn)
  scale = rng.uniform(0.5, 2.0, (3, 2)).astype(np.float32)
  want = np.empty((R, C), np.float64)
  for r in range(R):
    for c in range(C):
      want[r, c] = float(w8[r, c]) * float(scale[r // 128, c // 128])
  got = hf.dequantize_fp8_blocks(w8, scale)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-7)
  with pytest.raises(hf.CheckpointError, match=r"expected shape \(3, 2\)"):
    hf.dequantize_fp8_blocks(w8, scale[:2])


def test_fixtures_are_what_they_claim():
  files = [f for f in os.listdir(FP32_SHARDED) if f.endswith(".safetensors")]
  assert len(files) >= 2 and "model.safetensors.index.json" in os.listdir(
      FP32_SHARDED)
  reader = hf._Reader(FP8)
  name = "model.layers.0.self_attn.q_proj.weight"
  assert reader.dtype(name) == ml_dtypes.float8_e4m3fn
  assert reader.read(name).shape == (192, 160)            # partial blocks
  assert reader.read(name + "_scale_inv").shape == (2, 2)


# ---------------------------------------------------------------------------
# Parity with HF transformers (float64 reference logits)

@pytest.mark.parametrize("path", [FP32_SHARDED, FP8], ids=["fp32", "fp8"])
def test_logits_match_hf_reference(path):
  cfg, variables = hf.load(path, dtype="float32", compute_dtype="float32")
  ref = np.load(os.path.join(path, "reference.npz"))
  logits = np.asarray(_jit_logits(cfg, variables, ref["tokens"]))
  assert logits.shape == ref["logits"].shape
  err = np.abs(logits - ref["logits"]).max()
  assert err <= PARITY_ATOL, f"max abs error {err:.3e} vs HF float64"


def test_load_keeps_checkpoint_dtype():
  cfg, v = hf.load(FP32_SHARDED)
  assert cfg.param_dtype == cfg.compute_dtype == "float32"
  assert {x.dtype for x in _leaves(v).values()} == {np.dtype(np.float32)}
  assert cfg.num_mtp_modules == 3 and not any(
      k.startswith("mtp_") for k in v["params"])
  # The released format: bf16 weights, FP8 dequantised to bf16, fp32 router.
  cfg, v = hf.load(FP8)
  assert cfg.param_dtype == cfg.compute_dtype == "bfloat16"
  for name, x in _leaves(v).items():
    want = np.float32 if name.endswith(("router", "bias")) else ml_dtypes.bfloat16
    assert x.dtype == want, name
  layer = v["params"]["layers_0"]
  assert layer["attn"]["q_proj"].shape == (160, 4, 48)
  assert layer["moe"]["w2"].shape == (8, 96, 160)


# ---------------------------------------------------------------------------
# save -> load

@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, param_dtype):
  cfg = TINY.replace(param_dtype=param_dtype, aux_loss_coef=0.02)
  variables = _init(cfg)
  path = tmp_path / "ckpt"
  hf.save(str(path), cfg, variables, max_shard_bytes=200_000)
  files = os.listdir(path)
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) >= 2
  back_cfg, back = hf.load(str(path), compute_dtype=cfg.compute_dtype)
  assert back_cfg == cfg
  _assert_same_variables(variables, back)      # MTP, expert bias, dtypes


def test_save_load_is_faithful_without_overrides(tmp_path):
  """A float32 model saved and loaded with no arguments computes in float32
  and gives the saved model's logits exactly; bf16 weights compute in bf16,
  and compute_dtype= still overrides."""
  cfg = TINY.replace(compute_dtype="float32")
  variables = _init(cfg)
  hf.save(str(tmp_path / "f32"), cfg, variables)
  back_cfg, back = hf.load(str(tmp_path / "f32"))
  assert back_cfg == cfg
  tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % cfg.vocab_size
  np.testing.assert_array_equal(
      np.asarray(_jit_logits(back_cfg, back, tokens)),
      np.asarray(_jit_logits(cfg, variables, tokens)))
  assert hf.load(str(tmp_path / "f32"), compute_dtype="bfloat16")[
      0].compute_dtype == "bfloat16"
  bf16 = cfg.replace(param_dtype="bfloat16")
  hf.save(str(tmp_path / "bf16"), bf16, _init(bf16))
  assert hf.load(str(tmp_path / "bf16"))[0].compute_dtype == "bfloat16"


def test_save_writes_the_hub_layout(tmp_path):
  """Loading a hub checkpoint and saving it gives back the same tensors."""
  cfg, variables = hf.load(FP32_SHARDED)
  hf.save(str(tmp_path / "single"), cfg, variables)
  assert sorted(os.listdir(tmp_path / "single")) == ["config.json",
                                                     "model.safetensors"]
  saved = load_file(str(tmp_path / "single" / "model.safetensors"))
  original = hf._Reader(FP32_SHARDED)
  assert set(saved) == original.names()
  for name, x in saved.items():
    np.testing.assert_array_equal(x, original.read(name), name)
  with open(tmp_path / "single" / "config.json") as f:
    # Dtypes are load's choice (the weights'), not config.json's.
    assert hf.config_from_hf(json.load(f),
                             compute_dtype=cfg.compute_dtype) == cfg


def test_save_is_atomic(tmp_path, monkeypatch):
  cfg, variables = TINY, _init(TINY)
  path = tmp_path / "ckpt"
  calls = []

  def crash_on_second_shard(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise OSError("disk full")
    return save_file(*args, **kwargs)

  monkeypatch.setattr(hf, "save_file", crash_on_second_shard)
  with pytest.raises(OSError, match="disk full"):
    hf.save(str(path), cfg, variables, max_shard_bytes=200_000)
  assert os.listdir(tmp_path) == []               # no half checkpoint, no temp
  monkeypatch.undo()
  hf.save(str(path), cfg, variables)
  with pytest.raises(FileExistsError):
    hf.save(str(path), cfg, variables)
  hf.save(str(path), cfg, variables, overwrite=True)
  assert os.listdir(tmp_path) == ["ckpt"]


def test_save_refuses_what_it_cannot_write(tmp_path):
  variables = _init(TINY)
  stray = {**variables, "params": {**variables["params"],
                                   "extra": np.zeros(3, np.float32)}}
  with pytest.raises(hf.CheckpointError, match="params/extra"):
    hf.save(str(tmp_path / "a"), TINY, stray)
  mtp_beyond = {**variables, "params": {**variables["params"],
                                        "mtp_5": variables["params"]["mtp_0"]}}
  with pytest.raises(hf.CheckpointError, match="mtp_5"):
    hf.save(str(tmp_path / "b"), TINY, mtp_beyond)
  bad = {**variables, "params": {**variables["params"],
                                 "lm_head": np.zeros((3, 3), np.float32)}}
  with pytest.raises(hf.CheckpointError, match=r"lm_head: expected shape"):
    hf.save(str(tmp_path / "c"), TINY, bad)
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# load errors

def _edited_copy(tmp_path, src, edit_tensors=None, edit_config=None):
  """A copy of the single-file checkpoint `src` with its tensors/config edited."""
  dst = tmp_path / "edited"
  shutil.copytree(src, dst)
  if edit_tensors:
    tensors = hf._Reader(str(dst))
    tensors = {n: tensors.read(n) for n in tensors.names()}
    edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
  if edit_config:
    with open(dst / "config.json") as f:
      cfg = json.load(f)
    edit_config(cfg)
    with open(dst / "config.json", "w") as f:
      json.dump(cfg, f)
  return str(dst)


def test_load_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf.load(str(tmp_path))
  name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"

  path = _edited_copy(tmp_path / "missing", FP8,
                      edit_tensors=lambda t: t.pop(name))
  with pytest.raises(hf.CheckpointError, match=f"missing tensor '{name}'"):
    hf.load(path)

  def transpose(t):
    t[name] = np.ascontiguousarray(t[name].T)
  path = _edited_copy(tmp_path / "shape", FP8, edit_tensors=transpose)
  with pytest.raises(hf.CheckpointError, match=(
      rf"tensor '{name}': expected shape \(160, 96\), got \(96, 160\)")):
    hf.load(path)

  path = _edited_copy(tmp_path / "scale", FP8,
                      edit_tensors=lambda t: t.pop(name + "_scale_inv"))
  with pytest.raises(hf.CheckpointError, match=f"{name}_scale_inv"):
    hf.load(path)

  def extra(t):
    t["model.layers.9.foo.weight"] = np.zeros(2, np.float32)
  path = _edited_copy(tmp_path / "extra", FP8, edit_tensors=extra)
  with pytest.raises(hf.CheckpointError, match="model.layers.9.foo.weight"):
    hf.load(path)

  def quant(c):
    c["quantization_config"]["quant_method"] = "gptq"
  path = _edited_copy(tmp_path / "quant", FP8, edit_config=quant)
  with pytest.raises(hf.CheckpointError, match="quant_method='gptq'"):
    hf.load(path)


def test_load_reads_router_aux_loss_coef(tmp_path):
  # The fixtures' config.json (scripts/make_hf_fixtures.py HUB_CONFIG) does
  # not carry the field: HF's MiniMaxM2Config default applies.
  with open(os.path.join(FP8, "config.json")) as f:
    assert "router_aux_loss_coef" not in json.load(f)
  assert hf.load(FP8)[0].aux_loss_coef == 0.001
  path = _edited_copy(tmp_path, FP8, edit_config=lambda c: c.update(
      router_aux_loss_coef=0.05))
  cfg, variables = hf.load(path)
  assert cfg.aux_loss_coef == 0.05
  hf.save(str(tmp_path / "saved"), cfg, variables)
  with open(tmp_path / "saved" / "config.json") as f:
    assert json.load(f)["router_aux_loss_coef"] == 0.05
  assert hf.load(str(tmp_path / "saved"))[0] == cfg
