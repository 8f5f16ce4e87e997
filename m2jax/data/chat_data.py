"""Chat batches for supervised fine-tuning: render, pack, batch (a DataSource).

  train       conversations shuffled with `seed` (a new permutation every
              epoch), repeated forever, each rendered by the chat template
              (m2jax/data/chat.py) to ids and its assistant mask, packed
              whole into rows of seq_len by first fit over PACKING_BINS
              rows (padding fills what is left of a row; rows are shuffled
              within each group of bins), batched (full batches only).
  validation  conversations in order, one pass, packed the same way without
              shuffling; the last batch is padded with rows of padding.

One conversation is one segment: its own segment id, positions from 0, so
attention and targets never cross into a neighbour. A conversation longer
than seq_len is truncated to its first seq_len ids (with a warning, once):
its later turns are lost, never split into a segment of their own that
would lack the start of the conversation.

Batches are m2jax/data/packing.py's format plus `loss_mask` (the assistant
mask: m2jax/data/source.py), and `num_bytes` counts the UTF-8 bytes of the
assistant targets only, so bits per byte are the assistant's. Iterators are
grain's: `get_state()` is plain JSON data and a restored iterator yields
bitwise the batches of an uninterrupted one.

Usage:
  data = ChatData(config, tokenizer)                 # DataConfig.source:
  it = data.train_iterator()                         # "stdlib" or JSONL
  batch = next(it); state = it.get_state()
  for batch in data.validation_batches(): ...
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import grain
from grain import experimental as grain_exp
import numpy as np

from m2jax.config import ConfigError
from m2jax.data import chat
from m2jax.data import chat_sources
from m2jax.data import packing
from m2jax.data import pipeline
from m2jax.data import tokenizer as tokenizer_lib
from m2jax.data.config import DataConfig

# Rows first fit packs at once: more fill rows better (less padding) and
# mix conversations from further apart in the shuffled stream.
PACKING_BINS = 16
_FIELDS = ("tokens", "loss_mask")


def encode_conversation(conversation, tokenizer: tokenizer_lib.Tokenizer,
                        seq_len: int, where: str = "conversation"
                        ) -> dict[str, np.ndarray]:
  """{"tokens": [N] int32, "loss_mask": [N] int32}, N <= seq_len (truncated,
  with a warning)."""
  if not isinstance(conversation, dict) or not isinstance(
      conversation.get("messages"), list):
    raise ConfigError(f"{where}: a conversation is an object with a "
                      "'messages' list")
  try:
    ids_N, mask_N = chat.render(conversation["messages"], tokenizer,
                                tools=conversation.get("tools"))
  except chat.ChatFormatError as e:
    raise chat.ChatFormatError(f"{where}: {e}") from None
  if len(ids_N) > seq_len:
    # One text per seq_len, so Python shows it once, not per conversation.
    warnings.warn(f"chat data: conversations longer than seq_len={seq_len} "
                  f"tokens are cut to their first {seq_len} (their later "
                  "turns are not trained on)", stacklevel=2)
    ids_N, mask_N = ids_N[:seq_len], mask_N[:seq_len]
  return {"tokens": ids_N, "loss_mask": mask_N.astype(np.int32)}


def assistant_target_bytes(tokens_BxT, segment_ids_BxT, loss_mask_BxT,
                           byte_lengths_V) -> np.ndarray:
  """[B] int32: UTF-8 bytes of the next-token targets that are assistant
  tokens (the targets the SFT loss counts)."""
  tokens_BxT = np.asarray(tokens_BxT)
  segment_ids_BxT = np.asarray(segment_ids_BxT)
  counted_Bx_T1 = ((segment_ids_BxT[:, 1:] == segment_ids_BxT[:, :-1])
                   & (segment_ids_BxT[:, 1:] != 0)
                   & (np.asarray(loss_mask_BxT)[:, 1:] != 0))
  bytes_Bx_T1 = np.asarray(byte_lengths_V)[tokens_BxT[:, 1:]]
  return (bytes_Bx_T1 * counted_Bx_T1).sum(axis=1).astype(np.int32)


def _finish(packed: dict[str, np.ndarray], *, batch_size: int, pad_id: int,
            byte_lengths_V: np.ndarray, rows=None) -> dict[str, np.ndarray]:
  batch = packing.finish_batch(packed, batch_size=batch_size, pad_id=pad_id,
                               byte_lengths_V=byte_lengths_V)
  mask_BxT = packed["loss_mask"]
  mask_BxT = np.pad(mask_BxT, ((0, batch_size - mask_BxT.shape[0]), (0, 0)))
  batch["loss_mask"] = np.where(batch["segment_ids"] == 0, 0,
                                mask_BxT).astype(np.int32)
  batch["num_bytes"] = assistant_target_bytes(
      batch["tokens"], batch["segment_ids"], batch["loss_mask"],
      byte_lengths_V)
  if rows is not None:  # this process's rows (multi-host), in that order
    batch = {k: v[rows] for k, v in batch.items()}
  return batch


def make_chat_dataset(config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
                      conversations: Sequence[dict], train: bool,
                      rows: Sequence[int] | None = None) -> grain.IterDataset:
  """The batch pipeline over `conversations` (module docstring).

  `rows` keeps only those rows of every batch (a process's share,
  m2jax.sharding.process_rows); every process packs the whole stream, so the
  iterator state does not depend on `rows`.
  """
  if not len(conversations):  # pylint: disable=g-explicit-length-test
    split = "train" if train else "validation"
    raise ConfigError(f"the {split} split of {config.source!r} has no "
                      "conversations (see DataConfig.validation_fraction)")
  # Indices go through the shuffle, so an error names the conversation's
  # place in its source.
  convs = grain.MapDataset.range(len(conversations))
  if train:
    convs = convs.shuffle(seed=config.seed).repeat(None)
  convs = convs.map(lambda i: encode_conversation(
      conversations[i], tokenizer, config.seq_len,
      chat_sources.where(conversations, i)))
  packed = convs.to_iter_dataset(grain.ReadOptions(
      num_threads=config.num_threads,
      prefetch_buffer_size=4 * config.num_threads))
  packed = grain_exp.FirstFitPackIterDataset(
      packed, length_struct={f: config.seq_len for f in _FIELDS},
      num_packing_bins=PACKING_BINS, seed=config.seed, shuffle_bins=train)
  batches = packed.batch(config.batch_size, drop_remainder=train)
  batches = batches.map(functools.partial(
      _finish, batch_size=config.batch_size, pad_id=tokenizer.pad_id,
      byte_lengths_V=tokenizer.byte_lengths(),
      rows=None if rows is None else np.asarray(rows)))
  if config.prefetch_batches:
    batches = grain_exp.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.prefetch_batches)
  return _ClosedAtExit(batches)


class _ClosedAtExit(grain.IterDataset):
  """Its iterators are closed at interpreter exit, as pipeline.py's are."""

  def __iter__(self) -> grain.DatasetIterator:
    return pipeline.close_at_exit(self._parent.__iter__())


