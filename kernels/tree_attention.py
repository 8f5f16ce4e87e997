"""Tree (shared-prefix) attention: the mask given as one interval per key.

Samples that share prefixes are merged into a prefix tree and flattened
depth-first (m2jax.rl.prefix_tree). In that order the visible keys of a
query are exactly its ancestors and itself, and key j is visible to query i
iff

    j <= i < subtree_end[j]      and      segment_ids[i] == segment_ids[j]

(SPEC §3, §6). A chain (subtree_end[j] = end of j's segment) is plain causal
attention over packed documents. The mask is never materialised as [T, T]:

  tree_attention(q, k, v, subtree_end, segment_ids)   the entry point, GQA
      (query head h reads KV head h // (N / K)). Backends, named after their
      lowering as in kernels/gmm.py (TreeAttentionConfig.backend): "mosaic"
      (kernels/tree_attention_mosaic.py: TMA ring, warp-specialised wgmma;
      Hopper) and "triton" (kernels/tree_attention_triton.py: portable
      Pallas), forward and backward as a custom VJP; "xla", the reference.
  tree_attention_reference(...)   pure jnp, dense mask, float32 softmax.

Per tile (q rows a..b, k cols c..d) `block_lists` classifies the tile as
  empty   c > b, or max(subtree_end[c..d]) <= a, or disjoint segment ranges;
  full    d <= a, min(subtree_end[c..d]) > b, one segment on both sides;
  partial otherwise.
Each q block gets the list of its live k blocks, full ones first; the kernel
runs the full ones without any mask and masks inside the partial ones only.
The backward pass over k blocks uses the transposed lists. Queries with no
visible key (impossible when subtree_end[j] > j) get a zero output.

`query_rows=(start, stop)` computes only the queries of rows start..stop-1
(every tile outside them is empty in all three lists; the other rows'
outputs are zero and get no gradient), the keys still the whole row: how a
context-parallel shard runs the kernels on its queries against the gathered
row (m2jax.model.attention.shard_attention).

Example:
  out_BxTxNxH = tree_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                               subtree_end_BxT, segment_ids_BxT)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import tree_attention_mosaic as _mosaic
from kernels import tree_attention_triton as _triton

_NEG = _triton._NEG  # pylint: disable=protected-access
# Segment id given to the padding that rounds T up to the block size.
_PAD_SEGMENT = np.iinfo(np.int32).min


BACKENDS = ("auto", "xla", "mosaic", "triton")
# The fields a tile string (TreeAttentionConfig.from_string) sets, in order.
_MOSAIC_TILES = ("mosaic_block_k", "mosaic_block_k_dq", "mosaic_block_q_dkv",
                 "mosaic_stages", "mosaic_stages_dkv")
_TRITON_TILES = ("block_q", "block_k", "block_q_dq", "block_k_dq",
                 "block_q_dkv", "block_k_dkv", "num_warps", "num_stages",
                 "num_warps_bwd", "num_stages_bwd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeAttentionConfig:
  """Which kernels, and their tile sizes (powers of two).

  Frozen and hashable: the jitted kernels take it as a static argument, so
  it is part of their cache key.

  backend: "mosaic" (kernels/tree_attention_mosaic.py: wgmma + TMA, warp
    specialised, Hopper only), "triton" (kernels/tree_attention_triton.py:
    portable Pallas, lowered through Triton), "xla" (the dense-mask
    reference, float32 softmax, differentiated by JAX; memory grows as T^2),
    or "auto": mosaic on a Hopper GPU where it applies (bf16/f16, head dim
    64 or 128), triton on other GPUs, xla on a host without a GPU. The two
    Pallas backends run on CPU with interpret=True (auto then picks triton,
    the faster to interpret).
  block_* / num_*: the triton kernels' tiles and launch parameters, the
    best of a small sweep on an H200 (GQA 48/8, d=128, bf16;
    benchmarks/notes/tree_attention.md); 3 stages or 8 backward warps lost.
  mosaic_*: the mosaic kernels' k tile (forward, dq) and q tile (dk/dv),
    64 or 128 each (a wgmma contraction is a multiple of 64; 256-wide tiles
    overflow shared memory), and shared-memory ring depths (forward and dq,
    dk/dv), at least 1; their other side is always 128 rows.
  interpret: run the Pallas kernels in Pallas' interpreters (CPU tests).
  """
  backend: str = "auto"
  block_q: int = 128
  block_k: int = 128
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  num_warps: int = 8
  num_stages: int = 2
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2
  mosaic_block_k: int = 128
  mosaic_block_k_dq: int = 64
  mosaic_block_q_dkv: int = 64
  mosaic_stages: int = 2
  mosaic_stages_dkv: int = 2
  interpret: bool = False

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"tree attention backend must be one of {BACKENDS}, "
                       f"got {self.backend!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"tree attention interpret must be True or False, got "
                       f"{self.interpret!r}")
    for name in ("mosaic_block_k", "mosaic_block_k_dq", "mosaic_block_q_dkv"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"{name} must be 64 or 128, got "
                         f"{getattr(self, name)}")
    for name in ("mosaic_stages", "mosaic_stages_dkv"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

  @classmethod
  def from_string(cls, text: str, *, interpret: bool = False):
    """A config from its short form, as benchmarks and flags write it:

      "mosaic:BLOCK_K.BLOCK_K_DQ.BLOCK_Q_DKV.STAGES[.STAGES_DKV]"
          (STAGES_DKV defaults to STAGES), e.g. "mosaic:128.64.64.2";
      "triton:BQ.BK.BQ_DQ.BK_DQ.BQ_DKV.BK_DKV.WARPS.STAGES.WARPS_BWD.
          STAGES_BWD" (the prefix may be left out);
      a bare backend name ("auto", "xla", "mosaic", "triton"): its default
          tiles.
    """
    if text in BACKENDS:
      return cls(backend=text, interpret=interpret)
    backend, _, tiles = text.rpartition(":")
    if backend not in ("mosaic", "triton", ""):
      raise ValueError(f"tree attention tiles: unknown backend {backend!r} in "
                       f"{text!r} (mosaic:... or triton:...)")
    try:
      v = [int(x) for x in tiles.split(".")]
    except ValueError:
      raise ValueError(f"tree attention tiles: {text!r} is not "
                       f"BACKEND:N.N...") from None
    if backend == "mosaic":
      v += v[3:4] * (len(_MOSAIC_TILES) - len(v))  # stages_dkv = stages
      names = _MOSAIC_TILES
    else:
      backend, names = "triton", _TRITON_TILES
    if len(v) != len(names):
      raise ValueError(f"tree attention tiles: {text!r} gives {len(v)} "
                       f"numbers for {backend}'s {len(names)}: {names}")
    return cls(backend=backend, interpret=interpret, **dict(zip(names, v)))

  @property
  def pad_multiple(self) -> int:
    if self.backend == "mosaic":
      return max(_mosaic.TILE, self.mosaic_block_k, self.mosaic_block_k_dq,
                 self.mosaic_block_q_dkv)
    return max(self.block_q, self.block_k, self.block_q_dq, self.block_k_dq,
               self.block_q_dkv, self.block_k_dkv)

  def lists(self, se, seg, kernel: str, rows=None):
    """Tile lists and counts of one kernel ("fwd", "dq" or "dkv", the last
    transposed: per k tile) for this backend's tiles; `rows` [2]: only
    query rows start..stop-1 are computed."""
    if self.backend == "mosaic":
      t = _mosaic.TILE
      bq, bk = {"fwd": (t, self.mosaic_block_k),
                "dq": (t, self.mosaic_block_k_dq),
                "dkv": (self.mosaic_block_q_dkv, t)}[kernel]
    else:
      bq, bk = {"fwd": (self.block_q, self.block_k),
                "dq": (self.block_q_dq, self.block_k_dq),
                "dkv": (self.block_q_dkv, self.block_k_dkv)}[kernel]
    return _lists(se, seg, bq, bk, transpose=kernel == "dkv", rows=rows)


# ----------------------------------------------------------------- masks ---

def tree_mask(subtree_end_BxT, segment_ids_BxT=None):
  """Dense boolean [B, T, T] mask (query i, key j). For tests and tiny T."""
  T = subtree_end_BxT.shape[1]
  i = jnp.arange(T)[None, :, None]
  j = jnp.arange(T)[None, None, :]
  mask = (j <= i) & (i < subtree_end_BxT[:, None, :])
  if segment_ids_BxT is not None:
    mask &= segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return mask


def chain_subtree_end(segment_ids_BxT):
  """subtree_end of packed causal documents: each key is seen to its
  segment's end (a chain per segment), so tree attention == causal."""
  T = segment_ids_BxT.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)
  is_last = jnp.concatenate(
      [segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1],
       jnp.ones_like(segment_ids_BxT[:, :1], dtype=bool)], axis=1)
  # The next segment end at or after j: a reverse cumulative min.
  end = jnp.where(is_last, idx + 1, T)
  return jax.lax.cummin(end, axis=1, reverse=True).astype(jnp.int32)


