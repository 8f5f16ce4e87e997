"""A device timer shared by the benchmarks."""

import statistics
import time

import jax


def time_fn(f, *args, reps: int = 10, warmup: int = 2) -> float:
  """Median seconds per call of an already-jitted `f` (synchronised)."""
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
