"""Documents: the embedded stdlib corpus, user text/JSONL files, the split.

The default corpus needs no download: every *.py file of the running
interpreter's standard library (`sysconfig.get_paths()['stdlib']`), without
site-packages, __pycache__ and the build-specific _sysconfigdata*.py, with the
stdlib's own test suites unless `DataConfig.stdlib_tests` is off.

Two views of the same files (`DataConfig.documents`):
  files     one document per file (or JSONL line): `Documents`.
  packages  the long-context source: one document per package, i.e. per
            top-level entry of the corpus root (the stdlib's email/, asyncio/,
            json/, ...; a top-level file such as os.py is a package of its
            own). Its files, recursively and sorted by key, are concatenated,
            each preceded by the line "# <key>" (the repository-level
            concatenation that code models train long context on), so a 32K
            row holds one real 32K-token document: `Packages`.

Train/validation split: a document goes to validation when
`hash_fraction(key) < validation_fraction`. The key is the file's path
relative to the corpus root in POSIX form ("email/parser.py") for whole-file
documents, the package's name ("email", "os.py") for packages, and the
stripped line itself for JSONL documents (so duplicates land in the same
split). When a config reads packages in any stage
(`DataConfig.reads_packages`), files are split by their package's key too, so
both views agree on what is validation. The hash is SHA-256, so the split is
the same on every machine and a file keeps its side across Python patch
versions as long as its path does.

`Documents` and `Packages` are random-access sequences of str (grain's
data-source protocol: `len` and `__getitem__`); files are read lazily, so the
index of a large corpus costs a few ints per document.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterator, Sequence

import numpy as np

from m2jax.config import ConfigError
from m2jax.data.config import PACKAGES, STDLIB, DataConfig
from m2jax.errors import MissingPathError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Directory names never descended into in the stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_GLOB_CHARS = frozenset("*?[")
# Precedes each file of a package document; {key} is its path relative to
# the corpus root ("email/mime/text.py"). A Python comment, as the stdlib is.
PACKAGE_FILE_HEADER = "# {key}\n"


def hash_fraction(key: str | bytes) -> float:
  """Maps a key to [0, 1) with SHA-256: stable across machines and runs."""
  data = key.encode("utf-8") if isinstance(key, str) else key
  return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


class Documents(Sequence[str]):
  """Lazily read documents: whole files, or byte ranges holding JSONL lines.

  Attributes:
    files: the distinct file paths.
    file_index: [N] int32, which file each document is in.
    offset: [N] int64, byte offset of a JSONL line, -1 for a whole file.
    length: [N] int64, byte length of the JSONL line (unused for whole files).
    text_field: the JSONL key holding the text.
  """

  def __init__(self, files: Sequence[str], file_index, offset, length,
               text_field: str = "text"):
    self.files = list(files)
    self.file_index = np.asarray(file_index, np.int32)
    self.offset = np.asarray(offset, np.int64)
    self.length = np.asarray(length, np.int64)
    self.text_field = text_field

  def __len__(self) -> int:
    return len(self.file_index)

  def __getitem__(self, index: int) -> str:
    path = self.files[self.file_index[index]]
    offset = int(self.offset[index])
    if offset < 0:
      return _read_text(path)
    with open(path, "rb") as f:
      f.seek(offset)
      line = f.read(int(self.length[index]))
    try:
      text = json.loads(line)[self.text_field]
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
          f"{path} (byte {offset}): not a JSON object with a string field "
          f"{self.text_field!r}: {e!r}") from e
    if not isinstance(text, str):
      raise ValueError(f"{path} (byte {offset}): field {self.text_field!r} "
                       f"is {type(text).__name__}, not a string")
    return text

  def __iter__(self) -> Iterator[str]:
    return (self[i] for i in range(len(self)))

  def take(self, n: int | None) -> Documents:
    """The first n documents (all when n is None)."""
    if n is None:
      return self
    return Documents(self.files, self.file_index[:n], self.offset[:n],
                     self.length[:n], self.text_field)


class Packages(Sequence[str]):
  """Lazily concatenated packages (see the module docstring).

  Attributes:
    names: [P] package keys, sorted ("asyncio", "os.py").
    keys: [F] the keys of the files, package by package, sorted in each.
    files: [F] the files' paths, in the same order.
    starts: [P + 1] int64, package p holds files starts[p]:starts[p + 1].
  """

  def __init__(self, names: Sequence[str], keys: Sequence[str],
               files: Sequence[str], starts):
    self.names = list(names)
    self.keys = list(keys)
    self.files = list(files)
    self.starts = np.asarray(starts, np.int64)

  def __len__(self) -> int:
    return len(self.names)

  def __getitem__(self, index: int) -> str:
    parts = []
    for f in range(self.starts[index], self.starts[index + 1]):
      text = _read_text(self.files[f])
      parts += [PACKAGE_FILE_HEADER.format(key=self.keys[f]), text]
      if not text.endswith("\n"):
        parts.append("\n")
    return "".join(parts)

  def __iter__(self) -> Iterator[str]:
    return (self[i] for i in range(len(self)))

  def take(self, n: int | None) -> Packages:
    """The first n packages (all when n is None)."""
    if n is None or n >= len(self):
      return self
    end = int(self.starts[n])
    return Packages(self.names[:n], self.keys[:end], self.files[:end],
                    self.starts[:n + 1])


def package_key(key: str) -> str:
  """The package of a file key: "email/mime/text.py" -> "email", "os.py"."""
  return key.split("/", 1)[0]


def stdlib_root() -> pathlib.Path:
  """The running interpreter's standard-library directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = True) -> list[tuple[str, str]]:
  """(key, path) of every non-empty stdlib *.py file, sorted by key."""
  root = stdlib_root()
  skip = _STDLIB_SKIP_DIRS | (frozenset() if include_tests
                              else _STDLIB_TEST_DIRS)
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip]
    for name in filenames:
      if not name.endswith(".py") or name.startswith("_sysconfigdata"):
        continue
      path = os.path.join(dirpath, name)
      if os.path.getsize(path) > 0:
        found.append((_key(path, root), path))
  return sorted(found)


