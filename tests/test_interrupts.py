"""Interruptions lose nothing: real SIGINT, SIGTERM and SIGKILL on a run.

Every run is a separate process: experiments.pretrain signalled from
outside (Ctrl-C's SIGINT), and a script running the same configs that
signals itself at a chosen point (SIGTERM, then SIGINT inside the save of
the stop's checkpoint; SIGKILL while a checkpoint is being written in the
background, training already past it). One run goes through all of them and ends with `--resume` and nothing
else (the configs are read from its directory); it must equal an
uninterrupted run line for line, with no step logged twice. The processes
share one persistent compilation cache, so only the first compiles.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import orbax.checkpoint as ocp
import pytest

from m2jax.train import interrupt
from m2jax.train.checkpoint import Checkpointer
from m2jax.train.metrics import read_metrics
from conftest import FAST_COMPILE
from test_train import NO_MTP, ROOT, SMALL, _corpus

# Long enough that a signal sent after a few logged steps lands mid-run on
# a slow machine (steps take about 15 ms on one CPU core).
STEPS = 100
CHECKPOINT_EVERY = 25
INTERRUPT_AT = 7   # SIGTERM from inside, then SIGINT inside its save
KILL_AT = 50       # SIGKILL while this step's checkpoint is in flight


def _env(cache_dir):
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)  # one device
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


class _Process:
  """A child python whose stderr is collected as it comes (tqdm writes it
  without newlines, so it is read in chunks)."""

  def __init__(self, args, env, workdir=None):
    self.workdir = workdir
    self.proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    self._chunks = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for chunk in iter(lambda: self.proc.stderr.read1(4096), b""):
      self._chunks.append(chunk)

  @property
  def stderr(self) -> str:
    return b"".join(self._chunks).decode(errors="replace")

  def wait_for(self, text: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while text not in self.stderr:
      assert self.proc.poll() is None or text in self.stderr, (
          f"exited before printing {text!r}:\n{self.stderr[-3000:]}")
      assert time.time() < deadline, f"no {text!r}:\n{self.stderr[-3000:]}"
      time.sleep(0.01)

  def wait(self, timeout: float = 240) -> int:
    code = self.proc.wait(timeout)
    self._reader.join(10)
    return code


def _pretrain(workdir, corpus, env, *extra):
  return _Process(
      ["-m", "experiments.pretrain", "--preset=tiny", f"--workdir={workdir}",
       f"--data={corpus}", "--seq_len=32", "--batch_size=2",
       f"--steps={STEPS}", "--log_every=1", "--eval_every=50",
       "--eval_batches=2", f"--checkpoint_every={CHECKPOINT_EVERY}",
       "--sample_tokens=0", "--warmup_steps=2",
       *[f"--override={o}" for o in SMALL], *NO_MTP, *extra], env, workdir)


def _resume(workdir, env):
  # Nothing but the directory: the configs are the run's.
  return _Process(["-m", "experiments.pretrain", f"--workdir={workdir}",
                   "--resume", "--sample_tokens=0"], env, workdir)


# The reference run's configs, signalling itself: "interrupt" sends SIGTERM
# at step AT (from `should_stop`, which runs after a step is logged, before
# its checkpoint) and SIGINT inside the save of that step's checkpoint;
# "kill" sends SIGKILL once the asynchronous save of step AT has returned,
# its files being written (the rename that completes it held back).
_SELF_SIGNALLED = """
import asyncio, json, os, signal, sys, time
import orbax.checkpoint as ocp
from m2jax import config as config_lib
from m2jax.data import DataConfig
from m2jax.train import checkpoint, interrupt
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
ref, workdir, mode, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
saved = json.load(open(os.path.join(ref, "config.json")))
configs = [config_lib.config_from_dict(cls, saved[part]) for cls, part in (
    (config_lib.ModelConfig, "model"), (TrainConfig, "train"),
    (DataConfig, "data"))]
def signal_at(step, metrics):
  if step == at and mode == "interrupt":
    os.kill(os.getpid(), signal.SIGTERM)
  return False
held = []
finalize = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize
async def held_finalize(path):
  for _ in range(20):  # bounded: a save that blocks fails below, not hangs
    if not held:
      break
    await asyncio.sleep(1)
  await finalize(path)
ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = held_finalize
save = checkpoint.Checkpointer.save
def save_signalled(self, step, *args):
  if step == at and mode == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
  held.extend([step] if step == at and mode == "kill" else [])
  save(self, step, *args)
  if held:
    # With the device copy (the default) orbax starts in a background
    # thread: kill once its temporary directory exists (files being written).
    for _ in range(400):
      if ocp.path.step.all_temporary_paths(self.directory):
        break
      time.sleep(0.05)
    assert self.asynchronous and not os.path.isdir(
        os.path.join(self.directory, str(step)))
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpointer.save = save_signalled
try:
  pretrain(*configs, workdir, resume=os.path.exists(workdir), progress=False,
           sample_tokens=0, should_stop=signal_at)
except interrupt.TrainingInterrupted as e:
  print(e, file=sys.stderr)
  sys.exit(e.exit_status)
