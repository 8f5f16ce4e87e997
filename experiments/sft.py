r"""Supervised fine-tuning on chat data, from a pretraining run or hub weights.

  python -m experiments.sft --workdir=runs/sft --init=runs/demo
  python -m experiments.sft --workdir=runs/sft --resume        # continue
  python -m experiments.sft --workdir=runs/sft --init=runs/demo \
      --data=chats/*.jsonl --seq_len=2048 --batch_size=16
  python -m experiments.sft --workdir=runs/sft --hf_path=ckpt/ \
      --tokenizer_dir=runs/demo/tokenizer --mesh=expert=4

--data: "stdlib" (the embedded instruction set made from the standard
library's docstrings, m2jax/data/chat_sources.py) or chat JSONL, one
{"messages": [...], "tools": [...]} per line (m2jax/data/chat.py). The loss
counts assistant tokens only; val_loss is the held-out assistant-token loss.
--resume continues WORKDIR with the configs it saved (model, train, data):
a flag left out keeps the run's value; --steps and the cadence flags may
change it; any other flag given that contradicts the run is refused, naming
the field (m2jax.train.resume). All logic is in m2jax.train.sft; this file
only turns flags into configs.
"""

import json

from absl import flags, logging

from experiments import cli, run_flags, train_flags
from m2jax.config import ConfigError, ModelConfig, config_from_dict
from m2jax.data import DataConfig, load_tokenizer
from m2jax.data.chat_data import ChatData
from m2jax.train import resume, sft
from m2jax.train.config import OPTIMIZERS, TrainConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/sft", "Run directory.")
flags.DEFINE_string("init", None, "A pretraining (or SFT) run directory to "
                    "start from: its newest checkpoint and its tokenizer.")
flags.DEFINE_string("hf_path", None, "A hub checkpoint directory to start "
                    "from instead (m2jax.hf.load).")
flags.DEFINE_string("tokenizer_dir", None, "With --hf_path: an m2jax "
                    "tokenizer directory (a run's tokenizer/); default: the "
                    "one in --hf_path, else the byte tokenizer.")
flags.DEFINE_bool("resume", False, "Continue from the newest checkpoint.")
# Data.
flags.DEFINE_string("data", "stdlib", "'stdlib' (embedded instructions) or a "
                    "chat JSONL file, directory or glob.")
flags.DEFINE_string("validation_data", None, "Held-out chat JSONL (default: "
                    "a hash split of --data).")
flags.DEFINE_float("validation_fraction", 0.1, "Share of --data held out.")
flags.DEFINE_integer("max_conversations", None, "Keep the first n "
                     "conversations of each split.")
flags.DEFINE_integer("seq_len", 512, "Tokens per packed row (a longer "
                     "conversation is truncated).")
flags.DEFINE_integer("batch_size", 4, "Rows per batch.")
# Optimisation.
flags.DEFINE_integer("steps", 200, "Optimizer steps.")
flags.DEFINE_enum("optimizer", "adamw", list(OPTIMIZERS),
                  "adamw; muon, muonsphere or sso for the hidden matrices "
                  "and AdamW for the rest (m2jax.train.optim).")
flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate.")
flags.DEFINE_float("matrix_learning_rate", None,
                   "Peak learning rate of the hidden matrices under muon, "
                   "muonsphere and sso (SSO's eta, ~0.02; default: "
                   "--learning_rate).")
flags.DEFINE_integer("warmup_steps", 10, "Linear warmup steps.")
flags.DEFINE_float("decay_fraction", TrainConfig.decay_fraction,
                   "Final fraction of steps that decay.")
flags.DEFINE_float("weight_decay", 0.1, "Weight decay.")
flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clipping.")
flags.DEFINE_integer("mtp_depth", None, "MTP modules trained (default: all "
                     "the starting model has).")
flags.DEFINE_float("mtp_weight", 0.1, "MTP loss weight (M2 ends "
                   "pretraining at 0.1).")
flags.DEFINE_float("aux_loss", None, "Aux-loss coefficient (default: model's).")
flags.DEFINE_integer("seed", 0, "Data seed.")
train_flags.define_cadence(eval_every=50, eval_batches=32)
flags.DEFINE_integer("sample_tokens", 160, "Greedy answer to a held-out "
                     "prompt at the end (0: none).")

run_flags.define()  # --mesh, the Settings flags, multi-host


# The config field each flag sets ({flag: field}), for --resume.
TRAIN_FLAGS = {
    "steps": "steps", "seed": "seed", "optimizer": "optimizer",
    "learning_rate": "learning_rate",
    "matrix_learning_rate": "matrix_learning_rate",
    "warmup_steps": "warmup_steps",
    "decay_fraction": "decay_fraction", "weight_decay": "weight_decay",
    "grad_clip": "grad_clip", "mtp_depth": "mtp_depth",
    "mtp_weight": "mtp_weight", "aux_loss": "aux_loss_coef",
    **train_flags.CADENCE_FLAGS}
