"""Tools an agent may call, and the registry that runs them.

A tool is a name, a description and a JSON-schema of its arguments (the
OpenAI function spec the chat template lists in the system turn, see
m2jax.data.chat), and a call from an arguments dict to text. Whatever goes
wrong inside a tool (bad arguments, a limit hit, an exception) comes back
as a ToolResult with error=True and a message the model sees as the tool's
output, its first line saying what happened: a tool never crashes the
agent.

  registry = ToolRegistry([Calculator(), PythonTool(), ReadFile(data_dir)])
  registry.specs()                       # for chat.render(..., tools=...)
  registry.call("calculator", {"expression": "123456789 * 987654321"})
  # ToolResult(content="121932631112635269", error=False)
  registry.call("python", {"code": "while True: pass"})
  # ToolResult(content="error: CPU time limit (10 s) reached; ...", True)

The tools: Calculator (exact arithmetic), PythonTool (code run in
m2jax.agents.sandbox), ListFiles and ReadFile (one directory's files, read
only, no path out of it).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

from m2jax.agents.sandbox import SandboxConfig, run_python
from m2jax.errors import MissingPathError, UserError

# The most characters of a tool's output the model sees; longer output is
# cut, and the cut said, so a tool cannot flood the context.
MAX_OUTPUT_CHARS = 4096


class ToolError(Exception):
  """A tool's failure, reported to the model as the tool's output."""


class ToolResult(NamedTuple):
  content: str   # what the model sees as the tool message
  error: bool    # the call failed (content says why)


@runtime_checkable
class Tool(Protocol):
  """What the registry needs of a tool."""
  name: str
  description: str
  parameters: dict      # JSON schema of the arguments object

  def __call__(self, arguments: Mapping[str, Any]) -> str:
    """The tool's output; raises ToolError when it cannot give one."""


def spec(tool: Tool) -> dict:
  """The OpenAI function spec of a tool."""
  return {"type": "function",
          "function": {"name": tool.name, "description": tool.description,
                       "parameters": tool.parameters}}


def truncate(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n[output cut: {len(text)} characters, {limit} shown]"


class ToolRegistry:
  """Tools by name; `call` never raises for anything the model sent."""

  def __init__(self, tools: Iterable[Tool] = ()):
    self._tools: dict[str, Tool] = {}
    for tool in tools:
      self.add(tool)

  def add(self, tool: Tool) -> None:
    if not isinstance(tool, Tool):
      raise UserError(f"ToolRegistry: {tool!r} is not a Tool (name, "
                      "description, parameters, __call__)")
    if tool.name in self._tools:
      raise UserError(f"ToolRegistry: a tool named {tool.name!r} is "
                      "registered already")
    self._tools[tool.name] = tool

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self._tools)

  def __contains__(self, name: str) -> bool:
    return name in self._tools

  def specs(self) -> list[dict]:
    return [spec(t) for t in self._tools.values()]

  def call(self, name: str, arguments: Any) -> ToolResult:
    """Runs tool `name`. `arguments` is a dict, or its JSON text (as an
    OpenAI tool call carries it)."""
    tool = self._tools.get(name)
    if tool is None:
      return ToolResult(f"error: no tool named {name!r} (tools: "
                        f"{', '.join(self._tools) or 'none'})", True)
    if isinstance(arguments, str):
      try:
        arguments = json.loads(arguments) if arguments.strip() else {}
      except json.JSONDecodeError as e:
        return ToolResult(f"error: arguments are not JSON ({e.msg})", True)
    if not isinstance(arguments, Mapping):
      return ToolResult(f"error: arguments must be an object, got "
                        f"{type(arguments).__name__}", True)
    missing = [k for k in tool.parameters.get("required", ())
               if k not in arguments]
    if missing:
      return ToolResult(f"error: {name} needs argument(s) "
                        f"{', '.join(missing)}", True)
    try:
      return ToolResult(truncate(str(tool(arguments))), False)
    except ToolError as e:
      return ToolResult(f"error: {e}", True)
    except Exception as e:  # pylint: disable=broad-except
      # A bug in a tool is still the tool's error, not the agent's crash.
      return ToolResult(f"error: {name} failed: {type(e).__name__}: {e}",
                        True)


