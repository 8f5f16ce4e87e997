"""The white-box agent (SPEC §3): an agent loop whose context management the
system knows, so every model call it makes is a training sample.

An episode starts from a task's messages (a user turn, perhaps a system
turn) and a tool registry, and repeats: render the context with the chat
template (m2jax/data/chat.py) and the tools' specs, ask the policy for a
completion, parse it, run its tool calls, append the assistant message
(its reasoning kept: interleaved thinking, H_{t+1} = H_t + assistant(r_t,
a_t) + tool(o_t)) and one tool message per call, manage the context. It
ends at a final answer (an assistant message without tool calls: its
content is the answer), after `max_turns` model calls, or when the next
prompt would exceed `max_context_tokens` (end "answer", "max_turns",
"context").

Context management. The context is the task's messages, then the pinned
summary turn (if any), then the turns after it; a turn is an assistant
message with the tool messages answering it.
  * keep_last_turns = N > 0: only the last N turns after the summary stay.
  * summarise: the agent offers a `summarise` tool ({"summary": text}); a
    turn that calls it successfully becomes the pinned summary turn and
    every turn before it leaves the context. Its call carries the summary,
    so the summary is the model's own text, in its own turn.
The full log (`Episode.history`) is never rewritten. Re-rendering a
canonical completion reproduces its tokens, so while nothing is dropped
each call's state extends the previous call's state and action; after a
rewrite it does not (the trainer's prefix-tree packing merges whatever
the samples still share).

Records. Every model call is a `Call`: the exact prompt tokens sent (the
state), the action tokens and their behaviour log-probs as generated, the
policy version, the parsed message and its tools' results. Each becomes
one step of a pool trajectory (m2jax/rl/agent_rollout.py).

  agent = Agent(AgentConfig(max_turns=4), ToolRegistry([Calculator()]),
                ByteTokenizer())
  episode = agent.run([{"role": "user", "content": "..."}], generate)
  episode.answer, episode.end, [c.state for c in episode.calls]

`generate(prompt_ids) -> Completion` is any policy; the RL rollout drives
`Agent.start(...)` episodes step by step instead (`Episode.prompt`,
`Episode.advance`), so many episodes share the engine's batches.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from m2jax.agents import tools as tools_lib
from m2jax.data import chat
from m2jax.errors import UserError

ENDS = ("answer", "max_turns", "context")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """How the agent runs an episode and manages its context.

  max_turns: model calls per episode at most.
  keep_last_turns: turns kept after the summary (0: all of them).
  summarise: offer the summarise tool (module docstring).
  summarise_name, summarise_description: that tool's name and
    description as the model sees them.
  summarised_note: the summarise tool's output (what the model sees).
  max_context_tokens: the longest prompt the agent sends; an episode whose
    next prompt is longer ends ("context").
  """
  max_turns: int = 8
  keep_last_turns: int = 0
  summarise: bool = False
  summarise_name: str = "summarise"
  summarise_description: str = ("Replace the earlier turns of this "
                                "conversation with your summary of them.")
  summarised_note: str = "Earlier turns replaced by your summary."
  max_context_tokens: int = 1024

  def __post_init__(self):
    def fail(field, rule):
      raise UserError(f"AgentConfig.{field}: {rule} (got "
                      f"{getattr(self, field)!r})")
    if self.max_turns < 1:
      fail("max_turns", "must be >= 1")
    if self.keep_last_turns < 0:
      fail("keep_last_turns", "must be >= 0 (0: keep every turn)")
    if not isinstance(self.summarise_name, str) or not self.summarise_name:
      fail("summarise_name", "must be a non-empty string")
    if self.max_context_tokens < 2:
      fail("max_context_tokens", "must be >= 2")


class Completion(NamedTuple):
  """What the policy returned for one prompt."""
  tokens: Sequence[int]        # the action, END_OF_TURN included if sampled
  logprobs: Sequence[float]    # behaviour log q of each token
  version: int                 # the policy version that generated it
  finish_reason: str | None = "stop"   # the engine's: "stop", "length"


class Call(NamedTuple):
  """One model call of an episode: one training step (state, action)."""
  state: list[int]             # the exact prompt tokens sent
  action: list[int]            # the tokens received
  logprobs: list[float]        # their behaviour log-probs
  version: int
  finish_reason: str | None
  message: dict                # the parsed assistant message
  results: tuple[tools_lib.ToolResult, ...]   # one per tool call, in order


class Episode:
  """One task run by the agent; see the module docstring.

  prompt: the tokens of the next model call (None once done).
  calls: every model call so far. history: every message, never rewritten.
  done, end (one of ENDS), answer (the final content; None unless end is
  "answer").
  """

  def __init__(self, agent: "Agent", messages: Sequence[Mapping]):
    if isinstance(messages, (str, Mapping)) or not messages:
      raise UserError("an episode starts from a non-empty list of messages")
    self.agent = agent
    self.task = [chat.normalize_message(m, i)
                 for i, m in enumerate(messages)]
    self.summary: list[dict] = []       # the pinned summary turn
    self.turns: list[list[dict]] = []   # turns after it, oldest first
    self.history: list[dict] = list(self.task)
    self.calls: list[Call] = []
    self.dropped_turns = 0
    self.done, self.end, self.answer = False, None, None
    self.prompt: list[int] | None = None
    self._next_prompt()

  def context(self) -> list[dict]:
    """The messages the next prompt renders."""
    return self.task + self.summary + [m for t in self.turns for m in t]

  def _next_prompt(self) -> None:
    ids, _ = chat.render(self.context(), self.agent.tokenizer,
                         tools=self.agent.tool_specs(),
                         add_generation_prompt=True)
    if len(ids) > self.agent.config.max_context_tokens:
      self._finish("context")
    else:
      self.prompt = [int(t) for t in ids]

  def _finish(self, end: str, answer: str | None = None) -> None:
    self.done, self.end, self.answer, self.prompt = True, end, answer, None

  def advance(self, completion: Completion) -> Call:
    """Take the policy's completion of `prompt`: record the call, run its
    tools, manage the context, and set the next prompt or end."""
    if self.done:
      raise UserError(f"advance: the episode has ended ({self.end})")
    tokens = [int(t) for t in completion.tokens]
    logprobs = [float(x) for x in completion.logprobs]
    if len(tokens) != len(logprobs):
      raise UserError(f"advance: {len(tokens)} tokens but {len(logprobs)} "
                      "log-probs")
    text = self.agent.tokenizer.decode(np.asarray(tokens, np.int32))
    message = chat.parse_completion(text)
    calls = message.get("tool_calls", [])
    results = tuple(self._run(c) for c in calls)
    call = Call(self.prompt, tokens, logprobs, int(completion.version),
                completion.finish_reason, message, results)
    self.calls.append(call)
    turn = [message] + [{"role": "tool", "content": r.content}
                        for r in results]
    self.history += turn
    if not calls:
      self._finish("answer", message["content"])
      return call
    name = self.agent.config.summarise_name
    if self.agent.config.summarise and any(
        c["name"] == name and not r.error for c, r in zip(calls, results)):
      self.dropped_turns += len(self.turns) + (1 if self.summary else 0)
      self.summary, self.turns = turn, []
    else:
      self.turns.append(turn)
    keep = self.agent.config.keep_last_turns
    if keep and len(self.turns) > keep:
      self.dropped_turns += len(self.turns) - keep
      self.turns = self.turns[-keep:]
    if len(self.calls) >= self.agent.config.max_turns:
      self._finish("max_turns")
    else:
      self._next_prompt()
    return call

  def _run(self, call: dict) -> tools_lib.ToolResult:
    config = self.agent.config
    if not (config.summarise and call["name"] == config.summarise_name):
      return self.agent.registry.call(call["name"], call["arguments"])
    summary = call["arguments"].get("summary")
    if not isinstance(summary, str) or not summary.strip():
      return tools_lib.ToolResult(
          f"error: {config.summarise_name} needs a non-empty string "
          "argument 'summary'", True)
    return tools_lib.ToolResult(config.summarised_note, False)


class Agent:
  """Runs episodes of tasks with a tool registry; see the module
  docstring."""

  def __init__(self, config: AgentConfig, registry: tools_lib.ToolRegistry,
               tokenizer):
    if not isinstance(registry, tools_lib.ToolRegistry):
      raise UserError(f"Agent: registry must be a ToolRegistry, got "
                      f"{type(registry).__name__}")
    if config.summarise and config.summarise_name in registry:
      raise UserError(f"AgentConfig.summarise_name: the registry has a tool "
                      f"named {config.summarise_name!r} already")
    self.config, self.registry, self.tokenizer = config, registry, tokenizer
    specs = registry.specs()
    if config.summarise:
      specs.append({"type": "function", "function": {
          "name": config.summarise_name,
          "description": config.summarise_description,
          "parameters": {"type": "object",
                         "properties": {"summary": {"type": "string"}},
                         "required": ["summary"]}}})
    self._specs = specs

  def tool_specs(self) -> list[dict]:
    """The function specs the system turn lists: the registry's, then
    summarise when offered (what demonstrations must be rendered with)."""
    return copy.deepcopy(self._specs)

  def start(self, messages: Sequence[Mapping]) -> Episode:
    """An episode of the task `messages`, ready for its first call."""
    return Episode(self, messages)

  def run(self, messages: Sequence[Mapping],
          generate: Callable[[list[int]], Completion]) -> Episode:
    """The episode run to its end, one `generate` call per model call."""
    episode = self.start(messages)
    while not episode.done:
      episode.advance(generate(episode.prompt))
    return episode
