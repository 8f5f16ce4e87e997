"""m2jax.rl.scheduler: the windowed-FIFO, FIFO and greedy rules, the lag cap
and the worst-case lag bound of the module docstring (a randomized property
test over finish orders and batch sizes, and constructed cases where the
bound is reached), backpressure, resume; benchmarks.schedule_sim on a
skewed workload."""

import collections
import fractions
import math

import numpy as np
import pytest

from benchmarks import schedule_sim
from m2jax.config import ConfigError
from m2jax.rl import scheduler
from m2jax.rl.scheduler import ScheduleConfig, Scheduler


def _queue(n, config, version=0):
  sched = Scheduler(config)
  for i in range(n):
    sched.submit(f"t{i}", version)
  return sched


def _finish(sched, *ids):
  for tid in ids:
    sched.finish(tid)


# ---------------------------------------------------------------- config ---

@pytest.mark.parametrize("field,value", [
    ("policy", "lifo"), ("window", 0.0), ("window", 1.5), ("window", True),
    ("window", "0.3"), ("max_lag", -1), ("max_lag", 1.5), ("max_lag", True),
    ("max_queued", 0), ("max_queued", 2.0)])
def test_bad_config_is_a_one_line_error_naming_the_field(field, value):
  with pytest.raises(ConfigError) as err:
    ScheduleConfig(**{field: value})
  message = str(err.value)
  assert message.startswith(f"ScheduleConfig.{field}: ") and "\n" not in message
  assert repr(value) in message


def test_defaults_and_window_size():
  config = ScheduleConfig()
  assert (config.policy, config.window) == ("windowed", 0.3)
  # ceil(0.3 * 10) is 3, though 0.3 * 10 is not exactly 3 in floating point
  # for every N (e.g. 0.3 * 20 = 6.000000000000001).
  assert [scheduler.window_size(n, 0.3) for n in (0, 1, 3, 10, 11, 20)] == [
      0, 1, 1, 3, 4, 6]


# ----------------------------------------------------------------- rules ---

def test_windowed_takes_any_finished_entry_inside_the_window_in_queue_order():
  sched = _queue(10, ScheduleConfig(window=0.3, max_lag=None))
  _finish(sched, "t3", "t5")
  assert sched.take(5, 0) == []          # w = 3: t3 and t5 are beyond it
  _finish(sched, "t2")
  assert sched.take(5, 0) == ["t2"]      # the head need not be finished
  # N = 9, w = 3: t3 moved into the window.
  assert sched.take(5, 0) == ["t3"]
  # N = 8, w = 3 (t0 t1 t4); t5 is at position 3.
  _finish(sched, "t1", "t0")
  assert sched.take(1, 0) == ["t0"]      # queue order, not finish order
  # N = 7, w = 3 (t1 t4 t5).
  assert sched.take(5, 0) == ["t1", "t5"]
  assert [e.trajectory_id for e in sched.entries()] == [
      "t4", "t6", "t7", "t8", "t9"]


def test_fifo_takes_only_a_finished_prefix():
  sched = _queue(5, ScheduleConfig(policy="fifo", max_lag=None))
  _finish(sched, "t1", "t2", "t4")
  assert sched.take(5, 0) == []
  _finish(sched, "t0")
  assert sched.take(5, 0) == ["t0", "t1", "t2"]   # stops at running t3
  _finish(sched, "t3")
  assert sched.take(1, 0) == ["t3"]


def test_greedy_takes_the_first_finished_first_anywhere_in_the_queue():
  sched = _queue(10, ScheduleConfig(policy="greedy", max_lag=None))
  _finish(sched, "t9", "t4", "t7")
  assert sched.take(2, 0) == ["t9", "t4"]
  assert sched.take(5, 0) == ["t7"]


