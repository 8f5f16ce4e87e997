"""Tree attention in portable Pallas, lowered through Triton (the "triton"
backend of kernels/tree_attention.py).

Portable `pl.pallas_call` kernels: BlockSpecs, ref slicing and `plgpu.dot`, so
the same code lowers through Triton on a GPU (`plgpu.CompilerParams` picks
that backend) and runs under `interpret=True` on CPU.

  forward       grid (q block, batch, q head): loop over the q block's live
                k blocks (full ones unmasked, then partial ones masked),
                online softmax in base 2; writes out and lse (log2 domain).
  backward_dq   same grid and lists: dq = scale * sum ds @ k.
  backward_dkv  grid (k block, batch, kv head): loop over the G query heads
                of the kv head and the q blocks that read this k block;
                dv = sum p^T do, dk = scale * sum ds^T q (GQA reduction
                happens in registers, no [.., N, ..] dk buffer).
Heavy q blocks (late in the causal order) are launched first.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NEG = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


def _visible(q_idx, seg_q, k_idx, se_k, seg_k):
  """[bq, bk] tree mask of one tile from its row and column vectors."""
  return ((k_idx[None, :] <= q_idx[:, None])
          & (q_idx[:, None] < se_k[None, :])
          & (seg_q[:, None] == seg_k[None, :]))


def _log2_scores(q, k, scale, mask=None):
  """scale * q k^T in log2 units; _NEG where `mask` is False (None: none)."""
  s = plgpu.dot(q, k, trans_b=True) * (scale * _LOG2E)
  return s if mask is None else jnp.where(mask, s, _NEG)


def _k_block(q, q_idx, seg_q, k_ref, v_ref, se_ref, seg_ref, k_start,
             block_k, scale, masked):
  """The k/v block at `k_start` for one q block: (k, v, scores, mask).

  `masked` is static: full blocks skip the mask (it is None for them).
  """
  cols = pl.ds(k_start, block_k)
  k, v = k_ref[cols, :], v_ref[cols, :]
  mask = None
  if masked:
    mask = _visible(q_idx, seg_q, k_start + jnp.arange(block_k),
                    se_ref[cols], seg_ref[cols])
  return k, v, _log2_scores(q, k, scale, mask), mask


def _params(cfg, backward=False):
  if backward:
    return plgpu.CompilerParams(num_warps=cfg.num_warps_bwd,
                                num_stages=cfg.num_stages_bwd)
  return plgpu.CompilerParams(num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)


# ---------------------------------------------------------------- forward ---

def _fwd_kernel(q_ref, k_ref, v_ref, se_ref, seg_ref, list_ref, count_ref,
                o_ref, lse_ref, *, scale, block_q, block_k, num_q_blocks):
  q_start = (num_q_blocks - 1 - pl.program_id(0)) * block_q
  q = q_ref[...]
  q_idx = q_start + jnp.arange(block_q)
  seg_q = seg_ref[pl.ds(q_start, block_q)]

  def loop_body(masked):
    def body(t, carry):
      acc, m, l = carry
      k_start = pl.multiple_of(list_ref[t] * block_k, block_k)
      _, v, s, mask = _k_block(q, q_idx, seg_q, k_ref, v_ref, se_ref, seg_ref,
                               k_start, block_k, scale, masked)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - m_new[:, None])
      if masked:  # a row with nothing visible yet has m_new == _NEG
        p = jnp.where(mask, p, 0.0)
      l = l * alpha + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
      return acc, m_new, l
    return body

  n_full, n_partial = count_ref[0], count_ref[1]
  carry = (jnp.zeros(q.shape, jnp.float32),
           jnp.full((block_q,), _NEG, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(0, n_full, loop_body(False), carry)
  acc, m, l = lax.fori_loop(n_full, n_full + n_partial, loop_body(True),
                            carry)
  empty = l == 0.0
  l = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, 0.0, m + jnp.log2(l))


def _q_major_specs(T, H, G, bq, nq, list_len):
  """BlockSpecs of a (q tile, batch, head) grid, q tiles last-first (the
  longest tile lists start first): q rows, whole K/V of the head's KV head,
  per-(head, row) vectors, per-token vectors, the q tile's list and counts."""
  rev = lambda i: nq - 1 - i
  return dict(
      q=pl.BlockSpec((None, bq, None, H), lambda i, b, h: (b, rev(i), h, 0)),
      kv=pl.BlockSpec((None, T, None, H), lambda i, b, h: (b, 0, h // G, 0)),
      row=pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, rev(i))),
      tok=pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
      lists=pl.BlockSpec((None, None, list_len),
                         lambda i, b, h: (b, rev(i), 0)),
      counts=pl.BlockSpec((None, None, 2), lambda i, b, h: (b, rev(i), 0)))


