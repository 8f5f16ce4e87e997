"""Scheduling under heterogeneous rollout latencies: a discrete-event
simulation of Forge's rollout slots, scheduler and trainer on a virtual clock
(issue 15's "Scheduling" target; the scheduler is m2jax.rl.scheduler).

  rollouts  `slots` (P) run at once. Each starts a task whose difficulty is
            drawn from `mix` and runs latency_fn(difficulty, rng) virtual
            seconds; it starts with the trainer's current weights and
            a new one starts as soon as a slot is free and the scheduler
            has capacity (backpressure, ScheduleConfig.max_queued).
  trainer   when idle, takes from the scheduler at its version until it holds
            B trajectories, trains for `step_time` seconds, then increments
            its version. Stale entries (lag > max_lag) are dropped as soon as
            they appear; a running one is cancelled, freeing its slot.

The task stream (each submission's difficulty and latency) depends only on
the seed, so every policy sees the same tasks in the same order. Per run,
over the train steps after `warmup_steps` (the start, when all P rollouts
begin at once, is left out):

  samples_per_sec        trained trajectories per virtual second
  trainer_idle_fraction  share of the time the trainer waits for a batch
  lag_mean, lag_max      policy lag of trained trajectories, in versions
  drift_tv               mean over batches of the total variation distance
                         between the batch's difficulty mix and the task mix;
                         drift_tv_iid is the same for B independent draws from
                         the mix (what sampling noise alone gives)
  difficulty_mean        mean difficulty of trained trajectories
                         (task_difficulty_mean: of the mix)
  stale_fraction         rollouts submitted that were discarded as stale
  in_flight_mean         time-average of running rollouts (slot use)

  workload = Workload(mix={1: .5, 2: .5}, latency_fn=lognormal_latency(
      {1: 5.0, 2: 50.0}, sigma=1.0))
  simulate(workload, ScheduleConfig(policy="windowed"), seed=0)
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

from m2jax.rl import scheduler as sched_lib

LatencyFn = Callable[[int, np.random.Generator], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """What the scheduler is run against (everything but the policy)."""
  mix: dict[int, float]   # difficulty -> probability of a task
  latency_fn: LatencyFn   # (difficulty, rng) -> seconds a rollout takes
  slots: int = 64         # P: concurrent rollouts
  batch_size: int = 16    # B: trajectories per train step
  step_time: float = 10.0  # seconds per train step
  steps: int = 300        # train steps simulated
  warmup_steps: int = 30  # first steps left out of the metrics

  def __post_init__(self):
    probs = np.array(list(self.mix.values()), float)
    if not self.mix or (probs < 0).any() or abs(probs.sum() - 1) > 1e-6:
      raise ValueError(f"Workload.mix: must map difficulties to "
                       f"probabilities summing to 1 (got {self.mix!r})")
    for name in ("slots", "batch_size", "steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"Workload.{name}: must be >= 1 (got "
                         f"{getattr(self, name)!r})")
    if self.step_time <= 0:
      raise ValueError(f"Workload.step_time: must be > 0 (got "
                       f"{self.step_time!r})")
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"Workload.warmup_steps: must be in [0, steps) (got "
                       f"{self.warmup_steps!r})")


def lognormal_latency(medians: dict[int, float], sigma: float) -> LatencyFn:
  """Latency ~ median[d] * exp(sigma * N(0, 1)): heavy right tail, growing
  with difficulty through the medians."""
  def latency(difficulty: int, rng: np.random.Generator) -> float:
    return float(medians[difficulty] * np.exp(sigma * rng.standard_normal()))
  return latency


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
  """TV distance between the empirical mix of `counts` and `probs`."""
  return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def iid_drift(mix: dict[int, float], batch_size: int, draws: int = 4000,
              seed: int = 0) -> float:
  """Mean TV distance of B independent draws from the mix: the drift that
  sampling noise alone gives a batch."""
  probs = np.array(list(mix.values()), float)
  counts = np.random.default_rng(seed).multinomial(batch_size, probs, draws)
  return float(np.mean([total_variation(c, probs) for c in counts]))


def simulate(workload: Workload, schedule: sched_lib.ScheduleConfig,
             seed: int) -> dict:
  """One run of `schedule` on `workload`'s task stream of `seed`; the
  metrics of the module docstring."""
  levels = list(workload.mix)
  probs = np.array([workload.mix[d] for d in levels], float)
  rng = np.random.default_rng(seed)
  B = workload.batch_size
  sched = sched_lib.Scheduler(schedule)
  events: list = []              # (finish time, submission number, id)
  running: set[str] = set()
  started: dict[str, tuple[int, int]] = {}   # id -> (difficulty, version)
  clock = {"t": 0.0, "version": 0, "submitted": 0, "stale": 0,
           "in_flight_area": 0.0}
  batch: list[str] = []
  train_end = None               # virtual time the step in training ends
  idle_since = 0.0
  steps = []                     # per step: (start, end, difficulties, lags)

  def drop_stale():
    gone = sched.stale(clock["version"])
    clock["stale"] += len(gone)
    running.difference_update(gone)   # cancelled: their events are ignored
    sched.drop(gone)

  def refill():
    while len(running) < workload.slots and sched.can_submit():
      n = clock["submitted"]
      difficulty = levels[rng.choice(len(levels), p=probs)]
      finish = clock["t"] + workload.latency_fn(difficulty, rng)
      tid = str(n)
      sched.submit(tid, clock["version"])
      started[tid] = (difficulty, clock["version"])
      running.add(tid)
      heapq.heappush(events, (finish, n, tid))
      clock["submitted"] += 1

  while len(steps) < workload.steps or train_end is not None:
    drop_stale()
    refill()
    if train_end is None:
      batch += sched.take(B - len(batch), clock["version"])
      if len(batch) == B:
        u = clock["version"]
        steps.append((idle_since, clock["t"],
                      [started[t][0] for t in batch],
                      [u - started[t][1] for t in batch]))
        train_end = clock["t"] + workload.step_time
        batch = []
        refill()   # the take freed queue capacity
    while events and events[0][2] not in running:
      heapq.heappop(events)
    if train_end is None and not events:
      raise RuntimeError("schedule_sim: nothing running and no batch: the "
                         "workload cannot make progress")
    if events and (train_end is None or events[0][0] < train_end):
      t_next, _, tid = heapq.heappop(events)
      clock["in_flight_area"] += len(running) * (t_next - clock["t"])
      clock["t"] = t_next
      running.discard(tid)
      sched.finish(tid)
    else:
      clock["in_flight_area"] += len(running) * (train_end - clock["t"])
      clock["t"] = train_end
      clock["version"] += 1
      train_end, idle_since = None, clock["t"]
      steps[-1] = steps[-1] + (clock["t"],)

  return _metrics(workload, levels, probs, steps, clock)


def _metrics(workload, levels, probs, steps, clock) -> dict:
  kept = steps[workload.warmup_steps:]
  t0 = steps[workload.warmup_steps - 1][4] if workload.warmup_steps else 0.0
  t1 = kept[-1][4]
  idle = sum(start - waited_from for waited_from, start, *_ in kept)
  difficulties = np.array([d for s in kept for d in s[2]])
  lags = np.array([lag for s in kept for lag in s[3]])
  index = {d: i for i, d in enumerate(levels)}
  tv = [total_variation(np.bincount([index[d] for d in s[2]],
                                    minlength=len(levels)), probs)
        for s in kept]
  return {
      "samples_per_sec": len(kept) * workload.batch_size / (t1 - t0),
      "trainer_idle_fraction": idle / (t1 - t0),
      "lag_mean": float(lags.mean()),
      "lag_max": int(lags.max()),
      "drift_tv": float(np.mean(tv)),
      "difficulty_mean": float(difficulties.mean()),
      "stale_fraction": clock["stale"] / clock["submitted"],
      "in_flight_mean": clock["in_flight_area"] / clock["t"],
      "virtual_seconds": t1 - t0,
  }
