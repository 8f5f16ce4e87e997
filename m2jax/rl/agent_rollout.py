"""Forge's rollout side for tool tasks: white-box agent episodes driven by
the engine in this process, committed to the pool as multi-step
trajectories (SPEC §3).

A rollout unit is a GRPO group: one task of a multi-step env
(m2jax/rl/envs/tool_tasks.py), `group_size` episodes of the white-box agent
(m2jax/agents/whitebox.py) on it. Every model call is an engine request,
and the calls of all episodes in flight share the engine's batches: a
group's first call is one request of group_size samples (they share the
prompt's KV pages, as in m2jax/rl/rollout.py); each later call is sent
when its episode has its tool results. Calls are sampled as single-turn
rollouts are (rollout.py): temperature, top_p, at most max_new_tokens
tokens, END_OF_TURN ending the action and kept in it.

A trajectory has one Step per model call: the exact prompt tokens sent
(state), the tokens and behaviour log-probs received (action, logprobs),
the policy version the call was sent under (the newest the rollout was
told of, at a `submit` or an `update_variables`: in async mode weights
may change between an episode's calls) and the env's process reward of
the call. The trajectory's reward is the outcome: env.verify(task,
answer) on the episode's final answer ("" when it ended without one).
`verification` holds the verifier's detail and correct, end ("answer",
"max_turns", "context"), turns, tool_calls, tool_errors, dropped_turns,
finish_reason (the engine's, of the last call), completion_s and
baseline_s.

Environment time (simulated seconds, the env's latency model): each model
call counts env.call_s and each turn's tool calls env.tool_seconds (run in
parallel); an episode's sum is its completion_s. An episode's next call is
sent tool_seconds * latency_scale wall seconds after its tool calls (0:
at once). A group is verified and committed, one transaction, when all its
episodes have ended.

Determinism (as rollout.py). The task of group `seq` is drawn from
task_rng(seed, seq); its first call's samples use seeds group_seed(seed,
seq) + i, call t > 0 of episode i the seed call_seed(seed, seq, i, t), and
tool latencies rng [seed, 2, seq, i, t]. Pool ids and queue positions are
rollout.py's: "g<seq>-<i>", seq * group_size + i.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time

import numpy as np

from m2jax.agents import whitebox
from m2jax.data import chat
from m2jax.errors import UserError
from m2jax.infer.engine import Engine
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib


def agent_for(env, config: whitebox.AgentConfig,
              tokenizer) -> whitebox.Agent:
  """The white-box agent of a multi-step env: its tools, `config`."""
  if not getattr(env, "multi_step", False):
    raise UserError(f"the white-box agent runs tool tasks; env "
                    f"{env.name!r} is single-turn")
  return whitebox.Agent(config, env.registry(), tokenizer)


def demonstration(env, agent: whitebox.Agent, task) -> dict:
  """A warm-start conversation: the solved task, with the tools the agent
  lists (SFT data, rendered as the agent's prompts are)."""
  return {"messages": env.demonstration_messages(task),
          "tools": agent.tool_specs()}


def check_fits(env, agent: whitebox.Agent, max_new_tokens: int) -> None:
  """UserError unless the env's demonstration at its highest level runs
  through the agent: every turn within `max_new_tokens`, every prompt
  within the agent's max_context_tokens (else the policy could never
  solve a task however well it learnt)."""
  task = env.sample(np.random.default_rng(0), env.levels[-1])
  turns = [m for m in env.demonstration_messages(task)
           if m["role"] == "assistant"]
  longest = [0]

  def replay(prompt):
    del prompt
    tokens = agent.tokenizer.encode(chat.assistant_text(turns.pop(0))
                                    + chat.END_OF_TURN)
    longest[0] = max(longest[0], len(tokens))
    return whitebox.Completion(tokens, [0.0] * len(tokens), 0)

  episode = agent.run(env.messages(task), replay)
  if episode.end == "context":
    raise UserError(
        f"AgentConfig.max_context_tokens: {agent.config.max_context_tokens}"
        f" cuts {env.name}'s demonstrated episode at level "
        f"{task.difficulty} after {len(episode.calls)} of its "
        f"{len(episode.calls) + len(turns)} calls (raise it)")
  if longest[0] > max_new_tokens:
    raise UserError(
        f"RolloutConfig.max_new_tokens: {max_new_tokens} cuts "
        f"{env.name}'s demonstrated turns ({longest[0]} tokens at level "
        f"{task.difficulty}; raise it)")


def call_seed(run_seed: int, seq: int, episode: int, turn: int) -> int:
  """The sampling seed of call `turn` (> 0) of an episode."""
  return int(np.random.SeedSequence([run_seed, seq, episode, turn])
             .generate_state(1)[0]) & 0x7FFFFFFF


def _params(config: rollout_lib.RolloutConfig, *, n: int, seed: int
            ) -> SamplingParams:
  return SamplingParams(
      temperature=config.temperature, top_p=config.top_p,
      max_tokens=config.max_new_tokens, n=n, seed=seed,
      stop=(chat.END_OF_TURN,), include_stop_str_in_output=True)


@dataclasses.dataclass
class _Group:
  group_id: str
  task: object
  seq: int
  submitted_at: float
  episodes: list
  seconds: list          # simulated seconds of each episode so far
  running: int           # episodes not ended


@dataclasses.dataclass
class _Request:
  group: _Group
  episodes: list[int]    # the episode of each sample
  version: int
  taken: set = dataclasses.field(default_factory=set)  # samples consumed


class AgentRollout:
  """Groups of agent episodes in flight on one engine, with
  rollout.Rollout's interface (submit, poll, in_flight, cancel,
  next_ready_in), so the loop's sync and async modes, its scheduler and
  resume run it unchanged.

    rollout = AgentRollout(engine, env, agent, pool, RolloutConfig())
    rollout.submit(seq, version)
    while rollout.in_flight:
      for group_id in rollout.poll():   # verified and in the pool
        scheduler.finish(group_id)
  """

  def __init__(self, engine: Engine, env, agent: whitebox.Agent,
               pool: pool_lib.Pool,
               config: rollout_lib.RolloutConfig = (
                   rollout_lib.RolloutConfig()), *, seed: int = 0):
    self.engine, self.env, self.agent = engine, env, agent
    self.pool, self.config, self.seed = pool, config, seed
    self.version = 0
    self._groups: dict[str, _Group] = {}
    self._requests: dict[int, _Request] = {}
    # Calls waiting for their tool results: (ready_at, order, group, i).
    self._delayed: list[tuple[float, int, _Group, int]] = []
    self._order = itertools.count()
    self.cancelled: set[str] = set()

  @property
  def in_flight(self) -> int:
    """Groups submitted and not yet committed."""
    return len(self._groups)

  def cancel(self, group: str) -> None:
    """Mark a group as unwanted (stale): when its episodes end it is still
    committed, then discarded in the pool, and `poll` does not report it."""
    self.cancelled.add(group)

  def submit(self, seq: int, version: int) -> str:
    """Start the group of task number `seq` with the engine's current
    weights (`version`); returns its group id."""
    self.version = max(self.version, version)
    task = self.env.sample(rollout_lib.task_rng(self.seed, seq))
    G = self.config.group_size
    episodes = [self.agent.start(self.env.messages(task)) for _ in range(G)]
    if episodes[0].done:
      raise UserError(f"{task.env}: the prompt of task {seq} alone exceeds "
                      "AgentConfig.max_context_tokens="
                      f"{self.agent.config.max_context_tokens}")
    group = _Group(rollout_lib.group_id(seq), task, seq, time.time(),
                   episodes, [0.0] * G, G)
    rid = self.engine.add_request(episodes[0].prompt, _params(
        self.config, n=G, seed=rollout_lib.group_seed(self.seed, seq)))
    self._requests[rid] = _Request(group, list(range(G)), self.version)
    self._groups[group.group_id] = group
    return group.group_id

  def poll(self) -> list[str]:
    """One engine step (if there is work); every finished call advances
    its episode (tools run, next call queued); calls whose tool results
    are ready are sent; groups whose episodes all ended are committed, one
    transaction each. Returns the ids of the groups committed (cancelled
    ones are committed and discarded, not returned)."""
    if self.engine.has_work():
      self.engine.step()
    now = time.time()
    for rid in list(self._requests):
      request = self._requests[rid]
      for k, sample in enumerate(self.engine.result(rid)):
        if k in request.taken or sample.finish_reason is None:
          continue
        request.taken.add(k)
        self._advance(request, request.episodes[k], sample, now)
      if len(request.taken) == len(request.episodes):
        self.engine.release(rid)
        del self._requests[rid]
    while self._delayed and self._delayed[0][0] <= now:
      _, _, group, i = heapq.heappop(self._delayed)
      turn = len(group.episodes[i].calls)
      rid = self.engine.add_request(group.episodes[i].prompt, _params(
          self.config, n=1, seed=call_seed(self.seed, group.seq, i, turn)))
      self._requests[rid] = _Request(group, [i], self.version)
    done = []
    for group in [g for g in self._groups.values() if not g.running]:
      del self._groups[group.group_id]
      trajectories = self._trajectories(group)
      self.pool.add_many(trajectories)
      if group.group_id in self.cancelled:
        self.cancelled.discard(group.group_id)
        self.pool.discard([t.trajectory_id for t in trajectories],
                          reason="stale: past max_lag before it finished")
      else:
        done.append(group.group_id)
    return done

  def next_ready_in(self) -> float | None:
    """Seconds until the next call waiting on its tools is sent (None:
    none waits)."""
    if not self._delayed:
      return None
    return max(0.0, self._delayed[0][0] - time.time())

  def take_failed(self) -> list[str]:
    """Groups that ended uncommitted: none here (a group's episodes are
    committed together once they have all ended)."""
    return []

  def update_variables(self, variables, version: int) -> None:
    """New weights for the engine's steps from now on (the loop's weight
    sync); calls sent after it carry `version`."""
    self.engine.update_variables(variables)
    self.version = max(self.version, version)

  def close(self) -> None:
    """Nothing to stop: the engine is the loop's."""

  def _advance(self, request: _Request, i: int, sample, now: float) -> None:
    group = request.group
    episode = group.episodes[i]
    turn = len(episode.calls)
    call = episode.advance(whitebox.Completion(
        sample.tokens, sample.logprobs, request.version,
        sample.finish_reason))
    tool_calls = sum(c["name"] in self.agent.registry
                     for c in call.message.get("tool_calls", []))
    rng = np.random.default_rng([self.seed, 2, group.seq, i, turn])
    tool_s = self.env.tool_seconds(group.task, tool_calls, rng)
    group.seconds[i] += self.env.call_s + tool_s
    if episode.done:
      group.running -= 1
    else:
      heapq.heappush(self._delayed, (now + tool_s * self.config.latency_scale,
                                     next(self._order), group, i))

  def _trajectories(self, group: _Group) -> list[pool_lib.Trajectory]:
    finished = time.time()
    task = group.task
    ids = rollout_lib.trajectory_ids(group.group_id, len(group.episodes))
    out = []
    for i, episode in enumerate(group.episodes):
      verdict = self.env.verify(task, episode.answer or "")
      steps = tuple(pool_lib.Step(
          state=np.asarray(c.state, np.int32),
          action=np.asarray(c.action, np.int32),
          logprobs=np.asarray(c.logprobs, np.float32),
          policy_version=c.version,
          reward=self.env.process_reward(task, c.message, c.results))
          for c in episode.calls)
      results = [r for c in episode.calls for r in c.results]
      out.append(pool_lib.Trajectory(
          trajectory_id=ids[i], group_id=group.group_id, env=task.env,
          task_id=task.task_id, difficulty=task.difficulty, steps=steps,
          reward=float(verdict.reward),
          verification=dict(
              verdict.detail, correct=bool(verdict.correct),
              end=episode.end, turns=len(episode.calls),
              tool_calls=len(results),
              tool_errors=sum(r.error for r in results),
              dropped_turns=episode.dropped_turns,
              finish_reason=episode.calls[-1].finish_reason,
              completion_s=group.seconds[i],
              baseline_s=self.env.baseline_s(task)),
          queue_seq=group.seq * self.config.group_size + i,
          submitted_at=group.submitted_at, finished_at=finished))
    return out


def run_episodes(engine: Engine, env, agent: whitebox.Agent, tasks,
                 params: SamplingParams) -> list:
  """One episode of `agent` per task, every call sampled with `params`,
  all in the engine at once; the ended whitebox episodes, in task order."""
  episodes = [agent.start(env.messages(t)) for t in tasks]
  live = {engine.add_request(e.prompt, params): e
          for e in episodes if not e.done}
  while live:
    engine.step()
    for rid in [r for r in live if engine.done(r)]:
      episode = live.pop(rid)
      sample = engine.result(rid)[0]
      engine.release(rid)
      episode.advance(whitebox.Completion(sample.tokens, sample.logprobs, 0,
                                          sample.finish_reason))
      if not episode.done:
        live[engine.add_request(episode.prompt, params)] = episode
  return episodes


def evaluate(engine: Engine, env, agent: whitebox.Agent, tasks,
             max_new_tokens: int) -> float:
  """Mean reward of greedy episodes of `tasks` (all in the engine at
  once)."""
  params = SamplingParams(temperature=0, max_tokens=max_new_tokens,
                          stop=(chat.END_OF_TURN,),
                          include_stop_str_in_output=True)
  episodes = run_episodes(engine, env, agent, tasks, params)
  return float(np.mean([env.verify(t, e.answer or "").reward
                        for t, e in zip(tasks, episodes)]))