def forward(q, k, v, se, seg, lists, counts, *, scale, cfg):
  """out [B, T, N, H] and lse [B, N, T] (float32, base 2)."""
  B, T, N, H = q.shape
  bq, nq = cfg.block_q, T // cfg.block_q
  sp = _q_major_specs(T, H, N // k.shape[2], bq, nq, lists.shape[-1])
  kernel = lambda *refs: _fwd_kernel(
      *refs, scale=scale, block_q=bq, block_k=cfg.block_k, num_q_blocks=nq)
  return pl.pallas_call(
      kernel,
      grid=(nq, B, N),
      in_specs=[sp["q"], sp["kv"], sp["kv"], sp["tok"], sp["tok"],
                sp["lists"], sp["counts"]],
      out_specs=[sp["q"], sp["row"]],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
      compiler_params=_params(cfg),
      interpret=cfg.interpret,
      name="tree_attention_fwd",
  )(q, k, v, se, seg, lists, counts)


# ------------------------------------------------------------ backward dq ---

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, se_ref,
               seg_ref, list_ref, count_ref, dq_ref, *, scale, block_q,
               block_k, num_q_blocks):
  q_start = (num_q_blocks - 1 - pl.program_id(0)) * block_q
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_idx = q_start + jnp.arange(block_q)
  seg_q = seg_ref[pl.ds(q_start, block_q)]

  def loop_body(masked):
    def body(t, dq):
      k_start = pl.multiple_of(list_ref[t] * block_k, block_k)
      k, v, s, _ = _k_block(q, q_idx, seg_q, k_ref, v_ref, se_ref, seg_ref,
                            k_start, block_k, scale, masked)
      p = jnp.exp2(s - lse[:, None])
      dp = plgpu.dot(do, v, trans_b=True)
      ds = p * (dp - delta[:, None])
      return dq + plgpu.dot(ds.astype(k.dtype), k)
    return body

  n_full, n_partial = count_ref[0], count_ref[1]
  dq = jnp.zeros(q.shape, jnp.float32)
  dq = lax.fori_loop(0, n_full, loop_body(False), dq)
  dq = lax.fori_loop(n_full, n_full + n_partial, loop_body(True), dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward_dq(q, k, v, do, lse, delta, se, seg, lists, counts, *, scale,
                cfg):
  B, T, N, H = q.shape
  bq, nq = cfg.block_q_dq, T // cfg.block_q_dq
  sp = _q_major_specs(T, H, N // k.shape[2], bq, nq, lists.shape[-1])
  kernel = lambda *refs: _dq_kernel(
      *refs, scale=scale, block_q=bq, block_k=cfg.block_k_dq, num_q_blocks=nq)
  return pl.pallas_call(
      kernel,
      grid=(nq, B, N),
      in_specs=[sp["q"], sp["kv"], sp["kv"], sp["q"], sp["row"], sp["row"],
                sp["tok"], sp["tok"], sp["lists"], sp["counts"]],
      out_specs=sp["q"],
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(cfg, backward=True),
      interpret=cfg.interpret,
      name="tree_attention_dq",
  )(q, k, v, do, lse, delta, se, seg, lists, counts)


# ----------------------------------------------------------- backward dkv ---

def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, se_ref,
                seg_ref, list_ref, count_ref, dk_ref, dv_ref, *, scale,
                block_q, block_k, groups):
  k_start = pl.program_id(0) * block_k
  k, v = k_ref[...], v_ref[...]
  k_idx = k_start + jnp.arange(block_k)
  se_k = se_ref[pl.ds(k_start, block_k)]
  seg_k = seg_ref[pl.ds(k_start, block_k)]
  n_full, n_partial = count_ref[0], count_ref[1]

  def head(g, carry):
    def loop_body(masked):
      def body(t, carry):
        dk, dv = carry
        q_start = pl.multiple_of(list_ref[t] * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        mask = (_visible(q_start + jnp.arange(block_q), seg_ref[rows],
                         k_idx, se_k, seg_k) if masked else None)
        s = _log2_scores(q, k, scale, mask)
        p = jnp.exp2(s - lse_ref[g, rows][:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        dp = plgpu.dot(do, v, trans_b=True)
        ds = p * (dp - delta_ref[g, rows][:, None])
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv
      return body
    carry = lax.fori_loop(0, n_full, loop_body(False), carry)
    return lax.fori_loop(n_full, n_full + n_partial, loop_body(True), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_dkv(q, k, v, do, lse, delta, se, seg, lists, counts, *, scale,
                 cfg):
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  bk, nk = cfg.block_k_dkv, T // cfg.block_k_dkv
  kernel = lambda *refs: _dkv_kernel(
      *refs, scale=scale, block_q=cfg.block_q_dkv, block_k=bk, groups=G)
  q_spec = pl.BlockSpec((None, T, G, H), lambda j, b, h: (b, 0, h, 0))
  kv_spec = pl.BlockSpec((None, bk, None, H), lambda j, b, h: (b, j, h, 0))
  row_spec = pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0))
  tok_spec = pl.BlockSpec((None, T), lambda j, b, h: (b, 0))
  return pl.pallas_call(
      kernel,
      grid=(nk, B, K),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                tok_spec, tok_spec,
                pl.BlockSpec((None, None, lists.shape[-1]),
                             lambda j, b, h: (b, j, 0)),
                pl.BlockSpec((None, None, 2), lambda j, b, h: (b, j, 0))],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(cfg, backward=True),
      interpret=cfg.interpret,
      name="tree_attention_dkv",
  )(q, k, v, do, lse, delta, se, seg, lists, counts)
