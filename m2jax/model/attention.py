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
are depths. A packed row is the special case of a forest of chains
(subtree_end[j] = the end of j's document: tree_attention.chain_subtree_end).

`packed_attention` is the one entry point of training-time attention (no
KV cache); `attention_impl` is the one place that decides which
implementation runs, from `settings.attention`:
  "tree"       kernels/tree_attention.py with `settings.tree_attention` (the
               Mosaic kernels on Hopper): no mask array, forward and backward;
               full-attention layers only.
  "blockwise"  kernels/blockwise_attention.py: flash attention in XLA, any
               backend, windows and sinks, query/key offsets; no [T, T] array.
  "cudnn", "xla"  the dense [B, T, T] mask (attention_mask) into cuDNN's
               fused attention or XLA's reference: short rows, comparison.
  "auto"       full layers: "tree" on a GPU in half precision; otherwise
               the dense mask while T <= DENSE_MAX_LEN (cuDNN on a GPU in
               half precision, else XLA; on a CPU while T <=
               CPU_DENSE_MAX_LEN, where the dense path stops being faster)
               and "blockwise" beyond, so a long row never builds [T, T].
Full layers of tree rows always run "tree" (`settings.tree_attention` picks
its backend). Where its "auto" backend finds no kernel to run (a CPU, not
interpreting) they run "blockwise" with the tree's intervals instead of the
dense reference: the same values, and it skips the key blocks no query of
a block can see (an RL step of merged 1,024-token rows on 2 CPU cores: 3.5 s
against 11.9 s; benchmarks/notes/agents.md). `tree_attention.backend="xla"`
asks for the dense reference. A sliding-window layer never runs "tree"
(the kernels have no window): an explicit "tree" gives it "blockwise".

Under a mesh whose "sequence" axis splits rows (context parallelism,
m2jax/model/context_parallel.py) each device's queries attend to the
gathered row through `shard_attention`: where "tree" would run on the whole
row, the tree kernels on the row with only the shard's query rows computed
(`tree_attention(query_rows=...)`); otherwise a rectangular
`packed_attention` ("blockwise" for long rows).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
from jax import custom_batching
import jax.numpy as jnp

from kernels import blockwise_attention as blockwise_lib
from kernels.paged_attention import paged_attention
from kernels.tree_attention import (TreeAttentionConfig, chain_subtree_end,
                                    falls_back_to_reference, tree_attention)
from m2jax.config import ModelConfig
from m2jax.model import context_parallel, paged
from m2jax.model.layers import (RMSNorm, apply_partial_rope, constrain,
                                dtype_of, param_init)
from m2jax.settings import ATTENTIONS

_NEG_INF = -1e30


def attention_mask(segment_ids_BxT, positions_BxT, *, window: int | None,
                   num_sink_tokens: int = 0, subtree_end_BxT=None):
  """Boolean [B, T, T] mask: query i may read key j.

  Causal on the token index (so it also holds for tree layouts where
  positions are depths), same segment, and, with a window, pos_i - pos_j <
  window unless pos_j < num_sink_tokens. With `subtree_end_BxT` the causal
  part is the tree's: j <= i < subtree_end[j].
  """
  idx = jnp.arange(segment_ids_BxT.shape[1])
  return blockwise_lib.visible(idx, idx, segment_ids_BxT, segment_ids_BxT,
                               positions_BxT, positions_BxT, subtree_end_BxT,
                               window=window, num_sink_tokens=num_sink_tokens)


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


# The longest row "auto" gives the dense-mask paths (where no mask-free
# kernel applies): [B, N, T, T] float32 logits of 12 heads are 200 MB a row
# at 2048; beyond it a row runs "blockwise".
DENSE_MAX_LEN = 2048
# On a CPU the dense path is also the slower one past one blockwise tile
# (512): the tiny preset's train step at T = 1,024 ran 2,928 tokens/s dense
# against 4,974 blockwise on 2 cores (6,018 vs 5,435 at 512, equal at 128).
CPU_DENSE_MAX_LEN = 512
IMPLS = ATTENTIONS


def _half(dtype) -> bool:
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in CUDNN_DTYPES)


