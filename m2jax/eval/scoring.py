"""Exact-match scoring of synthetic tasks, and a whole evaluation suite.

A prompt is answered correctly iff greedy decoding after it reproduces the
answer exactly. Teacher forcing gives that in one forward pass: greedy
decoding emits the answer iff, with the answer's prefix in context, the
argmax at every answer position is the answer's next token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.eval import tasks as tasks_lib

_MIN_PADDED_LENGTH = 128


def padded_length(longest: int) -> int:
  """Batch length for `longest` tokens: the next power of two (>= 128).

  Every distinct length is one more compile of the scoring forward; powers of
  two keep that to one per octave (3 instead of 9 for lengths 128..960) for at
  most twice the tokens, which the forward pass of an evaluation batch pays
  easily.
  """
  return max(_MIN_PADDED_LENGTH, 1 << max(0, longest - 1).bit_length())


@functools.partial(jax.jit, static_argnums=0)
def _argmax(config: ModelConfig, variables, tokens, segment_ids):
  return jnp.argmax(model.logits(config, variables, tokens,
                                 segment_ids=segment_ids), axis=-1)


def exact_match(config: ModelConfig, variables, tokenizer,
                examples: list[tasks_lib.Example], batch_size: int = 8
                ) -> np.ndarray:
  """A bool per example: does greedy decoding reproduce the answer?"""
  encoded = [([tokenizer.bos_id, *tokenizer.encode(ex.prompt)],
              list(tokenizer.encode(ex.answer))) for ex in examples]
  return exact_match_tokens(config, variables, encoded, tokenizer.pad_id,
                            batch_size)


def exact_match_tokens(config: ModelConfig, variables, encoded, pad_id: int,
                       batch_size: int = 8) -> np.ndarray:
  """Like exact_match, on (prompt ids, answer ids) pairs."""
  hits = target_hits(
      config, variables,
      [(list(p) + list(a), range(len(p), len(p) + len(a))) for p, a in encoded],
      pad_id, batch_size)
  return np.array([h.all() for h in hits], bool)


def target_hits(config: ModelConfig, variables, rows, pad_id: int,
                batch_size: int = 8) -> list[np.ndarray]:
  """Teacher-forced greedy hits on chosen tokens.

  Args:
    rows: (ids, targets) pairs: a sequence's token ids and the indices of
      the tokens to predict (each > 0).
  Returns:
    Per row, a bool per target index t: is the argmax of the prediction at
    position t - 1, with ids[:t] in context, the token ids[t]?
  """
  hits = []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    T = padded_length(max(len(ids) for ids, _ in chunk))
    tokens = np.full((batch_size, T), pad_id, np.int32)
    seg = np.zeros((batch_size, T), np.int32)
    for i, (ids, _) in enumerate(chunk):
      tokens[i, :len(ids)] = ids
      seg[i, :len(ids)] = 1
    pred = np.asarray(_argmax(config, variables, tokens, seg))
    for i, (ids, targets) in enumerate(chunk):
      targets = np.asarray(targets, np.int64)
      # Position t predicts token t + 1.
      hits.append(pred[i, targets - 1] == tokens[i, targets])
  return hits


def evaluate_tasks(config: ModelConfig, variables, tokenizer, *,
                   lengths: list[int], tasks=tasks_lib.TASKS,
                   examples_per_point: int = 16, batch_size: int = 8) -> dict:
  """{task: {length: accuracy}} on the fixed evaluation examples."""
  scores: dict[str, dict[int, float]] = {}
  for task in tasks:
    scores[task] = {}
    for length in lengths:
      examples = tasks_lib.eval_examples(task, length, examples_per_point)
      scores[task][length] = float(np.mean(
          exact_match(config, variables, tokenizer, examples, batch_size)))
  return scores
