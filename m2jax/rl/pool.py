"""Forge's data pool (SPEC §3): finished trajectories in SQLite, and what
trained on them.

The rollout side adds each verified trajectory (`Pool.add`). The trainer
reads the untrained ones (`untrained`, `get`), records which train step and
policy version used them (`mark_trained`) or that they were dropped, e.g. as
too stale (`discard`), and on resume undoes what its checkpoint lost
(`rollback`). The trainings are the audit and the replay log:
`trained_in(step)` gives a step's batch again, in its order. One file, the
standard library's sqlite3; a rollout process and a trainer process may
open it at once (each its own Pool; one Pool may be shared by threads).

Schema (version SCHEMA_VERSION, in `meta`; a file of another version is
refused):

  meta(key, value)            schema_version, created_at
  trajectories(trajectory_id PK, group_id, env, task_id, difficulty,
      num_steps, reward, verification (JSON), queue_seq UNIQUE,
      policy_version (min over steps), submitted_at, finished_at, added_at)
  steps(trajectory_id, step_index, state, action, logprobs, policy_version,
      reward)                 PK (trajectory_id, step_index); the arrays are
                              little-endian BLOBs: int32 tokens, float32
                              log-probs
  trainings(trajectory_id, train_step, policy_version, batch_index,
      trained_at, undone_at)
  discards(trajectory_id, reason, train_step, discarded_at, undone_at)

Trajectories and steps are written once, by `add`, and never change. A
trajectory is untrained while no training or discard of it is live
(undone_at NULL; a partial unique index allows one live training per
trajectory). `rollback` sets undone_at rather than deleting, so the audit
keeps trainings whose update was lost (`history`).

Durability. Every write is one transaction (BEGIN IMMEDIATE ... COMMIT): a
trajectory with all its steps, a whole mark_trained batch, a rollback. In
WAL mode a transaction appends its pages to the write-ahead log and marks
its last frame as the commit; readers and crash recovery use only frames up
to the last complete (checksummed) commit, so a process killed anywhere in
a transaction leaves no trace of it: nothing is ever half-written. With
synchronous=FULL the log is fsynced before COMMIT returns, so a write the
pool acknowledged (the call returned) survives a killed process (the OS
already holds the bytes) and also an OS crash or power loss, which NORMAL
(atomic, but the last commits may roll back) would not promise. WAL also
lets the trainer read while the rollout process writes: readers see the
last commit, writers take turns, waiting up to `timeout` seconds.

The trainer's protocol, so a resumed run repeats no trajectory whose update
survived and retrains those whose update was lost:

  pool.mark_trained(batch_ids, train_step=s, policy_version=v)
  save the checkpoint of step s   # second: a crash between the two leaves
                                  # a marking that the rollback undoes
  ... killed; resumed from the checkpoint of step c:
  pool.rollback(after_step=c)

mark_trained refuses a step not after every live one, so a resumed trainer
that forgot the rollback fails loudly instead of leaving the lost steps'
trajectories marked and never trained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sqlite3
import threading
import time
from typing import Iterable, NamedTuple

import numpy as np

from m2jax.errors import MissingPathError, UserError

SCHEMA_VERSION = 1
TOKEN_MAX = 2**31 - 1  # tokens are stored as int32
_CHUNK = 500  # ids per `IN (...)` query, far below SQLite's variable limit
_TOKENS, _LOGPROBS = np.dtype("<i4"), np.dtype("<f4")  # BLOB layouts

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE trajectories (
         trajectory_id TEXT PRIMARY KEY, group_id TEXT NOT NULL,
         env TEXT NOT NULL, task_id TEXT NOT NULL,
         difficulty INTEGER NOT NULL, num_steps INTEGER NOT NULL,
         reward REAL NOT NULL, verification TEXT NOT NULL,
         queue_seq INTEGER NOT NULL UNIQUE, policy_version INTEGER NOT NULL,
         submitted_at REAL NOT NULL, finished_at REAL NOT NULL,
         added_at REAL NOT NULL)""",
    """CREATE TABLE steps (
         trajectory_id TEXT NOT NULL REFERENCES trajectories,
         step_index INTEGER NOT NULL, state BLOB NOT NULL,
         action BLOB NOT NULL, logprobs BLOB NOT NULL,
         policy_version INTEGER NOT NULL, reward REAL NOT NULL,
         PRIMARY KEY (trajectory_id, step_index))""",
    """CREATE TABLE trainings (
         trajectory_id TEXT NOT NULL REFERENCES trajectories,
         train_step INTEGER NOT NULL, policy_version INTEGER NOT NULL,
         batch_index INTEGER NOT NULL, trained_at REAL NOT NULL,
         undone_at REAL)""",
    """CREATE UNIQUE INDEX trainings_live ON trainings (trajectory_id)
         WHERE undone_at IS NULL""",
    "CREATE INDEX trainings_step ON trainings (train_step, batch_index)",
    """CREATE TABLE discards (
         trajectory_id TEXT NOT NULL REFERENCES trajectories,
         reason TEXT NOT NULL, train_step INTEGER,
         discarded_at REAL NOT NULL, undone_at REAL)""",
    """CREATE UNIQUE INDEX discards_live ON discards (trajectory_id)
         WHERE undone_at IS NULL""",
)
_UNTRAINED = """
    SELECT trajectory_id FROM trajectories AS t
    WHERE NOT EXISTS (SELECT 1 FROM trainings WHERE undone_at IS NULL
                      AND trajectory_id = t.trajectory_id)
      AND NOT EXISTS (SELECT 1 FROM discards WHERE undone_at IS NULL
                      AND trajectory_id = t.trajectory_id)
    ORDER BY queue_seq LIMIT ?"""


