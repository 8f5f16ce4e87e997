r"""Can a model config learn content-based retrieval? Associative recall.

  python -m experiments.recall_check --pairs=4 --steps=1500 \
      --override=hidden_size=128 --override=num_layers=2
  python -m experiments.recall_check --task=mqar --pairs=8 --hidden_size=128 \
      --num_layers=2 --learning_rate=1e-3 --steps=2000 --train_gaps=64 \
      --attention=sliding --window=32      # pairs beyond a 2x32 reach

--task=recall (m2jax.eval.recall: `pairs` two-letter key:value pairs, then
every key again with its value; accuracy on the queried value digits, 0.1 is
chance). --task=mqar (m2jax.eval.mqar: one-character keys and values, then
`gap` filler, then the queries; accuracy on the queried values, chance
1 / value_vocab), trained on sequences whose gap is drawn from --train_gaps
and scored on a held-out set at each of --eval_gaps. --attention and
--window make the model sliding-window (all layers, or a pattern such as
sliding,full), so one command shows whether SWA can reach the pairs.

Trains the jitted train step on fresh sequences and prints the held-out
accuracy every --eval_every steps (--out writes the curve as JSON). A quick
check of whether a sweep's model can retrieve at all before spending GPU
time on it (benchmarks/notes/mqar.md, benchmarks/results/ablations/).

It ends with a verdict (m2jax.eval.recall.recall_verdict): PASS when the
final held-out accuracy (each eval gap's, for mqar) is at least chance +
max(--margin, 3 standard errors of a guesser's accuracy on the held-out
targets), exit status 0; FAIL otherwise, exit status 1. --stop_accuracy
ends training early once every held-out accuracy reaches it.
"""

import json
import os
import time

from absl import flags, logging
import jax
import numpy as np

from experiments import cli
from m2jax import config as config_lib
from m2jax import model
from m2jax.data.tokenizer import ByteTokenizer
from m2jax.eval import mqar, recall
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

FLAGS = flags.FLAGS
flags.DEFINE_enum("task", "recall", ["recall", "mqar"],
                  "recall: two-letter keys, digits; mqar: Zoology's MQAR.")
