"""Prefix-tree merging benchmark: tree attention and a merged model step.

One GPU run:
  kernels    the time of each of our kernels (forward, dq, dk/dv) per tile
             config, with TFLOP/s counting recomputed products (where the
             time goes).
  attention  tree attention (ours, a small tile sweep) on one GRPO group
             packed in DFS order, TFLOP/s over live entries, next to cuDNN
             causal attention on the same number of tokens and tokamax's
             flash attention with a per-key q_end mask (if importable); a
             correctness check of ours against the float32 reference.
  model      forward+backward of the library's merged RL step
             (m2jax.rl.step.grad_step: CISPO with per-group normalisation on
             per-sample log-probs, the objective training runs), unmerged
             (every sample its own causal chain) vs merged (prefix trees), on
             (a) GRPO groups and (b) agent trajectories; both layouts run the
             same jitted step on rows of the same length, one row per call
             (the unmerged batch needs more rows: gradient accumulation), so
             the speedup is the ratio of summed row times, printed next to
             the FLOPs ratio. The row losses sum to the batch loss (whole-
             batch token weights), which both layouts must agree on.

  python -m experiments.bench_prefix_tree --out=benchmarks/results/prefix_tree_h100.json
"""

import functools
import json
import os
import traceback

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import rl_samples
from benchmarks import timing
from benchmarks import tree_attention_cases as tb
from experiments import cli
from kernels import tree_attention as ta
from m2jax import config as config_lib
from m2jax import model
from m2jax import params as params_lib
from m2jax.rl import cispo
from m2jax.rl import prefix_tree as pt
from m2jax.rl import step as rl_step
from m2jax.settings import Settings

_OUT = flags.DEFINE_string("out", "benchmarks/results/prefix_tree_h100.json",
                           "JSON results")
_SECTIONS = flags.DEFINE_list("sections", ["attention", "kernels", "model"],
                              "what runs")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU dry run of kernels")
_REPS = flags.DEFINE_integer("reps", 10, "timed repetitions (attention)")
# Attention problem (SPEC §5: GQA 48/8, d=128, one group of 16384 tokens).
_HEADS = flags.DEFINE_integer("heads", 48, "query heads")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "KV heads")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "head dim")
_ATTN_GROUPS = flags.DEFINE_list(
    "attn_groups", ["4096x16x768", "4096x16x512"],
    "GRPO groups PROMPTxGxRESPONSE timed for attention")
_TILES = flags.DEFINE_list(
    "tiles", ["mosaic:128.64.64.2", "mosaic:128.128.64.2",
              "mosaic:64.64.64.3", "triton:128.128.64.64.64.64.8.2.4.2"],
    "tree-attention configs, BACKEND:TILES "
    "(kernels.tree_attention.TreeAttentionConfig.from_string). mosaic: "
    "block_k.block_k_dq.block_q_dkv.stages[.stages_dkv]; triton: "
    "bq.bk.bq_dq.bk_dq.bq_dkv.bk_dkv.warps.stages.warps_bwd.stages_bwd (a bare "
    "list is triton). The first one is the default")
_TOKAMAX = flags.DEFINE_list("tokamax", ["mosaic", "triton"],
                             "tokamax implementations to time")
# Model problem.
_CONFIG = flags.DEFINE_string("config", "m2_small", "model preset")
_FFN = flags.DEFINE_enum("ffn", "moe", ["moe", "dense"],
                         "dense: SwiGLU with the MoE's active width")
_ROW_LEN = flags.DEFINE_integer("row_len", 36864, "tokens per packed row")
_GRPO = flags.DEFINE_string("grpo", "3x16x4096x512",
                            "GROUPSxGxPROMPTxRESPONSE for case (a)")
_AGENT_STEPS = flags.DEFINE_list("agent_steps", ["16", "32"],
                                 "steps of each agent trajectory (case b)")
_CASES = ("a_grpo", "b_agent")  # the keys of _samplers()
_MODEL_CASES = flags.DEFINE_list("model_cases", list(_CASES),
                                 f"which model-step cases run: {_CASES}")
flags.register_validator(
    "model_cases", lambda cases: set(cases) <= set(_CASES),
    f"--model_cases: each must be one of {_CASES}")
_AGENT_START = flags.DEFINE_integer("agent_start", 2048, "initial state")
_AGENT_FINAL = flags.DEFINE_integer("agent_final", 32768, "final length")
_AGENT_REWRITE = flags.DEFINE_bool(
    "agent_rewrite", True, "rewrite the context once in the last trajectory")
# The policy loss of the timed step (no MTP: the bench model has none).
_RL = rl_step.RLConfig(cispo=cispo.CISPOConfig(eps_high=0.3))


