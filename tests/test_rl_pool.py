"""The data pool (m2jax.rl.pool): every field round-trips bit for bit; a
trajectory, or a training batch, is all or nothing when its process is
SIGKILLed; a trainer reads and marks while a rollout process writes; the
audit (which step and version trained what), replay and rollback hold; bad
input is refused in one line and writes nothing.

The kill tests run tests/rl_pool_writer.py (no jax: it starts fast) and kill
it at a few points; its trajectories are big so the kills land inside
commits as well as between them.
"""

import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

import rl_pool_writer as writer
from m2jax.errors import MissingPathError
from m2jax.rl.pool import (TOKEN_MAX, Event, Pool, PoolError, Step,
                           Trajectory)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER = os.path.join(ROOT, "tests", "rl_pool_writer.py")


def small(i: int) -> Trajectory:
  return writer.trajectory(i, steps=2, tokens=5)


def assert_same(got: Trajectory, want: Trajectory) -> None:
  """Every field equal, arrays in dtype and bytes, floats in repr."""
  for field in dataclasses.fields(Trajectory):
    if field.name != "steps":
      a, b = getattr(got, field.name), getattr(want, field.name)
      assert (type(a), repr(a)) == (type(b), repr(b)), field.name
  assert len(got.steps) == len(want.steps)
  for k, (a, b) in enumerate(zip(got.steps, want.steps)):
    for field in dataclasses.fields(Step):
      x, y = getattr(a, field.name), getattr(b, field.name)
      if isinstance(y, np.ndarray):
        assert (x.dtype, x.shape, x.tobytes()) == (
            y.dtype, y.shape, y.tobytes()), f"steps[{k}].{field.name}"
      else:
        assert (type(x), repr(x)) == (type(y), repr(y)), (
            f"steps[{k}].{field.name}")


def one_line_error(call, match: str) -> str:
  with pytest.raises(PoolError, match=match) as e:
    call()
  assert "\n" not in str(e.value)
  return str(e.value)


def test_round_trip_keeps_every_field_bitwise(tmp_path):
  f32 = np.finfo(np.float32)
  want = Trajectory(
      trajectory_id="traj-é", group_id="group 7", env="sorting",
      task_id="sort:3 1 2", difficulty=-2,
      steps=(Step(state=np.array([0, TOKEN_MAX, 257], np.int64),
                  action=np.array([258], np.int32),
                  logprobs=np.array([-0.0], np.float32), policy_version=3,
                  reward=-0.0),
             Step(state=np.arange(5, dtype=np.int32),
                  action=np.array([1, 2, 3], np.int32),
                  logprobs=np.array([f32.smallest_subnormal, -f32.max,
                                     -1 / 3], np.float32),
                  policy_version=2, reward=0.1 + 0.2)),
      reward=1e-300, verification={"correct": True, "detail": {
          "parsed": [1, 2, 3], "why": None, "score": np.float32(0.5)}},
      queue_seq=2**40, submitted_at=1_767_225_600.123456,
      finished_at=1_767_225_600.987654)
  path = tmp_path / "pool.sqlite"
  with Pool(path) as p:
    p.add(want)
  with Pool(path) as p:  # read back from the file, by a fresh connection
    got, = p.get(["traj-é"])
  # The pool holds int32 tokens, and JSON (numpy scalars as numbers).
  assert got.steps[0].state.dtype == np.int32
  assert type(got.verification["detail"]["score"]) is float
  assert got.policy_version == 2  # the oldest weights of its steps
  assert_same(got, want)
  assert sqlite3.connect(path).execute(
      "PRAGMA journal_mode").fetchone() == ("wal",)


GOOD_STEP = dict(state=np.arange(3, dtype=np.int32),
                 action=np.array([1, 2], np.int32),
                 logprobs=np.array([-0.5, -1.0], np.float32),
                 policy_version=0)


