"""Forge's rollout side: the engine generates, the environment verifies, the
data pool stores (SPEC §3).

A rollout unit is a GRPO group: one task, `group_size` samples of its prompt
(they share the prompt's KV pages in the engine). The policy sees the task
through the chat template (m2jax/data/chat.py), the format the supervised
warm start taught it:

  prompt  = render([{"role": "user", "content": task.prompt}],
                   add_generation_prompt=True)
  action  = the sampled tokens up to and including END_OF_TURN

Every action token comes with its behaviour log-probability log q (the
engine's, m2jax/infer/sampling.py; with temperature 1 and no top-k / top-p,
q is the policy itself). The end-of-turn marker is part of the action: the
policy is trained to stop.

Environment latency. A real environment takes time after generation (tool
calls, sandboxes, judges): each sample's verification is ready
`env.latency(task) * latency_scale` wall seconds after the group finished
generating, and the group is ready when all its samples are (0: at once).
Only then is it verified and committed to the pool, one transaction per
group, and reported finished to the scheduler.

Determinism. A group's task and its sampling seeds are functions of the run
seed and the group's task number `seq` (0, 1, 2, ... in the order the run
asks for tasks), so regenerating a group after a crash gives the same task
and, under the same weights, the same samples. Its samples are stored in
the pool with queue_seq = seq * group_size + i and trajectory id
"g<seq>-<i>" (group id "g<seq>").
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from m2jax.data import chat
from m2jax.errors import UserError
from m2jax.infer.engine import Engine
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import pool as pool_lib


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How groups are sampled.

  group_size: samples per task (the GRPO group).
  temperature, top_p: sampling (1 and 1: the behaviour policy is the
    policy).
  max_new_tokens: action length at most (end-of-turn included).
  latency_scale: wall seconds per simulated environment second (0: the
    environment answers at once).
  """
  group_size: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 32
  latency_scale: float = 0.0

  def __post_init__(self):
    def fail(field, rule):
      raise UserError(f"RolloutConfig.{field}: {rule} (got "
                      f"{getattr(self, field)!r})")
    if self.group_size < 1:
      fail("group_size", "must be >= 1")
    if not self.temperature > 0:
      fail("temperature", "must be > 0 (RL samples)")
    if not 0 < self.top_p <= 1:
      fail("top_p", "must be in (0, 1]")
    if self.max_new_tokens < 1:
      fail("max_new_tokens", "must be >= 1")
    if self.latency_scale < 0:
      fail("latency_scale", "must be >= 0")


def prompt_ids(task, tokenizer) -> list[int]:
  """The chat-rendered prompt of `task` (BOS, user turn, assistant header)."""
  ids = chat.render([{"role": "user", "content": task.prompt}], tokenizer,
                    add_generation_prompt=True)[0]
  return [int(t) for t in ids]


def completion_text(tokens, tokenizer) -> str:
  """The answer text of an action: decoded, cut at the end of turn."""
  text = tokenizer.decode(np.asarray(tokens, np.int32))
  return text.split(chat.END_OF_TURN, 1)[0]


def demonstration(env, task) -> dict:
  """A warm-start conversation: the task and a correct answer (SFT data)."""
  return {"messages": [{"role": "user", "content": task.prompt},
                       {"role": "assistant",
                        "content": env.demonstration(task)}]}


def group_id(seq: int) -> str:
  return f"g{seq:08d}"


def trajectory_ids(group: str, group_size: int) -> list[str]:
  """The pool ids of a group's samples."""
  return [f"{group}-{i}" for i in range(group_size)]


def group_seed(run_seed: int, seq: int) -> int:
  """The sampling seed of a group (its samples use seed, seed + 1, ...)."""
  return int(np.random.SeedSequence([run_seed, seq]).generate_state(1)
             [0]) & 0x7FFFFFFF


def task_rng(run_seed: int, seq: int) -> np.random.Generator:
  """The generator that draws task number `seq`."""
  return np.random.default_rng([run_seed, 1, seq])


@dataclasses.dataclass
class _Group:
  group_id: str
  task: object
  prompt: list[int]
  seq: int
  version: int
  submitted_at: float
  samples: list | None = None


