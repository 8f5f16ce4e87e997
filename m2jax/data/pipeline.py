"""The grain pipelines: documents -> tokens -> packed rows -> batches.

  train       the document stream: documents shuffled with `seed` (a new
              permutation every epoch, grain's per-epoch reseeding), repeated
              forever; read from stream position `start_document` on,
              tokenized as BOS + ids + EOS, packed into rows, rows shuffled in
              a window of `shuffle_window`, batched (full batches only).
  validation  documents in key order, one pass, packed, batched; the last
              batch is padded to `batch_size` rows of padding.

Both are deterministic given the config and `start_document`. Iterators are
grain DatasetIterators whose `get_state()` is a small JSON-serialisable dict
{"start_document", "next_document", "pipeline"}; `set_state` (or
`make_iterator(..., state=...)`) resumes so that the following batches are
bitwise those of an uninterrupted run. grain's orbax hooks (`save`/`load`)
work on them too.

Every row of a batch carries its id, `row_ids`: its index in the stream of
packed rows from `start_document` on (before the row shuffle; -1 for the
validation padding).

Multi-host: with `rows` (m2jax.sharding.process_rows) a process gets only
those rows of every global batch, in that order. Packing is sequential
(where a row starts depends on every document before it), so each process
still tokenizes and packs the whole stream, then keeps only its rows of each
batch: the union over processes is exactly the batch of `rows=None`, and the
iterator state does not depend on `rows` (a checkpoint resumes on any
process count).

Context stages (m2jax/train/loop.py) re-pack one stream at a new seq_len: a
stage starts at `next_stage_start(...)`, one past the last document whose
tokens were in any batch of the stage before (its iterator's
`next_document`). So no document is read by two stages; the rest of a
document split across the stage switch, and the documents whose rows were
still waiting in the row-shuffle window (at most `shuffle_window` rows), are
skipped. Every row carries the stream positions of its documents for this (a
grain meta feature packed with the tokens, dropped before the batch is
yielded).

Usage:
  tokenizer = make_tokenizer(config, directory=workdir + "/tokenizer")
  train_it = make_iterator(config, tokenizer, "train")
  batch = next(train_it)              # see m2jax/data/packing.py for keys
  state = train_it.get_state()        # json.dumps(state) with the checkpoint
  long_it = make_iterator(long_config, tokenizer, "train",
                          start_document=next_stage_start(config, state,
                                                          long_config))
  val_ds = make_dataset(config, tokenizer, "validation")
  for batch in val_ds: ...            # a fresh pass on every iter()
"""

from __future__ import annotations

import atexit
import functools
import json
import os
from collections.abc import Sequence
from typing import Any
import weakref

import grain
from grain import experimental as grain_exp
import numpy as np

from m2jax.config import ConfigError
from m2jax.data import corpus
from m2jax.data import packing
from m2jax.data import tokenizer as tokenizer_lib
from m2jax.data import tokenizer_files
from m2jax.data.config import DataConfig

SPLITS = ("train", "validation")
# The packed meta feature holding each row's documents as stream position + 1
# (0: an empty slot).
_DOCUMENT = "document"
# The batch key of each row's index in the packed-row stream.
ROW_IDS = "row_ids"