@pytest.mark.parametrize("fields, match", [
    (dict(logprobs=np.array([-0.5], np.float32)),
     r"Step.logprobs: shape \(1,\) for 2 action tokens"),
    (dict(logprobs=np.array([-0.5, -1.0])),
     "Step.logprobs: dtype float64, expected float32"),
    (dict(logprobs=np.array([np.nan, -1.0], np.float32)),
     "Step.logprobs: not all finite"),
    (dict(action=np.array([1.0, 2.0])),
     "Step.action: dtype float64, expected integer token ids"),
    (dict(action=np.array([-1, 2])), r"Step.action: token ids span \[-1"),
    (dict(state=np.zeros(0, np.int32)), r"Step.state: shape \(0,\)"),
    (dict(state=np.zeros((2, 2), np.int32)), r"Step.state: shape \(2, 2\)"),
    (dict(policy_version=-1), "Step.policy_version: -1 is below 0"),
    (dict(policy_version=1.0), "Step.policy_version: 1.0 is not an integer"),
])
def test_bad_step_is_refused(fields, match):
  one_line_error(lambda: Step(**{**GOOD_STEP, **fields}), match)


@pytest.mark.parametrize("fields, match", [
    (dict(steps=()), "Trajectory.steps: 't0' has no steps"),
    (dict(steps=(GOOD_STEP,)), r"Trajectory.steps\[0\]: dict"),
    (dict(trajectory_id=""), "Trajectory.trajectory_id: '' is not"),
    (dict(reward=float("inf")), "Trajectory.reward: inf is not finite"),
    (dict(verification={"x": object()}), "Trajectory.verification: not JSON"),
    (dict(finished_at=0.0), "Trajectory.finished_at: 0.0 is before"),
    (dict(queue_seq=-1), "Trajectory.queue_seq: -1 is below 0"),
    (dict(difficulty="easy"), "Trajectory.difficulty: 'easy' is not"),
])
def test_bad_trajectory_is_refused(fields, match):
  one_line_error(lambda: dataclasses.replace(small(0), **fields), match)


def test_add_refuses_duplicates_and_writes_nothing(tmp_path):
  path = tmp_path / "pool.sqlite"
  with Pool(path) as p:
    p.add(small(0))
    # Another trajectory under an existing id; an existing queue_seq.
    same_id = dataclasses.replace(small(1), trajectory_id="t0")
    same_seq = dataclasses.replace(small(1), queue_seq=0)
    one_line_error(lambda: p.add(same_id),
                   "Pool.add: trajectory 't0' is already in the pool")
    one_line_error(lambda: p.add(same_seq),
                   "Pool.add: queue_seq 0 of 't1' is taken by 't0'")
    one_line_error(lambda: p.add(GOOD_STEP), "Pool.add: dict, expected")
    assert p.counts()["finished"] == 1
    assert_same(p.get(["t0"])[0], small(0))
  assert sqlite3.connect(path).execute(
      "SELECT COUNT(*) FROM steps").fetchone() == (2,)


