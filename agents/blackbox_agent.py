"""A black-box agent (SPEC §3): a program of its own that solves tool tasks
through an OpenAI-compatible server and nothing else. It imports nothing of
m2jax: the RL system sees only what it sends to the model and what it gets
back, recorded by Forge's gateway (m2jax/rl/gateway.py), which it reaches
with the official `openai` client: a base URL, a key and one header.

  OPENAI_API_KEY=KEY python agents/blackbox_agent.py \\
      --base_url=http://127.0.0.1:8000/v1 --model=policy \\
      < tasks.jsonl > results.jsonl
  python agents/blackbox_agent.py --base_url=... --model=policy \\
      --session_id=s1 --prompt="Compute 12*34." --tools="$(cat tools.json)"

Tasks. One JSON object per line on stdin (or one from the flags), each run
in its own thread as soon as it is read:
  session_id   the X-Session-Id of its calls (its gateway session)
  messages     the opening messages (OpenAI's chat shape)
  tools        OpenAI function specs; the agent runs them with its own
               implementations (a calculator) and refuses a task listing
               a tool it has none for
  max_turns    model calls at most
  sampling     temperature, top_p, max_tokens (per call) and seeds (one
               per call), each optional
  tool_wait_s  optional, one list per turn: the seconds that turn's tools
               take with 1, 2, ... calls (a simulated environment's
               latency; more calls than listed take the last); the agent
               waits them after running the tools

An episode: chat.completions.create with the history and the tools; the
assistant message is kept as returned (content, reasoning_content,
tool_calls: interleaved thinking, its reasoning stays in the history); each
tool call is run and answered by a tool message (a tool the task does not
list, arguments that are not a JSON object or lack a required field, and a
failing expression are answered "error: ..."); it stops at an answer (an
assistant message without tool calls), after max_turns calls, or when the
server says the context is full (400 context_length_exceeded). Then the
session is ended through the client's own `post`: POST
{base_url}/sessions/{id}/end with {} (the gateway's verifier judges it),
or after an error with {"discard": why}.

Output: a first line {"ready": true}, then one JSON line per task as it
ends: session_id, ok, end ("answer" | "max_turns" | "context"; null after
an error), turns, tool_calls, tool_errors, answer (the final content; null
unless end is "answer"), session (the gateway's outcome of the end, or
null) and error (null, or what went wrong). A failed HTTP call ends its
task with an error line; nothing a task does stops the program, which
exits once stdin is closed and every task has ended.

No call is retried (max_retries=0): the gateway would record a retried
generation twice.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import operator
import os
import sys
import threading
import time
import urllib.parse

import openai

SESSION_HEADER = "X-Session-Id"
MAX_OUTPUT_CHARS = 4096       # a tool's output the model sees, at most
MAX_EXPRESSION_CHARS = 500
MAX_RESULT_BITS = 3322        # about 1000 decimal digits
SAMPLING_KEYS = frozenset({"temperature", "top_p", "max_tokens", "seeds"})
TASK_KEYS = frozenset({"session_id", "messages", "tools", "max_turns",
                       "sampling", "tool_wait_s"})


class TaskError(ValueError):
  """A task line this agent cannot run."""


class ToolFailure(Exception):
  """A tool's failure, answered to the model as "error: <message>"."""


