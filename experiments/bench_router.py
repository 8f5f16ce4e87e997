r"""Router balance over training: bias update rules and rates vs softmax + aux.

  python -m experiments.bench_router --preset=m2_small --steps=2000 \
      --batch=8 --seq_len=512 --gmm_backend=mosaic --max_seconds=540 \
      --out=benchmarks/results/router/m2_small_h100.json
  python -m experiments.bench_router --preset=tiny --steps=5   # CPU check

Each (seed, arm) run trains a fresh model (init from the seed) on the same
batches of --data with the jitted pieces of m2jax.train.step (gradients,
then apply_gradients: the optimizer and the expert-bias update), one arm
per --arm "NAME FIELD=VALUE ..." of ModelConfig overrides on top of
--preset and --override; "train.FIELD=VALUE" overrides the TrainConfig
(e.g. train.router_lr_scale=0.1). The default arms: the paper's sign rule
at 1e-3 and the proportional rule at 1e-2, both with the router gates at the
full learning rate (router_lr_scale 1.0, the earlier defaults); the
proportional rule with the gates at 0.1x (m2_small's default now); and
softmax gating with the sequence-wise aux loss at 0.01, no bias and the
full learning rate (m2jax.sweep's "gating" baseline).

Per step it records the next-token loss and the expert-load max violation
(max load / mean load - 1; 7.0 is the ceiling at top-8 of 64 experts) of
the step's own batch: the mean over the main layers (bench_optimizers'
number), the worst main layer, the worst MTP block, and the mean over the
main layers of the load summed over the last --window steps (the same
router seen over more tokens: a batch of N tokens has a noise floor of
roughly 2.4 sqrt(E / (K N)) from sampling alone). At the end: the tail
means (--last steps), the validation loss, and the final router's loads on
--eval_batches batches of held-out rows spread over the validation split,
everything frozen: their summed violation (`violation_val`: the balance
over a large mixed batch, which the per-step number of an 8-row batch
cannot show), its mean per batch, and the summed violation of the split's
first batches (consecutive rows of a few files) for contrast. Runs go seed by seed, the
JSON is rewritten after each, and no run starts after --max_seconds;
--resume keeps the runs --out already holds.

--cpu_gather_experts (CPU only) computes the experts' grouped matmul by a
per-row gather of the expert weights instead of XLA's ragged_dot, which the
CPU backend densifies over all experts (64x the work at 64 experts): same
values, and what makes an m2_small-shaped router trainable on a laptop.
"""

import time

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid
from experiments import cli, run_flags
from kernels import gmm_ref
from m2jax import config as config_lib
from m2jax.data import make_dataset, make_iterator
from m2jax.errors import UserError
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import OPTIMIZERS, TrainConfig
from m2jax.train.loop import evaluate

FLAGS = flags.FLAGS
DEFAULT_ARMS = [
    "sign_1e-3_r1 bias_update=sign bias_update_rate=1e-3 "
    "train.router_lr_scale=1.0",
    "prop_1e-2_r1 bias_update=proportional bias_update_rate=1e-2 "
    "train.router_lr_scale=1.0",
    "prop_1e-2_r0.1 bias_update=proportional bias_update_rate=1e-2 "
    "train.router_lr_scale=0.1",
    "softmax_aux gating=softmax use_routing_bias=false aux_loss_coef=0.01 "
    "train.router_lr_scale=1.0",
]
flags.DEFINE_string("preset", "m2_small", "Model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE (every "
                          "arm).")
flags.DEFINE_multi_string("arm", DEFAULT_ARMS, "An arm: 'NAME FIELD=VALUE "
                          "...' (ModelConfig overrides), repeatable.")
flags.DEFINE_list("seeds", ["0"], "Seeds (init; data order is fixed).")
flags.DEFINE_enum("optimizer", "adamw", list(OPTIMIZERS), "Optimizer.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate (the hidden matrices' "
                   "under muon, muonsphere and sso).")
flags.DEFINE_float("adam_lr", 3e-3, "Peak learning rate of the AdamW kinds "
                   "(router, embeddings, norms) under the other optimizers.")
flags.DEFINE_integer("steps", 2000, "Optimizer steps per run.")
flags.DEFINE_integer("warmup_steps", None, "Warm-up steps (default: "
                     "steps // 20, at least 1).")
