"""The device timer (time_fn; time_steps for steps that carry a state), the
error metric, the copy bandwidth, the header of a results file that every
benchmark uses, and nvidia-smi's utilisation sampled during a run."""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import threading
import time

from absl import flags

import jax
import jax.numpy as jnp


def time_fn(f, *args, reps: int = 10, warmup: int = 2, min_time: float = 0.0,
            batch: int = 1):
  """Median seconds per call of `f(*args)`, and the outputs of its last call.

  `warmup` untimed calls first (compilation among them), then `reps`
  samples, each a batch of `batch` back-to-back calls synchronised once at
  its end. With `min_time` > 0, one more untimed call sizes the batches to
  last about `min_time` seconds instead, which hides the dispatch gap
  between calls of a short kernel.
  """
  out = None
  for _ in range(warmup):
    out = None  # free the last outputs before the next call
    out = jax.block_until_ready(f(*args))
  if min_time > 0:
    out = None
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    batch = max(1, int(min_time / max(time.perf_counter() - t0, 1e-6)))
  samples = []
  for _ in range(reps):
    out = None
    t0 = time.perf_counter()
    for _ in range(batch):
      out = f(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / batch)
  return statistics.median(samples), out


def time_steps(step, state, batches, *, reps: int = 10, warmup: int = 3,
               back_to_back: bool = False):
  """time_fn for a step that carries its state, `state, out = step(state,
  batch)` (a train step, which donates its state, cannot be called twice
  on one state): median seconds per step over `reps` steps after `warmup`
  untimed ones, the batches taken in turn, each step waited for. With
  `back_to_back` the `reps` steps are enqueued one after another and waited
  for once, as a training loop that syncs only to log runs them (m2jax's
  loops do): mean seconds per step, without the host's dispatch gap
  between steps. Returns (seconds, the last state, the last step's `out`)."""
  carry = {"state": state, "calls": 0}

  def one_step():
    batch = batches[carry["calls"] % len(batches)]
    carry["calls"] += 1
    carry["state"], out = step(carry["state"], batch)
    return carry["state"], out

  if back_to_back:  # one sample of `reps` steps
    reps, batch = 1, reps
  else:
    batch = 1
  seconds, (state, out) = time_fn(one_step, reps=reps, warmup=warmup,
                                  batch=batch)
  return seconds, state, out


def rel_err(got, want) -> float:
  """Relative L2 error ||got - want|| / ||want||, in float32; inf when `got`
  holds a non-finite value (an unwritten or overflowed output)."""
  got = jnp.asarray(got, jnp.float32)
  want = jnp.asarray(want, jnp.float32)
  if not bool(jnp.all(jnp.isfinite(got))):
    return float("inf")
  return float(jnp.linalg.norm(got - want)
               / jnp.maximum(jnp.linalg.norm(want), 1e-30))


def out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA running out of device memory (the one failure a
  benchmark records and moves past; anything else is a bug to see)."""
  return (isinstance(error, jax.errors.JaxRuntimeError)
          and "RESOURCE_EXHAUSTED" in str(error))


def warm_up_clocks(seconds: float = 2.0):
  """Runs matmuls for a while so the first timings see steady clocks."""
  x = jnp.ones((8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a: a @ a)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(x))


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> dict:
  """The device's measured memory bandwidth, the yardstick of bandwidth-
  bound kernels: bytes moved (read + written) per second by a large
  device-to-device copy, two ways: "copy" (`jnp.copy` under jit, an XLA
  copy) and "add_one" (`x + 1`, an elementwise pass XLA cannot elide).
  Each is the median of `reps` timings of back-to-back calls."""
  x = jnp.zeros((nbytes // 4,), jnp.uint32)
  out = {}
  for name, fn in (("copy", jnp.copy), ("add_one", lambda a: a + 1)):
    seconds, _ = time_fn(jax.jit(fn), x, reps=reps, min_time=0.05)
    out[name] = 2 * x.nbytes / seconds
  return out


def run_header() -> dict:
  """{date, device, jax, xla_flags, flags} of a benchmark run: the values
  of every flag the running script defines (absl files them under its
  path) and the XLA_FLAGS it ran under."""
  dev = jax.devices()[0]
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "device": getattr(dev, "device_kind", str(dev)),
          "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "flags": {f.name: f.value for f in
                    flags.FLAGS.get_key_flags_for_module(sys.argv[0])}}


class GpuSampler:
  """nvidia-smi's GPU utilisation (% of time a kernel ran) and memory,
  sampled every `interval` s in a thread while the `with` block runs; no
  samples where nvidia-smi is absent (a CPU). `summary()` after the block:
  {"util_mean", "util_max", "memory_used_mib_max", "samples"} or None."""

  def __init__(self, interval: float = 0.2):
    self.interval = interval
    # nvidia-smi numbers GPUs physically, whatever CUDA_VISIBLE_DEVICES
    # hides: sample the one this process sees as device 0.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    self.query = ("nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                  "--format=csv,noheader,nounits", f"--id={visible or 0}")
    self.samples: list[tuple[float, float]] = []
    self._stop = threading.Event()
    self._thread = None

  def _sample(self):
    while not self._stop.is_set():
      try:
        line = subprocess.run(self.query, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        util, mem = (float(x) for x in line.split(",")[:2])
      except (OSError, subprocess.SubprocessError, ValueError):
        return  # no nvidia-smi (or no GPU): no samples
      self.samples.append((util, mem))
      self._stop.wait(self.interval)

  def __enter__(self) -> "GpuSampler":
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def summary(self) -> dict | None:
    if not self.samples:
      return None
    util = [u for u, _ in self.samples]
    return {"util_mean": statistics.fmean(util), "util_max": max(util),
            "memory_used_mib_max": max(m for _, m in self.samples),
            "samples": len(util)}