# --- The calculator -----------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(arguments: dict) -> str:
  """Exact arithmetic on one expression of numbers, + - * / // % ** and
  parentheses, parsed (never evaluated as Python): nothing else is
  accepted, and results past about 1000 digits are refused."""
  expression = arguments["expression"]
  if not isinstance(expression, str):
    raise ToolFailure("expression must be a string")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ToolFailure(f"expression longer than {MAX_EXPRESSION_CHARS} "
                      "characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError):
    raise ToolFailure(f"cannot parse {expression!r}") from None
  return str(_evaluate(tree.body))


def _evaluate(node):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    a, b = _evaluate(node.left), _evaluate(node.right)
    # A power's size is known before it is computed: refuse a huge one
    # rather than hang on it.
    if (isinstance(node.op, ast.Pow) and isinstance(a, int)
        and isinstance(b, int) and abs(a) > 1
        and b * (a.bit_length() - 1) > MAX_RESULT_BITS):
      raise ToolFailure("result too large")
    try:
      value = _BINARY[type(node.op)](a, b)
    except ZeroDivisionError:
      raise ToolFailure("division by zero") from None
    except OverflowError:
      raise ToolFailure("result too large") from None
    if isinstance(value, complex):
      raise ToolFailure(f"{ast.unparse(node)!r} is not a real number")
    if (isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS
        or isinstance(value, float) and not math.isfinite(value)):
      raise ToolFailure("result too large")
    return value
  raise ToolFailure(f"unsupported expression: {ast.unparse(node)!r}")


IMPLEMENTED = {"calculator": calculator}


class Toolbox:
  """The tools a task lists, run by this agent's own implementations."""

  def __init__(self, specs):
    if not isinstance(specs, list):
      raise TaskError("tools: must be a list of OpenAI function specs")
    self.required: dict[str, list] = {}
    for i, spec in enumerate(specs):
      function = spec.get("function") if isinstance(spec, dict) else None
      name = function.get("name") if isinstance(function, dict) else None
      if not isinstance(name, str):
        raise TaskError(f"tools[{i}]: not an OpenAI function spec")
      if name not in IMPLEMENTED:
        raise TaskError(f"tools[{i}]: this agent has no implementation of "
                        f"{name!r} (it has {', '.join(IMPLEMENTED)})")
      parameters = function.get("parameters") or {}
      self.required[name] = list(parameters.get("required", ()))

  def run(self, name, arguments) -> tuple[str, bool]:
    """(the tool message's content, whether the call failed)."""
    if name not in self.required:
      return (f"error: no tool named {name!r} (tools: "
              f"{', '.join(self.required) or 'none'})", True)
    try:
      args = json.loads(arguments) if arguments and arguments.strip() else {}
    except (TypeError, ValueError):
      return "error: arguments are not JSON", True
    if not isinstance(args, dict):
      return (f"error: arguments must be an object, got "
              f"{type(args).__name__}", True)
    missing = [k for k in self.required[name] if k not in args]
    if missing:
      return f"error: {name} needs argument(s) {', '.join(missing)}", True
    try:
      output = IMPLEMENTED[name](args)
    except ToolFailure as e:
      return f"error: {e}", True
    except (RecursionError, MemoryError, ValueError) as e:
      return f"error: {name} failed: {type(e).__name__}", True
    if len(output) > MAX_OUTPUT_CHARS:
      output = (output[:MAX_OUTPUT_CHARS] + f"\n[output cut: {len(output)} "
                f"characters, {MAX_OUTPUT_CHARS} shown]")
    return output, False


# --- Tasks --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Task:
  session_id: str
  messages: list
  tools: list
  max_turns: int
  sampling: dict
  tool_wait_s: list


def parse_task(obj) -> Task:
  """A task from its JSON object; TaskError naming what is wrong."""
  if not isinstance(obj, dict):
    raise TaskError("a task is a JSON object")
  unknown = sorted(set(obj) - TASK_KEYS)
  if unknown:
    raise TaskError(f"unknown task keys {unknown} (known: "
                    f"{sorted(TASK_KEYS)})")
  sid = obj.get("session_id")
  if not isinstance(sid, str) or not sid:
    raise TaskError("session_id: must be a non-empty string")
  messages = obj.get("messages")
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) for m in messages):
    raise TaskError("messages: must be a non-empty list of objects")
  max_turns = obj.get("max_turns", 8)
  if isinstance(max_turns, bool) or not isinstance(max_turns, int) or (
      max_turns < 1):
    raise TaskError("max_turns: must be an integer >= 1")
  sampling = obj.get("sampling") or {}
  if not isinstance(sampling, dict) or set(sampling) - SAMPLING_KEYS:
    raise TaskError(f"sampling: an object of {sorted(SAMPLING_KEYS)}")
  seeds = sampling.get("seeds")
  if seeds is not None and (not isinstance(seeds, list) or len(seeds) <
                            max_turns):
    raise TaskError("sampling.seeds: one seed per turn (max_turns)")
  waits = obj.get("tool_wait_s") or []
  if not isinstance(waits, list) or not all(
      isinstance(w, list) and all(isinstance(x, (int, float)) and x >= 0
                                  for x in w) for w in waits):
    raise TaskError("tool_wait_s: a list (per turn) of lists of seconds")
  return Task(sid, messages, obj.get("tools") or [], max_turns, sampling,
              waits)


def _describe(e: Exception) -> str:
  if isinstance(e, openai.APIStatusError):
    return f"HTTP {e.status_code}: {e.message}"
  return f"{type(e).__name__}: {e}"


def _episode(client, model: str, task: Task, toolbox: Toolbox,
             result: dict) -> str:
  """Runs the task's calls; returns how it ended."""
  history = [dict(m) for m in task.messages]
  sampling = {k: v for k, v in task.sampling.items() if k != "seeds"}
  seeds = task.sampling.get("seeds")
  for turn in range(task.max_turns):
    kwargs = dict(model=model, messages=history, **sampling)
    if task.tools:
      kwargs["tools"] = task.tools
    if seeds is not None:
      kwargs["seed"] = seeds[turn]
    try:
      response = client.chat.completions.create(**kwargs)
    except openai.BadRequestError as e:
      if e.code == "context_length_exceeded":
        return "context"
      raise
    message = response.choices[0].message
    result["turns"] += 1
    kept = {"role": "assistant", "content": message.content}
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning is not None:
      kept["reasoning_content"] = reasoning
    calls = []
    for call in message.tool_calls or []:
      function = getattr(call, "function", None)
      calls.append({"id": call.id, "type": "function", "function": {
          "name": getattr(function, "name", None) or "",
          "arguments": getattr(function, "arguments", None) or ""}})
    if calls:
      kept["tool_calls"] = calls
    history.append(kept)
    if not calls:
      result["answer"] = message.content or ""
      return "answer"
    for call in calls:
      content, failed = toolbox.run(call["function"]["name"],
                                    call["function"]["arguments"])
      history.append({"role": "tool", "tool_call_id": call["id"],
                      "content": content})
      result["tool_calls"] += 1
      result["tool_errors"] += failed
    if turn < len(task.tool_wait_s) and task.tool_wait_s[turn]:
      waits = task.tool_wait_s[turn]
      time.sleep(waits[min(len(calls), len(waits)) - 1])
  return "max_turns"