def attention_impl(impl: str, dtype, backend: str, *,
                   window: int | None = None, length: int = 0,
                   tree: bool = False, square: bool = True) -> str:
  """The implementation that runs for `settings.attention` = `impl` on a
  layer with `window`, a row of `length` tokens (and a prefix tree when
  `tree`); see the module docstring. An explicit choice is kept, except
  that "tree" runs only on a full layer over a whole row (`square`; a
  slice of a longer row, or a windowed layer, gets "blockwise")."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  gpu_half = backend == "gpu" and _half(dtype)
  if tree and window is None:
    chosen = "tree"
  elif impl == "auto":
    if window is None and gpu_half:
      chosen = "tree"
    elif length > (CPU_DENSE_MAX_LEN if backend == "cpu" else DENSE_MAX_LEN):
      chosen = "blockwise"
    else:
      chosen = _dense_impl(impl, dtype, backend)
  else:
    chosen = impl
  if chosen == "tree" and (window is not None or not square):
    return "blockwise"
  return chosen


def _dense_impl(impl: str, dtype, backend: str) -> str:
  """The dense-mask implementation for `impl`: itself if "xla" or "cudnn",
  else cuDNN for half precision on a GPU, else XLA."""
  if impl in ("xla", "cudnn"):
    return impl
  return "cudnn" if backend == "gpu" and _half(dtype) else "xla"


def dot_product_attention(q, k, v, mask_BxTxS, *, impl: str):
  """Attention under a dense mask: cuDNN flash attention or the XLA
  reference (`_dense_impl` says which `impl` stands for)."""
  impl = _dense_impl(impl, q.dtype, jax.default_backend())
  if impl == "xla":
    return dot_product_attention_xla(q, k, v, mask_BxTxS)
  return jax.nn.dot_product_attention(
      q, k, v, mask=cudnn_mask(mask_BxTxS, q.shape[2]), implementation="cudnn")


def cudnn_mask(mask_BxTxS, num_heads: int):
  """The [B, 1, T, S] mask cuDNN's attention takes, every head sharing it.

  Under vmap (a sweep's models trained as one program) a mapped mask gets
  all `num_heads` heads instead: JAX's batching rule for cuDNN attention
  (jax 0.11.2) reshapes a mapped mask to [V * B, N, T, S] and fails on one
  head ("cannot reshape array of shape (3, 32, 1, 1024, 1024)"). The
  mask carries no gradient, so the custom vmap rule is safe under grad.
  """
  @custom_batching.custom_vmap
  def shared(mask):
    return mask[:, None]

  @shared.def_vmap  # called only when the mask is mapped
  def per_head(axis_size, in_batched, mask):
    del axis_size, in_batched
    V, B, T, S = mask.shape
    return jnp.broadcast_to(mask[:, :, None], (V, B, num_heads, T, S)), True

  return shared(mask_BxTxS)


def packed_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT,
                     positions_BxT, *, window: int | None, impl: str,
                     num_sink_tokens: int = 0, subtree_end_BxS=None,
                     kv_segment_ids_BxS=None, kv_positions_BxS=None,
                     q_offset=0, kv_offset=0,
                     tree_config: TreeAttentionConfig | None = None):
  """Causal GQA attention over packed documents (or a prefix tree), RoPE
  already applied; `attention_impl` picks the implementation.

  Args:
    q_BxTxNxH, k_BxSxKxH, v_BxSxKxH: queries, keys, values (N % K == 0).
    segment_ids_BxT, positions_BxT: of the queries; a key is visible only
      within its segment, and `window` is measured on positions.
    window, num_sink_tokens: the layer's sliding window (None: full) and
      sink positions.
    impl: `settings.attention` ("auto", "tree", "blockwise", "cudnn", "xla").
    subtree_end_BxS: prefix-tree intervals of the keys (tree rows).
    kv_segment_ids_BxS, kv_positions_BxS, q_offset, kv_offset: for a caller
      holding a slice of a longer row (sequence parallelism): the keys'
      segment ids and positions (default: the queries') and the global index
      of the first query and of the first key (ints or traced scalars).
      Causality compares global indices. Such a rectangular call runs
      "blockwise" unless "xla"/"cudnn" was asked for.
    tree_config: the tree kernels' backend and tiles (settings.tree_attention).
  Returns:
    [B, T, N, H] in q's dtype.

  Example (a sequence shard of a row of length S = n * T, keys gathered):
    out = packed_attention(q_shard, k_row, v_row, seg_shard, pos_shard,
                           window=None, impl="auto", kv_segment_ids_BxS=seg,
                           kv_positions_BxS=pos, q_offset=shard * T)
  """
  T, S = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
  sliced = (kv_segment_ids_BxS is not None or kv_positions_BxS is not None
            or not (isinstance(q_offset, int) and q_offset == 0)
            or not (isinstance(kv_offset, int) and kv_offset == 0))
  impl = attention_impl(impl, q_BxTxNxH.dtype, jax.default_backend(),
                        window=window, length=max(T, S),
                        tree=subtree_end_BxS is not None, square=not sliced)
  if impl == "tree":
    subtree_end = (chain_subtree_end(segment_ids_BxT)
                   if subtree_end_BxS is None else subtree_end_BxS)
    if falls_back_to_reference(tree_config or TreeAttentionConfig()):
      impl, subtree_end_BxS = "blockwise", subtree_end
    else:
      return _tree_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, subtree_end,
                             segment_ids_BxT, tree_config)
  if impl == "blockwise":
    return blockwise_lib.blockwise_attention(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, positions_BxT,
        kv_segment_ids_BxS=kv_segment_ids_BxS,
        kv_positions_BxS=kv_positions_BxS, subtree_end_BxS=subtree_end_BxS,
        window=window, num_sink_tokens=num_sink_tokens, q_offset=q_offset,
        kv_offset=kv_offset)
  mask = blockwise_lib.visible(  # the dense [B, T, S] mask
      q_offset + jnp.arange(T), kv_offset + jnp.arange(S), segment_ids_BxT,
      segment_ids_BxT if kv_segment_ids_BxS is None else kv_segment_ids_BxS,
      positions_BxT,
      positions_BxT if kv_positions_BxS is None else kv_positions_BxS,
      subtree_end_BxS, window=window, num_sink_tokens=num_sink_tokens)
  return dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask,
                               impl=impl)


def shard_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_segment_ids_BxT,
                    kv_segment_ids_BxS, q_positions_BxT, kv_positions_BxS,
                    q_offset, *, window: int | None, num_sink_tokens: int,
                    impl: str, tree_config: TreeAttentionConfig | None = None):
  """One context-parallel shard: T local queries (row tokens q_offset ..
  q_offset + T - 1) over the S keys of the whole row.

  Where the whole row would run the tree kernels (a full layer; on a GPU in
  half precision for "auto") the shard runs them too: the kernels are
  square, so the shard's queries sit at their place in an [B, S] row of
  zeros and only their rows are computed (query_rows), against the row's
  chain intervals. Otherwise the rectangular `packed_attention`.
  """
  S = k_BxSxKxH.shape[1]
  tree_config = tree_config or TreeAttentionConfig()
  if (attention_impl(impl, q_BxTxNxH.dtype, jax.default_backend(),
                     window=window, length=S) == "tree"
      and not falls_back_to_reference(tree_config)):
    T = q_BxTxNxH.shape[1]
    q_row = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((q_BxTxNxH.shape[0], S) + q_BxTxNxH.shape[2:],
                  q_BxTxNxH.dtype), q_BxTxNxH, q_offset, axis=1)
    out = tree_attention(q_row, k_BxSxKxH, v_BxSxKxH,
                         chain_subtree_end(kv_segment_ids_BxS),
                         kv_segment_ids_BxS, config=tree_config,
                         query_rows=(q_offset, q_offset + T))
    return jax.lax.dynamic_slice_in_dim(out, q_offset, T, axis=1)
  return packed_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_segment_ids_BxT,
                          q_positions_BxT, window=window, impl=impl,
                          num_sink_tokens=num_sink_tokens,
                          kv_segment_ids_BxS=kv_segment_ids_BxS,
                          kv_positions_BxS=kv_positions_BxS,
                          q_offset=q_offset)


def _mesh_spec(mesh, names, shape):
  """The PartitionSpec of logical axes `names` on `mesh`, keeping only the
  mesh axes that divide their dimension."""
  spec = []
  for dim, axis in zip(shape, nn.logical_to_mesh_axes(names)):
    axes = () if axis is None else (axis,) if isinstance(axis, str) else axis
    axes = tuple(a for a in axes if a in mesh.axis_names)
    size = 1
    for a in axes:
      size *= mesh.shape[a]
    spec.append(axes if axes and dim % size == 0 else None)
  return jax.P(*spec)


def _tree_attention(q, k, v, subtree_end, segment_ids, config):
  """The tree kernels; under a mesh they run per device on its rows and
  heads (a Pallas call is not partitioned by XLA, so it is placed by
  shard_map). Rows are never split along their length here."""
  call = functools.partial(tree_attention, config=config)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return call(q, k, v, subtree_end, segment_ids)
  q_spec = _mesh_spec(mesh, ("act_batch", None, "act_heads", None), q.shape)
  kv_spec = _mesh_spec(mesh, ("act_batch", None, "act_kv_heads", None),
                       k.shape)
  if q_spec[2] != kv_spec[2]:  # GQA groups must stay on one device
    q_spec = jax.P(q_spec[0], None, None, None)
    kv_spec = jax.P(kv_spec[0], None, None, None)
  row = jax.P(q_spec[0], None)
  return jax.shard_map(
      call, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, row, row),
      out_specs=q_spec, check_vma=False)(q, k, v, subtree_end, segment_ids)


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
          num_sink_tokens=cfg.num_sink_tokens, impl=cfg.settings.attention,
          tree_config=cfg.settings.tree_attention),
          q, k, v, segment_ids_BxT, positions_BxT,
          balance=cfg.settings.sequence_balance)
    else:
      out = packed_attention(q, k, v, segment_ids_BxT, positions_BxT,
                             window=self.window, impl=cfg.settings.attention,
                             num_sink_tokens=cfg.num_sink_tokens,
                             subtree_end_BxS=subtree_end_BxT,
                             tree_config=cfg.settings.tree_attention)
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
