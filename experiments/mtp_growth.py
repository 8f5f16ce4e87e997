r"""MTP growth K=1 -> K=3: copy-from-main-model init vs random init.

  python -m experiments.mtp_growth --preset=tiny --workdir=runs/mtp_growth
  python -m experiments.mtp_growth --preset=m2_small --mesh=data=2,expert=2

One warmup-stable-decay schedule of --base_steps + --growth_steps steps,
the growth inside its decay phase (m2jax.train.mtp_growth):
1. pretrain with one MTP module for --base_steps (or reuse WORKDIR/base: a
   WORKDIR whose other phases exist is refused; use a fresh one);
2. for each init in --inits: grow to --depth modules, train MTP only (main
   model frozen) until the MTP loss settles (or --mtp_only_max_steps), then
   to the end of the schedule two arms: joint training, and MTP-only
   training (the paper's negative arm), at the same step budget;
3. print and save (WORKDIR/mtp_growth.json) the per-depth MTP loss and
   acceptance at the start and end of each phase and arm, the steps to
   settle, the main model's loss, and the lr and MTP weight the schedule
   gives at the growth and at the switch.
"""

import json
import os

from absl import flags, logging

from experiments import cli, run_flags
from m2jax import config as config_lib
from m2jax.data import DataConfig
from m2jax.train import mtp_growth

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "tiny", f"One of {sorted(config_lib.PRESETS)}.")
flags.DEFINE_multi_string("override", [], "ModelConfig FIELD=VALUE.")
flags.DEFINE_string("workdir", "runs/mtp_growth", "Experiment directory.")
flags.DEFINE_string("data", "stdlib", "Corpus (see experiments.pretrain).")
flags.DEFINE_float("validation_fraction", DataConfig.validation_fraction,
                   "Share of --data held out for validation (at most 0.5).")
flags.DEFINE_string("validation_data", None,
                    "Validation documents of their own (then --data is used "
                    "whole for training).")
flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_integer("base_steps", 400, "Pretraining steps with K=1.")
flags.DEFINE_integer("growth_steps", 200, "Steps after the growth: MTP only "
                     "until settled, then each arm to the schedule's end.")
flags.DEFINE_float("decay_fraction", 0.75, "Decay phase, as a fraction of "
                   "base_steps + growth_steps; it must start by the growth. "
                   "The default puts the growth 56% into the decay (MTP "
                   "weight 0.19, lr 0.5 x peak there).")
flags.DEFINE_integer("warmup_steps", 10, "Warm-up steps (once, at step 0).")
flags.DEFINE_integer("depth", 3, "MTP modules after growth.")
flags.DEFINE_list("inits", ["copy", "random"], "Inits to compare.")
flags.DEFINE_integer("mtp_only_max_steps", 100, "Cap on the MTP-only phase "
                     "(below growth_steps).")
flags.DEFINE_integer("settle_window", 20, "Plateau window (logged steps).")
flags.DEFINE_float("settle_tol", 0.01, "Relative EMA improvement that counts "
                   "as settled.")
flags.DEFINE_integer("seed", 0, "Seed.")

run_flags.define()  # --mesh, the Settings flags, multi-host


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mesh, settings = run_flags.from_flags()
  model_config = config_lib.apply_overrides(
      config_lib.get_preset(FLAGS.preset), FLAGS.override).replace(
          settings=settings)
  data_config = DataConfig(source=FLAGS.data, seq_len=FLAGS.seq_len,
                           batch_size=FLAGS.batch_size, seed=FLAGS.seed,
                           validation_fraction=FLAGS.validation_fraction,
                           validation_source=FLAGS.validation_data)
  results = mtp_growth.run_experiment(
      model_config, data_config, FLAGS.workdir, base_steps=FLAGS.base_steps,
      growth_steps=FLAGS.growth_steps, depth=FLAGS.depth,
      inits=tuple(FLAGS.inits), mtp_only_max_steps=FLAGS.mtp_only_max_steps,
      learning_rate=FLAGS.learning_rate, decay_fraction=FLAGS.decay_fraction,
      warmup_steps=FLAGS.warmup_steps,
      settle=mtp_growth.Plateau(FLAGS.settle_window, FLAGS.settle_tol),
      seed=FLAGS.seed, mesh=mesh)
  path = os.path.join(FLAGS.workdir, "mtp_growth.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=2)
  print(mtp_growth.format_table(results))
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
