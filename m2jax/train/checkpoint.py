"""Orbax checkpoints of the whole run: train state, data iterator, configs.

Layout: WORKDIR/checkpoints/<step>/{state, data, meta}. Orbax writes each
step into a temporary directory and renames it when complete, so a crash
never leaves a half-written step that looks finished.

Saving is asynchronous for the trainers (`asynchronous=True`, from
TrainConfig.async_checkpoint): `save` returns once the state's arrays are
copied to host memory (orbax's device-to-host copy, which completes before
`save` returns), and the files are written in a background thread while
training goes on. So the next step may donate and overwrite the state's
device buffers: what is written is the state at the saved step. With
`device_copy=True` (TrainConfig.checkpoint_device_copy) `save` does not wait
for the host copy either: it copies the state on the device (a pass over
device memory, a few milliseconds, enqueued before any later step can
donate the buffers) and hands that copy to orbax in a background thread,
so training pauses for neither the ~1 s host copy of a large state nor the
writes; the copy holds one more state's worth of device memory until orbax
has written it. Where the copy would not fit beside the run's peak device
memory so far (or its allocation fails), this save and the later ones take
the host copy instead, said once; so do saves with several processes,
where orbax's save runs collectives that must not leave the main thread.
A pending save is waited for, and its failure raised, before the next save, before
any read (steps, restore, meta) and in `close`, which every trainer calls
on every way out. A process killed while a save is in flight leaves only
orbax's temporary directory, removed at the next start: the previous step
is what a resume finds.

Resuming tells the user's mistakes from damaged files, because only the
second may move anything:
  1. a step whose meta holds another model or data config than the run's, or
     whose saved state has another tree (e.g. another optimizer), is refused
     with the difference named (ConfigError) and nothing is touched. These
     checks read JSON metadata only, before any state is restored;
  2. a step that matches but fails to load (unreadable, corrupt or partial
     files) is moved to WORKDIR/checkpoints_corrupt/ and the previous step
     is tried. A step whose state has no tree metadata is such a step,
     never another config: a kill while orbax deletes an old step
     (max_to_keep) leaves one;
  3. if no step loads, or only quarantined steps are left, resuming is
     refused (ResumeError) instead of starting again from step 0.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import threading
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from m2jax.config import ConfigError, config_to_dict, without_moved_fields
from m2jax.data.tokenizer_files import unique_tmp
from m2jax.errors import MissingPathError, UserError

log = logging.getLogger(__name__)

# One orbax `save` call at a time in this process. With device_copy each
# Checkpointer calls it from its own thread, and two of them at once (the
# models of one vmapped sweep program, saved in the same step) raced inside
# orbax: both created step 1's temporary directories of one run, and the
# save failed with "Directory not empty" (tests/test_sweep.py, once in
# several runs). The calls only start orbax's writes, which still overlap.
_ORBAX_SAVE = threading.Lock()

CORRUPT_DIR = "checkpoints_corrupt"  # beside checkpoints/, in the workdir


class ResumeError(UserError):
  """A run asked to resume has checkpoints, but none that loads."""


class CheckpointError(RuntimeError):
  """A save did not complete (e.g. a write failed in the background)."""


def write_json(path: str, obj) -> None:
  """Write JSON atomically: a crash leaves the old file or the new one (its
  folder made if missing). Each writer has its own temporary file
  (tokenizer_files.unique_tmp), so processes writing the same path at once
  (sweep invocations sharing a directory) leave one whole file, never an
  interleaving."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = unique_tmp(path)
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=1)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def config_differences(saved: dict, config) -> list[tuple[str, Any, Any]]:
  """(field, saved value, this config's value) wherever the two differ."""
  current = config_to_dict(config)
  # A run saved before some fields moved to Settings still matches.
  saved = without_moved_fields(type(config), saved, warn=False)
  return [(field, saved.get(field), current.get(field))
          for field in sorted(set(saved) | set(current))
          if saved.get(field) != current.get(field)]


def check_same_config(saved: dict, config, what: str) -> None:
  """Raise ConfigError naming the first field where `config` != `saved`
  (and how many others differ: another preset differs in many)."""
  diffs = config_differences(saved, config)
  if diffs:
    (field, old, new), others = diffs[0], [d[0] for d in diffs[1:]]
    also = f" ({', '.join(others)} differ too)" if others else ""
    raise ConfigError(
        f"{type(config).__name__}.{field}: {what} has {old!r} but this run "
        f"has {new!r}{also}; resume with the run's config or use a fresh "
        "--workdir")


