"""Checkpointer housekeeping and asynchronous saves (resuming is
tests/test_resume.py; killed saves tests/test_interrupts.py)."""

import asyncio
import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from m2jax.config import ConfigError
from m2jax.errors import MissingPathError
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train.checkpoint import Checkpointer, CheckpointError, abstract


def test_opening_removes_the_unfinished_steps_of_a_killed_run(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ck = Checkpointer(directory, keep=3)
  ck.save(1, {"w": np.arange(4.0)}, {"next_document": 3}, {"step": 1})
  ck.close()
  # What a run killed while writing step 2 leaves: orbax's temporary
  # directory, never renamed to "2".
  tmp = os.path.join(directory, f"2{ocp.path.step.TMP_DIR_SUFFIX}-1234")
  shutil.copytree(os.path.join(directory, "1"), tmp)
  assert ocp.path.step.all_temporary_paths(directory)
  ck = Checkpointer(directory, keep=3)
  # Gone once the Checkpointer exists (no background thread left running).
  assert sorted(os.listdir(directory)) == ["1"]
  assert ck.steps() == [1]
  ck.close()


class _HeldFinalize:
  """Holds orbax's last act of a save (the rename of its temporary
  directory) until `release()`: the save stays in flight meanwhile, its
  arrays already copied to host, its files written or being written."""

  def __init__(self, monkeypatch, fail=False):
    self.released = threading.Event()
    cls = ocp.path.atomicity.AtomicRenameTemporaryPath
    finalize = cls.finalize

    async def held(path):
      await asyncio.to_thread(self.released.wait, 30)
      if fail:
        raise OSError("disk full (a test's)")
      await finalize(path)

    monkeypatch.setattr(cls, "finalize", held)

  def release(self, after=0.0):
    threading.Timer(after, self.released.set).start()


def _in_flight(directory, step) -> bool:
  return not os.path.isdir(os.path.join(directory, str(step)))


def test_async_save_holds_the_state_of_its_step_while_donated_steps_run(
    tmp_path, monkeypatch):
  directory = str(tmp_path / "checkpoints")
  held = _HeldFinalize(monkeypatch)
  ck = Checkpointer(directory, keep=3, asynchronous=True)
  # The train step donates its state, as step.jit_steps' does: the buffers
  # saved are reused (or freed) by the steps that run during the save.
  train = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s),
                  donate_argnums=0)
  state = train({"w": jnp.arange(4096.0), "m": {"v": jnp.ones((8, 16))}})
  saved = jax.tree.map(np.array, state)  # copies of the values at step 1
  data = {"next_document": 3}
  ck.save(1, state, data, {"step": 1})
  data["next_document"] = 99  # the loop's dict moves on too
  assert _in_flight(directory, 1)
  for _ in range(3):
    state = train(state)
  assert _in_flight(directory, 1)  # the steps ran while the save was held
  assert not np.array_equal(np.asarray(state["w"]), saved["w"])
  # A read waits for the save in flight (released in 0.2 s): without the
  # wait it would find step 1 unwritten and quarantine it.
  held.release(after=0.2)
  step, restored, data_state, meta = ck.restore_latest(abstract(state))
  assert (step, data_state, meta) == (1, {"next_document": 3}, {"step": 1})
  jax.tree.map(np.testing.assert_array_equal, restored, saved)
  assert ck.quarantined() == []
  ck.close()


def test_a_failed_background_save_is_raised_not_forgotten(tmp_path,
                                                         monkeypatch):
  directory = str(tmp_path / "checkpoints")
  held = _HeldFinalize(monkeypatch, fail=True)
  ck = Checkpointer(directory, keep=3, asynchronous=True)
  ck.save(1, {"w": np.arange(4.0)}, {}, {})
  held.release()
  with pytest.raises(CheckpointError, match="step 1 .* failed to save"):
    ck.close()
  assert Checkpointer(directory, keep=3).steps() == []


class _HeldManagerSave:
  """Holds orbax's CheckpointManager.save (its device-to-host copy and all)
  until `release()`, recording which thread called it and raising there
  when `fail`."""

  def __init__(self, monkeypatch, fail=False):
    self.released, self.entered = threading.Event(), threading.Event()
    self.threads = []
    save = ocp.CheckpointManager.save

    def held(manager, *args, **kwargs):
      self.threads.append(threading.current_thread())
      self.entered.set()
      self.released.wait(30)
      if fail:
        raise OSError("no space left (a test's)")
      return save(manager, *args, **kwargs)
    monkeypatch.setattr(ocp.CheckpointManager, "save", held)


def test_device_copy_save_returns_before_the_host_copy_and_keeps_its_step(
    tmp_path, monkeypatch):
  """With device_copy, `save` hands a device copy of the state to orbax in
  a background thread: it returns while orbax has not even started, the
  steps after it donate (delete) the saved buffers, and what is written is
  still the state of the saved step (without the copy, orbax would read
  deleted arrays and the save would fail)."""
  directory = str(tmp_path / "checkpoints")
  held = _HeldManagerSave(monkeypatch)
  ck = Checkpointer(directory, keep=3, asynchronous=True, device_copy=True)
  train = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s),
                  donate_argnums=0)
  state = train({"w": jnp.arange(4096.0), "m": {"v": jnp.ones((8, 16))},
                 "step": np.int32(1)})   # a host value rides along
  saved = jax.tree.map(np.array, state)
  old = state["w"]
  ck.save(1, state, {"next_document": 3}, {"step": 1})
  assert held.entered.wait(30) and not held.released.is_set()
  assert held.threads[0] is not threading.main_thread()
  for _ in range(3):
    state = train(state)
  assert old.is_deleted()   # the saved step's buffers were donated
  held.released.set()
  step, restored, data_state, _ = ck.restore_latest(abstract(state))
  assert (step, data_state) == (1, {"next_document": 3})
  jax.tree.map(np.testing.assert_array_equal, restored, saved)
  ck.close()


