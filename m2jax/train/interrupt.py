"""Stopping a training run on SIGINT or SIGTERM without losing a step.

A signal must never raise inside JAX, grain or orbax code: a KeyboardInterrupt
raised in a grain thread start or a tensorboardX queue put leaves threads
and half-written files behind (and once ended in "Fatal Python error:
Aborted"). So while `StopOnSignal` is active its handlers only record the
signal; the loop asks `requested()` after each step, saves a checkpoint of
that step, closes its writers and raises `TrainingInterrupted`, which the
experiment scripts (experiments/cli.py) print as one line, exiting with
status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).

  with StopOnSignal() as stop:
    for step in ...:
      state = train(state, batch)
      if stop.requested():   # every process agrees (below)
        save(step); break

Further signals while stopping (a second Ctrl-C during the save) are noted
and ignored: the checkpoint is completed. SIGKILL still stops at once; the
save it cuts short is orbax's temporary directory, removed at the next start
(m2jax.train.checkpoint), so the previous checkpoint is what a resume finds.

The handlers are installed even when the process started with SIGINT
ignored (a background job of a non-interactive shell): a run asked to stop
stops where it can resume. They are installed only from the main thread
(Python allows no other); elsewhere signals keep their previous behaviour.

Multi-host: `requested()` all-gathers every process's flag (one tiny
collective per step, only when jax.process_count() > 1), so all processes
stop after the same step and save the same checkpoint together.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
  """Training stopped on a signal after checkpointing its last step.

  A KeyboardInterrupt, so that `except Exception` never swallows it and code
  that handles Ctrl-C handles it too. `exit_status` is the shell's 128 + N.
  """

  def __init__(self, signum: int, step: int, directory: str, *,
               continue_with: str = ""):
    self.signum, self.step, self.directory = signum, step, directory
    super().__init__(
        f"{signal.Signals(signum).name}: stopped after step {step}, whose "
        f"checkpoint is in {directory}; "
        + (f"continue with: {continue_with}" if continue_with
           else "resuming continues from it"))

  @property
  def exit_status(self) -> int:
    return 128 + self.signum


def _say(text: str) -> None:
  # os.write, not print: a handler may run in the middle of a print to the
  # same stream (a reentrant call on its buffer raises).
  os.write(2, f"\n{text}\n".encode())


class StopOnSignal:
  """While active, SIGINT and SIGTERM ask the loop to stop; nothing raises."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> StopOnSignal:
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      # None: a handler installed from C; the default is the safe fallback.
      signal.signal(s, signal.SIG_DFL if handler is None else handler)
    self._previous = {}

  def _note(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is None:
      self.signum = signum
      _say(f"{name}: stopping after the step in flight with a checkpoint of "
           "it (SIGKILL stops at once, losing the steps since the last "
           "checkpoint)")
    else:
      _say(f"{name}: already stopping; the checkpoint is being completed")

  def requested(self) -> bool:
    """Whether any process received a signal (a collective when there are
    several processes: every process must call it at the same step)."""
    if jax.process_count() == 1:
      return self.signum is not None
    every = multihost_utils.process_allgather(
        np.int32(self.signum or 0))
    received = [int(s) for s in np.ravel(every) if s]
    if received and self.signum is None:
      self.signum = received[0]  # stopping for another process's signal
    return bool(received)
