"""Blockwise (flash) attention in plain XLA: packed rows, no [T, S] array.

The portable long-row attention: any backend, any head dim and dtype, with
sliding windows and sink tokens, where the Pallas tree kernels
(kernels/tree_attention.py) do not apply. Key j (global index kv_offset +
j) is visible to query i (global index q_offset + i) iff

    j <= i,  segment_ids[i] == kv_segment_ids[j],
    i < subtree_end[j]                          (if subtree_end is given),
    pos[i] - kv_pos[j] < window or kv_pos[j] < num_sink_tokens
                                                (if window is given)

which is m2jax.model.attention.attention_mask on a square row. The row is
cut into query blocks of `block_q` and key blocks of `block_k`; each query
block runs an online softmax over the key blocks that can hold a visible
key (from the block's first key of its segments to its last query), so the
largest arrays are [B, N, block_q, block_k] float32 scores. The backward
pass is a custom VJP that recomputes each tile's probabilities from the
saved log-sum-exp (FlashAttention-2's recurrence): dQ per query block, dK
and dV accumulated into float32 [B, S, K, H].

Offsets let a caller hold a slice of a longer row: a sequence-parallel
shard passes its queries with q_offset = the global index of its first
query, and the (gathered) keys with kv_offset, kv_segment_ids and
kv_positions.

  out_BxTxNxH = blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH,
                                    segment_ids_BxT, positions_BxT,
                                    window=None)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30
# Segment ids of the padding that rounds T and S up to the block sizes:
# a padded key matches no query, a padded query no key.
_PAD_Q = np.iinfo(np.int32).min + 1
_PAD_K = np.iinfo(np.int32).min


def visible(q_idx_T, k_idx_S, seg_q_BxT, seg_k_BxS, pos_q_BxT, pos_k_BxS,
            se_k_BxS=None, *, window: int | None, num_sink_tokens: int = 0):
  """Boolean [B, T, S]: query i may read key j (module docstring); indices
  are global token indices."""
  i, j = q_idx_T[None, :, None], k_idx_S[None, None, :]
  mask = (j <= i) & (seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :])
  if se_k_BxS is not None:
    mask = mask & (i < se_k_BxS[:, None, :])
  if window is not None:
    local = (pos_q_BxT[:, :, None] - pos_k_BxS[:, None, :]) < window
    if num_sink_tokens:
      local = local | (pos_k_BxS[:, None, :] < num_sink_tokens)
    mask = mask & local
  return mask


# ----------------------------------------------------------------- blocks ---

def _first_key_of_segment(seg_q_BxT, seg_k_BxS):
  """[B, T]: the smallest key index whose segment is query i's (S if none),
  exact for any layout (segments need not be contiguous)."""
  S = seg_k_BxS.shape[1]

  def row(seg_q, seg_k):
    order = jnp.argsort(seg_k, stable=True)
    sorted_k = seg_k[order]
    at = jnp.minimum(jnp.searchsorted(sorted_k, seg_q), S - 1)
    return jnp.where(sorted_k[at] == seg_q, order[at], S)

  return jax.vmap(row)(seg_q_BxT, seg_k_BxS).astype(jnp.int32)


def _key_block_ranges(seg_q, seg_k, q_offset, kv_offset, bq, bk):
  """[nq] first and one-past-last key block each query block must visit:
  no visible key lies outside them (a visible key shares the query's
  segment, so it is at or after the segment's first key, and is causal)."""
  B, Tp = seg_q.shape
  nq, nk = Tp // bq, seg_k.shape[1] // bk
  first = _first_key_of_segment(seg_q, seg_k)                    # [B, Tp]
  first = jnp.where(seg_q == _PAD_Q, seg_k.shape[1], first)
  lo = first.reshape(B, nq, bq).min(axis=(0, 2)) // bk
  last_q = q_offset + (jnp.arange(nq) + 1) * bq - 1              # global
  hi = jnp.clip((last_q - kv_offset) // bk + 1, 0, nk)
  return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _tile(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


class _Row:
  """One call's padded inputs, cut into tiles."""

  def __init__(self, seg_q, seg_k, pos_q, pos_k, se_k, q_offset, kv_offset,
               window, sinks, bq, bk):
    self.seg_q, self.seg_k, self.pos_q, self.pos_k = seg_q, seg_k, pos_q, pos_k
    self.se_k, self.q_offset, self.kv_offset = se_k, q_offset, kv_offset
    self.window, self.sinks, self.bq, self.bk = window, sinks, bq, bk

  def mask(self, i, j):
    """[B, 1, 1, bq, bk] of query block i and key block j."""
    bq, bk = self.bq, self.bk
    se = None if self.se_k is None else _tile(self.se_k, j * bk, bk)
    m = visible(self.q_offset + i * bq + jnp.arange(bq),
                self.kv_offset + j * bk + jnp.arange(bk),
                _tile(self.seg_q, i * bq, bq), _tile(self.seg_k, j * bk, bk),
                _tile(self.pos_q, i * bq, bq), _tile(self.pos_k, j * bk, bk),
                se, window=self.window, num_sink_tokens=self.sinks)
    return m[:, None, None]


def _scores(qi, kj, scale):
  """[B, K, G, bq, bk] float32 logits of a query tile [B, bq, K, G, H]."""
  return jnp.einsum("bqkgh,bskh->bkgqs", qi, kj,
                    preferred_element_type=jnp.float32) * scale


def _forward(q, k, v, row: _Row, lo, hi, scale):
  """(out [B, Tp, N, H] in q's dtype, lse [nq, B, K, G, bq] float32)."""
  B, Tp, N, H = q.shape
  K, bq, bk = k.shape[2], row.bq, row.bk
  G, nq = N // K, Tp // bq
  qg = q.reshape(B, Tp, K, G, H)

  def q_block(i):
    qi = _tile(qg, i * bq, bq)

    def body(j, carry):
      m, l, acc = carry
      vis = row.mask(i, j)
      s = jnp.where(vis, _scores(qi, _tile(k, j * bk, bk), scale), _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype),
                      _tile(v, j * bk, bk), preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((B, K, G, bq), _NEG, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo[i], hi[i], body, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None],
                    0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return jnp.einsum("bkgqh->bqkgh", out).astype(q.dtype), lse

  out, lse = jax.lax.map(q_block, jnp.arange(nq))     # [nq, B, bq, K, G, H]
  out = jnp.moveaxis(out, 0, 1).reshape(B, Tp, N, H)
  return out, lse


def _backward(q, k, v, row: _Row, lo, hi, scale, out, lse, do):
  B, Tp, N, H = q.shape
  K, bq, bk = k.shape[2], row.bq, row.bk
  G, nq = N // K, Tp // bq
  qg, dog = q.reshape(B, Tp, K, G, H), do.reshape(B, Tp, K, G, H)
  delta = jnp.einsum("btkgh,btkgh->bkgt", out.reshape(qg.shape).astype(
      jnp.float32), dog.astype(jnp.float32))                  # [B, K, G, Tp]

  def q_block(i, carry):
    dq, dk, dv = carry
    qi, doi = _tile(qg, i * bq, bq), _tile(dog, i * bq, bq)
    lse_i = lse[i][..., None]
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)[..., None]

    def body(j, c):
      dqi, dk, dv = c
      kj, vj = _tile(k, j * bk, bk), _tile(v, j * bk, bk)
      p = jnp.where(row.mask(i, j),
                    jnp.exp(_scores(qi, kj, scale) - lse_i), 0.0)
      dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj,
                      preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_i) * scale).astype(q.dtype)
      dqi = dqi + jnp.einsum("bkgqs,bskh->bqkgh", ds, kj,
                             preferred_element_type=jnp.float32)
      dkj = jnp.einsum("bkgqs,bqkgh->bskh", ds, qi,
                       preferred_element_type=jnp.float32)
      dvj = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), doi,
                       preferred_element_type=jnp.float32)
      dk = jax.lax.dynamic_update_slice_in_dim(
          dk, _tile(dk, j * bk, bk) + dkj, j * bk, axis=1)
      dv = jax.lax.dynamic_update_slice_in_dim(
          dv, _tile(dv, j * bk, bk) + dvj, j * bk, axis=1)
      return dqi, dk, dv

    dqi = jnp.zeros((B, bq, K, G, H), jnp.float32)
    dqi, dk, dv = jax.lax.fori_loop(lo[i], hi[i], body, (dqi, dk, dv))
    dq = jax.lax.dynamic_update_slice_in_dim(dq, dqi, i * bq, axis=1)
    return dq, dk, dv

  zeros_kv = jnp.zeros(k.shape, jnp.float32)
  dq, dk, dv = jax.lax.fori_loop(
      0, nq, q_block, (jnp.zeros(qg.shape, jnp.float32), zeros_kv, zeros_kv))
  return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype),
          dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13, 14))
