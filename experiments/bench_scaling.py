r"""Weak scaling of expert-parallel pretraining on 1, 2 and 4 GPUs of one host.

  NCCL_NVLS_ENABLE=0 python -m experiments.bench_scaling --preset=m2_small --gpus=1,2,4 \
      --compare=capacity=0,chunks=2,all_to_all=ragged,data \
      --out=benchmarks/results/scaling/run.json

The Settings flags (experiments/run_flags.py: --all_to_all,
--moe_capacity_factor, --exchange_chunks, --gmm_backend, ...) say how every
run steps; --ragged_decomposer adds XLA's ragged all-to-all decomposer
(experiments/bench_all_to_all.py measured why; notes and results:
benchmarks/notes/scaling.md, benchmarks/results/scaling/.)

The per-GPU batch stays fixed: n GPUs train on n x batch_per_gpu rows of
random tokens with the mesh expert=n (n = 1: the plain single-device path,
no mesh), AdamW, MTP depth 1, exactly the jitted step of m2jax.train.step.
Runs go one at a time (baseline, largest count, the rest): compile the
sharded init and step, train warmup + timed steps
(benchmarks.timing.time_steps: the mean step of steps run back to back, as
the training loops run them, and beside it the median step with each step
waited for; MFU from m2jax.params.mfu), append to the JSON.
Weak-scaling efficiency = tokens/s/GPU at n over tokens/s/GPU at 1.

Also measured, for the analysis: the exchange checked on the GPUs against
one device (a small model, the exchanges run: float32 with the XLA grouped
matmul, "float32_xla", and bf16 with the gmm backend "auto" picks,
"bf16_auto"), and one ragged all-to-all of a layer's rows timed alone.
"""

import functools
import json
import os
import time

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import exchange
from benchmarks import timing
from benchmarks import train_profile_table
from experiments import cli
from experiments import run_flags
from m2jax import config as config_lib
from m2jax import model, sharding
from m2jax import params as params_lib
from m2jax.data import single_document_batch
from m2jax import settings as settings_lib
from m2jax.settings import Settings
from m2jax.train import checkpoint
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import peak_flops

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "m2_small", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_list("gpus", ["1", "2", "4"], "GPU counts (mesh expert=n).")
flags.DEFINE_list(
    "compare", ["chunks=2", "data"], "Extra runs at the largest count, in "
    "order: chunks=N (each device's tokens in N exchanges), all_to_all=IMPL "
    "(another exchange), capacity=F (another capacity factor; 0: the "
    "worst-case buffer, dropless), data (experts replicated, pure data "
    "parallel).")
flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
flags.DEFINE_integer("batch_per_gpu", 8, "Rows per GPU per step.")
flags.DEFINE_integer("steps", 10, "Timed steps.")
flags.DEFINE_integer("warmup", 3, "Untimed steps first.")
flags.DEFINE_bool("checks", True, "Run the GPU correctness check and the "
                  "all-to-all timing.")
flags.DEFINE_string("out", "benchmarks/results/scaling/run.json",
                    "JSON output.")
flags.DEFINE_integer("time_budget_s", 10**6, "Start no new run after this "
                     "many seconds (the JSON keeps what finished).")
flags.DEFINE_string("profile_dir", None, "Trace --profile_steps more steps "
                    "of every run here (GPU 0's ops) and write the per-op "
                    "JSON and the table by category, collectives apart, "
                    "beside --out (benchmarks/train_profile_table.py).")
flags.DEFINE_integer("profile_steps", 3, "Steps traced (after timing).")
cli.integer_lists("gpus")
# How every run steps (Settings): --all_to_all, --exchange_chunks,
# --gmm_backend, ...; the capacity factor's worst case (0) is n x the
# average rows at m2_small, too much memory at n=4.
run_flags.define(all_to_all="allgather", moe_capacity_factor=1.5)


def _write(result):
  checkpoint.write_json(FLAGS.out, result)


def _runs():
  counts = [int(g) for g in FLAGS.gpus]
  # The baseline and the largest count first: the efficiency that matters.
  counts = sorted(counts, key=lambda c: (c != min(counts), c != max(counts)))
  runs = [dict(name=f"expert={n}" if n > 1 else "1 GPU, no mesh", n=n,
               mesh=f"expert={n}" if n > 1 else None) for n in counts]
  n = max(counts)
  for item in FLAGS.compare:
    kind, _, value = item.partition("=")
    if kind == "chunks" and n > 1 and int(value) > 1:
      runs.append(dict(name=f"expert={n},chunks={value}", n=n,
                       mesh=f"expert={n}", chunks=int(value)))
    elif kind == "all_to_all":
      runs.append(dict(name=f"expert={n},{value}", n=n, mesh=f"expert={n}",
                       all_to_all=value))
    elif kind == "capacity":
      runs.append(dict(name=f"expert={n},capacity={value}", n=n,
                       mesh=f"expert={n}", capacity_factor=float(value)))
    else:
      runs.append(dict(name=f"{item}={n}", n=n, mesh=f"{item}={n}"))
  return runs


