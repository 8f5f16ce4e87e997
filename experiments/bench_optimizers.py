r"""AdamW, Muon, MuonSphere and SSO trained side by side at equal tokens.

  python -m experiments.bench_optimizers --preset=m2_small --steps=300 \
      --batch=8 --seq_len=1024 --max_seconds=540 \
      --out=benchmarks/results/optimizers/m2_small.json
  python -m experiments.bench_optimizers --preset=tiny --steps=5   # CPU
  # One optimizer per 10-minute call, then one table:
  python -m experiments.bench_optimizers --optimizers=sso --out=sso.json ...
  python -m experiments.bench_optimizers --merge=adamw.json,sso.json \
      --out=benchmarks/results/optimizers/m2_small.json

Each (seed, optimizer) run trains a fresh model (init from the seed) on the
same batches of --data (default: the embedded stdlib corpus, byte tokens),
exactly the jitted step of m2jax.train.step, and reports: the final loss
(mean of the last --last steps' total and next-token loss) and the
validation loss at the end; the expert-load violation max load / mean load
- 1 (the train metric router/load_max_over_mean - 1, mean over layers) at
the end, over training and at its worst; the RMS of the residual stream
leaving the last block (act/hidden_rms) at the end and at its largest; the
step time (median over the steps after --untimed, each run to
block_until_ready: the optimizer's update included) and the first step's
(compilation included, for the first seed of an optimizer; later seeds
reuse its compiled step); the device's peak memory so far.
Runs go seed by seed (every optimizer once before any twice), the JSON is
rewritten after each, and no run starts after --max_seconds, so a run cut
short by a time limit keeps what finished; --resume keeps the runs --out
already holds and skips them.

Cost. Every optimizer is its own compiled step, and SSO's update is costly
at m2_small: one msign of all its units is ~28 TFLOP (the experts' 2,496
units), MuonSphere runs one per step, SSO one per lambda candidate (the
bracket from the last step's lambda*, then Illinois steps: the columns
`evals`, the mean per unit and step, and `msigns`, the step's msign work in
msigns of every unit, MuonSphere's being 1; before warm starts and
Illinois, cold bracket + bisection: 15-25), in true float32 by default
(TrainConfig.sso_matmul_precision; --train_override=sso_matmul_precision=
BF16_BF16_F32_X3 keeps ~16 bits on tensor cores).

JSON: {"device", "preset", "overrides", "batch", "seq_len", "steps",
"tokens_per_run", "lrs", "adam_lr", "train_overrides", "runs": [{"optimizer",
"seed", "lr", "adam_lr", "final_loss", "final_ce", "val_loss", "val_bpb",
"load_violation_final", "load_violation_mean", "load_violation_max",
"hidden_rms_final", "hidden_rms_max", "step_s", "first_step_s",
"tokens_per_sec", "peak_memory_gib", "finite", "curves": {"step", "loss",
"ce", "load_violation", "hidden_rms", "step_s", "evaluations_mean",
"evaluations_max", "msign_cost" (m2jax.train.sso.metrics of each step;
NaN but for SSO and MuonSphere)}} or {"optimizer", "seed",
"error"} (out of memory)], "summary": {optimizer: {the means over its seeds
of final_loss, final_ce, val_loss, load_violation_*, hidden_rms_*, step_s,
and over steps too of evaluations_mean, evaluations_max, msign_cost;
"seeds", "step_vs_muon"}}}.
"""

import json
import statistics
import time

from absl import flags, logging
import jax
import numpy as np

