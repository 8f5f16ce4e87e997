r"""Export a training run's checkpoint to the hub layout (m2jax.hf.save).

  python -m experiments.export --workdir=runs/demo --out=runs/demo_hub
  python -m experiments.export --workdir=runs/mtp_growth/copy/joint \
      --out=runs/grown_hub --step=550 --overwrite

Reads the run's saved config (WORKDIR/config.json) and its newest checkpoint
(or --step); `m2jax.hf.load(OUT)` reads it back (HF transformers >= 5.18
reads the main model; MTP modules are an m2jax extension). The tokenizer
stays in WORKDIR/tokenizer. An --out that holds files is refused unless
--overwrite; a step the run has no checkpoint of is refused, listing those
it has.
"""

from absl import flags, logging

from experiments import cli
from m2jax.eval.runs import export_run

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A pretrain --workdir (or one phase "
                    "directory of an mtp_growth --workdir).")
flags.DEFINE_string("out", None, "Output directory (missing or empty).")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).",
                     lower_bound=0)
flags.DEFINE_bool("overwrite", False, "Replace an --out that holds files.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config, step = export_run(FLAGS.workdir, FLAGS.out, step=FLAGS.step,
                            overwrite=FLAGS.overwrite)
  print(f"wrote step {step} of {FLAGS.workdir} to {FLAGS.out} (hub layout, "
        f"{config.param_dtype} weights)")
  if config.compute_dtype != config.param_dtype:
    # hf.load computes in the weights' dtype unless told otherwise.
    print(f"the run computed in {config.compute_dtype}: m2jax.hf.load("
          f"{FLAGS.out!r}, compute_dtype={config.compute_dtype!r}) does too")


if __name__ == "__main__":
  cli.run(main)
