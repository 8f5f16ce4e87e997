"""Associative recall: can a model config learn content-based retrieval?

Each sequence lists `pairs` random two-letter keys with two-digit values
("ab:12 cd:34 ..."), then every key again in a new order with its value: the
second occurrence of each value can only be predicted by finding its key
earlier in the sequence (induction-style retrieval, the skill behind the
needle-in-a-haystack tasks of m2jax.eval.tasks). Token ids are the raw
bytes of the text, so a row reads back with `bytes(row[1:])`.
experiments.recall_check trains on fresh batches and reports the accuracy on
the queried value digits (0.1 is chance).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.data import single_document_batch

# Every row starts with id 1: a control byte the key/value text never holds.
_COLON, _SPACE, _BOS = ord(":"), ord(" "), 1
# Value digits are uniform over 0-9: the accuracy of a model that cannot
# retrieve and guesses.
CHANCE_ACCURACY = 0.1
# Keys are two lowercase letters, distinct within a sequence.
MAX_PAIRS = 26 * 26
# A pass must also clear chance by this many standard errors of the
# accuracy a guesser gets on the same number of digits (noise).
PASS_STANDARD_ERRORS = 3.0


def recall_batch(rng: np.random.Generator, batch_size: int, pairs: int
                 ) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """A train-step batch of recall sequences and its query mask.

  Args:
    rng: numpy generator drawing the keys, values and query order.
    batch_size: B, sequences in the batch.
    pairs: key-value pairs per sequence; T = 1 + 12 * pairs tokens.
  Returns:
    (batch, mask_BxT): `single_document_batch` of the [B, T] byte ids, and a
    bool mask marking the value digits of the second (queried) listing.
  """
  rows, masks = [], []
  for _ in range(batch_size):
    keys = set()
    while len(keys) < pairs:
      keys.add(tuple(rng.integers(ord("a"), ord("z") + 1, 2)))
    keys = list(keys)
    values = [tuple(rng.integers(ord("0"), ord("9") + 1, 2)) for _ in keys]
    tokens, mask = [_BOS], [0]
    for k, v in zip(keys, values):
      tokens += [*k, _COLON, *v, _SPACE]
      mask += [0] * 6
    for i in rng.permutation(pairs):
      tokens += [*keys[i], _COLON, *values[i], _SPACE]
      mask += [0, 0, 0, 1, 1, 0]
    rows.append(tokens)
    masks.append(mask)
  return single_document_batch(rows), np.asarray(masks, bool)


def recall_accuracy(config: ModelConfig, variables, batch: dict,
                    mask_BxT: np.ndarray) -> float:
  """Fraction of the queried value digits that greedy next-token prediction
  gets right (teacher forcing; 0.1 is chance)."""
  logits_BxTxV = model.logits(config, variables, batch["tokens"],
                              segment_ids=batch["segment_ids"])
  pred_BxT = np.asarray(jnp.argmax(logits_BxTxV, -1))
  # Position t predicts token t + 1.
  hit_BxTm1 = pred_BxT[:, :-1] == batch["tokens"][:, 1:]
  return float(hit_BxTm1[mask_BxT[:, 1:]].mean())


def recall_verdict(accuracy: float, digits: int, margin: float, *,
                   chance: float = CHANCE_ACCURACY) -> tuple[bool, str]:
  """(passed, one line saying why) for a held-out accuracy on `digits`
  queried targets (value digits here; MQAR's values: m2jax.eval.mqar).

  Passes when the accuracy is at least `chance` plus the larger of `margin`
  and PASS_STANDARD_ERRORS standard errors of a guesser's accuracy on as
  many targets, so a pass is retrieval, not a lucky draw.
  """
  noise = PASS_STANDARD_ERRORS * np.sqrt(chance * (1 - chance)
                                         / max(digits, 1))
  threshold = chance + max(margin, noise)
  passed = accuracy >= threshold
  return passed, (
      f"{'PASS' if passed else 'FAIL'}: held-out recall accuracy "
      f"{accuracy:.3f} {'>=' if passed else '<'} {threshold:.3f} = chance "
      f"{chance:.3f} + max(margin {margin:.2f}, "
      f"{PASS_STANDARD_ERRORS:g} standard errors over {digits} targets "
      f"{noise:.3f})")
