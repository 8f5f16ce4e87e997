"""Orbax checkpoints of the whole run: train state, data iterator, configs.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each
step into a temporary directory and renames it when complete, so a crash
never leaves a half-written step that looks finished. On restore the newest
step that loads is used: a corrupt or partial newest step is reported and
the previous complete one is taken. A checkpoint whose model config differs
from the run's is refused with the differing field named.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from m2jax.config import ConfigError, config_to_dict

log = logging.getLogger(__name__)


def write_json(path: str, obj) -> None:
  """Write JSON atomically: a crash leaves the old file or the new one."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def check_same_config(saved: dict, config, what: str) -> None:
  """Raise ConfigError naming the first field where `config` != `saved`."""
  current = config_to_dict(config)
  for field in sorted(set(saved) | set(current)):
    if saved.get(field) != current.get(field):
      raise ConfigError(
          f"{type(config).__name__}.{field}: the checkpoint's {what} has "
          f"{saved.get(field)!r} but this run has {current.get(field)!r}; "
          "use a matching config or a fresh --workdir")


class Checkpointer:
  """Save / restore {state, data-iterator state, meta} every N steps."""

  def __init__(self, directory: str, *, keep: int):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False,
            cleanup_tmp_directories=True))

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, data_state: dict, meta: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def restore_latest(self, abstract_state) -> tuple[int, Any, dict, dict] | None:
    """(step, state, data_state, meta) of the newest step that loads.

    Steps that fail to load are moved to ../checkpoints_corrupt/ (kept for
    inspection, out of the way of the steps this run will save again).
    """
    for step in reversed(self.steps()):
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        log.warning("checkpoint step %d in %s is unreadable (%s: %s); "
                    "trying the previous one", step, self.directory,
                    type(e).__name__, str(e).splitlines()[0][:200])
        print(f"WARNING: checkpoint step {step} is corrupt or partial "
              f"({type(e).__name__}); falling back to an earlier step")
        self._quarantine(step)
        continue
      return step, restored["state"], restored["data"], restored["meta"]
    return None

  def _quarantine(self, step: int) -> None:
    corrupt = os.path.join(os.path.dirname(self.directory),
                           "checkpoints_corrupt")
    os.makedirs(corrupt, exist_ok=True)
    target = os.path.join(corrupt, f"{step}.{int(time.time())}")
    os.rename(os.path.join(self.directory, str(step)), target)
    print(f"moved the unreadable step {step} to {target}")
    self._manager.reload()

  def close(self) -> None:
    self._manager.close()


def abstract(tree):
  """ShapeDtypeStructs (with shardings) for restoring into `tree`'s layout."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