flags.DEFINE_string("preset", "tiny", "Base model preset.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_integer("hidden_size", None, "Model width (default: preset's).")
flags.DEFINE_integer("num_layers", None, "Layers (default: preset's).")
flags.DEFINE_list("attention", [], "Attention pattern, e.g. 'sliding' (all "
                  "layers) or 'sliding,full' (default: the preset's).")
flags.DEFINE_integer("window", None, "Sliding-window size of 'sliding' "
                     "layers.")
flags.DEFINE_integer("pairs", 4, "Key-value pairs per sequence.",
                     lower_bound=1, upper_bound=recall.MAX_PAIRS)
flags.DEFINE_integer("queries", 0, "mqar: keys queried (0: all).",
                     lower_bound=0)
flags.DEFINE_list("train_gaps", ["0"], "mqar: filler between pairs and "
                  "queries; each training sequence draws one of these.")
flags.DEFINE_list("eval_gaps", [], "mqar: gaps of the held-out sets "
                  "(default: --train_gaps).")
flags.DEFINE_integer("offset", 0, "mqar: filler before the first pair.",
                     lower_bound=0)
flags.DEFINE_integer("key_vocab", 26, "mqar: keys drawn from this many.")
flags.DEFINE_integer("value_vocab", 26, "mqar: values drawn from this many.")
flags.DEFINE_integer("eval_sequences", 64, "mqar: held-out sequences per "
                     "eval gap.", lower_bound=1)
flags.DEFINE_integer("steps", 1000, "Training steps.", lower_bound=1)
flags.DEFINE_integer("batch_size", 32, "Sequences per step (and held out, "
                     "for recall).", lower_bound=1)
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("eval_every", 200, "Steps between accuracy checks.",
                     lower_bound=1)
flags.DEFINE_float("stop_accuracy", None, "Stop once every held-out "
                   "accuracy is at least this.")
flags.DEFINE_float("margin", 0.1, "A pass needs held-out accuracy at least "
                   "this far above chance.", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Data and init seed.")
flags.DEFINE_string("out", None, "Write the flags and the accuracy curve "
                    "here (JSON).")
cli.integer_lists("train_gaps", "eval_gaps")
# What --out records of the command (everything that changes the result).
_RECORDED = ("task", "preset", "override", "hidden_size", "num_layers",
             "attention", "window", "pairs", "queries", "train_gaps",
             "eval_gaps", "offset", "key_vocab", "value_vocab",
             "eval_sequences", "steps", "batch_size", "learning_rate",
             "eval_every", "stop_accuracy", "seed")


def _model_config():
  overrides = ["num_mtp_modules=0"]
  if FLAGS.hidden_size is not None:
    overrides.append(f"hidden_size={FLAGS.hidden_size}")
  if FLAGS.num_layers is not None:
    overrides.append(f"num_layers={FLAGS.num_layers}")
  if FLAGS.attention:
    overrides.append("attention_pattern=" + ",".join(FLAGS.attention))
  if FLAGS.window is not None:
    overrides.append(f"sliding_window={FLAGS.window}")
  return config_lib.apply_overrides(config_lib.get_preset(FLAGS.preset),
                                    overrides + FLAGS.override)


class _Recall:
  """Two-letter associative recall (m2jax.eval.recall)."""

  def __init__(self):
    self.chance = recall.CHANCE_ACCURACY
    self.rng = np.random.default_rng(FLAGS.seed)
    self.held_out = recall.recall_batch(
        np.random.default_rng(FLAGS.seed + 10**6), FLAGS.batch_size,
        FLAGS.pairs)
    self.targets = {"recall": int(self.held_out[1].sum())}

  def batch(self, step):
    del step
    return recall.recall_batch(self.rng, FLAGS.batch_size, FLAGS.pairs)[0]

  def scores(self, mcfg, variables):
    return {"recall": recall.recall_accuracy(mcfg, variables,
                                             *self.held_out)}


class _MQAR:
  """Multi-query associative recall at chosen gaps (m2jax.eval.mqar)."""

  def __init__(self):
    self.tokenizer = ByteTokenizer()
    base = mqar.MQARConfig(pairs=FLAGS.pairs, queries=FLAGS.queries,
                           offset=FLAGS.offset, key_vocab=FLAGS.key_vocab,
                           value_vocab=FLAGS.value_vocab)
    self.train_gaps = [int(g) for g in FLAGS.train_gaps]
    eval_gaps = [int(g) for g in FLAGS.eval_gaps or FLAGS.train_gaps]
    # Every training row as long as the longest gap's: one compiled step.
    longest = base.replace(gap=max(self.train_gaps)).content_length
    self.train_cfg = base.replace(length=longest)
    self.chance = base.chance
    self.held_out = {g: mqar.eval_examples(base.replace(gap=g),
                                           FLAGS.eval_sequences)
                     for g in eval_gaps}
    self.targets = {f"gap{g}": FLAGS.eval_sequences * base.num_queries
                    for g in eval_gaps}

  def batch(self, step):
    docs = mqar.training_documents(FLAGS.batch_size, self.train_cfg,
                                   self.train_gaps, seed=FLAGS.seed * 10**5
                                   + step)
    examples = [mqar.MQARExample(d, ()) for d in docs]
    return mqar.train_batch(examples, self.tokenizer)[0]

  def scores(self, mcfg, variables):
    return {f"gap{g}": mqar.accuracy(mcfg, variables, self.tokenizer, exs,
                                     batch_size=32)
            for g, exs in self.held_out.items()}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mcfg = _model_config()
  task = _MQAR() if FLAGS.task == "mqar" else _Recall()
  tcfg = TrainConfig(steps=FLAGS.steps, learning_rate=FLAGS.learning_rate,
                     warmup_steps=min(20, FLAGS.steps), mtp_depth=0,
                     seed=FLAGS.seed)
  state = state_lib.init_state(mcfg, tcfg, model.init(
      mcfg, jax.random.key(FLAGS.seed)))
  train, _ = step_lib.jit_steps(mcfg, tcfg)
  curve = []
  start = time.time()
  for i in range(FLAGS.steps):
    state, metrics = train(state, task.batch(i))
    if (i + 1) % FLAGS.eval_every == 0 or i + 1 == FLAGS.steps:
      scores = task.scores(mcfg, state_lib.variables_of(state))
      curve.append({"step": i + 1, "ce": float(metrics["ce"]),
                    "seconds": round(time.time() - start, 1), **scores})
      print(f"step {i + 1}: next-token loss {float(metrics['ce']):.3f}, "
            "held-out accuracy "
            + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
            + f" (chance {task.chance:.3f}), {time.time() - start:.0f} s",
            flush=True)
      if (FLAGS.stop_accuracy is not None
          and min(scores.values()) >= FLAGS.stop_accuracy):
        break
  verdicts = {k: recall.recall_verdict(v, task.targets[k], FLAGS.margin,
                                       chance=task.chance)
              for k, v in scores.items()}
  for k, (_, line) in verdicts.items():
    print(line if len(verdicts) == 1 else f"{k}: {line}")
  if FLAGS.out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w", encoding="utf-8") as f:
      json.dump({"flags": {name: FLAGS[name].value for name in _RECORDED},
                 "model": config_lib.config_to_dict(mcfg),
                 "chance": task.chance, "curve": curve,
                 "passed": {k: bool(p) for k, (p, _) in verdicts.items()}},
                f, indent=1)
  return 0 if all(p for p, _ in verdicts.values()) else 1


if __name__ == "__main__":
  cli.run(main)
