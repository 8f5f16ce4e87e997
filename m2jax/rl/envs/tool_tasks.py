"""Tool tasks: environments an agent solves by calling tools (SPEC §3,
issue 16 item 5), run by the white-box agent (m2jax/agents/whitebox.py
through m2jax/rl/agent_rollout.py) or by a black-box agent through the
gateway. Each is multi-step: `multi_step` is True, and a run must use an
agent (m2jax.rl.loop refuses one without).

multiply: multiply two numbers of d digits each (d = the level), more than
a small model can do in its head; the calculator does it exactly.
  prompt     "Compute 48213*90571. Answer with the digits only."
  answer     "4366700223"
  solution   assistant: think, then call calculator {"expression":
             "48213*90571"} (the expression is copied from the prompt);
             tool: "4366700223"; assistant: think, then "4366700223".
             The think blocks are the fields call_reasoning and
             answer_reasoning (the demonstration's; the policy writes its
             own).

What a tool env gives any agent (white- or black-box alike):
  env.messages(task)       the task's opening messages (one user turn)
  env.registry()           its tools (m2jax.agents.tools.ToolRegistry;
                           .specs() is the API's `tools`, .call runs one)
  env.verify(task, answer) the verdict on the final answer: the content of
                           the assistant message that ended the episode
                           (an assistant message without tool calls)
  env.process_reward(task, message, results)
                           one model call's own reward (pool Step.reward)
  env.call_s, env.tool_seconds(task, tool_calls, rng), env.baseline_s(task)
                           the simulated time of a model call, of a turn's
                           tool calls, and of the demonstration (the
                           composite reward's T_completion / T_baseline)
  env.demonstration(task), env.demonstration_messages(task)
                           a final answer verify scores 1, and the whole
                           solved conversation (the warm start's data)

Reward: 1 iff the answer, stripped of surrounding whitespace, is the
product in canonical decimal (no sign, no leading zero), else 0. Process
reward: `valid_call_reward` for a call whose tool calls (one or more) all
ran without error, 0 otherwise (a final answer, a failed call).

Time (simulated seconds, the lognormal model of m2jax.rl.envs.base): a
model call takes `call_s`; each tool call draws a latency; a turn's tool
calls run in parallel (the turn waits for the slowest), so an episode takes
sum over turns of (call_s + its slowest tool call). The baseline is the
demonstration's: two calls and one tool call at the median latency.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import zlib
from typing import ClassVar, Sequence

import numpy as np

from m2jax.agents import tools as tools_lib
from m2jax.rl.envs import base

PROMPT = "Compute {a}*{b}. Answer with the digits only."
_OPERANDS = re.compile(r"Compute (\d+)\*(\d+)\.")
# The demonstration's think blocks (the defaults of Multiply.call_reasoning
# and .answer_reasoning): short, so a byte-level model's turns stay short.
CALL_REASONING = "Use the calculator."
ANSWER_REASONING = "The calculator gave the product."
MAX_DIGITS = 100   # digits per operand at most (the product: 200)


@dataclasses.dataclass(frozen=True)
class Multiply:
  """Config of the multiply env (levels = digits per operand)."""
  name: ClassVar[str] = "multiply"
  multi_step: ClassVar[bool] = True
  levels: tuple[int, ...] = (3, 4, 5, 6)
  mix: tuple[float, ...] | None = None   # weight per level; None: uniform
  valid_call_reward: float = 0.1         # process reward of a good call
  tool_description: str = "Exact arithmetic on integers."
  # The demonstration's think blocks. Shorter ones put the operands a
  # tiny byte-level model copies nearer to where it writes them.
  call_reasoning: str = CALL_REASONING
  answer_reasoning: str = ANSWER_REASONING
  # The fraction of demonstrations (the SFT warm start's data) that answer
  # with the tool's result; the rest answer another task's product of the
  # same level. Below 1 the warm start learns the protocol (call, then
  # answer a number) but not to read the result: that is left to RL.
  demo_correct_fraction: float = 1.0
  call_s: float = 1.0                    # simulated seconds per model call
  latency_median_s: float = 1.0          # a tool call's median at level 1
  latency_growth: float = 1.0            # median factor per level
  latency_sigma: float = 0.5             # lognormal sigma (tail weight)

  def __post_init__(self):
    base.check_levels(self, 1, MAX_DIGITS)
    if not _real(self.valid_call_reward):
      base.fail(self, "valid_call_reward", "must be a finite number",
                self.valid_call_reward)
    for field in ("tool_description", "call_reasoning", "answer_reasoning"):
      if not isinstance(getattr(self, field), str):
        base.fail(self, field, "must be a string", getattr(self, field))
    if not (_real(self.demo_correct_fraction)
            and 0 <= self.demo_correct_fraction <= 1):
      base.fail(self, "demo_correct_fraction", "must be in [0, 1]",
                self.demo_correct_fraction)
    if not (_real(self.call_s) and self.call_s >= 0):
      base.fail(self, "call_s", "must be >= 0", self.call_s)
    base.check_latency(self)

  def level_mix(self) -> dict[int, float]:
    return base.level_mix(self)

  def sample(self, rng: np.random.Generator,
             difficulty: int | None = None) -> base.Task:
    digits = base.pick_level(self, rng, difficulty)
    # Digit by digit: operands past int64 (numpy's integers) are allowed.
    a, b = (_number(rng, digits) for _ in range(2))
    return base.Task(task_id=base.task_id(self, digits, rng), env=self.name,
                     difficulty=digits, prompt=PROMPT.format(a=a, b=b),
                     answer=str(int(a) * int(b)))

  def registry(self) -> tools_lib.ToolRegistry:
    return tools_lib.ToolRegistry(
        [tools_lib.Calculator(description=self.tool_description)])

  def messages(self, task: base.Task) -> list[dict]:
    base.check_task(self, task)
    return [{"role": "user", "content": task.prompt}]

  def verify(self, task: base.Task, answer: str) -> base.Verification:
    base.check_task(self, task)
    text = answer.strip() if isinstance(answer, str) else ""
    digits_only = text.isascii() and text.isdigit()
    parsed = (text.lstrip("0") or "0") if digits_only else None
    correct = text == task.answer
    return base.Verification(
        reward=float(correct), correct=correct,
        detail={"parsed": parsed, "answer": task.answer})

  def process_reward(self, task: base.Task, message: dict,
                     results: Sequence[tools_lib.ToolResult]) -> float:
    del task, message
    ok = bool(results) and not any(r.error for r in results)
    return float(self.valid_call_reward) if ok else 0.0

  def expression(self, task: base.Task) -> str:
    """The calculator expression that solves `task`, as its prompt has it."""
    base.check_task(self, task)
    match = _OPERANDS.search(task.prompt)
    if match is None:
      raise ValueError(f"{self.name}: {task.prompt!r} is not a task prompt")
    return f"{match[1]}*{match[2]}"

  def demonstration(self, task: base.Task) -> str:
    """The answer a demonstration gives: the product, or (for a fraction
    1 - demo_correct_fraction of tasks, fixed per prompt) the product of
    another pair of operands of the same level."""
    rng = np.random.default_rng(zlib.crc32(task.prompt.encode()))
    if rng.random() < self.demo_correct_fraction:
      return task.answer
    a, b = (_number(rng, task.difficulty) for _ in range(2))
    return str(int(a) * int(b))

  def demonstration_messages(self, task: base.Task) -> list[dict]:
    expression = self.expression(task)
    result = self.registry().call("calculator", {"expression": expression})
    return self.messages(task) + [
        {"role": "assistant", "reasoning": self.call_reasoning,
         "content": "",
         "tool_calls": [{"name": "calculator",
                         "arguments": {"expression": expression}}]},
        {"role": "tool", "content": result.content},
        {"role": "assistant", "reasoning": self.answer_reasoning,
         "content": self.demonstration(task)}]

  def latency(self, task: base.Task, rng: np.random.Generator) -> float:
    """Simulated seconds one tool call of `task` takes."""
    return base.lognormal_latency(self, task.difficulty, rng)

  def tool_seconds(self, task: base.Task, tool_calls: int,
                   rng: np.random.Generator) -> float:
    """Simulated seconds a turn's `tool_calls` take, run in parallel (0
    without any)."""
    latencies = [self.latency(task, rng) for _ in range(tool_calls)]
    return max(latencies, default=0.0)

  def baseline_s(self, task: base.Task) -> float:
    """The demonstration's time: two calls, one tool call at the median."""
    median = (self.latency_median_s
              * self.latency_growth ** (task.difficulty - 1))
    return 2 * self.call_s + median


def _real(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def _number(rng: np.random.Generator, digits: int) -> str:
  """A decimal of exactly `digits` digits (level 1: 0..9)."""
  first = int(rng.integers(0 if digits == 1 else 1, 10))
  rest = rng.integers(0, 10, size=digits - 1)
  return str(first) + "".join(str(int(d)) for d in rest)
