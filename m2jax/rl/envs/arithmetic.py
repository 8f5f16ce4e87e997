"""Arithmetic: n-digit addition and multiplication with an exact answer.

Format (short ASCII for the byte tokenizer; no spaces):
  prompt  "37+58="     two operands of exactly d digits (d = the level;
                       level 1 operands are 0..9), then "=",
  answer  "95"         the result in canonical decimal.
Operations ("+", "*"), the levels and the mix over them are config fields.

Reward (no partial credit): 1 iff the completion equals the answer
exactly, i.e. canonical decimal: digits only, no sign, no leading zero
(other than "0" itself), no space or newline around it. Anything else
scores 0; the detail says what was read: `parsed` (the number the
completion spells, written canonically, if it is all ASCII digits, else
None: "095" -> "95"), `canonical` (whether the completion is spelled as
the answer would be) and the `answer`.

Latency: the lognormal model of m2jax.rl.envs.base (median 2 s at level 1,
doubling per digit, sigma 1.2: about 2 s to half a minute at the median,
minutes in the tail).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar

import numpy as np

from m2jax.rl.envs import base

OPS = {"+": operator.add, "*": operator.mul}
# numpy draws operands as int64: 10**18 is the largest bound below 2**63.
MAX_DIGITS = 18


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """Config of the arithmetic env (levels = digits per operand)."""
  name: ClassVar[str] = "arithmetic"
  levels: tuple[int, ...] = (1, 2, 3, 4, 5)
  mix: tuple[float, ...] | None = None   # weight per level; None: uniform
  ops: tuple[str, ...] = ("+", "*")      # drawn uniformly
  latency_median_s: float = 2.0          # median seconds at level 1
  latency_growth: float = 2.0            # median factor per level
  latency_sigma: float = 1.2             # lognormal sigma (tail weight)

  def __post_init__(self):
    base.check_levels(self, 1, MAX_DIGITS)
    ops = base.as_tuple(self, "ops")
    if not ops or len(set(ops)) != len(ops) or not set(ops) <= set(OPS):
      base.fail(self, "ops", f"must be distinct operations from "
                f"{tuple(OPS)}", ops)
    base.check_latency(self)

  def level_mix(self) -> dict[int, float]:
    return base.level_mix(self)

  def sample(self, rng: np.random.Generator,
             difficulty: int | None = None) -> base.Task:
    digits = base.pick_level(self, rng, difficulty)
    op = self.ops[int(rng.integers(len(self.ops)))]
    low = 0 if digits == 1 else 10 ** (digits - 1)
    a, b = (int(x) for x in rng.integers(low, 10 ** digits, size=2))
    return base.Task(task_id=base.task_id(self, digits, rng), env=self.name,
                     difficulty=digits, prompt=f"{a}{op}{b}=",
                     answer=str(OPS[op](a, b)))

  def verify(self, task: base.Task, completion: str) -> base.Verification:
    base.check_task(self, task)
    digits_only = completion.isascii() and completion.isdigit()
    # The number as a canonical string (no int(): a long run of digits
    # would hit Python's limit on int-from-string conversion).
    parsed = (completion.lstrip("0") or "0") if digits_only else None
    canonical = parsed == completion
    correct = completion == task.answer
    return base.Verification(
        reward=float(correct), correct=correct,
        detail={"parsed": parsed, "canonical": canonical,
                "answer": task.answer})

  def demonstration(self, task: base.Task) -> str:
    return task.answer

  def latency(self, task: base.Task, rng: np.random.Generator) -> float:
    return base.lognormal_latency(self, task.difficulty, rng)
