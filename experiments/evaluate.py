r"""Evaluate a pretraining run: validation loss / bits per byte and the
synthetic long-context tasks at several context lengths.

  python -m experiments.evaluate --workdir=runs/demo
  python -m experiments.evaluate --workdir=runs/demo --lengths=128,256 \
      --step=800                      # an older checkpoint than the newest

Every flag is checked before any work: a length outside [128 (the shortest
prompt every task fits in), the run's max_position_embeddings] or a step
the run has no checkpoint of is a one-line error.
"""

import json
import os

from absl import flags, logging

from experiments import cli
from m2jax.config import ConfigError
from m2jax.eval import TASKS, evaluate_tasks
from m2jax.eval.runs import checkpoint_steps, load_configs, load_run
from m2jax.eval.tasks import MIN_LENGTH
from m2jax.errors import MissingPathError
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import evaluate

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A pretrain --workdir.")
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: "
                     "the newest).", lower_bound=0)
flags.DEFINE_list("lengths", ["128", "256", "512"], "Task context lengths "
                  f"in characters, each >= {MIN_LENGTH} and <= the run's "
                  "max_position_embeddings.")
flags.DEFINE_list("tasks", list(TASKS), "Tasks to score.")
flags.DEFINE_integer("examples_per_point", 16, "Examples per task and length.",
                     lower_bound=1)
flags.DEFINE_integer("val_batches", 16, "Validation batches for the loss "
                     "(0: no validation loss).", lower_bound=0)
flags.DEFINE_string("output", None, "JSON output (default WORKDIR/eval.json).")
flags.mark_flag_as_required("workdir")
flags.register_validator("tasks", lambda tasks: set(tasks) <= set(TASKS),
                         f"each must be one of {TASKS}")
cli.integer_lists("lengths")


def _long_enough(items) -> bool:
  try:
    return all(int(n) >= MIN_LENGTH for n in items)
  except ValueError:
    return True  # not integers: cli.integer_lists says so


flags.register_validator(
    "lengths", _long_enough, f"each length must be >= {MIN_LENGTH} "
    "characters (the shortest prompt every task fits in)")


def _check_flags(workdir: str) -> list[int]:
  """The lengths, after the checks that need the run (its config.json and
  checkpoint list only: nothing is loaded or computed yet)."""
  mcfg, _, _ = load_configs(workdir)
  lengths = [int(n) for n in FLAGS.lengths]
  too_long = [n for n in lengths if n > mcfg.max_position_embeddings]
  if too_long:
    raise ConfigError(
        f"--lengths: {too_long} above the run's max_position_embeddings "
        f"({mcfg.max_position_embeddings}); allowed: {MIN_LENGTH} to "
        f"{mcfg.max_position_embeddings}")
  steps = checkpoint_steps(workdir)
  if not steps:
    raise MissingPathError(f"--workdir: {workdir} holds no checkpoint yet")
  if FLAGS.step is not None and FLAGS.step not in steps:
    raise MissingPathError(
        f"--step={FLAGS.step}: {workdir} has no checkpoint of that step; "
        f"its steps: {', '.join(map(str, steps))}")
  return lengths


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  lengths = _check_flags(FLAGS.workdir)
  mcfg, dcfg, tokenizer, variables, step = load_run(FLAGS.workdir, FLAGS.step)
  result = {"workdir": FLAGS.workdir, "step": step}
  if FLAGS.val_batches:
    _, eval_fn = step_lib.jit_steps(mcfg, TrainConfig(steps=1))
    state = state_lib.TrainState(step, variables["params"], None,
                                 variables.get("expert_bias", {}))
    result.update(evaluate(eval_fn, state, dcfg, tokenizer, FLAGS.val_batches))
  result["tasks"] = evaluate_tasks(
      mcfg, variables, tokenizer, lengths=lengths, tasks=FLAGS.tasks,
      examples_per_point=FLAGS.examples_per_point)
  path = FLAGS.output or os.path.join(FLAGS.workdir, "eval.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
