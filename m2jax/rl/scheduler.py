"""Forge's scheduler: which finished rollouts the trainer may take (SPEC §3).

An in-memory queue of rollouts in submission order; the data pool
(m2jax.rl.pool) holds the trajectories, the queue only their ids. Rollout
completion times range from seconds to hours, so the order in which the
trainer takes them is a trade-off (SPEC §3, "Windowed FIFO"):

  "fifo"      only a finished prefix of the queue: batches keep the task mix,
              but one slow rollout at the head stalls the trainer.
  "greedy"    any finished rollout, the first finished first: the trainer
              never waits while anything is done, but batches skew to the
              fast (easy) tasks and the slow ones age.
  "windowed"  (default, M2) any finished rollout among the first
              w = ceil(W * N) positions of the queue (N its length, W = 0.3),
              in queue order, never beyond: the trainer waits only while
              every rollout in the window is still running.

Policy lag. A rollout submitted with weights of version v and trained by
the trainer at version u has lag u - v. Entries with lag > max_lag at the
trainer's version are *stale*: take never returns them, they no longer
count as queue positions (N and the window exclude them), and stale(u)
reports them (finished ones to discard in the pool, running ones to cancel)
until drop removes them. Backpressure: at most max_queued entries (running,
finished, stale but not yet dropped) may be queued; capacity() says how many
more may be submitted.

Worst-case lag bound. Suppose versions only increase and the trainer takes
exactly B entries at each version (over one or more take calls), trains on
them, then increments its version. Then:

  (1) Every id take(n, u) returns has lag u - v <= max_lag.
  (2) Once an entry is *committed*, only the p entries ahead of it in the
      policy's order can be taken before it. Committed means: fifo, from its
      submission (queue order); windowed, from its finishing (queue order:
      an entry behind it is in the window only if it is too, and the window
      is taken in queue order); greedy, from its finishing (finish order).
      If at that moment the trainer is at version u, the entry is trained at
      version <= u + ceil((p + 1) / B) (<= u + ceil(p / B) if the batch of u
      is still being gathered), or is stale before. Proof: taken at u + m,
      the batches of u .. u+m-1 were completed after that moment with at
      least (m - 1) * B (resp. (m - 1) * B + 1) entries, all from the p
      ahead. Reached when those p are finished and taken first.
  (3) Hence, with C = max_queued and rollouts starting with the trainer's
      current weights:
        fifo      lag <= ceil(C / B) (p <= C - 1 at submission): with
                  C <= max_lag * B nothing ever goes stale.
        windowed  a rollout that is finished and inside the window
                  (p <= w - 1, w = ceil(W * N) <= ceil(W * C)) at version u
                  is trained at version <= u + ceil(w / B): it can go stale
                  only if its lag then exceeded max_lag - ceil(w / B).
                  TitanRL states S + ceil((W - 1) / P) (SPEC §7): the same
                  when u is the version whose batch is being gathered.
        greedy    lag <= its lag when it finished + ceil(C / B).
      How long a rollout runs before it is committed is not bounded by the
      scheduler (a slow one keeps aging); max_lag is the hard cap (1).

  sched = Scheduler(ScheduleConfig(policy="windowed", window=0.3, max_lag=2,
                                   max_queued=64))
  seq = sched.submit(tid, version)  # rollout started; seq is its queue_seq
  sched.finish(tid)                 # its trajectory is in the pool
  ids = sched.take(n, version)      # up to n ids, removed from the queue
  gone = sched.stale(version)       # discard / cancel, then sched.drop(gone)

On resume, Scheduler.resume(config, pool.untrained(), next_seq=...) rebuilds
the queue from the pool's untrained (finished) trajectories by queue_seq.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, NamedTuple

from m2jax.config import ConfigError

POLICIES = ("windowed", "fifo", "greedy")
# The window as a fraction of the queue: the M2 report's example, W = 0.3 N
# (SPEC §3); TitanRL's `window_fraction = 0.3` (SPEC §7).
WINDOW_FRACTION = 0.3
# Not from the paper: two versions of lag, the value the loop was designed
# with (forge_design.md).
MAX_LAG = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
  """Which finished rollouts the trainer may take, and how stale they may be.

  policy: "windowed" | "fifo" | "greedy" (see the module docstring).
  window: W, the window as a fraction of the queue's length, in (0, 1].
  max_lag: most versions between a rollout's weights and the trainer's when
    it trains on it (>= 0), or None for no limit.
  max_queued: most entries in the queue (running and finished; backpressure),
    or None for no limit. max_queued <= max_lag * batch_size keeps fifo from
    ever going stale.
  """
  policy: str = "windowed"
  window: float = WINDOW_FRACTION
  max_lag: int | None = MAX_LAG
  max_queued: int | None = None

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ConfigError(f"ScheduleConfig.policy: must be one of {POLICIES} "
                        f"(got {self.policy!r})")
    if (isinstance(self.window, bool)
        or not isinstance(self.window, (int, float))
        or not 0 < self.window <= 1):
      raise ConfigError(f"ScheduleConfig.window: must be a fraction in "
                        f"(0, 1] (got {self.window!r})")
    if self.max_lag is not None and not _is_int(self.max_lag, 0):
      raise ConfigError(f"ScheduleConfig.max_lag: must be an integer >= 0 "
                        f"or None (got {self.max_lag!r})")
    if self.max_queued is not None and not _is_int(self.max_queued, 1):
      raise ConfigError(f"ScheduleConfig.max_queued: must be an integer "
                        f">= 1 or None (got {self.max_queued!r})")


def _is_int(value, low: int) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)
          and value >= low)


def window_size(queue_len: int, window: float) -> int:
  """w = ceil(W * N): how many head positions the trainer may take from.
  Rounded to 9 decimals first, so that 0.3 * 10 gives 3, not 4."""
  return math.ceil(round(window * queue_len, 9))


class Entry(NamedTuple):
  """One queued rollout, as entries() reports it."""
  trajectory_id: str
  version: int         # the weights the rollout started with
  queue_seq: int       # submission order
  finished: bool
  finish_seq: int | None  # finishing order (greedy); None while running


@dataclasses.dataclass
class _Slot:
  version: int
  queue_seq: int
  finish_seq: int | None = None


class Scheduler:
  """The rollout queue and the rule deciding what the trainer takes.

  Not thread-safe: a loop that calls it from several threads holds a lock.
  """

  def __init__(self, config: ScheduleConfig = ScheduleConfig(), *,
               next_seq: int = 0):
    self.config = config
    self._queue: dict[str, _Slot] = {}   # insertion order = queue order
    self._next_seq = next_seq
    self._next_finish = 0

  @classmethod
  def resume(cls, config: ScheduleConfig, trajectories: Iterable, *,
             next_seq: int | None = None) -> Scheduler:
    """A queue of the pool's untrained trajectories (all finished), ordered
    by queue_seq, finish order by finished_at. Each needs trajectory_id,
    queue_seq, policy_version and finished_at (m2jax.rl.pool.Trajectory).
    next_seq: the next submission's queue_seq (the pool's next_queue_seq();
    default one past the largest given). A queue longer than max_queued is
    kept; capacity() stays 0 until it drains."""
    trajs = sorted(trajectories, key=lambda t: t.queue_seq)
    seqs = [t.queue_seq for t in trajs]
    if len(set(seqs)) != len(seqs):
      dup = next(s for s in seqs if seqs.count(s) > 1)
      raise ValueError(f"Scheduler.resume: queue_seq {dup} appears twice")
    top = seqs[-1] + 1 if seqs else 0
    if next_seq is None:
      next_seq = top
    elif next_seq < top:
      raise ValueError(f"Scheduler.resume: next_seq {next_seq} is not past "
                       f"the largest queue_seq {top - 1}")
    sched = cls(config, next_seq=next_seq)
    by_finish = sorted(trajs, key=lambda t: (t.finished_at, t.queue_seq))
    finish_rank = {id(t): i for i, t in enumerate(by_finish)}
    for t in trajs:
      tid = t.trajectory_id
      if tid in sched._queue:
        raise ValueError(f"Scheduler.resume: trajectory {tid!r} appears "
                         f"twice")
      sched._queue[tid] = _Slot(int(t.policy_version), int(t.queue_seq),
                                finish_rank[id(t)])
    sched._next_finish = len(trajs)
    return sched

  # --------------------------------------------------------------- rollouts

  def submit(self, trajectory_id: str, version: int) -> int:
    """A rollout started with weights `version`; returns its queue_seq.
    Raises if the queue is full (check can_submit first)."""
    if trajectory_id in self._queue:
      raise ValueError(f"Scheduler.submit: {trajectory_id!r} is already "
                       f"queued")
    if not self.can_submit():
      raise ValueError(f"Scheduler.submit: the queue is full (max_queued="
                       f"{self.config.max_queued}); check can_submit()")
    seq = self._next_seq
    self._queue[trajectory_id] = _Slot(int(version), seq)
    self._next_seq += 1
    return seq

  def finish(self, trajectory_id: str) -> None:
    """The rollout's trajectory is in the pool: it may be taken."""
    slot = self._slot(trajectory_id, "finish")
    if slot.finish_seq is not None:
      raise ValueError(f"Scheduler.finish: {trajectory_id!r} already "
                       f"finished")
    slot.finish_seq = self._next_finish
    self._next_finish += 1

  def drop(self, trajectory_ids: Iterable[str]) -> None:
    """Removes entries (stale ones once discarded, failed rollouts)."""
    trajectory_ids = list(trajectory_ids)
    for tid in trajectory_ids:
      self._slot(tid, "drop")
    for tid in trajectory_ids:
      self._queue.pop(tid, None)

  # ---------------------------------------------------------------- trainer

  def take(self, n: int, version: int) -> list[str]:
    """Up to n ids the trainer at `version` may train on now, removed from
    the queue: the policy's rule over the entries that are not stale."""
    if not _is_int(n, 1):
      raise ValueError(f"Scheduler.take: n must be an integer >= 1 (got "
                       f"{n!r})")
    live = [(tid, s) for tid, s in self._queue.items()
            if not self._is_stale(s, version)]
    policy = self.config.policy
    if policy == "fifo":
      chosen = []
      for tid, s in live[:n]:
        if s.finish_seq is None:
          break
        chosen.append(tid)
    elif policy == "windowed":
      w = window_size(len(live), self.config.window)
      chosen = [tid for tid, s in live[:w] if s.finish_seq is not None][:n]
    else:  # greedy
      done = [(s.finish_seq, tid) for tid, s in live
              if s.finish_seq is not None]
      chosen = [tid for _, tid in sorted(done)[:n]]
    for tid in chosen:
      del self._queue[tid]
    return chosen

  def stale(self, version: int) -> list[str]:
    """Ids (queue order) whose lag at the trainer's `version` exceeds
    max_lag: never taken; discard the finished ones in the pool, cancel the
    running ones (in_flight), then drop them."""
    return [tid for tid, s in self._queue.items()
            if self._is_stale(s, version)]

  # ------------------------------------------------------------------ state

  def in_flight(self) -> list[str]:
    """Ids of queued rollouts not yet finished, in queue order."""
    return [tid for tid, s in self._queue.items() if s.finish_seq is None]

  def capacity(self) -> int | None:
    """How many more rollouts may be submitted now (None: no limit)."""
    if self.config.max_queued is None:
      return None
    return max(0, self.config.max_queued - len(self._queue))

  def can_submit(self) -> bool:
    capacity = self.capacity()
    return capacity is None or capacity > 0

  def entries(self) -> list[Entry]:
    """A snapshot of the queue, in queue order."""
    return [Entry(tid, s.version, s.queue_seq, s.finish_seq is not None,
                  s.finish_seq) for tid, s in self._queue.items()]

  @property
  def next_seq(self) -> int:
    return self._next_seq

  def __len__(self) -> int:
    return len(self._queue)

  def __contains__(self, trajectory_id: str) -> bool:
    return trajectory_id in self._queue

  def _is_stale(self, slot: _Slot, version: int) -> bool:
    max_lag = self.config.max_lag
    return max_lag is not None and version - slot.version > max_lag

  def _slot(self, trajectory_id: str, what: str) -> _Slot:
    try:
      return self._queue[trajectory_id]
    except KeyError:
      raise ValueError(f"Scheduler.{what}: {trajectory_id!r} is not queued "
                       f"(never submitted, taken or dropped)") from None
