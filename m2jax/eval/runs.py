"""A training run's directory (WORKDIR of experiments.pretrain, or one phase
of experiments.mtp_growth): its configs, one of its checkpoints as model
variables (for evaluation), and that checkpoint exported to the hub layout.
"""

from __future__ import annotations

import json
import os

import jax

from m2jax import hf, model
from m2jax.config import ModelConfig, config_from_dict
from m2jax.data import DataConfig, make_tokenizer
from m2jax.errors import ExistingPathError, MissingPathError
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

CONFIG_FILE = "config.json"


def _runs_below(workdir: str) -> list[str]:
  """Run directories inside `workdir` (an mtp_growth WORKDIR holds one per
  phase: base/, copy/joint/, ...), relative to it."""
  found = []
  for root, dirs, files in os.walk(workdir):
    dirs.sort()
    if CONFIG_FILE in files and root != workdir:
      found.append(os.path.relpath(root, workdir))
      dirs.clear()  # a run's own subdirectories hold no runs
  return found


def load_configs(workdir: str) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The model, train and data configs a run saved in WORKDIR/config.json."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    runs = _runs_below(workdir) if os.path.isdir(workdir) else []
    hint = (f"; the runs inside it: {', '.join(runs)}" if runs
            else ": is it a pretrain --workdir?")
    raise MissingPathError(f"{workdir} holds no {CONFIG_FILE}{hint}")
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  return (config_from_dict(ModelConfig, raw["model"]),
          config_from_dict(TrainConfig, raw["train"]),
          config_from_dict(DataConfig, raw["data"]))


def _checkpointer(workdir: str) -> ckpt_lib.Checkpointer:
  # Read-only: the run may still be training and saving a step.
  return ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=1,
                               read_only=True)


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the run's complete checkpoints, oldest first."""
  checkpointer = _checkpointer(workdir)
  steps = checkpointer.steps()
  checkpointer.close()
  return steps


def load_run(workdir: str, step: int | None = None):
  """(model_config, data_config, tokenizer, variables, step) of checkpoint
  `step` of the run in `workdir` (None: its newest complete one), on this
  process's first device whatever mesh the run was trained on.

  Reading changes nothing in `workdir` (the run may still be training): a
  step that fails to load raises (a resuming run would quarantine it,
  m2jax.train.checkpoint), a step being saved is left alone.
  MissingPathError, one line, when the run has no checkpoint or none of
  `step` (listing its steps).
  """
  mcfg, tcfg, dcfg = load_configs(workdir)
  # Shapes only, no memory; placed explicitly, or orbax would look for the
  # devices of the mesh the run was saved from.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  state = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
      jax.eval_shape(lambda: state_lib.init_state(
          mcfg, tcfg, model.init(mcfg, jax.random.key(0)))))
  checkpointer = _checkpointer(workdir)
  try:
    steps = checkpointer.steps()
    if not steps:
      raise MissingPathError(f"{workdir} holds no checkpoint yet")
    step = steps[-1] if step is None else step
    state, _, _ = checkpointer.restore(step, state)
  finally:
    checkpointer.close()
  tokenizer = make_tokenizer(dcfg, os.path.join(workdir, "tokenizer"))
  return mcfg, dcfg, tokenizer, state_lib.variables_of(state), step


def export_run(workdir: str, out: str, *, step: int | None = None,
               overwrite: bool = False) -> tuple[ModelConfig, int]:
  """Write checkpoint `step` (None: the newest) of the run in `workdir` to
  directory `out` in the hub layout (m2jax.hf.save); (its config, step).

  `out` may be missing or empty; one that holds files is refused
  (ExistingPathError) unless `overwrite`. Everything is checked before the
  checkpoint is read: the run's config must have a hub layout (no dense FFN,
  no sliding-window layers, no sinks: hf.CheckpointError) and `step` must
  exist. `m2jax.hf.load(out)` gives the same variables and, for a float32
  run, the same logits (it computes in the checkpoint's dtype).
  """
  if not overwrite and os.path.exists(out) and not (
      os.path.isdir(out) and not os.listdir(out)):
    raise ExistingPathError(
        f"{out} exists and is not an empty directory; choose another "
        "output directory or overwrite it (--overwrite)")
  mcfg, _, _ = load_configs(workdir)
  hf.config_to_hf(mcfg)  # refuses what the hub layout cannot hold
  steps = checkpoint_steps(workdir)
  if step is not None and step not in steps:
    raise MissingPathError(
        f"{workdir} has no checkpoint of step {step}; its steps: "
        f"{', '.join(map(str, steps)) or 'none'}")
  mcfg, _, _, variables, step = load_run(workdir, step)
  hf.save(out, mcfg, jax.device_get(variables), overwrite=True)
  return mcfg, step
