r"""Can a model config learn content-based retrieval? Associative recall.

  python -m experiments.recall_check --pairs=4 --steps=1500 \
      --override=hidden_size=128 --override=num_layers=2

Trains the jitted train step on fresh associative-recall sequences
(m2jax.eval.recall: `pairs` key:value pairs, then every key again with its
value) and prints the accuracy on the queried value digits (0.1 is chance).
A quick check of whether a sweep's model can retrieve at all before spending
GPU time on it (benchmarks/results/ablations/README.md).

It ends with a verdict (m2jax.eval.recall.recall_verdict): PASS when the
final held-out accuracy is at least chance + max(--margin, 3 standard
errors of a guesser's accuracy on the held-out digits), exit status 0;
FAIL otherwise, exit status 1.
"""

import time

from absl import flags, logging
import jax
import numpy as np

from experiments import cli
from m2jax import config as config_lib
from m2jax import model
from m2jax.eval import recall
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "tiny", "Base model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_integer("pairs", 4, "Key-value pairs per sequence.",
                     lower_bound=1, upper_bound=recall.MAX_PAIRS)
flags.DEFINE_integer("steps", 1000, "Training steps.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Sequences per step (and held out).",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("eval_every", 200, "Steps between accuracy checks.",
                     lower_bound=1)
flags.DEFINE_float("margin", 0.1, "A pass needs held-out accuracy at least "
                   "this far above chance (0.1).", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Data and init seed.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
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
  held_out = recall.recall_batch(np.random.default_rng(FLAGS.seed + 10**6),
                                 FLAGS.batch_size, FLAGS.pairs)
  start = time.time()
  for i in range(FLAGS.steps):
    state, metrics = train(state, recall.recall_batch(rng, FLAGS.batch_size,
                                                      FLAGS.pairs)[0])
    if (i + 1) % FLAGS.eval_every == 0 or i + 1 == FLAGS.steps:
      acc = recall.recall_accuracy(mcfg, state_lib.variables_of(state),
                                   *held_out)
      print(f"step {i + 1}: next-token loss {float(metrics['ce']):.3f}, "
            f"held-out recall accuracy {acc:.3f} (chance "
            f"{recall.CHANCE_ACCURACY:.3f}), {time.time() - start:.0f} s",
            flush=True)
  passed, verdict = recall.recall_verdict(acc, int(held_out[1].sum()),
                                          FLAGS.margin)
  print(verdict)
  return 0 if passed else 1


if __name__ == "__main__":
  cli.run(main)