def _exchanges(settings):
  """The exchange of every run, then those --compare adds."""
  extra = [item.partition("=")[2] for item in FLAGS.compare
           if item.startswith("all_to_all=")]
  return list(dict.fromkeys([settings.all_to_all] + extra))


def _nonnegative(text: str) -> bool:
  try:
    return float(text) >= 0
  except ValueError:
    return False


def _check_compare():
  """A bad --compare item fails before any work, in one line."""
  for item in FLAGS.compare:
    kind, _, value = item.partition("=")
    if kind == "chunks" and not value.isdigit():
      raise settings_lib.SettingsError(
          f"--compare: {item!r}: chunks=N needs a positive integer")
    if kind == "all_to_all" and value not in settings_lib.ALL_TO_ALLS:
      raise settings_lib.SettingsError(
          f"--compare: {item!r}: all_to_all must be one of "
          f"{settings_lib.ALL_TO_ALLS}")
    if kind == "capacity" and not _nonnegative(value):
      raise settings_lib.SettingsError(
          f"--compare: {item!r}: capacity=F needs a number >= 0")
    if kind not in ("chunks", "all_to_all", "capacity") and (
        value or kind not in ("data", "fsdp", "tensor")):
      raise settings_lib.SettingsError(
          f"--compare: {item!r}: expected chunks=N, all_to_all=IMPL, "
          "capacity=F or a mesh axis (data, fsdp, tensor)")


def _batch(rows, seq_len, vocab, seed):
  rng = np.random.default_rng(seed)
  return single_document_batch(rng.integers(0, vocab, (rows, seq_len)))


def _prepare(run, mcfg, tcfg):
  """Compile the init and train step of one run (called in a thread)."""
  t = time.time()
  devices = jax.devices()[:run["n"]]
  mesh = sharding.make_mesh(run["mesh"], devices) if run["mesh"] else None
  rows = run["n"] * FLAGS.batch_per_gpu
  init = lambda key: state_lib.init_state(mcfg, tcfg, model.init(mcfg, key))
  key = jax.random.key(tcfg.seed)
  abstract = jax.eval_shape(init, key)
  batch = {k: jax.ShapeDtypeStruct((rows, FLAGS.seq_len), jnp.int32)
           for k in ("tokens", "segment_ids", "positions")}
  batch["num_bytes"] = jax.ShapeDtypeStruct((rows,), jnp.int32)
  mcfg = mcfg.replace(settings=mcfg.settings.replace(
      exchange_chunks=run.get("chunks", mcfg.settings.exchange_chunks),
      all_to_all=run.get("all_to_all", mcfg.settings.all_to_all),
      capacity_factor=run.get("capacity_factor",
                              mcfg.settings.capacity_factor)))
  train, _ = step_lib.jit_steps(mcfg, tcfg, mesh=mesh)
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(devices[0])
    shard = lambda tree: jax.tree.map(lambda _: dev, tree)
    init_c = jax.jit(init, out_shardings=shard(abstract))
  else:
    sharding.check_mesh(mcfg, mesh, rows)
    state_sh = state_lib.state_shardings(mcfg, tcfg, mesh)
    init_c = jax.jit(init, out_shardings=state_sh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, state_sh)
    bs = sharding.batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs)
             for k, v in batch.items()}
  init_c = init_c.lower(key).compile()
  train_c = train.lower(abstract, batch).compile()
  mem = train_c.memory_analysis()
  return dict(mesh=mesh, init=init_c, train=train_c, key=key,
              compile_s=round(time.time() - t, 1),
              temp_gib=round(getattr(mem, "temp_size_in_bytes", 0) / 2**30, 2),
              args_gib=round(getattr(mem, "argument_size_in_bytes", 0)
                             / 2**30, 2))