def live_entries(subtree_end_BxT, segment_ids_BxT=None) -> np.ndarray:
  """Number of visible (query, key) pairs per row, counted without a mask:
  sum_j (subtree_end[j] - j) when segments agree with the intervals."""
  se = np.asarray(subtree_end_BxT, np.int64)
  T = se.shape[1]
  count = np.maximum(se - np.arange(T)[None], 0)
  if segment_ids_BxT is not None:
    count = np.where(np.asarray(segment_ids_BxT) != 0, count, 0)
  return count.sum(axis=1)


# ------------------------------------------------------------- reference ---

def tree_attention_reference(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, subtree_end_BxT,
                             segment_ids_BxT=None, *, scale=None):
  """Dense reference: float32 logits and softmax; empty rows give zeros."""
  B, T, N, H = q_BxTxNxH.shape
  K = k_BxTxKxH.shape[2]
  scale = H ** -0.5 if scale is None else scale
  q = q_BxTxNxH.reshape(B, T, K, N // K, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BxTxKxH,
                      preferred_element_type=jnp.float32) * scale
  mask = tree_mask(subtree_end_BxT, segment_ids_BxT)[:, None, None]
  logits = jnp.where(mask, logits, _NEG)
  p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) * mask
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v_BxTxKxH.dtype), v_BxTxKxH,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)


