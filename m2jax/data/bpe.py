"""Byte-level BPE trained locally with HF `tokenizers` (an optional dependency).

GPT-2-style byte-level BPE: text is mapped to 256 byte symbols, so any string
encodes and decodes back exactly, and each non-special token stands for a
whole number of bytes (`byte_lengths`, used for bits per byte). Ids:
PAD=0, BOS=1, EOS=2, then the 256 byte symbols and the merges.

`tokenizers` is imported only when a BPE tokenizer is trained or loaded, so the
byte-level default works without it (`pip install tokenizers`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from m2jax.data import tokenizer_files

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
MODEL_FILE = "tokenizer.json"


def _hf():
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("DataConfig.tokenizer='bpe' needs HF tokenizers: "
                      "pip install tokenizers") from e
  return tokenizers


class BpeTokenizer:
  """A trained HF byte-level BPE behind the m2jax `Tokenizer` protocol."""

  kind = "bpe"
  pad_id = 0
  bos_id = 1
  eos_id = 2

  def __init__(self, hf_tokenizer):
    self._hf = hf_tokenizer
    for i, token in enumerate(SPECIAL_TOKENS):
      if hf_tokenizer.token_to_id(token) != i:
        raise ValueError(f"BPE tokenizer: special token {token!r} must have "
                         f"id {i}, has {hf_tokenizer.token_to_id(token)}")

  @property
  def vocab_size(self) -> int:
    return self._hf.get_vocab_size()

  def encode(self, text: str) -> np.ndarray:
    ids = self._hf.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, np.int32)

  def decode(self, ids) -> str:
    ids_N = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._hf.decode(ids_N, skip_special_tokens=True)

  def byte_lengths(self) -> np.ndarray:
    # Each character of a byte-level token is one byte symbol.
    lengths_V = np.zeros(self.vocab_size, np.int32)
    for i in range(len(SPECIAL_TOKENS), self.vocab_size):
      lengths_V[i] = len(self._hf.id_to_token(i))
    return lengths_V

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = tokenizer_files.unique_tmp(os.path.join(directory, MODEL_FILE))
    self._hf.save(tmp)
    os.replace(tmp, os.path.join(directory, MODEL_FILE))
    tokenizer_files.write_config(directory, self.kind, self.vocab_size)

  @classmethod
  def load(cls, directory: str) -> BpeTokenizer:
    hf = _hf().Tokenizer.from_file(os.path.join(directory, MODEL_FILE))
    return cls(hf)

  def to_json(self) -> str:
    """The HF tokenizer as JSON (equal JSON means an identical tokenizer)."""
    return self._hf.to_str()

  def __eq__(self, other) -> bool:
    return isinstance(other, BpeTokenizer) and (
        json.loads(self.to_json()) == json.loads(other.to_json()))

  __hash__ = None


def train_bpe(documents: Iterable[str], vocab_size: int,
              max_bytes: int) -> BpeTokenizer:
  """Trains a byte-level BPE on at most `max_bytes` of `documents`.

  Deterministic for the same documents in the same order.
  """
  hf = _hf()
  model = hf.Tokenizer(hf.models.BPE())
  model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  model.decoder = hf.decoders.ByteLevel()
  trainer = hf.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  model.train_from_iterator(_limit(documents, max_bytes), trainer=trainer)
  return BpeTokenizer(model)


def _limit(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
  used = 0
  for text in documents:
    if used >= max_bytes:
      return
    data = text.encode("utf-8", errors="replace")[:max_bytes - used]
    used += len(data)
    yield data.decode("utf-8", errors="ignore")