class ChatData:
  """Chat conversations as SFT batches: a DataSource for the train loop.

  `config` (a DataConfig: source, split, seq_len, batch_size, seed, reader
  threads; its tokenizer fields name `tokenizer`'s kind) is saved as the
  run's data config. `conversations` ({"train", "validation"} sequences of
  conversation dicts) replaces the config's source, e.g. for generated
  demonstrations; by default chat_sources.split_conversations(config).
  """

  def __init__(self, config: DataConfig, tokenizer: tokenizer_lib.Tokenizer,
               conversations: dict[str, Sequence[dict]] | None = None):
    if tokenizer.kind != config.tokenizer:
      raise ConfigError(f"DataConfig.tokenizer: {config.tokenizer!r}, but the "
                        f"tokenizer given is {tokenizer.kind!r}")
    self.config = config
    self.tokenizer = tokenizer
    self._conversations = conversations

  @functools.cached_property
  def conversations(self) -> dict[str, Sequence[dict]]:
    if self._conversations is not None:
      return self._conversations
    return chat_sources.split_conversations(self.config)

  @property
  def seq_len(self) -> int:
    return self.config.seq_len

  @property
  def batch_size(self) -> int:
    return self.config.batch_size

  def train_iterator(self, state: dict | None = None,
                     rows: Sequence[int] | None = None
                     ) -> grain.DatasetIterator:
    it = iter(make_chat_dataset(self.config, self.tokenizer,
                                self.conversations["train"], train=True,
                                rows=rows))
    if state is not None:
      it.set_state(packing.restore_state_types(state))
    return it

  def validation_batches(self, rows: Sequence[int] | None = None
                         ) -> grain.IterDataset:
    return make_chat_dataset(self.config, self.tokenizer,
                             self.conversations["validation"], train=False,
                             rows=rows)
