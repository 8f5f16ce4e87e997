r"""N small models in one vmapped program vs one at a time: throughput.

  python -m experiments.bench_sweep_vmap --preset=tiny --models=1,2,4 \
      --batch_size=4 --seq_len=128 --output=benchmarks/results/x.json

Two measurements per grouped-matmul backend:
  step   the train step of one model (what a sequential sweep runs N times)
         and the vmapped step of N models (m2jax.train.multi), timed on
         random batches after warm-up (benchmarks.timing.time_steps):
         tokens/s of all models, model TFLOP/s (m2jax.params.flops_per_token,
         6 x active parameters + attention) and MFU against the card's dense
         bf16 peak, the speedup N x t(1) / t(N), and nvidia-smi's GPU
         utilisation sampled during the timed steps (none on a CPU).
  sweep  (--sweep_steps > 0) a sweep's training end to end for N seeds:
         loop.pretrain one seed after another vs multi.pretrain_many, wall
         time with compiles, data pipelines, evals and checkpoints, on
         synthetic task documents, at the sweep's cadence.
"""

import json
import os
import tempfile
import time

from absl import flags, logging
import jax
import numpy as np

from benchmarks import timing
from experiments import cli
from m2jax import config as config_lib
from m2jax import params
from m2jax.data import DataConfig, single_document_batch
from m2jax.eval import tasks as tasks_lib
from m2jax.settings import Settings
from m2jax.train import checkpoint
from m2jax.train import multi
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import peak_flops

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "tiny", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_list("models", ["1", "2", "4"], "Models per program (N); the "
                  "first 1 is the one-at-a-time baseline.")
flags.DEFINE_integer("batch_size", 4, "Rows per batch, per model.")
flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
flags.DEFINE_integer("steps", 10, "Timed steps (after 3 warm-up steps).")
flags.DEFINE_list("backends", ["auto"],
                  "gmm backends (kernels.gmm.BACKENDS): auto is Mosaic on a "
                  "GPU for bf16 shapes it takes, xla (ragged_dot) elsewhere.")
flags.DEFINE_integer("sweep_steps", 0, "Steps of the end-to-end sweep "
                     "comparison (0: skip it).")
flags.DEFINE_integer("sweep_models", 3, "Seeds of the end-to-end comparison.")
flags.DEFINE_string("output", None, "JSON file for the results.")
cli.integer_lists("models")


def _model(backend):
  return config_lib.apply_overrides(
      config_lib.get_preset(FLAGS.preset), FLAGS.override).replace(
          settings=Settings(gmm_backend=backend))


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def bench_step(mcfg, n: int) -> dict:
  """The step of n models (n = 1: train_step itself), timed."""
  tcfg = TrainConfig(steps=1000, mtp_depth=min(1, mcfg.num_mtp_modules))
  B, T = FLAGS.batch_size, FLAGS.seq_len
  rng = np.random.default_rng(0)
  batch = lambda: single_document_batch(rng.integers(0, mcfg.vocab_size,
                                                     (B, T)))
  seeds = [tcfg.replace(seed=i) for i in range(n)]
  if n == 1:
    state = state_lib.create_state(mcfg, seeds[0])
    fn, _ = step_lib.jit_steps(mcfg, tcfg)
    batches = [jax.device_put(batch()) for _ in range(4)]
  else:
    state = multi.stack([state_lib.create_state(mcfg, t) for t in seeds])
    step = multi.jit_multi_step(mcfg, tcfg)
    fn = lambda s, b: step(s, b, None)
    batches = [jax.device_put(multi.stack([batch() for _ in range(n)]))
               for _ in range(4)]
  try:
    t = time.perf_counter()
    jax.block_until_ready(fn(state, batches[0]))  # compiles; donates state
    compile_s = time.perf_counter() - t
    state = (state_lib.create_state(mcfg, seeds[0]) if n == 1 else
             multi.stack([state_lib.create_state(mcfg, t) for t in seeds]))
    with timing.GpuSampler() as gpu:
      step_s, _, metrics = timing.time_steps(fn, state, batches,
                                             reps=FLAGS.steps, warmup=3)
  except Exception as e:  # pylint: disable=broad-except
    if not timing.out_of_memory(e) and n == 1:
      raise
    return {"models": n, "error": _error(e)}
  tps = n * B * T / step_s
  fpt = params.flops_per_token(mcfg, T, mtp_depth=tcfg.mtp_depth)
  mem = jax.devices()[0].memory_stats() or {}
  return {"models": n, "compile_s": compile_s, "step_s": step_s,
          "tokens_per_sec": tps, "model_tflops": tps * fpt / 1e12,
          "mfu": params.mfu(tps, fpt, peak_flops()),
          "gpu": gpu.summary(),
          "peak_memory_gib": mem.get("peak_bytes_in_use", 0) / 2**30,
          "loss": np.asarray(metrics["loss"]).tolist()}


