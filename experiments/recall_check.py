r"""Can a model config learn content-based retrieval? Associative recall.

  python -m experiments.recall_check --pairs=4 --steps=1500 \
      --override=hidden_size=128 --override=num_layers=2

Trains the jitted train step on fresh associative-recall sequences
(m2jax.eval.recall: `pairs` key:value pairs, then every key again with its
value) and prints the accuracy on the queried value digits (0.1 is chance).
A quick check of whether a sweep's model can retrieve at all before spending
GPU time on it (benchmarks/results/ablations/README.md).
"""

import time

from absl import flags
import jax
import numpy as np

from experiments import cli
from m2jax import config as config_lib
from m2jax import model
from m2jax.eval.recall import recall_accuracy, recall_batch
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "tiny", "Base model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_integer("pairs", 4, "Key-value pairs per sequence.")
flags.DEFINE_integer("steps", 1000, "Training steps.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("eval_every", 200, "Steps between accuracy checks.")
flags.DEFINE_integer("seed", 0, "Data and init seed.")


def main(argv):
  del argv
  mcfg = config_lib.apply_overrides(
      config_lib.get_preset(FLAGS.preset),
      ["num_mtp_modules=0"] + FLAGS.override)
  tcfg = TrainConfig(steps=FLAGS.steps, learning_rate=FLAGS.learning_rate,
                     warmup_steps=min(20, FLAGS.steps), mtp_depth=0,
                     seed=FLAGS.seed)
  state = state_lib.init_state(mcfg, tcfg, model.init(
      mcfg, jax.random.key(FLAGS.seed)))
  train, _ = step_lib.jit_steps(mcfg, tcfg)
  rng = np.random.default_rng(FLAGS.seed)
  held_out = recall_batch(np.random.default_rng(FLAGS.seed + 10**6),
                          FLAGS.batch_size, FLAGS.pairs)
  start = time.time()
  for i in range(FLAGS.steps):
    state, metrics = train(state, recall_batch(rng, FLAGS.batch_size,
                                               FLAGS.pairs)[0])
    if (i + 1) % FLAGS.eval_every == 0 or i + 1 == FLAGS.steps:
      acc = recall_accuracy(mcfg, state_lib.variables_of(state), *held_out)
      print(f"step {i + 1}: loss {float(metrics['loss']):.3f}, recall "
            f"accuracy {acc:.3f} (chance 0.100), {time.time() - start:.0f} s",
            flush=True)


if __name__ == "__main__":
  cli.run(main)
