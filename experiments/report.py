"""Write a sweep's report (markdown tables + PNG plots) from results.json.

  python -m experiments.report --sweep_dir=runs/sweep_attention
"""

import json
import os

from absl import flags

from experiments import cli
from m2jax import report
from m2jax.errors import MissingPathError

FLAGS = flags.FLAGS
flags.DEFINE_string("sweep_dir", None, "Directory holding results.json.")
flags.DEFINE_string("out_dir", None, "Where to write (default: sweep_dir).")
flags.mark_flag_as_required("sweep_dir")


def main(argv):
  del argv
  path = os.path.join(FLAGS.sweep_dir, "results.json")
  if not os.path.exists(path):
    raise MissingPathError(f"no results.json in {FLAGS.sweep_dir}: run "
                           "experiments.sweep first")
  with open(path, encoding="utf-8") as f:
    results = json.load(f)
  paths = report.write_report(results, FLAGS.out_dir or FLAGS.sweep_dir)
  print(open(paths["report"], encoding="utf-8").read())
  print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
  cli.run(main)
