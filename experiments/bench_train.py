r"""Training throughput of a preset: tokens/s and MFU per grouped-matmul backend.

  python -m experiments.bench_train --preset=m2_small --batch_size=8 \
      --seq_len=2048 --backends=mosaic,xla --output=benchmarks/results/x.json

Times the jitted train step (forward, backward, AdamW, bias update) on
random token batches, after warm-up: --steps steps back to back, waited for
once, as the training loops run them ("step_s", the mean; what tokens/s and
MFU use), and the median of --steps steps each waited for
("step_s_each_waited_for", which adds the host's dispatch gap between
steps; the figure reported before 2026-11-27, session h)
(benchmarks.timing.time_steps). MFU (m2jax.params.mfu) counts 6 x active
parameters + causal attention FLOPs per token, the trained MTP module
included (m2jax.params.flops_per_token), against the card's dense bf16
peak; the measured dense matmul rate of the same card is reported beside it.

  --dense_baseline  also times the dense model with the MoE's active FFN
                    width (m2jax.config.dense_counterpart) in the same run:
                    each MoE run reports its step over the dense step
                    ("moe_over_dense"; issue 17's target is <= 1.3).
  --profile_dir=DIR traces --profile_steps more steps of every run into
                    DIR/<run> (xplane and HLO text) and writes, next to
                    --output (else in DIR), <name>.<run>.ops.json (device
                    time per op, small) and <name>.profile.md (ms per step
                    by category: benchmarks/train_profile_table.py, which
                    regenerates it from either).
"""

import json
import os
import time

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks import train_profile_table
from experiments import cli
from m2jax import config as config_lib
from m2jax import model, params
from m2jax.data import single_document_batch
from m2jax.train import checkpoint
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.settings import Settings
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import peak_flops

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "m2_small", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
flags.DEFINE_integer("steps", 10, "Timed steps (after 3 warm-up steps).")
flags.DEFINE_list("backends", ["mosaic", "xla"],
                  "gmm backends to compare (kernels.gmm.BACKENDS).")
flags.DEFINE_string("output", None, "JSON file for the results.")
flags.DEFINE_bool("dense_baseline", False,
                  "Also time the dense model with the MoE's active FFN width.")
flags.DEFINE_string("profile_dir", None,
                    "Trace steps of every run into this directory and write "
                    "the per-op JSON and the per-category table.")
flags.DEFINE_integer("profile_steps", 3, "Steps traced (after timing).")
flags.DEFINE_multi_string(
    "variant", [], "Also time the first backend with other Settings: "
    "'NAME FIELD=VALUE ...' (attention=cudnn loss_chunk=0 is the step before "
    "the mask-free attention and the chunked loss; loss_impl=recompute the "
    "chunked loss before its fused gradient); repeatable.")


def _variants() -> list[tuple[str, list[str]]]:
  """[(name, Settings FIELD=VALUE overrides)] of --variant, checked now."""
  out = []
  for text in FLAGS.variant:
    name, *pairs = text.split()
    config_lib.apply_overrides(Settings(), pairs)
    out.append((name, pairs))
  return out


def _dense_matmul_tflops(reps=20) -> float:
  # A CPU (smoke runs) would take minutes at the GPU's size.
  n = 8192 if jax.default_backend() == "gpu" else 512
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  seconds, _ = timing.time_fn(jax.jit(lambda x, y: x @ y), a, b, reps=reps,
                               min_time=0.05)
  return params.matmul_flops(n, n, n) / seconds / 1e12


def _model_config(backend: str, dense: bool = False, overrides=()):
  mcfg = config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    FLAGS.override)
  if dense:
    mcfg = config_lib.dense_counterpart(mcfg)
  return mcfg.replace(settings=config_lib.apply_overrides(
      Settings(gmm_backend=backend), list(overrides)))


def _output_stem() -> str:
  if FLAGS.output:
    return os.path.splitext(FLAGS.output)[0]
  return os.path.join(FLAGS.profile_dir, "bench_train")


