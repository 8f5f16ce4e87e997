"""m2jax.agents.sandbox through the python tool: each escape the issue names
(network, writing outside the working directory, a fork bomb, an infinite
loop, huge output, a memory hog) comes back as a tool error naming what
stopped it, with the working directory gone afterwards; ordinary code
works. The kernel layers are also tried with the audit hook off, to show
they hold alone (the hook is not a boundary)."""

import concurrent.futures
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from m2jax.agents import sandbox
from m2jax.agents.sandbox import SandboxConfig, run_python
from m2jax.agents.tools import PythonTool, ToolRegistry
from m2jax.config import ConfigError

FAST = SandboxConfig(cpu_seconds=1, wall_seconds=2,
                     memory_bytes=256 << 20, max_output_bytes=8192)
BARE = SandboxConfig(cpu_seconds=1, wall_seconds=2, memory_bytes=256 << 20,
                     audit_hook=False)
# A loaded machine may give the code less than 1 s of CPU in 2 s.
SPIN = SandboxConfig(cpu_seconds=1, wall_seconds=30)


def _lines(*lines):
  return "\n".join(lines)


def _kernel_offers() -> set[str]:
  """The kernel layers this machine offers, probed apart from the sandbox
  (a layer the sandbox failed to set up must fail a test, not skip one)."""
  probe = _lines(
      "import ctypes, os", "offers = []", "try:",
      "  os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET | os.CLONE_NEWNS)",
      "  offers += ['userns', 'netns', 'tmpfs']", "except OSError:",
      "  pass", "libc = ctypes.CDLL(None)",
      "if libc.syscall(444, None, 0, 1) >= 1:",   # landlock's ABI version
      "  offers.append('landlock')", "print(' '.join(offers))")
  offers = set(subprocess.run([sys.executable, "-I", "-c", probe],
                              check=True, capture_output=True,
                              text=True).stdout.split())
  with open("/proc/self/status") as f:
    if ("Seccomp:" in f.read()
        and os.uname().machine in ("x86_64", "aarch64")):
      offers.add("seccomp")
  return offers


OFFERS = _kernel_offers()
LAYERS = sandbox.containment(FAST)


def _needs(*layers):
  missing = [layer for layer in layers if layer not in OFFERS]
  return pytest.mark.skipif(bool(missing), reason=f"this kernel offers no "
                            f"{', '.join(missing)}")


def _held_by(*layers):
  """The configs an escape is tried with: the audit hook's, and the bare
  kernel's where one of `layers` is there to hold it."""
  return [FAST] + ([BARE] if OFFERS & set(layers) else [])


@pytest.fixture(autouse=True)
def workdirs(tmp_path, monkeypatch):
  """Sandboxes make their working directories here; each test checks that
  none is left, whatever the code did."""
  parent = tmp_path / "sandboxes"
  parent.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(parent))
  yield parent
  assert os.listdir(parent) == []


def _children() -> set[int]:
  pids = set()
  for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/children") as f:
      pids.update(int(p) for p in f.read().split())
  return pids


def _python(code, config=FAST):
  return ToolRegistry([PythonTool(config)]).call("python", {"code": code})


# ------------------------------------------------------------------ layers

def test_the_sandbox_uses_every_layer_this_kernel_offers():
  assert OFFERS | {"rlimits", "nocaps", "audit"} <= set(LAYERS), (
      OFFERS, LAYERS)
  assert "audit" not in sandbox.containment(BARE)
  status = run_python("print(open('/proc/self/status').read())", BARE)
  assert "CapEff:\t0000000000000000" in status.stdout.splitlines()


# ------------------------------------------------------------ ordinary code

def test_runs_from_several_threads_keep_their_own_output():
  codes = [f"print({i} * 11)" for i in range(4)]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(lambda code: run_python(code, FAST), codes))
  assert [r.stdout for r in results] == [f"{i * 11}\n" for i in range(4)]


