"""The chat template: conversations <-> token ids, and completions -> messages.

One template serves supervised fine-tuning (m2jax.train.sft renders its
training data with `render`) and the OpenAI-compatible server (it renders
requests with `render(..., add_generation_prompt=True)`, stops generation at
END_OF_TURN and reads the answer back with `parse_completion`). It is plain
text, so it works for every m2jax tokenizer (the byte tokenizer has no ids to
spare for special tokens); the only special id is the tokenizer's BOS, first.

A conversation is a list of messages, each a dict:
  {"role": "system" | "user" | "tool", "content": str}
  {"role": "assistant", "content": str | None,
   "reasoning": str (optional),            # also read as "reasoning_content"
   "tool_calls": [{"name": str, "arguments": {...}}, ...] (optional)}
OpenAI's shapes are accepted too: content as a list of {"type": "text",
"text": ...} parts, and tool calls as {"type": "function", "function":
{"name", "arguments": JSON text}}; "tool_call_id" and "name" may be given
(tool results follow their calls in call order and are not rendered with
them). Any other key is an error.

The text, exactly (\\n is a newline; braces are the message's fields):

  <BOS id>
  <|system|>\\n{content}<|end|>\\n
  <|user|>\\n{content}<|end|>\\n
  <|assistant|>\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}\\n
  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n
  <tool_call>\\n{...}\\n</tool_call><|end|>\\n
  <|tool|>\\n{content}<|end|>\\n

  * The think block is written only when the message has reasoning; the
    "\\n" between content and the first tool call only when both exist; tool
    calls are joined by "\\n"; each is json.dumps({"name", "arguments"},
    ensure_ascii=False).
  * Reasoning stays in the history: every assistant message keeps its think
    block, earlier turns included (interleaved thinking, SPEC §3:
    H_{t+1} = H_t + assistant(reasoning_t, action_t) + tool(observation_t)).
  * `tools` (OpenAI function specs) are listed in the system turn, after
    the system message's content and a blank line: TOOLS_HEADER, then
    "<tools>\\n", one json.dumps(spec) per line, "</tools>". Without a
    system message the tools make a system turn of their own.
  * add_generation_prompt appends "<|assistant|>\\n": the prompt a model
    continues, ending its turn with "<|end|>" (the server's stop string).
  * Markers are plain text, not escaped: a message that contains one reads
    back ambiguously.

The assistant mask marks exactly what the model generates: an assistant
message's think block, content, tool calls and its "<|end|>"; never a role
header, the newline after "<|end|>", BOS, or another role's text. Each piece
of the text is encoded on its own and the ids concatenated, so every id
belongs to one piece (a BPE merge never straddles a marker) and the mask is
exact for every tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from m2jax.data import tokenizer as tokenizer_lib
from m2jax.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
END_OF_TURN = "<|end|>"  # ends every turn; the server stops generation here
THINK_START, THINK_END = "<think>", "</think>"
THINK_OPEN, THINK_CLOSE = THINK_START + "\n", "\n" + THINK_END + "\n\n"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
TOOLS_HEADER = ("# Tools\nYou may call one or more of these functions; for "
                "each call write <tool_call>\n{\"name\": <function name>, "
                "\"arguments\": <JSON object>}\n</tool_call>\n")
_MESSAGE_KEYS = frozenset({"role", "content", "reasoning", "reasoning_content",
                           "tool_calls", "tool_call_id", "name"})
_TOOL_CALL_RE = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.DOTALL)


class ChatFormatError(UserError, ValueError):
  """A conversation or tool call that does not fit the chat template."""


def header(role: str) -> str:
  """The text that opens a turn of `role`: "<|role|>\\n"."""
  return f"<|{role}|>\n"


def _text(value, where: str) -> str:
  """Content as one string: str, None (empty) or OpenAI's text parts."""
  if value is None:
    return ""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(
      isinstance(p, Mapping) and p.get("type") == "text"
      and isinstance(p.get("text"), str) for p in value):
    return "".join(p["text"] for p in value)
  raise ChatFormatError(f"{where}: content must be a string, null or a list "
                        f"of {{'type': 'text', 'text': ...}} parts, got "
                        f"{type(value).__name__}")


