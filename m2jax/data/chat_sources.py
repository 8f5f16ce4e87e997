"""Conversations for fine-tuning: chat JSONL, the embedded set, the split.

A conversation is a dict {"messages": [...], "tools": [...] (optional)}
(m2jax/data/chat.py for the messages; other keys are ignored, so records
may carry ids or provenance). Sources, as DataConfig.source names them:

  "stdlib"   the embedded set, no download: one conversation per public
             top-level function of the running interpreter's standard
             library (its non-test *.py files, read with `ast`) that has a
             docstring, sizes filtered (MAX_BYTE_TOKENS). user: "Write a Python
             function `name(args)` that: <first paragraph of the docstring>",
             assistant: the function's source, decorators included.
             Deterministic for a given Python (433 conversations on 3.12).
             The stdlib is also the pretraining corpus: held out means held
             out from fine-tuning.
  a path     a JSONL file, a directory of them or a glob: one conversation
             per non-blank line, read lazily (an index of byte offsets).

Any random-access sequence of conversation dicts is a source too
(`ChatData(..., conversations={"train": ..., "validation": ...})`): the
demonstrations the RL environments generate (issue 15) join that way.

Split: a conversation goes to validation when `hash_fraction(key) <
DataConfig.validation_fraction`; the key is the stripped JSONL line, or for
the embedded set the function's file ("json/decoder.py"), so a module's
functions are all on one side. `validation_source` takes validation from a
source of its own instead; `max_documents` keeps the first n of each split.
"""

from __future__ import annotations

import ast
import functools
import json
from collections.abc import Iterator, Sequence

import numpy as np

from m2jax.config import ConfigError
from m2jax.data import chat
from m2jax.data import corpus
from m2jax.data.config import STDLIB, DataConfig

# Size filter of the embedded set: a docstring paragraph of 20-240
# characters, and a whole conversation that fits a row of MAX_BYTE_TOKENS
# byte-tokenizer ids (BOS + the rendered text's UTF-8 bytes), so the
# default SFT row (seq_len 512) never truncates one and CPU steps stay short.
MIN_PARAGRAPH_CHARS, MAX_PARAGRAPH_CHARS = 20, 240
MAX_BYTE_TOKENS = 512
PROMPT = "Write a Python function `{name}({args})` that: {paragraph}"


def function_conversation(name: str, args: str, paragraph: str,
                          source: str) -> dict:
  """The embedded set's conversation for one function."""
  prompt = PROMPT.format(name=name, args=args, paragraph=paragraph)
  return {"messages": [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": source}]}


def _file_functions(text: str) -> Iterator[dict]:
  """The conversations of one module's qualifying functions, in file order."""
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return
  lines = text.splitlines(keepends=True)
  for node in tree.body:
    if (not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        or node.name.startswith("_")):
      continue
    doc = ast.get_docstring(node)
    if not doc:
      continue
    # Docstrings wrap lines; the paragraph is read as one line.
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    source = "".join(lines[first - 1:node.end_lineno]).rstrip() + "\n"
    if not MIN_PARAGRAPH_CHARS <= len(paragraph) <= MAX_PARAGRAPH_CHARS:
      continue
    conv = function_conversation(node.name, ast.unparse(node.args),
                                 paragraph, source)
    if 1 + len(chat.render_text(conv["messages"]).encode()) <= MAX_BYTE_TOKENS:
      yield conv


@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, dict], ...]:
  """(file key, conversation) of the embedded set, sorted by file."""
  out = []
  for key, path in corpus.stdlib_files(include_tests=False):
    with open(path, "rb") as f:
      text = f.read().decode("utf-8", errors="replace")
    out += [(key, conv) for conv in _file_functions(text)]
  return tuple(out)


class Conversations(Sequence[dict]):
  """Lazily read JSONL conversations (one per line, by byte range)."""

  def __init__(self, files: Sequence[str], file_index, offset, length):
    self.files = list(files)
    self.file_index = np.asarray(file_index, np.int32)
    self.offset = np.asarray(offset, np.int64)
    self.length = np.asarray(length, np.int64)

  def __len__(self) -> int:
    return len(self.file_index)

  def __getitem__(self, index: int) -> dict:
    path = self.files[self.file_index[index]]
    offset = int(self.offset[index])
    with open(path, "rb") as f:
      f.seek(offset)
      line = f.read(int(self.length[index]))
    try:
      record = json.loads(line)
    except ValueError as e:
      raise ConfigError(f"{path} (byte {offset}): not JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(
        record.get("messages"), list):
      raise ConfigError(f"{path} (byte {offset}): a conversation is an "
                        "object with a 'messages' list")
    return record

  def take(self, n: int | None) -> Conversations:
    if n is None:
      return self
    return Conversations(self.files, self.file_index[:n], self.offset[:n],
                         self.length[:n])


def where(conversations, index: int) -> str:
  """Where conversation `index` of a source comes from, for error messages."""
  if isinstance(conversations, Conversations):
    return (f"{conversations.files[conversations.file_index[index]]} (byte "
            f"{int(conversations.offset[index])})")
  return f"conversation {index}"


def _read(source: str, config: DataConfig, validation: bool | None):
  """One side of `source`'s split (None: all of it)."""
  keep = (lambda key: True) if validation is None else (
      lambda key: (corpus.hash_fraction(key) < config.validation_fraction)
      == validation)
  if source == STDLIB:
    return [conv for key, conv in stdlib_functions() if keep(key)]
  paths, file_index, offset, length = [], [], [], []
  for _, path in corpus.user_files(source):
    if not (path.lower().endswith(corpus.JSONL_SUFFIXES)
            or config.format == "jsonl"):
      suffixes = "/".join(corpus.JSONL_SUFFIXES)
      raise ConfigError(f"DataConfig.source: chat data is JSONL ({suffixes} "
                        f"files, or format='jsonl'), but {path} is not")
    for line_offset, line in corpus.jsonl_lines(path):
      if keep(line):
        if not paths or paths[-1] != path:
          paths.append(path)
        file_index.append(len(paths) - 1)
        offset.append(line_offset)
        length.append(len(line))
  return Conversations(paths, file_index, offset, length)


def split_conversations(config: DataConfig) -> dict[str, Sequence[dict]]:
  """The "train" and "validation" conversations `config` describes."""
  if config.validation_source is not None:
    splits = {"train": _read(config.source, config, None),
              "validation": _read(config.validation_source, config, None)}
  else:
    splits = {"train": _read(config.source, config, False),
              "validation": _read(config.source, config, True)}
  if config.max_documents is not None:
    splits = {k: (v.take(config.max_documents) if isinstance(
        v, Conversations) else v[:config.max_documents])
              for k, v in splits.items()}
  return splits