"""


def _logged_lines(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    return f.read().count("\n")


def _wait_logged(victim, workdir, lines):
  deadline = time.time() + 120
  while _logged_lines(workdir) < lines:
    assert victim.proc.poll() is None, victim.stderr[-3000:]
    assert time.time() < deadline, victim.stderr[-3000:]
    time.sleep(0.01)


def _checkpoints(workdir):
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=3)
  steps = checkpointer.steps()
  checkpointer.close()
  return steps


def _assert_clean_exit(victim, code, name) -> int:
  """The step the one-line message says the run stopped after."""
  status, err = victim.wait(), victim.stderr
  assert status == code, err[-3000:]
  assert "Traceback" not in err and "Fatal Python error" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"interrupted: {name}: stopped after step "), last
  assert last.endswith("; continue with: python -m experiments.pretrain "
                       f"--workdir={victim.workdir} --resume"), last
  return int(last.split("stopped after step ")[1].split(",")[0])


def _assert_stopped_at_a_saved_step(workdir, step):
  lines = read_metrics(workdir)
  train = [l["step"] for l in lines if "loss" in l]
  # The last completed step is logged (log_every=1) and checkpointed, off
  # the periodic checkpoints.
  assert train[-1] == step, train[-3:]
  assert _checkpoints(workdir)[-1:] == [step], _checkpoints(workdir)
  assert len(train) == len(set(train))


def _assert_same_run(ref_dir, workdir):
  ref, run = read_metrics(ref_dir), read_metrics(workdir)
  steps = [(l["step"], "val_loss" in l) for l in run]
  assert len(steps) == len(set(steps)), "a step is logged twice"
  assert steps == [(l["step"], "val_loss" in l) for l in ref]
  for a, b in zip(ref, run):
    for key in ("loss", "ce", "grad_norm", "val_loss"):
      assert a.get(key) == b.get(key), (key, a["step"])


def test_signals_checkpoint_the_last_step_and_resume_loses_nothing(tmp_path):
  corpus = _corpus(tmp_path)
  env = _env(str(tmp_path / "jax_cache"))
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
  ref = _pretrain(ref_dir, corpus, env)
  assert ref.wait() == 0, ref.stderr[-3000:]  # compiles for the others
  self_signalled = lambda mode, at: _Process(
      ["-c", _SELF_SIGNALLED, ref_dir, run_dir, mode, str(at)], env, run_dir)

  # Ctrl-C from outside once a few steps are logged (while the first
  # self-signalled process runs beside it).
  outside = _pretrain(str(tmp_path / "ctrl_c"), corpus, env)
  run = self_signalled("interrupt", INTERRUPT_AT)
  _wait_logged(outside, outside.workdir, 5)
  outside.proc.send_signal(signal.SIGINT)
  stopped = _assert_clean_exit(outside, 130, "SIGINT")
  _assert_stopped_at_a_saved_step(outside.workdir, stopped)

  # SIGTERM; a SIGINT inside the save is noted, the checkpoint completed.
  assert run.wait() == 143, run.stderr[-3000:]
  assert "SIGTERM: stopping after the step in flight" in run.stderr
  assert "SIGINT: already stopping" in run.stderr
  _assert_stopped_at_a_saved_step(run_dir, INTERRUPT_AT)
  # Resumed from it, then killed while the checkpoint of KILL_AT was being
  # written in the background (orbax's temporary directory is all it left):
  # the next resume starts from the one before.
  run = self_signalled("kill", KILL_AT)
  assert run.wait() == -signal.SIGKILL, run.stderr[-3000:]
  assert max(l["step"] for l in read_metrics(run_dir)) == KILL_AT
  assert ocp.path.step.all_temporary_paths(os.path.join(run_dir,
                                                        "checkpoints"))
  assert _checkpoints(run_dir)[-1:] == [KILL_AT - CHECKPOINT_EVERY]
  run = _resume(run_dir, env)
  assert run.wait() == 0, run.stderr[-3000:]
  _assert_same_run(ref_dir, run_dir)
  assert _checkpoints(run_dir)[-1:] == [STEPS]


def test_stop_on_signal_only_records_and_restores_the_handlers():
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are installed from the main thread only")
  before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
  with interrupt.StopOnSignal() as stop:
    assert not stop.requested()
    os.kill(os.getpid(), signal.SIGTERM)  # delivered, handled: no exit
    os.kill(os.getpid(), signal.SIGINT)   # no KeyboardInterrupt either
    assert stop.requested() and stop.signum == signal.SIGTERM
  assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before
  error = interrupt.TrainingInterrupted(signal.SIGTERM, 7, "/run/ckpt/7")
  assert isinstance(error, KeyboardInterrupt) and error.exit_status == 143
  assert str(error).startswith("SIGTERM: stopped after step 7")


# Two processes of one multi-host run (CPU, gloo collectives); only process
# 1 receives SIGTERM, between two checks.
_TWO_PROCESSES = """
import os, signal, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, index = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2,
                           process_id=index)
from m2jax.train import interrupt
with interrupt.StopOnSignal() as stop:
  before = stop.requested()
  if index == 1:
    os.kill(os.getpid(), signal.SIGTERM)
  after = stop.requested()
print(before, after, stop.signum)  # last: gloo prints to stdout too
"""


def test_every_process_stops_at_the_same_step():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = _env("")
  del env["JAX_COMPILATION_CACHE_DIR"]
  procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(port),
                             str(i)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  # Process 0 got no signal, but stops after the same check, for SIGTERM.
  assert [out.splitlines()[-1].split() for out, _ in outs] == [
      ["False", "True", str(int(signal.SIGTERM))]] * 2
