r"""Decode benchmarks (issue 14), one GPU run; sections chosen by --sections:

  kernel   paged decode attention (kernels/paged_attention.py) at batch 8,
           32K context, T = 1, for m2_small's heads (12 query, 2 KV) and
           M2's (48, 8), head dim 128, bf16: every backend and the
           reference, as the whole call the engine makes and as the kernel
           alone; KV bytes read per second as a fraction of the card's copy
           bandwidth, measured in the same run (target >= 0.7). First a
           correctness check of every backend against the float32
           reference on the device: ragged batches (an empty row, a row of
           only the new tokens, lengths off the page grid) at T = 1, 4 and
           16 (16 x 6 = 96 query rows: two Mosaic row blocks).
  engine   the engine's greedy decode step at --engine_batches (128-token
           prompts, 128 new tokens, --decode_steps per compiled call) next
           to its memory floor (benchmarks/decode_cases.floor_bytes);
           --profile also traces one call: device time per kernel
           (benchmarks/profile.py).
  spec     MTP speculative decoding at batch 1 on held-out prompts of
           --workdir's run: tokens/s, acceptance per depth and greedy
           identity for each K in --drafts (K=0: plain decoding).
  prefix   n samples of one long prompt against n requests of it
           (--prefix_case): prefill time and KV pages.
  hf       HF transformers generate on the same weights (hub layout, its
           own process), against the engine section's tokens/s.

  python -m experiments.bench_decode --sections=kernel \
      --out=benchmarks/results/decode_kernel_h100.json
  python -m experiments.bench_decode --workdir=RUN \
      --sections=spec,engine,prefix,hf --out=benchmarks/results/decode.json
CPU dry run (interpreted kernels, tiny sizes):
  python -m experiments.bench_decode --interpret --batch=2 --context=300 \
      --heads=4x2 --head_dim=64 --page_sizes=16 --check_context=100 \
      --check_new_tokens=1,3 --splits=0,3 --copy_mib=16 --reps=1 \
      --out=/tmp/decode.json
"""

import functools
import itertools
import json
import os
import traceback

from absl import flags
import jax
import numpy as np

from benchmarks import decode_cases as dc
from benchmarks import paged_attention_cases as pc
from benchmarks import profile as profile_lib
from benchmarks import timing
from experiments import cli
from kernels import gmm_mosaic
from m2jax.settings import Settings

_OUT = flags.DEFINE_string("out", "benchmarks/results/decode_kernel_h100.json",
                           "JSON results")
_SECTIONS = flags.DEFINE_list(
    "sections", ["kernel"], "what runs, in order: kernel, engine, spec, "
    "prefix, hf (hf reads the engine section's numbers)")
_INTERPRET = flags.DEFINE_bool("interpret", False,
                               "CPU dry run: Pallas kernels interpreted")
_REPS = flags.DEFINE_integer("reps", 10, "timed repetitions")
# The kernel section's problem.
_BATCH = flags.DEFINE_integer("batch", 8, "rows")
_CONTEXT = flags.DEFINE_integer("context", 32768, "keys per row")
_HEADS = flags.DEFINE_list("heads", ["12x2", "48x8"],
                           "QUERYxKV heads: m2_small, M2")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "head dim")
_PAGE_SIZES = flags.DEFINE_list("page_sizes", ["64", "16"],
                                "page sizes S (token slots per page)")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 1,
                                   "T: new tokens per row in the timed case")
_CONFIGS = flags.DEFINE_list(
    "configs", ["mosaic:64.2", "mosaic:128.1", "triton:64.4.2"],
    "kernel configs (PagedAttentionConfig.from_string): mosaic:BLOCK_K."
    "STAGES, triton:BLOCK_K.WARPS.STAGES")
_SPLITS = flags.DEFINE_list("splits", ["0", "16"],
                            "num_splits to time each config with (0: auto)")
_CHECK_CONTEXT = flags.DEFINE_integer(
    "check_context", 4096, "longest row of the correctness check")
_CHECK_NEW_TOKENS = flags.DEFINE_list("check_new_tokens", ["1", "4", "16"],
                                      "T values of the correctness check")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 1024,
                                 "size of the copy-bandwidth measurement")
cli.integer_lists("page_sizes", "splits", "check_new_tokens")
_MAX_ERR = 2e-2  # bf16 output vs the float32 reference, relative L2


def _settings() -> Settings:
  """How the kernel sections run the kernels: --interpret reaches the
  kernel configs through Settings, its one home."""
  return Settings(interpret=_INTERPRET.value)


def _record(results, key, value):
  results[key] = value
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1, default=float)