def run_task(base: openai.OpenAI, model: str, task: Task) -> dict:
  """Runs one task and ends its session; returns its result line."""
  result = {"session_id": task.session_id, "ok": False, "end": None,
            "turns": 0, "tool_calls": 0, "tool_errors": 0, "answer": None,
            "session": None, "error": None}
  client = base.with_options(
      default_headers={SESSION_HEADER: task.session_id})
  try:
    result["end"] = _episode(client, model, task, Toolbox(task.tools),
                             result)
  except Exception as e:  # pylint: disable=broad-except
    result["error"] = _describe(e)
  body = ({} if result["error"] is None
          else {"discard": f"agent error: {result['error']}"[:1000]})
  path = f"/sessions/{urllib.parse.quote(task.session_id, safe='')}/end"
  try:
    result["session"] = client.post(path, body=body, cast_to=object)
  except Exception as e:  # pylint: disable=broad-except
    result["error"] = result["error"] or f"ending the session: {_describe(e)}"
  result["ok"] = result["error"] is None
  return result


class _Output:
  """JSON lines on a stream, one writer at a time."""

  def __init__(self, stream):
    self.stream, self.lock = stream, threading.Lock()

  def write(self, obj) -> None:
    line = json.dumps(obj, ensure_ascii=False, default=str)
    with self.lock:
      self.stream.write(line + "\n")
      self.stream.flush()


def _run_line(base, model: str, line: str, out: _Output) -> None:
  try:
    obj = json.loads(line)
  except ValueError as e:
    out.write({"session_id": None, "ok": False,
               "error": f"a task line that is not JSON: {e}"})
    return
  try:
    task = parse_task(obj)
  except TaskError as e:
    sid = obj.get("session_id") if isinstance(obj, dict) else None
    out.write({"session_id": sid if isinstance(sid, str) else None,
               "ok": False, "error": f"bad task: {e}"})
    return
  try:
    out.write(run_task(base, model, task))
  except Exception as e:  # pylint: disable=broad-except
    out.write({"session_id": task.session_id, "ok": False,
               "error": f"the agent failed: {_describe(e)}"})


def _flag_task(args) -> dict:
  try:
    tools = json.loads(args.tools) if args.tools else []
  except ValueError as e:
    raise SystemExit(f"--tools: not JSON ({e})") from None
  sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
  return {"session_id": args.session_id, "tools": tools,
          "messages": [{"role": "user", "content": args.prompt}],
          "max_turns": args.max_turns, "sampling": sampling}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--base_url", required=True,
                      help="the server's OpenAI base URL (ending in /v1)")
  parser.add_argument("--model", required=True, help="the model's name")
  parser.add_argument("--api_key", default=None, help="the server's key "
                      "(default: $OPENAI_API_KEY; a flag shows in ps)")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="seconds one HTTP call may take")
  single = parser.add_argument_group("one task from flags (else stdin)")
  single.add_argument("--session_id")
  single.add_argument("--prompt", help="the user message")
  single.add_argument("--tools", help="OpenAI function specs (JSON list)")
  single.add_argument("--max_turns", type=int, default=8)
  single.add_argument("--temperature", type=float, default=1.0)
  single.add_argument("--max_tokens", type=int, default=256)
  args = parser.parse_args(argv)
  key = args.api_key or os.environ.get("OPENAI_API_KEY") or "none"
  base = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=0,
                       timeout=args.timeout)
  out = _Output(sys.stdout)
  if args.session_id is not None or args.prompt is not None:
    if not (args.session_id and args.prompt):
      parser.error("one task from flags needs --session_id and --prompt")
    try:
      task = parse_task(_flag_task(args))
    except TaskError as e:
      parser.error(str(e))
    result = run_task(base, args.model, task)
    out.write(result)
    return 0 if result["ok"] else 1
  out.write({"ready": True})
  threads: list[threading.Thread] = []
  for line in sys.stdin:
    if not line.strip():
      continue
    thread = threading.Thread(target=_run_line, daemon=True,
                              args=(base, args.model, line, out))
    thread.start()
    threads = [t for t in threads if t.is_alive()] + [thread]
  for thread in threads:
    thread.join()
  return 0


if __name__ == "__main__":
  sys.exit(main())
