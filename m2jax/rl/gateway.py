"""Forge's gateway (SPEC §3): the OpenAI-compatible server recording the
sessions of black-box agents, each committed to the data pool as one
trajectory.

An agent changes nothing but its base URL, its key and one header:

  client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY,
                         default_headers={"X-Session-Id": "task17-a"})

Calls. Each generation call (POST /v1/completions or /v1/chat/completions)
with the header is one step of its session (pool.Step):
  state           the prompt's tokens as the engine saw them (the chat
                  template rendered, BOS included: the response's
                  prompt_token_ids)
  action          the completion's tokens as sampled, the stop string (the
                  chat's end-of-turn marker) or EOS included: the policy is
                  trained to stop. The client's answer stops before the
                  stop string, as the plain server's does.
  logprobs        their behaviour log q, float32
  policy_version  the weights that generated it
  reward          0, unless the end gives per-step (process) rewards
A recorded call has one prompt and n = 1 (a session is one path of
states). Calls without the header are refused (400) unless
GatewayConfig.require_session is False: a gateway exists to record, and an
agent that forgot the header would otherwise generate rollouts no one
trains on, silently.

Branches. A call whose prompt extends the previous call's prompt +
completion (+ tool output) continues that branch; any other (the context
rewritten: truncated, summarised, an earlier turn edited) forks from the
call with the longest common token prefix (`branch_point`). The branch
structure is kept in the trajectory's verification["gateway"] (parents,
shared prefix lengths); the trainer needs only the tokens, as its prefix
trees (m2jax/rl/prefix_tree.py) merge whatever prefixes the steps share.
With the byte tokenizer the history re-rendered by the chat template is
token-identical to prompt + completion, so turns continue; a BPE tokenizer
may encode the re-rendered text otherwise, and such a call forks.

Ending. A session ends once:
  * explicitly: POST /v1/sessions/{id}/end with {"reward", "verification",
    "step_rewards"} (an outcome the agent's harness verified), with {} to
    let the session's verifier judge it, or with {"discard": reason};
    in process `end_session(...)` alike;
  * after `session_timeout_s` without a call: judged by its verifier; with
    none, or if the verifier gives no outcome, it is stored and at once
    discarded in the pool with the reason, so nothing is silently lost and
    nothing unverified is trained on;
  * when the gateway closes (same as a timeout).
A verified session is committed as one Pool.add (one transaction, durable
when it returns); a session without calls writes nothing ("empty"). The
end's answer, `wait` and GET /v1/sessions/{id} give the Outcome. A call
that finishes after its session ended is not recorded (stats
"late_calls"); a call to an ended session gets a 409.

Sessions are opened by their creator (`open_session`: the RL loop, with its
group, task and queue position) or, unless GatewayConfig.implicit_sessions
is False, by the first call with a new id (an unknown agent): the trajectory
id, group and task are then the session id, the env GatewayConfig.env, and
queue_seq is taken at commit (after every position stored or held by an
open session; an RL loop that hands out queue positions as it goes sets
implicit_sessions=False, so none is taken before it gives it). A session
id is 1-128 characters of letters, digits and "._:-", and is refused once
its trajectory id is in the pool.

Security is the server's (m2jax/serve/app.py): with a key every /v1 route,
the session routes included, needs it; `serve` refuses a host beyond
loopback without one; a body over GatewayConfig.max_body_bytes gets a 413
before it is parsed; a refused call touches no session.

In process (the RL loop):
  gateway = Gateway(pool, GatewayConfig(session_timeout_s=600))
  app = gateway.create_app(engine_loop, model_name="policy", api_key=KEY)
  gateway.start()                                  # the idle timeout
  sid = gateway.open_session(group_id="g7", task_id="t7", queue_seq=56,
                             verifier=judge)       # judge(Session) -> Verdict
  ... the agent runs against the app with X-Session-Id: sid ...
  outcome = gateway.wait(sid)                      # or gateway.end_session
  outcome.trajectory_id                            # in the pool
  gateway.close()
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import threading
import time
import uuid
from typing import Callable, Mapping, NamedTuple

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from m2jax.errors import UserError
from m2jax.infer.engine import Sample
from m2jax.rl import pool as pool_lib
from m2jax.rl.envs import base as envs_base
from m2jax.serve import app as app_lib
from m2jax.serve import protocol as proto

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class SessionError(UserError, ValueError):
  """A session request that is refused; `status` is its HTTP status."""

  def __init__(self, status: int, message: str, code: str | None = None):
    super().__init__(message)
    self.status, self.code = status, code


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
  """How the gateway records.

  session_timeout_s: a session without a call for this long ends.
  require_session: refuse generation calls without the session header
    (False: serve them unrecorded).
  implicit_sessions: a call with an unknown session id opens it (False:
    only `open_session` opens sessions, unknown ids get a 404).
  env: the env name of implicitly opened sessions' trajectories.
  max_open_sessions, max_calls_per_session: bounds on what is held in
    memory (beyond them, a 429 / 400).
  max_body_bytes: the largest request body (413 beyond).
  keep_outcomes: ended sessions remembered (for `wait`, GET and the 409
    of a reused id; the pool remembers the rest).
  """
  session_timeout_s: float = 600.0
  require_session: bool = True
  implicit_sessions: bool = True
  env: str = "agent"
  max_open_sessions: int = 1024
  max_calls_per_session: int = 1024
  max_body_bytes: int = 8 << 20
  keep_outcomes: int = 100_000

  def __post_init__(self):
    def fail(field, rule):
      raise UserError(f"GatewayConfig.{field}: {rule} (got "
                      f"{getattr(self, field)!r})")
    if not self.session_timeout_s > 0:
      fail("session_timeout_s", "must be > 0")
    if not isinstance(self.env, str) or not self.env:
      fail("env", "must be a non-empty string")
    for name in ("max_open_sessions", "max_calls_per_session",
                 "max_body_bytes", "keep_outcomes"):
      if getattr(self, name) < 1:
        fail(name, "must be >= 1")


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """One recorded generation call (arrays read-only)."""
  prompt: np.ndarray       # [Ls] int32, the state
  completion: np.ndarray   # [La] int32, the action (stop string included)
  logprobs: np.ndarray     # [La] float32, behaviour log q
  policy_version: int
  finish_reason: str       # "stop" | "length"
  parent: int              # the call it branches from; -1: a new root
  shared: int              # prompt tokens shared with the parent's history
  continues: bool          # the prompt extends the parent's whole history


@dataclasses.dataclass(frozen=True)
class Session:
  """What a verifier sees: the session's identity and its calls."""
  session_id: str
  trajectory_id: str
  group_id: str
  task_id: str
  env: str
  difficulty: int
  queue_seq: int | None    # None: taken at commit
  calls: tuple[Call, ...]


