"""Paged decode attention in portable Pallas, lowered through Triton (the
"triton" backend of kernels/paged_attention.py).

One program per (batch row, KV head, key split), grid (B, K, splits). Its
query rows are the G heads of the KV head times the T new tokens (r =
t * G + g, padded to a power of two >= 16 for the dots), so every key block
is read once for all of them. The program walks its split's blocks of
`block_k` keys: each key's page id is gathered from the row's block table
(`tables[key // S]`) and its K and V rows from the pool (`pages[page,
key % S]`), so pages of any size S are read in blocks of block_k keys. Key
indices past the row's last key are clamped to it: neither the table
entries past the row's pages nor the unfilled slots of its last page are
ever read (whatever they hold, even NaN, cannot reach the output). Full
blocks run with no mask; the last ones (the causal edge among the new
tokens, the clamped keys) mask the logits. Online softmax in base 2; the
program writes its rows' normalised output and log-sum-exp, merged over
splits by `paged_attention.combine_splits`.

Plain refs, jnp ops and `pltriton.dot`, so `interpret=True` runs the same
code on CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite: no inf - inf
_LOG2E = math.log2(math.e)
_MIN_ROWS = 16  # Triton's dots need every dimension >= 16


def padded_rows(rows: int) -> int:
  """Query rows of a program: a power of two >= 16."""
  return max(_MIN_ROWS, 1 << (rows - 1).bit_length())


def _split_range(kv_len, block_k, splits, split):
  """[lo, hi) key blocks of `split`: the row's blocks divided evenly."""
  n_blocks = (kv_len + block_k - 1) // block_k
  per = (n_blocks + splits - 1) // splits
  lo = jnp.minimum(split * per, n_blocks)
  return lo, jnp.minimum(lo + per, n_blocks)


def _kernel(len_ref, table_ref, off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
            *, T, scale, splits, block_k, page_size):
  kv_len = len_ref[0]
  lo, hi = _split_range(kv_len, block_k, splits, pl.program_id(2))
  # Blocks before `mid` are visible to every query row: no mask.
  mid = jnp.clip(jnp.maximum(kv_len - T + 1, 0) // block_k, lo, hi)
  q = q_ref[...]
  limit = kv_len + off_ref[...]  # row r sees keys < limit[r]
  c = scale * _LOG2E

  def body(masked):
    def step(i, carry):
      acc, m, l = carry
      key = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
      stored = jnp.minimum(key, kv_len - 1)  # never past the row's pages
      page = table_ref[stored // page_size]
      k = k_ref[page, stored % page_size, :]
      v = v_ref[page, stored % page_size, :]
      s = pltriton.dot(q, k, trans_b=True) * c
      if masked:
        visible = key[None, :] < limit[:, None]
        s = jnp.where(visible, s, _NEG)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - m_new[:, None])
      if masked:  # a row with nothing visible yet has m_new == _NEG
        p = jnp.where(visible, p, 0.0)
      l = l * alpha + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
      return acc, m_new, l
    return step

  rows = q.shape[0]
  carry = (jnp.zeros(q.shape, jnp.float32),
           jnp.full((rows,), _NEG, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  carry = lax.fori_loop(lo, mid, body(False), carry)
  acc, m, l = lax.fori_loop(mid, hi, body(True), carry)
  empty = l == 0.0
  o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(l))


def partials(kv_lens, tables, row_offsets, q, k_pages, v_pages, *, T, R,
             scale, cfg):
  """Per-split results of paged attention.

  kv_lens [B] int32; tables [B, M] int32; row_offsets [rows] int32
  (`paged_attention.query_row_offsets`); q [B, K, rows, H] (query rows
  r = t * G + g, zero padding); k_pages, v_pages [P, S, K, H]; splits =
  cfg.num_splits (>= 1). Returns o [B, K, splits, rows, H] float32 (each
  split normalised over its own keys) and lse [B, K, splits, rows] float32
  (base 2; -inf: no key).
  """
  del R  # every padded row is computed; the caller keeps the first R
  B, K, rows, H = q.shape
  splits = cfg.num_splits
  P, S = k_pages.shape[:2]
  M = tables.shape[1]
  kernel = lambda *refs: _kernel(*refs, T=T, scale=scale, splits=splits,
                                 block_k=cfg.block_k, page_size=S)
  page_spec = pl.BlockSpec((P, S, None, H), lambda b, h, s: (0, 0, h, 0))
  return pl.pallas_call(
      kernel,
      grid=(B, K, splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (b,)),
          pl.BlockSpec((None, M), lambda b, h, s: (b, 0)),
          pl.BlockSpec((rows,), lambda b, h, s: (0,)),
          pl.BlockSpec((None, None, rows, H), lambda b, h, s: (b, h, 0, 0)),
          page_spec, page_spec],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, H),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows),
                       lambda b, h, s: (b, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, K, splits, rows, H), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, splits, rows), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="paged_attention",
  )(kv_lens, tables, row_offsets, q, k_pages, v_pages)
