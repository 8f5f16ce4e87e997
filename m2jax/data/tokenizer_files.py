"""How a tokenizer is saved with a run: the kind file every kind shares.

A saved tokenizer is a directory holding `tokenizer_config.json` ({"kind",
"vocab_size"}) beside the kind's own files (BPE: the HF `tokenizer.json`).
Every kind writes the file here (m2jax/data/tokenizer.py, bpe.py), and
`tokenizer.load_tokenizer` reads the kind back to pick the class, so both
tokenizer modules import this one and neither imports the other's saving.
"""

from __future__ import annotations

import json
import os
import threading

CONFIG_FILE = "tokenizer_config.json"


def unique_tmp(path: str) -> str:
  """A temporary name beside `path` that no other process or thread writing
  the same path at once uses (runs sharing a directory save it together)."""
  return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


def write_config(directory: str, kind: str, vocab_size: int) -> None:
  """Writes `directory`/CONFIG_FILE atomically (a crash leaves none)."""
  tmp = unique_tmp(os.path.join(directory, CONFIG_FILE))
  with open(tmp, "w") as f:
    json.dump({"kind": kind, "vocab_size": vocab_size}, f, indent=2)
  os.replace(tmp, os.path.join(directory, CONFIG_FILE))


def read_kind(directory: str) -> str | None:
  """The kind saved in `directory` (None if its config names none)."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no tokenizer saved in {directory!r} "
                            f"({CONFIG_FILE} missing)")
  with open(path) as f:
    return json.load(f).get("kind")