class Verdict(NamedTuple):
  """A session's outcome. step_rewards: one process reward per call."""
  reward: float
  verification: dict = {}
  step_rewards: tuple[float, ...] | None = None


# A verifier judges an ended session; None: it cannot (the session is then
# stored and discarded). An env's Verification is taken as its reward with
# dict(detail, correct=...) as the verification.
Verifier = Callable[[Session], "Verdict | envs_base.Verification | None"]


class Outcome(NamedTuple):
  """How a session ended."""
  session_id: str
  status: str                 # committed | discarded | empty | failed
  trajectory_id: str | None   # in the pool (committed or discarded)
  reward: float | None
  reason: str | None          # why discarded or failed
  num_calls: int
  ended_by: str               # end | timeout | close


def branch_point(prompt: np.ndarray, calls) -> tuple[int, int, bool]:
  """(parent, shared, continues) of a call with `prompt` after `calls`: the
  previous call if the prompt extends its prompt + completion, else the
  call sharing the longest token prefix with it (at equal length one whose
  whole history it extends, then the later one; -1 if none shares a
  token)."""
  best = (-1, 0, False)
  for i, call in enumerate(calls):
    history = np.concatenate([call.prompt, call.completion])
    m = min(len(history), len(prompt))
    differ = np.flatnonzero(prompt[:m] != history[:m])
    shared = int(differ[0]) if differ.size else m
    continues = shared == len(history)
    if continues and i == len(calls) - 1:
      return i, shared, True
    if shared and (shared, continues) >= best[1:]:
      best = (i, shared, continues)
  return best


