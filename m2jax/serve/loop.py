"""The one engine loop of the server: a thread that owns the Engine.

Every HTTP request, whatever its connection, becomes one or more engine
requests added to the same Engine (m2jax/infer/engine.py), so concurrent
requests are decoded together in one batch. The thread alone touches the
engine: handlers send it commands through a thread-safe queue (add, abort,
swap weights) and it answers each request through that request's asyncio
queue (`loop.call_soon_threadsafe`), in the order

  ("added", policy_version)  or  ("error", status, message, param)
  ("tokens", index, new_ids, new_logprobs)            zero or more times
  ("done", index, Sample)                             once per sample
  ("error", 500, message, None)                       if the engine failed

A step that raises fails the requests in flight (a 500 each), and the loop
goes on with a fresh engine (the compiled steps are cached, so nothing is
compiled again): no request can stop the server.

The policy version is a counter of the weights being served: every response
carries the version that produced it. `swap_weights` installs new weights
(and the version) once the requests in flight have finished; requests that
arrive meanwhile wait and are served by the new weights. RL reads the
version to know how off-policy a rollout is.

Sharing an engine. `EngineLoop(..., engine=e)` serves an engine someone
else holds (the RL loop's, m2jax/rl/blackbox_rollout.py): a swap updates
its weights in place (`Engine.update_variables`), so the holder's object
stays current, and the thread steps it only while requests of its own are
in flight, so the holder may use it in between (never while they are).
`max_seq_len` may lower the longest sequence served below the engine's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import traceback
from typing import Any

from m2jax.errors import UserError
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Ticket:
  """One engine request of an HTTP request, and where its results go."""
  prompt: list[int]
  params: SamplingParams
  loop: asyncio.AbstractEventLoop
  queue: asyncio.Queue
  tag: int = 0                 # the caller's index of this prompt
  rid: int | None = None       # the engine's request id, once added

  def post(self, *item) -> None:
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag,) + item)
    except RuntimeError:       # the client's event loop is gone
      pass


class EngineLoop:
  """The thread that owns the engine (module docstring)."""

  def __init__(self, model_config, variables, engine_config: EngineConfig,
               *, tokenizer=None, mesh=None, policy_version: int = 0,
               engine: Engine | None = None, max_seq_len: int | None = None):
    self._args = dict(model_config=model_config,
                      engine_config=engine_config, tokenizer=tokenizer,
                      mesh=mesh)
    self.tokenizer = tokenizer
    self.shared = engine is not None
    self.engine = engine if self.shared else self._new_engine(variables)
    self.variables = variables
    self._max_seq_len = max_seq_len
    self.policy_version = policy_version
    self.stats = collections.Counter()
    self._commands: queue.Queue = queue.Queue()
    self._tickets: dict[int, Ticket] = {}
    self._swap: tuple[Any, int, concurrent.futures.Future] | None = None
    self._deferred: list[Ticket] = []
    self._aborted = False
    self._thread = threading.Thread(target=self._run, name="engine-loop",
                                    daemon=True)

  def _new_engine(self, variables) -> Engine:
    a = self._args
    return Engine(a["model_config"], variables, a["engine_config"],
                  tokenizer=a["tokenizer"], mesh=a["mesh"])

  @classmethod
  def around(cls, engine: Engine, *, policy_version: int = 0,
             max_seq_len: int | None = None) -> "EngineLoop":
    """A loop serving `engine`, which its holder keeps (module docstring)."""
    return cls(engine.model_config, engine.variables, engine.config,
               tokenizer=engine.tokenizer, mesh=engine.mesh,
               policy_version=policy_version, engine=engine,
               max_seq_len=max_seq_len)

  @property
  def max_seq_len(self) -> int:
    if self._max_seq_len is None:
      return self.engine.max_seq_len
    return min(self.engine.max_seq_len, self._max_seq_len)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  # ------------------------------------------------- called by handlers --

  def start(self) -> "EngineLoop":
    self._thread.start()
    return self

  def stop(self, timeout: float = 10.0) -> None:
    self._commands.put(("stop",))
    self._thread.join(timeout)

  def add(self, ticket: Ticket) -> None:
    self._commands.put(("add", ticket))

  def abort(self, ticket: Ticket) -> None:
    self._commands.put(("abort", ticket))

  def swap_weights(self, variables, policy_version: int | None = None
                   ) -> concurrent.futures.Future:
    """Serve `variables` from now on, as `policy_version` (default: the
    current version + 1), once the requests in flight are done; the
    future's result is the new version."""
    done = concurrent.futures.Future()
    self._commands.put(("swap", variables, policy_version, done))
    return done

  # ------------------------------------------------------ the thread ----

  def _busy(self) -> bool:
    """Whether the engine has work of this loop's to step: a shared
    engine's holder may use it while none is in flight (aborted requests
    are, until a step has dropped them)."""
    if not self.engine.has_work():
      self._aborted = False
      return False
    return not self.shared or bool(self._tickets) or self._aborted

  def _run(self) -> None:
    while True:
      idle = not self._busy()
      try:
        command = self._commands.get(block=idle, timeout=0.5 if idle else None)
      except queue.Empty:
        command = None
      while command is not None:
        if command[0] == "stop":
          self._drop_all()
          return
        self._handle(command)
        try:
          command = self._commands.get_nowait()
        except queue.Empty:
          command = None
      if self._swap is not None and not self.engine.has_work():
        self._install_swap()
      if self._busy():
        self._step()

  def _drop_all(self) -> None:
    """At the stop: abort what is in flight (its KV pages freed, for a
    shared engine's holder) and fail a pending swap."""
    for ticket in list(self._tickets.values()) + self._deferred:
      self._abort(ticket)
      ticket.post("error", 503, "the server is stopping", None)
    if self._swap is not None:
      self._swap[2].set_exception(RuntimeError("the engine loop stopped"))
      self._swap = None

  def _handle(self, command) -> None:
    kind = command[0]
    if kind == "add":
      if self._swap is not None:
        self._deferred.append(command[1])
      else:
        self._add(command[1])
    elif kind == "abort":
      self._abort(command[1])
    elif kind == "swap":
      _, variables, version, done = command
      self._swap = (variables, version, done)

  def _add(self, ticket: Ticket) -> None:
    try:
      ticket.rid = self.engine.add_request(ticket.prompt, ticket.params)
    except UserError as e:      # e.g. a prompt longer than the KV pool
      ticket.post("error", 400, str(e), "prompt")
      return
    except Exception as e:  # pylint: disable=broad-except
      # A bug, not the request's fault: that request fails, the loop (and
      # every other request) goes on.
      log.error("engine add_request failed:\n%s", traceback.format_exc())
      ticket.post("error", 500, f"the engine refused the request: "
                  f"{type(e).__name__}: {e}", None)
      return
    self._tickets[ticket.rid] = ticket
    self.stats["requests"] += 1
    ticket.post("added", self.policy_version)

  def _abort(self, ticket: Ticket) -> None:
    if ticket in self._deferred:
      self._deferred.remove(ticket)
    if ticket.rid is not None and self._tickets.get(ticket.rid) is ticket:
      self.engine.abort(ticket.rid)
      self.engine.release(ticket.rid)
      del self._tickets[ticket.rid]
      self._aborted = True   # its sequences leave at the next step
      self.stats["aborted"] += 1

  def _step(self) -> None:
    try:
      events = self.engine.step()
    except Exception as e:  # pylint: disable=broad-except
      # A failed step leaves the engine's state unknown (its buffers are
      # donated): fail what was in flight and start a fresh engine (a
      # shared engine's holder keeps the failed one: engine_failures says
      # so).
      log.error("engine step failed:\n%s", traceback.format_exc())
      self.stats["engine_failures"] += 1
      message = f"the engine failed: {type(e).__name__}: {e}"
      for ticket in self._tickets.values():
        ticket.post("error", 500, message, None)
      self._tickets.clear()
      self.engine = self._new_engine(self.variables)
      return
    rows = {(e.request_id, e.index) for e in events if e.tokens}
    self.stats["steps"] += 1
    self.stats["batched_steps"] += len(rows) > 1
    self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
    for e in events:
      ticket = self._tickets.get(e.request_id)
      if ticket is None:        # aborted meanwhile
        continue
      if e.finish_reason is None:
        ticket.post("tokens", e.index, e.tokens, e.logprobs)
      else:
        # The finished sample is the reference: a stop string may have cut
        # tokens that earlier events reported.
        ticket.post("done", e.index,
                    self.engine.result(e.request_id)[e.index])
    for rid in [r for r in {e.request_id for e in events}
                if r in self._tickets and self.engine.done(r)]:
      self.engine.release(rid)
      del self._tickets[rid]

  def _install_swap(self) -> None:
    variables, version, done = self._swap
    self._swap = None
    try:
      if self.shared:
        self.engine.update_variables(variables)
        engine = self.engine
      else:
        engine = self._new_engine(variables)
    except Exception as e:  # pylint: disable=broad-except
      done.set_exception(e)
    else:
      self.engine, self.variables = engine, variables
      self.policy_version = (self.policy_version + 1 if version is None
                             else int(version))
      done.set_result(self.policy_version)
    deferred, self._deferred = self._deferred, []
    for ticket in deferred:
      self._add(ticket)
