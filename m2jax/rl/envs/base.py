"""What every Forge RL environment shares (SPEC §3): the task and
verification records, the Env protocol, and the pieces of an env config
(difficulty levels with a mix over them, a simulated latency model).

Environments deal in text only: the loop shows the policy `task.prompt`,
decodes what it generated before EOS and passes that string, untouched, to
`env.verify`. Everything here is host-side numpy and deterministic given
the numpy Generator passed in.

Latency model (all envs): a task of difficulty d takes
  latency_median_s * latency_growth ** (d - 1) * exp(latency_sigma * z),
  z ~ N(0, 1)
simulated seconds: lognormal, so the median grows geometrically with the
level and the tail is heavy (p99 / median = exp(2.33 * sigma), 16x at
sigma = 1.2). It stands for the tool calls, sandboxes and judges of real
agent tasks, whose times range from seconds to hours, and exists to
exercise the scheduler (m2jax.rl.scheduler); no env sleeps.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Protocol

import numpy as np

from m2jax.config import ConfigError

# The task id's random part: 63 bits, so ids of a run never collide in
# practice (1e6 tasks: collision probability ~5e-8).
_ID_BITS = 63


class Task(NamedTuple):
  """One prompt of an env and its reference answer."""
  task_id: str      # unique, deterministic from the generator's rng draws
  env: str          # the env's name ("arithmetic", "sorting")
  difficulty: int   # one of the env's levels
  prompt: str       # what the policy sees, e.g. "37+58="
  answer: str       # the reference answer, e.g. "95"


class Verification(NamedTuple):
  """The verifier's judgement of one completion."""
  reward: float     # in [0, 1]
  correct: bool     # reward == 1
  detail: dict      # JSON-serialisable: what was parsed, positions right...


class Env(Protocol):
  """An environment: a frozen config dataclass with these methods."""
  name: str
  levels: tuple[int, ...]

  def level_mix(self) -> dict[int, float]:
    """Probability of each level when `sample` draws one."""

  def sample(self, rng: np.random.Generator,
             difficulty: int | None = None) -> Task:
    """A task of `difficulty` (None: drawn from the level mix)."""

  def verify(self, task: Task, completion: str) -> Verification:
    """Scores what the policy generated before EOS."""

  def demonstration(self, task: Task) -> str:
    """A completion `verify` scores 1 (the supervised warm start's data)."""

  def latency(self, task: Task, rng: np.random.Generator) -> float:
    """Simulated seconds the environment takes on `task` (> 0)."""


def fail(config, field: str, rule: str, value) -> None:
  """Raises the one-line error for a bad config field."""
  raise ConfigError(f"{type(config).__name__}.{field}: {rule} "
                    f"(got {value!r})")


def _real(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def as_tuple(config, field: str) -> tuple:
  """The field as a tuple (a list from a caller becomes one, so the frozen
  config stays hashable)."""
  value = getattr(config, field)
  if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
    fail(config, field, "must be a sequence", value)
  value = tuple(value)
  object.__setattr__(config, field, value)
  return value


def check_levels(config, lowest: int, highest: int | None = None) -> None:
  """Validates `levels` (increasing ints in [lowest, highest]) and `mix`
  (None, or one non-negative weight per level, summing above 0)."""
  levels = as_tuple(config, "levels")
  top = float("inf") if highest is None else highest
  if (not levels or any(not isinstance(d, numbers.Integral)
                        or isinstance(d, bool) for d in levels)
      or any(not lowest <= d <= top for d in levels)
      or any(a >= b for a, b in zip(levels, levels[1:]))):
    bounds = (f">= {lowest}" if highest is None
              else f"in [{lowest}, {highest}]")
    fail(config, "levels", f"must be increasing ints {bounds}", levels)
  # Plain ints, so tasks and mixes built from them are JSON-serialisable.
  object.__setattr__(config, "levels", tuple(int(d) for d in levels))
  if config.mix is None:
    return
  mix = as_tuple(config, "mix")
  if (len(mix) != len(levels) or any(not _real(w) or w < 0 for w in mix)
      or sum(mix) <= 0):
    fail(config, "mix", f"must be {len(levels)} non-negative weights (one "
         "per level) with a positive sum, or None for uniform", mix)


def check_latency(config) -> None:
  """Validates the latency model's three fields."""
  if not (_real(config.latency_median_s) and config.latency_median_s > 0):
    fail(config, "latency_median_s", "must be > 0", config.latency_median_s)
  if not (_real(config.latency_growth) and config.latency_growth >= 1):
    fail(config, "latency_growth", "must be >= 1", config.latency_growth)
  if not (_real(config.latency_sigma) and config.latency_sigma > 0):
    fail(config, "latency_sigma", "must be > 0", config.latency_sigma)


def level_mix(config) -> dict[int, float]:
  """{level: probability} from the config's `levels` and `mix`."""
  weights = (np.ones(len(config.levels)) if config.mix is None
             else np.asarray(config.mix, np.float64))
  probs = weights / weights.sum()
  return {d: float(p) for d, p in zip(config.levels, probs)}


def pick_level(config, rng: np.random.Generator,
               difficulty: int | None) -> int:
  """`difficulty` if it is one of the levels; None draws one from the mix."""
  if difficulty is None:
    mix = level_mix(config)
    return int(rng.choice(list(mix), p=list(mix.values())))
  if difficulty not in config.levels:
    raise ValueError(f"{config.name}: difficulty {difficulty!r} is not one "
                     f"of the levels {config.levels}")
  return int(difficulty)


def task_id(config, difficulty: int, rng: np.random.Generator) -> str:
  """A unique id drawn from `rng`, e.g. "arithmetic-3-5f0c2a9e81d4b7c6"."""
  nonce = int(rng.integers(2 ** _ID_BITS))
  return f"{config.name}-{difficulty}-{nonce:016x}"


def check_task(config, task: Task) -> None:
  """Errors unless `task` was made by this env."""
  if task.env != config.name:
    raise ValueError(f"{config.name}: cannot verify a task of env "
                     f"{task.env!r}")


def lognormal_latency(config, difficulty: int,
                      rng: np.random.Generator) -> float:
  """Seconds drawn from the latency model of the module docstring."""
  median = config.latency_median_s * config.latency_growth ** (difficulty - 1)
  return float(median * math.exp(config.latency_sigma
                                 * rng.standard_normal()))