@dataclasses.dataclass(eq=False)
class _Session:
  info: Session               # calls left empty; the list below grows
  verifier: Verifier | None
  timeout_s: float
  opened_at: float            # unix seconds
  active_at: float            # monotonic seconds of the last call activity
  calls: list = dataclasses.field(default_factory=list)
  in_flight: int = 0
  ending: bool = False

  def snapshot(self) -> Session:
    return dataclasses.replace(self.info, calls=tuple(self.calls))


class _EndRequest(BaseModel):
  """POST /v1/sessions/{id}/end."""
  model_config = ConfigDict(extra="forbid")
  reward: float | None = Field(None, allow_inf_nan=False)
  verification: dict | None = None
  step_rewards: list[float] | None = None
  discard: str | None = Field(None, min_length=1, max_length=1000)


class Gateway:
  """Sessions, their recording and their commits (module docstring).
  Thread-safe: the server's event loop, the RL loop and the timeout
  thread share it. `stats` counts sessions_opened, calls_recorded,
  unrecorded_calls, late_calls and the outcomes by status."""

  def __init__(self, pool: pool_lib.Pool,
               config: GatewayConfig = GatewayConfig(), *,
               verifier: Verifier | None = None):
    self.pool, self.config, self.verifier = pool, config, verifier
    self.stats = collections.Counter()
    self._sessions: dict[str, _Session] = {}
    self._outcomes: collections.OrderedDict[str, Outcome] = (
        collections.OrderedDict())
    self._cond = threading.Condition()
    self._commit_lock = threading.Lock()   # queue_seq is taken under it
    self._next_seq = 0
    self._stop = threading.Event()
    self._reaper: threading.Thread | None = None

  # ----------------------------------------------------- in-process API --

  def open_session(self, session_id: str | None = None, *,
                   trajectory_id: str | None = None,
                   group_id: str | None = None, task_id: str | None = None,
                   env: str | None = None, difficulty: int = 0,
                   queue_seq: int | None = None,
                   verifier: Verifier | None = None,
                   timeout_s: float | None = None) -> str:
    """Open a session (a fresh id if none is given) and return its id.
    Defaults: trajectory, group and task ids = the session id, env =
    GatewayConfig.env, queue_seq taken at commit, the gateway's verifier
    and timeout."""
    sid = session_id if session_id is not None else uuid.uuid4().hex
    _check_id(sid)
    tid = trajectory_id if trajectory_id is not None else sid
    if queue_seq is not None and (isinstance(queue_seq, bool) or not
                                  isinstance(queue_seq, (int, np.integer))
                                  or queue_seq < 0):
      raise SessionError(400, f"open_session: queue_seq must be an integer "
                         f">= 0 (got {queue_seq!r})")
    if timeout_s is not None and not timeout_s > 0:
      raise SessionError(400, f"open_session: timeout_s must be > 0 (got "
                         f"{timeout_s!r})")
    self._check_not_stored(tid)
    info = Session(sid, tid, group_id or sid, task_id or sid,
                   env or self.config.env, int(difficulty), queue_seq, ())
    with self._cond:
      self._add(sid, info, verifier, timeout_s)
    return sid

  def end_session(self, session_id: str, *, reward: float | None = None,
                  verification: Mapping | None = None,
                  step_rewards=None, discard: str | None = None) -> Outcome:
    """End a session now: committed with `reward` (and `verification`,
    `step_rewards`), or judged by its verifier when no reward is given, or
    stored and discarded with the reason `discard`. Returns once the pool
    holds it. SessionError: unknown (404), already ended (409), no reward
    and no verifier (400; the session stays open)."""
    return self._end(session_id, "end", reward=reward,
                     verification=verification, step_rewards=step_rewards,
                     discard=discard)

  def wait(self, session_id: str, timeout: float | None = None) -> Outcome:
    """The outcome of a session, once it has ended (TimeoutError after
    `timeout` seconds)."""
    with self._cond:
      if (session_id not in self._sessions
          and session_id not in self._outcomes):
        raise SessionError(404, f"unknown session {session_id!r}",
                           "session_not_found")
      if not self._cond.wait_for(lambda: session_id in self._outcomes,
                                 timeout):
        raise TimeoutError(f"session {session_id!r} has not ended after "
                           f"{timeout} s")
      return self._outcomes[session_id]

  def outcome(self, session_id: str) -> Outcome | None:
    """The outcome of an ended session, None while it is open."""
    with self._cond:
      return self._outcomes.get(session_id)

  def session(self, session_id: str) -> Session | None:
    """The calls of an open session so far, None if it is not open."""
    with self._cond:
      s = self._sessions.get(session_id)
      return s.snapshot() if s else None

  def create_app(self, loop, *, model_name: str,
                 api_key: str | None = None) -> FastAPI:
    """The OpenAI server (m2jax/serve/app.py) over `loop`, recording here,
    with the session routes."""
    app = app_lib.create_app(loop, model_name=model_name, api_key=api_key,
                             recorder=_Recorder(self),
                             max_body_bytes=self.config.max_body_bytes)

    @app.get("/v1/sessions/{session_id}", responses=app_lib.ERROR_RESPONSES)
    async def session_status(session_id: str):
      with self._cond:
        s, done = self._sessions.get(session_id), self._outcomes.get(
            session_id)
        if s is not None:
          return {"session_id": session_id, "status": "open",
                  "num_calls": len(s.calls), "in_flight": s.in_flight}
      if done is None:
        raise proto.ApiError(404, f"unknown session {session_id!r}",
                             "session_id", "session_not_found")
      return done._asdict()

    @app.post("/v1/sessions/{session_id}/end",
              responses=app_lib.ERROR_RESPONSES)
    async def end(session_id: str, req: _EndRequest):
      try:
        # A commit waits for the disk; other sessions go on meanwhile.
        outcome = await asyncio.to_thread(
            self._end, session_id, "end", reward=req.reward,
            verification=req.verification, step_rewards=req.step_rewards,
            discard=req.discard)
      except SessionError as e:
        raise proto.ApiError(e.status, str(e), None, e.code) from None
      if outcome.status == "failed":
        raise proto.ApiError(500, f"session {session_id!r} could not be "
                             f"stored: {outcome.reason}")
      return outcome._asdict()

    return app

  def start(self) -> "Gateway":
    """Start the thread that ends idle sessions."""
    if self._reaper is None:
      self._reaper = threading.Thread(target=self._reap_loop, daemon=True,
                                      name="gateway-timeouts")
      self._reaper.start()
    return self

  def close(self) -> None:
    """Stop the timeout thread and end every open session (as a timeout
    would: judged by its verifier, or stored and discarded)."""
    self._stop.set()
    if self._reaper is not None:
      self._reaper.join()
    with self._cond:
      open_ids = list(self._sessions)
    for sid in open_ids:
      self._end_quietly(sid, "close")

  # ------------------------------------------------------------ internals --

  def _check_not_stored(self, trajectory_id: str) -> None:
    try:
      # training_of refuses an unknown id, and reads no steps.
      self.pool.training_of(trajectory_id)
    except pool_lib.PoolError:
      return
    raise SessionError(409, f"trajectory {trajectory_id!r} is already in "
                       "the pool; use another session id", "session_ended")

  def _add(self, sid, info, verifier, timeout_s) -> _Session:
    """Register a new session (under the lock)."""
    if sid in self._sessions or sid in self._outcomes:
      raise SessionError(409, f"session {sid!r} already exists",
                         "session_exists")
    for other in self._sessions.values():
      if other.info.trajectory_id == info.trajectory_id or (
          info.queue_seq is not None
          and other.info.queue_seq == info.queue_seq):
        raise SessionError(409, f"session {other.info.session_id!r} has "
                           f"trajectory id {info.trajectory_id!r} or "
                           f"queue_seq {info.queue_seq} already",
                           "session_exists")
    if len(self._sessions) >= self.config.max_open_sessions:
      raise SessionError(429, f"{len(self._sessions)} sessions are open, "
                         "the most this gateway holds (GatewayConfig."
                         "max_open_sessions)", "too_many_sessions")
    s = _Session(info, verifier or self.verifier,
                 timeout_s or self.config.session_timeout_s, time.time(),
                 time.monotonic())
    self._sessions[sid] = s
    self.stats["sessions_opened"] += 1
    return s

  async def _begin(self, headers: Mapping[str, str], prompts: int,
                   n: int) -> _Call | None:
    sid = headers.get(SESSION_HEADER)
    if sid is None:
      if self.config.require_session:
        raise proto.ApiError(400, f"this gateway records sessions: send the "
                             f"{SESSION_HEADER} header", SESSION_HEADER,
                             "missing_session_id")
      self.stats["unrecorded_calls"] += 1
      return None
    try:
      _check_id(sid)
      if prompts != 1 or n != 1:
        raise SessionError(400, "a recorded call has one prompt and n=1 "
                           f"(got {prompts} prompts, n={n})")
      with self._cond:
        s = self._sessions.get(sid)
        known = s is not None or sid in self._outcomes
      if not known:
        if not self.config.implicit_sessions:
          raise SessionError(404, f"unknown session {sid!r}: open it first",
                             "session_not_found")
        await asyncio.to_thread(self._check_not_stored, sid)
      with self._cond:
        s = self._sessions.get(sid)
        if s is None:
          if sid in self._outcomes:
            raise SessionError(409, f"session {sid!r} has ended",
                               "session_ended")
          s = self._add(sid, Session(sid, sid, sid, sid, self.config.env, 0,
                                     None, ()), None, None)
        if s.ending:
          raise SessionError(409, f"session {sid!r} is ending",
                             "session_ended")
        if len(s.calls) + s.in_flight >= self.config.max_calls_per_session:
          raise SessionError(400, f"session {sid!r} has "
                             f"{self.config.max_calls_per_session} calls, "
                             "the most one holds", "too_many_calls")
        s.in_flight += 1
        s.active_at = time.monotonic()
    except SessionError as e:
      raise proto.ApiError(e.status, str(e), SESSION_HEADER,
                           e.code) from None
    return _Call(self, s)

  def _record(self, s: _Session, prompt, sample: Sample,
              version: int) -> None:
    if not sample.tokens:
      return
    prompt = _frozen(prompt, np.int32)
    with self._cond:
      if s.ending or self._sessions.get(s.info.session_id) is not s:
        self.stats["late_calls"] += 1
        return
      parent, shared, continues = branch_point(prompt, s.calls)
      s.calls.append(Call(
          prompt, _frozen(sample.tokens, np.int32),
          _frozen(sample.logprobs, np.float32), int(version),
          sample.finish_reason, parent, shared, continues))
      s.active_at = time.monotonic()
      self.stats["calls_recorded"] += 1

  def _release(self, s: _Session) -> None:
    with self._cond:
      s.in_flight -= 1
      s.active_at = time.monotonic()

  def _end(self, sid: str, ended_by: str, *, reward=None, verification=None,
           step_rewards=None, discard=None) -> Outcome:
    with self._cond:
      s = self._sessions.get(sid)
      if s is None:
        if sid in self._outcomes:
          raise SessionError(409, f"session {sid!r} has already ended",
                             "session_ended")
        raise SessionError(404, f"unknown session {sid!r}",
                           "session_not_found")
      if s.ending:
        raise SessionError(409, f"session {sid!r} is ending",
                           "session_ended")
      s.ending = True   # from here no call is recorded
      info = s.snapshot()
    try:
      outcome = self._judge_and_store(s, info, ended_by, reward,
                                      verification, step_rewards, discard)
    except SessionError:
      with self._cond:
        s.ending = False
      raise
    with self._cond:
      del self._sessions[sid]
      self._outcomes[sid] = outcome
      while len(self._outcomes) > self.config.keep_outcomes:
        self._outcomes.popitem(last=False)
      self.stats[outcome.status] += 1
      self._cond.notify_all()
    return outcome

  def _judge_and_store(self, s: _Session, info: Session, ended_by: str,
                       reward, verification, step_rewards,
                       discard) -> Outcome:
    """The outcome of an ending session, stored. SessionError (400) for an
    outcome the caller gave that is refused."""
    if discard is not None and (reward is not None or verification
                                or step_rewards is not None):
      raise SessionError(400, "give a reward or a discard reason, not both")
    n = len(info.calls)
    if n == 0:
      return Outcome(info.session_id, "empty", None, None,
                     discard or "no call was recorded", 0, ended_by)
    judged = discard is None and reward is None
    if judged and s.verifier is None:
      if ended_by == "end":
        raise SessionError(400, f"session {info.session_id!r} has no "
                           "verifier: give its reward (or discard it)")
      discard = f"{ended_by} without an outcome (no verifier)"
    elif judged:
      try:
        verdict = _verdict(s.verifier(info))
      except Exception as e:  # pylint: disable=broad-except
        log.exception("the verifier of session %r failed", info.session_id)
        verdict, discard = None, (f"the verifier failed: "
                                  f"{type(e).__name__}: {e}")
      if verdict is None:
        discard = discard or f"{ended_by}: the verifier gave no outcome"
      else:
        reward, verification, step_rewards = verdict
    try:
      trajectory = self._trajectory(s, info, ended_by, reward, verification,
                                    step_rewards, discard)
    except (SessionError, pool_lib.PoolError) as e:
      if not judged:   # the caller's outcome: theirs to fix
        raise SessionError(400, str(e)) from None
      discard = f"the verifier's outcome was refused: {e}"
      trajectory = self._trajectory(s, info, ended_by, 0.0, None, None,
                                    discard)
    try:
      with self._commit_lock:
        seq = info.queue_seq
        if seq is None:   # after every position stored or held open
          with self._cond:
            held = [o.info.queue_seq + 1 for o in self._sessions.values()
                    if o.info.queue_seq is not None]
          seq = max([self._next_seq, self.pool.next_queue_seq()] + held)
          self._next_seq = seq + 1
        # Stored and discarded in one transaction: a crash cannot leave a
        # session nobody verified waiting to be trained.
        self.pool.add(dataclasses.replace(trajectory, queue_seq=seq),
                      discard_reason=discard)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("session %r was not stored", info.session_id)
      return Outcome(info.session_id, "failed", None, None,
                     f"{type(e).__name__}: {e}", n, ended_by)
    return Outcome(info.session_id,
                   "discarded" if discard is not None else "committed",
                   trajectory.trajectory_id, trajectory.reward, discard, n,
                   ended_by)

  @staticmethod
  def _trajectory(s: _Session, info: Session, ended_by: str, reward,
                  verification, step_rewards,
                  discard) -> pool_lib.Trajectory:
    """The session as a pool trajectory (queue_seq 0 until the commit),
    validated by the pool's own checks."""
    calls = info.calls
    if discard is not None:
      reward, verification, step_rewards = 0.0, {}, None
    if not isinstance(verification, (dict, type(None))):
      raise SessionError(400, "verification: must be a dict")
    verification = dict(verification or {})
    if "gateway" in verification:
      raise SessionError(400, "verification: the key 'gateway' is the "
                         "gateway's own")
    if step_rewards is not None and len(step_rewards) != len(calls):
      raise SessionError(400, f"step_rewards: {len(step_rewards)} for the "
                         f"session's {len(calls)} recorded calls")
    verification["gateway"] = {
        "session_id": info.session_id, "ended_by": ended_by,
        "parents": [c.parent for c in calls],
        "shared": [c.shared for c in calls],
        "continues": [c.continues for c in calls],
        "finish_reasons": [c.finish_reason for c in calls]}
    if discard is not None:
      verification["gateway"]["discarded"] = discard
    steps = tuple(pool_lib.Step(c.prompt, c.completion, c.logprobs,
                                c.policy_version,
                                0.0 if step_rewards is None
                                else step_rewards[i])
                  for i, c in enumerate(calls))
    return pool_lib.Trajectory(
        info.trajectory_id, info.group_id, info.env, info.task_id,
        info.difficulty, steps, reward, verification, 0, s.opened_at,
        max(time.time(), s.opened_at))

  def _end_quietly(self, sid: str, ended_by: str) -> None:
    try:
      self._end(sid, ended_by)
    except SessionError:   # ended meanwhile by someone else
      pass

  def _reap_loop(self) -> None:
    interval = min(1.0, self.config.session_timeout_s / 4)
    while not self._stop.wait(interval):
      now = time.monotonic()
      with self._cond:
        idle = [sid for sid, s in self._sessions.items()
                if not s.ending and not s.in_flight
                and now - s.active_at > s.timeout_s]
      for sid in idle:
        self._end_quietly(sid, "timeout")