def test_ordinary_code_prints_imports_and_writes_files_inside(workdirs):
  code = _lines(
      "import collections, fractions, json, math, os, tempfile",
      "print(math.factorial(30), fractions.Fraction(1, 3) * 3)",
      "with open('notes/out.txt', 'w') as f: f.write('kept')",
      "with tempfile.NamedTemporaryFile('w', delete=False) as t:",
      "  t.write('x')",
      "print(open('notes/out.txt').read(), open('data.csv').read().strip())",
      "print(json.dumps(sorted(os.listdir('notes'))))",
      "print(os.getcwd())")
  result = run_python(code, FAST, files={"data.csv": "a,b\n1,2\n",
                                         "notes/in.txt": b"given"})
  assert result.ok, result.summary
  *lines, cwd = result.stdout.splitlines()
  assert lines == ["265252859812191058636308480000000 1", "kept a,b", "1,2",
                   '["in.txt", "out.txt"]']
  assert os.path.dirname(cwd) == str(workdirs)
  assert not os.path.exists(cwd)
  assert result.summary == "exit status 0" and result.limit is None
  assert _python("print(sum(range(10)))") == ("45\n", False)


def test_a_raising_program_gives_its_traceback_as_a_tool_error():
  content, error = _python(_lines("print('before')", "1 / 0"))
  assert error
  first, *rest = content.splitlines()
  assert first == "error: exit status 1: ZeroDivisionError: division by zero"
  assert "before" in rest and 'File "<code>", line 2' in content


# ----------------------------------------------------------------- escapes

def test_network_is_refused_and_no_connection_arrives():
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = _lines("import socket",
                  f"socket.create_connection(('127.0.0.1', {port}), 1)")
    for config in _held_by("seccomp", "landlock"):
      content, error = _python(code, config)
      assert error and "PermissionError" in content.splitlines()[0]
      if config.audit_hook:
        assert "network access is not allowed" in content.splitlines()[0]
    time.sleep(0.05)
    with pytest.raises(BlockingIOError):
      listener.accept()


@_needs("netns")
def test_the_code_has_a_network_namespace_of_its_own():
  result = run_python("import os; print(os.readlink('/proc/self/ns/net'))",
                      BARE)
  assert result.ok
  assert result.stdout.strip() != os.readlink("/proc/self/ns/net")


def test_writing_outside_the_working_directory_is_refused(tmp_path):
  target = tmp_path / "escaped.txt"
  attempts = [f"open({str(target)!r}, 'w').write('x')",
              _lines("import os", f"os.symlink({str(tmp_path)!r}, 'out')",
                     "open('out/escaped.txt', 'w').write('x')"),
              _lines("import os", f"os.close(os.open({str(target)!r}, "
                     "os.O_WRONLY | os.O_CREAT))")]
  for config in _held_by("landlock"):
    for code in attempts:
      content, error = _python(code, config)
      assert error and "PermissionError" in content.splitlines()[0], content
      assert not target.exists()
  content, _ = _python(attempts[0])
  assert "writing outside the working directory" in content


def test_a_fork_bomb_is_contained_and_reported():
  before = _children()
  bomb = _lines("import os", "while True:", "  os.fork()")
  for config in _held_by("seccomp"):
    said = ("starting processes is not allowed" if config.audit_hook
            else "Operation not permitted")
    content, error = _python(bomb, config)
    assert error and said in content.splitlines()[0], content
  content, error = _python("import os; os.system(':(){ :|:& };:')")
  assert error and "starting processes" in content
  assert _children() == before


@_needs("seccomp")
def test_without_the_hook_the_kernel_refuses_processes_and_signals():
  for code in ("import subprocess; subprocess.run(['true'])",
               "import os; os.execv('/bin/true', ['true'])",
               f"import os; os.kill({os.getpid()}, 0)",
               "import resource; resource.setrlimit(resource.RLIMIT_CPU, "
               "(1, 100))"):
    content, error = _python(code, BARE)
    assert error, code
    assert ("Operation not permitted" in content
            or "not allowed to raise" in content), content
  # Threads still work: the filter refuses clone only without CLONE_THREAD.
  threads = _lines("import threading", "t = threading.Thread(target=print, "
                   "args=('in a thread',))", "t.start(); t.join()")
  assert _python(threads, BARE) == ("in a thread\n", False)


