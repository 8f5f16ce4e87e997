"""The paged KV cache as the model reads and writes it (generation).

Keys and values of every attention layer live in a pool of fixed-size pages
(m2jax/infer/kv_cache.py allocates them):

  pages.k[i], pages.v[i]   [P, S, K, H]: layer i's P pages of S token slots
                           (main layers first, then the MTP modules' blocks)
  block_tables [B, M]      row b's token i sits in page block_tables[b, i // S],
                           slot i % S
  kv_lens [B]              keys of row b once this call's tokens are written

A forward call with a cache feeds T new tokens per row, right-aligned: token
t of row b is at position kv_lens[b] - T + t. A row with fewer new tokens
pads on the left (`valid` False there): padded tokens are computed but their
keys go to TRASH_PAGE (page 0, never given to a sequence), so they can never
overwrite a real key, and their outputs are ignored. Rows with kv_lens 0
are whole padding rows of a batch bucket.

Attention over the cache: the paged decode kernel (kernels/paged_attention.py,
`Settings.paged_attention`) for up to DECODE_TOKENS new tokens per row
(decoding, speculative verification); a chunk of a long prompt gathers its
row's pages and runs the ordinary masked attention (`Settings.attention`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Page 0 is never allocated: padded tokens write their keys there.
TRASH_PAGE = 0
# Up to this many new tokens per row the paged decode kernel runs; longer
# chunks (prefill) gather the pages and use the ordinary attention.
DECODE_TOKENS = 16


class PagedKV(NamedTuple):
  """The page pools: one [P, S, K, H] array per attention layer, k and v."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]


class LayerCache(NamedTuple):
  """What one attention layer needs of the cache for one call."""
  k_pages: jax.Array        # [P, S, K, H]
  v_pages: jax.Array        # [P, S, K, H]
  block_tables: jax.Array   # [B, M] int32
  kv_lens: jax.Array        # [B] int32, after this call's tokens
  valid: jax.Array          # [B, T] bool, False on left padding


def positions(kv_lens_B, valid_BxT):
  """[B, T] positions of right-aligned new tokens (0 where padded)."""
  T = valid_BxT.shape[1]
  pos = kv_lens_B[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]
  return jnp.where(valid_BxT, pos, 0).astype(jnp.int32)


def write(pages_PxSxKxH, new_BxTxKxH, block_tables_BxM, positions_BxT,
          valid_BxT):
  """`pages` with the new tokens' keys (or values) written at their slots;
  padded tokens write to TRASH_PAGE."""
  S = pages_PxSxKxH.shape[1]
  M = block_tables_BxM.shape[1]
  index = jnp.clip(positions_BxT // S, 0, M - 1)
  page = jnp.take_along_axis(block_tables_BxM, index, axis=1)
  page = jnp.where(valid_BxT, page, TRASH_PAGE)
  slot = jnp.where(valid_BxT, positions_BxT % S, 0)
  return pages_PxSxKxH.at[page, slot].set(
      new_BxTxKxH.astype(pages_PxSxKxH.dtype))


def gather(pages_PxSxKxH, block_tables_BxM):
  """Each row's pages in order: [B, M * S, K, H]."""
  B, M = block_tables_BxM.shape
  _, S, K, H = pages_PxSxKxH.shape
  return jnp.take(pages_PxSxKxH, block_tables_BxM, axis=0).reshape(
      B, M * S, K, H)


def gathered_mask(kv_lens_B, positions_BxT, num_keys: int, *,
                  window: int | None = None, num_sink_tokens: int = 0):
  """[B, T, M * S] mask for the gathered keys: key j is visible to the
  token at position p iff j <= p and j < kv_len (and, with a window,
  p - j < window unless j < num_sink_tokens)."""
  j = jnp.arange(num_keys, dtype=jnp.int32)[None, None]
  p = positions_BxT[:, :, None]
  mask = (j <= p) & (j < kv_lens_B[:, None, None])
  if window is not None:
    local = (p - j) < window
    if num_sink_tokens:
      local = local | (j < num_sink_tokens)
    mask = mask & local
  return mask


def empty(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
          head_dim: int, dtype) -> PagedKV:
  """Zeroed pools for `num_layers` attention layers."""
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
  return PagedKV(zeros(), zeros())