def bench_sweep(mcfg, n: int, workdir: str) -> dict:
  """Training of n seeds as a sweep does it: one after another, then as
  one program; wall seconds of each (compiles included)."""
  steps, T = FLAGS.sweep_steps, FLAGS.seq_len
  data = os.path.join(workdir, "train.jsonl")
  with open(data, "w", encoding="utf-8") as f:
    for doc in tasks_lib.training_documents(
        400, [tasks_lib.MIN_LENGTH, max(tasks_lib.MIN_LENGTH, T - 32)],
        seed=1):
      f.write(json.dumps({"text": doc}) + "\n")
  tcfg = TrainConfig(steps=steps, warmup_steps=max(1, steps // 20),
                     log_every=max(1, steps // 50),
                     eval_every=max(1, steps // 4), eval_batches=2,
                     checkpoint_every=max(1, steps // 4), keep_checkpoints=1,
                     mtp_depth=min(1, mcfg.num_mtp_modules))
  runs = lambda mode: [multi.Run(
      mcfg, tcfg.replace(seed=s),
      DataConfig(source=data, validation_fraction=0.1, seq_len=T,
                 batch_size=FLAGS.batch_size, seed=s),
      os.path.join(workdir, mode, f"seed{s}")) for s in range(n)]
  t = time.perf_counter()
  for run in runs("sequential"):
    pretrain(run.model, run.train, run.data, run.workdir, progress=False,
             sample_tokens=0)
  sequential_s = time.perf_counter() - t
  t = time.perf_counter()
  with timing.GpuSampler() as gpu:
    multi.pretrain_many(runs("vmapped"), resume=False, progress=False)
  vmapped_s = time.perf_counter() - t
  tokens = n * steps * FLAGS.batch_size * T
  return {"models": n, "steps": steps, "sequential_s": sequential_s,
          "vmapped_s": vmapped_s, "speedup": sequential_s / vmapped_s,
          "tokens_per_sec_sequential": tokens / sequential_s,
          "tokens_per_sec_vmapped": tokens / vmapped_s, "gpu": gpu.summary()}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  counts = params.count_params(_model("auto"))
  result = dict(timing.run_header(), active_params=counts["active_params"],
                total_params=counts["total_params"],
                peak_bf16_tflops=(peak_flops() or 0) / 1e12, backends={})

  def save():  # after every measurement: a run cut by a timeout keeps them
    if FLAGS.output:
      checkpoint.write_json(FLAGS.output, result)

  for backend in FLAGS.backends:
    mcfg = _model(backend)
    entry = result["backends"][backend] = {"step": []}
    for n in FLAGS.models:
      r = bench_step(mcfg, int(n))
      one = entry["step"][0] if entry["step"] else r
      if one["models"] == 1 and "error" not in one and "error" not in r:
        r["speedup_vs_sequential"] = r["models"] * one["step_s"] / r["step_s"]
      entry["step"].append(r)
      print(json.dumps(r), flush=True)
      save()
    if FLAGS.sweep_steps:
      with tempfile.TemporaryDirectory() as d:
        entry["sweep"] = bench_sweep(mcfg, FLAGS.sweep_models, d)
      print(json.dumps(entry["sweep"]), flush=True)
      save()
  print(f"\n{result['device']}: {FLAGS.preset} {FLAGS.override} "
        f"B={FLAGS.batch_size} T={FLAGS.seq_len} per model")
  for backend, entry in result["backends"].items():
    for r in entry["step"]:
      if "error" in r:
        print(f"  {backend} N={r['models']}: {r['error']}")
        continue
      util = (r["gpu"] or {}).get("util_mean")
      print(f"  {backend} N={r['models']:>2}: {r['tokens_per_sec']:>11,.0f} "
            f"tok/s {r['model_tflops']:7.2f} TFLOP/s MFU {r['mfu'] or 0:6.1%}"
            f" x{r.get('speedup_vs_sequential', 0):.2f} vs sequential"
            + ("" if util is None else f", GPU busy {util:.0f}%"))
    if "sweep" in entry:
      s = entry["sweep"]
      print(f"  {backend} sweep of {s['models']} seeds x {s['steps']} steps: "
            f"{s['sequential_s']:.1f} s one by one, {s['vmapped_s']:.1f} s "
            f"in one program (x{s['speedup']:.2f})")


if __name__ == "__main__":
  cli.run(main)
