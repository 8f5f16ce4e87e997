"""Settings for the whole test session.

One persistent XLA compilation cache for the session's processes: pytest's
workers and every subprocess the tests start (the CLI runs, the multi-host
and interrupt runs, the sharded checks) inherit JAX_COMPILATION_CACHE_DIR,
so a program compiled once (the tiny preset's train step, say) loads from
the cache in the next process instead of compiling again. The cache is keyed
by the program, the jax version and the flags, so it never hands a test
another program; tests that need their own cache set the variable
themselves. An explicit JAX_COMPILATION_CACHE_DIR in the environment wins.
"""

import os
import tempfile

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"m2jax-test-xla-cache-{os.getuid()}"))
