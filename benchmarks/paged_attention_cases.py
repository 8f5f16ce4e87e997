"""Paged decode attention benchmark cases (used by experiments/bench_decode.py).

A page pool and block tables as the engine keeps them (each row's pages
scattered over the pool in a random order), the candidates wrapped to one
calling convention `(q, k_pages, v_pages, block_tables, kv_lens) -> out`,
and the useful traffic of a call: the bytes of keys and values it must
read (the timer, the error metric and the copy bandwidth are
benchmarks/timing.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels import paged_attention as pa
from m2jax.settings import Settings


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  """One decode attention problem."""
  batch: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  new_tokens: int = 1  # T: 1 decoding, K + 1 verifying K drafts

  @classmethod
  def from_heads(cls, heads: str, **kw):
    """heads as "NxK", e.g. "48x8" (query heads x KV heads)."""
    n, k = (int(x) for x in heads.split("x"))
    return cls(num_heads=n, num_kv_heads=k, **kw)


def inputs(case: DecodeCase, kv_lens, *, dtype=jnp.bfloat16, seed=0):
  """(q, k_pages, v_pages, block_tables, kv_lens) on the default device:
  rows of the given lengths, each holding ceil(len / S) pages drawn
  without replacement from a pool of exactly the pages the batch needs
  (plus one), in a random order; table entries past a row's pages point at
  page 0. Random normal values, generated on the device."""
  kv_lens = np.asarray(kv_lens, np.int32)
  S = case.page_size
  used = -(-kv_lens // S)
  M = max(1, int(used.max()))
  P = int(used.sum()) + 1
  rng = np.random.default_rng(seed)
  order = rng.permutation(P)
  tables = np.zeros((case.batch, M), np.int32)
  start = 0
  for b, n in enumerate(used):
    tables[b, :n] = order[start:start + n]
    start += n
  keys = jax.random.split(jax.random.key(seed), 3)
  page_shape = (P, S, case.num_kv_heads, case.head_dim)
  q = jax.random.normal(keys[0], (case.batch, case.new_tokens,
                                  case.num_heads, case.head_dim), dtype)
  k = jax.random.normal(keys[1], page_shape, dtype)
  v = jax.random.normal(keys[2], page_shape, dtype)
  return q, k, v, jnp.asarray(tables), jnp.asarray(kv_lens)


def ragged_lengths(batch: int, max_len: int, new_tokens: int, seed=0):
  """Lengths for a correctness check: an empty padding row, a row of only
  the new tokens, the rest random (most not a multiple of any page)."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(new_tokens, max_len + 1, batch)
  lens[0], lens[min(1, batch - 1)] = 0, new_tokens
  return lens.astype(np.int32)


def kv_bytes(kv_lens, case: DecodeCase, dtype=jnp.bfloat16) -> int:
  """Bytes of keys and values one call must read; the queries and outputs
  (a few KB) are left out."""
  return int(np.sum(np.asarray(kv_lens, np.int64)) * 2 * case.num_kv_heads
             * case.head_dim * jnp.dtype(dtype).itemsize)


def config(text: str, settings: Settings = Settings(), num_splits: int = 0):
  """A PagedAttentionConfig from a --configs item ("mosaic:64.2",
  "triton:64.4.2", "xla", ...), run as `settings` says (its interpret)."""
  return settings.replace(paged_attention=pa.PagedAttentionConfig.from_string(
      text, num_splits=num_splits)).paged_attention


def ours(cfg: pa.PagedAttentionConfig):
  """The whole call the engine makes (query layout, kernel, split merge)."""
  return lambda q, k, v, t, l: pa.paged_attention(q, k, v, t, l, config=cfg)


def reference():
  return pa.paged_attention_reference


def resolved(cfg, q, k, tables) -> pa.PagedAttentionConfig:
  """The backend and split count a call with these inputs runs."""
  return pa.resolve_config(cfg, q, k, tables)


def kernel_alone(cfg, q, k, v, tables, kv_lens):
  """A thunk running the Pallas kernel of a resolved config alone, its
  arguments (the queries in the kernel's row layout) prepared beforehand:
  what the call costs without the XLA ops around the kernel. None for the
  reference."""
  if cfg.backend == "xla":
    return None
  kernel, args = pa.kernel_call(q, k, v, tables, kv_lens,
                                scale=q.shape[-1] ** -0.5, config=cfg)
  args = jax.block_until_ready(args)
  return lambda: kernel(*args)
