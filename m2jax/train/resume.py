"""Resuming a run from its directory: the saved configs, and the flags given.

A run saves what it trains (WORKDIR/config.json: the model, train and data
configs; every checkpoint's meta holds the same). Resuming reads them, so
the user need not repeat every flag:

  saved = resume.read_run_configs(workdir)        # refuses a missing run
  model = resume.resumed_config(ModelConfig, saved["model"], given)

where `given` holds only what the user gave explicitly (experiments/
pretrain.py knows which flags were present), each with the flag that gave
it. A given value that contradicts the saved one is refused naming the
field, the run's value and the flag; what was not given keeps the saved
value. The fields of `RESUMABLE_TRAIN_FIELDS` may change on resume: more
steps, another logging or checkpoint cadence.

How a step runs (m2jax.settings.Settings: kernels, the expert exchange,
remat) is never saved, so it always comes from the flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Mapping

from m2jax.config import ConfigError, config_from_dict
from m2jax.errors import MissingPathError
from m2jax.train import checkpoint as ckpt_lib

# TrainConfig fields a resume may change: how long to train, and how often
# (and whether in the background) to log, evaluate and checkpoint.
# Everything else would make the continued run another run (another
# optimizer, schedule, seed, losses).
RESUMABLE_TRAIN_FIELDS = frozenset({
    "steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
    "keep_checkpoints", "async_checkpoint", "checkpoint_device_copy"})

CONFIG_FILE = "config.json"
SAVED_PARTS = ("model", "train", "data")


@dataclasses.dataclass(frozen=True)
class Given:
  """A config field's value as the user gave it, and the flag that gave it
  (for the error message, e.g. "--preset=m2_small")."""
  value: Any
  flag: str


def _no_run(workdir: str, why: str) -> MissingPathError:
  parent = os.path.dirname(os.path.abspath(workdir))
  near = []
  if os.path.isdir(parent):
    near = difflib.get_close_matches(os.path.basename(workdir.rstrip("/")),
                                     sorted(os.listdir(parent)), n=1)
  hint = (f" (did you mean {os.path.join(os.path.dirname(workdir), near[0])}?)"
          if near else "")
  return MissingPathError(f"cannot resume {workdir}: {why}{hint}")


def read_run_configs(workdir: str) -> dict[str, dict]:
  """{"model", "train", "data"}: the saved config dicts of the run in
  `workdir`, from its config.json or else its newest checkpoint's meta.

  Raises MissingPathError when `workdir` does not exist or holds no run
  (resuming must never quietly start a new run in a mistyped directory).
  """
  if not os.path.isdir(workdir):
    raise _no_run(workdir, "the directory does not exist")
  saved = None
  path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  else:
    checkpoints = os.path.join(workdir, "checkpoints")
    if os.path.isdir(checkpoints):
      checkpointer = ckpt_lib.Checkpointer(checkpoints, keep=1)
      saved = checkpointer.newest_meta()
      checkpointer.close()
  if not saved or any(part not in saved for part in SAVED_PARTS):
    raise _no_run(workdir, f"it holds no run (no {CONFIG_FILE} and no "
                  "readable checkpoint)")
  return {part: saved[part] for part in SAVED_PARTS}


def resumed_config(cls, saved: Mapping[str, Any],
                   given: Mapping[str, Given], *,
                   may_change: frozenset[str] = frozenset()):
  """The saved config of class `cls`, with the `may_change` fields that
  `given` sets replaced.

  Any other field of `given` must equal the saved value, or ConfigError
  names it: "ModelConfig.hidden_size: the run has 64 but --preset=m2_small
  gives 1024" (and how many more fields that flag contradicts).
  """
  config = config_from_dict(cls, dict(saved))
  changes, conflicts = {}, []
  for field, g in given.items():
    if g.value == getattr(config, field):
      continue
    if field in may_change:
      changes[field] = g.value
    else:
      conflicts.append((field, g))
  if conflicts:
    (field, g), others = conflicts[0], conflicts[1:]
    also = (f" ({len(others)} more field{'s' * (len(others) > 1)} differ: "
            f"{', '.join(f for f, _ in others)})" if others else "")
    raise ConfigError(
        f"{cls.__name__}.{field}: the run has {getattr(config, field)!r} but "
        f"{g.flag} gives {g.value!r}{also}; leave the flag out to keep the "
        "run's value, or train in a fresh --workdir")
  return dataclasses.replace(config, **changes)
