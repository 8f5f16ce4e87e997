"""Multi-host training, run for real: two processes on this machine.

Each process has 4 fake CPU devices; `jax.distributed` joins them through a
coordinator on 127.0.0.1 (gloo carries their collectives) into one mesh of
8 devices, fsdp=2 x expert=4 (fsdp across the processes, as across
hosts). The tests run the real command,
`python -m experiments.pretrain ... --coordinator_address=127.0.0.1:PORT
--num_processes=2 --process_id=I`, and check that

  * its losses equal one process with 8 devices, same flags;
  * both processes write the checkpoint, and one process with 8 devices
    resumes it and continues with the same losses;
  * each process reads only its own rows of every global batch (by row id:
    none read twice, none skipped; tests/multihost_rows.py reports them);
  * killing one process ends the other with JAX's one-line error instead of
    leaving it blocked in a collective.

The pipeline's `rows` and the row ids are checked in this process first.

Compilation dominates; the processes of a test run at once. Every child is
killed when its test ends, whatever happened.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from m2jax import sharding
from m2jax.data import DataConfig, make_dataset, make_iterator, make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "fsdp=2,expert=4"
# One layer of the tiny preset, 4 steps of 8 rows of 64 tokens, a checkpoint
# every 2 steps; nothing the equality does not need (sample, late evals, the
# MTP module: its parameters are sharded and saved like the layer's).
FLAGS = ("--preset=tiny", "--override=num_layers=1",
         "--override=num_mtp_modules=0", "--mtp_depth=0", f"--mesh={MESH}",
         "--seq_len=64", "--batch_size=8", "--warmup_steps=1",
         "--log_every=1", "--eval_every=1000", "--eval_batches=1",
         "--sample_tokens=0")
STEPS = ("--steps=4", "--checkpoint_every=2")
# Two processes against one: the same float32 sums reduced in another order
# (gloo across processes, in-process otherwise), which after a few Adam
# steps differ by ~2e-7 relative (measured); wrong rows in the batch moved
# it by 1e-2 (measured, 2e-3 relative).
RTOL = 1e-5
# Seconds: any one process; --heartbeat_timeout of the killed run. Its
# survivor ended 8 s after the kill (JAX's default, 100 s: 52 s and more).
PROCESS_TIMEOUT = 400
HEARTBEAT_TIMEOUT = 10
SURVIVOR_TIMEOUT = HEARTBEAT_TIMEOUT + 20
# JAX 0.11.2's error when the coordination service stops hearing from a
# process (xla/pjrt/distributed/client.h); the lines after it name the task.
PEER_GONE = ("Terminating process because the JAX distributed service "
             "detected fatal errors. This most likely indicates that another "
             "task died")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, cache: str | None = None) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      f"--xla_force_host_platform_device_count={devices} "
      # Compile time dominates on CPU; the arrays are tiny.
      "--xla_backend_optimization_level=0 "
      "--xla_llvm_disable_expensive_passes=true"),
             PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  for key in ("JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS"):
    env.pop(key, None)
  if cache is not None:  # a later run of the same programs compiles nothing
    env.update(JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


class _Children:
  """Child processes, each logging to files; all killed on exit."""

  def __init__(self, logs: str):
    self.logs, self.procs = logs, {}

  def start(self, name: str, argv, env) -> subprocess.Popen:
    out = open(os.path.join(self.logs, f"{name}.out"), "wb")
    err = open(os.path.join(self.logs, f"{name}.err"), "wb")
    with out, err:
      proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                              stdout=out, stderr=err)
    self.procs[name] = proc
    return proc

  def log(self, name: str, stream: str = "err") -> str:
    with open(os.path.join(self.logs, f"{name}.{stream}"), "rb") as f:
      return f.read().decode("utf-8", "replace")

  def tail(self, name: str) -> str:
    return f"--- {name} ---\n" + self.log(name)[-3000:]

  def wait_ok(self, *names: str, timeout: float = PROCESS_TIMEOUT) -> None:
    """Wait for `names` to exit 0, together at most `timeout` seconds; fail
    as soon as one exits otherwise (its peers would wait for it)."""
    end = time.monotonic() + timeout
    while True:
      codes = {n: self.procs[n].poll() for n in names}
      failed = {n: c for n, c in codes.items() if c}  # None: running
      assert not failed, f"exit codes {failed}\n" + "\n".join(
          map(self.tail, names))
      if all(c == 0 for c in codes.values()):
        return
      assert time.monotonic() < end, (
          f"{[n for n, c in codes.items() if c is None]} still running after "
          f"{timeout}s\n" + "\n".join(map(self.tail, names)))
      time.sleep(0.2)

  def wait_until(self, done, what: str, timeout: float = PROCESS_TIMEOUT):
    """Wait until `done()` while every child runs (at most `timeout` s)."""
    end = time.monotonic() + timeout
    while not done():
      for name, proc in self.procs.items():
        assert proc.poll() is None, f"{name} exited before {what}\n" + (
            self.tail(name))
      assert time.monotonic() < end, f"no {what} after {timeout}s\n" + (
          "\n".join(map(self.tail, self.procs)))
      time.sleep(0.5)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
    for proc in self.procs.values():
      proc.wait(timeout=30)


def _pretrain(workdir: str, *flags: str) -> list[str]:
  return ["-m", "experiments.pretrain", *FLAGS, f"--workdir={workdir}",
          *flags]


def _multihost(address: str, process_id: int) -> tuple[str, ...]:
  return (f"--coordinator_address={address}", "--num_processes=2",
          f"--process_id={process_id}")


def _losses(workdir: str, keys=("loss", "ce")) -> dict[int, tuple]:
  """{step: values of `keys`} of the lines of a run's metrics.jsonl that
  hold them (train lines; ("val_loss",): eval lines)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      m = json.loads(line)
      if keys[0] in m:
        out[m["step"]] = tuple(m[k] for k in keys)
  return out