def test_stale_entries_are_never_taken_reported_and_left_out_of_the_rule():
  sched = Scheduler(ScheduleConfig(policy="fifo", max_lag=1))
  sched.submit("old", 0)
  sched.submit("new", 1)
  sched.finish("new")
  # At version 2, "old" (lag 2) is stale: it no longer blocks fifo's head.
  assert sched.stale(2) == ["old"] and sched.in_flight() == ["old"]
  assert sched.take(5, 2) == ["new"]    # lag 1 = max_lag is allowed
  sched.finish("old")                   # a stale rollout may still finish
  assert sched.take(5, 2) == [] and sched.stale(2) == ["old"]
  sched.drop(sched.stale(2))
  assert len(sched) == 0

  # The window counts live entries only: here N = 2, w = 1 (with the two
  # stale ones counted, w would be 2 and "b" inside it).
  sched = Scheduler(ScheduleConfig(window=0.5, max_lag=2))
  for tid, version in (("a", 5), ("b", 5), ("s0", 0), ("s1", 0)):
    sched.submit(tid, version)
  _finish(sched, "b", "s0", "s1")
  assert sched.take(5, 5) == []
  assert sched.stale(5) == ["s0", "s1"]


def test_backpressure_counts_every_queued_entry_until_taken_or_dropped():
  sched = Scheduler(ScheduleConfig(max_lag=0, max_queued=2))
  assert sched.capacity() == 2 and sched.can_submit()
  assert [sched.submit("a", 0), sched.submit("b", 0)] == [0, 1]
  assert sched.capacity() == 0 and not sched.can_submit()
  with pytest.raises(ValueError, match="full.*max_queued=2"):
    sched.submit("c", 0)
  sched.finish("a")
  assert sched.take(1, 0) == ["a"] and sched.capacity() == 1
  assert sched.stale(1) == ["b"] and sched.capacity() == 1  # until dropped
  sched.drop(["b"])
  assert sched.capacity() == 2 and sched.submit("c", 1) == 2
  assert Scheduler(ScheduleConfig()).capacity() is None


def test_misuse_is_a_one_line_error_naming_the_id():
  sched = _queue(2, ScheduleConfig())
  with pytest.raises(ValueError, match="'t0' is already queued"):
    sched.submit("t0", 0)
  with pytest.raises(ValueError, match="finish: 'x' is not queued"):
    sched.finish("x")
  sched.finish("t0")
  with pytest.raises(ValueError, match="'t0' already finished"):
    sched.finish("t0")
  with pytest.raises(ValueError, match="drop: 'x' is not queued"):
    sched.drop(["t1", "x"])
  assert len(sched) == 2                 # nothing dropped
  with pytest.raises(ValueError, match="n must be an integer >= 1"):
    sched.take(0, 0)


def test_resume_rebuilds_the_queue_from_untrained_trajectories():
  Traj = collections.namedtuple(
      "Traj", "trajectory_id queue_seq policy_version finished_at")
  untrained = [Traj("c", 7, 3, 10.0), Traj("a", 2, 1, 30.0),
               Traj("b", 5, 2, 20.0)]
  sched = Scheduler.resume(ScheduleConfig(policy="greedy", max_lag=None),
                           untrained, next_seq=9)
  assert [(e.trajectory_id, e.queue_seq, e.version, e.finished)
          for e in sched.entries()] == [
              ("a", 2, 1, True), ("b", 5, 2, True), ("c", 7, 3, True)]
  assert sched.in_flight() == [] and sched.next_seq == 9
  assert sched.submit("d", 4) == 9
  sched.finish("d")
  assert sched.take(4, 4) == ["c", "b", "a", "d"]   # finish order
  fifo = Scheduler.resume(ScheduleConfig(policy="fifo"), untrained)
  assert fifo.next_seq == 8 and fifo.take(2, 3) == ["a", "b"]
  with pytest.raises(ValueError, match="queue_seq 2 appears twice"):
    Scheduler.resume(ScheduleConfig(), untrained + [Traj("e", 2, 1, 0.0)])
  with pytest.raises(ValueError, match="next_seq 5 is not past"):
    Scheduler.resume(ScheduleConfig(), untrained, next_seq=5)


# ------------------------------------------------------------- lag bound ---

def _bound(record, batch_size):
  """The docstring's bound (2): version <= u + ceil((p + 1) / B)."""
  u, p = record
  return u + math.ceil((p + 1) / batch_size)