def _measure(run, prep, mcfg, tcfg):
  rows = run["n"] * FLAGS.batch_per_gpu
  batches = [_batch(rows, FLAGS.seq_len, mcfg.vocab_size, s) for s in (1, 2)]
  if prep["mesh"] is not None:
    batches = [sharding.shard_batch(b, prep["mesh"]) for b in batches]
  else:
    batches = [jax.device_put(b, jax.devices()[0]) for b in batches]
  state = prep["init"](prep["key"])
  state, first = prep["train"](state, batches[0])  # the first warm-up step
  loss_first = float(first["loss"])
  # Back to back, as the training loops run steps; then each step waited
  # for (the figure before 2026-11-27, session h: it adds the host's
  # dispatch gap, which grows with the devices a step launches on).
  step_s, state, m = timing.time_steps(
      prep["train"], state, batches[::-1], reps=FLAGS.steps,
      warmup=max(FLAGS.warmup - 1, 0), back_to_back=True)
  waited_s, state, _ = timing.time_steps(
      prep["train"], state, batches[::-1], reps=FLAGS.steps, warmup=0)
  profile = None
  if FLAGS.profile_dir:
    label = run["name"].replace(" ", "_").replace(",", "_")
    state, profile = train_profile_table.capture(
        prep["train"], state, batches, steps=FLAGS.profile_steps,
        trace_dir=os.path.join(FLAGS.profile_dir, label),
        hlo_text=prep["train"].as_text(), label=label, device=0)
    profile["step_ms"] = step_s * 1e3
  tps = rows * FLAGS.seq_len / step_s
  flops = params_lib.flops_per_token(mcfg, FLAGS.seq_len,
                                     mtp_depth=tcfg.mtp_depth)
  mfu = params_lib.mfu(tps, flops, peak_flops(), num_devices=run["n"])
  out = dict(step_ms=round(1e3 * step_s, 1),
             step_ms_each_waited_for=round(1e3 * waited_s, 1),
             tokens_per_s=round(tps),
             tokens_per_s_per_gpu=round(tps / run["n"]),
             mfu=None if mfu is None else round(mfu, 4),
             loss_first=round(loss_first, 4), loss_last=float(m["loss"]),
             dropped_last_step=float(m["moe/dropped"]))
  if profile is not None:
    path = f"{os.path.splitext(FLAGS.out)[0]}.{profile['label']}.ops.json"
    checkpoint.write_json(path, profile)
    out["profile_ops_json"] = path
    out["profile"] = profile
  del state, m
  return out


def _check_exchange(n, impl):
  """Sharded (expert=n, exchange `impl`, dropless) vs one device, small model."""
  out = {}
  for name, over in (("float32_xla", dict(compute_dtype="float32")),
                     ("bf16_auto", dict(compute_dtype="bfloat16",
                                          hidden_size=256,
                                          moe_intermediate_size=256))):
    cfg = config_lib.TINY.replace(num_layers=1, num_experts=8,
                                  settings=Settings(attention="xla"), **over)
    variables = model.init(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, cfg.vocab_size, (2 * n, 64), dtype=np.int32))

    def loss_fn(c, v, t):
      out_ = model.forward(c, v, t, mtp_depth=1)
      return (out_.logits.astype(jnp.float32) ** 2).mean(), out_.routing.load_E

    fn = lambda c: jax.jit(jax.value_and_grad(
        functools.partial(loss_fn, c), has_aux=True))
    (ref, ref_load), ref_g = fn(cfg)(variables, tokens)
    mesh = sharding.make_mesh(f"expert={n}", jax.devices()[:n])
    placed = sharding.place(variables, sharding.variable_shardings(cfg, mesh))
    sharded_cfg = cfg.replace(settings=cfg.settings.replace(all_to_all=impl))
    with sharding.use_mesh(mesh):
      (got, load), g = fn(sharded_cfg)(placed, sharding.shard_batch(
          {"t": tokens}, mesh)["t"])
    rel = max(float(jnp.linalg.norm((a - b).astype(jnp.float32))
                    / (jnp.linalg.norm(a.astype(jnp.float32)) + 1e-30))
              for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)))
    out[name] = dict(loss_rel_err=abs(float(got) - float(ref)) / abs(float(ref)),
                     grad_max_rel_err=rel,
                     load_equal=bool((np.asarray(load) == np.asarray(ref_load))
                                     .all()))
  return out


