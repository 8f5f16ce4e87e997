"""Packed rows: the batch format, next-token targets, bytes per target.

Documents (BOS + ids + EOS) are concatenated and cut into rows of `seq_len`
tokens by grain's ConcatThenSplitIterDataset. A batch is a dict of numpy arrays:

  tokens       [B, T] int32  token ids; PAD where segment_ids == 0
  segment_ids  [B, T] int32  1..n for the documents in the row, 0 for padding
  positions    [B, T] int32  position within the document, 0 at its start
  num_bytes    [B]    int32  UTF-8 bytes of the row's next-token targets (the
                             tokens where `next_token_targets(...)[1]` is True)
  row_ids      [B]    int32  the row's index in its pipeline's packed-row
                             stream, -1 for padding (m2jax/data/pipeline.py;
                             other batch makers may leave it out)

A document longer than the rest of a row is split: its continuation starts the
next row with a fresh segment id and positions restarting at 0 (it lacks BOS,
so the model sees a chunk with no preceding context). Padding only appears in
the last rows of a finite (validation) pass.

Targets are derived inside the row: the pair (t, t + k) is valid only when
both tokens lie in the same, non-padding segment. So attention masks and every
MTP depth respect document boundaries, and EOS never predicts the next BOS.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np


def next_token_targets(tokens_BxT, segment_ids_BxT, shift: int = 1):
  """Targets `shift` tokens ahead and the mask of valid (same-segment) pairs.

  Args:
    tokens_BxT: [B, T] int token ids.
    segment_ids_BxT: [B, T] int, 0 for padding.
    shift: k >= 1; 1 is the main next-token loss, k the MTP depth-k target.

  Returns:
    targets_BxT: [B, T] int32, tokens[:, t + k], 0 where t + k >= T.
    mask_BxT: [B, T] bool, True where t + k < T and
      segment_ids[:, t] == segment_ids[:, t + k] != 0.

  Pure jnp, so it runs under jit and on numpy inputs alike.
  """
  if shift < 1:
    raise ValueError(f"next_token_targets: shift must be >= 1, got {shift}")
  tokens_BxT = jnp.asarray(tokens_BxT)
  segment_ids_BxT = jnp.asarray(segment_ids_BxT)
  batch, length = tokens_BxT.shape
  pad = min(shift, length)
  ahead_tokens_BxT = jnp.concatenate(
      [tokens_BxT[:, shift:], jnp.zeros((batch, pad), tokens_BxT.dtype)],
      axis=1)
  ahead_segments_BxT = jnp.concatenate(
      [segment_ids_BxT[:, shift:],
       jnp.zeros((batch, pad), segment_ids_BxT.dtype)], axis=1)
  mask_BxT = (segment_ids_BxT == ahead_segments_BxT) & (segment_ids_BxT != 0)
  return ahead_tokens_BxT.astype(jnp.int32), mask_BxT


def target_bytes(tokens_BxT, segment_ids_BxT, byte_lengths_V) -> np.ndarray:
  """[B] int32: UTF-8 bytes of the valid next-token targets of each row.

  Bits per byte of a set of rows = sum of target nats / ln 2 / sum of this.
  """
  tokens_BxT = np.asarray(tokens_BxT)
  segment_ids_BxT = np.asarray(segment_ids_BxT)
  valid_Bx_T1 = (segment_ids_BxT[:, 1:] == segment_ids_BxT[:, :-1]) & (
      segment_ids_BxT[:, 1:] != 0)
  bytes_Bx_T1 = np.asarray(byte_lengths_V)[tokens_BxT[:, 1:]]
  return (bytes_Bx_T1 * valid_Bx_T1).sum(axis=1).astype(np.int32)


def finish_batch(packed: dict[str, np.ndarray], *, batch_size: int,
                 pad_id: int, byte_lengths_V: np.ndarray
                 ) -> dict[str, np.ndarray]:
  """Grain's packed features -> the batch format of the module docstring.

  Pads a short final batch to `batch_size` rows of padding (segment id 0) so
  that every batch has the same shape and jit compiles once.
  """
  tokens_BxT = packed["tokens"]
  segment_ids_BxT = packed["tokens_segment_ids"]
  positions_BxT = packed["tokens_positions"]
  missing = batch_size - tokens_BxT.shape[0]
  if missing:
    rows = ((0, missing), (0, 0))
    tokens_BxT = np.pad(tokens_BxT, rows)
    segment_ids_BxT = np.pad(segment_ids_BxT, rows)
    positions_BxT = np.pad(positions_BxT, rows)
  tokens_BxT = np.where(segment_ids_BxT == 0, pad_id, tokens_BxT)
  return {
      "tokens": tokens_BxT.astype(np.int32),
      "segment_ids": segment_ids_BxT.astype(np.int32),
      "positions": positions_BxT.astype(np.int32),
      "num_bytes": target_bytes(tokens_BxT, segment_ids_BxT, byte_lengths_V),
  }


def single_document_batch(tokens_BxT) -> dict[str, np.ndarray]:
  """A train-step batch whose every row is one whole document (benchmarks,
  synthetic tasks): segment 1 everywhere, positions 0..T-1, one byte a token.
  """
  tokens_BxT = np.asarray(tokens_BxT, np.int32)
  B, T = tokens_BxT.shape
  return {"tokens": tokens_BxT,
          "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
          "num_bytes": np.full((B,), T, np.int32)}


def restore_state_types(state: Any) -> Any:
  """Undoes what a JSON round trip does to a grain iterator state.

  grain 0.2.18's ConcatThenSplit compares its `remainder_slices` with a tuple
  sentinel, so after JSON turns them into lists a restore would wrongly see a
  remainder. Other values survive JSON unchanged.
  """
  if isinstance(state, dict):
    return {k: ({f: tuple(s) for f, s in v.items()}
                if k == "remainder_slices" else restore_state_types(v))
            for k, v in state.items()}
  if isinstance(state, list):
    return [restore_state_types(v) for v in state]
  return state