from benchmarks import grid
from experiments import cli, run_flags
from m2jax import config as config_lib
from m2jax.data import make_iterator
from m2jax.errors import UserError
from m2jax.train import sso
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.checkpoint import write_json
from m2jax.train.config import OPTIMIZERS, TrainConfig
from m2jax.train.loop import evaluate

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "m2_small", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_list("optimizers", list(OPTIMIZERS), "Optimizers to compare.")
flags.DEFINE_list("seeds", ["0", "1"], "Seeds (init; data order is fixed).")
flags.DEFINE_integer("steps", 300, "Optimizer steps per run (equal tokens).")
flags.DEFINE_integer("batch", 8, "Rows per batch.")
flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
flags.DEFINE_list(
    "lrs", ["adamw:3e-3", "muon:0.02", "muonsphere:0.02", "sso:0.02"],
    "OPTIMIZER:LR, the peak learning rate of the hidden matrices (all of "
    "AdamW's parameters). AdamW 3e-3: the repo's pretraining default for "
    "tiny and m2_small. Muon 0.02: Keller Jordan's Muon lr, for the same "
    "sqrt(max(1, d_out/d_in))-scaled orthogonal update as m2jax's Muon. "
    "MuonSphere/SSO 0.02: their eta is the spectral step relative to the "
    "radius (|dW|_2 = eta R), the SSO paper's 0.02-0.05 range, at its low "
    "end to match Muon's step. Under muon, muonsphere and sso the other "
    "parameters (embeddings, lm_head, router, norms) use --adam_lr.")
flags.DEFINE_float("adam_lr", 3e-3, "Peak learning rate of the AdamW kinds "
                   "under muon, muonsphere and sso.")
flags.DEFINE_integer("warmup_steps", None, "Warm-up steps (default: "
                     "steps // 20, at least 1).")
flags.DEFINE_multi_string("train_override", [], "TrainConfig FIELD=VALUE "
                          "for every run, e.g. sso_matmul_precision=default.")
flags.DEFINE_string("data", "stdlib", "Training documents (pretrain's --data"
                    "): 'stdlib' (embedded corpus), a directory or a glob.")
flags.DEFINE_integer("last", 20, "Steps averaged for the final values.")
flags.DEFINE_integer("untimed", 2, "First steps left out of the step time "
                     "(the first compiles).")
flags.DEFINE_integer("eval_batches", 8, "Validation batches at the end.")
flags.DEFINE_float("max_seconds", 1e9, "Start no run after this many seconds "
                   "(the JSON keeps what finished).")
flags.DEFINE_bool("resume", False, "Keep the runs --out already holds (same "
                  "preset, batch, seq_len and steps) and skip them.")
flags.DEFINE_string("out", "benchmarks/results/optimizers/run.json",
                    "JSON output, rewritten after every run.")
flags.DEFINE_list("merge", [], "Train nothing: merge these JSON files of one "
                  "comparison (e.g. one optimizer per call) into --out, "
                  "with the summary and the table.")
cli.integer_lists("seeds")
run_flags.define()

SUMMARY_KEYS = ("final_loss", "final_ce", "val_loss", "load_violation_final",
                "load_violation_mean", "load_violation_max",
                "hidden_rms_final", "hidden_rms_max", "step_s")
# Per step, from the optimizer state (m2jax.train.sso.metrics; NaN for
# AdamW and Muon); the summary holds their means over steps and seeds.
SSO_CURVES = ("evaluations_mean", "evaluations_max", "msign_cost")


def _lrs() -> dict[str, float]:
  lrs = {}
  for item in FLAGS.lrs:
    name, sep, value = item.partition(":")
    try:
      lrs[name] = float(value) if sep else None
    except ValueError:
      lrs[name] = None
    if lrs[name] is None or lrs[name] <= 0:
      raise UserError(f"--lrs: {item!r} is not OPTIMIZER:LR with LR > 0")
  for name in FLAGS.optimizers:
    if name not in OPTIMIZERS:
      raise UserError(f"--optimizers: {name!r} is not one of {OPTIMIZERS}")
    if name not in lrs:
      raise UserError(f"--lrs: no learning rate for {name!r}")
  return lrs