def user_files(source: str) -> list[tuple[str, str]]:
  """(key, path) of a file, every file below a directory, or a glob's files.

  Keys are paths relative to the directory (or the glob's fixed prefix).
  Hidden files and directories (".name") are skipped; so are empty files.
  """
  if any(c in _GLOB_CHARS for c in source):
    root = _glob_root(source)
    paths = [p for p in glob.glob(source, recursive=True)
             if os.path.isfile(p)]
  elif os.path.isdir(source):
    root = pathlib.Path(source)
    paths = []
    for dirpath, dirnames, filenames in os.walk(source):
      dirnames[:] = [d for d in dirnames if not d.startswith(".")]
      paths += [os.path.join(dirpath, n) for n in filenames
                if not n.startswith(".")]
  elif os.path.isfile(source):
    root = pathlib.Path(source).parent
    paths = [source]
  else:
    raise MissingPathError(f"data source {source!r}: no such file, "
                           "directory or glob match")
  found = sorted((_key(p, root), p) for p in paths if os.path.getsize(p) > 0)
  if not found:
    raise MissingPathError(f"data source {source!r} holds no non-empty files")
  return found


def split_documents(config: DataConfig) -> dict[str, Documents | Packages]:
  """The "train" and "validation" documents that `config` describes, in the
  view `config.documents` names (files or packages)."""
  index = _index_packages if config.documents == PACKAGES else _index
  if config.validation_source is not None:
    train = index(config.source, config, None)
    validation = index(config.validation_source, config, None)
  else:
    train = index(config.source, config, False)
    validation = index(config.source, config, True)
  return {"train": train.take(config.max_documents),
          "validation": validation.take(config.max_documents)}


