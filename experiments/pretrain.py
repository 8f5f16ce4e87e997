r"""Pretrain a MiniMax-M2-style model (the main job; `make demo` runs it).

  python -m experiments.pretrain --preset=tiny --steps=300 --workdir=runs/tiny
  python -m experiments.pretrain --workdir=runs/tiny --resume   # continue
  python -m experiments.pretrain --workdir=runs/tiny --resume --steps=600
  python -m experiments.pretrain --preset=m2_small --data=/path/*.jsonl \
      --seq_len=2048 --batch_size=16 --gmm_backend=mosaic
  python -m experiments.pretrain --preset=m2_small --mesh=expert=4 \
      --seq_len=2048 --batch_size=32          # 4 GPUs, expert parallel
  python -m experiments.pretrain --preset=m2_small --seq_len=8192 \
      --batch_size=4 --context_schedule=0:8192,0.8:32768 \
      --context_documents=packages  # 8K on files, then 32K on whole packages
  python -m experiments.pretrain --preset=m2_small --seq_len=8192 \
      --batch_size=8 --context_schedule=m2_small --remat  # ... to 128K rows

All logic is in m2jax.train.loop; this file only turns flags into configs.
"""

import json

from absl import flags, logging

from experiments import cli, run_flags, train_flags
from m2jax import config as config_lib
from m2jax.data import DataConfig
from m2jax.train import resume
from m2jax.train.config import (OPTIMIZERS, TrainConfig,
                                parse_context_schedule)
from m2jax.train.interrupt import TrainingInterrupted
from m2jax.train.loop import pretrain

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "tiny", f"One of {sorted(config_lib.PRESETS)}.")
flags.DEFINE_multi_string("override", [],
                          "ModelConfig FIELD=VALUE, repeatable "
                          "(e.g. attention_pattern=sliding,full).")
flags.DEFINE_string("workdir", "runs/pretrain", "Run directory.")
flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its "
                  "newest checkpoint, with its saved configs: flags given "
                  "must agree with them, except --steps and the cadence "
                  "flags (--log_every ... --keep_checkpoints).")
# Data.
flags.DEFINE_string("data", "stdlib",
                    "'stdlib' (embedded corpus), a directory, file or glob of "
                    ".txt / .jsonl documents.")
flags.DEFINE_enum("documents", "files", ["files", "packages"],
                  "A document is a file, or a package: the files of one "
                  "top-level directory concatenated (long context).")
flags.DEFINE_enum("context_documents", None, ["files", "packages"],
                  "Documents of the context stages after the first "
                  "(default: --documents).")
flags.DEFINE_float("validation_fraction", DataConfig.validation_fraction,
                   "Share of --data's documents held out for validation "
                   "(hash split, at most 0.5).")
flags.DEFINE_string("validation_data", None,
                    "Validation documents of their own (same forms as "
                    "--data); then --data is used whole for training.")
flags.DEFINE_enum("tokenizer", "byte", ["byte", "bpe"], "Tokenizer.")
flags.DEFINE_integer("bpe_vocab_size", 4096, "BPE vocabulary size (the "
                     "model's vocab_size too, unless overridden).")
flags.DEFINE_integer("seq_len", 256, "Tokens per packed row.")
flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
# Optimisation.
flags.DEFINE_integer("steps", 300, "Optimizer steps.")
flags.DEFINE_enum("optimizer", "adamw", list(OPTIMIZERS),
                  "adamw; muon, muonsphere or sso for the hidden matrices "
                  "and AdamW for the rest (m2jax.train.optim).")
flags.DEFINE_float("learning_rate", 3e-3, "Peak learning rate.")
flags.DEFINE_float("matrix_learning_rate", None,
                   "Peak learning rate of the hidden matrices under muon, "
                   "muonsphere and sso (SSO's eta, ~0.02; default: "
                   "--learning_rate).")
