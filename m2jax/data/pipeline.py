"""The grain pipelines: documents -> tokens -> packed rows -> batches.

  train       documents shuffled with `seed` (a new permutation every epoch,
              grain's per-epoch reseeding), repeated forever, tokenized as
              BOS + ids + EOS, packed into rows, rows shuffled in a window of
              `shuffle_window`, batched (full batches only).
  validation  documents in key order, one pass, packed, batched; the last
              batch is padded to `batch_size` rows of padding.

Both are deterministic given the config. Iterators are grain DatasetIterators
whose `get_state()` is a small JSON-serialisable dict; `set_state` (or
`make_iterator(..., state=...)`) resumes so that the following batches are
bitwise those of an uninterrupted run. grain's orbax hooks (`save`/`load`)
work on them too.

Usage:
  tokenizer = make_tokenizer(config, directory=workdir + "/tokenizer")
  train_it = make_iterator(config, tokenizer, "train")
  batch = next(train_it)              # see m2jax/data/packing.py for keys
  state = train_it.get_state()        # json.dumps(state) with the checkpoint
  val_ds = make_dataset(config, tokenizer, "validation")
  for batch in val_ds: ...            # a fresh pass on every iter()
"""

from __future__ import annotations

import atexit
import functools
import json
import os
from typing import Any
import weakref

import grain
from grain import experimental as grain_exp
import numpy as np

from m2jax.config import ConfigError
from m2jax.data import corpus
from m2jax.data import packing
from m2jax.data import tokenizer as tokenizer_lib
from m2jax.data.config import DataConfig

SPLITS = ("train", "validation")


def make_tokenizer(config: DataConfig, directory: str | None = None
                   ) -> tokenizer_lib.Tokenizer:
  """The tokenizer `config` asks for, loaded from `directory` if saved there.

  Otherwise it is built (BPE: trained on the train split, documents in a
  seeded order, up to `bpe_train_bytes`) and, when `directory` is given,
  saved there, so a run keeps its tokenizer next to its checkpoints.
  A saved tokenizer that disagrees with `config` is refused.
  """
  if directory is not None and os.path.exists(
      os.path.join(directory, tokenizer_lib.CONFIG_FILE)):
    tok = tokenizer_lib.load_tokenizer(directory)
    if tok.kind != config.tokenizer:
      raise ConfigError(f"DataConfig.tokenizer: {config.tokenizer!r}, but "
                        f"{directory} holds a {tok.kind!r} tokenizer")
    if config.tokenizer == "bpe" and tok.vocab_size != config.bpe_vocab_size:
      raise ConfigError(
          f"DataConfig.bpe_vocab_size: {config.bpe_vocab_size}, but the BPE "
          f"tokenizer in {directory} has {tok.vocab_size} ids")
    return tok
  if config.tokenizer == "byte":
    tok = tokenizer_lib.ByteTokenizer()
  else:
    from m2jax.data import bpe  # pylint: disable=g-import-not-at-top
    docs = corpus.split_documents(config)["train"]
    order = np.random.default_rng(config.seed).permutation(len(docs))
    tok = bpe.train_bpe((docs[int(i)] for i in order),
                        config.bpe_vocab_size, config.bpe_train_bytes)
  if directory is not None:
    tok.save(directory)
  return tok


def make_dataset(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
                 split: str = "train",
                 documents: corpus.Documents | None = None
                 ) -> grain.IterDataset:
  """The batch pipeline of `split` ("train": infinite, "validation": one pass).

  `documents` overrides the split's documents (default:
  `corpus.split_documents(config)[split]`).
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if documents is None:
    documents = corpus.split_documents(config)[split]
  if not len(documents):  # pylint: disable=g-explicit-length-test
    raise ConfigError(f"the {split} split of {config.source!r} has no "
                      "documents (see DataConfig.validation_fraction)")
  train = split == "train"
  docs = grain.MapDataset.source(documents)
  if train:
    docs = docs.shuffle(seed=config.seed).repeat(None)
  docs = docs.map(lambda text: {
      "tokens": tokenizer_lib.encode_document(tokenizer, text)})
  rows = docs.to_iter_dataset(grain.ReadOptions(
      num_threads=config.num_threads,
      prefetch_buffer_size=4 * config.num_threads))
  rows = grain_exp.ConcatThenSplitIterDataset(
      rows, length_struct={"tokens": config.seq_len})
  if train and config.shuffle_window > 1:
    rows = grain_exp.WindowShuffleIterDataset(
        rows, window_size=config.shuffle_window, seed=config.seed)
  batches = rows.batch(config.batch_size, drop_remainder=train)
  batches = batches.map(functools.partial(
      packing.finish_batch, batch_size=config.batch_size,
      pad_id=tokenizer.pad_id, byte_lengths_V=tokenizer.byte_lengths()))
  if config.prefetch_batches:
    batches = grain_exp.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.prefetch_batches)
  return _JsonStateIterDataset(batches)


def make_iterator(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
                  split: str = "train", state: dict[str, Any] | None = None,
                  documents: corpus.Documents | None = None
                  ) -> grain.DatasetIterator:
  """An iterator over `make_dataset(...)`, resumed from `state` if given."""
  it = iter(make_dataset(config, tokenizer, split, documents))
  if state is not None:
    it.set_state(state)
  return it


def bytes_per_token(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
                    split: str = "validation",
                    max_batches: int | None = None) -> float:
  """Mean UTF-8 bytes per next-token target over (the first batches of) a split.

  bits per byte = (nats per target token) / ln 2 / bytes_per_token. Summing
  each batch's `num_bytes` instead gives the exact figure for the batches
  actually evaluated.
  """
  total_bytes = total_targets = 0
  for i, batch in enumerate(make_dataset(config, tokenizer, split)):
    if max_batches is not None and i >= max_batches:
      break
    _, mask_BxT = packing.next_token_targets(batch["tokens"],
                                             batch["segment_ids"])
    total_bytes += int(batch["num_bytes"].sum())
    total_targets += int(np.asarray(mask_BxT).sum())
  return total_bytes / max(total_targets, 1)


class _JsonStateIterDataset(grain.IterDataset):
  """Passes elements through; its iterators' states survive a JSON trip."""

  def __iter__(self) -> grain.DatasetIterator:
    it = _JsonStateIterator(self._parent.__iter__())
    _LIVE_ITERATORS.add(it)
    return it


class _JsonStateIterator(grain.DatasetIterator):
  """get_state() is plain JSON data; set_state() accepts it back."""

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return json.loads(json.dumps(self._parent.get_state()))

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(packing.restore_state_types(state))


# grain's thread-prefetch iterators, collected during interpreter teardown,
# print tracebacks from `__del__` (module globals are already None). Closing
# live iterators at exit, then making their `close` a no-op, avoids that.
_LIVE_ITERATORS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
  for it in list(_LIVE_ITERATORS):
    it.close()
    nodes = [it]
    while nodes:
      node = nodes.pop()
      node.close = lambda: None
      nodes.extend(getattr(node, "_parents", ()))