def make_tokenizer(config: DataConfig, directory: str | None = None
                   ) -> tokenizer_lib.Tokenizer:
  """The tokenizer `config` asks for, loaded from `directory` if saved there.

  Otherwise it is built (BPE: trained on the train split, documents in a
  seeded order, up to `bpe_train_bytes`) and, when `directory` is given,
  saved there, so a run keeps its tokenizer next to its checkpoints.
  A saved tokenizer that disagrees with `config` is refused.
  """
  if directory is not None and os.path.exists(
      os.path.join(directory, tokenizer_files.CONFIG_FILE)):
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
                 documents: Sequence[str] | None = None,
                 start_document: int = 0,
                 rows: Sequence[int] | None = None) -> grain.IterDataset:
  """The batch pipeline of `split` ("train": infinite, "validation": one pass).

  `documents` overrides the split's documents (default:
  `corpus.split_documents(config)[split]`). `start_document` is the stream
  position of the first document read (train: counted over all epochs).
  `rows` (distinct indices below `batch_size`) keeps only those rows of
  every batch, in that order (None: all).
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not _is_position(start_document):
    raise ValueError(f"start_document must be an integer >= 0, got "
                     f"{start_document!r}")
  if rows is not None:
    rows = np.asarray(rows)
    if (rows.ndim != 1 or not len(rows) or len(set(rows.tolist())) != len(rows)
        or rows.min() < 0 or rows.max() >= config.batch_size):
      raise ValueError(f"rows must be distinct indices in [0, "
                       f"{config.batch_size}), got {rows.tolist()}")
  if documents is None:
    documents = corpus.split_documents(config)[split]
  if not len(documents):  # pylint: disable=g-explicit-length-test
    raise ConfigError(f"the {split} split of {config.source!r} has no "
                      "documents (see DataConfig.validation_fraction)")
  train = split == "train"
  docs = grain.MapDataset.source(documents)
  if train:
    docs = docs.shuffle(seed=config.seed).repeat(None)
  # Indexed before slicing, so the position is the document's place in the
  # whole stream whatever stage starts where.
  docs = docs.map_with_index(lambda position, text: {
      "tokens": tokenizer_lib.encode_document(tokenizer, text),
      _DOCUMENT: np.int64(position + 1)})
  docs = docs[start_document:]
  packed = docs.to_iter_dataset(grain.ReadOptions(
      num_threads=config.num_threads,
      prefetch_buffer_size=4 * config.num_threads))
  # A row holds at most seq_len / 2 documents (each has BOS and EOS), so the
  # meta feature never limits packing; a split document is in both rows.
  packed = grain_exp.ConcatThenSplitIterDataset(
      packed, length_struct={"tokens": config.seq_len,
                             _DOCUMENT: config.seq_len},
      meta_features=(_DOCUMENT,))
  packed = packed.map_with_index(
      lambda row_id, row: {**row, ROW_IDS: np.int32(row_id)})
  if train and config.shuffle_window > 1:
    packed = grain_exp.WindowShuffleIterDataset(
        packed, window_size=config.shuffle_window, seed=config.seed)
  # Whole batches, then this process's rows: the stream position the
  # iterator state records must be the whole batch's, the same everywhere.
  batches = packed.batch(config.batch_size, drop_remainder=train)
  batches = batches.map(functools.partial(
      _finish_batch, rows=rows, batch_size=config.batch_size,
      pad_id=tokenizer.pad_id, byte_lengths_V=tokenizer.byte_lengths()))
  if config.prefetch_batches:
    batches = grain_exp.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.prefetch_batches)
  return _StreamIterDataset(batches, start_document)


def make_iterator(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
                  split: str = "train", state: dict[str, Any] | None = None,
                  documents: Sequence[str] | None = None,
                  start_document: int = 0,
                  rows: Sequence[int] | None = None) -> grain.DatasetIterator:
  """An iterator over `make_dataset(...)`, resumed from `state` if given.

  A state carries its own start_document; passing another one is an error.
  """
  if state is not None:
    if start_document not in (0, state["start_document"]):
      raise ValueError(f"start_document {start_document} contradicts the "
                       f"state's {state['start_document']}")
    start_document = state["start_document"]
  it = iter(make_dataset(config, tokenizer, split, documents, start_document,
                         rows))
  if state is not None:
    it.set_state(state)
  return it


def next_stage_start(previous: DataConfig, previous_state: dict[str, Any],
                     config: DataConfig) -> int:
  """Where a stage reading `config` starts in its document stream.

  Args:
    previous: the config of the stage before.
    previous_state: its train iterator's `get_state()` at its last batch.
    config: the new stage's config.

  Returns:
    The previous stage's `next_document` (one past the last stream position
    whose tokens were in one of its batches) when `config` reads the same
    stream (`DataConfig.same_stream`: only packing and batching differ), else
    0: other documents are another stream, read from its beginning.
  """
  if previous.same_stream(config):
    return int(previous_state["next_document"])
  return 0


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


def _finish_batch(packed: dict[str, np.ndarray], *, rows, batch_size: int,
                  **kwargs) -> tuple[dict[str, np.ndarray], int]:
  """(the batch's `rows` (None: all), one past the highest stream position
  the whole batch holds tokens of)."""
  stream_end = int(packed.pop(_DOCUMENT).max(initial=0))
  row_ids_B = packed.pop(ROW_IDS)
  batch = packing.finish_batch(packed, batch_size=batch_size, **kwargs)
  batch[ROW_IDS] = np.pad(row_ids_B, (0, batch_size - len(row_ids_B)),
                          constant_values=-1)
  if rows is not None:
    batch = {k: v[rows] for k, v in batch.items()}
  return batch, stream_end


def _is_position(value) -> bool:
  return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and value >= 0)


class _StreamIterDataset(grain.IterDataset):
  """Yields the batches; its iterators track where the stream has been read."""

  def __init__(self, parent: grain.IterDataset, start_document: int):
    super().__init__(parent)
    self._start_document = int(start_document)

  def __iter__(self) -> grain.DatasetIterator:
    return close_at_exit(_StreamIterator(self._parent.__iter__(),
                                         self._start_document))


class _StreamIterator(grain.DatasetIterator):
  """get_state() is plain JSON data; set_state() accepts it back.

  The state: {"start_document": first stream position this pipeline reads,
  "next_document": one past the highest stream position any yielded batch
  held tokens of (start_document before the first batch), "pipeline": grain's
  state of the pipeline}.
  """

  def __init__(self, parent: grain.DatasetIterator, start_document: int):
    super().__init__(parent)
    self._start_document = start_document
    self._next_document = start_document

  @property
  def next_document(self) -> int:
    return self._next_document

  def __next__(self) -> dict[str, np.ndarray]:
    batch, stream_end = next(self._parent)
    self._next_document = max(self._next_document, stream_end)
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"start_document": self._start_document,
            "next_document": self._next_document,
            "pipeline": json.loads(json.dumps(self._parent.get_state()))}

  def set_state(self, state: dict[str, Any]) -> None:
    if state["start_document"] != self._start_document:
      raise ValueError(
          f"iterator state starts at document {state['start_document']}, "
          f"this pipeline at {self._start_document}")
    self._parent.set_state(packing.restore_state_types(state["pipeline"]))
    self._next_document = int(state["next_document"])


# grain's thread-prefetch iterators, collected during interpreter teardown,
# print tracebacks from `__del__` (module globals are already None). Closing
# live iterators at exit, then making their `close` a no-op, avoids that.
_LIVE_ITERATORS: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(it: grain.DatasetIterator) -> grain.DatasetIterator:
  """`it`, closed at interpreter exit if still alive (see above)."""
  _LIVE_ITERATORS.add(it)
  return it


@atexit.register
def _close_live_iterators() -> None:
  for it in list(_LIVE_ITERATORS):
    it.close()
    nodes = [it]
    while nodes:
      node = nodes.pop()
      node.close = lambda: None
      nodes.extend(getattr(node, "_parents", ()))