def _case(heads, page_size, new_tokens):
  return pc.DecodeCase.from_heads(heads, batch=_BATCH.value,
                                  head_dim=_HEAD_DIM.value,
                                  page_size=page_size, new_tokens=new_tokens)


def _check(results):
  """Every config against the float32 reference on ragged batches; returns
  the configs that failed anywhere."""
  rows, failed = [], set()
  for heads in _HEADS.value:
    for t in (int(x) for x in _CHECK_NEW_TOKENS.value):
      case = _case(heads, int(_PAGE_SIZES.value[0]), t)
      lens = pc.ragged_lengths(case.batch, _CHECK_CONTEXT.value, t)
      args = pc.inputs(case, lens, seed=t)
      want = jax.jit(pc.reference())(*args)
      for text in _CONFIGS.value:
        cfg = pc.config(text, _settings())
        row = {"heads": heads, "new_tokens": t, "config": text,
               "lens": lens.tolist()}
        try:
          row["rel_err"] = timing.rel_err(jax.jit(pc.ours(cfg))(*args), want)
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if not row.get("rel_err", np.inf) < _MAX_ERR:
          failed.add(text)
        rows.append(row)
        print(f"check {heads:>5} T={t:<2} {text:<16} rel. L2 "
              f"{row.get('rel_err', float('nan')):.2e} {row.get('error', '')}",
              flush=True)
        _record(results, "correctness", rows)
  if failed:
    print(f"PAGED ATTENTION MISMATCH ON DEVICE: {sorted(failed)}", flush=True)
  return failed


def _time(results, copy_bw, failed):
  rows = []
  for heads in _HEADS.value:
    for page_size in (int(x) for x in _PAGE_SIZES.value):
      case = _case(heads, page_size, _NEW_TOKENS.value)
      lens = np.full(case.batch, _CONTEXT.value, np.int32)
      args = pc.inputs(case, lens)
      nbytes = pc.kv_bytes(lens, case)
      cands = {"reference": (pc.reference(), None, None)}
      for text in _CONFIGS.value:
        for splits in (int(x) for x in _SPLITS.value):
          cfg = pc.resolved(pc.config(text, _settings(), splits),
                            args[0], args[1], args[3])
          name = text if splits == 0 else f"{text}/{splits}"
          cands[name] = (pc.ours(cfg), pc.kernel_alone(cfg, *args), cfg)
      want = None
      for name, (fn, kernel, cfg) in cands.items():
        row = {"heads": heads, "page_size": page_size,
               "new_tokens": case.new_tokens, "batch": case.batch,
               "context": _CONTEXT.value, "impl": name, "kv_bytes": nbytes,
               "passed_check": name.split("/")[0] not in failed}
        if cfg is not None:
          row["num_splits"] = cfg.num_splits
        try:
          t, out = timing.time_fn(jax.jit(fn), *args, reps=_REPS.value,
                                  min_time=0.0 if _INTERPRET.value else 0.05)
          row["ms"] = t * 1e3
          row["kv_tb_per_s"] = nbytes / t / 1e12
          row["fraction_of_copy_bw"] = nbytes / t / copy_bw
          if name == "reference":  # timed first
            want = out
          elif want is not None:
            row["rel_err_vs_reference"] = timing.rel_err(out, want)
          if kernel is not None:
            tk, _ = timing.time_fn(kernel, reps=_REPS.value,
                                   min_time=0.0 if _INTERPRET.value else 0.05)
            row["kernel_ms"] = tk * 1e3
            row["kernel_fraction_of_copy_bw"] = nbytes / tk / copy_bw
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          traceback.print_exc()
        rows.append(row)
        print(f"{heads:>5} S={page_size:<3} {name:<18} "
              f"{row.get('ms', float('nan')):8.3f} ms  "
              f"{row.get('kv_tb_per_s', 0):5.2f} TB/s = "
              f"{row.get('fraction_of_copy_bw', 0):5.1%} of copy  | kernel "
              f"{row.get('kernel_ms', float('nan')):8.3f} ms "
              f"{row.get('kernel_fraction_of_copy_bw', 0):5.1%}  splits "
              f"{row.get('num_splits', '-')}  err "
              f"{row.get('rel_err_vs_reference', float('nan')):.1e}",
              flush=True)
        _record(results, "kernel", rows)
  return rows


def _kernel_section(results):
  bw = timing.copy_bandwidth(_COPY_MIB.value << 20, reps=_REPS.value)
  copy_bw = max(bw.values())  # the stricter yardstick
  _record(results, "copy_bandwidth_bytes_per_s", bw)
  print("copy bandwidth (read + write):", {k: f"{v / 1e12:.2f} TB/s"
                                           for k, v in bw.items()},
        flush=True)
  failed = set(_CONFIGS.value)
  try:
    failed = _check(results)
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
  _time(results, copy_bw, failed)