flags.DEFINE_integer("batch", 8, "Rows per batch.")
flags.DEFINE_integer("seq_len", 512, "Tokens per row.")
flags.DEFINE_string("data", "stdlib", "Training documents (pretrain's "
                    "--data).")
flags.DEFINE_integer("window", 10, "Steps whose loads are summed for the "
                     "windowed violation.")
flags.DEFINE_integer("last", 50, "Steps averaged for the final values.")
flags.DEFINE_integer("eval_batches", 8, "Validation batches at the end.")
flags.DEFINE_float("max_seconds", 1e9, "Start no run after this many "
                   "seconds (the JSON keeps what finished).")
flags.DEFINE_bool("resume", False, "Keep the runs --out already holds (same "
                  "comparison) and skip them.")
flags.DEFINE_bool("cpu_gather_experts", False, "CPU: grouped matmul by a "
                  "per-row gather (module docstring).")
flags.DEFINE_string("out", "benchmarks/results/router/run.json",
                    "JSON output, rewritten after every run.")
cli.integer_lists("seeds")
run_flags.define()

SAME = ("preset", "overrides", "optimizer", "lr", "batch", "seq_len",
        "steps")
CURVES = ("ce", "violation", "violation_worst", "violation_mtp",
          "violation_window", "bias_std")


def gather_gmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """ragged_dot's values ([M, K] x [G, K, N], rows past the groups zero) by
  gathering each row's expert weight: O(M K N) work on CPU."""
  M, G = lhs.shape[0], rhs.shape[0]
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  ids = jnp.searchsorted(ends, jnp.arange(M, dtype=jnp.int32), side="right")
  w_MxKxN = jnp.take(rhs, jnp.minimum(ids, G - 1), axis=0)
  out = jnp.einsum("mk,mkn->mn", lhs, w_MxKxN,
                   preferred_element_type=preferred_element_type)
  return jnp.where((ids < G)[:, None], out, 0).astype(out.dtype)


def parse_arm(text: str, base) -> tuple[str, object]:
  """(name, ModelConfig) of one --arm (its train.FIELD=VALUE left out)."""
  name, *overrides = text.split()
  if not name or "=" in name:
    raise UserError(f"--arm {text!r}: expected 'NAME FIELD=VALUE ...'")
  return name, config_lib.apply_overrides(
      base, [o for o in overrides if not o.startswith("train.")])


def arm_train_config(text: str, tcfg: TrainConfig) -> TrainConfig:
  """`tcfg` with the arm's train.FIELD=VALUE overrides (TrainConfig)."""
  return config_lib.apply_overrides(
      tcfg, [o[len("train."):] for o in text.split()[1:]
             if o.startswith("train.")])


def violation(load_LxE):
  """max / mean - 1 of each row (router) of a load [L, E]."""
  load = np.asarray(load_LxE, np.float64)
  return load.max(-1) / np.maximum(load.mean(-1), 1e-9) - 1.0


def _train_step(mcfg, tcfg):
  """train_step's two halves, returning the loads the bias update read."""

  def step(state, batch):
    metrics, out, grads = step_lib.gradients(state, batch, model_config=mcfg,
                                             train_config=tcfg)
    state, more = step_lib.apply_gradients(state, grads, out,
                                           model_config=mcfg,
                                           train_config=tcfg)
    mtp = None if out.mtp_routing is None else out.mtp_routing.load_E
    load = None if out.routing is None else out.routing.load_E
    return state, dict(metrics, **more), load, mtp

  return jax.jit(step, donate_argnums=0)


def spread_rows(dcfg, tokenizer, batches: int) -> list[dict]:
  """`batches` batches of validation rows taken evenly across the whole
  split. The split is packed in key order, so its consecutive rows are
  chunks of a few files; rows spread over it are many files."""
  rows = []
  for batch in make_dataset(dcfg, tokenizer, "validation"):
    batch = {k: np.asarray(v) for k, v in batch.items()}
    rows += [{k: v[r] for k, v in batch.items()}
             for r in range(len(batch["row_ids"])) if batch["row_ids"][r] >= 0]
  n = batches * dcfg.batch_size
  if len(rows) < n:
    raise UserError(f"--eval_batches={batches}: the validation split has "
                    f"{len(rows)} rows, fewer than {n}")
  picked = [rows[i] for i in np.linspace(0, len(rows) - 1, n).astype(int)]
  return [{k: np.stack([r[k] for r in picked[i:i + dcfg.batch_size]])
           for k in picked[0]}
          for i in range(0, n, dcfg.batch_size)]