def start(*args) -> subprocess.Popen:
  """tests/rl_pool_writer.py with this interpreter and this checkout."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  return subprocess.Popen([sys.executable, WRITER, *map(str, args)], env=env,
                          cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen) -> str:
  line = proc.stdout.readline()
  assert line, f"the writer died: {proc.stderr.read()}"
  return line.strip()


def kill(proc: subprocess.Popen, after_s: float) -> list[str]:
  """SIGKILL `proc` after `after_s` seconds (unless it finished its work
  first, on a slow machine); the lines it printed since."""
  time.sleep(after_s)
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
  rest = proc.stdout.read().split()
  status = proc.wait()
  assert status in (0, -signal.SIGKILL), (
      f"the writer failed: {proc.stderr.read()}")
  proc.stdout.close()
  proc.stderr.close()
  return rest


def test_add_is_all_or_none_under_sigkill(tmp_path):
  path = tmp_path / "pool.sqlite"
  rng = np.random.default_rng(0)
  acked, first = [], 0
  for acks in (1, 2, 3, 1, 2, 3):
    proc = start("add", path, first)
    acked += [read_line(proc) for _ in range(acks)]
    # Somewhere in the next add() (one takes a few ms, most of it commit).
    acked += kill(proc, rng.uniform(0, 0.006))
    with Pool(path) as p:  # the next writer goes on after the last stored
      first = p.next_queue_seq()
  with Pool(path) as p:
    stored = p.untrained_ids()
    # Every acknowledged trajectory, at most the one killed after it
    # committed, and each whole and bit for bit what was added.
    assert stored == [f"t{i}" for i in range(first)]
    assert set(acked) <= set(stored) and len(stored) <= len(acked) + 6
    for t in p.get(stored):
      assert_same(t, writer.trajectory(int(t.trajectory_id[1:])))
  # No step rows of a trajectory that is not there (written before it).
  per_id = dict(sqlite3.connect(path).execute(
      "SELECT trajectory_id, COUNT(*) FROM steps GROUP BY trajectory_id"))
  assert per_id == {tid: writer.STEPS for tid in stored}


def test_mark_trained_is_all_or_none_under_sigkill(tmp_path):
  path, n, batch = tmp_path / "pool.sqlite", 300, 15
  with Pool(path) as p:
    for i in range(n):
      p.add(writer.trajectory(i, steps=1, tokens=2))
  rng = np.random.default_rng(1)
  acked = []
  for _ in range(3):
    proc = start("train", path, batch)
    assert read_line(proc) == "ready"
    # Its first step, unless an earlier trainer outran its kill on a busy
    # machine and left nothing to train (it then exits at once).
    first = proc.stdout.readline()
    acked += [int(first)] if first else []
    acked += map(int, kill(proc, rng.uniform(0, 0.003)))
  with Pool(path) as p:
    last = p.last_train_step()
    assert set(acked) <= set(range(last + 1))
    trained = []
    for step in range(last + 1):  # every step's batch whole, none partial
      ids = [t.trajectory_id for t in p.trained_in(step)]
      assert len(ids) == batch, f"train step {step}: {len(ids)} of {batch}"
      assert {p.training_of(tid) for tid in ids} == {(step, step)}
      trained += ids
    assert trained == [f"t{i}" for i in range(len(trained))]
    assert p.counts()["trained"] == len(trained)


def test_trainer_reads_and_marks_while_a_writer_adds(tmp_path):
  path = tmp_path / "pool.sqlite"
  proc = start("add", path, 0)
  acked = [read_line(proc)]  # the pool exists
  trained, deadline = [], time.monotonic() + 30
  with Pool(path) as p:
    while len(trained) < 12 and time.monotonic() < deadline:
      # Only whole trajectories are ever visible, committed ones.
      batch = p.untrained(limit=3)
      for t in batch:
        assert_same(t, writer.trajectory(int(t.trajectory_id[1:])))
      if batch:
        p.mark_trained([t.trajectory_id for t in batch],
                       train_step=len(trained), policy_version=0)
        trained += [t.trajectory_id for t in batch]
    assert len(trained) >= 12, "the trainer saw too few trajectories"
    acked += kill(proc, 0)
    assert all(p.training_of(tid) is not None for tid in trained)
    assert set(acked) <= set(trained) | set(p.untrained_ids())


def test_audit_replay_and_discard(tmp_path):
  path = tmp_path / "pool.sqlite"
  with Pool(path) as p:
    for i in (3, 0, 5, 1, 2, 4):  # added out of queue order
      p.add(small(i))
    p.mark_trained(["t4", "t1", "t3"], train_step=0, policy_version=2)
    p.discard(["t2"], reason="stale: lag 3 > 2", train_step=0)
  with Pool(path) as p:
    # Replay: step 0's batch, in its order, bit for bit.
    replay = p.trained_in(0)
    assert [t.trajectory_id for t in replay] == ["t4", "t1", "t3"]
    for t in replay:
      assert_same(t, small(int(t.trajectory_id[1:])))
    assert p.training_of("t1") == (0, 2)
    assert p.training_of("t2") is None and p.training_of("t0") is None
    assert p.untrained_ids() == ["t0", "t5"]  # queue order
    assert [t.trajectory_id for t in p.untrained(limit=1)] == ["t0"]
    assert p.counts() == {"finished": 6, "trained": 3, "discarded": 1,
                          "untrained": 2}
    assert p.last_train_step() == 0 and p.next_queue_seq() == 6
    # A discarded trajectory stays for the audit, and is never trained.
    assert_same(p.get(["t2"])[0], small(2))
    (event,) = p.history("t2")
    assert event._replace(at=0) == Event("discarded", 0, None,
                                         "stale: lag 3 > 2", 0, None)
    one_line_error(lambda: p.training_of("t9"),
                   "Pool.training_of: unknown trajectory 't9'")
    one_line_error(lambda: p.get(["t0", "t9"]),
                   "Pool.get: unknown trajectory 't9'")
    # Stored already discarded, in the add's transaction; never reversed.
    p.add(small(6), discard_reason="session timed out")
    p.rollback(after_step=-1)
    assert "t6" not in p.untrained_ids()
    (event,) = p.history("t6")
    assert (event.kind, event.reason) == ("discarded", "session timed out")


def test_mark_trained_refuses_and_marks_nothing(tmp_path):
  with Pool(tmp_path / "pool.sqlite") as p:
    for i in range(4):
      p.add(small(i))
    p.mark_trained(["t0"], train_step=0, policy_version=0)
    p.discard(["t1"], reason="stale")
    before = p.counts()
    for ids, match in [
        (["t2", "t0"], r"trajectory 't0' was already trained \(train step 0"),
        (["t2", "t9"], "unknown trajectory 't9'"),
        (["t2", "t1"], r"trajectory 't1' was discarded \(stale\)"),
        (["t2", "t2"], "trajectory 't2' is given twice"),
        ([], "no trajectory ids"),
        ("t2", "the string 't2', expected a list")]:
      one_line_error(lambda: p.mark_trained(ids, train_step=1,
                                            policy_version=1),
                     "Pool.mark_trained: " + match)
    one_line_error(lambda: p.discard(["t3", "t0"], reason="stale"),
                   "Pool.discard: trajectory 't0' was already trained")
    # A step not after the last one: a resumed trainer that did not roll
    # back would otherwise leave the lost step's batch marked forever.
    one_line_error(
        lambda: p.mark_trained(["t2"], train_step=0, policy_version=1),
        r"train step 0 is not after step 0.*calls rollback\(after_step=")
    assert p.counts() == before
    assert p.training_of("t2") is None and p.training_of("t3") is None


def test_rollback_retrains_only_the_lost_steps(tmp_path):
  with Pool(tmp_path / "pool.sqlite") as p:
    for i in range(8):
      p.add(small(i))
    p.mark_trained(["t0", "t1"], train_step=0, policy_version=0)
    p.mark_trained(["t2", "t3"], train_step=1, policy_version=1)
    p.discard(["t4"], reason="stale", train_step=1)
    p.mark_trained(["t5"], train_step=2, policy_version=2)
    p.discard(["t6"], reason="bad verifier")  # tied to no step: stays
    # The trainer resumes from its checkpoint of step 0: steps 1 and 2 lost.
    assert p.rollback(after_step=0) == 4
    assert p.untrained_ids() == ["t2", "t3", "t4", "t5", "t7"]
    assert p.training_of("t0") == (0, 0) and p.training_of("t2") is None
    assert p.trained_in(1) == [] and p.last_train_step() == 0
    # The undone training stays in the audit.
    (event,) = p.history("t2")
    assert (event.kind, event.train_step) == ("trained", 1)
    assert event.undone_at is not None
    # Trained again, in the resumed run's step 1.
    p.mark_trained(["t3", "t2"], train_step=1, policy_version=1)
    assert [t.trajectory_id for t in p.trained_in(1)] == ["t3", "t2"]
    assert [e.undone_at is None for e in p.history("t2")] == [False, True]
    assert p.rollback(after_step=5) == 0
    assert p.counts() == {"finished": 8, "trained": 4, "discarded": 1,
                          "untrained": 3}


def test_other_files_are_refused(tmp_path):
  path = tmp_path / "pool.sqlite"
  Pool(path).close()
  with sqlite3.connect(path) as db:
    db.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
  one_line_error(lambda: Pool(path), "schema version 0, this m2jax reads "
                 "version 1; use the m2jax that wrote it or a fresh pool")
  other = tmp_path / "other.sqlite"
  with sqlite3.connect(other) as db:
    db.execute("CREATE TABLE runs (x)")
  one_line_error(lambda: Pool(other), "an SQLite file but not a pool")
  text = tmp_path / "notes.txt"
  text.write_text("not a database " * 100)
  one_line_error(lambda: Pool(text), "not an SQLite file")
  with pytest.raises(MissingPathError, match="does not exist"):
    Pool(tmp_path / "missing" / "pool.sqlite")