def _train_config(optimizer: str, seed: int, lr: float, mcfg) -> TrainConfig:
  base = grid.train_config(mcfg, steps=FLAGS.steps, seed=seed,
                           optimizer=optimizer, lr=lr, adam_lr=FLAGS.adam_lr,
                           warmup_steps=FLAGS.warmup_steps)
  return config_lib.apply_overrides(base, FLAGS.train_override)


def _tail_mean(values):
  return float(np.mean(values[-FLAGS.last:]))


def one_run(mcfg, dcfg, tokenizer, optimizer: str, seed: int,
            lr: float) -> dict:
  """Train one run; its row of the JSON."""
  tcfg = _train_config(optimizer, seed, lr, mcfg)
  state = state_lib.create_state(mcfg, tcfg)
  train, eval_fn = step_lib.jit_steps(mcfg, tcfg)
  batches = make_iterator(dcfg, tokenizer, "train")
  as_arrays = lambda b: {k: np.asarray(v) for k, v in b.items()}
  batch = as_arrays(next(batches))
  curves = {k: [] for k in ("step", "loss", "ce", "load_violation",
                            "hidden_rms", "step_s") + SSO_CURVES}
  finite = True
  for i in range(FLAGS.steps):
    t = time.perf_counter()
    state, metrics = jax.block_until_ready(train(state, batch))
    seconds = time.perf_counter() - t
    # One transfer for the step's metrics and the SSO solve's counts.
    metrics, solve = jax.device_get((metrics, sso.metrics(state.opt_state)))
    curves["step"].append(i + 1)
    curves["loss"].append(float(metrics["loss"]))
    curves["ce"].append(float(metrics["ce"]))
    curves["load_violation"].append(
        float(metrics.get("router/load_max_over_mean", np.nan)) - 1.0)
    curves["hidden_rms"].append(float(metrics["act/hidden_rms"]))
    curves["step_s"].append(seconds)
    for k in SSO_CURVES:
      curves[k].append(float(solve.get("sso/" + k, np.nan)))
    if not np.isfinite(curves["loss"][-1]):
      finite = False
      break
    batch = as_arrays(next(batches))
  batches.close()
  timed = curves["step_s"][FLAGS.untimed:] or curves["step_s"]
  step_s = statistics.median(timed)
  val = evaluate(eval_fn, state, dcfg, tokenizer, FLAGS.eval_batches)
  mem = jax.devices()[0].memory_stats() or {}
  violation = curves["load_violation"]
  return {
      "optimizer": optimizer, "seed": seed, "lr": lr,
      "adam_lr": tcfg.learning_rate, "finite": finite,
      "final_loss": _tail_mean(curves["loss"]),
      "final_ce": _tail_mean(curves["ce"]),
      "val_loss": val["val_loss"], "val_bpb": val["val_bpb"],
      "load_violation_final": _tail_mean(violation),
      "load_violation_mean": float(np.mean(violation)),
      "load_violation_max": float(np.max(violation)),
      "hidden_rms_final": _tail_mean(curves["hidden_rms"]),
      "hidden_rms_max": float(np.max(curves["hidden_rms"])),
      "step_s": step_s, "first_step_s": curves["step_s"][0],
      "tokens_per_sec": FLAGS.batch * FLAGS.seq_len / step_s,
      "peak_memory_gib": mem.get("peak_bytes_in_use", 0) / 2**30,
      "curves": curves,
  }


def summarize(runs) -> dict:
  """{optimizer: the mean over its finished seeds of SUMMARY_KEYS}, and
  each one's step time over Muon's."""
  out = {}
  for name in dict.fromkeys(r["optimizer"] for r in runs):
    done = [r for r in runs if r["optimizer"] == name and "error" not in r]
    if done:
      out[name] = {k: float(np.mean([r[k] for r in done]))
                   for k in SUMMARY_KEYS}
      # Runs from before the counts were recorded lack them: NaN.
      for k in SSO_CURVES:
        out[name][k] = float(np.mean([np.mean(r["curves"].get(k, np.nan))
                                      for r in done]))
      out[name]["seeds"] = len(done)
  if "muon" in out:
    for name in out:
      out[name]["step_vs_muon"] = out[name]["step_s"] / out["muon"]["step_s"]
  return out


