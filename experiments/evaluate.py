"""Evaluate a pretraining run: validation loss / bits per byte and the
synthetic long-context tasks at several context lengths.

  python -m experiments.evaluate --workdir=runs/demo --lengths=64,128,256
"""

import json
import os

from absl import flags, logging

from experiments import cli
from m2jax.eval import TASKS, evaluate_tasks
from m2jax.eval.runs import load_run
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import evaluate

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A pretrain --workdir.")
flags.DEFINE_list("lengths", ["64", "128", "256"], "Task context lengths.")
flags.DEFINE_list("tasks", list(TASKS), "Tasks to score.")
flags.DEFINE_integer("examples_per_point", 16, "Examples per task and length.")
flags.DEFINE_integer("val_batches", 16, "Validation batches for the loss.")
flags.DEFINE_string("output", None, "JSON output (default WORKDIR/eval.json).")
flags.mark_flag_as_required("workdir")
flags.register_validator("tasks", lambda tasks: set(tasks) <= set(TASKS),
                         f"each must be one of {TASKS}")
cli.integer_lists("lengths")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mcfg, dcfg, tokenizer, variables, step = load_run(FLAGS.workdir)
  _, eval_fn = step_lib.jit_steps(mcfg, TrainConfig(steps=1))
  state = state_lib.TrainState(step, variables["params"], None,
                              variables.get("expert_bias", {}))
  result = {"workdir": FLAGS.workdir, "step": step,
            **evaluate(eval_fn, state, dcfg, tokenizer, FLAGS.val_batches)}
  result["tasks"] = evaluate_tasks(
      mcfg, variables, tokenizer, lengths=[int(n) for n in FLAGS.lengths],
      tasks=FLAGS.tasks, examples_per_point=FLAGS.examples_per_point)
  path = FLAGS.output or os.path.join(FLAGS.workdir, "eval.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
