"""TEMPORARY (gen branch): the reference only, until the kernel branch lands."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "xla", "mosaic", "triton")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig:
  backend: str = "auto"
  interpret: bool = False


def paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, *,
                              scale=None):
  B, T, N, H = q.shape
  _, S, K, _ = k_pages.shape
  M = block_tables.shape[1]
  k = jnp.take(k_pages, block_tables, axis=0).reshape(B, M * S, K, H)
  v = jnp.take(v_pages, block_tables, axis=0).reshape(B, M * S, K, H)
  scale = H ** -0.5 if scale is None else scale
  qg = q.reshape(B, T, K, N // K, H)
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k,
                 preferred_element_type=jnp.float32) * scale
  pos = kv_lens[:, None] - T + jnp.arange(T)[None]
  j = jnp.arange(M * S)
  mask = (j[None, None] <= pos[:, :, None]) & (j[None, None] < kv_lens[:, None, None])
  s = jnp.where(mask[:, None, None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1) * mask[:, None, None]
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H).astype(q.dtype)


def paged_attention(q, k_pages, v_pages, block_tables, kv_lens, *, scale=None,
                    config=None):
  del config
  return paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens,
                                   scale=scale)