def test_device_copy_failures_are_raised_and_memory_falls_back(
    tmp_path, monkeypatch):
  directory = str(tmp_path / "checkpoints")
  held = _HeldManagerSave(monkeypatch, fail=True)
  ck = Checkpointer(directory, keep=3, asynchronous=True, device_copy=True)
  ck.save(1, {"w": jnp.arange(4.0)}, {}, {})
  held.released.set()
  with pytest.raises(CheckpointError, match="step 1 .*OSError: no space"):
    ck.close()
  # No device memory for the copy: the save takes the host copy in the
  # caller's thread instead (and still completes), as do later saves.
  monkeypatch.undo()
  held = _HeldManagerSave(monkeypatch)
  held.released.set()

  def out_of_memory(arrays):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (a test's)")
  monkeypatch.setattr(ckpt_lib, "_copy_arrays", out_of_memory)
  ck = Checkpointer(directory, keep=3, asynchronous=True, device_copy=True)
  ck.save(2, {"w": jnp.arange(4.0)}, {}, {})
  ck.save(3, {"w": jnp.arange(4.0)}, {}, {})
  assert held.threads == [threading.main_thread()] * 2
  assert not ck.device_copy and ck.steps() == [2, 3]
  ck.close()


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def _array_on(device, nbytes):
  shard = type("Shard", (), {"device": device,
                             "data": np.zeros(nbytes, np.uint8)})
  return type("Array", (), {"addressable_shards": [shard, shard]})


def test_the_device_copy_needs_room_beside_the_peak_memory_use():
  """The copy lives while the next steps run: it must fit beside the run's
  peak so far, per device (a device without statistics, a CPU, is not
  refused)."""
  gpu = _Device({"bytes_limit": 100, "peak_bytes_in_use": 60,
                 "bytes_in_use": 20})
  room = ckpt_lib._no_room_for  # pylint: disable=protected-access
  assert room([_array_on(gpu, 20)]) is None   # 2 shards: 40 of 40 bytes
  assert room([_array_on(gpu, 20), _array_on(gpu, 1)]).endswith(
      "free beside the peak")
  assert room([_array_on(_Device(None), 10**9)]) is None


def _cut_deletion_short(directory, step):
  """What a run SIGKILLed while orbax deletes an old step (max_to_keep, in
  the background after a later save) leaves, as seen on a real kill: its
  parallel deleter removes every file first, the directories last."""
  for root, _, files in os.walk(os.path.join(directory, str(step))):
    for name in files:
      os.remove(os.path.join(root, name))


def test_a_step_whose_deletion_was_cut_short_is_damage_not_another_config(
    tmp_path):
  """Orbax reads the missing tree metadata of such a step as None: once
  taken for an empty tree, it refused every resume of the run as "another
  train state" (expert_bias, first in order, named as missing)."""
  directory = str(tmp_path / "checkpoints")
  state = {"expert_bias": {"b": np.zeros(2)}, "params": {"w": np.arange(4.0)}}
  ck = Checkpointer(directory, keep=3)
  for step in (1, 2, 3):
    ck.save(step, state, {"next": step}, {"step": step})
  ck.close()
  _cut_deletion_short(directory, 1)
  ck = Checkpointer(directory, keep=3)
  assert ck.steps() == [1, 2, 3]
  # Another tree is still the user's mistake, named; nothing is moved.
  other = abstract({**state, "params": {"w": np.arange(5.0)}})
  with pytest.raises(ConfigError, match=r"params/w has shape \(4,\) in the "
                     r"checkpoint, \(5,\) in this run"):
    ck.restore_latest(other)
  step, restored, data_state, _ = ck.restore_latest(abstract(state))
  assert (step, data_state) == (3, {"next": 3})
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert ck.steps() == [1, 2, 3] and ck.quarantined() == []
  with pytest.raises(MissingPathError, match="step 1 .* is incomplete"):
    ck.restore(1, abstract(state))
  # As the newest step it is quarantined and the previous one loads.
  _cut_deletion_short(directory, 3)
  assert ck.restore_latest(abstract(state))[0] == 2
  assert [q.split(".")[0] for q in ck.quarantined()] == ["3"]
  assert ck.steps() == [1, 2]
  ck.close()


def test_write_json_of_two_writers_at_once_leaves_one_whole_file(tmp_path):
  # Another process is half-way through writing the same path (two sweep
  # invocations sharing a directory): this write must not share its
  # temporary file, or the other's late bytes land in ours.
  path = str(tmp_path / "results.json")
  other = open(path + ".tmp", "w", encoding="utf-8")  # the old shared name
  other.write('{"runs": [1, 2')
  other.flush()
  ckpt_lib.write_json(path, {"runs": [3]})
  other.write(', 4, 5, 6, 7, 8]}')
  other.close()
  with open(path, encoding="utf-8") as f:
    assert json.load(f) == {"runs": [3]}
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "results.json", "results.json.tmp"]  # ours renamed, the other's left
  # As readable as open() makes a file (mkstemp's own files are 0600).
  umask = os.umask(0o022)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
