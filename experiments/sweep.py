r"""Run an ablation sweep (resumable) and write its report.

  python -m experiments.sweep --grid=attention --preset=tiny --steps=300 \
      --seeds=0,1 --sweep_dir=runs/sweep_attention
  python -m experiments.sweep --grid=experts ...   # mtp, experts, gating
  python -m experiments.sweep --grid=mtp --equal_compute ...  # equal FLOPs
  python -m experiments.sweep --grid=attention --window=32 \
      --mqar_fraction=0.5 --mqar_gaps=0,64 ...   # MQAR inside/beyond SWA

--parallel trains the seeds of each arm as one vmapped program (one
compile, several small models filling the GPU); the results are the same.
Rerunning the same command skips finished runs and resumes a killed (or
Ctrl-C'd) one from its checkpoint. Commands with different --variants may
run at once on one --sweep_dir (an arm per GPU). --variants and --seeds choose what runs
now; results.json and the report always cover every finished run of
--sweep_dir (python -m experiments.report rewrites the report alone).
How the steps run is every training script's Settings flags
(experiments/run_flags.py), e.g. --gmm_backend=xla where a vmapped Mosaic
grouped matmul fails; the sweep trains on one device (no --mesh).
"""

from absl import flags, logging

from experiments import cli, run_flags
from m2jax import config as config_lib
from m2jax import report, sweep
from m2jax.errors import UserError

FLAGS = flags.FLAGS
run_flags.define()
flags.DEFINE_enum("grid", "attention", list(sweep.GRIDS), "Which ablation.")
flags.DEFINE_string("preset", "tiny", f"One of {sorted(config_lib.PRESETS)}.")
flags.DEFINE_multi_string("override", [], "Base ModelConfig FIELD=VALUE.")
flags.DEFINE_string("sweep_dir", None, "Sweep directory (default runs/sweep_GRID).")
flags.DEFINE_list("seeds", ["0", "1"], "Seeds per variant.")
flags.DEFINE_integer("steps", 200, "Steps per run (equal tokens for all "
                     "arms; with --equal_compute, the first arm's steps).")
flags.DEFINE_bool("equal_compute", False, "Equal training FLOPs instead of "
                  "equal tokens: each arm's steps are --steps scaled by the "
                  "first arm's FLOPs per token over its own (the mtp grid "
                  "at equal compute).")
flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("window", 256, "Sliding-window size (attention grid).")
flags.DEFINE_string("data", "synthetic",
                    "'synthetic' (task documents), 'stdlib', or a path/glob.")
flags.DEFINE_integer("train_documents", 4000, "Synthetic training documents.")
flags.DEFINE_float("drill_fraction", 0.0, "Fraction of the synthetic "
                   "training documents that are retrieval drills (every fact "
                   "asked for; m2jax.eval.tasks.DRILLS).")
flags.DEFINE_list("variants", [], "Arms of the grid to run now (default: "
                  "all); the report covers every finished arm.")
flags.DEFINE_list("eval_lengths", ["128", "256", "512", "960"],
                  "Context lengths of the long-context tasks.")
flags.DEFINE_integer("examples_per_point", 16, "Examples per task and length.")
flags.DEFINE_bool("parallel", False, "Train the runs that can share a program "
                  "(an arm's seeds; arms differing only in learning rate) as "
                  "one vmapped program (m2jax.train.multi): same results, "
                  "several small models per GPU.")
flags.DEFINE_float("mqar_fraction", 0.0, "Fraction of the synthetic training "
                   "documents that are MQAR sequences (m2jax.eval.mqar) at "
                   "gaps 0..max(--mqar_gaps).")
flags.DEFINE_integer("mqar_pairs", 8, "MQAR key-value pairs (all queried).")
flags.DEFINE_list("mqar_gaps", [], "Gaps (filler between pairs and queries) "
                  "MQAR is scored at: some inside the sliding window, some "
                  "beyond num_layers * (window - 1).")
flags.DEFINE_integer("mqar_examples", 64, "Held-out MQAR sequences per gap.")
cli.integer_lists("seeds", "eval_lengths", "mqar_gaps")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mesh, settings = run_flags.from_flags()
  if mesh is not None:
    raise UserError(f"--mesh={FLAGS.mesh}: a sweep trains each run on one "
                    "device (--parallel batches runs on it); leave --mesh out")
  base = config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    FLAGS.override).replace(settings=settings)
  cfg = sweep.SweepConfig(
      grid=FLAGS.grid, seeds=tuple(int(s) for s in FLAGS.seeds),
      steps=FLAGS.steps, seq_len=FLAGS.seq_len, batch_size=FLAGS.batch_size,
      learning_rate=FLAGS.learning_rate, window=FLAGS.window, data=FLAGS.data,
      train_documents=FLAGS.train_documents,
      drill_fraction=FLAGS.drill_fraction, variants=tuple(FLAGS.variants),
      eval_lengths=tuple(int(n) for n in FLAGS.eval_lengths),
      examples_per_point=FLAGS.examples_per_point, parallel=FLAGS.parallel,
      mqar_fraction=FLAGS.mqar_fraction, mqar_pairs=FLAGS.mqar_pairs,
      mqar_gaps=tuple(int(g) for g in FLAGS.mqar_gaps),
      mqar_examples=FLAGS.mqar_examples, equal_compute=FLAGS.equal_compute)
  sweep_dir = FLAGS.sweep_dir or f"runs/sweep_{FLAGS.grid}"
  results = sweep.run_sweep(base, cfg, sweep_dir)
  paths = report.write_report(results, sweep_dir)
  print(open(paths["report"], encoding="utf-8").read())
  print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
  cli.run(main)
