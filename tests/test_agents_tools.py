"""m2jax.agents.tools: the registry never raises for what the model sent;
the calculator is exact and refuses anything but arithmetic (huge powers
fast); the file tools read inside their directory and refuse every way
out of it (.., absolute paths, symlinks). The python tool's escapes are in
test_agents_sandbox.py."""

import os
import time

import pytest

from m2jax.agents.tools import (Calculator, ListFiles, PythonTool, ReadFile,
                                ToolRegistry, spec)
from m2jax.errors import MissingPathError, UserError


def _calc(expression):
  return ToolRegistry([Calculator()]).call("calculator",
                                           {"expression": expression})


# -------------------------------------------------------------- registry

def test_the_registry_reports_bad_calls_as_tool_errors():
  registry = ToolRegistry([Calculator()])
  assert registry.call("nope", {}) == (
      "error: no tool named 'nope' (tools: calculator)", True)
  assert registry.call("calculator", "{not json")[1]
  assert registry.call("calculator", "[1]") == (
      "error: arguments must be an object, got list", True)
  assert registry.call("calculator", {}) == (
      "error: calculator needs argument(s) expression", True)
  assert registry.call("calculator", '{"expression": "2*3"}') == ("6", False)
  with pytest.raises(UserError):
    registry.add(Calculator())
  names = [s["function"]["name"] for s in ToolRegistry(
      [Calculator(), PythonTool()]).specs()]
  assert names == ["calculator", "python"]
  assert spec(PythonTool())["function"]["parameters"]["required"] == ["code"]


# ------------------------------------------------------------ calculator

def test_calculator_is_exact_on_big_integers():
  a, b = 123456789012345678901234567890, 987654321098765432109876543210
  assert _calc(f"{a} * {b}") == (str(a * b), False)
  assert _calc("2**200 - 1") == (str(2**200 - 1), False)
  assert _calc("(7 - 10) * -(4 // 3) % 5") == (str((7 - 10) * -(4 // 3) % 5),
                                               False)
  assert _calc("1 / 4") == ("0.25", False)


@pytest.mark.parametrize("expression", [
    "x + 1", "pow(2, 10)", "(1).real", "__import__('os').system('true')",
    "[1, 2]", "1 if 1 else 2", "'a' * 3", "True + 1", "1 << 100",
    "lambda: 1", "(-8) ** 0.5"])
def test_calculator_refuses_anything_but_arithmetic(expression):
  content, error = _calc(expression)
  assert error and "\n" not in content, content


def test_calculator_refuses_huge_results_fast():
  start = time.monotonic()
  for expression in ("9**9**9", "2**10**10", "(10**999) * (10**999)",
                     "10.0**400", "10**999 * 1.5", "1 / 0", "7 % 0"):
    content, error = _calc(expression)
    assert error, expression
    assert any(word in content for word in ("digits", "too large",
                                            "division by zero")), content
  assert time.monotonic() - start < 0.5
  assert _calc("1" * 501)[0] == "error: expression longer than 500 characters"


# ---------------------------------------------------------------- files

@pytest.fixture
def task_dir(tmp_path):
  root = tmp_path / "task"
  (root / "data").mkdir(parents=True)
  (root / "data" / "rows.csv").write_text("id,value\n1,10\n2,20\n")
  (root / "readme.txt").write_text("x" * 100)
  (root / "blob.bin").write_bytes(b"\0\1\2")
  (tmp_path / "secret.txt").write_text("outside")
  (root / "link_out").symlink_to(tmp_path / "secret.txt")
  (root / "dir_out").symlink_to(tmp_path)
  (root / "link_in").symlink_to(root / "readme.txt")
  return root


def test_read_file_reads_inside_in_parts(task_dir):
  registry = ToolRegistry([ReadFile(str(task_dir), max_bytes=40)])
  assert registry.call("read_file", {"path": "data/rows.csv"}) == (
      "id,value\n1,10\n2,20\n", False)
  content, error = registry.call("read_file", {"path": "readme.txt"})
  assert not error and content == "x" * 40 + (
      "\n[bytes 0-40 of 100; call again with offset=40 for more]")
  assert registry.call("read_file", {"path": "readme.txt", "offset": 80}) == (
      "x" * 20, False)
  assert registry.call("read_file", {"path": "link_in"})[0].startswith("xxx")


@pytest.mark.parametrize("path,said", [
    ("../secret.txt", "leads outside"), ("data/../../secret.txt",
                                         "leads outside"),
    ("link_out", "leads outside"), ("dir_out/secret.txt", "leads outside"),
    ("/etc/passwd", "is absolute"), ("missing.txt", "cannot read"),
    ("data", "is not a file"), ("blob.bin", "binary file")])
def test_read_file_refuses_every_way_out(task_dir, path, said):
  content, error = ToolRegistry([ReadFile(str(task_dir))]).call(
      "read_file", {"path": path})
  assert error and said in content, content
  assert "outside" not in content.replace("leads outside", "")


def test_list_files_lists_inside_only(task_dir):
  registry = ToolRegistry([ListFiles(str(task_dir))])
  content, error = registry.call("list_files", {})
  assert not error
  assert content.splitlines() == ["blob.bin\t3", "data/rows.csv\t19",
                                  "link_in\t100", "readme.txt\t100"]
  assert registry.call("list_files", {"path": "data"}) == (
      "data/rows.csv\t19", False)
  for path in ("..", "dir_out", "/tmp"):
    assert registry.call("list_files", {"path": path})[1], path
  few = ToolRegistry([ListFiles(str(task_dir), max_entries=2)])
  assert few.call("list_files", {})[0].endswith("[2 more files not listed]")
  with pytest.raises(MissingPathError):
    ListFiles(str(task_dir / "nope"))


def test_python_tool_sees_its_files_and_returns_stdout():
  tool = PythonTool(files={"rows.csv": "1\n2\n3\n"})
  code = "print(sum(int(line) for line in open('rows.csv')))"
  assert ToolRegistry([tool]).call("python", {"code": code}) == ("6\n", False)
  assert ToolRegistry([tool]).call("python", {"code": "x = 1"}) == (
      "(no output)", False)
  assert ToolRegistry([tool]).call("python", {"code": 3}) == (
      "error: code must be a string", True)
  assert not os.path.exists("rows.csv")
