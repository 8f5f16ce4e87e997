r"""The expert-parallel exchange alone: ragged all-to-all per XLA mode.

  NCCL_NVLS_ENABLE=0 python -m experiments.bench_all_to_all --gpus=4 \
      --out=benchmarks/results/all_to_all.json

One MoE layer's dispatch at m2_small sizes (8 x 2048 tokens x top-8 rows of
1024 bf16 per GPU, split evenly over the GPUs) through
`jax.lax.ragged_all_to_all`, once per XLA implementation of it (each in its
own process: XLA flags are read at start-up), next to a dense
`jax.lax.all_to_all` of the same bytes (NCCL's all-to-all: the reference).
Prints GB/s per GPU; the fastest variant's XLA_FLAGS is what
experiments/bench_scaling should run under.
"""

import json
import os
import subprocess
import sys

from absl import flags

from benchmarks import exchange
from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_integer("gpus", 4, "GPUs in the exchange.")
flags.DEFINE_integer("rows", 8 * 2048 * 8, "Rows per GPU.")
flags.DEFINE_integer("width", 1024, "Row width (bf16).")
flags.DEFINE_string("variant", None, "Internal: time one variant here.")
flags.DEFINE_string("out", None, "JSON output.")

# name -> XLA flags. "dense" times jax.lax.all_to_all instead.
VARIANTS = {
    "ragged_default": "",
    "ragged_one_shot": "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true",
    "ragged_decomposed": "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true",
    "ragged_symmetric": "--xla_gpu_ragged_all_to_all_mode=symmetric",
    "ragged_peer": "--xla_gpu_ragged_all_to_all_mode=peer",
    "dense_all_to_all": "",
}


def _child(variant):
  rec = exchange.time_exchange(FLAGS.gpus, FLAGS.rows, FLAGS.width,
                               dense=variant.startswith("dense"))
  print(json.dumps(dict(variant=variant, flags=VARIANTS[variant], **rec)))


def main(argv):
  del argv
  if FLAGS.variant:
    return _child(FLAGS.variant)
  results = []
  for name, xla_flags in VARIANTS.items():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    try:
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.bench_all_to_all",
           f"--variant={name}", f"--gpus={FLAGS.gpus}", f"--rows={FLAGS.rows}",
           f"--width={FLAGS.width}"], env=env, capture_output=True, text=True,
          timeout=240, check=False)
    except subprocess.TimeoutExpired:  # a hung mode must not cost the others
      rec = dict(variant=name, flags=xla_flags, error="timed out after 240 s")
    else:
      lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      rec = (json.loads(lines[-1]) if lines else
             dict(variant=name, flags=xla_flags,
                  error=proc.stderr.strip().splitlines()[-1][:300]
                  if proc.stderr.strip() else f"exit {proc.returncode}"))
    results.append(rec)
    print(json.dumps(rec), flush=True)
  ragged = [r for r in results if r["variant"].startswith("ragged")
            and r.get("correct")]
  best = min(ragged, key=lambda r: r["ms"]) if ragged else None
  out = dict(gpus=FLAGS.gpus, rows_per_gpu=FLAGS.rows, width=FLAGS.width,
             results=results, best_ragged=best and best["variant"],
             best_ragged_flags=best and best["flags"])
  print(f"best ragged: {out['best_ragged']} {out['best_ragged_flags']!r}")
  if FLAGS.out:
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
