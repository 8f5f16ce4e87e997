"""Flags the training commands share (experiments.pretrain, experiments.sft):
the cadence of logs, evals and checkpoints, and reading flags back as config
fields for --resume (m2jax.train.resume checks them against the run).

  train_flags.define_cadence(eval_every=100, eval_batches=8)  # at import
  given = train_flags.given({"steps": "steps", ...})           # in main
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import inspect
import sys
from typing import Any

from absl import flags

from m2jax import config as config_lib
from m2jax.train import resume
from m2jax.train.config import GNMRConfig

FLAGS = flags.FLAGS

# {flag: TrainConfig field} of the cadence flags.
CADENCE_FLAGS = {"log_every": "log_every", "eval_every": "eval_every",
                 "eval_batches": "eval_batches",
                 "checkpoint_every": "checkpoint_every",
                 "keep_checkpoints": "keep_checkpoints",
                 "async_checkpoint": "async_checkpoint",
                 "checkpoint_device_copy": "checkpoint_device_copy"}


def define_cadence(*, eval_every: int, eval_batches: int,
                   flag_values: flags.FlagValues = FLAGS) -> None:
  """--log_every, --eval_every, --eval_batches, --checkpoint_every,
  --keep_checkpoints, --async_checkpoint and --checkpoint_device_copy, with
  the command's own eval defaults. They are
  registered to the calling script, so its --helpshort lists them."""
  kw = _registered_to(inspect.currentframe().f_back, flag_values)
  flags.DEFINE_integer("log_every", 10, "Steps between metric lines.", **kw)
  flags.DEFINE_integer("eval_every", eval_every,
                       "Steps between validation evals.", **kw)
  flags.DEFINE_integer("eval_batches", eval_batches,
                       "Validation batches per eval.", **kw)
  flags.DEFINE_integer("checkpoint_every", 100,
                       "Steps between checkpoints.", **kw)
  flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept.", **kw)
  _define_save_modes(kw)


def define_save_modes(flag_values: flags.FlagValues = FLAGS) -> None:
  """--async_checkpoint and --checkpoint_device_copy alone (for a command
  with its own cadence flags), registered to the calling script."""
  _define_save_modes(_registered_to(inspect.currentframe().f_back,
                                    flag_values))


def _define_save_modes(kw: dict) -> None:
  flags.DEFINE_bool("async_checkpoint", True,
                    "Write checkpoints in the background while training "
                    "goes on (false: each save blocks until written).", **kw)
  flags.DEFINE_bool("checkpoint_device_copy", True,
                    "With --async_checkpoint: copy the state on the device "
                    "and move it to host memory in the background (one "
                    "more state in device memory meanwhile; false: each "
                    "save waits for the host copy).", **kw)


def _registered_to(frame, flag_values: flags.FlagValues) -> dict:
  """DEFINE_* keywords registering flags to the module of `frame`."""
  caller = frame.f_globals["__name__"]
  # absl names the main module by its path (sys.argv[0]).
  return {"flag_values": flag_values,
          "module_name": sys.argv[0] if caller == "__main__" else caller}


def given(table: Mapping[str, str], *, explicit_only: bool = True,
          convert: Mapping[str, Callable[[Any], Any]] | None = None,
          flag_values: flags.FlagValues = FLAGS
          ) -> dict[str, resume.Given]:
  """{field: Given} of the flags of `table` ({flag: config field}): only
  those on the command line when `explicit_only`. `convert` turns a flag's
  value into the field's ({flag: function}, e.g. a parser)."""
  convert = convert or {}
  out = {}
  for flag, field in table.items():
    holder = flag_values[flag]
    if explicit_only and not holder.present:
      continue
    value = holder.value
    out[field] = resume.Given(convert[flag](value) if flag in convert
                              else value, f"--{flag}={value}")
  return out


def parse_gnmr(items):
  """--gnmr's value -> TrainConfig.gnmr: None (unset), GNMRConfig() ('on'),
  or GNMRConfig with FIELD=VALUE overrides."""
  if not items:
    return None
  items = [i for i in items if i.strip() != "on"]
  return config_lib.apply_overrides(GNMRConfig(), items)
