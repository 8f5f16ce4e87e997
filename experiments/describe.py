"""Print a preset's parameter counts as one JSON object.

  python -m experiments.describe --preset=minimax_m2
"""

import json

from absl import flags

from experiments import cli
from m2jax import config as config_lib
from m2jax import params

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "minimax_m2",
                    f"One of {sorted(config_lib.PRESETS)}.")


def main(argv):
  del argv
  config = config_lib.get_preset(FLAGS.preset)
  print(json.dumps({"preset": FLAGS.preset, **params.count_params(config)},
                   indent=2))


if __name__ == "__main__":
  cli.run(main)