# ------------------------------------------------------------ tile lists ---

def block_classes(subtree_end_BxT, segment_ids_BxT, block_q: int,
                  block_k: int, rows=None):
  """(live, full) booleans [B, T/block_q, T/block_k] for every tile; with
  `rows` = [start, stop], tiles without a query row in start..stop-1 are
  empty."""
  B, T = subtree_end_BxT.shape
  nq, nk = T // block_q, T // block_k
  se = subtree_end_BxT.reshape(B, nk, block_k)
  seg_k = segment_ids_BxT.reshape(B, nk, block_k)
  seg_q = segment_ids_BxT.reshape(B, nq, block_q)
  a = (jnp.arange(nq) * block_q)[None, :, None]          # first q row
  b = a + block_q - 1                                     # last q row
  c = (jnp.arange(nk) * block_k)[None, None, :]          # first k col
  d = c + block_k - 1                                     # last k col
  se_max, se_min = se.max(-1)[:, None, :], se.min(-1)[:, None, :]
  kmin, kmax = seg_k.min(-1)[:, None, :], seg_k.max(-1)[:, None, :]
  qmin, qmax = seg_q.min(-1)[:, :, None], seg_q.max(-1)[:, :, None]
  live = (c <= b) & (se_max > a) & (kmin <= qmax) & (qmin <= kmax)
  full = (live & (d <= a) & (se_min > b) & (qmin == qmax) & (kmin == kmax)
          & (qmin == kmin))
  if rows is not None:
    wanted = (b >= rows[0]) & (a < rows[1])
    live, full = live & wanted, full & wanted
  return live, full