def test_an_infinite_loop_hits_the_cpu_limit_then_the_wall_clock():
  content, error = _python("while True: pass", SPIN)
  assert error
  assert content.splitlines()[0] == ("error: CPU time limit (1 s) reached; "
                                     "the run was stopped")
  sleeper = _lines("import time", "while True: time.sleep(0.05)")
  result = run_python(sleeper, SandboxConfig(wall_seconds=0.5))
  assert result.limit == "wall" and result.signal == 9
  assert 0.5 <= result.wall_s < 5 and result.cpu_s < 0.5
  assert result.summary == ("wall-clock limit (0.5 s) reached; the run was "
                            "stopped")


def test_a_program_that_ignores_sigxcpu_is_still_stopped():
  code = _lines("import signal", "signal.signal(signal.SIGXCPU, "
                "signal.SIG_IGN)", "while True: pass")
  result = run_python(code, SPIN)
  # Killed at the hard limit, a second of CPU later.
  assert result.limit == "cpu" and result.signal == 9
  assert result.cpu_s > 1.5


def test_huge_output_is_bounded_and_reported():
  result = run_python("while True: print('x' * 1000)", FAST)
  assert result.limit == "output"
  assert 0 < len(result.stdout) <= FAST.max_output_bytes
  content, error = _python("import sys; sys.stderr.write('e' * 10**7)")
  assert error and content.startswith("error: output limit (8 KiB) reached")
  assert len(content) <= 4200


def test_a_memory_hog_hits_the_memory_limit():
  for code in ("x = bytearray(10**10)",
               _lines("chunks = []", "while True:",
                      "  chunks.append(bytearray(10**6))")):
    content, error = _python(code)
    assert error
    assert content.splitlines()[0] == ("error: memory limit (256 MiB) "
                                       "reached; the run was stopped")


def test_file_size_and_disk_limits():
  config = SandboxConfig(file_bytes=1 << 20, disk_bytes=4 << 20)
  one_big = _lines("with open('big', 'wb') as f:",
                   "  for _ in range(4): f.write(bytes(1 << 19))")
  assert run_python(one_big, config).limit == "file_size"
  content, _ = _python(one_big, config)
  assert content.startswith("error: file size limit (1 MiB) reached")
  if "tmpfs" in OFFERS:
    many = _lines("for i in range(8):",
                  "  open(f'f{i}', 'wb').write(bytes((1 << 20) - 1))")
    assert run_python(many, config).limit == "disk"


def test_the_working_directory_goes_even_when_the_run_is_killed(workdirs):
  code = _lines("import os", "print(os.getcwd(), flush=True)",
                "open('left.txt', 'w').write('x')", "while True: pass")
  result = run_python(code, SandboxConfig(wall_seconds=0.3))
  assert result.limit == "wall"
  cwd = result.stdout.strip()
  assert os.path.dirname(cwd) == str(workdirs) and not os.path.exists(cwd)


# ------------------------------------------------------------------ config

@pytest.mark.parametrize("field,value", [
    ("cpu_seconds", 0), ("cpu_seconds", 1.5), ("wall_seconds", 0),
    ("wall_seconds", float("inf")), ("memory_bytes", 1 << 20),
    ("max_output_bytes", True), ("max_open_files", 3), ("audit_hook", 1)])
def test_bad_config_is_a_one_line_error_naming_the_field(field, value):
  with pytest.raises(ConfigError) as err:
    SandboxConfig(**{field: value})
  assert str(err.value).startswith(f"SandboxConfig.{field}:")
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("files", [{"../x": "a"}, {"/etc/x": "a"},
                                   {"a//b": "a"}, {"x": 3},
                                   {"a": "x", "a/b/c": "y"}])
def test_bad_files_are_refused(files):
  with pytest.raises(ConfigError):
    run_python("pass", FAST, files)