def held_out_loads(mcfg, tcfg, state, dcfg, tokenizer, batches: int) -> dict:
  """The final router on held-out text, parameters and biases frozen.

  A training step's batch holds a few documents, so experts that specialise
  in their content are overloaded on that step even when the router is
  balanced over the data; the per-step violation mixes that with imbalance.
  Here: the loads of --eval_batches batches of validation rows spread over
  the whole split, summed (`violation_val`: what a large, mixed global
  batch sees) and batch by batch, and for contrast the summed loads of the
  split's first --eval_batches batches (`violation_val_consecutive`:
  consecutive rows, a few files).
  """

  def loads(state, batch):
    _, out, _ = step_lib.gradients(state, batch, model_config=mcfg,
                                   train_config=tcfg)
    return out.routing.load_E  # the gradients are dead code: never computed

  loads = jax.jit(loads)
  per_batch = [np.asarray(loads(state, b), np.float64)
               for b in spread_rows(dcfg, tokenizer, batches)]
  first = []
  for i, batch in enumerate(make_dataset(dcfg, tokenizer, "validation")):
    if i >= batches:
      break
    batch = {k: np.asarray(v) for k, v in batch.items()}
    first.append(np.asarray(loads(state, batch), np.float64))
  summed = violation(sum(per_batch))
  return {"violation_val": float(summed.mean()),
          "violation_val_worst": float(summed.max()),
          "violation_val_batch": float(np.mean([violation(l).mean()
                                                for l in per_batch])),
          "violation_val_consecutive": float(violation(sum(first)).mean()),
          "val_tokens": int(sum(l[0].sum() for l in per_batch)
                            // mcfg.num_experts_per_tok)}


def _bias_std(expert_bias) -> float:
  leaves = [np.asarray(b) for b in jax.tree.leaves(expert_bias)]
  return float(np.mean([b.std() for b in leaves])) if leaves else 0.0


def one_run(name, mcfg, dcfg, tokenizer, seed: int, arm: str = "") -> dict:
  """Train one arm from one seed; its row of the JSON."""
  tcfg = arm_train_config(arm, grid.train_config(
      mcfg, steps=FLAGS.steps, seed=seed, optimizer=FLAGS.optimizer,
      lr=FLAGS.lr, adam_lr=FLAGS.adam_lr, warmup_steps=FLAGS.warmup_steps))
  state = state_lib.create_state(mcfg, tcfg)
  train = _train_step(mcfg, tcfg)
  _, eval_fn = step_lib.jit_steps(mcfg, tcfg)
  batches = make_iterator(dcfg, tokenizer, "train")
  curves = {k: [] for k in CURVES}
  recent = []
  start = time.perf_counter()
  for _ in range(FLAGS.steps):
    batch = {k: np.asarray(v) for k, v in next(batches).items()}
    state, metrics, load, mtp_load = train(state, batch)
    curves["ce"].append(float(metrics["ce"]))
    if load is None:
      continue
    v = violation(load)
    recent = (recent + [np.asarray(load, np.float64)])[-FLAGS.window:]
    curves["violation"].append(float(v.mean()))
    curves["violation_worst"].append(float(v.max()))
    curves["violation_mtp"].append(
        float(violation(mtp_load).max()) if mtp_load is not None else 0.0)
    curves["violation_window"].append(float(violation(sum(recent)).mean()))
    curves["bias_std"].append(_bias_std(state.expert_bias))
  seconds = time.perf_counter() - start
  batches.close()
  val = evaluate(eval_fn, state, dcfg, tokenizer, FLAGS.eval_batches)
  if curves["violation"]:
    val.update(held_out_loads(mcfg, tcfg, state, dcfg, tokenizer,
                              FLAGS.eval_batches))
  tail = lambda k: (float(np.mean(curves[k][-FLAGS.last:])) if curves[k]
                    else float("nan"))
  return {"arm": name, "seed": seed, "final_ce": tail("ce"),
          **{k: v for k, v in val.items() if k != "val_bpb"},
          **{f"{k}_final": tail(k) for k in CURVES[1:]},
          "violation_max_last": (float(np.max(curves["violation"]
                                              [-FLAGS.last:]))
                                 if curves["violation"] else float("nan")),
          "seconds": seconds, "curves": curves}


def summarize(runs) -> dict:
  """{arm: mean and std over its seeds of the final values}."""
  keys = ("final_ce", "val_loss", "violation_final", "violation_worst_final",
          "violation_window_final", "violation_mtp_final", "violation_val",
          "violation_val_worst")
  out = {}
  for name in dict.fromkeys(r["arm"] for r in runs):
    done = [r for r in runs if r["arm"] == name and "error" not in r]
    if done:
      out[name] = {"seeds": len(done)}
      for k in keys:
        values = [r[k] for r in done if k in r]
        if not values:
          continue
        out[name][k] = float(np.mean(values))
        out[name][k + "_std"] = float(np.std(values))
  return out


def _table(summary) -> str:
  rows = [f"{'arm':>14} {'seeds':>5} {'ce':>7} {'val':>7} {'viol':>6} "
          f"{'worst':>6} {'window':>6} {'mtp':>6} {'heldout':>7} "
          f"{'ho.worst':>8}"]
  for name, s in summary.items():
    rows.append(f"{name:>14} {s['seeds']:>5} {s['final_ce']:>7.4f} "
                f"{s['val_loss']:>7.4f} {s['violation_final']:>6.3f} "
                f"{s['violation_worst_final']:>6.3f} "
                f"{s['violation_window_final']:>6.3f} "
                f"{s['violation_mtp_final']:>6.3f} "
                f"{s.get('violation_val', float('nan')):>7.3f} "
                f"{s.get('violation_val_worst', float('nan')):>8.3f}")
  return "\n".join(rows)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  mesh, settings = run_flags.from_flags()
  if mesh is not None:
    raise UserError("--mesh: bench_router runs on one device")
  if FLAGS.cpu_gather_experts:
    if jax.default_backend() != "cpu":
      raise UserError("--cpu_gather_experts: only for the CPU backend")
    gmm_ref.gmm_ref = gather_gmm
  base = config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    FLAGS.override).replace(settings=settings)
  arms = [parse_arm(text, base) for text in FLAGS.arm]
  for text in FLAGS.arm:  # a bad train.FIELD fails now, not after a run
    arm_train_config(text, TrainConfig())
  if len({name for name, _ in arms}) != len(arms):
    raise UserError(f"--arm: names must differ, got {FLAGS.arm}")
  dcfg, tokenizer = grid.data(FLAGS.data, FLAGS.seq_len, FLAGS.batch)
  texts = dict(zip((name for name, _ in arms), FLAGS.arm))
  result = {"device": jax.devices()[0].device_kind, "preset": FLAGS.preset,
            "overrides": FLAGS.override, "optimizer": FLAGS.optimizer,
            "lr": FLAGS.lr, "batch": FLAGS.batch, "seq_len": FLAGS.seq_len,
            "steps": FLAGS.steps, "window": FLAGS.window,
            "arms": texts,
            "runs": []}
  old = grid.previous(FLAGS.out, result, SAME) if FLAGS.resume else None
  if old:
    result["runs"] = [r for r in old["runs"] if "error" not in r]
    result["arms"] = dict(old.get("arms", {}), **result["arms"])
  done = {(r["arm"], r["seed"]) for r in result["runs"]}
  configs = dict(arms)
  plan = [{"arm": name, "seed": seed} for seed in (int(s) for s in FLAGS.seeds)
          for name, _ in arms if (name, seed) not in done]
  grid.run_all(plan, lambda r: one_run(r["arm"], configs[r["arm"]], dcfg,
                                       tokenizer, r["seed"],
                                       texts[r["arm"]]),
               result, out=FLAGS.out, summarize=summarize, start=start,
               max_seconds=FLAGS.max_seconds)
  print(f"\n{result['device']}: {FLAGS.preset} {FLAGS.override} "
        f"B={FLAGS.batch} T={FLAGS.seq_len}, {FLAGS.steps} steps, "
        f"{FLAGS.optimizer}")
  print(_table(result["summary"]))


if __name__ == "__main__":
  cli.run(main)