def normalize_tool_call(call, where: str = "tool call") -> dict:
  """{"name": str, "arguments": dict} from ours or OpenAI's tool-call shape."""
  if not isinstance(call, Mapping):
    raise ChatFormatError(f"{where}: must be an object, got "
                          f"{type(call).__name__}")
  if "function" in call:  # OpenAI: {"id", "type", "function": {...}}
    call = call["function"]
    if not isinstance(call, Mapping):
      raise ChatFormatError(f"{where}: 'function' must be an object")
  name, arguments = call.get("name"), call.get("arguments", {})
  if not isinstance(name, str) or not name:
    raise ChatFormatError(f"{where}: 'name' must be a non-empty string, got "
                          f"{name!r}")
  if isinstance(arguments, str):  # OpenAI sends the arguments as JSON text
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
      raise ChatFormatError(f"{where}: 'arguments' is not JSON ({e})") from None
  if not isinstance(arguments, Mapping):
    raise ChatFormatError(f"{where}: 'arguments' must be a JSON object, got "
                          f"{type(arguments).__name__}")
  return {"name": name, "arguments": dict(arguments)}


def normalize_message(message, index: int = 0) -> dict:
  """The canonical form of a message (module docstring), checked.

  {"role", "content": str}, plus for an assistant "reasoning" (when given)
  and "tool_calls" [{"name", "arguments"}] (when non-empty).
  """
  where = f"message {index}"
  if not isinstance(message, Mapping):
    raise ChatFormatError(f"{where}: must be an object, got "
                          f"{type(message).__name__}")
  unknown = sorted(set(message) - _MESSAGE_KEYS)
  if unknown:
    raise ChatFormatError(f"{where}: unknown keys {unknown} (known: "
                          f"{sorted(_MESSAGE_KEYS)})")
  role = message.get("role")
  if role not in ROLES:
    raise ChatFormatError(f"{where}: role must be one of {ROLES}, got "
                          f"{role!r}")
  out = {"role": role, "content": _text(message.get("content"), where)}
  reasoning = message.get("reasoning")
  if message.get("reasoning_content") is not None:
    if reasoning is not None:
      raise ChatFormatError(f"{where}: give 'reasoning' or "
                            "'reasoning_content', not both")
    reasoning = message["reasoning_content"]
  calls = message.get("tool_calls") or []
  if role != "assistant" and (reasoning is not None or calls):
    raise ChatFormatError(f"{where}: only assistant messages carry reasoning "
                          f"or tool_calls (role {role!r})")
  if reasoning is not None:
    if not isinstance(reasoning, str):
      raise ChatFormatError(f"{where}: reasoning must be a string, got "
                            f"{type(reasoning).__name__}")
    out["reasoning"] = reasoning
  if not isinstance(calls, Sequence) or isinstance(calls, str):
    raise ChatFormatError(f"{where}: tool_calls must be a list")
  if calls:
    out["tool_calls"] = [normalize_tool_call(c, f"{where} tool call {i}")
                         for i, c in enumerate(calls)]
  return out


def assistant_text(message) -> str:
  """What the model writes for an assistant message, up to END_OF_TURN
  (excluded): the think block, the content and the tool calls."""
  m = normalize_message(message)
  parts = []
  if "reasoning" in m:
    parts += [THINK_OPEN, m["reasoning"], THINK_CLOSE]
  parts.append(m["content"])
  calls = m.get("tool_calls", [])
  if calls and m["content"]:
    parts.append("\n")
  parts.append("\n".join(
      TOOL_CALL_OPEN + json.dumps(c, ensure_ascii=False) + TOOL_CALL_CLOSE
      for c in calls))
  return "".join(parts)


def _tools_text(tools) -> str:
  if not isinstance(tools, Sequence) or isinstance(tools, str):
    raise ChatFormatError("tools must be a list of function specs")
  for i, spec in enumerate(tools):
    if not isinstance(spec, Mapping):
      raise ChatFormatError(f"tool {i}: must be an object")
  lines = "".join(json.dumps(spec, ensure_ascii=False) + "\n" for spec in tools)
  return f"{TOOLS_HEADER}<tools>\n{lines}</tools>"