def block_lists(live, full):
  """Per row of tiles: column indices sorted full, partial, empty; counts.

  Returns lists [..., n] int32 and counts [..., 2] int32 (n_full, n_partial).
  """
  order_key = jnp.where(full, 0, jnp.where(live, 1, 2))
  lists = jnp.argsort(order_key, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.stack([full.sum(-1), (live & ~full).sum(-1)], axis=-1)
  return lists, counts.astype(jnp.int32)


def _lists(se, seg, bq, bk, transpose=False, rows=None):
  live, full = block_classes(se, seg, bq, bk, rows)
  if transpose:
    live, full = live.swapaxes(1, 2), full.swapaxes(1, 2)
  return block_lists(live, full)


# ---------------------------------------------------------- custom VJP -----

# Each kernel behind one jit: every layer calling it with the same shapes
# shares one traced jaxpr, lowered once per program (as in kernels/gmm.py).
_KERNELS = {
    name: tuple(jax.jit(f, static_argnames=("scale", "cfg"))
                for f in (mod.forward, mod.backward_dq, mod.backward_dkv))
    for name, mod in (("mosaic", _mosaic), ("triton", _triton))}

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, se, seg, rows, scale, cfg):
  return _forward(q, k, v, se, seg, rows, scale, cfg)[0]


def _forward(q, k, v, se, seg, rows, scale, cfg):
  lists, counts = cfg.lists(se, seg, "fwd", rows)
  fwd = _KERNELS[cfg.backend][0]
  return fwd(q, k, v, se, seg, lists, counts, scale=scale, cfg=cfg)


def _attention_fwd(q, k, v, se, seg, rows, scale, cfg):
  out, lse = _forward(q, k, v, se, seg, rows, scale, cfg)
  return out, (q, k, v, se, seg, rows, out, lse)


def softmax_delta(out, do):
  """delta [B, N, T] = rowsum(out * do), float32: the backward kernels'
  softmax correction (dS = P * (dP - delta))."""
  return jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32),
                    do.astype(jnp.float32))


def _attention_bwd(scale, cfg, res, do):
  q, k, v, se, seg, rows, out, lse = res
  delta = softmax_delta(out, do)
  dq_lists = cfg.lists(se, seg, "dq", rows)
  dkv_lists = cfg.lists(se, seg, "dkv", rows)
  _, dq_kernel, dkv_kernel = _KERNELS[cfg.backend]
  dq = dq_kernel(q, k, v, do, lse, delta, se, seg, *dq_lists, scale=scale,
                 cfg=cfg)
  dk, dv = dkv_kernel(q, k, v, do, lse, delta, se, seg, *dkv_lists,
                      scale=scale, cfg=cfg)
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_supported(dtypes, head_dim: int, scale: float = 1.0) -> bool:
  """The Mosaic kernels take q, k, v of one 16-bit dtype, head_dim 64 or 128
  (one or two 128-byte swizzled rows; wider heads overflow shared memory)
  and a positive scale (their running max is taken before scaling)."""
  dts = {jnp.dtype(d) for d in dtypes}
  return (len(dts) == 1
          and dts <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and head_dim in (64, 128) and scale > 0)


def _on_hopper() -> bool:
  """wgmma is sm_90 only (Blackwell has tcgen05 instead)."""
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return str(getattr(gpu, "compute_capability", "")).startswith("9.")


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def falls_back_to_reference(cfg: TreeAttentionConfig) -> bool:
  """Whether `cfg` ("auto", not interpreting, off a GPU) runs the dense XLA
  reference because no tree kernel runs here (not because it was asked
  for by name)."""
  return cfg.backend == "auto" and not cfg.interpret and not _on_gpu()