def _settings() -> Settings:
  """How the kernels run before the model section picks its tiles:
  --interpret reaches every kernel config through Settings, its one home."""
  return Settings(interpret=_INTERPRET.value)


def _tile_config(text):
  return _settings().replace(tree_attention=ta.TreeAttentionConfig.from_string(
      text)).tree_attention


def _record(results, key, value):
  results[key] = value
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1, default=float)


# ------------------------------------------------------------- attention ---

def _first_per_backend():
  firsts = {}
  for tile in _TILES.value:
    firsts.setdefault(_tile_config(tile).backend, tile)
  return firsts


def _check_ours_on_device(results):
  """GQA, bf16, two batch rows (a ragged random tree, a causal chain):
  forward and gradients vs float32. Returns the configs that failed."""
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 99, 300)
  seqs = [np.concatenate([prompt, rng.integers(1, 3, rng.integers(1, 150))])
          for _ in range(12)]   # ragged responses, some sharing a few tokens
  T = 2000
  se = np.concatenate([pt.pack(seqs, row_len=T, num_rows=1).subtree_end,
                       np.full((1, T), T, np.int32)])
  q, k, v, do = (jnp.concatenate(pair) for pair in zip(
      tb.inputs(T, 12, 2, 128, seed=0), tb.inputs(T, 12, 2, 128, seed=1)))
  want = jax.jit(tb.reference(se, backward=True))(q, k, v, do)
  bad, checked = {}, {}
  for tile in _TILES.value:  # every config: any may become the model's
    got = jax.jit(tb.ours(se, _tile_config(tile), backward=True))(q, k, v, do)
    errs = {n: timing.rel_err(g, w) for n, g, w in
            zip(("out", "dq", "dk", "dv"), got, want)}
    print(f"correctness {tile} (bf16 vs float32 reference, rel. L2):", errs)
    checked[tile] = errs
    _record(results, "correctness", checked)
    if not all(e < 2e-2 for e in errs.values()):
      bad[tile] = errs
  if bad:
    print(f"TREE ATTENTION MISMATCH ON DEVICE (these configs are timed but "
          f"never used for the model step): {bad}", flush=True)
  return set(bad)


def _time_attention(results, failed):
  N, K, H = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
  rows = []
  tiles = list(_TILES.value)
  for n_group, spec in enumerate(_ATTN_GROUPS.value):
    if n_group == 1:  # the tile sweep runs on the first group only
      tiles = [_best_tiles(rows, failed)]
    prompt, G, resp = (int(x) for x in spec.split("x"))
    se = tb.grpo_subtree_end(prompt, G, resp)
    T = se.shape[1]
    live = int(ta.live_entries(se)[0])
    causal = T * (T + 1) // 2
    q, k, v, do = tb.inputs(T, N, K, H)
    cands = {}
    for tile in tiles:
      cfg = _tile_config(tile)
      cands[f"ours[{tile}]"] = (tb.ours(se, cfg), tb.ours(se, cfg, True), live)
    cands["cudnn_causal"] = (tb.cudnn_causal(), tb.cudnn_causal(True), causal)
    if n_group == 0:  # kernel quality on plain causal, and the peers
      chain = np.full((1, T), T, np.int32)
      for backend, tile in _first_per_backend().items():
        cfg = _tile_config(tile)
        cands[f"ours_causal_chain[{tile}]"] = (
            tb.ours(chain, cfg), tb.ours(chain, cfg, True), causal)
      for impl in _TOKAMAX.value:
        try:
          cands[f"tokamax_{impl}_q_end"] = (tb.tokamax_q_end(se, impl),
                                            tb.tokamax_q_end(se, impl, True),
                                            live)
        except (ImportError, AttributeError) as e:
          print(f"tokamax {impl}: not importable: {e}")
    for name, (fwd, fwdbwd, entries) in cands.items():
      row = {"group": spec, "tokens": T, "impl": name, "entries": entries,
             "live_fraction_of_causal": live / causal}
      for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        try:
          t, _ = timing.time_fn(jax.jit(fn), q, k, v, do, reps=_REPS.value)
          row[f"{mode}_ms"] = t * 1e3
          row[f"{mode}_tflops"] = params_lib.attention_flops(
              entries, N, H, backward=mode == "fwdbwd") / t / 1e12
        except jax.errors.JaxRuntimeError as e:
          if not timing.out_of_memory(e):
            raise
          row[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
          print(f"{spec} {name} {mode}: {row[f'{mode}_error']}")
      rows.append(row)
      print(f"{spec:>13} {name:<42} fwd {row.get('fwd_tflops', 0):6.1f}  "
            f"fwd+bwd {row.get('fwdbwd_tflops', 0):6.1f} TFLOP/s "
            f"({row.get('fwdbwd_ms', 0):.2f} ms)", flush=True)
      _record(results, "attention", rows)
  return rows


def _time_kernels(results):
  """Time split of ours: each kernel of every tile config on the first
  group, with its TFLOP/s counting recomputed products (live entries)."""
  N, K, H = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
  prompt, G, resp = (int(x) for x in _ATTN_GROUPS.value[0].split("x"))
  se = tb.grpo_subtree_end(prompt, G, resp)
  live = int(ta.live_entries(se)[0])
  q, k, v, do = tb.inputs(se.shape[1], N, K, H)
  rows = []
  for tile in _TILES.value:
    row = {"impl": tile}
    try:
      for name, (fn, args, mm) in tb.kernel_passes(
          se, _tile_config(tile), q, k, v, do).items():
        t, _ = timing.time_fn(fn, *args, reps=_REPS.value)
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_tflops_with_recompute"] = (
            params_lib.attention_product_flops(live, N, H, mm) / t / 1e12)
    except jax.errors.JaxRuntimeError as e:
      if not timing.out_of_memory(e):
        raise
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(f"kernels {tile:<40} " + "  ".join(
        f"{n} {row.get(n + '_ms', 0):.2f} ms "
        f"({row.get(n + '_tflops_with_recompute', 0):.0f} TF/s w/ recompute)"
        for n in ("fwd", "dq", "dkv")), row.get("error", ""), flush=True)
    _record(results, "kernels", rows)