def check_splits(config: DataConfig) -> None:
  """Refuse a config whose train or validation split holds no document (a
  small corpus, a small validation_fraction), naming what to change; a
  training run calls it before any work."""
  splits = split_documents(config)
  if not len(splits["train"]):  # pylint: disable=g-explicit-length-test
    raise ConfigError(
        f"the train split of {config.source!r} has no documents: give more "
        "documents or a smaller DataConfig.validation_fraction "
        f"(--validation_fraction, now {config.validation_fraction})")
  if not len(splits["validation"]):  # pylint: disable=g-explicit-length-test
    if config.validation_source is not None:
      raise ConfigError(f"DataConfig.validation_source "
                        f"{config.validation_source!r} has no documents")
    raise ConfigError(
        f"the validation split of {config.source!r} has no documents: "
        f"DataConfig.validation_fraction={config.validation_fraction} of "
        f"its {len(splits['train'])} documents sends none there; raise it "
        "(--validation_fraction, at most 0.5) or give validation documents "
        "of their own (DataConfig.validation_source, --validation_data)")


def _keep(config: DataConfig, validation: bool | None):
  """key -> whether the document of `key` is on the `validation` side."""
  fraction = config.validation_fraction
  if validation is None:
    return lambda key: True
  return lambda key: (hash_fraction(key) < fraction) == validation


def _files(source: str, config: DataConfig) -> list[tuple[str, str]]:
  if source == STDLIB:
    return stdlib_files(config.stdlib_tests)
  return user_files(source)


def _index(source: str, config: DataConfig, validation: bool | None
           ) -> Documents:
  """Indexes `source` as files, keeping one side of the split (None: all)."""
  keep = _keep(config, validation)
  split_key = package_key if config.reads_packages else (lambda key: key)
  paths, file_index, offset, length = [], [], [], []
  for key, path in _files(source, config):
    if source != STDLIB and _is_jsonl(path, config.format):
      for line_offset, line in jsonl_lines(path):
        if keep(line):
          if not paths or paths[-1] != path:
            paths.append(path)
          file_index.append(len(paths) - 1)
          offset.append(line_offset)
          length.append(len(line))
    elif keep(split_key(key)):
      paths.append(path)
      file_index.append(len(paths) - 1)
      offset.append(-1)
      length.append(0)
  return Documents(paths, file_index, offset, length, config.text_field)


def _index_packages(source: str, config: DataConfig,
                    validation: bool | None) -> Packages:
  """Indexes `source` as packages, keeping one side of the split."""
  keep = _keep(config, validation)
  members: dict[str, list[tuple[str, str]]] = {}
  for key, path in _files(source, config):  # sorted by key
    if source != STDLIB and _is_jsonl(path, config.format):
      raise ConfigError(
          f"DataConfig.documents: 'packages' concatenates whole files, but "
          f"{path} is JSONL (format={config.format!r} reads it by lines)")
    if keep(package_key(key)):
      members.setdefault(package_key(key), []).append((key, path))
  names = sorted(members)
  keys = [key for name in names for key, _ in members[name]]
  files = [path for name in names for _, path in members[name]]
  starts = np.cumsum([0] + [len(members[name]) for name in names])
  return Packages(names, keys, files, starts)


def jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(byte offset, stripped line) of every non-blank line."""
  offset = 0
  with open(path, "rb") as f:
    for line in f:
      stripped = line.strip()
      if stripped:
        yield offset + (len(line) - len(line.lstrip())), stripped
      offset += len(line)


def _read_text(path: str) -> str:
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def _is_jsonl(path: str, fmt: str) -> bool:
  if fmt == "auto":
    return path.lower().endswith(JSONL_SUFFIXES)
  return fmt == "jsonl"


def _key(path: str, root: pathlib.Path) -> str:
  return pathlib.Path(os.path.relpath(path, root)).as_posix()


def _glob_root(pattern: str) -> pathlib.Path:
  parts = pathlib.Path(pattern).parts
  fixed = []
  for part in parts:
    if any(c in _GLOB_CHARS for c in part):
      break
    fixed.append(part)
  return pathlib.Path(*fixed) if fixed else pathlib.Path(".")
