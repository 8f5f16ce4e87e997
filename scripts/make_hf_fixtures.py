"""Write the tiny MiniMax-M2 hub checkpoints and HF reference logits for tests/test_hf.py.

Runs in its own environment (torch CPU + transformers >= 5.18, never a
dependency of m2jax):

  python3.11 -m venv .venv-hf
  .venv-hf/bin/pip install -r scripts/requirements-hf.txt
  .venv-hf/bin/python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf_*
  .venv-hf/bin/python scripts/make_hf_fixtures.py --verify DIR

Fixtures (deterministic, seeded):
  hf_tiny_fp32_sharded/  float32 weights in >= 2 safetensors shards + index.
  hf_tiny_fp8/           the released checkpoint's format: FP8 e4m3 linear
                         weights with 128x128 `weight_scale_inv` blocks,
                         bf16 embedding / norms / lm_head, fp32 router + bias.
Each holds `reference.npz`: `tokens` [2, 12] and float64 `logits` [2, 12, V],
computed by HF's MiniMaxM2ForCausalLM (eager attention and experts, float64)
after loading the checkpoint's hub layout with `from_pretrained` (for FP8:
from the dequantised weights, W = float(w8) * scale, in float64).

Sizes: hidden 160 and q/o projections of 192 make FP8 blocks that are full
(128) and partial (32, 64) in both dimensions. The expert bias is a few units
(like the released values) with a spread that makes it change which experts
are chosen; the script checks that it does, and that every top-k choice wins
by a margin float32 cannot flip.

`--verify DIR` loads any hub-layout directory (e.g. one written by
`m2jax.hf.save`) with HF in float64 and compares with DIR/reference.npz.
"""

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

SEED = 0
FP8_BLOCK = 128
FP8_MAX = 448.0   # largest finite float8_e4m3fn
MIN_ROUTING_MARGIN = 1e-3

# A hub config.json as MiniMax-M2 writes it (legacy `rotary_dim`, top-level
# `rope_theta`), at test size.
HUB_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "vocab_size": 300,
    "hidden_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "rotary_dim": 24,
    "rope_theta": 5000000,
    "hidden_act": "silu",
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 96,
    "shared_intermediate_size": 0,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "routed_scaling_factor": 1.0,
    "use_mtp": True,
    "num_mtp_modules": 3,
    "mtp_transformer_layers": 1,
    "attn_type_list": [1, 1],
    "sliding_window": None,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": None,
}
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "float8_e4m3fn",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
}
BATCH, LENGTH = 2, 12


def random_hub_weights(cfg, gen):
  """float64 weights under hub names (torch [out, in])."""
  D, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
  H, KV, hd = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
               cfg["head_dim"])
  E, F = cfg["num_local_experts"], cfg["intermediate_size"]
  normal = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
  linear = lambda out, inp: normal(out, inp) / inp ** 0.5
  norm = lambda n: 1.0 + 0.3 * normal(n)
  w = {"model.embed_tokens.weight": normal(V, D)}
  for i in range(L):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = norm(D)
    w[p + "post_attention_layernorm.weight"] = norm(D)
    w[p + "self_attn.q_proj.weight"] = linear(H * hd, D)
    w[p + "self_attn.k_proj.weight"] = linear(KV * hd, D)
    w[p + "self_attn.v_proj.weight"] = linear(KV * hd, D)
    w[p + "self_attn.o_proj.weight"] = linear(D, H * hd)
    w[p + "self_attn.q_norm.weight"] = norm(H * hd)
    w[p + "self_attn.k_norm.weight"] = norm(KV * hd)
    m = p + "block_sparse_moe."
    w[m + "gate.weight"] = 2.0 * linear(E, D)
    # Several units, like the released biases; spread ~ the sigmoid range.
    w[m + "e_score_correction_bias"] = 4.0 + 0.3 * normal(E)
    for e in range(E):
      w[m + f"experts.{e}.w1.weight"] = linear(F, D)
      w[m + f"experts.{e}.w3.weight"] = linear(F, D)
      w[m + f"experts.{e}.w2.weight"] = linear(D, F)
  w["model.norm.weight"] = norm(D)
  w["lm_head.weight"] = linear(V, D)
  return w


def is_quantized(name):
  """The Linear weights FP8 quantisation converts (not gate / lm_head)."""
  return name.startswith("model.layers.") and name.endswith(
      ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def quantize_fp8_blocks(w):
  """(float8 w8, float32 scale) with w ~= w8 * scale[r // 128, c // 128]."""
  R, C = w.shape
  nr, nc = -(-R // FP8_BLOCK), -(-C // FP8_BLOCK)
  scale = torch.empty(nr, nc, dtype=torch.float32)
  w8 = torch.empty(R, C, dtype=torch.float8_e4m3fn)
  for i in range(nr):
    for j in range(nc):
      rows = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK)
      cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
      block = w[rows, cols]
      s = (block.abs().max() / FP8_MAX).to(torch.float32)
      scale[i, j] = s
      w8[rows, cols] = (block / s.double()).to(torch.float8_e4m3fn)
  return w8, scale


def dequantize_fp8_blocks(w8, scale):
  R, C = w8.shape
  s = scale.double().repeat_interleave(FP8_BLOCK, 0)[:R]
  s = s.repeat_interleave(FP8_BLOCK, 1)[:, :C]
  return w8.double() * s


def write_checkpoint(directory, config, tensors, max_shard_bytes=None):
  """Hub layout: config.json + one file, or shards + index."""
  os.makedirs(directory, exist_ok=True)
  names = list(tensors)
  shards, size = [[]], 0
  for name in names:
    n = tensors[name].numel() * tensors[name].element_size()
    if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += n
  if len(shards) == 1:
    files = ["model.safetensors"]
  else:
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]
  weight_map = {}
  for file, shard in zip(files, shards):
    save_file({n: tensors[n].contiguous() for n in shard},
              os.path.join(directory, file), metadata={"format": "pt"})
    weight_map.update({n: file for n in shard})
  if len(shards) > 1:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                f, indent=2)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)


