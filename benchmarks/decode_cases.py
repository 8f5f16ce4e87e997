"""Benchmark pieces for generation (experiments/bench_decode.py): the engine
timed per decode step next to its memory floor, prefix sharing, and HF
transformers' `generate` on the same checkpoint (run in its own process).

The floor of a decode step is the bytes it must read over the card's copy
bandwidth: the active weights (everything but the experts, plus the experts
the batch's tokens route to) in the compute dtype, and the KV cache of every
row. Expert reads assume uniform routing: E * (1 - (1 - k/E)^B) distinct
experts per layer for a batch of B tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

from benchmarks import profile as profile_lib
from m2jax import params as params_lib
from m2jax.config import ModelConfig
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams


def floor_bytes(cfg: ModelConfig, batch: int, context: int) -> dict:
  """Bytes a decode step of `batch` rows at `context` keys must read."""
  counts = params_lib.count_params(cfg)
  bd = counts["breakdown"]
  item = np.dtype(cfg.compute_dtype).itemsize
  E, k = cfg.num_experts, cfg.num_experts_per_tok
  touched = E * (1 - (1 - k / E) ** batch)
  experts = bd.get("experts", 0) * touched / E
  # The embedding is a gather of B rows; lm_head is read whole.
  dense = (counts["total_params"] - bd.get("experts", 0)
           - bd.get("embedding", 0) - bd.get("expert_bias", 0))
  router_extra = bd.get("router", 0) * (4 - item)   # kept in float32
  weights = (dense + experts) * item + router_extra
  kv = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item
        * context * batch)
  return {"weights": weights, "kv": kv, "total": weights + kv,
          "experts_touched_per_layer": touched}


def time_engine(cfg: ModelConfig, variables, *, batch: int, prompt: int,
                new_tokens: int, page_size: int = 64, mtp_draft: int = 0,
                decode_steps: int = 1, seed: int = 0, prompts=None,
                profile: bool = False) -> dict:
  """Greedy decode of `prompts` (default: `batch` random ones), at most
  `batch` at a time: the time of one decode step (a token for every row),
  from the engine steps after the first few that admit no request
  (compilation and prefill excluded). `profile`: one warm decode call is
  traced instead (benchmarks.profile: device time per XLA op), not timed."""
  rng = np.random.default_rng(seed)
  prompts = prompts or [list(rng.integers(3, cfg.vocab_size, prompt))
                        for _ in range(batch)]
  pages = batch * (-(-(prompt + new_tokens + mtp_draft + 1) // page_size)) + 2
  eng = Engine(cfg, variables, EngineConfig(
      page_size=page_size, num_pages=pages, max_batch=batch,
      prefill_chunk=1024, mtp_draft=mtp_draft, decode_steps=decode_steps))
  rids = [eng.add_request(p, SamplingParams(temperature=0,
                                            max_tokens=new_tokens))
          for p in prompts]
  t0 = time.perf_counter()
  eng.step()                     # admits and prefills everything
  prefill_s = time.perf_counter() - t0
  times, tokens, traced = [], [], None
  while eng.has_work():
    before = eng.stats["decode_tokens"]
    prefills = eng.stats["prefill_calls"]
    if profile and len(times) == 1 and traced is None:
      traced = profile_lib.device_op_times(eng.step)
      continue
    t = time.perf_counter()
    eng.step()
    if eng.stats["prefill_calls"] == prefills:   # decode only
      times.append(time.perf_counter() - t)
      tokens.append(eng.stats["decode_tokens"] - before)
  warm = min(8, len(times) // 4)   # the first calls may still compile
  tps = float(np.sum(tokens[warm:]) / np.sum(times[warm:]))
  out = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
         "mtp_draft": mtp_draft, "decode_steps_per_call": decode_steps,
         "prefill_and_compile_s": prefill_s, "engine_calls": len(times),
         "step_ms": 1e3 * batch / tps, "tokens_per_sec": tps,
         "outputs": [eng.result(r)[0].tokens for r in rids]}
  if traced is not None:
    out["profile"] = traced
  st = eng.stats
  if mtp_draft:
    out["acceptance"] = st["accepted"] / max(st["drafted"], 1)
    rounds = st["drafted"] / mtp_draft
    out["acceptance_at_depth"] = [st[f"accepted_at_{k}"] / max(rounds, 1)
                                  for k in range(1, mtp_draft + 1)]
  return out


def prefix_sharing(cfg: ModelConfig, variables, *, samples: int,
                   prompt: int, page_size: int = 64) -> dict:
  """n samples of one prompt against n independent requests of it:
  prefill time (compiled beforehand) and KV pages held."""
  rng = np.random.default_rng(1)
  tokens = list(rng.integers(3, cfg.vocab_size, prompt))
  pages = samples * (prompt // page_size + 4) + 2
  ec = EngineConfig(page_size=page_size, num_pages=pages, max_batch=samples,
                    prefill_chunk=prompt, prefix_cache=False)
  params = SamplingParams(temperature=1.0, max_tokens=1, seed=0)
  result = {}
  for name in ("shared", "independent"):
    eng = Engine(cfg, variables, ec)
    passes = []
    for _ in range(3):   # the first pass compiles; the best later one counts
      if name == "shared":
        rids = [eng.add_request(tokens, dataclasses.replace(params,
                                                            n=samples))]
      else:
        rids = [eng.add_request(tokens, params) for _ in range(samples)]
      before = dict(eng.stats)
      t = time.perf_counter()
      eng.admit()                                       # prefill only
      jax.block_until_ready(eng.pages)
      seconds = time.perf_counter() - t
      held = eng.pool.used_pages()
      while eng.has_work():
        eng.step()
      for r in rids:
        eng.release(r)
      passes.append({"prefill_s": seconds, "pages_held": held,
                     "prefill_calls": eng.stats["prefill_calls"]
                                      - before.get("prefill_calls", 0),
                     "prefill_tokens": eng.stats["prefill_tokens"]
                                       - before.get("prefill_tokens", 0)})
    best = min(passes[1:], key=lambda p: p["prefill_s"])
    result[name] = {**best, "passes": passes}
  result["prompt_pages"] = -(-prompt // page_size)
  return result


def hf_generate(hub_dir: str, *, batch: int, prompt: int, new_tokens: int,
                timeout: int = 900) -> dict:
  """HF transformers `generate` (PyTorch, bf16, SDPA, greedy, MTP off) on a
  hub checkpoint, in a subprocess (its own GPU memory): tokens/s."""
  code = f"""
