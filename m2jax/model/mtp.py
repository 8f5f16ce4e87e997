"""Multi-token prediction modules (DeepSeek-V3 style; SPEC §2).

Module k (k = 1..K) takes the previous depth's hidden state h^{k-1} (h^0 =
the main model's last hidden state, before the final norm) and the embedding
of the token k steps ahead, normalises each, concatenates
[embedding; hidden], projects 2D -> D, runs one transformer block, and
predicts through the main model's final norm and lm_head (shared; the
Transformer applies them). At position t, depth k therefore predicts token
t + k + 1. M2 pretrains with one module (loss weight 0.3, then 0.1) and
grows to three for speculative decoding (m2jax/train/mtp_growth.py).

Chain layout (`chain_inputs`): depth k reads emb(token t + k) at position t;
t counts only while t + k stays in t's segment.

Tree layout (`tree_inputs`; `subtree_end` and `parent` given,
m2jax.rl.prefix_tree): every token appears once, and the shift follows tree
edges: a token with several children has several next tokens, so depth k's
elements are indexed by the token k ahead rather than by t. Element c (a
token at depth >= k) takes emb(token c) and the depth-(k-1) hidden state of
c's parent (the main model's hidden state for k = 1), sits at position
depth(c) - k, and attends to its ancestors of depth >= k. On every sample's
path through c this is exactly the unmerged position t = depth(c) - k, so
mtp_logits[k-1][c] predicts each child d of c (token t + k + 1): the logits
for node d are read at parent(d), as for the main head, and are valid where
depth(parent(d)) >= k. On a chain this is the unmerged output shifted by k.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.config import ModelConfig
from m2jax.model.block import block_class
from m2jax.model.layers import RMSNorm, dtype_of, param_init


class MTPModule(nn.Module):
  """Depth-k MTP module: [norm(emb(t+k)); norm(h^{k-1})] -> proj -> block.

  Returns (h^k [B, T, D], a list of RoutingStats or None per block, a list
  of the blocks' new pages or None); `caches` (generation) holds one
  m2jax.model.paged.LayerCache per block.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, hidden, shifted_emb, segment_ids, positions, valid,
               subtree_end=None, caches=None):
    cfg = self.config
    D = cfg.hidden_size
    norm = lambda name: RMSNorm((D,), cfg.rms_norm_eps, ("norm",),
                                cfg.param_dtype, name=name)
    cdt = dtype_of(cfg.compute_dtype)
    proj = self.param("proj", param_init(cfg, ("mtp_concat", "embed")),
                      (2 * D, D), dtype_of(cfg.param_dtype))
    h = jnp.concatenate([norm("embed_norm")(shifted_emb),
                         norm("hidden_norm")(hidden)], axis=-1)
    h = jnp.einsum("btc,cd->btd", h.astype(cdt), proj.astype(cdt))
    stats, new_caches = [], []
    for j in range(cfg.mtp_transformer_layers):
      h, s, c = block_class(cfg)(cfg, None, name=f"block_{j}")(
          h, segment_ids, positions, valid, subtree_end,
          None if caches is None else caches[j])
      stats.append(s)
      new_caches.append(c)
    return h, stats, new_caches


def shift_left(x_BxT, k: int, fill=0):
  """x[:, t + k] at position t; `fill` past the end."""
  if k == 0:
    return x_BxT
  k = min(k, x_BxT.shape[1])
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


class MTPInputs(NamedTuple):
  """What module k reads besides its embeddings, in one layout."""
  hidden: jax.Array        # [B, T, D] h^{k-1} at each element
  tokens: jax.Array        # [B, T] the token whose embedding it reads
  positions: jax.Array     # [B, T] RoPE positions
  valid: jax.Array         # [B, T] bool: counted by the routing statistics
  subtree_end: jax.Array | None   # [B, T] tree attention, None on a chain


def chain_inputs(k: int, h_prev, tokens, segment_ids, positions,
                 valid) -> MTPInputs:
  """Depth k on packed rows: position t reads emb(token t + k).

  Position t of depth k is only meaningful while t + k stays inside t's
  segment; that is also what keeps its routing statistics honest.
  """
  same_seg = shift_left(segment_ids, k, fill=-1) == segment_ids
  return MTPInputs(h_prev, shift_left(tokens, k), positions,
                   valid & same_seg, None)


def tree_inputs(k: int, h_prev, tokens, positions, valid, subtree_end,
                parent) -> MTPInputs:
  """Depth k on tree edges (module docstring): element c reads emb(c) and
  h_prev at parent(c); elements shallower than k are cut out of the
  attention (visible to themselves only) and of the routing statistics."""
  h_in = jnp.take_along_axis(h_prev, jnp.maximum(parent, 0)[..., None],
                             axis=1)
  ok = valid & (positions >= k)
  idx = jnp.arange(tokens.shape[1], dtype=subtree_end.dtype)[None]
  return MTPInputs(h_in, tokens, jnp.maximum(positions - k, 0), ok,
                   jnp.where(ok, subtree_end, idx + 1))