def _drive(policy, rng, *, batch_size, window, max_lag, max_queued,
           events=400):
  """Random submits, finishes (any running entry), takes (random n) and
  drops of stale entries; the trainer takes exactly B entries per version.
  Checks every take against an independent model of the rule, the lag cap
  and the bound of the commit moments. Returns (takes, stale seen)."""
  sched = Scheduler(ScheduleConfig(policy=policy, window=window,
                                   max_lag=max_lag, max_queued=max_queued))
  W = fractions.Fraction(str(window))
  queue = []       # [id, version, finish order or None], queue order
  version, have, finishes, submitted = 0, 0, 0, 0
  commit, entered = {}, {}   # id -> (version, p)
  takes = stale_seen = 0

  def live():
    return [e for e in queue
            if max_lag is None or version - e[1] <= max_lag]

  def note_window_entries():
    entries = live()
    for p, e in enumerate(entries[:math.ceil(W * len(entries))]):
      if e[2] is not None and e[0] not in entered:
        entered[e[0]] = (version, p)

  for _ in range(events):
    r = rng.random()
    running = [e for e in queue if e[2] is None]
    if r < 0.3 and (max_queued is None or len(queue) < max_queued):
      tid = f"r{submitted}"
      submitted += 1
      assert sched.submit(tid, version) == submitted - 1
      queue.append([tid, version, None])
      if policy == "fifo":
        commit[tid] = (version, len(live()) - 1)
    elif r < 0.6 and running:
      e = running[rng.integers(len(running))]
      sched.finish(e[0])
      entries = live()
      if e in entries:
        if policy == "windowed":
          commit[e[0]] = (version, entries.index(e))
        elif policy == "greedy":
          commit[e[0]] = (version, sum(x[2] is not None for x in entries))
      e[2] = finishes
      finishes += 1
    elif r < 0.85 and have < batch_size:
      n = int(rng.integers(1, batch_size - have + 1))
      entries = live()
      if policy == "fifo":
        prefix = []
        for e in entries:
          if e[2] is None:
            break
          prefix.append(e)
        want = prefix[:n]
      elif policy == "windowed":
        w = math.ceil(W * len(entries))
        want = [e for e in entries[:w] if e[2] is not None][:n]
      else:
        want = sorted((e for e in entries if e[2] is not None),
                      key=lambda e: e[2])[:n]
      got = sched.take(n, version)
      assert got == [e[0] for e in want]
      for e in want:
        queue.remove(e)
        assert max_lag is None or version - e[1] <= max_lag   # (1)
        assert version <= _bound(commit[e[0]], batch_size)     # (2)
        if policy == "windowed":
          assert version <= _bound(entered[e[0]], batch_size)  # (3)
          if max_queued is not None:   # p <= w - 1 <= ceil(W * C) - 1
            assert entered[e[0]][1] < math.ceil(W * max_queued)
      have += len(got)
      takes += len(got)
    elif r < 0.95 and have == batch_size:
      version, have = version + 1, 0
    else:
      gone = sched.stale(version)
      assert gone == [e[0] for e in queue if e not in live()]
      sched.drop(gone)
      queue[:] = live()
      stale_seen += len(gone)
    note_window_entries()
    assert len(sched) == len(queue)
  return takes, stale_seen


@pytest.mark.parametrize("policy", scheduler.POLICIES)
def test_random_runs_respect_the_rule_the_lag_cap_and_the_lag_bound(policy):
  rng = np.random.default_rng(0)
  takes = stale = 0
  for _ in range(12):
    max_lag = [None, 0, 1, 2, 3][rng.integers(5)]
    t, s = _drive(policy, rng, batch_size=int(rng.integers(1, 5)),
                  window=[0.3, 0.5, 1.0][rng.integers(3)], max_lag=max_lag,
                  max_queued=[None, 4, 8, 16][rng.integers(4)])
    takes, stale = takes + t, stale + s
  assert takes > 500 and stale > 20     # the runs did exercise both