import json, time, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(
    {hub_dir!r}, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
model.eval()
torch.manual_seed(0)
ids = torch.randint(3, model.config.vocab_size, ({batch}, {prompt})).cuda()
mask = torch.ones_like(ids)
kw = dict(max_new_tokens={new_tokens}, min_new_tokens={new_tokens},
          do_sample=False, attention_mask=mask, pad_token_id=0)
try:
  model.generate(ids, use_mtp=False, max_new_tokens=4, attention_mask=mask)
  kw["use_mtp"] = False
except (TypeError, ValueError):
  pass
with torch.no_grad():
  model.generate(ids, **{{**kw, "max_new_tokens": 8, "min_new_tokens": 8}})
  torch.cuda.synchronize()
  t = time.perf_counter()
  out = model.generate(ids, **kw)
  torch.cuda.synchronize()
  s = time.perf_counter() - t
print(json.dumps({{"batch": {batch}, "seconds": s,
                   "new_tokens": out.shape[1] - {prompt},
                   "tokens_per_sec": {batch} * (out.shape[1] - {prompt}) / s,
                   "transformers": transformers.__version__,
                   "torch": torch.__version__}}))
"""
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get(
      "CUDA_VISIBLE_DEVICES", "0"))
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=timeout, env=env, check=False)
  if proc.returncode:
    return {"batch": batch, "error": proc.stderr[-2000:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])
