"""Load a training run (WORKDIR of experiments.pretrain) for evaluation."""

from __future__ import annotations

import json
import os

import jax

from m2jax import model
from m2jax.config import ModelConfig, config_from_dict
from m2jax.data import DataConfig, make_tokenizer
from m2jax.errors import MissingPathError
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig


def load_configs(workdir: str) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise MissingPathError(f"{path} not found: is {workdir} a pretrain "
                           "--workdir?")
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  return (config_from_dict(ModelConfig, raw["model"]),
          config_from_dict(TrainConfig, raw["train"]),
          config_from_dict(DataConfig, raw["data"]))


def load_run(workdir: str):
  """(model_config, data_config, tokenizer, variables, step) of the newest
  complete checkpoint in `workdir`."""
  mcfg, tcfg, dcfg = load_configs(workdir)
  # Shapes only, no memory.
  state = jax.eval_shape(lambda: state_lib.init_state(
      mcfg, tcfg, model.init(mcfg, jax.random.key(0))))
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=tcfg.keep_checkpoints)
  restored = checkpointer.restore_latest(state)
  checkpointer.close()
  if restored is None:
    raise FileNotFoundError(f"no readable checkpoint under {workdir}")
  step, state, _, _ = restored
  tokenizer = make_tokenizer(dcfg, os.path.join(workdir, "tokenizer"))
  return mcfg, dcfg, tokenizer, state_lib.variables_of(state), step