flags.DEFINE_float("router_lr_scale", TrainConfig.router_lr_scale,
                   "Multiplies the router gates' learning rate (the loss-free "
                   "bias update must keep up with them; "
                   "benchmarks/notes/router.md).")
flags.DEFINE_integer("warmup_steps", 20, "Linear warmup steps.")
flags.DEFINE_float("decay_fraction", TrainConfig.decay_fraction,
                   "Final fraction of steps that decay (default: M2's).")
flags.DEFINE_float("weight_decay", 0.1,
                   "Weight decay (which parameters: m2jax.train.optim).")
flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clipping.")
flags.DEFINE_integer("mtp_depth", 1, "MTP modules trained (<= the preset's).")
flags.DEFINE_float("mtp_weight", 0.3, "MTP loss weight in the stable phase.")
flags.DEFINE_float("mtp_weight_final", 0.1, "MTP weight at the end of decay.")
flags.DEFINE_float("z_loss", 0.0, "z-loss coefficient.")
flags.DEFINE_string("context_schedule", "",
                    "Context extension: 'cpu' (256 -> 1024), 'm2' (8K -> 32K "
                    "-> 192K), 'm2_small' (8K -> 32K -> 128K: one H100 with "
                    "--remat) or START:SEQ_LEN,..., START the fraction of "
                    "--steps where that stage starts (the first 0), e.g. "
                    "0:256,0.75:1024; tokens per batch are kept.")
flags.DEFINE_float("aux_loss", None, "Aux-loss coefficient (default: model's).")
flags.DEFINE_list("gnmr", None, "GNMR, per-unit gradient-norm recovery "
                  "(m2jax.train.gnmr): 'on' for its defaults, or GNMRConfig "
                  "FIELD=VALUE,... (e.g. max_recovering=4,lock_steps=20); "
                  "unset: off.")
flags.DEFINE_integer("seed", 0, "Init and data seed.")
train_flags.define_cadence(eval_every=100, eval_batches=8)
flags.DEFINE_integer("sample_tokens", 96, "Greedy sample length at the end.")

run_flags.define()  # --mesh, the Settings flags, multi-host

# The config field each flag sets ({flag: field}). With --resume, a flag
# given explicitly must agree with the run's saved config (or be one of
# resume.RESUMABLE_TRAIN_FIELDS); a flag left out takes the saved value.
DATA_FLAGS = {"data": "source", "documents": "documents",
              "context_documents": "context_documents",
              "validation_data": "validation_source",
              "validation_fraction": "validation_fraction",
              "tokenizer": "tokenizer", "bpe_vocab_size": "bpe_vocab_size",
              "seq_len": "seq_len", "batch_size": "batch_size", "seed": "seed"}
TRAIN_FLAGS = {
    "steps": "steps", "seed": "seed", "optimizer": "optimizer",
    "learning_rate": "learning_rate",
    "matrix_learning_rate": "matrix_learning_rate",
    "router_lr_scale": "router_lr_scale", "warmup_steps": "warmup_steps",
    "decay_fraction": "decay_fraction", "weight_decay": "weight_decay",
    "grad_clip": "grad_clip", "mtp_depth": "mtp_depth",
    "mtp_weight": "mtp_weight", "mtp_weight_final": "mtp_weight_final",
    "z_loss": "z_loss_coef", "aux_loss": "aux_loss_coef",
    "context_schedule": "context_schedule", "gnmr": "gnmr",
    **train_flags.CADENCE_FLAGS}


def _given(table: dict[str, str], *, explicit_only: bool
           ) -> dict[str, resume.Given]:
  return train_flags.given(
      table, explicit_only=explicit_only,
      convert={"context_schedule": parse_context_schedule,
               "gnmr": train_flags.parse_gnmr})