def _assert_close(got: dict, want: dict, steps, what: str) -> None:
  assert sorted(got) == sorted(want) == list(steps), (what, got, want)
  np.testing.assert_allclose(
      [got[s] for s in steps], [want[s] for s in steps], rtol=RTOL,
      err_msg=what)


# One process ---------------------------------------------------------------


def test_pipeline_rows_are_rows_of_the_whole_batch():
  data = DataConfig(seq_len=64, batch_size=8)
  tok = make_tokenizer(data)
  whole = make_iterator(data, tok, "train")
  part = make_iterator(data, tok, "train", rows=[6, 1])
  ids = []
  for _ in range(3):
    w, p = next(whole), next(part)
    assert p.keys() == w.keys()
    for key in w:
      np.testing.assert_array_equal(p[key], w[key][[6, 1]], err_msg=key)
    ids += w["row_ids"].tolist()
  # Row ids name distinct packed rows; the state is the whole batch's.
  assert len(set(ids)) == len(ids) and min(ids) >= 0
  assert part.get_state() == whole.get_state()
  last = list(make_dataset(data, tok, "validation", rows=[7]))[-1]
  assert last["row_ids"].tolist() == [-1]  # padding
  for bad in ([1, 1], [8], []):
    with pytest.raises(ValueError, match="rows must be distinct"):
      make_dataset(data, tok, "train", rows=bad)


def test_one_process_holds_every_row():
  mesh = sharding.make_mesh("data=1")
  np.testing.assert_array_equal(sharding.process_rows(mesh, 4), np.arange(4))
  batch = {"tokens": np.arange(12).reshape(4, 3)}
  placed = sharding.shard_batch(batch, mesh, 4)
  np.testing.assert_array_equal(placed["tokens"], batch["tokens"])
  with pytest.raises(sharding.MeshError, match="has 3 rows but this process "
                     "holds 4 of the 4 rows"):
    sharding.shard_batch({"tokens": np.zeros((3, 3))}, mesh, 4)


def test_multi_host_arguments_are_checked_before_jax_starts():
  with pytest.raises(sharding.MeshError, match="give all of"):
    sharding.initialize_distributed("127.0.0.1:1", 2)
  with pytest.raises(sharding.MeshError, match="heartbeat_timeout must be"):
    sharding.initialize_distributed("127.0.0.1:1", 2, 0, heartbeat_timeout_s=0)


# Two processes ---------------------------------------------------------------


