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
  correct = np.zeros(len(encoded), bool)
  for start in range(0, len(encoded), batch_size):
    chunk = encoded[start:start + batch_size]
    longest = max(len(p) + len(a) for p, a in chunk)
    T = padded_length(longest)
    tokens = np.full((batch_size, T), pad_id, np.int32)
    seg = np.zeros((batch_size, T), np.int32)
    for i, (p, a) in enumerate(chunk):
      tokens[i, :len(p) + len(a)] = list(p) + list(a)
      seg[i, :len(p) + len(a)] = 1
    pred = np.asarray(_argmax(config, variables, tokens, seg))
    for i, (p, a) in enumerate(chunk):
      # Position t predicts token t + 1; the answer starts at len(p).
      got = pred[i, len(p) - 1:len(p) - 1 + len(a)]
      correct[start + i] = np.array_equal(got, np.asarray(a))
  return correct


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