class Rollout:
  """Groups in flight on one engine; see the module docstring.

    rollout = Rollout(engine, env, tokenizer, pool, RolloutConfig())
    rollout.submit(seq, version)
    while not done:
      for group_id in rollout.poll():   # verified and in the pool
        scheduler.finish(group_id)
    rollout.update_variables(new_variables, version + 1)   # weight sync

  Every rollout (agent_rollout.py, blackbox_rollout.py) has these methods
  and take_failed() and close(), so the loop runs any of them.
  """

  def __init__(self, engine: Engine, env, tokenizer, pool: pool_lib.Pool,
               config: RolloutConfig = RolloutConfig(), *, seed: int = 0):
    self.engine, self.env, self.tokenizer = engine, env, tokenizer
    self.pool, self.config, self.seed = pool, config, seed
    self._generating: dict[int, _Group] = {}   # request id -> group
    self._waiting: list[tuple[float, int, _Group]] = []  # (ready_at, seq, g)
    self.cancelled: set[str] = set()

  @property
  def in_flight(self) -> int:
    """Groups submitted and not yet committed."""
    return len(self._generating) + len(self._waiting)

  def cancel(self, group: str) -> None:
    """Mark a group as unwanted (stale): when done it is still committed,
    then discarded in the pool, and `poll` does not report it."""
    self.cancelled.add(group)

  def submit(self, seq: int, version: int) -> str:
    """Start generating the group of task number `seq` with the
    engine's current weights (`version`); returns its group id."""
    task = self.env.sample(task_rng(self.seed, seq))
    c = self.config
    params = SamplingParams(
        temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_new_tokens,
        n=c.group_size, seed=group_seed(self.seed, seq),
        stop=(chat.END_OF_TURN,), include_stop_str_in_output=True)
    prompt = prompt_ids(task, self.tokenizer)
    rid = self.engine.add_request(prompt, params)
    group = _Group(group_id(seq), task, prompt, seq, version, time.time())
    self._generating[rid] = group
    return group.group_id

  def poll(self) -> list[str]:
    """One engine step (if there is work), then commit every group whose
    environment latency has passed, one transaction each. Returns the ids
    of the groups committed (cancelled ones are committed and discarded,
    not returned)."""
    if self.engine.has_work():
      self.engine.step()
    now = time.time()
    for rid in [r for r in self._generating if self.engine.done(r)]:
      group = self._generating.pop(rid)
      group.samples = self.engine.result(rid)
      self.engine.release(rid)
      rng = np.random.default_rng([self.seed, 2, group.seq])
      latency = max(self.env.latency(group.task, rng)
                    for _ in group.samples)
      heapq.heappush(self._waiting, (now + latency * self.config.latency_scale,
                                     group.seq, group))
    done = []
    while self._waiting and self._waiting[0][0] <= now:
      _, _, group = heapq.heappop(self._waiting)
      trajectories = self._trajectories(group)
      stale = group.group_id in self.cancelled
      # A cancelled group is stored already discarded, in one transaction.
      self.pool.add_many(trajectories, discard_reason=(
          "stale: past max_lag before it finished" if stale else None))
      if stale:
        self.cancelled.discard(group.group_id)
      else:
        done.append(group.group_id)
    return done

  def next_ready_in(self) -> float | None:
    """Seconds until the next waiting group is ready (None: none waits)."""
    if not self._waiting:
      return None
    return max(0.0, self._waiting[0][0] - time.time())

  def take_failed(self) -> list[str]:
    """Groups that ended uncommitted: none here (a group is one engine
    request, committed whole); m2jax/rl/blackbox_rollout.py has some."""
    return []

  def update_variables(self, variables, version: int) -> None:
    """New weights for the calls from now on (the loop's weight sync)."""
    del version   # groups carry the version they were submitted with
    self.engine.update_variables(variables)

  def close(self) -> None:
    """Nothing to stop: the engine is the loop's."""

  def _trajectories(self, group: _Group) -> list[pool_lib.Trajectory]:
    state = np.asarray(group.prompt, np.int32)
    finished = time.time()
    ids = trajectory_ids(group.group_id, len(group.samples))
    out = []
    for i, sample in enumerate(group.samples):
      verdict = self.env.verify(
          group.task, completion_text(sample.tokens, self.tokenizer))
      step = pool_lib.Step(
          state=state,
          action=np.asarray(sample.tokens, np.int32),
          logprobs=np.asarray(sample.logprobs, np.float32),
          policy_version=group.version)
      out.append(pool_lib.Trajectory(
          trajectory_id=ids[i], group_id=group.group_id,
          env=group.task.env, task_id=group.task.task_id,
          difficulty=group.task.difficulty, steps=(step,),
          reward=float(verdict.reward),
          verification=dict(verdict.detail, correct=bool(verdict.correct),
                            finish_reason=sample.finish_reason),
          queue_seq=group.seq * self.config.group_size + i,
          submitted_at=group.submitted_at,
          finished_at=finished))
    return out
