"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology").

A sequence lists `pairs` key -> value pairs, one character each ("aQcXbZ"),
then `gap` filler characters, then `queries` of the keys again, each
followed by its value ("bZaQ"). Predicting a queried value needs the model
to find that key among the pairs: content-based retrieval over a distance
this module controls, which is what separates full from sliding-window
attention (SPEC §8). The layout, for pairs=3, queries=2, gap=4, offset=2:

  ..aQcXbZ....bZaQ
  ^ offset filler (keeps the pairs clear of an SWA layer's sink tokens)
    ^ pairs        ^ queries, in a random order, each key at most once
          ^ gap

Keys are distinct lowercase letters, values uppercase letters drawn
independently and uniformly, so a model that cannot see the pairs predicts a
queried value with probability 1 / value_vocab at best (`chance`): values
never repeat information between queries, and no key is queried twice.

Distances: the key of pair i (0-based) sits at offset + 2i, the key of query
j at offset + 2 * pairs + gap + 2j, so a query is gap + 2 ... gap + 2 *
(pairs + queries) - 2 characters after its pair (`distance_range`). A
sliding-window layer of window W lets position t read t - W + 1 ... t, so L
such layers carry information at most L * (W - 1) positions; with gap >=
`gap_beyond_reach(W, L)` no pair character is in reach of any query, and an
all-SWA model is at chance however well it is trained.

Texts are ASCII, one token a character under the byte tokenizer. Accuracy is
the fraction of queried values that greedy next-token prediction gets right
with the rest of the sequence in context (teacher forcing, `accuracy`).
Training documents (`training_documents`) use seeds below
m2jax.eval.tasks.EVAL_SEED_BASE, evaluation examples (`eval_examples`) seeds
at or above it.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Sequence

import numpy as np

from m2jax.config import ConfigError, ModelConfig
from m2jax.data import single_document_batch
from m2jax.data.tokenizer import Tokenizer
from m2jax.eval import scoring
from m2jax.eval.tasks import EVAL_SEED_BASE

KEY_ALPHABET = string.ascii_lowercase
VALUE_ALPHABET = string.ascii_uppercase
FILLER = "."


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  """One MQAR format; `gap`, `offset` and `length` only move characters, so
  a seed gives the same pairs and queries at every gap."""
  pairs: int = 8
  queries: int = 0        # distinct keys queried; 0: all `pairs`
  gap: int = 0            # filler between the last pair and the first query
  offset: int = 0         # filler before the first pair
  key_vocab: int = 26     # keys are drawn from the first key_vocab letters
  value_vocab: int = 26   # values from the first value_vocab capitals
  length: int = 0         # trailing filler up to this length (0: none)

  def __post_init__(self):
    def fail(field, rule):
      raise ConfigError(f"MQARConfig.{field}: {rule} (got "
                        f"{getattr(self, field)!r})")
    if not 1 <= self.key_vocab <= len(KEY_ALPHABET):
      fail("key_vocab", f"must be in [1, {len(KEY_ALPHABET)}]")
    if not 2 <= self.value_vocab <= len(VALUE_ALPHABET):
      fail("value_vocab", f"must be in [2, {len(VALUE_ALPHABET)}]")
    if not 1 <= self.pairs <= self.key_vocab:
      fail("pairs", f"must be in [1, key_vocab={self.key_vocab}] (keys are "
           "distinct)")
    if not 0 <= self.queries <= self.pairs:
      fail("queries", f"must be in [0, pairs={self.pairs}] (0: all)")
    for field in ("gap", "offset", "length"):
      if getattr(self, field) < 0:
        fail(field, "must be >= 0")
    if self.length and self.length < self.content_length:
      fail("length", f"must be 0 or >= {self.content_length}, the "
           "characters of offset, pairs, gap and queries")

  def replace(self, **changes) -> MQARConfig:
    return dataclasses.replace(self, **changes)

  @property
  def num_queries(self) -> int:
    return self.queries or self.pairs

  @property
  def chance(self) -> float:
    """Accuracy of the best predictor that cannot see the pairs."""
    return 1.0 / self.value_vocab

  @property
  def content_length(self) -> int:
    return self.offset + 2 * self.pairs + self.gap + 2 * self.num_queries

  @property
  def text_length(self) -> int:
    return max(self.length, self.content_length)

  def distance_range(self) -> tuple[int, int]:
    """(shortest, longest) distance from a pair's key to its query's key."""
    return self.gap + 2, self.gap + 2 * (self.pairs + self.num_queries) - 2


def gap_beyond_reach(window: int, num_sliding_layers: int) -> int:
  """The smallest gap that puts every pair character out of reach of every
  query for `num_sliding_layers` sliding-window layers of `window`."""
  return num_sliding_layers * (window - 1)


@dataclasses.dataclass(frozen=True)
class MQARExample:
  text: str
  value_positions: tuple[int, ...]  # character index of each queried value


def generate(cfg: MQARConfig, seed: int) -> MQARExample:
  """The MQAR sequence of `cfg` for `seed` (deterministic)."""
  rng = random.Random(f"mqar/{cfg.pairs}/{cfg.num_queries}/{cfg.key_vocab}/"
                      f"{cfg.value_vocab}/{seed}")
  keys = rng.sample(KEY_ALPHABET[:cfg.key_vocab], cfg.pairs)
  values = [rng.choice(VALUE_ALPHABET[:cfg.value_vocab]) for _ in keys]
  asked = rng.sample(range(cfg.pairs), cfg.num_queries)
  head = (FILLER * cfg.offset + "".join(k + v for k, v in zip(keys, values))
          + FILLER * cfg.gap)
  text = head + "".join(keys[i] + values[i] for i in asked)
  text += FILLER * (cfg.text_length - len(text))
  return MQARExample(text, tuple(len(head) + 2 * j + 1
                                 for j in range(cfg.num_queries)))


def eval_examples(cfg: MQARConfig, n: int) -> list[MQARExample]:
  """The fixed evaluation set of `cfg` (seeds >= EVAL_SEED_BASE)."""
  return [generate(cfg, EVAL_SEED_BASE + i) for i in range(n)]


def training_documents(n: int, cfg: MQARConfig, gaps: Sequence[int],
                       seed: int = 0) -> list[str]:
  """`n` training texts of `cfg`, each at a gap drawn from `gaps` (training
  seeds: disjoint from `eval_examples`)."""
  if not gaps or min(gaps) < 0:
    raise ConfigError(f"MQAR training gaps must be a non-empty list of "
                      f"gaps >= 0 (got {list(gaps)})")
  rng = random.Random(f"mqar-gaps/{seed}")
  first = seed * n
  if first + n > EVAL_SEED_BASE:
    raise ConfigError(f"MQAR training seeds {first}..{first + n - 1} reach "
                      f"the evaluation seeds (>= {EVAL_SEED_BASE})")
  return [generate(cfg.replace(gap=rng.choice(gaps)), first + i).text
          for i in range(n)]


def encode(example: MQARExample, tokenizer: Tokenizer
           ) -> tuple[list[int], list[int]]:
  """(BOS + token ids of the text, index of each queried value's token)."""
  ids = [int(i) for i in tokenizer.encode(example.text)]
  if len(ids) != len(example.text):
    raise ConfigError("MQAR needs a tokenizer with one token per character "
                      f"(the byte tokenizer); got {len(ids)} tokens for "
                      f"{len(example.text)} characters")
  return [tokenizer.bos_id, *ids], [p + 1 for p in example.value_positions]


def train_batch(examples: Sequence[MQARExample], tokenizer: Tokenizer
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """A train-step batch of equal-length examples (one document a row) and
  the [B, T] bool mask of the queried values' tokens."""
  rows, masks = [], []
  for ex in examples:
    ids, targets = encode(ex, tokenizer)
    mask = np.zeros(len(ids), bool)
    mask[targets] = True
    rows.append(ids)
    masks.append(mask)
  if len({len(r) for r in rows}) != 1:
    raise ConfigError("MQAR train_batch needs examples of one length (set "
                      "MQARConfig.length); got lengths "
                      f"{sorted({len(r) for r in rows})}")
  return single_document_batch(rows), np.stack(masks)


def query_hits(config: ModelConfig, variables, tokenizer: Tokenizer,
               examples: Sequence[MQARExample], batch_size: int = 8
               ) -> list[np.ndarray]:
  """Per example, a bool per query: is the queried value the argmax of the
  model's prediction at its query key (teacher forcing)?"""
  return scoring.target_hits(
      config, variables, [encode(ex, tokenizer) for ex in examples],
      tokenizer.pad_id, batch_size)


def accuracy(config: ModelConfig, variables, tokenizer: Tokenizer,
             examples: Sequence[MQARExample], batch_size: int = 8) -> float:
  """Fraction of the queried values predicted (chance: MQARConfig.chance)."""
  return float(np.concatenate(query_hits(config, variables, tokenizer,
                                         examples, batch_size)).mean())
