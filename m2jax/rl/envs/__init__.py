"""Forge's RL environments with verifiers (SPEC §3; issue 15 item 4).

  base.py        Task, Verification, the Env protocol, the level mix and
                 the lognormal latency model every env shares
  arithmetic.py  n-digit addition and multiplication, exact answer
  sorting.py     sort a list of small numbers, reward = positions right
  tool_tasks.py  multi-step tasks solved with tool calls (multiply, with
                 the calculator), run by an agent (`multi_step`)

An env is a frozen config dataclass with methods (sample, verify,
demonstration, latency, level_mix); `make(name, **fields)` builds one by
name. The task mix is the probability of each (env name, difficulty) a
run draws; `sample_tasks` draws tasks from it, and `batch_mix` with
`total_variation` measure how far a batch's mix drifts from it (the
scheduler's skew toward fast, easy tasks):

  envs = [make("arithmetic", levels=(1, 2)), make("sorting")]
  mix = task_mix(envs, weights=(3, 1))
  tasks = sample_tasks(envs, 64, np.random.default_rng(0), mix)
  drift = total_variation(batch_mix(tasks[:16]), mix)
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from m2jax.config import ConfigError
from m2jax.rl.envs.arithmetic import Arithmetic
from m2jax.rl.envs.base import Env, Task, Verification
from m2jax.rl.envs.sorting import Sorting
from m2jax.rl.envs.tool_tasks import Multiply

ENVS: dict[str, type] = {cls.name: cls
                         for cls in (Arithmetic, Sorting, Multiply)}

Mix = dict[tuple[str, int], float]   # (env name, difficulty) -> probability


def make(name: str, **fields) -> Env:
  """The env called `name` with its config `fields` (the rest default)."""
  if name not in ENVS:
    raise ConfigError(f"unknown env {name!r} (known: {', '.join(ENVS)})")
  cls = ENVS[name]
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise ConfigError(f"{cls.__name__}: unknown field(s) {unknown} (fields: "
                      f"{', '.join(known)})")
  return cls(**fields)


def multi_step(name: str) -> bool:
  """Whether env `name` is solved over several model calls with tools
  (an agent runs it) rather than by one completion."""
  return bool(getattr(ENVS.get(name), "multi_step", False))


def task_mix(envs: Sequence[Env],
             weights: Sequence[float] | None = None) -> Mix:
  """{(env name, difficulty): probability}: an env is drawn with its weight
  (None: uniform), then a level from the env's own level mix."""
  names = [env.name for env in envs]
  if not envs or len(set(names)) != len(names):
    raise ValueError(f"task_mix: needs distinct envs (got {names})")
  w = np.ones(len(envs)) if weights is None else np.asarray(weights, float)
  if w.shape != (len(envs),) or not np.all(w >= 0) or w.sum() <= 0:
    raise ValueError(f"task_mix: weights must be {len(envs)} non-negative "
                     f"numbers with a positive sum (got {weights!r})")
  w = w / w.sum()
  return {(env.name, d): float(w_e * p)
          for env, w_e in zip(envs, w) for d, p in env.level_mix().items()}


def sample_tasks(envs: Sequence[Env], n: int, rng: np.random.Generator,
                 mix: Mapping[tuple[str, int], float] | None = None
                 ) -> list[Task]:
  """`n` tasks, each of an (env, difficulty) drawn from `mix` (default: the
  envs' uniform task mix); deterministic given `rng`."""
  by_name = {env.name: env for env in envs}
  mix = task_mix(envs) if mix is None else mix
  for name, d in mix:
    if name not in by_name or d not in by_name[name].levels:
      raise ValueError(f"sample_tasks: the mix names ({name!r}, {d!r}), "
                       "which is not a level of the envs given")
  keys = list(mix)
  p = np.asarray([mix[k] for k in keys], float)
  if not np.all(p >= 0) or p.sum() <= 0:
    raise ValueError("sample_tasks: the mix needs non-negative "
                     f"probabilities with a positive sum (got {dict(mix)})")
  picks = rng.choice(len(keys), size=n, p=p / p.sum())
  return [by_name[keys[i][0]].sample(rng, keys[i][1]) for i in picks]


def batch_mix(tasks: Sequence[Task]) -> Mix:
  """The fraction of `tasks` of each (env name, difficulty)."""
  if not tasks:
    raise ValueError("batch_mix: no tasks")
  counts = collections.Counter((t.env, t.difficulty) for t in tasks)
  return {k: c / len(tasks) for k, c in sorted(counts.items())}


def total_variation(p: Mapping, q: Mapping) -> float:
  """Total variation distance between two mixes (a key missing from one
  has probability 0 there): 0 when equal, 1 when disjoint."""
  keys = set(p) | set(q)
  return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


__all__ = ["ENVS", "Arithmetic", "Env", "Mix", "Multiply", "Sorting", "Task",
           "Verification", "batch_mix", "make", "multi_step", "sample_tasks",
           "task_mix", "total_variation"]
