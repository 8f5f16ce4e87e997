"""The expert-parallel exchange alone: ragged all-to-all per XLA mode.

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
import statistics
import time

from absl import app, flags

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


def _time(fn, x, reps=20):
  for _ in range(3):
    y = fn(x)
  y.block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def _child(variant):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n, rows, width = FLAGS.gpus, FLAGS.rows, FLAGS.width
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  part = rows // n

  def ragged(x):
    me = jax.lax.axis_index("x")
    sizes = jnp.full((n,), part, jnp.int32)
    offsets = jnp.arange(n, dtype=jnp.int32) * part
    return jax.lax.ragged_all_to_all(
        x, jnp.zeros_like(x), offsets, sizes,
        jnp.full((n,), me * part, jnp.int32), sizes, axis_name="x")

  def dense(x):
    return jax.lax.all_to_all(x.reshape(n, part, width), "x", 0, 0
                              ).reshape(rows, width)

  body = dense if variant.startswith("dense") else ragged
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"),
                             out_specs=P("x")))
  x = jax.device_put(
      jnp.arange(n * rows * width, dtype=jnp.float32).reshape(n * rows, width)
      .astype(jnp.bfloat16), NamedSharding(mesh, P("x")))
  ms = _time(fn, x)
  # Correctness: GPU d's block s must be GPU s's block d.
  y = jax.device_get(fn(x)).reshape(n, n, part, width)
  xs = jax.device_get(x).reshape(n, n, part, width)
  ok = bool((y == xs.transpose(1, 0, 2, 3)).all())
  moved = rows * width * 2 * (n - 1) / n
  print(json.dumps(dict(variant=variant, flags=VARIANTS[variant],
                        ms=round(ms, 3), correct=ok,
                        gb_per_s_per_gpu=round(moved / ms / 1e6, 1))))


def main(argv):
  del argv
  if FLAGS.variant:
    return _child(FLAGS.variant)
  results = []
  for name, xla_flags in VARIANTS.items():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_all_to_all",
         f"--variant={name}", f"--gpus={FLAGS.gpus}", f"--rows={FLAGS.rows}",
         f"--width={FLAGS.width}"], env=env, capture_output=True, text=True,
        timeout=240, check=False)
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
  app.run(main)