def pieces(messages, *, tools=None, add_generation_prompt: bool = False
           ) -> list[tuple[str, bool]]:
  """The conversation as (text, is_assistant_generated) pieces, in order.

  Their concatenation is the rendered text (BOS excluded); the flagged ones
  are what the assistant mask covers.
  """
  if isinstance(messages, (str, Mapping)) or not isinstance(messages,
                                                             Sequence):
    raise ChatFormatError("a conversation must be a list of messages")
  msgs = [normalize_message(m, i) for i, m in enumerate(messages)]
  if tools:
    listing = _tools_text(tools)
    if msgs and msgs[0]["role"] == "system":
      content = msgs[0]["content"]
      msgs[0] = {"role": "system",
                 "content": f"{content}\n\n{listing}" if content else listing}
    else:
      msgs.insert(0, {"role": "system", "content": listing})
  out = []
  for m in msgs:
    out.append((header(m["role"]), False))
    if m["role"] == "assistant":
      out.append((assistant_text(m) + END_OF_TURN, True))
    else:
      out.append((m["content"] + END_OF_TURN, False))
    out.append(("\n", False))
  if add_generation_prompt:
    out.append((header("assistant"), False))
  return out


def render_text(messages, *, tools=None,
                add_generation_prompt: bool = False) -> str:
  """The rendered conversation as text (without BOS): what `render` encodes."""
  return "".join(text for text, _ in pieces(
      messages, tools=tools, add_generation_prompt=add_generation_prompt))


def render(messages, tokenizer: tokenizer_lib.Tokenizer, *, tools=None,
           add_generation_prompt: bool = False
           ) -> tuple[np.ndarray, np.ndarray]:
  """(ids_N int32, assistant_mask_N bool) of a conversation.

  ids: BOS, then each piece of `pieces(...)` encoded on its own. mask: True
  exactly on the ids of assistant-generated pieces (module docstring).
  """
  ids, mask = [np.asarray([tokenizer.bos_id], np.int32)], [np.zeros(1, bool)]
  for text, generated in pieces(messages, tools=tools,
                                add_generation_prompt=add_generation_prompt):
    piece = np.asarray(tokenizer.encode(text), np.int32)
    ids.append(piece)
    mask.append(np.full(len(piece), generated))
  return np.concatenate(ids), np.concatenate(mask)


def parse_completion(text: str) -> dict:
  """An assistant message from the text a model generated after the prompt.

  Reads what `assistant_text` writes: the text is cut at the first
  END_OF_TURN; a leading think block becomes "reasoning" (an unclosed one,
  e.g. cut by max_tokens, takes the rest of the text); each
  <tool_call>{json}</tool_call> whose JSON is {"name": str, "arguments":
  object} becomes a tool call; the text before the first of them is the
  content. A block that does not parse stays in the content as text, so no
  completion is an error. parse_completion(assistant_text(m)) ==
  normalize_message(m) for messages whose text holds no marker.
  """
  text = text.split(END_OF_TURN, 1)[0]
  message: dict[str, Any] = {"role": "assistant"}
  if text.startswith(THINK_START):
    body = text[len(THINK_OPEN):] if text.startswith(THINK_OPEN) else text[
        len(THINK_START):]
    if (close := body.find(THINK_CLOSE)) >= 0:
      message["reasoning"], text = body[:close], body[close + len(THINK_CLOSE):]
    elif (close := body.find(THINK_END)) >= 0:  # other spacing than ours
      message["reasoning"] = body[:close].rstrip("\n")
      text = body[close + len(THINK_END):].lstrip("\n")
    else:  # never closed (cut by max_tokens): all of it is reasoning
      message["reasoning"], text = body, ""
  calls, between, first, end = [], [], None, 0
  for match in _TOOL_CALL_RE.finditer(text):
    try:
      call = normalize_tool_call(json.loads(match.group(1)))
    except (ValueError, ChatFormatError):
      continue  # not a call: it stays in the text
    if first is None:
      first = match.start()
    else:
      between.append(text[end:match.start()])
    calls.append(call)
    end = match.end()
  if first is None:
    content = text
  else:
    content = text[:first]
    content = content[:-1] if content.endswith("\n") else content
    # Beyond the newlines that join calls, text between or after them (a
    # block that did not parse, say) is kept as content, not dropped.
    rest = [s.strip() for s in between + [text[end:]] if s.strip()]
    content = "\n".join([content] + rest if content else rest)
  message["content"] = content
  if calls:
    message["tool_calls"] = calls
  return message
