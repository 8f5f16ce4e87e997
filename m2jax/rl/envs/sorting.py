"""Sorting: put a list of small numbers in ascending order, partial credit.

Format (short ASCII for the byte tokenizer):
  prompt  "sort 3 1 2:"   d numbers drawn uniformly from 0..max_value
                          (repeats allowed; d = the level), single spaces,
  answer  "1 2 3"         the same numbers ascending, single spaces.
The levels (list lengths), the mix over them and max_value are config
fields.

Reward: the fraction of positions right. The completion is split at single
spaces into items (split(" "), so "" is one empty item and a double space
makes an empty item); position i is right iff item i is exactly the
answer's item i, and
  reward = positions right / max(len(items), len(answer items)),
so a list that is too short loses the missing positions, one that is too
long pays for its extra items, and a malformed item (wrong separator,
leading zero, stray text) is just a wrong position: "1,2,3" is one wrong
item and scores 0. Reward 1 iff the completion equals the answer. The
detail holds the `items` read, `positions_right` and the answer's
`length`.

Latency: the lognormal model of m2jax.rl.envs.base (median 1 s for a
one-item list, times 1.5 per item, sigma 1.2: 1.5 s to 8 s at the median
over the default lengths, a minute or more in the tail).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import numpy as np

from m2jax.rl.envs import base


@dataclasses.dataclass(frozen=True)
class Sorting:
  """Config of the sorting env (levels = list lengths)."""
  name: ClassVar[str] = "sorting"
  levels: tuple[int, ...] = (2, 3, 4, 5, 6)
  mix: tuple[float, ...] | None = None   # weight per level; None: uniform
  max_value: int = 9                     # items are drawn from 0..max_value
  latency_median_s: float = 1.0          # median seconds at length 1
  latency_growth: float = 1.5            # median factor per item
  latency_sigma: float = 1.2             # lognormal sigma (tail weight)

  def __post_init__(self):
    base.check_levels(self, 1)
    if (not isinstance(self.max_value, numbers.Integral)
        or isinstance(self.max_value, bool) or self.max_value < 1):
      base.fail(self, "max_value", "must be an int >= 1", self.max_value)
    base.check_latency(self)

  def level_mix(self) -> dict[int, float]:
    return base.level_mix(self)

  def sample(self, rng: np.random.Generator,
             difficulty: int | None = None) -> base.Task:
    length = base.pick_level(self, rng, difficulty)
    values = [int(x) for x in rng.integers(0, self.max_value + 1, length)]
    return base.Task(task_id=base.task_id(self, length, rng), env=self.name,
                     difficulty=length,
                     prompt="sort " + " ".join(map(str, values)) + ":",
                     answer=" ".join(map(str, sorted(values))))

  def verify(self, task: base.Task, completion: str) -> base.Verification:
    base.check_task(self, task)
    items, expected = completion.split(" "), task.answer.split(" ")
    right = sum(a == b for a, b in zip(items, expected))
    reward = right / max(len(items), len(expected))
    return base.Verification(
        reward=reward, correct=reward == 1.0,
        detail={"items": items, "positions_right": right,
                "length": len(expected)})

  def demonstration(self, task: base.Task) -> str:
    return task.answer

  def latency(self, task: base.Task, rng: np.random.Generator) -> float:
    return base.lognormal_latency(self, task.difficulty, rng)