def test_fifo_never_goes_stale_with_max_queued_at_most_max_lag_times_b():
  rng = np.random.default_rng(1)
  for batch_size, max_lag in ((1, 1), (2, 2), (3, 1), (4, 3)):
    takes, stale = _drive("fifo", rng, batch_size=batch_size, window=0.3,
                          max_lag=max_lag, max_queued=max_lag * batch_size)
    assert takes > 50 and stale == 0


def _lag_run(policy, finish_order, *, max_lag=None):
  """B = 2. The batch of version 0 is complete (taken, in training) when
  four entries are queued and finish in `finish_order`; the trainer then
  takes two per version. Returns {id: version it was taken at}."""
  sched = Scheduler(ScheduleConfig(policy=policy, window=0.5,
                                   max_lag=max_lag, max_queued=4))
  for tid in ("x", "y"):
    sched.submit(tid, 0)
    sched.finish(tid)
  assert sched.take(2, 0) + sched.take(2, 0) == ["x", "y"]  # w may be 1
  for tid in "abcd":
    sched.submit(tid, 0)
  _finish(sched, *finish_order)
  taken = {}
  for version in (1, 2):
    for tid in sched.take(2, version):
      taken[tid] = version
  return taken, sched


def test_the_lag_bound_is_reached():
  # fifo, committed at submission: "d" has p = 3 ahead, bound
  # ceil(C / B) = ceil(4 / 2) = 2 = max_lag, reached and not stale.
  taken, sched = _lag_run("fifo", "abcd", max_lag=2)
  assert taken == {"a": 1, "b": 1, "c": 2, "d": 2} and sched.stale(2) == []
  # windowed, finished inside the window at version 0 (N = 4, w = 2, "b"
  # at p = 1): bound 0 + ceil(2 / 2) = 1; the later-finished "a" ahead of it
  # is still taken first.
  taken, _ = _lag_run("windowed", "ba")
  assert taken["a"] == 1 and taken["b"] == 1
  # windowed, "c" finished outside the window (p = 2): bound
  # 0 + ceil(3 / 2) = 2, reached.
  taken, _ = _lag_run("windowed", "cab")
  assert taken == {"a": 1, "b": 1, "c": 2}
  # greedy: "c" finished with two finished entries ahead: bound 2, reached;
  # with max_lag 1 the same entry is stale instead.
  taken, _ = _lag_run("greedy", "abc")
  assert taken == {"a": 1, "b": 1, "c": 2}
  taken, sched = _lag_run("greedy", "abc", max_lag=1)
  assert taken == {"a": 1, "b": 1} and sched.stale(2) == ["c", "d"]


# ------------------------------------------------------------- simulator ---

def test_simulator_greedy_drifts_to_easy_tasks_fifo_keeps_the_mix():
  # Hard tasks take 10x longer; a lag cap of 2 versions (2 s apart at the
  # fastest) discards the slow ones that greedy and windowed pass over, and
  # max_queued = max_lag * B keeps fifo from ever going stale.
  workload = schedule_sim.Workload(
      mix={1: 0.5, 2: 0.5}, latency_fn=schedule_sim.lognormal_latency(
          {1: 1.0, 2: 10.0}, sigma=0.5),
      slots=32, batch_size=8, step_time=2.0, steps=200, warmup_steps=20)
  out = {policy: schedule_sim.simulate(
      workload, ScheduleConfig(policy=policy, max_lag=2, max_queued=16),
      seed=0) for policy in scheduler.POLICIES}
  greedy, fifo, windowed = out["greedy"], out["fifo"], out["windowed"]
  assert greedy["drift_tv"] > fifo["drift_tv"] + 0.05
  assert greedy["difficulty_mean"] < fifo["difficulty_mean"] - 0.1
  assert fifo["stale_fraction"] == 0 and greedy["stale_fraction"] > 0.1
  assert (fifo["samples_per_sec"] < windowed["samples_per_sec"]
          < greedy["samples_per_sec"])
  assert (fifo["trainer_idle_fraction"] > windowed["trainer_idle_fraction"]
          > greedy["trainer_idle_fraction"])
  for run in out.values():
    assert run["lag_max"] <= 2
    assert 0 < run["samples_per_sec"] <= 8 / 2.0   # the trainer's ceiling
