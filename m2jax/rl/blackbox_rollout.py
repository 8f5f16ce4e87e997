"""Forge's rollout side for a black-box agent (SPEC §3): tool-task episodes
run by a separate program (agents/blackbox_agent.py) that imports nothing
of m2jax and reaches the policy only through the recording gateway
(m2jax/rl/gateway.py), each of its sessions committed to the pool as one
multi-step trajectory.

What runs, for the rollout's life:
  * an EngineLoop around the RL loop's engine (m2jax/serve/loop.py): its
    thread steps the engine; a weight sync is its swap, which waits for
    the calls in flight, so no call spans two policy versions;
  * a Gateway over the pool (sessions opened only here, implicit_sessions
    off), served by uvicorn in a thread on 127.0.0.1 at a free port with a
    random key;
  * one agent process (sys.executable agents/blackbox_agent.py), given one
    task line per session on its stdin; its result lines come back on its
    stdout.

It has AgentRollout's interface (submit, poll, in_flight, cancel,
next_ready_in, take_failed, update_variables, close), so the loop's modes,
scheduler and resume run either. For the same run seed its trajectories
match the white-box rollout's (m2jax/rl/agent_rollout.py):
  ids         group "g<seq>", trajectory (and session) "g<seq>-<i>",
              queue_seq seq * group_size + i
  task        env.sample(task_rng(seed, seq)): its messages and the env's
              tools (the specs the white-box agent lists)
  sampling    temperature, top_p, max_new_tokens per call; call t of
              episode i seeded group_seed(seed, seq) + i (t = 0) or
              call_seed(seed, seq, i, t); at most AgentConfig.max_turns
              calls; a prompt longer than max_context_tokens is refused by
              the server (the engine loop's max_seq_len is max_context_
              tokens + max_new_tokens) and the episode ends, "context"
  verdict     the session's verifier reads each call's completion as the
              white-box agent does (chat.parse_completion), runs its tool
              calls with the env's own tools for the process reward, and
              gives the white-box rollout's verification keys: the
              verifier's detail, correct, end, turns, tool_calls,
              tool_errors, finish_reason, completion_s (env.call_s and
              env.tool_seconds from the white-box rollout's draws) and
              baseline_s; dropped_turns counts the calls that do not keep
              the previous call's whole prompt (the agent rewrote its
              context: all a black box shows of its context management;
              a re-rendered cut completion alone is not one). The gateway
              adds its "gateway" key.
  latency     with latency_scale > 0 each task line carries, per turn, the
              wall seconds its tools take with 1..TOOL_WAIT_CALLS calls
              (those draws), which the agent waits.
They differ where the agent is its own: its tools' output (its
calculator: the same results, other error wording) and the server's
stops (the chat route also stops at EOS).

Groups. poll reports a group once all its sessions are committed (ended
by the agent with {} and judged by the verifier). A group whose session
ended otherwise (the agent failed and discarded it, no call was recorded,
the verifier or the pool failed) is not retried: its stored sessions are
discarded in the pool and take_failed() hands it to the loop, which drops
it from its scheduler and generates another. `max_failed_in_a_row` such
groups with nothing committed between raise RuntimeError, as do the agent
process exiting and the engine failing: a broken agent stops the run.

Resume. Sessions commit one at a time, so a run killed mid-group can leave
part of a group in the pool. submit(seq) opens sessions only for the
trajectories the pool lacks (queue positions never generated) and counts
its untrained ones as done; a group with a discarded member fails at once
(nothing is generated twice). close() discards the sessions still open,
with their groups.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from m2jax.agents import whitebox
from m2jax.data import chat
from m2jax.errors import UserError
from m2jax.infer.engine import Engine
from m2jax.rl import agent_rollout
from m2jax.rl import gateway as gw_lib
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.serve.loop import EngineLoop

log = logging.getLogger(__name__)

AGENT_PROGRAM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "agents", "blackbox_agent.py")
MODEL_NAME = "policy"
TOOL_WAIT_CALLS = 4      # tool calls per turn with their own wall latency
_POLL_WAIT_S = 0.05      # poll waits this long for a session to end


@dataclasses.dataclass(frozen=True)
class BlackBoxConfig:
  """How the black-box rollout runs its agent.

  session_timeout_s: a session without a call this long ends (judged as
    its calls stand); the agent's own call_timeout_s bounds a call first.
  call_timeout_s: seconds one HTTP call of the agent may take.
  max_failed_in_a_row: failed groups, nothing committed between, before
    the rollout gives up (RuntimeError).
  start_timeout_s: seconds the agent process may take to start.
  """
  session_timeout_s: float = 3600.0
  call_timeout_s: float = 600.0
  max_failed_in_a_row: int = 8
  start_timeout_s: float = 60.0

  def __post_init__(self):
    for field in ("session_timeout_s", "call_timeout_s", "start_timeout_s"):
      if not getattr(self, field) > 0:
        raise UserError(f"BlackBoxConfig.{field}: must be > 0 (got "
                        f"{getattr(self, field)!r})")
    if self.max_failed_in_a_row < 1:
      raise UserError(f"BlackBoxConfig.max_failed_in_a_row: must be >= 1 "
                      f"(got {self.max_failed_in_a_row!r})")


@dataclasses.dataclass
class _Group:
  group_id: str
  seq: int
  task: object
  sessions: dict[int, str]     # episode -> its session id
  stored: list[int]            # episodes the pool held at the submit
  broken: str | None = None    # why it cannot be committed (resume)


class _Server:
  """uvicorn serving `app` in a thread on a free loopback port."""

  def __init__(self, app, timeout_s: float = 30.0):
    import uvicorn  # pylint: disable=import-outside-toplevel
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    self.server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False))
    self.thread = threading.Thread(target=self.server.run, daemon=True,
                                   kwargs={"sockets": [sock]},
                                   name="gateway-server")
    self.thread.start()
    deadline = time.time() + timeout_s
    while not self.server.started:
      if not self.thread.is_alive() or time.time() > deadline:
        raise RuntimeError("the gateway's server did not start")
      time.sleep(0.01)

  def close(self) -> None:
    self.server.should_exit = True
    self.thread.join(10)


class BlackBoxRollout:
  """Groups of black-box agent sessions through the gateway (module
  docstring).

    rollout = BlackBoxRollout(engine, env, AgentConfig(), pool,
                              RolloutConfig(), seed=0)
    rollout.submit(seq, version)
    while rollout.in_flight:
      for group_id in rollout.poll():   # verified and in the pool
        scheduler.finish(group_id)
      scheduler.drop(rollout.take_failed())
    rollout.update_variables(new_variables, version + 1)
    rollout.close()
  """

  def __init__(self, engine: Engine, env, agent_config: whitebox.AgentConfig,
               pool: pool_lib.Pool,
               config: rollout_lib.RolloutConfig = (
                   rollout_lib.RolloutConfig()), *, seed: int = 0,
               policy_version: int = 0,
               blackbox: BlackBoxConfig = BlackBoxConfig(),
               command: list[str] | None = None):
    if not getattr(env, "multi_step", False):
      raise UserError(f"the black-box agent runs tool tasks; env "
                      f"{env.name!r} is single-turn")
    if agent_config.summarise or agent_config.keep_last_turns:
      raise UserError("AgentConfig.summarise / keep_last_turns: the "
                      "white-box agent's context management; the black-box "
                      "agent manages its own (leave them off)")
    if engine.tokenizer is None:
      raise UserError("the black-box rollout needs an engine with a "
                      "tokenizer (the gateway serves chat)")
    if command is None and not os.path.isfile(AGENT_PROGRAM):
      raise UserError(f"the black-box agent program {AGENT_PROGRAM} is "
                      "missing (run from a checkout of the repository)")
    self.engine, self.env, self.agent_config = engine, env, agent_config
    self.pool, self.config, self.seed = pool, config, seed
    self.blackbox, self.version = blackbox, policy_version
    self.tokenizer = engine.tokenizer
    self.tools = env.registry().specs()
    self.cancelled: set[str] = set()
    self.stats = collections.Counter()   # agent_errors, groups_failed
    self._groups: dict[str, _Group] = {}
    self._failed: list[str] = []
    self._failed_in_a_row = 0
    self._results: queue.Queue = queue.Queue()
    self._ready = threading.Event()
    self._closed = False
    self._server = self._proc = None
    self._stderr = tempfile.TemporaryFile(mode="w+")
    self.engine_loop = EngineLoop.around(
        engine, policy_version=policy_version,
        max_seq_len=agent_config.max_context_tokens + config.max_new_tokens)
    self.gateway = gw_lib.Gateway(pool, gw_lib.GatewayConfig(
        session_timeout_s=blackbox.session_timeout_s,
        implicit_sessions=False, env=env.name))
    key = secrets.token_urlsafe(24)
    try:
      self.engine_loop.start()
      self._server = _Server(self.gateway.create_app(
          self.engine_loop, model_name=MODEL_NAME, api_key=key))
      self.gateway.start()
      self._start_agent(command or [sys.executable, AGENT_PROGRAM], key)
    except BaseException:
      self.close()
      raise

  # ---------------------------------------------------------- interface --

  @property
  def in_flight(self) -> int:
    """Groups submitted and not yet committed or failed."""
    return len(self._groups)

  @property
  def url(self) -> str:
    """The gateway's base URL (its OpenAI routes are under /v1)."""
    return self._server.url

  def cancel(self, group: str) -> None:
    """Mark a group as unwanted (stale): when its sessions end it is
    discarded in the pool, and neither poll nor take_failed reports it."""
    self.cancelled.add(group)

  def submit(self, seq: int, version: int) -> str:
    """Open the sessions of task number `seq` and hand them to the agent;
    returns its group id. `version` is the loop's newest weights, which
    the engine loop serves already (update_variables)."""
    self.version = max(self.version, version)
    self._check_alive()
    task = self.env.sample(rollout_lib.task_rng(self.seed, seq))
    G = self.config.group_size
    gid = rollout_lib.group_id(seq)
    ids = rollout_lib.trajectory_ids(gid, G)
    group = _Group(gid, seq, task, {}, [])
    for i, tid in enumerate(ids):
      state = self._stored(tid)
      if state == "untrained":
        group.stored.append(i)
      elif state is not None:
        group.broken = f"trajectory {tid} is {state} in the pool already"
    lines = []
    if group.broken is None:
      for i, tid in enumerate(ids):
        if i in group.stored:
          continue
        group.sessions[i] = self.gateway.open_session(
            tid, trajectory_id=tid, group_id=gid, task_id=task.task_id,
            env=task.env, difficulty=task.difficulty, queue_seq=seq * G + i,
            verifier=self._verifier(task, seq, i))
        lines.append(self._task_line(task, seq, i, tid))
    self._groups[gid] = group
    self._send(lines)
    return gid

  def poll(self) -> list[str]:
    """Groups whose sessions have all ended: the committed ones are
    returned (cancelled ones discarded instead), the failed ones discarded
    and kept for take_failed. Waits up to 50 ms for a session to end when
    none has (the engine loop's thread does the work meanwhile)."""
    self._check_alive()
    self._read_results()
    done = self._collect()
    if not done and self._groups:
      waiting = next((sid for g in self._groups.values()
                      for sid in g.sessions.values()
                      if self.gateway.outcome(sid) is None), None)
      if waiting is not None:
        try:
          self.gateway.wait(waiting, timeout=_POLL_WAIT_S)
        except TimeoutError:
          pass
      self._read_results()
      done = self._collect()
    return done

  def take_failed(self) -> list[str]:
    """Ids of the groups that failed since the last call (discarded in the
    pool; module docstring)."""
    failed, self._failed = self._failed, []
    return failed

  def next_ready_in(self) -> float | None:
    """None: no call waits on the rollout (the agent waits on its tools)."""
    return None

  def update_variables(self, variables, version: int) -> None:
    """Serve `variables` as `version` from the next call on: the engine
    loop's swap, once the calls in flight are done; returns when it is
    (so the loop may use the engine itself, e.g. to evaluate)."""
    done = self.engine_loop.swap_weights(variables, version)
    while True:
      try:
        done.result(timeout=1.0)
        break
      except TimeoutError:
        self._check_alive()
    self.version = version

  def close(self) -> None:
    """Discard the groups still in flight (their open sessions ended as
    discarded, their committed ones discarded), then stop the agent, the
    server, the gateway and the engine loop. Idempotent."""
    if self._closed:
      return
    self._closed = True
    for group in list(self._groups.values()):
      for sid in group.sessions.values():
        self._discard_session(sid, "the rollout closed before it ended")
    for group in list(self._groups.values()):
      for sid in group.sessions.values():
        try:   # one the agent was ending as we closed
          self.gateway.wait(sid, timeout=10)
        except TimeoutError:
          pass
    try:
      self._collect(closing=True)
    except Exception:  # pylint: disable=broad-except
      log.exception("discarding the groups in flight at close failed")
    self._stop_agent()
    if self._server is not None:
      self._server.close()
    self.gateway.close()
    self.engine_loop.stop()
    self._stderr.close()

  # ---------------------------------------------------------- the agent --

  def _start_agent(self, command: list[str], key: str) -> None:
    self._proc = subprocess.Popen(
        command + [f"--base_url={self._server.url}/v1",
                   f"--model={MODEL_NAME}",
                   f"--timeout={self.blackbox.call_timeout_s}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        text=True, bufsize=1, env={**os.environ, "OPENAI_API_KEY": key})
    threading.Thread(target=self._read_agent, daemon=True,
                     name="blackbox-agent-reader").start()
    deadline = time.time() + self.blackbox.start_timeout_s
    while not self._ready.wait(0.05):
      if self._proc.poll() is not None or time.time() > deadline:
        raise RuntimeError(f"the black-box agent did not start: "
                           f"{self._agent_stderr()}")

  def _read_agent(self) -> None:
    for line in self._proc.stdout:
      try:
        result = json.loads(line)
      except ValueError:
        log.warning("black-box agent: %s", line.rstrip())
        continue
      if result == {"ready": True}:
        self._ready.set()
      else:
        self._results.put(result)

  def _agent_stderr(self) -> str:
    self._stderr.seek(0)
    text = self._stderr.read().strip()
    return text[-2000:] or f"exit status {self._proc.poll()}"

  def _send(self, lines: list[dict]) -> None:
    try:
      for line in lines:
        self._proc.stdin.write(json.dumps(line) + "\n")
      self._proc.stdin.flush()
    except (BrokenPipeError, OSError) as e:
      raise RuntimeError(f"the black-box agent stopped reading tasks "
                         f"({e}): {self._agent_stderr()}") from None

  def _stop_agent(self) -> None:
    proc = self._proc
    if proc is None:
      return
    try:
      proc.stdin.close()
    except OSError:
      pass
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.terminate()
      try:
        proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

  def _check_alive(self) -> None:
    if self._closed:
      raise RuntimeError("the black-box rollout is closed")
    if self.engine_loop.stats["engine_failures"]:
      raise RuntimeError("the engine failed while serving the black-box "
                         "agent (its traceback is in the log)")
    if not self.engine_loop.alive or not self._server.thread.is_alive():
      raise RuntimeError("the black-box rollout's engine loop or server "
                         "stopped")
    if self._proc.poll() is not None:
      raise RuntimeError(f"the black-box agent exited: "
                         f"{self._agent_stderr()}")

  def _task_line(self, task, seq: int, i: int, session_id: str) -> dict:
    c, turns = self.config, self.agent_config.max_turns
    seeds = [rollout_lib.group_seed(self.seed, seq) + i] + [
        agent_rollout.call_seed(self.seed, seq, i, t) for t in range(1, turns)]
    line = {"session_id": session_id, "messages": self.env.messages(task),
            "tools": self.tools, "max_turns": turns,
            "sampling": {"temperature": c.temperature, "top_p": c.top_p,
                         "max_tokens": c.max_new_tokens, "seeds": seeds}}
    if c.latency_scale > 0:
      line["tool_wait_s"] = [
          [c.latency_scale * self.env.tool_seconds(task, k, self._rng(
              seq, i, t)) for k in range(1, TOOL_WAIT_CALLS + 1)]
          for t in range(turns)]
    return line

  def _read_results(self) -> None:
    """The agent's result lines: a task that failed with its session still
    open has it discarded (the agent ends its sessions itself otherwise)."""
    while True:
      try:
        result = self._results.get_nowait()
      except queue.Empty:
        return
      if result.get("ok"):
        continue
      self.stats["agent_errors"] += 1
      sid = result.get("session_id")
      log.warning("black-box agent, session %s: %s", sid,
                  result.get("error"))
      if isinstance(sid, str) and self.gateway.session(sid) is not None:
        self._discard_session(sid, f"agent error: {result.get('error')}")

  def _discard_session(self, sid: str, reason: str) -> None:
    try:
      self.gateway.end_session(sid, discard=reason[:1000])
    except gw_lib.SessionError:   # ended meanwhile
      pass

  # --------------------------------------------------------- the groups --

  def _stored(self, trajectory_id: str) -> str | None:
    """None (not in the pool), "untrained", "trained" or "discarded"."""
    try:
      events = self.pool.history(trajectory_id)
    except pool_lib.PoolError:
      return None
    live = [e.kind for e in events if e.undone_at is None]
    return live[-1] if live else "untrained"

  def _collect(self, closing: bool = False) -> list[str]:
    """Settle the groups whose sessions have all ended."""
    done = []
    G = self.config.group_size
    for group in list(self._groups.values()):
      outcomes = {i: self.gateway.outcome(sid)
                  for i, sid in group.sessions.items()}
      if any(o is None for o in outcomes.values()):
        continue
      del self._groups[group.group_id]
      ids = rollout_lib.trajectory_ids(group.group_id, G)
      bad = [f"{ids[i]} {o.status} ({o.reason})"
             for i, o in outcomes.items() if o.status != "committed"]
      reason = group.broken or (bad[0] if bad else None)
      cancelled = group.group_id in self.cancelled
      self.cancelled.discard(group.group_id)
      if reason is None and not cancelled:
        # (At the close a whole group stays in the pool, untrained: a
        # resumed run trains it.)
        self._failed_in_a_row = 0
        done.append(group.group_id)
        continue
      committed = [ids[i] for i in group.stored] + [
          ids[i] for i, o in outcomes.items() if o.status == "committed"]
      committed = [t for t in committed if self._stored(t) == "untrained"]
      if committed:
        self.pool.discard(committed, reason=(
            "stale: past max_lag before it finished" if reason is None
            else f"group failed: {reason}")[:1000])
      if reason is None or closing:
        continue
      log.warning("black-box group %s failed: %s", group.group_id, reason)
      self.stats["groups_failed"] += 1
      if not cancelled:
        self._failed.append(group.group_id)
      if group.broken is None:
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= self.blackbox.max_failed_in_a_row:
          raise RuntimeError(
              f"{self._failed_in_a_row} black-box groups failed in a row; "
              f"the last: {reason}")
    return done

  # --------------------------------------------------------- the verdict --

  def _rng(self, seq: int, episode: int, turn: int) -> np.random.Generator:
    """The white-box rollout's draw of a turn's tool latencies."""
    return np.random.default_rng([self.seed, 2, seq, episode, turn])

  def _verifier(self, task, seq: int, episode: int):
    def judge(session: gw_lib.Session) -> gw_lib.Verdict:
      return self._judge(task, seq, episode, session)
    return judge

  def _judge(self, task, seq: int, episode: int,
             session: gw_lib.Session) -> gw_lib.Verdict:
    """The white-box rollout's verdict on the session's calls (module
    docstring)."""
    env, registry = self.env, self.env.registry()
    messages, results, seconds = [], [], 0.0
    for t, call in enumerate(session.calls):
      message = chat.parse_completion(self.tokenizer.decode(
          np.asarray(call.completion, np.int32)))
      calls = message.get("tool_calls", [])
      results.append(tuple(registry.call(c["name"], c["arguments"])
                           for c in calls))
      messages.append(message)
      known = sum(c["name"] in registry for c in calls)
      seconds += env.call_s + env.tool_seconds(
          task, known, self._rng(seq, episode, t))
    calls = session.calls
    if not messages[-1].get("tool_calls"):
      end, answer = "answer", messages[-1]["content"]
    else:
      answer = ""
      end = ("max_turns" if len(calls) >= self.agent_config.max_turns
             else "context")
    verdict = env.verify(task, answer)
    flat = [r for rs in results for r in rs]
    return gw_lib.Verdict(
        float(verdict.reward),
        dict(verdict.detail, correct=bool(verdict.correct), end=end,
             turns=len(calls), tool_calls=len(flat),
             tool_errors=sum(r.error for r in flat),
             dropped_turns=sum(
                 c.parent != t or c.shared < len(calls[t].prompt)
                 for t, c in enumerate(calls[1:])),
             finish_reason=calls[-1].finish_reason, completion_s=seconds,
             baseline_s=env.baseline_s(task)),
        tuple(env.process_reward(task, m, r)
              for m, r in zip(messages, results)))
