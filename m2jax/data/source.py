"""DataSource: training data that brings its own pipelines to the train loop.

m2jax.train.loop.pretrain reads either a DataConfig (pretraining's grain
pipelines, m2jax/data/pipeline.py, context stages included) or a DataSource:
any object with the members below, e.g. the chat batches of supervised
fine-tuning (m2jax/data/chat_data.py). Its batches use the format of
m2jax/data/packing.py and may add

  loss_mask  [B, T] int32  1 where token t is a target to learn: the next-
                           token loss at t - k (every depth k) counts only
                           where it is 1 (m2jax.train.losses.target_mask)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from m2jax.data.tokenizer import Tokenizer


@runtime_checkable
class DataSource(Protocol):
  """What the train loop needs from data it does not build itself."""

  # A frozen config dataclass: saved as the run's "data" config and checked
  # against the checkpoints on resume.
  config: Any
  tokenizer: Tokenizer  # saved with the run

  @property
  def seq_len(self) -> int:
    """T of every batch."""

  @property
  def batch_size(self) -> int:
    """B of every batch."""

  def train_iterator(self, state: dict | None = None,
                     rows: Sequence[int] | None = None) -> Iterator[dict]:
    """The endless train batches, resumed from `state` (a JSON-ready dict a
    checkpoint saved from this iterator's `get_state()`) when given. `rows`
    (multi-host: m2jax.sharding.process_rows) keeps only those rows of every
    batch, in that order; the state must not depend on it."""

  def validation_batches(self, rows: Sequence[int] | None = None
                         ) -> Iterable[dict]:
    """One pass over the validation batches (a fresh pass per iter()),
    `rows` as for train_iterator."""