# ------------------------------------------------ the engine and peers ----

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "A trained run (pretrain / mtp_growth work directory)"
    " for the engine sections; default: a fresh --preset model (random "
    "weights: timing only, no acceptance)")
_PRESET = flags.DEFINE_string("preset", "m2_small", "model without --workdir")
_ENGINE_BATCHES = flags.DEFINE_list("engine_batches", ["1", "64", "256"],
                                    "decode batch sizes of the engine section")
_PROMPT = flags.DEFINE_integer("prompt", 128, "prompt tokens (engine, hf)")
_GEN = flags.DEFINE_integer("gen", 128, "new tokens (engine, hf)")
_ENGINE_TILES = flags.DEFINE_list(
    "engine_gmm_tiles", [""], "grouped-matmul tiles TILE_N.TILE_K.STAGES "
    "of the engine section, one run each ('': picked per shape)")
_PROFILE = flags.DEFINE_bool(
    "profile", False, "engine section: trace one warm decode call per batch "
    "size and print/save device time per XLA op (benchmarks/profile.py)")
_DECODE_STEPS = flags.DEFINE_integer(
    "decode_steps", 16, "decode steps per compiled engine call: tokens "
    "(plain decoding) or speculative rounds (spec section, every K)")
_DRAFTS = flags.DEFINE_list("drafts", ["0", "1", "2", "3"],
                            "MTP draft tokens K of the spec section")
_HF_BATCHES = flags.DEFINE_list("hf_batches", ["1", "64"],
                                "batch sizes of HF transformers generate")
_SPEC_PROMPTS = flags.DEFINE_integer(
    "spec_prompts", 4, "held-out prompts of the spec section (one at a time)")
_PREFIX = flags.DEFINE_string("prefix_case", "16x4096",
                              "SAMPLESxPROMPT of the prefix section")
cli.integer_lists("engine_batches", "drafts", "hf_batches")


@functools.lru_cache(maxsize=1)
def _run():
  """(config, variables, source, data config, tokenizer) of the engine
  sections (the last two None without --workdir)."""
  # pylint: disable=import-outside-toplevel
  from m2jax import config as config_lib
  from m2jax import model
  from m2jax.eval import runs
  if _WORKDIR.value:
    cfg, dcfg, tokenizer, variables, step = runs.load_run(_WORKDIR.value)
    return cfg, variables, f"{_WORKDIR.value} step {step}", dcfg, tokenizer
  cfg = config_lib.get_preset(_PRESET.value)
  return (cfg, model.init(cfg, jax.random.key(0)), f"{_PRESET.value} random",
          None, None)


def _model():
  return _run()[:3]


def _bandwidth(results):
  if "copy_bandwidth_bytes_per_s" not in results:
    _record(results, "copy_bandwidth_bytes_per_s",
            timing.copy_bandwidth(_COPY_MIB.value << 20, reps=_REPS.value))
  return max(results["copy_bandwidth_bytes_per_s"].values())


