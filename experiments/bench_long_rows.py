r"""Long-row training: tokens/s and memory of one row of 32K to 131K tokens.

  python -m experiments.bench_long_rows --preset=m2_small --batch_size=1 \
      --seq_len=32768,65536,131072 --remat \
      --output=benchmarks/results/long_rows_h100.json

For each length (ascending), the jitted train step (forward, backward,
AdamW, bias update) of `--batch_size` rows packed with `--documents` equal
documents each, timed after warm-up as the median over --steps steps
(benchmarks.timing.time_steps). Attention runs without a [T, T] mask
(m2jax.model.attention.attention_impl: the tree kernels on a GPU, blockwise
XLA flash attention for windows and off a GPU) and lm_head + cross-entropy
run --loss_chunk positions at a time (m2jax.train.losses). Each length
reports the compiled step's memory (XLA's buffer assignment: arguments +
outputs + temporaries - donated aliases) and, on a GPU, the process's peak
bytes in use so far (a running maximum: lengths run in ascending order, so
it is the current length's). A length that runs out of memory is recorded
and the next one tried. --compile_only stops after the memory analysis
(no device run: the memory a length needs, on any host).

Settings flags are the training scripts' (experiments/run_flags.py), with
--remat on by default: at 131,072 tokens the per-layer MoE activations
(T x top_k rows of the expert matmuls) do not fit 80 GB for 12 layers.
--mesh=sequence=N splits every row over N devices (context parallelism,
m2jax.model.context_parallel: the paper's 196,608-token stage on several
GPUs); MFU is then per device and the peak memory the largest device's.
Runs on a CPU at tiny size:
  python -m experiments.bench_long_rows --preset=tiny --seq_len=2048,4096 \
      --steps=1 --warmup=1
"""

import json
import time

from absl import flags, logging
import jax
import numpy as np

from benchmarks import timing
from experiments import cli, run_flags
from m2jax import config as config_lib
from m2jax import model, params, sharding
from m2jax.train import checkpoint
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import peak_flops

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "m2_small", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_integer("batch_size", 1, "Rows per batch.")
flags.DEFINE_list("seq_len", ["32768", "65536", "131072"], "Row lengths.")
flags.DEFINE_integer("documents", 1, "Equal documents packed in each row.")
flags.DEFINE_integer("steps", 5, "Timed steps per length.")
flags.DEFINE_integer("warmup", 2, "Untimed steps before them.")
flags.DEFINE_bool("compile_only", False, "Report the compiled step's memory "
                  "without running it.")
flags.DEFINE_string("output", None, "JSON file for the results.")
run_flags.define(remat=True)