# --- The calculator ---------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub,
           ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@dataclasses.dataclass(frozen=True)
class Calculator:
  """Exact integer (and float) arithmetic on one expression: + - * / // %
  ** and parentheses; nothing else parses (no names, calls or attributes).
  Results past `max_digits` digits are refused before they are computed
  where that can be known (powers), so no expression can hang the agent."""
  max_digits: int = 1000
  max_chars: int = 500
  name: str = "calculator"
  description: str = ("Evaluates an arithmetic expression exactly: integers "
                      "of any size, + - * / // % ** and parentheses.")
  parameters: dict = dataclasses.field(default_factory=lambda: {
      "type": "object",
      "properties": {"expression": {"type": "string",
                                    "description": "e.g. 12345 * 6789"}},
      "required": ["expression"]})

  def __call__(self, arguments: Mapping[str, Any]) -> str:
    expression = arguments["expression"]
    if not isinstance(expression, str):
      raise ToolError("expression must be a string")
    if len(expression) > self.max_chars:
      raise ToolError(f"expression longer than {self.max_chars} characters")
    try:
      tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
      raise ToolError(f"cannot parse {expression!r}") from None
    return str(self._eval(tree.body))

  def _eval(self, node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](self._eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      a, b = self._eval(node.left), self._eval(node.right)
      if isinstance(node.op, ast.Pow):
        self._check_power(a, b)
      try:
        value = _BINARY[type(node.op)](a, b)
      except ZeroDivisionError:
        raise ToolError("division by zero") from None
      except OverflowError:
        raise ToolError("result too large") from None
      if isinstance(value, int) and value.bit_length() > 3.33 * self.max_digits:
        raise ToolError(f"result has more than {self.max_digits} digits")
      if isinstance(value, complex):   # a negative number to a fraction
        raise ToolError(f"{ast.unparse(node)!r} is not a real number")
      if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large")
      return value
    raise ToolError(f"unsupported expression: {ast.unparse(node)!r}")

  def _check_power(self, a, b) -> None:
    if isinstance(b, int) and isinstance(a, int) and abs(a) > 1:
      if b > 0 and b * max(a.bit_length() - 1, 1) > 3.33 * self.max_digits:
        raise ToolError(f"result has more than {self.max_digits} digits")


# --- Python in the sandbox ----------------------------------------------------

def _tail(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return f"[... {len(text) - limit} characters cut]\n" + text[-limit:]


@dataclasses.dataclass(frozen=True)
class PythonTool:
  """Runs the `code` argument in a fresh sandbox (m2jax.agents.sandbox)
  whose working directory starts with `files`; its output is what the code
  printed. A limit hit or a non-zero exit is a ToolError whose first line
  says which limit or what happened, followed by the output and the end of
  stderr (the traceback), so the model can fix its code."""
  config: SandboxConfig = SandboxConfig()
  files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
  name: str = "python"
  description: str = (
      "Runs a Python 3 program in a fresh sandbox and returns what it "
      "prints. The standard library is available; there is no network and "
      "no subprocesses; files may be written in the current directory only "
      "and are gone after the call. Print the values you need.")
  parameters: dict = dataclasses.field(default_factory=lambda: {
      "type": "object",
      "properties": {"code": {"type": "string",
                              "description": "a complete Python program"}},
      "required": ["code"]})

  def __call__(self, arguments: Mapping[str, Any]) -> str:
    code = arguments["code"]
    if not isinstance(code, str):
      raise ToolError("code must be a string")
    result = run_python(code, self.config, self.files)
    if result.ok:
      return result.stdout or "(no output)"
    parts = [result.summary]
    if result.stdout:
      parts.append("stdout:\n" + _tail(result.stdout, 1000))
    if result.stderr:
      parts.append("stderr:\n" + _tail(result.stderr, 2500))
    raise ToolError("\n".join(parts))


# --- Files of one directory ---------------------------------------------------

def _root(directory: str, tool: str) -> str:
  if not isinstance(directory, str) or not os.path.isdir(directory):
    raise MissingPathError(f"{tool}: root {directory!r} is not a directory")
  return os.path.realpath(directory)


def _inside(root: str, path: Any) -> str:
  """The real path of `path` (relative to root); a ToolError if it is
  absolute or leads out of root (by .. or a symlink)."""
  if not isinstance(path, str):
    raise ToolError("path must be a string")
  if os.path.isabs(path):
    raise ToolError(f"path {path!r} is absolute; give it relative to the "
                    "files directory")
  real = os.path.realpath(os.path.join(root, path))
  if real != root and not real.startswith(root + os.sep):
    raise ToolError(f"path {path!r} leads outside the files directory")
  return real


@dataclasses.dataclass(frozen=True)
class ListFiles:
  """Lists the files (with sizes) beneath `root`, or beneath a directory
  inside it; nothing outside root is listed or reachable."""
  root: str
  max_entries: int = 200
  name: str = "list_files"
  description: str = ("Lists the task's files (path and size in bytes), "
                      "all of them or those under a directory.")
  parameters: dict = dataclasses.field(default_factory=lambda: {
      "type": "object",
      "properties": {"path": {"type": "string",
                              "description": "a directory (default: all)"}},
      "required": []})

  def __post_init__(self):
    object.__setattr__(self, "root", _root(self.root, "ListFiles"))

  def __call__(self, arguments: Mapping[str, Any]) -> str:
    top = _inside(self.root, arguments.get("path", "."))
    if not os.path.isdir(top):
      raise ToolError(f"{arguments.get('path')!r} is not a directory")
    paths = []
    for dirpath, _, filenames in os.walk(top):
      for name in filenames:
        path = os.path.join(dirpath, name)
        real = os.path.realpath(path)
        if real.startswith(self.root + os.sep) and os.path.isfile(real):
          paths.append((os.path.relpath(path, self.root), real))
        # else a link out of root, or to no file: not listed
    paths.sort()
    lines = [f"{rel}\t{os.path.getsize(real)}"
             for rel, real in paths[:self.max_entries]]
    if len(paths) > self.max_entries:
      lines.append(f"[{len(paths) - self.max_entries} more files not listed]")
    return "\n".join(lines) or "(no files)"


@dataclasses.dataclass(frozen=True)
class ReadFile:
  """Reads a text file beneath `root`, `max_bytes` at a time from a byte
  `offset`; nothing outside root can be read."""
  root: str
  max_bytes: int = 3500
  name: str = "read_file"
  description: str = ("Reads one of the task's text files. Long files come "
                      "in parts: pass the offset the previous part names.")
  parameters: dict = dataclasses.field(default_factory=lambda: {
      "type": "object",
      "properties": {"path": {"type": "string",
                              "description": "the file, as list_files "
                                             "names it"},
                     "offset": {"type": "integer",
                                "description": "byte to start at (0)"}},
      "required": ["path"]})

  def __post_init__(self):
    object.__setattr__(self, "root", _root(self.root, "ReadFile"))

  def __call__(self, arguments: Mapping[str, Any]) -> str:
    path = _inside(self.root, arguments["path"])
    offset = arguments.get("offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
      raise ToolError("offset must be an integer >= 0")
    try:
      # O_NOFOLLOW: the checked path must not become a link before the open.
      fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
      raise ToolError(f"cannot read {arguments['path']!r}: "
                      f"{e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      os.close(fd)
      raise ToolError(f"{arguments['path']!r} is not a file")
    with os.fdopen(fd, "rb") as f:
      f.seek(offset)
      data = f.read(self.max_bytes)
    if b"\0" in data:
      raise ToolError(f"{arguments['path']!r} is a binary file "
                      f"({info.st_size} bytes)")
    text = data.decode(errors="replace")
    end = offset + len(data)
    if end < info.st_size:
      text += (f"\n[bytes {offset}-{end} of {info.st_size}; call again with "
               f"offset={end} for more]")
    return text