def test_two_processes_train_like_one_and_resume_on_one(tmp_path):
  two, one, resumed = (str(tmp_path / d) for d in ("two", "one", "resumed"))
  cache = str(tmp_path / "jax_cache")
  address = f"127.0.0.1:{_free_port()}"
  with _Children(str(tmp_path)) as children:
    for i in range(2):
      children.start(f"two{i}", _pretrain(two, *STEPS,
                                          *_multihost(address, i)), _env(4))
    children.start("one", _pretrain(one, *STEPS), _env(8, cache))
    children.wait_ok("two0", "two1", "one")
    two_losses = _losses(two)
    _assert_close(two_losses, _losses(one), range(1, 5),
                  "2 processes x 4 devices vs 1 x 8: loss, ce per step")
    _assert_close(_losses(two, ("val_loss",)), _losses(one, ("val_loss",)),
                  (0, 4), "2 processes x 4 devices vs 1 x 8: val_loss")

    # Both processes wrote their shards of each step (orbax: one OCDBT store
    # per process; the fsdp halves of process 1 are only there).
    for step in (2, 4):
      state = os.path.join(two, "checkpoints", str(step), "state")
      for i in range(2):
        store = os.path.join(state, f"ocdbt.process_{i}")
        assert os.path.isdir(store) and os.listdir(store), (step, i,
                                                            os.listdir(state))

    # One process with 8 devices resumes the two processes' step 2.
    shutil.copytree(two, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
    children.start("resumed", _pretrain(resumed, *STEPS, "--resume"),
                   _env(8, cache))
    children.wait_ok("resumed")
    assert "resumed from step 2" in children.log("resumed", "out")
    got = _losses(resumed)
    _assert_close({s: got[s] for s in (3, 4)},
                  {s: two_losses[s] for s in (3, 4)}, (3, 4),
                  "resumed on 1 process vs continued on 2: loss, ce")


def test_each_process_reads_only_its_own_rows(tmp_path):
  address = f"127.0.0.1:{_free_port()}"
  with _Children(str(tmp_path)) as children:
    for i in range(2):
      children.start(f"rows{i}", [os.path.join("tests", "multihost_rows.py"),
                                  address, str(i)], _env(4))
    children.wait_ok("rows0", "rows1")
    reports = [json.loads(children.log(f"rows{i}", "out").splitlines()[-1])
               for i in range(2)]

  # What one process reads: the whole global batches.
  data = DataConfig(seq_len=64, batch_size=8)
  it = make_iterator(data, make_tokenizer(data), "train")
  batches = [next(it) for _ in range(len(reports[0]["local_row_ids"]))]
  assert [r["rows"] for r in reports] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  seen = []
  for step, batch in enumerate(batches):
    ids = batch["row_ids"]
    for r in reports:
      # Its rows of the global batch, nothing else.
      assert r["local_row_ids"][step] == ids[r["rows"]].tolist(), step
      # shard_batch put every row where one process would have.
      assert r["global_row_ids"][step] == ids.tolist(), step
      assert r["global_tokens"][step] == batch["tokens"].tolist(), step
    seen += [i for r in reports for i in r["local_row_ids"][step]]
  # No row read twice, none skipped: the ids of the processes' rows are
  # those of the global batches, each once.
  assert sorted(seen) == sorted(int(i) for b in batches
                                for i in b["row_ids"])
  assert len(set(seen)) == len(seen) == 8 * len(batches)
  # The iterator state does not depend on the rows (a checkpoint resumes on
  # any process count).
  assert reports[0]["state"] == reports[1]["state"] == json.loads(
      json.dumps(it.get_state()))


def test_killed_process_ends_the_other_with_an_error(tmp_path):
  workdir = str(tmp_path / "run")
  address = f"127.0.0.1:{_free_port()}"
  metrics = os.path.join(workdir, "metrics.jsonl")
  with _Children(str(tmp_path)) as children:
    for i in range(2):
      # What is killed is a process in the collectives of a train step, any
      # step: one device a process (fsdp=2 across the two) and a dense FFN
      # compile in a fraction of the time of the MoE on 8 devices.
      children.start(f"run{i}", _pretrain(
          workdir, "--steps=100000", "--checkpoint_every=100000",
          f"--heartbeat_timeout={HEARTBEAT_TIMEOUT}", "--mesh=fsdp=2",
          "--override=ffn_type=dense", "--override=dense_intermediate_size=32",
          *_multihost(address, i)), _env(1))
    # Until both train (process 0 logs every step).
    children.wait_until(lambda: os.path.exists(metrics) and '"loss"' in (
        pathlib.Path(metrics).read_text()), "a train step")
    children.procs["run1"].send_signal(signal.SIGKILL)
    try:
      rc = children.procs["run0"].wait(timeout=SURVIVOR_TIMEOUT)
    except subprocess.TimeoutExpired:
      raise AssertionError(
          f"process 0 still running {SURVIVOR_TIMEOUT}s after process 1 was "
          "killed\n" + children.tail("run0")) from None
    log = children.log("run0")
  assert rc != 0, log[-3000:]
  assert PEER_GONE in log, log[-3000:]
  # The coordinator names the process that stopped sending heartbeats.
  assert "stopped sending heartbeats):\n1\n" in log, log[-3000:]