def _first_line(e: Exception) -> str:
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


@jax.jit
def _copy_arrays(arrays):
  return [jnp.copy(x) for x in arrays]


def _no_room_for(arrays) -> str | None:
  """Why a copy of `arrays` would not fit beside the peak device memory
  use so far (None: it fits, or the devices keep no statistics)."""
  need = {}
  for x in arrays:
    for shard in x.addressable_shards:
      need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
  for device, nbytes in need.items():
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
    if limit and limit - peak < nbytes:
      return (f"{device}: {nbytes / 2**30:.1f} GiB needed, "
              f"{(limit - peak) / 2**30:.1f} GiB free beside the peak")
  return None


def _out_of_memory(e: Exception) -> bool:
  """Failures that say nothing about the files (never quarantine for them)."""
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)


class Checkpointer:
  """Save / restore {state, data-iterator state, meta} every N steps."""

  def __init__(self, directory: str, *, keep: int, read_only: bool = False,
               asynchronous: bool = False, device_copy: bool = False):
    """`read_only`: for reading a run that may still be training (e.g.
    evaluating it): its unfinished steps are left alone. `asynchronous`:
    `save` returns before the files are written (module docstring); the
    caller must `close` (or `wait`) before it exits. `device_copy` (with
    `asynchronous`): `save` returns before the state reaches host memory,
    a copy of it on the device going there in the background."""
    self.directory = os.path.abspath(directory)
    self.corrupt_directory = os.path.join(os.path.dirname(self.directory),
                                          CORRUPT_DIR)
    # The unfinished steps of a killed run (orbax's temporary directories)
    # are removed here, on the primary host as orbax would, and before the
    # manager lists the steps. Not by orbax's cleanup_tmp_directories: it
    # runs in a background thread that no public call waits for, and a run
    # refused right after this (e.g. a resume with another config) would
    # exit under it, the thread printing a traceback.
    if jax.process_index() == 0 and not read_only:
      for tmp in ocp.path.step.all_temporary_paths(self.directory):
        tmp.get().rmtree()
    # Handlers named up front so that meta and the state's tree metadata can
    # be read alone, before (and instead of) restoring a state.
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous))
    self.asynchronous = asynchronous
    # One process only: orbax's save runs collectives across processes
    # (barriers, gathers), which from a background thread could interleave
    # with the training step's own and deadlock or fail.
    self.device_copy = (device_copy and asynchronous
                        and jax.process_count() == 1)
    self._pending: int | None = None  # the step being written, if any
    self._thread: threading.Thread | None = None  # device_copy's handover
    self._thread_error: Exception | None = None
    self._closed = False

  def steps(self) -> list[int]:
    self.wait()
    return sorted(self._manager.all_steps())

  def quarantined(self) -> list[str]:
    """Entries of checkpoints_corrupt/ ("<step>.<unix time>"), sorted."""
    if not os.path.isdir(self.corrupt_directory):
      return []
    return sorted(os.listdir(self.corrupt_directory))

  def save(self, step: int, state, data_state: dict, meta: dict) -> None:
    """Save `step`. Asynchronous: returns once `state` is copied to host
    memory (its device buffers may then be donated), the files still being
    written; the previous save is completed (or its failure raised) first.
    """
    self.wait()
    # The JSON parts are written later too: the caller may change its dicts.
    data_state, meta = copy.deepcopy(data_state), copy.deepcopy(meta)
    snapshot = self._device_snapshot(state) if self.device_copy else None
    if snapshot is not None:
      # Not a daemon: orbax's writer threads inherit it, and a process
      # leaving without close() must still finish (or not start) them.
      self._thread = threading.Thread(
          target=self._save_in_background, name=f"checkpoint-{step}",
          args=(step, snapshot, data_state, meta))
      self._thread.start()
    else:
      self._save(step, state, data_state, meta)
    self._pending = step
    if not self.asynchronous:
      self.wait()

  def _save(self, step: int, state, data_state: dict, meta: dict) -> None:
    with _ORBAX_SAVE:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state),
          meta=ocp.args.JsonSave(meta)), force=True)

  def _save_in_background(self, step, snapshot, data_state, meta) -> None:
    try:
      self._save(step, snapshot, data_state, meta)
    except Exception as e:  # pylint: disable=broad-except
      self._thread_error = e  # raised by wait(), in the caller's thread

  def _device_snapshot(self, state):
    """A copy of `state` (its device arrays copied on the device, its host
    values copied), or None where device memory cannot hold one beside the
    run's peak so far: the copy lives until orbax has written it, while
    the next steps run. Without that room the save waits for the host copy
    instead, this save and every later one (said once)."""
    leaves, treedef = jax.tree.flatten(state)
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    why = _no_room_for(arrays)
    if why is None:
      try:
        # One program for the whole tree, waited for here so that a failed
        # allocation is raised here, not in the next train step.
        copies = iter(jax.block_until_ready(_copy_arrays(arrays)))
      except Exception as e:  # pylint: disable=broad-except
        if not _out_of_memory(e):
          raise
        why = _first_line(e)
    if why is not None:
      self.device_copy = False
      log.warning("checkpoint: no device memory for a copy of the state "
                  "(%s); saves wait for the host copy", why)
      return None
    return jax.tree.unflatten(treedef, [
        next(copies) if isinstance(x, jax.Array) else copy.deepcopy(x)
        for x in leaves])

  def wait(self) -> None:
    """Complete the save in flight, if any; CheckpointError if it failed
    (a run must not go on believing it has a checkpoint it does not have).

    Orbax raises a failed background write here, or in some failures only
    logs it and leaves the step unfinished (never renamed from its
    temporary directory): the step's directory is checked as well.
    """
    if self._pending is None:
      return
    if self._thread is not None:   # device_copy: orbax's save itself
      self._thread.join()   # (interrupted, a later wait joins it again)
      self._thread = None
    step, self._pending = self._pending, None
    error, self._thread_error = self._thread_error, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      error = error or e
    if error is None and (
        jax.process_index() != 0
        or os.path.isdir(os.path.join(self.directory, str(step)))):
      return
    why = (_first_line(error) if error is not None
           else "its files were not completed; orbax's log says why")
    self._manager.reload()  # forget the step orbax still lists
    raise CheckpointError(
        f"checkpoint step {step} in {self.directory} failed to save ({why}); "
        "the previous checkpoints are intact")

  def check_resume(self, configs: Mapping[str, Any] | None = None) -> None:
    """Refuse a resume that cannot work, reading JSON only, moving nothing.

    `configs` maps meta keys to this run's configs (e.g. {"model": ...,
    "data": ...}); every step whose meta reads must hold the same ones
    (ConfigError naming the first differing field). A step whose meta does
    not read is left for `restore_latest` to judge. With no step but
    quarantined ones, resuming would silently start from step 0: ResumeError.
    """
    steps, quarantined = self.steps(), self.quarantined()
    if not steps and quarantined:
      raise ResumeError(
          f"{self.directory} holds no checkpoint to resume, but "
          f"{self.corrupt_directory} holds {len(quarantined)} that failed to "
          f"load ({', '.join(quarantined)}); refusing to start again from "
          "step 0. Inspect or repair them, or start over in a fresh "
          "--workdir (or remove that directory)")
    if not configs:
      return
    for step in reversed(steps):
      meta = self._read_meta(step)
      if meta is None:
        continue  # unreadable: restore_latest quarantines it
      for key, config in configs.items():
        check_same_config(meta.get(key) or {}, config,
                          f"checkpoint step {step} in {self.directory}")

  def restore_latest(self, abstract_state, *,
                     configs: Mapping[str, Any] | None = None,
                     train_config=None) -> tuple[int, Any, dict, dict] | None:
    """(step, state, data_state, meta) of the newest step that loads.

    None only when there is nothing to resume (no step, none quarantined).
    First `check_resume(configs)`; then every step's saved state tree must
    match `abstract_state`'s paths and shapes, or ConfigError names the
    first difference (with the TrainConfig fields that differ from
    `train_config`, the likely cause). Only then are states restored,
    newest first; a step that fails is moved to checkpoints_corrupt/ (kept
    for inspection, out of the way of the steps this run will save again).
    If every step fails: ResumeError.
    """
    self.check_resume(configs)
    steps = self.steps()
    if not steps:
      return None
    unreadable = {}
    for step in reversed(steps):
      try:
        where = self._state_difference(step, abstract_state)
      except Exception as e:  # pylint: disable=broad-except
        unreadable[step] = e  # judged below, after every step was checked
        continue
      if where is not None:
        raise ConfigError(
            f"checkpoint step {step} in {self.directory} holds another train "
            f"state than this run: {where}"
            f"{self._train_hint(step, train_config)}; resume with the run's "
            "config or use a fresh --workdir")
    for step in reversed(steps):
      error = unreadable.get(step)
      if error is None:
        try:
          restored = self._manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state),
              data=ocp.args.JsonRestore(),
              meta=ocp.args.JsonRestore()))
          return step, restored["state"], restored["data"], restored["meta"]
        except Exception as e:  # pylint: disable=broad-except
          if _out_of_memory(e):
            raise
          error = e
      log.warning("checkpoint step %d in %s is unreadable (%s); trying the "
                  "previous one", step, self.directory, _first_line(error))
      print(f"WARNING: checkpoint step {step} is corrupt or partial "
            f"({_first_line(error)}); falling back to an earlier step")
      self._quarantine(step)
    raise ResumeError(
        f"no checkpoint in {self.directory} loads: steps {steps} failed to "
        f"load and were moved to {self.corrupt_directory}; refusing to start "
        "again from step 0. Inspect or repair them, or start over in a fresh "
        "--workdir (or remove that directory)")

  def restore(self, step: int, abstract_state) -> tuple[Any, dict, dict]:
    """(state, data_state, meta) of exactly `step`: no fallback to another
    step, nothing moved (for reading a run, e.g. evaluating one step).

    MissingPathError lists the steps there are when `step` is not one (or
    says that its files are incomplete); ConfigError names where the saved
    state's tree differs from `abstract_state`'s.
    """
    steps = self.steps()
    if step not in steps:
      raise MissingPathError(
          f"{self.directory} has no checkpoint of step {step}; its steps: "
          f"{', '.join(map(str, steps)) or 'none'}")
    where = self._state_difference(step, abstract_state)
    if where is not None:
      raise ConfigError(f"checkpoint step {step} in {self.directory} holds "
                        f"another train state than its run's config: {where}")
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["data"], restored["meta"]

  def newest_meta(self) -> dict | None:
    """The meta (configs) of the newest step whose meta reads, or None."""
    for step in reversed(self.steps()):
      meta = self._read_meta(step)
      if meta is not None:
        return meta
    return None

  def _read_meta(self, step: int) -> dict | None:
    """The step's meta (configs), or None when it does not read."""
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # pylint: disable=broad-except
      return None

  def _state_difference(self, step: int, abstract_state) -> str | None:
    """Where the saved state's tree differs from `abstract_state` (a path
    missing on one side, or another shape); None if it does not.

    Reads the state's tree metadata only; raises if that does not read.
    """
    metadata = self._manager.item_metadata(step)["state"]
    if metadata is None:
      # Orbax reads a missing tree-metadata file as None, not as an error:
      # what a step keeps when its deletion (max_to_keep, in the background
      # after a later save) or its write is cut short by a kill. Damage,
      # not another tree (an empty tree would name every leaf as missing).
      raise MissingPathError(
          f"checkpoint step {step} in {self.directory} is incomplete: its "
          "state has no tree metadata (a deletion or save of it was cut "
          "short)")
    saved = ocp.tree.to_flat_dict(metadata)
    wanted = ocp.tree.to_flat_dict(abstract_state)
    for path in sorted(set(saved) | set(wanted), key=str):
      name = "/".join(map(str, path))
      if path not in wanted:
        return f"{name} is in the checkpoint, not in this run"
      if path not in saved:
        return f"{name} is in this run, not in the checkpoint"
      if tuple(saved[path].shape) != tuple(wanted[path].shape):
        return (f"{name} has shape {tuple(saved[path].shape)} in the "
                f"checkpoint, {tuple(wanted[path].shape)} in this run")
    return None

  def _train_hint(self, step: int, train_config) -> str:
    """The TrainConfig fields that differ from the step's (the likely cause
    of another state tree: e.g. the optimizer)."""
    meta = self._read_meta(step) if train_config is not None else None
    if not meta or "train" not in meta:
      return ""
    diffs = config_differences(meta["train"], train_config)
    return "; the TrainConfig fields that differ: " + ", ".join(
        f"{field} ({old!r} in the checkpoint, {new!r} here)"
        for field, old, new in diffs) if diffs else ""

  def _quarantine(self, step: int) -> None:
    os.makedirs(self.corrupt_directory, exist_ok=True)
    target = os.path.join(self.corrupt_directory,
                          f"{step}.{int(time.time())}")
    os.rename(os.path.join(self.directory, str(step)), target)
    print(f"moved the unreadable step {step} to {target}")
    self._manager.reload()

  def close(self) -> None:
    """Complete the save in flight (raising if it failed) and release the
    manager. Safe to call again (trainers call it on every way out)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
    finally:
      self._manager.close()


def abstract(tree):
  """ShapeDtypeStructs (with shardings) for restoring into `tree`'s layout."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