class PoolError(UserError, ValueError):
  """Bad input to the pool, or a file that is not a pool of this version."""


# --- Input checks: each names the field and says what was wrong, in one line.


def _int(name: str, value, minimum: int | None = None) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise PoolError(f"{name}: {value!r} is not an integer")
  if minimum is not None and value < minimum:
    raise PoolError(f"{name}: {value} is below {minimum}")
  return int(value)


def _float(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(
      value, (int, float, np.integer, np.floating)):
    raise PoolError(f"{name}: {value!r} is not a number")
  if not math.isfinite(value):
    raise PoolError(f"{name}: {value} is not finite")
  return float(value) + 0.0  # -0.0 as 0.0, as SQLite would read it back


def _str(name: str, value) -> str:
  if not isinstance(value, str) or not value:
    raise PoolError(f"{name}: {value!r} is not a non-empty string")
  return value


def _tokens(name: str, value) -> np.ndarray:
  """A read-only int32 copy of a 1-D array of token ids (any integer dtype
  whose values fit: the conversion loses nothing)."""
  a = np.asarray(value)
  if a.ndim != 1 or a.size == 0:
    raise PoolError(f"{name}: shape {a.shape}, expected [L] with L >= 1")
  if not np.issubdtype(a.dtype, np.integer):
    raise PoolError(f"{name}: dtype {a.dtype}, expected integer token ids")
  if a.min() < 0 or a.max() > TOKEN_MAX:
    raise PoolError(f"{name}: token ids span [{a.min()}, {a.max()}], "
                    f"outside [0, {TOKEN_MAX}]")
  a = a.astype(np.int32)
  a.flags.writeable = False
  return a


def _json(name: str, value) -> str:
  """A dict as JSON text, numpy scalars as Python numbers."""
  if not isinstance(value, dict):
    raise PoolError(f"{name}: {type(value).__name__}, expected a dict")

  def plain(x):
    if isinstance(x, np.generic):
      return x.item()
    raise TypeError(f"{type(x).__name__} {x!r} is not JSON")

  try:
    return json.dumps(value, allow_nan=False, default=plain)
  except (TypeError, ValueError) as e:
    raise PoolError(f"{name}: not JSON: {e}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """One (state, action) pair (SPEC §3), validated at construction.

  state: [Ls] int32, the tokens the policy saw.
  action: [La] int32, the tokens it generated.
  logprobs: [La] float32, the behaviour log q of each action token (float32
    only: a cast would change the values the importance ratio divides by).
  policy_version: the version of the weights that generated the action.
  reward: this step's own (process) reward.
  Arrays are stored as read-only copies; compare Steps field by field.
  """
  state: np.ndarray
  action: np.ndarray
  logprobs: np.ndarray
  policy_version: int
  reward: float = 0.0

  def __post_init__(self):
    state = _tokens("Step.state", self.state)
    action = _tokens("Step.action", self.action)
    logprobs = np.asarray(self.logprobs)
    if logprobs.dtype != np.float32:
      raise PoolError(f"Step.logprobs: dtype {logprobs.dtype}, expected "
                      "float32")
    if logprobs.shape != action.shape:
      raise PoolError(f"Step.logprobs: shape {logprobs.shape} for "
                      f"{action.size} action tokens, expected "
                      f"{action.shape}")
    if not np.isfinite(logprobs).all():
      raise PoolError("Step.logprobs: not all finite")
    logprobs = logprobs.copy()
    logprobs.flags.writeable = False
    for name, value in (
        ("state", state), ("action", action), ("logprobs", logprobs),
        ("policy_version",
         _int("Step.policy_version", self.policy_version, 0)),
        ("reward", _float("Step.reward", self.reward))):
      object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
  """One finished, verified rollout: its steps and its outcome.

  group_id: the samples of one prompt (a GRPO group) share it.
  difficulty: the env's level of the task.
  reward: the final (outcome) reward.
  verification: the verifier's result, a dict kept as JSON gives it back.
  queue_seq: the rollout's position in submission order (the scheduler's
    queue), unique in a pool.
  submitted_at, finished_at: unix seconds of the rollout's start and of its
    verification.
  """
  trajectory_id: str
  group_id: str
  env: str
  task_id: str
  difficulty: int
  steps: tuple[Step, ...]
  reward: float
  verification: dict
  queue_seq: int
  submitted_at: float
  finished_at: float

  def __post_init__(self):
    for name in ("trajectory_id", "group_id", "env", "task_id"):
      _str(f"Trajectory.{name}", getattr(self, name))
    steps = self.steps
    if isinstance(steps, Step) or not isinstance(steps, (tuple, list)):
      raise PoolError(f"Trajectory.steps: {type(steps).__name__}, expected "
                      "a tuple of Step")
    if not steps:
      raise PoolError(f"Trajectory.steps: {self.trajectory_id!r} has no "
                      "steps")
    for i, step in enumerate(steps):
      if not isinstance(step, Step):
        raise PoolError(f"Trajectory.steps[{i}]: {type(step).__name__}, "
                        "expected a Step")
    submitted_at = _float("Trajectory.submitted_at", self.submitted_at)
    finished_at = _float("Trajectory.finished_at", self.finished_at)
    if finished_at < submitted_at:
      raise PoolError(f"Trajectory.finished_at: {finished_at} is before "
                      f"submitted_at {submitted_at}")
    for name, value in (
        ("steps", tuple(steps)),
        # As the pool will give it back: JSON (numpy scalars as numbers,
        # tuples as lists, keys as strings).
        ("verification", json.loads(_json("Trajectory.verification",
                                          self.verification))),
        ("difficulty", _int("Trajectory.difficulty", self.difficulty)),
        ("reward", _float("Trajectory.reward", self.reward)),
        ("queue_seq", _int("Trajectory.queue_seq", self.queue_seq, 0)),
        ("submitted_at", submitted_at), ("finished_at", finished_at)):
      object.__setattr__(self, name, value)

  @property
  def policy_version(self) -> int:
    """The oldest weights the trajectory used (min over its steps)."""
    return min(step.policy_version for step in self.steps)


class Training(NamedTuple):
  """Which train step used a trajectory, with which policy version (the
  trainer's version when it trained on it)."""
  train_step: int
  policy_version: int


class Event(NamedTuple):
  """One training or discard of a trajectory, live or undone (the audit)."""
  kind: str                   # "trained" | "discarded"
  train_step: int | None      # None: a discard not tied to a step
  policy_version: int | None  # trained: the trainer's version
  reason: str | None          # discarded: why
  at: float                   # unix seconds
  undone_at: float | None     # set by rollback


class Pool:
  """The trajectory store. Every method is one transaction; writes return
  only once durable.

    pool = Pool(os.path.join(workdir, "pool.sqlite"))
    pool.add(trajectory)                                # rollout side
    batch = pool.get(ids)                               # trainer side
    pool.mark_trained(ids, train_step=7, policy_version=7)
  """

  def __init__(self, path: str | os.PathLike, *, timeout: float = 60.0):
    """Open the pool at `path`, creating it if the file is new or empty.
    timeout: seconds to wait for another process's write to finish."""
    self.path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(self.path))
    if not os.path.isdir(parent):
      raise MissingPathError(f"pool {self.path}: directory {parent} does "
                             "not exist")
    self._lock = threading.RLock()
    self._db = sqlite3.connect(self.path, timeout=timeout,
                               isolation_level=None, check_same_thread=False)
    try:
      self._open()
    except BaseException:
      self._db.close()
      raise

  def _open(self) -> None:
    db = self._db
    try:
      mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.DatabaseError as e:
      raise PoolError(f"pool {self.path}: not an SQLite file ({e})") from None
    if mode != "wal":
      raise PoolError(f"pool {self.path}: journal mode {mode}, WAL needed")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA foreign_keys=ON")
    with self._write():
      tables = {name for name, in db.execute(
          "SELECT name FROM sqlite_master WHERE type = 'table'")}
      if not tables:
        for statement in _SCHEMA:
          db.execute(statement)
        db.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("schema_version", str(SCHEMA_VERSION)),
            ("created_at", repr(time.time()))])
        return
      row = ("meta" in tables and db.execute(
          "SELECT value FROM meta WHERE key = 'schema_version'").fetchone())
      if not row:
        raise PoolError(f"pool {self.path}: an SQLite file but not a pool "
                        "(no schema version)")
      if row[0] != str(SCHEMA_VERSION):
        raise PoolError(
            f"pool {self.path}: schema version {row[0]}, this m2jax reads "
            f"version {SCHEMA_VERSION}; use the m2jax that wrote it or a "
            "fresh pool file")

  @contextlib.contextmanager
  def _transaction(self, begin: str):
    with self._lock:
      self._db.execute(begin)
      try:
        yield self._db
        self._db.execute("COMMIT")
      except BaseException:
        if self._db.in_transaction:
          self._db.execute("ROLLBACK")
        raise

  def _write(self):
    # IMMEDIATE takes the write lock first (waiting up to the timeout): a
    # transaction that read before writing could otherwise fail at once on
    # another process's newer commit, a case the busy timeout does not wait
    # out.
    return self._transaction("BEGIN IMMEDIATE")

  def _read(self):
    # One snapshot: a batch never mixes the states of two commits.
    return self._transaction("BEGIN")

  # --- Writes ----------------------------------------------------------------

  def add(self, trajectory: Trajectory, *,
          discard_reason: str | None = None) -> None:
    """Store a trajectory with all its steps in one transaction. Returns
    once it is durable (acknowledged); a duplicate id or queue_seq is
    refused and nothing is written. With `discard_reason` it is stored
    already discarded (never reversed), in the same transaction: kept for
    the audit, never trained, and no crash can leave it untrained."""
    self.add_many([trajectory], what="Pool.add",
                  discard_reason=discard_reason)

  def add_many(self, trajectories: Iterable[Trajectory], *,
               what: str = "Pool.add_many",
               discard_reason: str | None = None) -> None:
    """Store several trajectories (a GRPO group) in one transaction: all of
    them or none, as `add` stores one."""
    trajectories = list(trajectories)
    if discard_reason is not None:
      discard_reason = _str(f"{what}: discard_reason", discard_reason)
    for t in trajectories:
      if not isinstance(t, Trajectory):
        raise PoolError(f"{what}: {type(t).__name__}, expected a "
                        "Trajectory")
    ids = [t.trajectory_id for t in trajectories]
    seqs = [t.queue_seq for t in trajectories]
    for name, values in (("trajectory id", ids), ("queue_seq", seqs)):
      if len(set(values)) != len(values):
        raise PoolError(f"{what}: a {name} is given twice")
    now = time.time()
    with self._write() as db:
      for t in trajectories:
        tid = t.trajectory_id
        if db.execute("SELECT 1 FROM trajectories WHERE trajectory_id = ?",
                      (tid,)).fetchone():
          raise PoolError(f"{what}: trajectory {tid!r} is already in the "
                          "pool")
        other = db.execute("SELECT trajectory_id FROM trajectories "
                           "WHERE queue_seq = ?", (t.queue_seq,)).fetchone()
        if other:
          raise PoolError(f"{what}: queue_seq {t.queue_seq} of {tid!r} is "
                          f"taken by {other[0]!r}")
        db.execute(
            "INSERT INTO trajectories VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (tid, t.group_id, t.env, t.task_id, t.difficulty, len(t.steps),
             t.reward, _json("Trajectory.verification", t.verification),
             t.queue_seq, t.policy_version, t.submitted_at, t.finished_at,
             now))
        db.executemany("INSERT INTO steps VALUES (?,?,?,?,?,?,?)", [
            (tid, i, s.state.astype(_TOKENS).tobytes(),
             s.action.astype(_TOKENS).tobytes(),
             s.logprobs.astype(_LOGPROBS).tobytes(), s.policy_version,
             s.reward) for i, s in enumerate(t.steps)])
      if discard_reason is not None:
        db.executemany("INSERT INTO discards VALUES (?, ?, NULL, ?, NULL)",
                       [(t.trajectory_id, discard_reason, now)
                        for t in trajectories])

  def mark_trained(self, ids: Iterable[str], *, train_step: int,
                   policy_version: int) -> None:
    """Record that train step `train_step`, at the trainer's
    `policy_version`, used the trajectories `ids` (in this order: the
    batch's order, for replay). All or none: an unknown, trained or
    discarded id, or a step not after every recorded one, is refused
    (naming it) and nothing is marked."""
    ids = _ids("Pool.mark_trained", ids)
    if not ids:
      raise PoolError("Pool.mark_trained: no trajectory ids")
    train_step = _int("Pool.mark_trained: train_step", train_step, 0)
    policy_version = _int("Pool.mark_trained: policy_version",
                          policy_version, 0)
    now = time.time()
    with self._write() as db:
      self._check_untrained(db, "Pool.mark_trained", ids)
      last, = db.execute("SELECT MAX(train_step) FROM trainings "
                         "WHERE undone_at IS NULL").fetchone()
      if last is not None and train_step <= last:
        raise PoolError(
            f"Pool.mark_trained: train step {train_step} is not after step "
            f"{last}, which the pool records; a resumed trainer calls "
            "rollback(after_step=<its checkpoint's step>) first")
      db.executemany(
          "INSERT INTO trainings VALUES (?, ?, ?, ?, ?, NULL)",
          [(tid, train_step, policy_version, i, now)
           for i, tid in enumerate(ids)])

  def discard(self, ids: Iterable[str], *, reason: str,
              train_step: int | None = None) -> None:
    """Record that the trajectories `ids` will not be trained on (e.g. too
    stale). They stay in the pool for the audit. `train_step`: the trainer's
    step when it decided, so rollback(after_step < train_step) reverses the
    decision (None: never reversed). All or none, like mark_trained."""
    ids = _ids("Pool.discard", ids)
    reason = _str("Pool.discard: reason", reason)
    if train_step is not None:
      train_step = _int("Pool.discard: train_step", train_step, 0)
    now = time.time()
    with self._write() as db:
      self._check_untrained(db, "Pool.discard", ids)
      db.executemany("INSERT INTO discards VALUES (?, ?, ?, ?, NULL)",
                     [(tid, reason, train_step, now) for tid in ids])

  def rollback(self, after_step: int) -> int:
    """Resume from a checkpoint taken after train step `after_step`: undo
    the trainings (and step-tied discards) of later steps, whose update was
    lost, so those trajectories are untrained again. Returns how many."""
    after_step = _int("Pool.rollback: after_step", after_step)
    now = time.time()
    with self._write() as db:
      return sum(db.execute(
          f"UPDATE {table} SET undone_at = ? "
          "WHERE undone_at IS NULL AND train_step > ?",
          (now, after_step)).rowcount for table in ("trainings", "discards"))

  # --- Reads -----------------------------------------------------------------

  def get(self, ids: Iterable[str]) -> list[Trajectory]:
    """The trajectories `ids`, in that order; an unknown id is refused."""
    ids = _ids("Pool.get", ids)
    with self._read() as db:
      found = self._load(db, ids)
    for tid in ids:
      if tid not in found:
        raise PoolError(f"Pool.get: unknown trajectory {tid!r}")
    return [found[tid] for tid in ids]

  def untrained_ids(self, *, limit: int | None = None) -> list[str]:
    """Ids of the trajectories neither trained nor discarded, in queue_seq
    order (the first `limit` of them)."""
    limit = -1 if limit is None else _int("Pool: limit", limit, 0)
    with self._read() as db:
      return [tid for tid, in db.execute(_UNTRAINED, (limit,))]

  def untrained(self, *, limit: int | None = None) -> list[Trajectory]:
    """The trajectories neither trained nor discarded, in queue_seq order."""
    limit = -1 if limit is None else _int("Pool: limit", limit, 0)
    with self._read() as db:
      ids = [tid for tid, in db.execute(_UNTRAINED, (limit,))]
      found = self._load(db, ids)
    return [found[tid] for tid in ids]

  def trained_in(self, train_step: int) -> list[Trajectory]:
    """The batch train step `train_step` used (live trainings), in the
    order it was marked: for audit and replay."""
    train_step = _int("Pool.trained_in: train_step", train_step)
    with self._read() as db:
      ids = [tid for tid, in db.execute(
          "SELECT trajectory_id FROM trainings WHERE train_step = ? AND "
          "undone_at IS NULL ORDER BY batch_index", (train_step,))]
      found = self._load(db, ids)
    return [found[tid] for tid in ids]

  def training_of(self, trajectory_id: str) -> Training | None:
    """(train_step, policy_version) of the live training of a trajectory,
    None if it is untrained or discarded."""
    tid, = _ids("Pool.training_of", [trajectory_id])
    with self._read() as db:
      self._check_known(db, "Pool.training_of", tid)
      row = db.execute("SELECT train_step, policy_version FROM trainings "
                       "WHERE trajectory_id = ? AND undone_at IS NULL",
                       (tid,)).fetchone()
    return Training(*row) if row else None

  def history(self, trajectory_id: str) -> list[Event]:
    """Every training and discard of a trajectory, undone ones included, in
    time order."""
    tid, = _ids("Pool.history", [trajectory_id])
    with self._read() as db:
      self._check_known(db, "Pool.history", tid)
      rows = db.execute(
          "SELECT 'trained', train_step, policy_version, NULL, trained_at, "
          "undone_at FROM trainings WHERE trajectory_id = ? UNION ALL "
          "SELECT 'discarded', train_step, NULL, reason, discarded_at, "
          "undone_at FROM discards WHERE trajectory_id = ? ORDER BY 5",
          (tid, tid)).fetchall()
    return [Event(*row) for row in rows]

  def next_queue_seq(self) -> int:
    """1 + the largest queue_seq stored, 0 for an empty pool (resume)."""
    with self._read() as db:
      return db.execute("SELECT COALESCE(MAX(queue_seq) + 1, 0) "
                        "FROM trajectories").fetchone()[0]

  def last_train_step(self) -> int | None:
    """The latest train step with live trainings (None: none), e.g. to
    check a resumed trainer's checkpoint step against the pool."""
    with self._read() as db:
      return db.execute("SELECT MAX(train_step) FROM trainings "
                        "WHERE undone_at IS NULL").fetchone()[0]

  def counts(self) -> dict[str, int]:
    """How many trajectories are stored ("finished"), "trained" (live),
    "discarded" (live) and "untrained"."""
    with self._read() as db:
      (finished,), (trained,), (discarded,) = (db.execute(
          f"SELECT COUNT(*) FROM {table}" + where).fetchone()
          for table, where in (("trajectories", ""),
                               ("trainings", " WHERE undone_at IS NULL"),
                               ("discards", " WHERE undone_at IS NULL")))
    return {"finished": finished, "trained": trained,
            "discarded": discarded,
            "untrained": finished - trained - discarded}

  def close(self) -> None:
    with self._lock:
      self._db.close()

  def __enter__(self) -> Pool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --- Helpers (inside a transaction) ----------------------------------------

  def _check_known(self, db, what: str, tid: str) -> None:
    if not db.execute("SELECT 1 FROM trajectories WHERE trajectory_id = ?",
                      (tid,)).fetchone():
      raise PoolError(f"{what}: unknown trajectory {tid!r}")

  def _check_untrained(self, db, what: str, ids: list[str]) -> None:
    """Refuse (naming it) the first id that is unknown, trained or
    discarded, or given twice."""
    status = {}
    for chunk in _chunks(ids):
      status.update((tid, (step, reason)) for tid, step, reason in db.execute(
          "SELECT t.trajectory_id, r.train_step, d.reason "
          "FROM trajectories AS t "
          "LEFT JOIN trainings AS r ON r.trajectory_id = t.trajectory_id "
          "  AND r.undone_at IS NULL "
          "LEFT JOIN discards AS d ON d.trajectory_id = t.trajectory_id "
          "  AND d.undone_at IS NULL "
          f"WHERE t.trajectory_id IN ({_marks(chunk)})", chunk))
    seen = set()
    for tid in ids:
      if tid not in status:
        raise PoolError(f"{what}: unknown trajectory {tid!r}")
      step, reason = status[tid]
      if step is not None:
        raise PoolError(f"{what}: trajectory {tid!r} was already trained "
                        f"(train step {step})")
      if reason is not None:
        raise PoolError(f"{what}: trajectory {tid!r} was discarded "
                        f"({reason})")
      if tid in seen:
        raise PoolError(f"{what}: trajectory {tid!r} is given twice")
      seen.add(tid)

  def _load(self, db, ids: list[str]) -> dict[str, Trajectory]:
    """The stored trajectories among `ids`, by id."""
    heads, steps = {}, {}
    unique = list(dict.fromkeys(ids))
    for chunk in _chunks(unique):
      marks = _marks(chunk)
      for row in db.execute(
          "SELECT trajectory_id, group_id, env, task_id, difficulty, "
          "num_steps, reward, verification, queue_seq, submitted_at, "
          f"finished_at FROM trajectories WHERE trajectory_id IN ({marks})",
          chunk):
        heads[row[0]] = row
      for tid, state, action, logprobs, version, reward in db.execute(
          "SELECT trajectory_id, state, action, logprobs, policy_version, "
          f"reward FROM steps WHERE trajectory_id IN ({marks}) "
          "ORDER BY trajectory_id, step_index", chunk):
        steps.setdefault(tid, []).append(Step(
            np.frombuffer(state, _TOKENS), np.frombuffer(action, _TOKENS),
            np.frombuffer(logprobs, _LOGPROBS).astype(np.float32), version,
            reward))
    found = {}
    for tid, (_, group, env, task, difficulty, num_steps, reward,
              verification, queue_seq, submitted, finished) in heads.items():
      if len(steps.get(tid, ())) != num_steps:
        raise PoolError(f"pool {self.path}: trajectory {tid!r} has "
                        f"{len(steps.get(tid, ()))} of its {num_steps} "
                        "steps (a damaged file)")
      found[tid] = Trajectory(tid, group, env, task, difficulty,
                              tuple(steps[tid]), reward,
                              json.loads(verification), queue_seq, submitted,
                              finished)
    return found


def _ids(what: str, ids) -> list[str]:
  if isinstance(ids, str):
    raise PoolError(f"{what}: the string {ids!r}, expected a list of "
                    "trajectory ids")
  ids = list(ids)
  for tid in ids:
    _str(f"{what}: trajectory id", tid)
  return ids


def _chunks(ids: list[str]):
  for i in range(0, len(ids), _CHUNK):
    yield ids[i:i + _CHUNK]


def _marks(chunk: list[str]) -> str:
  return ",".join("?" * len(chunk))
