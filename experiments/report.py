"""Write a sweep's report (markdown tables + PNG plots) of every finished run.

  python -m experiments.report --sweep_dir=runs/sweep_attention

The runs are read from the sweep directory's run folders (every arm and
seed, whichever invocation ran it), or from its results.json alone when the
folders are not there; results.json is written beside the report with what
it shows (arms that ran at once may have left an older one).
"""

import os

from absl import flags

from experiments import cli
from m2jax import report, sweep
from m2jax.train.checkpoint import write_json

FLAGS = flags.FLAGS
flags.DEFINE_string("sweep_dir", None, "The sweep directory.")
flags.DEFINE_string("out_dir", None, "Where to write (default: sweep_dir).")
flags.mark_flag_as_required("sweep_dir")


def main(argv):
  del argv
  results = sweep.load_results(FLAGS.sweep_dir)
  out_dir = FLAGS.out_dir or FLAGS.sweep_dir
  paths = report.write_report(results, out_dir)
  write_json(os.path.join(out_dir, "results.json"), results)
  print(open(paths["report"], encoding="utf-8").read())
  print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
  cli.run(main)