DATA_FLAGS = {"data": "source", "validation_data": "validation_source",
              "validation_fraction": "validation_fraction",
              "max_conversations": "max_documents", "seq_len": "seq_len",
              "batch_size": "batch_size", "seed": "seed"}


def _configs_of_run(workdir: str):
  """(model, train, data) configs of the SFT run in `workdir`, the flags
  given explicitly checked against them."""
  saved = resume.read_run_configs(workdir)
  mcfg = config_from_dict(ModelConfig, saved["model"])
  train_config = resume.resumed_config(
      TrainConfig, saved["train"], train_flags.given(TRAIN_FLAGS),
      may_change=resume.RESUMABLE_TRAIN_FIELDS)
  data_config = resume.resumed_config(DataConfig, saved["data"],
                                      train_flags.given(DATA_FLAGS))
  return mcfg, train_config, data_config


def _configs(init):
  """(model, train, data) configs from the flags and the starting point."""
  mcfg = init.model_config
  depth = (mcfg.num_mtp_modules if FLAGS.mtp_depth is None
           else FLAGS.mtp_depth)
  train_config = TrainConfig(
      steps=FLAGS.steps, seed=FLAGS.seed, optimizer=FLAGS.optimizer,
      learning_rate=FLAGS.learning_rate,
      matrix_learning_rate=FLAGS.matrix_learning_rate,
      warmup_steps=FLAGS.warmup_steps,
      decay_fraction=FLAGS.decay_fraction, weight_decay=FLAGS.weight_decay,
      grad_clip=FLAGS.grad_clip, mtp_depth=depth,
      mtp_weight=FLAGS.mtp_weight, mtp_weight_final=FLAGS.mtp_weight,
      aux_loss_coef=FLAGS.aux_loss, log_every=FLAGS.log_every,
      eval_every=FLAGS.eval_every, eval_batches=FLAGS.eval_batches,
      checkpoint_every=FLAGS.checkpoint_every,
      keep_checkpoints=FLAGS.keep_checkpoints,
      async_checkpoint=FLAGS.async_checkpoint,
      checkpoint_device_copy=FLAGS.checkpoint_device_copy)
  data_config = sft.chat_data_config(
      init.tokenizer, source=FLAGS.data,
      validation_source=FLAGS.validation_data,
      validation_fraction=FLAGS.validation_fraction,
      max_documents=FLAGS.max_conversations, seq_len=FLAGS.seq_len,
      batch_size=FLAGS.batch_size, seed=FLAGS.seed)
  return mcfg, train_config, data_config


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes
  mesh, settings = run_flags.from_flags()
  if FLAGS.init is not None and FLAGS.hf_path is not None:
    raise ConfigError("--init and --hf_path: give one starting point")
  if FLAGS.tokenizer_dir is not None and FLAGS.hf_path is None:
    raise ConfigError("--tokenizer_dir goes with --hf_path (--init uses the "
                      "run's own tokenizer)")
  if FLAGS.resume:
    # The run's saved configs, so the continued run is the same run.
    mcfg, train_config, data_config = _configs_of_run(FLAGS.workdir)
    tokenizer = load_tokenizer(f"{FLAGS.workdir}/tokenizer")
    init = None
  else:
    if FLAGS.init is None and FLAGS.hf_path is None:
      raise ConfigError("give a starting point: --init=PRETRAIN_RUN or "
                        "--hf_path=DIR (or --resume)")
    init = (sft.load_init(FLAGS.init) if FLAGS.init is not None
            else sft.load_hub(FLAGS.hf_path, FLAGS.tokenizer_dir))
    mcfg, train_config, data_config = _configs(init)
    tokenizer = init.tokenizer
  data = ChatData(data_config, tokenizer)
  summary = sft.finetune(mcfg.replace(settings=settings), train_config, data,
                         FLAGS.workdir, init=init, resume=FLAGS.resume,
                         sample_tokens=FLAGS.sample_tokens, mesh=mesh)
  sample = summary.pop("sample", None)
  summary.pop("state", None)
  summary.pop("metrics", None)  # every logged step is in metrics.jsonl
  summary["workdir"] = FLAGS.workdir
  print(json.dumps(summary, indent=2))
  if sample is not None:
    print("--- greedy answer to a held-out prompt ---")
    print(sample["prompt"] + sample["completion"])


if __name__ == "__main__":
  cli.run(main)