def main(argv):
  del argv
  if FLAGS.mesh:
    raise sharding.MeshError("--mesh: bench_scaling builds its meshes from "
                             "--gpus (expert=n); leave --mesh out")
  _check_compare()
  _, settings = run_flags.from_flags()
  if FLAGS.profile_dir:
    # A persistent cache's key leaves out the ops' names (their scopes): a
    # step cached before a scope changed would be profiled under the old.
    jax.config.update("jax_enable_compilation_cache", False)
  counts = [int(g) for g in FLAGS.gpus]
  # from_flags saw no mesh: the decomposer for the expert=n runs.
  if run_flags.extend_xla_flags(f"expert={max(counts)}", settings.all_to_all,
                                FLAGS.ragged_decomposer):
    logging.warning("XLA_FLAGS += %s (--noragged_decomposer to leave it out)",
                    run_flags.RAGGED_DECOMPOSER_FLAG)
  mcfg = config_lib.apply_overrides(
      config_lib.get_preset(FLAGS.preset), FLAGS.override).replace(
          settings=settings)
  tcfg = TrainConfig(steps=1000, warmup_steps=10, mtp_depth=1,
                     learning_rate=3e-4)
  runs = _runs()
  dev = jax.devices()[0]
  result = dict(
      what="weak scaling, expert parallel pretraining (random tokens)",
      device=dev.device_kind, device_count=jax.device_count(),
      jax=jax.__version__, preset=FLAGS.preset, override=FLAGS.override,
      seq_len=FLAGS.seq_len, batch_per_gpu=FLAGS.batch_per_gpu,
      tokens_per_gpu_per_step=FLAGS.seq_len * FLAGS.batch_per_gpu,
      capacity_factor=settings.capacity_factor, steps=FLAGS.steps,
      warmup=FLAGS.warmup, optimizer=tcfg.optimizer, mtp_depth=tcfg.mtp_depth,
      exchange_impl=settings.all_to_all, settings=settings.to_dict(),
      xla_flags=os.environ.get("XLA_FLAGS"),
      nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), runs=[])
  t0 = time.time()
  _write(result)
  base, profiles = None, []  # base: the 1-GPU run's record
  for r in runs:  # one at a time: compile, measure, write
    rec = dict(r)
    if time.time() - t0 > FLAGS.time_budget_s:
      rec["error"] = "skipped: --time_budget_s spent"
    else:
      try:
        prep = _prepare(r, mcfg, tcfg)
        rec.update(compile_s=prep["compile_s"], temp_gib=prep["temp_gib"],
                   args_gib=prep["args_gib"])
        print(f"{r['name']}: compiled in {prep['compile_s']} s", flush=True)
        rec.update(_measure(r, prep, mcfg, tcfg))
        prep.clear()
      except Exception as e:  # pylint: disable=broad-except
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    if rec.get("n") == 1 and "tokens_per_s_per_gpu" in rec:
      base = rec
    if base and "tokens_per_s_per_gpu" in rec:
      rec["weak_scaling_efficiency"] = round(
          rec["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
      rec["weak_scaling_efficiency_each_waited_for"] = round(
          base["step_ms_each_waited_for"] / rec["step_ms_each_waited_for"],
          3)
    profile = rec.pop("profile", None)
    if profile is not None:
      profiles.append(profile)
    result["runs"].append(rec)
    _write(result)
    print(json.dumps(rec), flush=True)

  if FLAGS.checks and jax.device_count() > 1:
    try:
      result["exchange_check"] = {
          impl: _check_exchange(max(r["n"] for r in runs), impl)
          for impl in _exchanges(settings)}
    except Exception as e:  # pylint: disable=broad-except
      result["exchange_check"] = f"{type(e).__name__}: {str(e)[:400]}"
    _write(result)
  if FLAGS.checks and jax.device_count() > 1:
    n = max(r["n"] for r in runs)
    rows = FLAGS.batch_per_gpu * FLAGS.seq_len * mcfg.num_experts_per_tok
    try:
      result["all_to_all"] = exchange.time_exchange(n, rows, mcfg.hidden_size)
      # Forward: dispatch + return; backward: the same two again.
      layers = mcfg.num_layers + 1  # + the MTP block
      result["all_to_all"]["per_step_ms_estimate"] = round(
          4 * layers * result["all_to_all"]["ms"], 1)
    except Exception as e:  # pylint: disable=broad-except
      result["all_to_all"] = f"{type(e).__name__}: {str(e)[:400]}"
  if profiles:  # GPU 0's ops
    result["profile_table"] = train_profile_table.write_markdown(
        profiles, os.path.splitext(FLAGS.out)[0])
  result["total_s"] = round(time.time() - t0, 1)
  _write(result)

  print(f"\n{result['device']} x{result['device_count']}, {FLAGS.preset}, "
        f"{result['tokens_per_gpu_per_step']} tokens/GPU/step")
  print(f"{'run':>18} {'GPUs':>4} {'step ms':>8} {'tok/s/GPU':>10} "
        f"{'eff':>6} {'MFU':>6} {'dropped':>7} {'loss':>7}  (each step "
        f"waited for: step ms, eff)")
  for rec in result["runs"]:
    if "error" in rec:
      print(f"{rec['name']:>18} {rec['n']:>4} ERROR {rec['error'][:300]}")
      continue
    print(f"{rec['name']:>18} {rec['n']:>4} {rec['step_ms']:>8} "
          f"{rec['tokens_per_s_per_gpu']:>10} "
          f"{rec.get('weak_scaling_efficiency', float('nan')):>6} "
          f"{rec['mfu'] or float('nan'):>6} {rec['dropped_last_step']:>7.0f} "
          f"{rec['loss_last']:>7.3f}  ({rec['step_ms_each_waited_for']}, "
          f"{rec.get('weak_scaling_efficiency_each_waited_for')})")
  print("exchange check:", json.dumps(result.get("exchange_check")))
  print("all-to-all:", json.dumps(result.get("all_to_all")))


if __name__ == "__main__":
  cli.run(main)