def _attention(q, k, v, seg_q, seg_k, pos_q, pos_k, se_k, q_offset,
               kv_offset, scale, window, sinks, bq, bk):
  return _attention_fwd(q, k, v, seg_q, seg_k, pos_q, pos_k, se_k, q_offset,
                        kv_offset, scale, window, sinks, bq, bk)[0]


def _attention_fwd(q, k, v, seg_q, seg_k, pos_q, pos_k, se_k, q_offset,
                   kv_offset, scale, window, sinks, bq, bk):
  row = _Row(seg_q, seg_k, pos_q, pos_k, se_k, q_offset, kv_offset, window,
             sinks, bq, bk)
  lo, hi = _key_block_ranges(seg_q, seg_k, q_offset, kv_offset, bq, bk)
  out, lse = _forward(q, k, v, row, lo, hi, scale)
  # The key-block ranges are saved ([T / bq] each), not searched for again.
  res = (q, k, v, seg_q, seg_k, pos_q, pos_k, se_k, q_offset, kv_offset, out,
         lse, lo, hi)
  return out, res


def _attention_bwd(scale, window, sinks, bq, bk, res, do):
  (q, k, v, seg_q, seg_k, pos_q, pos_k, se_k, q_offset, kv_offset, out, lse,
   lo, hi) = res
  row = _Row(seg_q, seg_k, pos_q, pos_k, se_k, q_offset, kv_offset, window,
             sinks, bq, bk)
  dq, dk, dv = _backward(q, k, v, row, lo, hi, scale, out, lse, do)
  return dq, dk, dv, None, None, None, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad(x, n, value):
  """`x` padded along axis 1 to length n with `value`."""
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, n - x.shape[1])
  return jnp.pad(x, widths, constant_values=value)


def blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT,
                        positions_BxT, *, kv_segment_ids_BxS=None,
                        kv_positions_BxS=None, subtree_end_BxS=None,
                        window: int | None = None, num_sink_tokens: int = 0,
                        q_offset=0, kv_offset=0, block_q: int = 512,
                        block_k: int = 512, scale: float | None = None):
  """Attention under the packed-row mask of the module docstring.

  Args:
    q_BxTxNxH: queries; k_BxSxKxH, v_BxSxKxH: keys, values (N % K == 0;
      query head h reads KV head h // (N / K)).
    segment_ids_BxT, positions_BxT: the queries' segment ids and positions
      (positions matter only with a window).
    kv_segment_ids_BxS, kv_positions_BxS: the keys'; default the queries'
      (a square row).
    subtree_end_BxS: optional prefix-tree intervals of the keys (global
      indices), as kernels/tree_attention.py.
    window, num_sink_tokens: sliding window on positions, sink positions.
    q_offset, kv_offset: global index of the first query and key (ints or
      traced int32 scalars).
    block_q, block_k: tile sizes (rounded down to T and S when larger).
  Returns:
    [B, T, N, H] in q's dtype; a query that sees no key gets zeros.
  """
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1:3]
  if N % K:
    raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads={K}")
  scale = float(H ** -0.5 if scale is None else scale)
  seg_k = segment_ids_BxT if kv_segment_ids_BxS is None else kv_segment_ids_BxS
  pos_k = positions_BxT if kv_positions_BxS is None else kv_positions_BxS
  bq, bk = min(block_q, T), min(block_k, S)
  Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
  q = _pad(q_BxTxNxH, Tp, 0)
  k, v = _pad(k_BxSxKxH, Sp, 0), _pad(v_BxSxKxH, Sp, 0)
  seg_q = _pad(segment_ids_BxT.astype(jnp.int32), Tp, _PAD_Q)
  seg_k = _pad(seg_k.astype(jnp.int32), Sp, _PAD_K)
  pos_q = _pad(positions_BxT.astype(jnp.int32), Tp, 0)
  pos_k = _pad(pos_k.astype(jnp.int32), Sp, 0)
  se_k = (None if subtree_end_BxS is None
          else _pad(subtree_end_BxS.astype(jnp.int32), Sp, 0))
  out = _attention(q, k, v, seg_q, seg_k, pos_q, pos_k, se_k,
                   jnp.asarray(q_offset, jnp.int32),
                   jnp.asarray(kv_offset, jnp.int32), scale, window,
                   int(num_sink_tokens), bq, bk)
  return out[:, :T]
