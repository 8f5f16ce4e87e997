"""Running untrusted Python (code a model wrote) in a confined subprocess.

  config = SandboxConfig(cpu_seconds=2, wall_seconds=5)
  result = run_python("print(sum(range(10)))", config)
  result.stdout, result.summary, result.limit, result.layers

The code runs in `python -I -B` (no environment, user site or bytecode
writes) in a fresh working directory that is removed afterwards in every
case, its own session (a wall-clock timeout kills the process group), with
stdout and stderr read to a byte bound (the run is killed past it, never
buffered without bound). The child confines itself before the code starts,
in layers; `SandboxResult.layers` says which held for a run:

  userns    a user namespace of its own: no capability outside it, so the
            limits below cannot be raised again
  netns     a network namespace of its own with no interface up: nothing
            on this host or beyond can be reached, loopback included
  tmpfs     (a mount namespace) the working directory is a fresh tmpfs of
            `disk_bytes`, so the code cannot fill a disk (without it only
            RLIMIT_FSIZE bounds each file); it vanishes with the process
  rlimits   RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE, RLIMIT_NOFILE,
            RLIMIT_NPROC (threads, counted in the user namespace; the
            kernel ignores it for uid 0, where threads are bounded by
            RLIMIT_AS alone, each stack being address space), no core files
  nocaps    every capability dropped (root's too, without a user namespace)
  landlock  the kernel refuses writes, file creation and removal outside
            the working directory (reads stay allowed: the standard library
            and site-packages import), TCP bind and connect, signals to
            processes outside the sandbox, ptrace of them
  seccomp   a syscall filter: no new processes (fork, vfork, clone without
            CLONE_THREAD; clone3 answers ENOSYS so threads fall back to
            clone), no exec, no sockets, no ptrace, no io_uring, no bpf, no
            raising limits, signals only to itself; x86_64 and aarch64
  audit     a sys.addaudithook preamble that turns what the layers above
            refuse into a PermissionError saying so ('sandbox: network
            access is not allowed'), and refuses ctypes' library loading,
            symbol lookup and raw memory access

What is a security boundary: the namespaces, nocaps, landlock and seccomp
are enforced by the kernel and hold whatever the code does inside the
process (ctypes included, which cannot undo them); so do the rlimits, which
no capability is left to raise. The audit hook is NOT a boundary: CPython's
own docs say a hook can be bypassed by code that runs in the process; it
is there for clear error messages and as the only network / write /
process guard where the kernel layers are missing. On this project's
containers (Linux 6.18, landlock ABI 7) all layers hold, run as root or as
uid 1000; elsewhere a layer the kernel refuses is left out and the result's
`layers` says so. Not covered by any layer: reading what the user running
m2jax may read (the code can read /etc or a checkpoint directory), and the
CPU and memory the code uses up to its limits.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from m2jax.config import ConfigError

# Exit statuses the child uses to say which limit ended the code, when the
# code raised rather than being killed (the code could exit with them too;
# it would only misreport itself).
_EXIT_SETUP = 120     # the sandbox could not be set up
_EXIT_MEMORY = 121    # MemoryError (RLIMIT_AS)
_EXIT_FILE = 122      # OSError EFBIG (RLIMIT_FSIZE)
_EXIT_DISK = 123      # OSError ENOSPC / EDQUOT (the tmpfs is full)
_MIB = 1 << 20
LIMITS = ("cpu", "wall", "memory", "file_size", "disk", "output")


def _is_int(value, low: int) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)
          and value >= low)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits of one sandboxed run."""
  cpu_seconds: int = 10              # RLIMIT_CPU, whole seconds
  wall_seconds: float = 20.0         # then the process group is killed
  memory_bytes: int = 1024 * _MIB    # RLIMIT_AS (address space)
  file_bytes: int = 16 * _MIB        # RLIMIT_FSIZE: the largest file
  disk_bytes: int = 64 * _MIB        # the tmpfs working directory's size
  max_output_bytes: int = 64 * 1024  # stdout + stderr; killed past it
  max_open_files: int = 64           # RLIMIT_NOFILE
  max_threads: int = 16              # RLIMIT_NPROC (see the module doc)
  # Python-level checks with clear messages; not a boundary (module doc).
  # Turned off only to show the kernel layers hold alone.
  audit_hook: bool = True

  def __post_init__(self):
    lows = {"cpu_seconds": 1, "memory_bytes": 64 * _MIB, "file_bytes": 1,
            "disk_bytes": _MIB, "max_output_bytes": 1, "max_open_files": 16,
            "max_threads": 1}
    for name, low in lows.items():
      if not _is_int(getattr(self, name), low):
        raise ConfigError(f"SandboxConfig.{name}: must be an integer >= "
                          f"{low} (got {getattr(self, name)!r})")
    wall = self.wall_seconds
    if (isinstance(wall, bool) or not isinstance(wall, (int, float))
        or not 0 < wall < float("inf")):
      raise ConfigError(f"SandboxConfig.wall_seconds: must be a number > 0 "
                        f"(got {wall!r})")
    if not isinstance(self.audit_hook, bool):
      raise ConfigError(f"SandboxConfig.audit_hook: must be True or False "
                        f"(got {self.audit_hook!r})")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What a run gave. `limit` names the limit that ended it (one of LIMITS)
  or is None; `summary` says in one line how it ended."""
  stdout: str
  stderr: str
  exit_code: int | None       # None when killed by a signal
  signal: int | None          # the signal that killed it
  limit: str | None
  summary: str
  wall_s: float
  cpu_s: float
  layers: tuple[str, ...]     # the containment that held (module doc)

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and self.limit is None


def run_python(code: str, config: SandboxConfig = SandboxConfig(),
               files: Mapping[str, str | bytes] | None = None
               ) -> SandboxResult:
  """Runs `code` in a fresh sandbox whose working directory starts with
  `files` (relative path -> content). Never raises for what the code does;
  raises UserError (ConfigError) for a bad `code` or `files`."""
  if not isinstance(code, str):
    raise ConfigError(f"run_python: code must be a string (got "
                      f"{type(code).__name__})")
  request = {"code": code, "files": _checked_files(files, config),
             "cpu": config.cpu_seconds, "memory": config.memory_bytes,
             "file": config.file_bytes, "disk": config.disk_bytes,
             "nofile": config.max_open_files, "nproc": config.max_threads,
             "audit": config.audit_hook, "exit_setup": _EXIT_SETUP,
             "exit_memory": _EXIT_MEMORY, "exit_file": _EXIT_FILE,
             "exit_disk": _EXIT_DISK}
  workdir = tempfile.mkdtemp(prefix="m2jax-sandbox-")
  try:
    return _run(request, workdir, config)
  finally:
    _remove(workdir)


def _checked_files(files, config: SandboxConfig) -> dict[str, bytes]:
  out, total = {}, 0
  for name, content in (files or {}).items():
    parts = name.split("/") if isinstance(name, str) else [""]
    if (not isinstance(name, str) or name.startswith("/")
        or any(p in ("", ".", "..") for p in parts)):
      raise ConfigError(f"run_python: file name {name!r} must be a relative "
                        "path without '.', '..' or empty parts")
    if isinstance(content, str):
      content = content.encode()
    if not isinstance(content, bytes):
      raise ConfigError(f"run_python: file {name!r} must be str or bytes")
    out[name] = content
    total += len(content)
  folders = [name.rsplit("/", 1)[0] + "/" for name in out if "/" in name]
  for name in out:
    if any(folder.startswith(name + "/") for folder in folders):
      raise ConfigError(f"run_python: {name!r} is a file and a directory")
  # The files must leave room in the tmpfs for the code's own writes.
  if total > config.disk_bytes // 2:
    raise ConfigError(f"run_python: the files hold {total} bytes, more than "
                      f"half of SandboxConfig.disk_bytes={config.disk_bytes}")
  return out


def _run(request: dict, workdir: str, config: SandboxConfig
         ) -> SandboxResult:
  status_r, status_w = os.pipe()
  request["workdir"], request["status_fd"] = workdir, status_w
  env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir,
         "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
         "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
  start = time.monotonic()
  try:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-B", "-c", _child_source()], cwd=workdir,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, pass_fds=(status_w,),
        start_new_session=True)
  except BaseException:
    os.close(status_r)
    raise
  finally:
    os.close(status_w)
  out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
  streams = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
  limit = None
  try:
    limit = _pump(proc, marshal.dumps(request), streams, status_r,
                  start + config.wall_seconds, config.max_output_bytes)
  finally:
    # The leader is not reaped yet (a zombie at most), so its process group
    # id cannot have been reused: this kills the code and anything it left.
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for f in (proc.stdin, proc.stdout, proc.stderr):
      f.close()
    os.close(status_r)
  wall_s = time.monotonic() - start
  cpu_s = usage.ru_utime + usage.ru_stime
  stdout = streams[out_fd].decode(errors="replace")
  stderr = streams[err_fd].decode(errors="replace")
  try:
    layers = tuple(json.loads(streams[status_r].decode()))
  except ValueError:
    layers = ()
  code = proc.returncode
  sig = -code if code < 0 else None
  if limit is None:
    # A SIGKILL we did not send, after the CPU limit: the hard limit.
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL
                                 and cpu_s >= config.cpu_seconds):
      limit = "cpu"
    else:
      limit = {_EXIT_MEMORY: "memory", _EXIT_FILE: "file_size",
               _EXIT_DISK: "disk"}.get(code)
  return SandboxResult(
      stdout=stdout, stderr=stderr, exit_code=None if sig else code,
      signal=sig, limit=limit,
      summary=_summary(limit, code, stderr, config),
      wall_s=wall_s, cpu_s=cpu_s, layers=layers)


def _pump(proc, payload: bytes, streams: dict, status_fd: int,
          deadline: float, max_output: int) -> str | None:
  """Feeds the request to the child and reads its output until it exits
  and its pipes close; returns 'wall' or 'output' when it must be killed."""
  sel = selectors.DefaultSelector()
  pidfd = os.pidfd_open(proc.pid)
  try:
    stdin = proc.stdin.fileno()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_WRITE)
    for fd in streams:
      sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    sent, output, exited = 0, 0, False
    while len(sel.get_map()) > 0:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return None if exited else "wall"
      for key, _ in sel.select(remaining):
        fd = key.fd
        if fd == stdin:
          try:
            sent += os.write(fd, payload[sent:sent + 65536])
          except BrokenPipeError:
            sent = len(payload)
          if sent == len(payload):
            sel.unregister(fd)
            proc.stdin.close()
        elif fd == pidfd:
          # Exited: what is still in the pipes is read below; a pipe some
          # leftover holds open must not keep us past a short grace.
          sel.unregister(fd)
          exited = True
          deadline = min(deadline, time.monotonic() + 0.5)
        else:
          data = os.read(fd, 65536)
          if not data:
            sel.unregister(fd)
            continue
          if fd != status_fd:
            output += len(data)
            room = max_output - (output - len(data))
            streams[fd] += data[:max(room, 0)]
            if output > max_output:
              return "output"
          elif len(streams[fd]) < 4096:
            streams[fd] += data
    return None
  finally:
    sel.close()
    os.close(pidfd)


def _summary(limit, code: int, stderr: str, config: SandboxConfig) -> str:
  said = {"cpu": f"CPU time limit ({config.cpu_seconds} s) reached",
          "wall": f"wall-clock limit ({config.wall_seconds:g} s) reached",
          "memory": f"memory limit ({_size(config.memory_bytes)}) reached",
          "file_size": f"file size limit ({_size(config.file_bytes)}) "
                       "reached",
          "disk": f"disk limit ({_size(config.disk_bytes)}) reached",
          "output": f"output limit ({_size(config.max_output_bytes)}) "
                    "reached"}
  if limit is not None:
    return said[limit] + "; the run was stopped"
  if code == _EXIT_SETUP:
    return "the sandbox could not be set up: " + _last_line(stderr)
  if code < 0:
    return f"killed by signal {signal.Signals(-code).name}"
  if code == 0:
    return "exit status 0"
  last = _last_line(stderr)
  return f"exit status {code}" + (f": {last}" if last else "")


def _last_line(text: str) -> str:
  lines = [line for line in text.splitlines() if line.strip()]
  return lines[-1].strip()[:300] if lines else ""


def _size(n: int) -> str:
  for unit, scale in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1 << 10)):
    if n >= scale and n % scale == 0:
      return f"{n // scale} {unit}"
  return f"{n} bytes"


def _remove(workdir: str) -> None:
  """Removes the working directory whatever the code did to its modes."""
  def unlock(function, path, _):
    del function
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
      os.chmod(path, 0o700)
      shutil.rmtree(path, onexc=unlock)
    else:
      os.unlink(path)
  shutil.rmtree(workdir, onexc=unlock)


@functools.cache
def containment(config: SandboxConfig = SandboxConfig()) -> tuple[str, ...]:
  """The layers (module doc) that hold on this machine."""
  return run_python("", config).layers


# --- The child ----------------------------------------------------------------
# These functions run inside the sandboxed python: their source is sent as
# its -c program (the child imports nothing of m2jax), so they use only the
# standard library and each other.

@functools.cache
def _child_source() -> str:
  functions = (_child_main, _child_confine, _child_landlock, _child_seccomp,
               _child_audit, _child_run)
  return ("\n".join(inspect.getsource(f) for f in functions)
          + "\n_child_main()\n")


def _child_main():
  import json
  import marshal
  import os
  import sys
  request = marshal.loads(sys.stdin.buffer.read())
  try:
    layers = _child_confine(request)
  except Exception as e:  # pylint: disable=broad-except
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(request["exit_setup"])
  if request["audit"]:
    _child_audit(os.getcwd())
    layers.append("audit")
  os.write(request["status_fd"], json.dumps(layers).encode())
  os.close(request["status_fd"])
  _child_run(request)


def _child_confine(request):
  """Namespaces, the tmpfs, the input files, rlimits, landlock, seccomp;
  returns the layers that held."""
  import ctypes
  import os
  import resource
  layers = []
  workdir = request["workdir"]
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                         ctypes.c_ulong, ctypes.c_char_p]
  uid, gid = os.getuid(), os.getgid()
  try:
    os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET | os.CLONE_NEWNS)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
    layers += ["userns", "netns"]
    mount_ns = True
  except OSError:
    try:  # root without user namespaces still has these
      os.unshare(os.CLONE_NEWNET | os.CLONE_NEWNS)
      layers.append("netns")
      mount_ns = True
    except OSError:
      mount_ns = False
  if mount_ns:
    ms_nosuid, ms_nodev, ms_noexec, ms_rec, ms_private = 2, 4, 8, 16384, 262144
    # Private first, so the tmpfs never shows in the host's namespace.
    libc.mount(None, b"/", None, ms_rec | ms_private, None)
    options = f"size={request['disk']},nr_inodes=4096,mode=0700".encode()
    if libc.mount(b"m2jax-sandbox", workdir.encode(), b"tmpfs",
                  ms_nosuid | ms_nodev | ms_noexec, options) == 0:
      layers.append("tmpfs")
    os.chdir(workdir)  # onto the tmpfs (the old cwd is beneath it)
  for name, content in request["files"].items():
    path = os.path.join(workdir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content)
  for which, value in ((resource.RLIMIT_CPU, request["cpu"]),
                       (resource.RLIMIT_AS, request["memory"]),
                       (resource.RLIMIT_FSIZE, request["file"]),
                       (resource.RLIMIT_NOFILE, request["nofile"]),
                       (resource.RLIMIT_NPROC, request["nproc"]),
                       (resource.RLIMIT_CORE, 0)):
    # CPU: SIGXCPU at the limit, SIGKILL a second later if it is caught.
    hard = value + 1 if which == resource.RLIMIT_CPU else value
    resource.setrlimit(which, (value, hard))
  layers.append("rlimits")
  # Every capability goes, those of root outside a user namespace included.
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)   # _LINUX_CAPABILITY_VERSION_3
  if libc.capset(header, (ctypes.c_uint32 * 6)()) == 0:
    layers.append("nocaps")
  if _child_landlock(workdir):
    layers.append("landlock")
  if _child_seccomp(os.getpid()):
    layers.append("seccomp")
  return layers


def _child_landlock(workdir):
  """Writes only beneath `workdir` (and to /dev/null), no TCP, signals
  and ptrace only inside; returns the landlock ABI, 0 if unavailable."""
  import ctypes
  import os
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

  def syscall(*args):   # variadic: every argument passed as a full long
    return libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a
                          for a in args))

  create, add_rule, restrict = 444, 445, 446   # the same on every arch
  abi = syscall(create, None, 0, 1)   # LANDLOCK_CREATE_RULESET_VERSION
  if abi < 1:
    return 0
  write_file, truncate = 1 << 1, 1 << 14
  # remove dir/file, make char/dir/reg/sock/fifo/block/sym, (refer, truncate)
  writes = write_file | sum(1 << b for b in range(4, 13))
  writes |= (1 << 13 if abi >= 2 else 0) | (truncate if abi >= 3 else 0)

  class Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]

  class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

  ruleset = Ruleset(writes, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
  size = 8 if abi < 4 else 16 if abi < 6 else 24
  ruleset_fd = syscall(create, ctypes.byref(ruleset), size, 0)
  if ruleset_fd < 0:
    return 0
  try:
    for path, allowed in ((workdir, writes),
                          ("/dev/null", writes & (write_file | truncate))):
      fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      rule = PathBeneath(allowed, fd)
      ok = syscall(add_rule, ruleset_fd, 1, ctypes.byref(rule), 0)
      os.close(fd)
      if ok != 0:
        return 0
    if libc.prctl(38, 1, 0, 0, 0) != 0:   # PR_SET_NO_NEW_PRIVS
      return 0
    if syscall(restrict, ruleset_fd, 0) != 0:
      return 0
  finally:
    os.close(ruleset_fd)
  return abi


def _child_seccomp(pid):
  """Installs the syscall filter of the module doc; False if this arch or
  kernel has none."""
  import ctypes
  import errno
  import os
  import struct
  machine = os.uname().machine
  if machine == "x86_64":
    arch = 0xC000003E
    nr = {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
          "socket": 41, "socketpair": 53, "ptrace": 101, "vm_readv": 310,
          "vm_writev": 311, "io_uring_setup": 425, "setrlimit": 160,
          "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248,
          "request_key": 249, "userfaultfd": 323, "pidfd_send_signal": 424,
          "tkill": 200, "unshare": 272, "setns": 308, "mount": 165,
          "prlimit64": 302, "kill": 62, "tgkill": 234, "sigqueue": 129,
          "tgsigqueue": 297, "clone": 56, "clone3": 435}
  elif machine == "aarch64":
    arch = 0xC00000B7
    nr = {"execve": 221, "execveat": 281, "socket": 198, "socketpair": 199,
          "ptrace": 117, "vm_readv": 270, "vm_writev": 271,
          "io_uring_setup": 425, "setrlimit": 164, "bpf": 280,
          "perf_event_open": 241, "keyctl": 219, "add_key": 217,
          "request_key": 218, "userfaultfd": 282, "pidfd_send_signal": 424,
          "tkill": 130, "unshare": 97, "setns": 268, "mount": 40,
          "prlimit64": 261, "kill": 129, "tgkill": 131, "sigqueue": 138,
          "tgsigqueue": 240, "clone": 220, "clone3": 435}
  else:
    return False
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, kill = 0x7FFF0000, 0x80000000
  eperm, enosys = 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
  arg0, arg2_lo, arg2_hi = 16, 32, 36           # offsets in seccomp_data
  me, group = pid & 0xFFFFFFFF, -pid & 0xFFFFFFFF
  # (code, jump-if-true, jump-if-false, k); jumps name labels below.
  prog = [(ld, 0, 0, 4), (jeq, 0, "kill", arch), (ld, 0, 0, 0)]
  if machine == "x86_64":   # the x32 ABI's numbers
    prog.append((jge, "eperm", 0, 0x40000000))
  checked = {"clone": "clone", "clone3": "enosys", "kill": "kill_",
             "tgkill": "own", "sigqueue": "own", "tgsigqueue": "own",
             "prlimit64": "prlimit"}
  for name, number in nr.items():
    prog.append((jeq, checked.get(name, "eperm"), 0, number))
  prog += [(ret, 0, 0, allow),
           "clone", (ld, 0, 0, arg0), (jset, "allow", "eperm", 0x10000),
           "kill_", (ld, 0, 0, arg0), (jeq, "allow", 0, 0),
           (jeq, "allow", 0, group), (jeq, "allow", "eperm", me),
           "own", (ld, 0, 0, arg0), (jeq, "allow", "eperm", me),
           "prlimit", (ld, 0, 0, arg2_lo), (jeq, 0, "eperm", 0),
           (ld, 0, 0, arg2_hi), (jeq, "allow", "eperm", 0),
           "allow", (ret, 0, 0, allow), "eperm", (ret, 0, 0, eperm),
           "enosys", (ret, 0, 0, enosys), "kill", (ret, 0, 0, kill)]
  labels, code = {}, []
  for item in prog:
    if isinstance(item, str):
      labels[item] = len(code)
    else:
      code.append(item)
  def offset(target, pc):
    return target if isinstance(target, int) else labels[target] - pc - 1
  blob = b"".join(struct.pack("HBBI", op, offset(jt, pc), offset(jf, pc), k)
                  for pc, (op, jt, jf, k) in enumerate(code))
  buffer = ctypes.create_string_buffer(blob)

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  program = Program(len(code), ctypes.addressof(buffer))
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
  if libc.prctl(38, 1, 0, 0, 0) != 0:           # PR_SET_NO_NEW_PRIVS
    return False
  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
  return libc.prctl(22, 2, ctypes.addressof(program), 0, 0) == 0


def _child_audit(workdir):
  """The audit-hook preamble (not a boundary: see the module doc)."""
  import os
  import sys
  root = os.path.realpath(workdir)
  writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  spawn = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
           "os.system", "os.startfile", "subprocess.Popen", "pty.spawn"}
  path_events = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1,
                 "os.rmdir": 1, "os.chmod": 1, "os.chown": 1, "os.link": 2,
                 "os.symlink": 2, "os.truncate": 1, "os.utime": 1,
                 "os.mkfifo": 1, "os.mknod": 1, "os.chflags": 1,
                 "os.lchown": 1, "os.lchmod": 1, "os.lchflags": 1,
                 "shutil.chown": 1, "sqlite3.connect": 1}
  inside_paths = (root, os.devnull)
  realpath, fspath, join = os.path.realpath, os.fspath, os.path.join
  getcwd, getpid = os.getcwd, os.getpid

  def inside(path):
    if isinstance(path, int):
      return True   # an fd already open
    path = fspath(path)
    if isinstance(path, bytes):
      path = path.decode(errors="surrogateescape")
    if path == ":memory:":
      return True
    full = realpath(join(getcwd(), path))
    return full in inside_paths or full.startswith(root + "/")

  def refuse(what):
    raise PermissionError(f"sandbox: {what} is not allowed")

  def hook(event, args):
    if event == "open":
      path, _, flags = args
      if flags & writes and not inside(path):
        refuse(f"writing outside the working directory ({path!r})")
    elif event in path_events:
      for path in args[:path_events[event]]:
        if not inside(path):
          refuse(f"{event} outside the working directory ({path!r})")
    elif event.startswith("socket."):
      refuse("network access")
    elif event in spawn:
      refuse("starting processes")
    elif event.startswith("ctypes.") and args[:1] != (None,):
      # Importing ctypes opens the process itself (numpy does); loading a
      # library, looking up a symbol or touching an address is refused.
      refuse("ctypes")
    elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
      if event != "signal.pthread_kill" and args[0] not in (0, getpid()):
        refuse("signalling other processes")
    elif event == "resource.setrlimit" or event == "resource.prlimit":
      refuse("changing limits")

  sys.addaudithook(hook)


def _child_run(request):
  import builtins
  import errno
  import linecache
  import os
  import sys
  import traceback
  code = request["code"]
  linecache.cache["<code>"] = (len(code), None, code.splitlines(True),
                               "<code>")
  sys.argv = ["<code>"]
  sys.path.insert(0, os.getcwd())
  namespace = {"__name__": "__main__", "__builtins__": builtins}
  try:
    exec(compile(code, "<code>", "exec"), namespace)
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    namespace.clear()   # room to print a MemoryError's traceback
    report = traceback.TracebackException.from_exception(e)
    # Frames of this preamble (the -c program, '<string>') are not the
    # code's: drop them, the audit hook's included.
    report.stack = traceback.StackSummary.from_list(
        [f for f in report.stack if f.filename != "<string>"])
    print("".join(report.format()), end="", file=sys.stderr)
    status = 1
    if isinstance(e, MemoryError):
      status = request["exit_memory"]
    elif isinstance(e, OSError) and e.errno == errno.EFBIG:
      status = request["exit_file"]
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      status = request["exit_disk"]
    sys.exit(status)