def _best_tiles(rows, failed):
  """The fastest config on the first group that passed the device check."""
  ours = [r for r in rows if r["impl"].startswith("ours[")
          and r["impl"][5:-1] not in failed
          and "fwdbwd_tflops" in r and r["group"] == _ATTN_GROUPS.value[0]]
  if not ours:
    return _TILES.value[0]
  return max(ours, key=lambda r: r["fwdbwd_tflops"])["impl"][5:-1]


# ----------------------------------------------------------------- model ---

def _samplers():
  """{model case: rng, vocab -> (sequences, loss masks, group ids)}."""
  groups, size, prompt, resp = (int(x) for x in _GRPO.value.split("x"))
  return {
      "a_grpo": functools.partial(
          rl_samples.grpo_samples, groups=groups, group_size=size,
          prompt_len=prompt, response_len=resp),
      "b_agent": functools.partial(
          rl_samples.agent_samples,
          steps=[int(s) for s in _AGENT_STEPS.value],
          start_len=_AGENT_START.value, final_len=_AGENT_FINAL.value,
          rewrite_last=_AGENT_REWRITE.value)}


def _model_config(ffn: str, settings: Settings):
  """The --config preset without MTP, `ffn` "moe" or "dense" (of the MoE's
  active width), run with `settings`."""
  cfg = config_lib.get_preset(_CONFIG.value).replace(num_mtp_modules=0,
                                                     settings=settings)
  if ffn == "dense":
    cfg = cfg.replace(ffn_type="dense", dense_intermediate_size=(
        cfg.num_experts_per_tok * cfg.moe_intermediate_size))
  return cfg


def _time_layout(step, params, bias, batches):
  """(seconds, loss) of one forward+backward over all rows, one row per
  call (the median of 3 timings per row when there are few rows, else one;
  after a warm-up). The per-token weights are the whole batch's, so the row
  losses add up to the batch loss."""
  rows = [jax.device_put(b) for b in batches]
  jax.block_until_ready(step(params, bias, rows[0]))
  reps = 3 if len(rows) <= 4 else 1
  seconds, loss = 0.0, 0.0
  for row in rows:
    t, (_, metrics, _) = timing.time_fn(step, params, bias, row, reps=reps,
                                        warmup=0)
    seconds += t
    loss += float(metrics["loss"])
  return seconds, loss


