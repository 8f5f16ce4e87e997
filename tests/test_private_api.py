"""No library or script module reaches into JAX's private modules.

`jax._src` moves between releases without notice. What the kernels needed
from it has public names in jax 0.11.2 (the Mosaic tree kernels no longer
test for ref types; the Triton cross-lowering tests name their GPU with
`jax.sharding.AbstractDevice`), so this test keeps it that way and names
every offending line.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "m2jax", "experiments", "benchmarks")


def test_no_module_imports_private_jax():
  found = []
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if "jax._src" in code:
          found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  assert not found, ("private JAX names (jax._src) in: " + "; ".join(found)
                     + " -- use the public API")
