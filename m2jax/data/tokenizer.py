"""Tokenizers: the protocol the train loop sees, and the default byte tokenizer.

Byte tokenizer ids:
  0..255  the UTF-8 bytes of the text
  256     PAD  (fills the tail of a batch; its segment id is 0)
  257     BOS  (starts every document)
  258     EOS  (ends every document)
  vocab_size = 259

The optional byte-level BPE tokenizer (m2jax/data/bpe.py) follows the same
protocol with PAD/BOS/EOS = 0/1/2. A tokenizer is saved into a directory with
the run (`save`; the shared format: m2jax/data/tokenizer_files.py) and
`load_tokenizer` restores either kind from it.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import numpy as np

from m2jax.data import bpe
from m2jax.data import tokenizer_files


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline and the train loop need from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Number of ids; every id is in [0, vocab_size)."""

  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str) -> np.ndarray:
    """[N] int32 ids of `text`, without BOS/EOS."""

  def decode(self, ids) -> str:
    """The text of `ids`; special ids are dropped."""

  def byte_lengths(self) -> np.ndarray:
    """[vocab_size] int32: UTF-8 bytes each id stands for (0 for specials)."""

  def save(self, directory: str) -> None:
    """Writes everything `load_tokenizer(directory)` needs."""


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then PAD/BOS/EOS (see the module docstring)."""

  kind = "byte"
  pad_id = 256
  bos_id = 257
  eos_id = 258

  @property
  def vocab_size(self) -> int:
    return 259

  def encode(self, text: str) -> np.ndarray:
    data = text.encode("utf-8", errors="replace")
    return np.frombuffer(data, np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids_N = np.asarray(ids).reshape(-1)
    return bytes(ids_N[ids_N < 256].astype(np.uint8)).decode(
        "utf-8", errors="replace")

  def byte_lengths(self) -> np.ndarray:
    lengths_V = np.zeros(self.vocab_size, np.int32)
    lengths_V[:256] = 1
    return lengths_V

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    tokenizer_files.write_config(directory, self.kind, self.vocab_size)

  def __eq__(self, other) -> bool:
    return isinstance(other, ByteTokenizer)

  def __hash__(self) -> int:
    return hash(self.kind)


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
  """[N + 2] int32: BOS, the ids of `text`, EOS."""
  ids_N = tokenizer.encode(text)
  out = np.empty(len(ids_N) + 2, np.int32)
  out[0] = tokenizer.bos_id
  out[1:-1] = ids_N
  out[-1] = tokenizer.eos_id
  return out


def load_tokenizer(directory: str) -> Tokenizer:
  """Restores a tokenizer written by `save` (byte or BPE)."""
  kind = tokenizer_files.read_kind(directory)
  if kind == "byte":
    return ByteTokenizer()
  if kind == "bpe":
    return bpe.BpeTokenizer.load(directory)
  raise ValueError(f"{os.path.join(directory, tokenizer_files.CONFIG_FILE)}: "
                   f"unknown tokenizer kind {kind!r}")
