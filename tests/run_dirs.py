"""Run directories as experiments.pretrain leaves them, written without
training (random values from numpy, shapes from jax.eval_shape: nothing is
compiled), for the tests of what reads a run: evaluation and export.
"""

import os

import jax
import numpy as np

from m2jax import config as config_lib
from m2jax.config import config_to_dict
from m2jax.data import DataConfig
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

# TINY with one layer (float32 parameters and compute, one MTP module).
MODEL = config_lib.TINY.replace(num_layers=1)


def write_run(workdir, steps=(1, 2), mcfg=MODEL) -> dict:
  """A run in `workdir` with checkpoints at `steps`; {step: variables}.

  Every step holds other random values (scale 0.3, so logits differ by
  more than rounding between steps and between float32 and bf16 compute).
  """
  tcfg = TrainConfig(steps=max(steps))
  dcfg = DataConfig(seq_len=16, batch_size=2)
  meta = {"model": config_to_dict(mcfg), "train": config_to_dict(tcfg),
          "data": config_to_dict(dcfg)}
  shapes = jax.eval_shape(lambda: state_lib.create_state(mcfg, tcfg))
  os.makedirs(workdir, exist_ok=True)
  ckpt_lib.write_json(os.path.join(workdir, "config.json"), meta)
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=len(steps))
  saved = {}
  for step in steps:
    rng = np.random.default_rng(step)
    state = jax.tree.map(
        lambda s, rng=rng: (0.3 * rng.normal(size=s.shape)).astype(s.dtype)
        if np.issubdtype(s.dtype, np.floating) else np.zeros(s.shape, s.dtype),
        shapes)
    state = state._replace(step=np.asarray(step, np.int32))
    checkpointer.save(step, state, {}, meta)
    saved[step] = state_lib.variables_of(state)
  checkpointer.close()
  return saved