def hf_model(directory):
  """HF MiniMaxM2ForCausalLM from a hub-layout directory, float64, eager."""
  model = MiniMaxM2ForCausalLM.from_pretrained(
      directory, dtype=torch.float64, attn_implementation="eager",
      experts_implementation="eager")
  model.eval()
  cfg = model.config
  rotary = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor",
                                                      1.0))
  inv_freq = model.model.rotary_emb.inv_freq
  # transformers 5.0-5.17 ignored rotary_dim and rotated the whole head.
  assert inv_freq.shape[0] * 2 == rotary, (inv_freq.shape, rotary)
  return model


def reference_logits(model, tokens):
  """float64 logits and every router's (scores, bias) for the checks."""
  routers = []
  hooks = [
      blk.mlp.gate.register_forward_hook(
          lambda mod, args, out, blk=blk: routers.append(
              (torch.sigmoid(out[0].double()), blk.mlp.e_score_correction_bias)))
      for blk in model.model.layers]
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens)).logits
  for h in hooks:
    h.remove()
  return logits.double().numpy(), routers


def check_routing(routers, top_k):
  """The bias changes the choice somewhere, and no choice is a near tie."""
  changed, min_margin = 0, np.inf
  for scores, bias in routers:
    biased = scores + bias.double()
    ranked = biased.sort(dim=-1, descending=True).values
    min_margin = min(min_margin,
                     float((ranked[:, top_k - 1] - ranked[:, top_k]).min()))
    with_bias = biased.topk(top_k).indices.sort().values
    without = scores.topk(top_k).indices.sort().values
    changed += int((with_bias != without).any(-1).sum())
  assert changed > 0, "the expert bias never changes the selection"
  assert min_margin > MIN_ROUTING_MARGIN, f"near-tie routing: {min_margin}"
  return changed, min_margin


def make_fixtures(out_dir):
  gen = torch.Generator().manual_seed(SEED)
  weights = random_hub_weights(HUB_CONFIG, gen)
  tokens = np.random.default_rng(SEED).integers(
      0, HUB_CONFIG["vocab_size"], (BATCH, LENGTH)).astype(np.int32)

  # fp32, sharded.
  fp32_dir = os.path.join(out_dir, "hf_tiny_fp32_sharded")
  shutil.rmtree(fp32_dir, ignore_errors=True)
  fp32 = {n: t.float() for n, t in weights.items()}
  write_checkpoint(fp32_dir, {**HUB_CONFIG, "torch_dtype": "float32"}, fp32,
                   max_shard_bytes=2_000_000)
  logits, routers = reference_logits(hf_model(fp32_dir), tokens)
  changed, margin = check_routing(routers, HUB_CONFIG["num_experts_per_tok"])
  np.savez(os.path.join(fp32_dir, "reference.npz"), tokens=tokens,
           logits=logits)
  print(f"{fp32_dir}: bias changes {changed} choices, margin {margin:.2e}")

  # FP8 blocks, as released: bf16 except the router (fp32) and quantised Linears.
  fp8_dir = os.path.join(out_dir, "hf_tiny_fp8")
  shutil.rmtree(fp8_dir, ignore_errors=True)
  fp8, dequantised = {}, {}
  for name, w in weights.items():
    if is_quantized(name):
      w8, scale = quantize_fp8_blocks(w)
      fp8[name], fp8[name + "_scale_inv"] = w8, scale
      dequantised[name] = dequantize_fp8_blocks(w8, scale)
    elif ".block_sparse_moe.gate." in name or "e_score_correction" in name:
      fp8[name] = w.float()
      dequantised[name] = fp8[name].double()
    else:
      fp8[name] = w.to(torch.bfloat16)
      dequantised[name] = fp8[name].double()
  write_checkpoint(fp8_dir, {**HUB_CONFIG, "torch_dtype": "bfloat16",
                             "quantization_config": QUANTIZATION_CONFIG}, fp8)
  with tempfile.TemporaryDirectory() as tmp:   # the dequantised twin, f64
    write_checkpoint(tmp, {**HUB_CONFIG, "torch_dtype": "float64"},
                     dequantised)
    logits, routers = reference_logits(hf_model(tmp), tokens)
  changed, margin = check_routing(routers, HUB_CONFIG["num_experts_per_tok"])
  np.savez(os.path.join(fp8_dir, "reference.npz"), tokens=tokens,
           logits=logits)
  print(f"{fp8_dir}: bias changes {changed} choices, margin {margin:.2e}")


def verify(directory):
  """HF float64 logits of `directory` against its reference.npz."""
  ref = np.load(os.path.join(directory, "reference.npz"))
  logits, _ = reference_logits(hf_model(directory), ref["tokens"])
  err = float(np.abs(logits - ref["logits"]).max())
  print(f"{directory}: HF float64 vs reference.npz max abs error {err:.3e}")
  return err


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
  parser.add_argument("--verify", help="hub-layout directory to check with HF")
  parser.add_argument("--tolerance", type=float, default=1e-4)
  args = parser.parse_args()
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  if args.verify:
    if verify(args.verify) > args.tolerance:
      raise SystemExit(f"mismatch above {args.tolerance}")
  else:
    make_fixtures(os.path.normpath(args.out))


if __name__ == "__main__":
  main()