def _time_model(results, settings: Settings, ffn: str):
  cfg = _model_config(ffn, settings)
  remat = settings.remat
  rng = np.random.default_rng(0)
  variables = model.init(cfg, jax.random.key(0))
  params, bias = variables["params"], variables.get(model.EXPERT_BIAS, {})
  samplers = _samplers()
  cases = [(c, samplers[c](rng, cfg.vocab_size)) for c in _MODEL_CASES.value]
  max_len = max(len(s) for _, (seqs, _, _) in cases for s in seqs)
  layouts = {}
  for case, (seqs, masks, group_ids) in cases:
    payloads = rl_samples.rollout_payloads(rng, seqs, group_ids,
                                           cfg.vocab_size)
    layouts[case] = {
        name: pt.pack(seqs, row_len=_ROW_LEN.value, merge=merge,
                      loss_masks=masks, payloads=payloads, max_len=max_len)
        for name, merge in (("unmerged", False), ("merged", True))}
  # Every row of every layout has one shape (rows of row_len, the same
  # sample slots): compile once, time everything.
  slots = max(int(np.bincount(t.sample_index[:, 0] // _ROW_LEN.value).max())
              for by_name in layouts.values() for t in by_name.values())
  batches = {case: {name: rl_step.make_batches(
      trees, group_ids, _RL, rows_per_batch=1, samples_per_batch=slots)
                    for name, trees in layouts[case].items()}
             for case, (_, _, group_ids) in cases}
  first = jax.device_put(batches[cases[0][0]]["merged"][0])
  step = jax.jit(functools.partial(rl_step.grad_step, model_config=cfg,
                                   config=_RL))
  step = step.lower(params, bias, first).compile()
  mem = step.memory_analysis()
  step_memory = {"temp": mem.temp_size_in_bytes / 2**30,
                 "arguments": mem.argument_size_in_bytes / 2**30,
                 "outputs": mem.output_size_in_bytes / 2**30}
  print("compiled step memory (GiB):", step_memory, flush=True)
  out = []
  for case, (seqs, _, _) in cases:
    row = {"case": case, "samples": len(seqs),
           "sample_tokens": int(sum(map(len, seqs))), "config": _CONFIG.value,
           "ffn": cfg.ffn_type, "remat": remat, "row_len": _ROW_LEN.value,
           "settings": cfg.settings.to_dict(),
           "loss": "CISPO, per-group normalisation, sample layout "
                   "(m2jax.rl.step.grad_step)",
           "step_memory_gib": step_memory}
    for name, trees in layouts[case].items():
      entries = trees.attention_entries()
      row[name] = {"rows": int(trees.tokens.shape[0]),
                   "tokens": trees.num_tokens, "attention_entries": entries,
                   "flops": params_lib.train_flops(cfg, trees.num_tokens,
                                                   entries)}
      row[name]["seconds"], row[name]["loss"] = _time_layout(
          step, params, bias, batches[case][name])
      row[name]["tflops"] = row[name]["flops"] / row[name]["seconds"] / 1e12
    u, m = row["unmerged"], row["merged"]
    row["speedup"] = u["seconds"] / m["seconds"]
    row["flops_ratio"] = u["flops"] / m["flops"]
    row["speedup_over_flops_ratio"] = row["speedup"] / row["flops_ratio"]
    # The same objective from both layouts (the merged step is exact).
    row["loss_rel_diff"] = abs(u["loss"] - m["loss"]) / max(
        abs(u["loss"]), 1e-30)
    # Doing the whole batch in one step instead of accumulating over rows
    # needs activation memory proportional to the rows.
    row["one_step_activation_gib"] = {
        k: row[k]["rows"] * row["step_memory_gib"]["temp"]
        for k in ("unmerged", "merged")}
    out.append(row)
    print(f"{case}: {len(seqs)} samples, unmerged {u['rows']} rows "
          f"{u['tokens']} tok {u['seconds']:.3f} s ({u['tflops']:.0f} TFLOP/s)"
          f" | merged {m['rows']} rows {m['tokens']} tok {m['seconds']:.3f} s "
          f"({m['tflops']:.0f} TFLOP/s) | speedup {row['speedup']:.2f}x, "
          f"FLOPs ratio {row['flops_ratio']:.2f}x "
          f"({100 * row['speedup_over_flops_ratio']:.0f}%) | loss "
          f"{u['loss']:.6g} vs {m['loss']:.6g} | per-row step temp "
          f"{row['step_memory_gib']['temp']:.1f} GiB", flush=True)
    _record(results, "model", out)
  return out


def main(argv):
  del argv
  results = timing.run_header()
  print("device:", results["device"], flush=True)
  # How the model step runs; the attention section picks its tiles.
  settings = _settings()
  if "attention" in _SECTIONS.value:
    failed = _check_ours_on_device(results)
    rows = _time_attention(results, failed)
    best = _best_tiles(rows, failed)
    # The model step runs the fastest tiles that passed the check.
    settings = settings.replace(
        tree_attention=ta.TreeAttentionConfig.from_string(best))
    _record(results, "model_tiles", best)
    print("tiles for the model step:", best)
  if "kernels" in _SECTIONS.value:
    _time_kernels(results)
  if "model" in _SECTIONS.value:
    try:
      _time_model(results, settings, _FFN.value)
    except jax.errors.JaxRuntimeError as e:
      if not timing.out_of_memory(e):
        raise
      traceback.print_exc()
      print("out of memory: retrying the model step with a dense FFN of "
            "equal width and remat", flush=True)
      _time_model(results, settings.replace(remat=True), "dense")
    stats = jax.devices()[0].memory_stats() or {}
    _record(results, "peak_bytes_in_use", stats.get("peak_bytes_in_use"))
  print(json.dumps({k: v for k, v in results.items() if k != "attention"},
                   default=float)[:3000])


if __name__ == "__main__":
  cli.run(main)
