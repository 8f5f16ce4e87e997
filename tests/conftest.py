"""Settings for the whole test session.

One persistent XLA compilation cache for the session's processes: pytest's
workers and every subprocess the tests start (the CLI runs, the multi-host
and interrupt runs, the sharded checks) inherit JAX_COMPILATION_CACHE_DIR,
so a program compiled once (the tiny preset's train step, say) loads from
the cache in the next process instead of compiling again. The cache is keyed
by the program, the jax version and the flags, so it never hands a test
another program; tests that need their own cache set the variable
themselves. An explicit JAX_COMPILATION_CACHE_DIR in the environment wins.

Programs that compiled in 0.2 s or more are cached (JAX's default is 1 s):
with the flags below most compile in less than a second, and the processes
of a test (a run and its resume, the documented commands on one run) and
pytest's two workers compile many of the same ones.

XLA's CPU backend without its LLVM optimisations (FAST_COMPILE, added to
XLA_FLAGS for the session and the subprocesses that inherit it): compiling
dominates the suite and the arrays are tiny, so optimised machine code
costs far more time than it saves. The programs compute the same values:
the optimisation level changes how XLA's CPU code is generated, not the
operations it computes (the suite passes either way; the sharded, multi-host
and documented-command tests ran with these flags before they were
session-wide). Tests that give a subprocess an XLA_FLAGS of its own add
FAST_COMPILE to it.
"""

import os
import tempfile

FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true")

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"m2jax-test-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [f for f in [os.environ.get("XLA_FLAGS"), FAST_COMPILE] if f])