def _engine_section(results):
  """Decode step time at each batch size next to its memory floor."""
  cfg, variables, source = _model()
  bw = _bandwidth(results)
  rows = []
  for batch, tiles in itertools.product(map(int, _ENGINE_BATCHES.value),
                                        _ENGINE_TILES.value):
    run_cfg = cfg
    if tiles:
      n, k, stages = (int(x) for x in tiles.split("."))
      run_cfg = cfg.replace(settings=cfg.settings.replace(
          gmm_tiles=gmm_mosaic.TileConfig(tile_n=n, tile_k=k, stages=stages)))
    r = dc.time_engine(run_cfg, variables, batch=batch, prompt=_PROMPT.value,
                       new_tokens=_GEN.value,
                       decode_steps=_DECODE_STEPS.value,
                       profile=_PROFILE.value)
    r.pop("outputs")
    if "profile" in r:
      profile_lib.print_summary(r["profile"], f"profile B={batch}")
    r["gmm_tiles"] = tiles or "auto"
    r["settings"] = run_cfg.settings.to_dict()
    floor = dc.floor_bytes(cfg, batch, _PROMPT.value + _GEN.value // 2)
    r.update(source=source, floor_bytes=floor,
             floor_ms=floor["total"] / bw * 1e3)
    r["fraction_of_floor"] = r["floor_ms"] / r["step_ms"]
    rows.append(r)
    print(f"engine B={batch} tiles {r['gmm_tiles']}: step {r['step_ms']:.3f} ms, "
          f"{r['tokens_per_sec']:,.0f} tok/s, floor {r['floor_ms']:.3f} ms "
          f"({100 * r['fraction_of_floor']:.0f}% of floor)", flush=True)
    _record(results, "engine", rows)


def _spec_section(results):
  """MTP speculative decoding at batch 1: tokens/s and acceptance per K."""
  cfg, variables, source = _model()
  rows, ref = [], None
  prompts = _held_out_prompts()
  for K in map(int, _DRAFTS.value):
    if K > cfg.num_mtp_modules:
      print(f"spec K={K}: the model has {cfg.num_mtp_modules} MTP modules")
      continue
    r = dc.time_engine(cfg, variables, batch=1, prompt=_PROMPT.value,
                       new_tokens=_GEN.value, mtp_draft=K, prompts=prompts,
                       decode_steps=_DECODE_STEPS.value)
    outputs = r.pop("outputs")
    if ref is None:
      ref = outputs
    r["identical_to_plain_greedy"] = [o == w for o, w in zip(outputs, ref)]
    r["source"] = source
    rows.append(r)
    base = rows[0]["tokens_per_sec"]
    print(f"spec K={K}: {r['tokens_per_sec']:,.1f} tok/s "
          f"({r['tokens_per_sec'] / base:.2f}x K=0), acceptance "
          f"{r.get('acceptance', float('nan')):.2f} per depth "
          f"{r.get('acceptance_at_depth')}, identical "
          f"{r['identical_to_plain_greedy']}", flush=True)
    _record(results, "spec", rows)


def _held_out_prompts():
  """Validation rows of the run (None without one: random prompts)."""
  if not _WORKDIR.value:
    return None
  from m2jax.data import make_dataset  # pylint: disable=import-outside-toplevel
  _, _, _, dcfg, tokenizer = _run()
  batch = next(iter(make_dataset(dcfg, tokenizer, "validation")))
  rows = np.asarray(batch["tokens"])[:_SPEC_PROMPTS.value, :_PROMPT.value]
  return [[int(t) for t in row] for row in rows]


def _prefix_section(results):
  cfg, variables, source = _model()
  samples, prompt = (int(x) for x in _PREFIX.value.split("x"))
  r = dc.prefix_sharing(cfg, variables, samples=samples, prompt=prompt)
  r["source"] = source
  print(f"prefix {samples}x{prompt}: shared prefill "
        f"{r['shared']['prefill_s']:.3f} s, {r['shared']['pages_held']} pages"
        f" | independent {r['independent']['prefill_s']:.3f} s, "
        f"{r['independent']['pages_held']} pages (one prompt: "
        f"{r['prompt_pages']} pages)", flush=True)
  _record(results, "prefix", r)


def _hf_section(results):
  """HF transformers generate on the same weights (hub layout), and the
  engine's tokens/s at the same batch sizes from the engine section."""
  # pylint: disable=import-outside-toplevel
  import tempfile
  from m2jax import hf
  cfg, variables, source = _model()
  rows = []
  with tempfile.TemporaryDirectory() as d:
    d = os.path.join(d, "hub")
    main_only = {c: {k: v for k, v in tree.items()
                     if not k.startswith("mtp_")}
                 for c, tree in variables.items()}
    hf.save(d, cfg.replace(num_mtp_modules=0), main_only)
    for batch in map(int, _HF_BATCHES.value):
      r = dc.hf_generate(d, batch=batch, prompt=_PROMPT.value,
                         new_tokens=_GEN.value)
      r["source"] = source
      ours = [e for e in results.get("engine", []) if e["batch"] == batch]
      if ours and "tokens_per_sec" in r:
        r["engine_over_hf"] = ours[0]["tokens_per_sec"] / r["tokens_per_sec"]
      rows.append(r)
      print(f"hf B={batch}: {r.get('tokens_per_sec', float('nan')):,.1f} "
            f"tok/s; ours / hf {r.get('engine_over_hf', float('nan')):.1f}x"
            f"{' ' + r['error'][-300:] if 'error' in r else ''}", flush=True)
      _record(results, "hf", rows)


_SECTION_FNS = {"kernel": _kernel_section, "engine": _engine_section,
                "spec": _spec_section, "prefix": _prefix_section,
                "hf": _hf_section}


flags.register_validator(
    "sections", lambda names: set(names) <= set(_SECTION_FNS),
    f"must name sections among {sorted(_SECTION_FNS)}")


def main(argv):
  del argv
  results = timing.run_header()
  print("device:", results["device"], flush=True)
  for name in _SECTIONS.value:
    _SECTION_FNS[name](results)
  _record(results, "done", True)


if __name__ == "__main__":
  cli.run(main)