def _model_given(base: config_lib.ModelConfig) -> dict[str, resume.Given]:
  """{field: Given} of --preset (when given: all its fields) and each
  --override, applied to `base`."""
  given = {}
  if FLAGS["preset"].present:
    preset = config_lib.config_to_dict(base)
    given = {field: resume.Given(getattr(base, field),
                                 f"--preset={FLAGS.preset}")
             for field in preset}
  config = config_lib.apply_overrides(base, FLAGS.override)
  for item in FLAGS.override:
    field = item.partition("=")[0].strip()
    given[field] = resume.Given(getattr(config, field), f"--override={item}")
  return given


def _configs_from_flags():
  """(model, train, data) configs of a new run: every flag counts."""
  model_config = _vocab_for_tokenizer(config_lib.apply_overrides(
      config_lib.get_preset(FLAGS.preset), FLAGS.override))
  train = {f: g.value for f, g in _given(TRAIN_FLAGS,
                                         explicit_only=False).items()}
  data = {f: g.value for f, g in _given(DATA_FLAGS,
                                        explicit_only=False).items()}
  return model_config, TrainConfig(**train), DataConfig(**data)


def _configs_of_run(workdir: str):
  """(model, train, data) configs of the run in `workdir`, with the flags
  given explicitly checked against them (m2jax.train.resume)."""
  saved = resume.read_run_configs(workdir)
  # --override applies to the given preset, or else to the run's model.
  base = (config_lib.get_preset(FLAGS.preset) if FLAGS["preset"].present
          else config_lib.config_from_dict(config_lib.ModelConfig,
                                           saved["model"]))
  model_config = resume.resumed_config(config_lib.ModelConfig,
                                       saved["model"], _model_given(base))
  train_config = resume.resumed_config(
      TrainConfig, saved["train"], _given(TRAIN_FLAGS, explicit_only=True),
      may_change=resume.RESUMABLE_TRAIN_FIELDS)
  data_config = resume.resumed_config(
      DataConfig, saved["data"], _given(DATA_FLAGS, explicit_only=True))
  return model_config, train_config, data_config


def _vocab_for_tokenizer(model_config):
  """The model config with the BPE tokenizer's vocabulary size, unless the
  user chose vocab_size with --override (then it must hold the tokenizer)."""
  if FLAGS.tokenizer != "bpe":
    return model_config
  overridden = {o.split("=", 1)[0].strip() for o in FLAGS.override}
  wanted = FLAGS.bpe_vocab_size
  if "vocab_size" not in overridden:
    if model_config.vocab_size != wanted:
      print(f"note: ModelConfig.vocab_size {model_config.vocab_size} -> "
            f"{wanted}, the BPE tokenizer's (--bpe_vocab_size; "
            "--override=vocab_size=N sets it yourself)")
    return model_config.replace(vocab_size=wanted)
  if model_config.vocab_size < wanted:
    raise config_lib.ConfigError(
        f"ModelConfig.vocab_size: --override=vocab_size="
        f"{model_config.vocab_size} is below --bpe_vocab_size={wanted}; "
        "raise it or leave it out (pretrain then uses the tokenizer's)")
  return model_config


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes
  mesh, settings = run_flags.from_flags()
  model_config, train_config, data_config = (
      _configs_of_run(FLAGS.workdir) if FLAGS.resume
      else _configs_from_flags())
  model_config = model_config.replace(settings=settings)  # never saved
  try:
    summary = pretrain(model_config, train_config, data_config, FLAGS.workdir,
                       resume=FLAGS.resume, sample_tokens=FLAGS.sample_tokens,
                       mesh=mesh)
  except TrainingInterrupted as e:  # printed by cli.run, with what to do
    raise TrainingInterrupted(
        e.signum, e.step, e.directory, continue_with=(
            f"python -m experiments.pretrain --workdir={FLAGS.workdir} "
            "--resume")) from None
  sample = summary.pop("sample", None)
  summary.pop("state", None)
  summary.pop("metrics", None)  # every logged step is in metrics.jsonl
  summary["workdir"] = FLAGS.workdir
  print(json.dumps(summary, indent=2))
  if sample is not None:
    print("--- greedy sample ---")
    print(sample)


if __name__ == "__main__":
  cli.run(main)