def bench(backend: str, dense: bool = False, variant=None) -> dict:
  name, overrides = variant or ("", [])
  mcfg = _model_config(backend, dense, overrides)
  label = f"dense-{backend}" if dense else backend
  label += f"-{name}" if name else ""
  tcfg = TrainConfig(steps=1000, mtp_depth=min(1, mcfg.num_mtp_modules))
  t = time.perf_counter()
  state = state_lib.init_state(mcfg, tcfg, model.init(mcfg, jax.random.key(0)))
  train, _ = step_lib.jit_steps(mcfg, tcfg)
  print(f"{label}: init {time.perf_counter() - t:.1f} s", flush=True)
  B, T = FLAGS.batch_size, FLAGS.seq_len
  rng = np.random.default_rng(0)
  batches = [single_document_batch(rng.integers(0, mcfg.vocab_size, (B, T)))
             for _ in range(4)]
  batches = [jax.device_put(b) for b in batches]
  try:
    t = time.perf_counter()
    compiled = train.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t
    print(f"{label}: compiled the train step in {compile_s:.1f} s",
          flush=True)
    # Back to back, as the training loops run steps (they sync to log);
    # then each step waited for, the figure before 2026-11-27 (session h).
    step_s, state, metrics = timing.time_steps(
        compiled, state, batches, reps=FLAGS.steps, warmup=3,
        back_to_back=True)
    synced_s, state, _ = timing.time_steps(compiled, state, batches,
                                           reps=FLAGS.steps, warmup=0)
    profile = None
    if FLAGS.profile_dir:
      state, profile = train_profile_table.capture(
          compiled, state, batches, steps=FLAGS.profile_steps,
          trace_dir=os.path.join(FLAGS.profile_dir, label),
          hlo_text=compiled.as_text(), label=label)
      profile["step_ms"] = step_s * 1e3
      profile["device"] = jax.devices()[0].device_kind
  except Exception as e:  # pylint: disable=broad-except
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if ("RESOURCE_EXHAUSTED" in error
        and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ):
      # B=24 at T=2048 needs ~71 GiB: more than the default 75% pool.
      error += (" (JAX's memory pool is 75% of the GPU by default; "
                "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives it more)")
    return {"backend": backend, "label": label, "dense": dense,
            "error": error}
  del state
  tps = B * T / step_s
  fpt = params.flops_per_token(mcfg, T, mtp_depth=tcfg.mtp_depth)
  mem = jax.devices()[0].memory_stats() or {}
  out = {"backend": backend, "label": label, "dense": dense,
         "settings": mcfg.settings.to_dict(),
         "compile_s": compile_s, "step_s": step_s,
         "step_s_each_waited_for": synced_s,
         "tokens_per_sec": tps,
         "model_tflops": tps * fpt / 1e12,
         "mfu": params.mfu(tps, fpt, peak_flops()),
         "peak_memory_gib": mem.get("peak_bytes_in_use", 0) / 2**30,
         "loss": float(metrics["loss"])}
  if "router/load_max_over_mean" in metrics:
    # How uneven the experts' groups were: the weight-gradient kernels'
    # work per group grows with its rows (benchmarks/notes/train.md).
    out["router_load_max_over_mean"] = float(
        metrics["router/load_max_over_mean"])
  if dense:
    out["dense_intermediate_size"] = mcfg.dense_intermediate_size
  if profile is not None:
    path = f"{_output_stem()}.{label}.ops.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(profile, f, separators=(",", ":"))
    out["profile_ops_json"] = path
    out["profile"] = profile
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if FLAGS.profile_dir:
    # A persistent cache's key leaves out the ops' names (their scopes): a
    # step cached before a scope changed would be profiled under the old.
    jax.config.update("jax_enable_compilation_cache", False)
  counts = params.count_params(config_lib.get_preset(FLAGS.preset))
  result = {"device": jax.devices()[0].device_kind, "preset": FLAGS.preset,
            "overrides": FLAGS.override, "batch_size": FLAGS.batch_size,
            "seq_len": FLAGS.seq_len, "active_params": counts["active_params"],
            "total_params": counts["total_params"],
            "dense_bf16_matmul_tflops": _dense_matmul_tflops(),
            "peak_bf16_tflops": (peak_flops() or 0) / 1e12, "runs": []}
  runs = [(backend, False, None) for backend in FLAGS.backends]
  runs += [(FLAGS.backends[0], False, v) for v in _variants()]
  if FLAGS.dense_baseline:  # the dense FFN runs no grouped matmul
    runs.append((FLAGS.backends[0], True, None))
  for backend, dense, variant in runs:
    r = bench(backend, dense, variant)
    result["runs"].append(r)
    print(json.dumps({k: v for k, v in r.items() if k != "profile"}))
  dense_run = next((r for r in result["runs"]
                    if r["dense"] and "error" not in r), None)
  if dense_run:
    result["dense_step_s"] = dense_run["step_s"]
    for r in result["runs"]:
      if not r["dense"] and "error" not in r:
        r["moe_over_dense"] = r["step_s"] / dense_run["step_s"]
  profiles = [r.pop("profile") for r in result["runs"] if "profile" in r]
  B_T = FLAGS.batch_size * FLAGS.seq_len
  print(f"\n{result['device']}: {FLAGS.preset} B={FLAGS.batch_size} "
        f"T={FLAGS.seq_len}; dense matmul {result['dense_bf16_matmul_tflops']:.0f}"
        " TFLOP/s")
  for r in result["runs"]:
    if "error" in r:
      print(f"  {r['label']:>11}: {r['error']}")
    else:
      ratio = (f"  {r['moe_over_dense']:.2f}x the dense step"
               if "moe_over_dense" in r else "")
      waited = B_T / r["step_s_each_waited_for"]
      print(f"  {r['label']:>11}: {r['tokens_per_sec']:>10,.0f} tok/s  "
            f"MFU {r['mfu'] or 0:.1%}  {r['peak_memory_gib']:.1f} GiB"
            f"{ratio}  ({waited:,.0f} tok/s with each step waited for)")
  if profiles:
    result["profile_table"] = train_profile_table.write_markdown(
        profiles, _output_stem())
  if FLAGS.output:
    checkpoint.write_json(FLAGS.output, result)


if __name__ == "__main__":
  cli.run(main)
