"""Decode attention over a paged KV cache: the generation engine's attention.

The engine keeps keys and values in a pool of fixed-size pages,

  k_pages_PxSxKxH, v_pages_PxSxKxH   P pages of S token slots, K KV heads,

and gives each sequence a row of page ids (a block table): token i of row b
lives in page block_tables[b, i // S], slot i % S. A decode step appends T
new tokens per row (T = 1 plain decoding; T = K + 1 when verifying K
speculative drafts) and attends them to the row's kv_lens[b] cached keys,
the new ones last:

  paged_attention(q_BxTxNxH, k_pages, v_pages, block_tables_BxM, kv_lens_B)
      -> out_BxTxNxH

Query t of row b sits at absolute position kv_lens[b] - T + t and sees keys
0 .. that position (causal among the new tokens). Rows with kv_lens == 0
(padding of a batch bucket) give zeros; kv_lens[b] < T is invalid input
(not checked on device). GQA: query head h reads KV head h // (N / K).

Decode reads every cached byte once per step and does little arithmetic
per byte, so the kernels are built around bandwidth: the G = N / K query
heads of a KV head and the T new tokens form the G * T rows of one program,
so each page is read once for all of them; and each row's keys are split
into `num_splits` ranges run by separate programs (so batch 8 at 32K
context fills the GPU), whose partial results are merged with their
log-sum-exp (`combine_splits`). Softmax and accumulation are float32.

Backends (PagedAttentionConfig.backend), named as in kernels/gmm.py:
  "mosaic"  kernels/paged_attention_mosaic.py: Pallas Mosaic GPU for Hopper
            (TMA page loads addressed through the block table, a ring of
            shared-memory slots fed by a producer warpgroup, wgmma).
  "triton"  kernels/paged_attention_triton.py: portable Pallas (Triton
            lowering; also runs in the interpreter on CPU).
  "xla"     paged_attention_reference: gathers the pages, dense mask.
  "auto"    mosaic on Hopper where it applies, triton on other GPUs, xla
            without a GPU (triton when interpret=True).
Forward only: decoding needs no gradient.

Example:
  out = paged_attention(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                        block_tables_BxM, kv_lens_B)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import paged_attention_mosaic as _mosaic
from kernels import paged_attention_triton as _triton

BACKENDS = ("auto", "xla", "mosaic", "triton")
# The fields a tile string (PagedAttentionConfig.from_string) sets, in order.
_MOSAIC_TILES = ("mosaic_block_k", "mosaic_stages")
_TRITON_TILES = ("block_k", "num_warps", "num_stages")
# Streaming multiprocessors assumed when the device does not say (H100 SXM).
_DEFAULT_SMS = 132
# Automatic splits give every split at least this many key blocks, so the
# partial results stay small next to the keys each split reads.
_MIN_BLOCKS_PER_SPLIT = 4
# Automatic splits aim at this fraction of the GPU's SMs busy in every wave.
_WAVE_EFFICIENCY = 0.9


def _power_of_two(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig:
  """Which kernel, how the keys are split, and its tiles.

  Frozen and hashable: the jitted kernels take it as a static argument, so
  it is part of their cache key.

  backend: "auto", "xla", "mosaic" or "triton" (module docstring).
  num_splits: key ranges per (row, KV head), each its own program, merged
    by log-sum-exp; each row's keys are divided evenly over them, so a
    short row in a batch of long ones is still spread over all splits.
    0 picks a count per shape (`splits_for`: enough programs to keep the
    GPU's SMs busy in whole waves).
  block_k, num_warps, num_stages: the triton kernel's keys per loop step
    (a power of two >= 16) and launch parameters.
  mosaic_block_k: the mosaic kernel's keys per pipeline step, 64 or 128
    (the wgmma N of q k^T and the contraction of p v).
  mosaic_stages: shared-memory slots per compute warpgroup (>= 1); the ring
    holds 2 * mosaic_stages steps of K and V in flight.
  interpret: run the Pallas kernels in Pallas' interpreters (CPU tests).
  """
  backend: str = "auto"
  num_splits: int = 0
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  mosaic_block_k: int = 64
  mosaic_stages: int = 2
  interpret: bool = False

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"paged attention backend must be one of {BACKENDS}, "
                       f"got {self.backend!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"paged attention interpret must be True or False, "
                       f"got {self.interpret!r}")
    if not isinstance(self.num_splits, int) or self.num_splits < 0:
      raise ValueError(f"PagedAttentionConfig.num_splits must be an integer "
                       f">= 0 (0: automatic), got {self.num_splits!r}")
    if not _power_of_two(self.block_k) or self.block_k < 16:
      raise ValueError(f"PagedAttentionConfig.block_k must be a power of two "
                       f">= 16, got {self.block_k}")
    if not _power_of_two(self.num_warps):
      raise ValueError(f"PagedAttentionConfig.num_warps must be a power of "
                       f"two, got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"PagedAttentionConfig.num_stages must be >= 1, got "
                       f"{self.num_stages}")
    if self.mosaic_block_k not in (64, 128):
      raise ValueError(f"PagedAttentionConfig.mosaic_block_k must be 64 or "
                       f"128, got {self.mosaic_block_k}")
    if self.mosaic_stages < 1:
      raise ValueError(f"PagedAttentionConfig.mosaic_stages must be >= 1, got "
                       f"{self.mosaic_stages}")

  @classmethod
  def from_string(cls, text: str, *, num_splits: int = 0,
                  interpret: bool = False):
    """A config from its short form, as benchmarks and flags write it:
    "mosaic:BLOCK_K.STAGES", "triton:BLOCK_K.WARPS.STAGES", or a bare
    backend name (its default tiles)."""
    if text in BACKENDS:
      return cls(backend=text, num_splits=num_splits, interpret=interpret)
    backend, _, tiles = text.partition(":")
    names = {"mosaic": _MOSAIC_TILES, "triton": _TRITON_TILES}.get(backend)
    if names is None:
      raise ValueError(f"paged attention tiles: unknown backend {backend!r} "
                       f"in {text!r} (mosaic:... or triton:...)")
    try:
      values = [int(x) for x in tiles.split(".")]
    except ValueError:
      raise ValueError(f"paged attention tiles: {text!r} is not "
                       f"BACKEND:N.N...") from None
    if len(values) != len(names):
      raise ValueError(f"paged attention tiles: {text!r} gives {len(values)} "
                       f"numbers for {backend}'s {len(names)}: {names}")
    return cls(backend=backend, num_splits=num_splits, interpret=interpret,
               **dict(zip(names, values)))

  @property
  def keys_per_step(self) -> int:
    return self.mosaic_block_k if self.backend == "mosaic" else self.block_k


# ------------------------------------------------------------- reference ---

def paged_attention_reference(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                              block_tables_BxM, kv_lens_B, *, scale=None):
  """Pure jnp: gathers each row's pages into [B, M * S, K, H], dense mask,
  float32 logits, softmax and products (HIGHEST precision, so no TF32 on a
  GPU). Keys past kv_lens are dropped from the values too, so whatever the
  pool holds there (even NaN) cannot reach the output."""
  B, T, N, H = q_BxTxNxH.shape
  _, S, K, _ = k_pages_PxSxKxH.shape
  M = block_tables_BxM.shape[1]
  G = N // K
  scale = H ** -0.5 if scale is None else scale
  f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
  k_BxLxKxH = k_pages_PxSxKxH[block_tables_BxM].reshape(B, M * S, K, H)
  v_BxLxKxH = v_pages_PxSxKxH[block_tables_BxM].reshape(B, M * S, K, H)
  key_L = jnp.arange(M * S)
  kv_lens_B = kv_lens_B.astype(jnp.int32)
  pos_BxT = kv_lens_B[:, None] - T + jnp.arange(T)  # each query's position
  visible_BxTxL = key_L[None, None, :] <= pos_BxT[:, :, None]
  stored_BxL = key_L[None, :] < kv_lens_B[:, None]
  v_BxLxKxH = jnp.where(stored_BxL[:, :, None, None],
                        v_BxLxKxH.astype(f32), 0.0)
  q_BxTxKxGxH = q_BxTxNxH.reshape(B, T, K, G, H).astype(f32)
  logits = jnp.einsum("btkgh,blkh->bkgtl", q_BxTxKxGxH,
                      k_BxLxKxH.astype(f32), precision=hi) * scale
  mask = visible_BxTxL[:, None, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l == 0.0, 1.0, l)  # rows that see nothing give zeros
  out = jnp.einsum("bkgtl,blkh->btkgh", p, v_BxLxKxH, precision=hi)
  return out.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)


# -------------------------------------------------- split key ranges ---

def combine_splits(o_BxKxXxRxH, lse_BxKxXxR):
  """Merges X partial results per (row, KV head, query row): each is
  normalised over its own keys, with lse its base-2 log-sum-exp of the
  scaled logits (-inf for a split that saw no key). Returns [B, K, R, H]
  float32; rows that saw no key in any split give zeros."""
  m = jnp.max(lse_BxKxXxR, axis=2, keepdims=True)
  w = jnp.exp2(lse_BxKxXxR - jnp.where(jnp.isfinite(m), m, 0.0))
  total = jnp.sum(w, axis=2)
  out = jnp.einsum("bkxr,bkxrh->bkrh", w, o_BxKxXxRxH,
                   precision=jax.lax.Precision.HIGHEST)
  return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def _num_sms() -> int:
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    return _DEFAULT_SMS
  return int(getattr(gpu, "core_count", 0) or _DEFAULT_SMS)


def splits_for(programs: int, max_keys: int, keys_per_step: int,
               num_sms: int | None = None) -> int:
  """Automatic num_splits. `programs` (rows x KV heads x row blocks) times
  the splits are the kernel's programs; with equal rows they finish
  together, so the GPU is used as well as its SMs are filled in the last
  wave. The smallest count whose waves are at least _WAVE_EFFICIENCY full
  (B = 8, K = 2 on 132 SMs: 8 splits, 128 programs), else the count with
  the fullest waves; each split keeps at least _MIN_BLOCKS_PER_SPLIT key
  blocks of the longest possible row (M * S keys)."""
  sms = _num_sms() if num_sms is None else num_sms
  most = max(1, -(-max_keys // keys_per_step) // _MIN_BLOCKS_PER_SPLIT)

  def efficiency(s):
    total = programs * s
    return total / (-(-total // sms) * sms)
  for s in range(1, most + 1):
    if efficiency(s) >= _WAVE_EFFICIENCY:
      return s
  return max(range(1, most + 1), key=lambda s: (efficiency(s), s))


# ------------------------------------------------------------ dispatch ---

# Each kernel behind one jit: every layer calling it with the same shapes
# shares one traced jaxpr, lowered once per program (as in kernels/gmm.py).
_STATIC = ("T", "R", "scale", "cfg")
_KERNELS = {"mosaic": jax.jit(_mosaic.partials, static_argnames=_STATIC),
            "triton": jax.jit(_triton.partials, static_argnames=_STATIC)}


def mosaic_supported(dtypes, head_dim: int, page_size: int) -> bool:
  """The Mosaic kernel takes q, k, v of one 16-bit dtype (wgmma), head_dim
  64 or 128 (one or two 128-byte swizzled rows) and pages of a multiple of
  8 slots (TMA copies land on 8-row shared-memory tiles)."""
  dts = {jnp.dtype(d) for d in dtypes}
  return (len(dts) == 1
          and dts <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and head_dim in (64, 128) and page_size % 8 == 0)


def triton_supported(head_dim: int) -> bool:
  """Triton tiles are powers of two, and its dots need dimensions >= 16."""
  return _power_of_two(head_dim) and head_dim >= 16


def _on_hopper() -> bool:
  """wgmma is sm_90 only (Blackwell has tcgen05 instead)."""
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return str(getattr(gpu, "compute_capability", "")).startswith("9.")


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _resolve_backend(cfg, dtypes, head_dim, page_size):
  mosaic_ok = mosaic_supported(dtypes, head_dim, page_size)
  triton_ok = triton_supported(head_dim)
  if cfg.backend == "auto":
    if not cfg.interpret and not _on_gpu():
      backend = "xla"
    elif mosaic_ok and not cfg.interpret and _on_hopper():
      backend = "mosaic"
    else:
      backend = "triton" if triton_ok else "xla"
    return dataclasses.replace(cfg, backend=backend)
  if cfg.backend == "mosaic" and not mosaic_ok:
    raise ValueError(
        f"paged attention backend='mosaic' needs q, k, v of one dtype, bf16 "
        f"or f16, head_dim 64 or 128 and a page size that is a multiple of "
        f"8; got {[jnp.dtype(d).name for d in dtypes]}, head_dim={head_dim}, "
        f"page_size={page_size} (use backend='triton' or 'auto')")
  if cfg.backend == "triton" and not triton_ok:
    raise ValueError(f"paged attention backend='triton' needs a head_dim "
                     f"that is a power of two >= 16, got {head_dim}")
  return cfg


def _check_shapes(q, k_pages, v_pages, block_tables, kv_lens):
  if q.ndim != 4 or k_pages.ndim != 4:
    raise ValueError(f"paged attention expects q [B, T, N, H] and pages "
                     f"[P, S, K, H]; got {q.shape} and {k_pages.shape}")
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f"paged attention: k_pages {k_pages.dtype} "
                     f"{k_pages.shape} and v_pages {v_pages.dtype} "
                     f"{v_pages.shape} differ")
  B, T, N, H = q.shape
  _, S, K, Hk = k_pages.shape
  if Hk != H:
    raise ValueError(f"paged attention: q head_dim {H} != pages' {Hk}")
  if N % K:
    raise ValueError(f"paged attention: num_heads={N} must be a multiple of "
                     f"num_kv_heads={K}")
  if not _power_of_two(S):
    raise ValueError(f"paged attention: page size {S} must be a power of two")
  if (block_tables.ndim != 2 or block_tables.shape[0] != B
      or not jnp.issubdtype(block_tables.dtype, jnp.integer)):
    raise ValueError(f"paged attention: block_tables must be integers "
                     f"[B={B}, M], got {block_tables.dtype} "
                     f"{block_tables.shape}")
  if kv_lens.shape != (B,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
    raise ValueError(f"paged attention: kv_lens must be integers [B={B}], "
                     f"got {kv_lens.dtype} {kv_lens.shape}")
  if T > block_tables.shape[1] * S:
    raise ValueError(f"paged attention: {T} new tokens per row do not fit "
                     f"{block_tables.shape[1]} pages of {S}")


def query_row_offsets(T: int, G: int, rows: int) -> np.ndarray:
  """Per query row r = t * G + g of a (row, KV head) program: key j is
  visible iff j < kv_len + offset[r], offset = min(t, T - 1) - T + 1.
  Padding rows (t >= T) see every stored key, so they stay finite."""
  t = np.minimum(np.arange(rows) // G, T - 1)
  return (t - T + 1).astype(np.int32)


def _rows(backend: str, R: int) -> int:
  """Query rows a (batch row, KV head) is padded to for `backend`."""
  return (_mosaic.padded_rows(R) if backend == "mosaic"
          else _triton.padded_rows(R))


def resolve_config(config, q_BxTxNxH, k_pages_PxSxKxH, block_tables_BxM):
  """The config a call with these arguments runs: backend chosen ("auto"
  resolved) and, for the Pallas backends, num_splits fixed (0 resolved by
  `splits_for`). Raises the one-line errors of bad shapes and of a backend
  that cannot take them."""
  cfg = PagedAttentionConfig() if config is None else config
  B, T, N, H = q_BxTxNxH.shape
  _, S, K, _ = k_pages_PxSxKxH.shape
  cfg = _resolve_backend(cfg, (q_BxTxNxH.dtype, k_pages_PxSxKxH.dtype), H, S)
  if cfg.backend == "xla" or cfg.num_splits:
    return cfg
  row_blocks = (_rows("mosaic", T * (N // K)) // _mosaic.ROWS
                if cfg.backend == "mosaic" else 1)
  splits = splits_for(B * K * row_blocks, block_tables_BxM.shape[1] * S,
                      cfg.keys_per_step)
  return dataclasses.replace(cfg, num_splits=splits)


def paged_attention(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                    block_tables_BxM, kv_lens_B, *, scale=None,
                    config: PagedAttentionConfig | None = None):
  """Attention of T new tokens per row over a paged KV cache.

  Args:
    q_BxTxNxH: the new tokens' queries (the last T of each row's keys).
    k_pages_PxSxKxH, v_pages_PxSxKxH: the page pool; S a power of two.
      Slots past kv_lens may hold anything (they are masked out).
    block_tables_BxM: int page ids; entries past ceil(kv_lens / S) are
      never read (any value).
    kv_lens_B: int keys per row, the new tokens included (write the new
      tokens' K and V into their pages first); 0 gives zeros; values are
      clipped to [0, M * S]; values in 1 .. T - 1 are invalid (not checked
      on device).
    scale: logit scale, default head_dim ** -0.5.
    config: backend, splits and tiles; None is `PagedAttentionConfig()`.
  Returns:
    [B, T, N, H] in q's dtype.
  """
  _check_shapes(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                block_tables_BxM, kv_lens_B)
  cfg = resolve_config(config, q_BxTxNxH, k_pages_PxSxKxH, block_tables_BxM)
  scale = float(q_BxTxNxH.shape[-1] ** -0.5 if scale is None else scale)
  if cfg.backend == "xla":
    return paged_attention_reference(q_BxTxNxH, k_pages_PxSxKxH,
                                     v_pages_PxSxKxH, block_tables_BxM,
                                     kv_lens_B, scale=scale)
  kernel, args = kernel_call(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                             block_tables_BxM, kv_lens_B, scale=scale,
                             config=cfg)
  B, T, N, H = q_BxTxNxH.shape
  K = k_pages_PxSxKxH.shape[2]
  out_BxKxRxH = combine_splits(*kernel(*args))[:, :, :T * (N // K)]
  out = out_BxKxRxH.reshape(B, K, T, N // K, H).transpose(0, 2, 1, 3, 4)
  return out.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)


def kernel_call(q_BxTxNxH, k_pages_PxSxKxH, v_pages_PxSxKxH,
                block_tables_BxM, kv_lens_B, *, scale: float,
                config: PagedAttentionConfig):
  """The Pallas kernel of a resolved config and its arguments: `kernel(
  *args)` gives the per-split (o, lse) that `combine_splits` merges. The
  queries are laid out as the kernel's rows (r = t * G + g per KV head,
  zero-padded). `paged_attention` is this plus the merge; benchmarks time
  the kernel alone with it."""
  B, T, N, H = q_BxTxNxH.shape
  _, S, K, _ = k_pages_PxSxKxH.shape
  M = block_tables_BxM.shape[1]
  G = N // K
  R = T * G  # query rows per (row, KV head): t-major, r = t * G + g
  rows = _rows(config.backend, R)
  q_BxKxRxH = q_BxTxNxH.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4)
  q_BxKxRxH = jnp.pad(q_BxKxRxH.reshape(B, K, R, H),
                      ((0, 0), (0, 0), (0, rows - R), (0, 0)))
  kernel = functools.partial(_KERNELS[config.backend], T=T, R=R,
                             scale=scale, cfg=config)
  args = (jnp.clip(kv_lens_B.astype(jnp.int32), 0, M * S),
          block_tables_BxM.astype(jnp.int32),
          jnp.asarray(query_row_offsets(T, G, rows)), q_BxKxRxH,
          k_pages_PxSxKxH, v_pages_PxSxKxH)
  return kernel, args
