"""One expert-parallel exchange on n GPUs, timed and checked
(experiments/bench_all_to_all.py, experiments/bench_scaling.py)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.timing import time_fn


def time_exchange(n: int, rows: int, width: int, dense: bool = False) -> dict:
  """Median ms of one exchange of `rows` bf16 rows of `width` per GPU, split
  evenly over n GPUs (ragged all-to-all, or dense all_to_all), checked."""
  if rows % n:
    raise ValueError(f"rows={rows} must divide by the {n} GPUs")
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  part = rows // n

  def ragged(x):
    me = jax.lax.axis_index("x")
    sizes = jnp.full((n,), part, jnp.int32)
    offsets = jnp.arange(n, dtype=jnp.int32) * part
    return jax.lax.ragged_all_to_all(
        x, jnp.zeros_like(x), offsets, sizes,
        jnp.full((n,), me * part, jnp.int32), sizes, axis_name="x")

  def dense_(x):
    return jax.lax.all_to_all(x.reshape(n, part, width), "x", 0, 0
                              ).reshape(rows, width)

  fn = jax.jit(jax.shard_map(dense_ if dense else ragged, mesh=mesh,
                             in_specs=P("x"), out_specs=P("x")))
  # Each row carries its global index in base 256 in its first three
  # columns: exact in bf16, so a row landing anywhere else is caught.
  r = jnp.arange(n * rows, dtype=jnp.int32)[:, None]
  digits = jnp.concatenate([r % 256, r // 256 % 256, r // 65536], axis=1)
  x = jax.device_put(
      jnp.pad(digits, ((0, 0), (0, width - 3))).astype(jnp.bfloat16),
      NamedSharding(mesh, P("x")))
  seconds, y = time_fn(fn, x, reps=20, warmup=3)
  ms = 1e3 * seconds
  # Correctness: GPU d's block s must be GPU s's block d.
  y = jax.device_get(y).reshape(n, n, part, width)
  xs = jax.device_get(x).reshape(n, n, part, width)
  moved = rows * width * 2 * (n - 1) / n
  return dict(rows=rows, width=width, ms=round(ms, 3),
              correct=bool((y == xs.transpose(1, 0, 2, 3)).all()),
              gb_per_s_per_gpu=round(moved / ms / 1e6, 1))