class _Call:
  """The server's Recording of one call (m2jax/serve/app.py)."""
  # pylint: disable=protected-access

  def __init__(self, gateway: Gateway, session: _Session):
    self.gateway, self.session, self.open = gateway, session, True

  def done(self, prompt, sample: Sample, policy_version: int) -> None:
    self.gateway._record(self.session, prompt, sample, policy_version)

  def close(self) -> None:
    if self.open:
      self.open = False
      self.gateway._release(self.session)


class _Recorder:
  """The server's Recorder: admits calls into their sessions."""
  # pylint: disable=protected-access

  def __init__(self, gateway: Gateway):
    self.gateway = gateway

  async def begin(self, headers, *, prompts: int, n: int) -> _Call | None:
    return await self.gateway._begin(headers, prompts, n)


def _check_id(sid) -> None:
  if not isinstance(sid, str) or not _SESSION_ID.fullmatch(sid):
    raise SessionError(400, f"session id {str(sid)[:40]!r}: 1-128 letters, "
                       "digits or '._:-'", "invalid_session_id")


def _frozen(values, dtype) -> np.ndarray:
  a = np.asarray(values, dtype)
  a.flags.writeable = False
  return a


def _verdict(v) -> Verdict | None:
  if v is None or isinstance(v, Verdict):
    return v
  if isinstance(v, envs_base.Verification):
    return Verdict(float(v.reward), dict(v.detail, correct=bool(v.correct)))
  raise TypeError(f"a verifier returns a Verdict, an env Verification or "
                  f"None, not {type(v).__name__}")


def serve(loop, gateway: Gateway, *, model_name: str,
          host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info") -> None:
  """Serve the recording gateway until interrupted (the engine loop must be
  started); open sessions end as at a timeout when it stops."""
  # pylint: disable=import-outside-toplevel
  import uvicorn
  app_lib.check_host(host, api_key)
  app = gateway.create_app(loop, model_name=model_name, api_key=api_key)
  gateway.start()
  try:
    uvicorn.run(app, host=host, port=port, log_level=log_level)
  finally:
    gateway.close()
