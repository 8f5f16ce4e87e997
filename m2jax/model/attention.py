"""GQA self-attention with M2's per-layer QK norm and partial RoPE.

Order of operations (HF `MiniMaxM2Attention`): project q, k, v; RMSNorm over
the *whole* q projection (all heads at once) and over the whole k projection;
split into heads; rotate-half RoPE on the first `rotary_dim` dims of each
head; softmax attention where query head h reads KV head h // (H / KV).

Masking: causal, never across segment ids (packed documents), optionally a
sliding window on positions (i - j < window) with sink tokens (the first
`num_sink_tokens` positions of each document stay visible).

Tree layout (prefix-tree merged samples, m2jax.rl.prefix_tree): given
`subtree_end`, "causal" becomes "key j is visible to query i iff
j <= i < subtree_end[j]" (i is j or one of its descendants) and positions
are depths. Full-attention layers then run kernels/tree_attention.py with
the backend and tiles of `settings.tree_attention` (the Mosaic GPU kernels
on Hopper, the dense-mask reference on a CPU by default); sliding-window
layers use the dense mask, the window measured on depths.

Which implementation runs is `config.settings` (m2jax.settings): the
attention of ordinary rows is `settings.attention` (cuDNN or XLA).

Under a mesh whose "sequence" axis splits rows (context parallelism,
m2jax/model/context_parallel.py) each device's queries attend to the
gathered row through `shard_attention`.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from kernels.paged_attention import paged_attention
from kernels.tree_attention import tree_attention
from m2jax.config import ModelConfig
from m2jax.model import context_parallel, paged
from m2jax.model.layers import (RMSNorm, apply_partial_rope, constrain,
                                dtype_of, param_init)

_NEG_INF = -1e30


def attention_mask(segment_ids_BxT, positions_BxT, *, window: int | None,
                   num_sink_tokens: int = 0, subtree_end_BxT=None):
  """Boolean [B, T, T] mask: query i may read key j.

  Causal on the token index (so it also holds for tree layouts where
  positions are depths), same segment, and, with a window, pos_i - pos_j <
  window unless pos_j < num_sink_tokens. With `subtree_end_BxT` the causal
  part is the tree's: j <= i < subtree_end[j].
  """
  T = segment_ids_BxT.shape[1]
  idx = jnp.arange(T)
  mask = (idx[None, :, None] >= idx[None, None, :])
  if subtree_end_BxT is not None:
    mask = mask & (idx[None, :, None] < subtree_end_BxT[:, None, :])
  mask = mask & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
  if window is not None:
    dist = positions_BxT[:, :, None] - positions_BxT[:, None, :]
    local = dist < window
    if num_sink_tokens:
      local = local | (positions_BxT[:, None, :] < num_sink_tokens)
    mask = mask & local
  return mask


def dot_product_attention_xla(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
  """Reference GQA attention: float32 logits and softmax."""
  B, T, N, H = q_BxTxNxH.shape
  K = k_BxSxKxH.shape[2]
  q = q_BxTxNxH.reshape(B, T, K, N // K, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BxSxKxH,
                      preferred_element_type=jnp.float32)
  logits = logits * (H ** -0.5)
  logits = jnp.where(mask_BxTxS[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)


# The dtypes cuDNN's fused attention takes; it refuses float32.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_impl(impl: str, dtype, backend: str) -> str:
  """The implementation "auto" stands for: cuDNN flash attention on a GPU
  for half-precision inputs, else the XLA reference (CPU, and float32
  models such as the tiny preset on a GPU); an explicit choice is kept."""
  if impl != "auto":
    return impl
  half = any(jnp.dtype(dtype) == jnp.dtype(d) for d in CUDNN_DTYPES)
  return "cudnn" if backend == "gpu" and half else "xla"


def dot_product_attention(q, k, v, mask_BxTxS, *, impl: str):
  """Dispatch to cuDNN flash attention or the XLA reference
  (attention_impl says which "auto" picks)."""
  impl = attention_impl(impl, q.dtype, jax.default_backend())
  if impl == "xla":
    return dot_product_attention_xla(q, k, v, mask_BxTxS)
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask_BxTxS[:, None], implementation="cudnn")


def shard_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_segment_ids_BxT,
                    kv_segment_ids_BxS, q_positions_BxT, kv_positions_BxS,
                    q_offset, *, window: int | None, num_sink_tokens: int,
                    impl: str):
  """One context-parallel shard: T local queries (row tokens q_offset ..
  q_offset + T - 1) over the S keys of the whole row."""
  mask = context_parallel.shard_mask(
      q_segment_ids_BxT, kv_segment_ids_BxS, q_positions_BxT,
      kv_positions_BxS, q_offset=q_offset, window=window,
      num_sink_tokens=num_sink_tokens)
  return dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask,
                               impl=impl)


def _paged_attention(q, k_pages, v_pages, block_tables, kv_lens, config):
  """The paged decode kernel; under a mesh that splits heads over "tensor"
  it runs per device on its heads (a Pallas call is not partitioned by
  XLA, so it is placed by shard_map)."""
  call = functools.partial(paged_attention, config=config)
  mesh = jax.sharding.get_abstract_mesh()
  axis = nn.logical_to_mesh_axes(("act_kv_heads",))
  axis = axis[0] if axis is not None and len(axis) else None
  if (mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1
      or k_pages.shape[2] % mesh.shape[axis]):
    return call(q, k_pages, v_pages, block_tables, kv_lens)
  heads = jax.P(None, None, axis, None)
  return jax.shard_map(
      call, mesh=mesh, in_specs=(heads, heads, heads, jax.P(), jax.P()),
      out_specs=heads, check_vma=False)(q, k_pages, v_pages, block_tables,
                                        kv_lens)


class Attention(nn.Module):
  """One attention layer. `window=None` is full (causal) attention."""
  config: ModelConfig
  window: int | None = None

  @nn.compact
  def __call__(self, x_BxTxD, segment_ids_BxT, positions_BxT,
               subtree_end_BxT=None, cache: paged.LayerCache | None = None):
    """Returns (y [B, T, D], the layer's new (k_pages, v_pages) or None).

    With `cache` (generation, m2jax/model/paged.py) the T new tokens are
    right-aligned at positions kv_lens - T + t: their keys and values are
    written into the pages, and they attend to everything the row cached.
    """
    cfg = self.config
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pdt, cdt = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
    wq = self.param("q_proj", param_init(cfg, ("embed", "q_heads", "head_dim")),
                    (D, N, H), pdt)
    wk = self.param("k_proj", param_init(cfg, ("embed", "kv_heads", "head_dim")),
                    (D, K, H), pdt)
    wv = self.param("v_proj", param_init(cfg, ("embed", "kv_heads", "head_dim")),
                    (D, K, H), pdt)
    wo = self.param("o_proj", param_init(cfg, ("q_heads", "head_dim", "embed")),
                    (N, H, D), pdt)

    x = x_BxTxD.astype(cdt)
    q = jnp.einsum("btd,dnh->btnh", x, wq.astype(cdt))
    k = jnp.einsum("btd,dkh->btkh", x, wk.astype(cdt))
    v = jnp.einsum("btd,dkh->btkh", x, wv.astype(cdt))
    if cfg.use_qk_norm:
      q = RMSNorm((N, H), cfg.rms_norm_eps, ("q_heads", "head_dim"),
                  cfg.param_dtype, name="q_norm")(q)
      k = RMSNorm((K, H), cfg.rms_norm_eps, ("kv_heads", "head_dim"),
                  cfg.param_dtype, name="k_norm")(k)
    q = apply_partial_rope(q, positions_BxT, cfg.rotary_dim, cfg.rope_theta)
    k = apply_partial_rope(k, positions_BxT, cfg.rotary_dim, cfg.rope_theta)
    q = constrain(q, ("act_batch", "act_length", "act_heads", None))
    k = constrain(k, ("act_batch", "act_length", "act_kv_heads", None))
    v = constrain(v, ("act_batch", "act_length", "act_kv_heads", None))

    new_cache = None
    if cache is not None:
      out, new_cache = self._cached(q, k, v, positions_BxT, cache)
    elif context_parallel.sequence_shards() > 1:
      if subtree_end_BxT is not None:
        raise context_parallel.ContextParallelError(
            "the prefix-tree layout does not run with a mesh sequence axis")
      out = context_parallel.attention(functools.partial(
          shard_attention, window=self.window,
          num_sink_tokens=cfg.num_sink_tokens, impl=cfg.settings.attention),
          q, k, v, segment_ids_BxT, positions_BxT)
    elif subtree_end_BxT is not None and self.window is None:
      out = tree_attention(q, k, v, subtree_end_BxT, segment_ids_BxT,
                           config=cfg.settings.tree_attention)
    else:
      mask = attention_mask(segment_ids_BxT, positions_BxT,
                            window=self.window,
                            num_sink_tokens=cfg.num_sink_tokens,
                            subtree_end_BxT=subtree_end_BxT)
      out = dot_product_attention(q, k, v, mask, impl=cfg.settings.attention)
    y = jnp.einsum("btnh,nhd->btd", out, wo.astype(cdt))
    return constrain(y, ("act_batch", "act_length", "act_embed")), new_cache

  def _cached(self, q, k, v, positions_BxT, cache: paged.LayerCache):
    """Write the new keys and values, then attend over the row's cache."""
    cfg = self.config
    k_pages = paged.write(cache.k_pages, k, cache.block_tables, positions_BxT,
                          cache.valid)
    v_pages = paged.write(cache.v_pages, v, cache.block_tables, positions_BxT,
                          cache.valid)
    if self.window is None and q.shape[1] <= paged.DECODE_TOKENS:
      out = _paged_attention(q, k_pages, v_pages, cache.block_tables,
                             cache.kv_lens, cfg.settings.paged_attention)
    else:  # a prompt chunk (or a sliding window): gather the row's pages
      keys, values = (paged.gather(p, cache.block_tables)
                      for p in (k_pages, v_pages))
      mask = paged.gathered_mask(cache.kv_lens, positions_BxT, keys.shape[1],
                                 window=self.window,
                                 num_sink_tokens=cfg.num_sink_tokens)
      out = dot_product_attention(q, keys, values, mask,
                                  impl=cfg.settings.attention)
    return out, (k_pages, v_pages)
