"""experiments/bench_prefix_tree.py's failure handling: a bad --model_cases
is a one-line usage error before any work, and only running out of device
memory is recorded and moved past (benchmarks.timing.out_of_memory)."""

import os
import subprocess
import sys

import jax
import pytest

from benchmarks import timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bad_model_case_is_a_one_line_error_before_any_work(tmp_path):
  out = tmp_path / "results.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_prefix_tree",
       "--model_cases=a_grpo,c_chat", f"--out={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith("error: ") and "--model_cases" in lines[0]
  assert "a_grpo" in lines[0] and "b_agent" in lines[0]
  assert not out.exists()  # nothing ran, nothing was written


def test_only_out_of_memory_counts_as_out_of_memory():
  with pytest.raises(jax.errors.JaxRuntimeError) as oom:
    jax.numpy.zeros((1 << 42,), jax.numpy.float32).block_until_ready()
  assert timing.out_of_memory(oom.value)
  assert not timing.out_of_memory(ValueError("RESOURCE_EXHAUSTED"))
  assert not timing.out_of_memory(
      jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed to compile"))
