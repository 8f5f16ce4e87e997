"""Tools an agent may call, and the registry that runs them.

A tool is a name, a description and a JSON-schema of its arguments (the
OpenAI function spec the chat template lists in the system turn, see
m2jax.data.chat), and a call from an arguments dict to text. Whatever goes
wrong inside a tool (bad arguments, a limit hit, an exception) comes back
as a ToolResult with error=True and a one-line message the model sees as
the tool's output: a tool never crashes the agent.

  registry = ToolRegistry([Calculator()])
  registry.specs()                       # for chat.render(..., tools=...)
  registry.call("calculator", {"expression": "123456789 * 987654321"})
  # ToolResult(content="121932631112635269", error=False)
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

from m2jax.errors import UserError

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
      return value
    raise ToolError(f"unsupported expression: {ast.unparse(node)!r}")

  def _check_power(self, a, b) -> None:
    if isinstance(b, int) and isinstance(a, int) and abs(a) > 1:
      if b > 0 and b * max(a.bit_length() - 1, 1) > 3.33 * self.max_digits:
        raise ToolError(f"result has more than {self.max_digits} digits")
