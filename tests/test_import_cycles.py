"""No import cycles between the modules of the repository.

Counts every import statement, function-level (lazy) ones included, the way
import-linter does: `from a.b import c` imports the module a.b.c when there
is one, else a.b. A cycle means two modules that cannot be read, tested or
moved one without the other.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("m2jax", "kernels", "experiments", "benchmarks")
# Cycles that issue #13 removes in another change (train-state shardings
# move next to the train state); delete an entry once its cycle is gone.
KNOWN = {frozenset({"m2jax.sharding", "m2jax.train.step"})}


def _modules() -> dict[str, str]:
  """{dotted module name: path} of every module in PACKAGES."""
  out = {}
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(directory, f)
          name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          out[name.removesuffix(".__init__")] = path
  return out


def _imports(name: str, path: str, modules) -> set[str]:
  """The modules of `modules` that module `name` imports anywhere in it."""
  found = set()
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: resolve against this module's package
        parts = name.split(".")
        if not path.endswith("__init__.py"):
          parts = parts[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                 else base for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in modules:   # a name inside a module
        target = target.rpartition(".")[0]
      if target and target != name:
        found.add(target)
  return found


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
  """The strongly connected components of more than one module."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(frozenset(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_sees_lazy_imports():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [frozenset("abc")]
  modules = _modules()
  # A function-level import counts (m2jax.data.pipeline imports bpe lazily).
  assert "m2jax.data.bpe" in _imports(
      "m2jax.data.pipeline", modules["m2jax.data.pipeline"], modules)


def test_no_import_cycles():
  modules = _modules()
  graph = {m: _imports(m, p, modules) for m, p in modules.items()}
  new = [sorted(c) for c in _cycles(graph) if c not in KNOWN]
  assert not new, f"import cycles: {new}"