def _table(summary) -> str:
  head = (f"{'optimizer':>10} {'seeds':>5} {'loss':>7} {'val':>7} "
          f"{'viol.end':>8} {'viol.max':>8} {'rms.end':>8} {'step ms':>8} "
          f"{'/muon':>6} {'evals':>6} {'msigns':>6}")
  rows = [head]
  for name, s in summary.items():
    rows.append(f"{name:>10} {s['seeds']:>5} {s['final_loss']:>7.4f} "
                f"{s['val_loss']:>7.4f} {s['load_violation_final']:>8.3f} "
                f"{s['load_violation_max']:>8.3f} "
                f"{s['hidden_rms_final']:>8.3f} {1e3 * s['step_s']:>8.1f} "
                f"{s.get('step_vs_muon', float('nan')):>6.2f} "
                f"{s['evaluations_mean']:>6.2f} {s['msign_cost']:>6.2f}")
  return "\n".join(rows)


SAME = ("preset", "overrides", "batch", "seq_len", "steps")


def _merge(paths) -> dict:
  """The runs of the JSON files at `paths` (one comparison) in one result."""
  merged = None
  for path in paths:
    with open(path, encoding="utf-8") as f:
      part = json.load(f)
    if merged is None:
      merged = dict(part, runs=[], lrs={})
    elif any(part.get(k) != merged.get(k) for k in SAME):
      raise UserError(f"--merge: {path} is another comparison than "
                      f"{paths[0]} (they differ in one of {SAME})")
    merged["lrs"].update(part["lrs"])
    merged["runs"] += [r for r in part["runs"] if "error" not in r]
  merged["summary"] = summarize(merged["runs"])
  return merged


def _print(result) -> None:
  print(f"\n{result['device']}: {result['preset']} B={result['batch']} "
        f"T={result['seq_len']}, {result['steps']} steps "
        f"({result['tokens_per_run']:,} tokens per run)")
  print(_table(result["summary"]))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.merge:
    result = _merge(FLAGS.merge)
    write_json(FLAGS.out, result)
    _print(result)
    return
  start = time.perf_counter()
  mesh, settings = run_flags.from_flags()
  if mesh is not None:
    raise UserError("--mesh: bench_optimizers runs on one device")
  lrs = _lrs()
  mcfg = config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    FLAGS.override).replace(settings=settings)
  dcfg, tokenizer = grid.data(FLAGS.data, FLAGS.seq_len, FLAGS.batch)
  result = {"device": jax.devices()[0].device_kind, "preset": FLAGS.preset,
            "overrides": FLAGS.override, "batch": FLAGS.batch,
            "seq_len": FLAGS.seq_len, "steps": FLAGS.steps,
            "tokens_per_run": FLAGS.steps * FLAGS.batch * FLAGS.seq_len,
            "lrs": {k: lrs[k] for k in FLAGS.optimizers},
            "adam_lr": FLAGS.adam_lr, "train_overrides": FLAGS.train_override,
            "runs": []}
  old = grid.previous(FLAGS.out, result, SAME) if FLAGS.resume else None
  if old:
    result["runs"] = [r for r in old["runs"] if "error" not in r]
  done = {(r["optimizer"], r["seed"]) for r in result["runs"]}
  plan = [{"optimizer": name, "seed": int(seed)} for seed in FLAGS.seeds
          for name in FLAGS.optimizers if (name, int(seed)) not in done]
  grid.run_all(plan, lambda r: one_run(mcfg, dcfg, tokenizer, r["optimizer"],
                                       r["seed"], lrs[r["optimizer"]]),
               result, out=FLAGS.out, summarize=summarize, start=start,
               max_seconds=FLAGS.max_seconds)
  _print(result)


if __name__ == "__main__":
  cli.run(main)