def _resolve_backend(cfg, dtypes, head_dim, scale=1.0):
  ok = mosaic_supported(dtypes, head_dim, scale)
  if cfg.backend == "auto":
    if falls_back_to_reference(cfg):
      return dataclasses.replace(cfg, backend="xla")
    mosaic = ok and not cfg.interpret and _on_hopper()
    return dataclasses.replace(cfg, backend="mosaic" if mosaic else "triton")
  if cfg.backend == "mosaic" and not ok:
    raise ValueError(
        f"tree attention backend='mosaic' needs q, k, v of one dtype, bf16 "
        f"or f16, head_dim 64 or 128 and scale > 0; got "
        f"{[jnp.dtype(d).name for d in dtypes]}, head_dim={head_dim}, "
        f"scale={scale} (use backend='triton' or 'auto')")
  return cfg


def tree_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, subtree_end_BxT,
                   segment_ids_BxT=None, *, scale=None,
                   config: TreeAttentionConfig | None = None,
                   query_rows=None):
  """Flash attention under the tree mask; see the module docstring.

  Args:
    q_BxTxNxH: queries; k_BxTxKxH, v_BxTxKxH: keys and values, N % K == 0.
    subtree_end_BxT: int, key j is visible to queries j .. subtree_end[j]-1.
    segment_ids_BxT: optional int >= 0; keys never cross segments.
    scale: logit scale, default head_dim ** -0.5.
    config: backend and tile sizes; None is `TreeAttentionConfig()` (auto).
      `TreeAttentionConfig(interpret=True)` runs the kernels on CPU.
    query_rows: optional (start, stop), ints or traced int32 scalars: only
      the queries of rows start..stop-1 are computed; the other rows give
      zeros and pass no gradient (module docstring).
  Returns:
    [B, T, N, H] in q's dtype.
  """
  cfg = TreeAttentionConfig() if config is None else config
  B, T, N, H = q_BxTxNxH.shape
  if N % k_BxTxKxH.shape[2]:
    raise ValueError(f"num_heads={N} must be a multiple of num_kv_heads="
                     f"{k_BxTxKxH.shape[2]}")
  scale = float(H ** -0.5 if scale is None else scale)
  cfg = _resolve_backend(
      cfg, (q_BxTxNxH.dtype, k_BxTxKxH.dtype, v_BxTxKxH.dtype), H, scale)
  if query_rows is None:
    rows, keep = jnp.asarray([0, T], jnp.int32), lambda out: out
  else:
    rows = jnp.stack([jnp.asarray(r, jnp.int32) for r in query_rows])
    i = jnp.arange(T, dtype=jnp.int32)[None, :, None, None]
    keep = lambda out: jnp.where((i >= rows[0]) & (i < rows[1]), out,
                                 jnp.zeros((), out.dtype))
  if cfg.backend == "xla":
    return keep(tree_attention_reference(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, subtree_end_BxT, segment_ids_BxT,
        scale=scale))
  se = subtree_end_BxT.astype(jnp.int32)
  seg = (jnp.zeros_like(se) if segment_ids_BxT is None
         else segment_ids_BxT.astype(jnp.int32))
  Tp = -(-T // cfg.pad_multiple) * cfg.pad_multiple
  if Tp != T:  # padding keys see only themselves, in a segment of their own
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (
        jnp.pad(x, pad) for x in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
    tail = jnp.arange(T, Tp, dtype=jnp.int32)[None]
    se = jnp.concatenate([se, jnp.broadcast_to(tail + 1, (B, Tp - T))], 1)
    seg = jnp.concatenate(
        [seg, jnp.full((B, Tp - T), _PAD_SEGMENT, jnp.int32)], 1)
  out = _attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, se, seg, rows, scale, cfg)
  return keep(out[:, :T])