def packed_batch(rng, batch_size: int, seq_len: int, documents: int,
                 vocab_size: int) -> dict:
  """Random tokens in rows of `documents` packed documents of equal length
  (the last takes the remainder): segment ids 1.., positions restarting."""
  length = seq_len // documents
  doc = np.minimum(np.arange(seq_len) // length, documents - 1)
  starts = np.searchsorted(doc, doc)  # the first index of each document
  row = lambda x: np.tile(x.astype(np.int32), (batch_size, 1))
  return {"tokens": rng.integers(0, vocab_size, (batch_size, seq_len),
                                 dtype=np.int32),
          "segment_ids": row(doc + 1),
          "positions": row(np.arange(seq_len) - starts),
          "num_bytes": np.full((batch_size,), seq_len, np.int32)}


def _memory(compiled) -> dict:
  """The compiled step's buffer sizes in GiB (XLA's memory analysis)."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  gib = lambda n: n / 2**30
  total = (m.argument_size_in_bytes + m.output_size_in_bytes
           + m.temp_size_in_bytes - m.alias_size_in_bytes)
  return {"step_memory_gib": gib(total),
          "temp_gib": gib(m.temp_size_in_bytes),
          "arguments_gib": gib(m.argument_size_in_bytes)}


def bench(settings, seq_len: int, mesh=None) -> dict:
  base = config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    FLAGS.override)
  mcfg = base.replace(settings=settings, max_position_embeddings=max(
      base.max_position_embeddings, seq_len))
  tcfg = TrainConfig(steps=1000, mtp_depth=min(1, mcfg.num_mtp_modules))
  B, T = FLAGS.batch_size, seq_len
  rng = np.random.default_rng(0)
  host = [packed_batch(rng, B, T, FLAGS.documents, mcfg.vocab_size)
          for _ in range(2)]
  result = {"seq_len": T, "batch_size": B, "documents": FLAGS.documents}
  make_state = lambda: state_lib.init_state(
      mcfg, tcfg, model.init(mcfg, jax.random.key(0)))
  if mesh is None:
    batches = [jax.device_put(b) for b in host]
  else:
    sharding.check_mesh(mcfg, mesh, B, seq_len=T)
    batches = [sharding.shard_batch(b, mesh) for b in host]
    make_state = jax.jit(make_state, out_shardings=state_lib.state_shardings(
        mcfg, tcfg, mesh))
  try:
    # Compiling needs only the state's shapes (no parameters in memory).
    state = (jax.eval_shape(make_state) if FLAGS.compile_only
             else make_state())
    train, _ = step_lib.jit_steps(mcfg, tcfg, mesh=mesh)
    t = time.perf_counter()
    compiled = train.lower(state, batches[0]).compile()
    result["compile_s"] = time.perf_counter() - t
    result.update(_memory(compiled))
    print(f"T={T}: compiled in {result['compile_s']:.1f} s", flush=True)
    if FLAGS.compile_only:
      return result
    step_s, _, metrics = timing.time_steps(compiled, state, batches,
                                           reps=FLAGS.steps,
                                           warmup=FLAGS.warmup)
  except Exception as e:  # pylint: disable=broad-except
    if not timing.out_of_memory(e):
      raise
    return dict(result, error=f"out of memory: {str(e).splitlines()[0][:300]}")
  tps = B * T / step_s
  fpt = params.flops_per_token(mcfg, T // FLAGS.documents,
                               mtp_depth=tcfg.mtp_depth)
  devices = jax.devices()[:1] if mesh is None else mesh.devices.flat
  peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0)
             for d in devices)
  return dict(result, step_s=step_s, tokens_per_sec=tps,
              mfu=params.mfu(tps, fpt, peak_flops(),
                             num_devices=1 if mesh is None else mesh.size),
              peak_memory_gib=peak / 2**30,
              loss=float(metrics["loss"]))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mesh, settings = run_flags.from_flags()
  lengths = sorted(int(n) for n in FLAGS.seq_len)
  result = {"device": jax.devices()[0].device_kind, "preset": FLAGS.preset,
            "overrides": FLAGS.override, "settings": settings.to_dict(),
            "runs": []}
  if mesh is not None:
    result["mesh"] = sharding.format_mesh(mesh)
  for T in lengths:
    r = bench(settings, T, mesh)
    result["runs"].append(r)
    print(json.dumps(r), flush=True)
  print(f"\n{result['device']}: {FLAGS.preset} B={FLAGS.batch_size}, "
        f"{FLAGS.documents} document(s) a row, remat={settings.remat}, "
        f"attention={settings.attention}, loss_chunk={settings.loss_chunk}")
  for r in result["runs"]:
    mem = r.get("step_memory_gib")
    mem = "" if mem is None else f"  step {mem:.1f} GiB"
    if "error" in r:
      print(f"  T={r['seq_len']:>7}: {r['error']}{mem}")
    elif "tokens_per_sec" not in r:
      print(f"  T={r['seq_len']:>7}: compiled{mem}")
    else:
      mfu = "" if r["mfu"] is None else f"  MFU {r['mfu']:.1%}"
      print(f"  T={r['seq_len']:>7}: {r['tokens_per_sec']:>10,.0f} tok/s"
            f"{mfu}{mem}  peak {r['peak_memory_gib']:.1f} GiB")
  if FLAGS.output:
    checkpoint.write_json(FLAGS.output, result)


if __name__ == "__main__":
  cli.run(main)
