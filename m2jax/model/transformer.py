"""The decoder: pre-norm blocks, final norm, untied head, and MTP modules.

  x = embedding[tokens]
  for each layer:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
  logits = lm_head(final_norm(x))

Multi-token prediction (DeepSeek-V3 style, SPEC §2). Module k (k = 1..K)
takes the previous depth's hidden state h^{k-1} (h^0 = the main model's last
hidden state, before the final norm) and the embedding of the token k steps
ahead, normalises each, concatenates [embedding; hidden], projects 2D -> D,
runs one transformer block, and predicts through the shared final norm and
lm_head. At position t, depth k therefore predicts token t + k + 1.

Tree layout (`subtree_end` and `parent` given; m2jax.rl.prefix_tree): every
token appears once, attention follows the tree (attention.py) and the MoE
and norms see each token once. The MTP shift follows tree edges: a token
with several children has several next tokens, so depth k's elements are
indexed by the token k ahead rather than by t. Element c (a token at depth
>= k) takes emb(token c) and the depth-(k-1) hidden state of c's parent
(the main model's hidden state for k = 1), sits at position depth(c) - k,
and attends to its ancestors of depth >= k. On every sample's path through
c this is exactly the unmerged position t = depth(c) - k, so
mtp_logits[k-1][c] predicts each child d of c (token t + k + 1): the
logits for node d are read at parent(d), as for the main head, and are
valid where depth(parent(d)) >= k. On a chain this is the unmerged output
shifted by k.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.config import ModelConfig
from m2jax.model.attention import Attention
from m2jax.model.layers import (RMSNorm, constrain, dtype_of, param_init,
                                positions_from_segments)
from m2jax.model.moe import DenseFFN, MoE, RoutingStats


class Block(nn.Module):
  """One pre-norm decoder block. Returns (x, RoutingStats or None)."""
  config: ModelConfig
  window: int | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions, valid, subtree_end=None):
    cfg = self.config
    norm = lambda name: RMSNorm((cfg.hidden_size,), cfg.rms_norm_eps,
                                ("norm",), cfg.param_dtype, name=name)
    h = norm("attn_norm")(x)
    x = x + Attention(cfg, self.window, name="attn")(h, segment_ids, positions,
                                                     subtree_end)
    h = norm("ffn_norm")(x)
    if cfg.ffn_type == "moe":
      y, stats = MoE(cfg, name="moe")(h, segment_ids, valid)
    else:
      y, stats = DenseFFN(cfg, name="mlp")(h), None
    return x + y, stats


def _block_cls(cfg: ModelConfig):
  return nn.remat(Block) if cfg.remat else Block


class MTPModule(nn.Module):
  """Depth-k MTP module: [norm(emb(t+k)); norm(h^{k-1})] -> proj -> block."""
  config: ModelConfig

  @nn.compact
  def __call__(self, hidden, shifted_emb, segment_ids, positions, valid,
               subtree_end=None):
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
    stats = []
    for j in range(cfg.mtp_transformer_layers):
      h, s = _block_cls(cfg)(cfg, None, name=f"block_{j}")(
          h, segment_ids, positions, valid, subtree_end)
      stats.append(s)
    return h, stats


class ModelOutput(NamedTuple):
  logits: jax.Array                   # [B, T, V] float32
  mtp_logits: tuple[jax.Array, ...]   # K x [B, T, V]; depth k predicts t+k+1
  hidden: jax.Array                   # [B, T, D] last hidden, before the norm
  routing: RoutingStats | None        # fields stacked over layers [L, ...]
  mtp_routing: RoutingStats | None    # fields stacked over MTP blocks


def _stack(stats):
  stats = [s for s in stats if s is not None]
  if not stats:
    return None
  return RoutingStats(*(jnp.stack(f) for f in zip(*stats)))


def shift_left(x_BxT, k: int, fill=0):
  """x[:, t + k] at position t; `fill` past the end."""
  if k == 0:
    return x_BxT
  k = min(k, x_BxT.shape[1])
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


class Transformer(nn.Module):
  """MiniMax-M2: embedding, blocks, final norm, lm_head, MTP modules."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    pdt = dtype_of(cfg.param_dtype)
    self.embedding = self.param(
        "embedding", param_init(cfg, ("vocab", "embed")),
        (cfg.vocab_size, cfg.hidden_size), pdt)
    block = _block_cls(cfg)
    # Lists get the names layers_0, layers_1, ... and mtp_0, mtp_1, ...
    self.layers = [block(cfg, cfg.layer_window(i))
                   for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm((cfg.hidden_size,), cfg.rms_norm_eps, ("norm",),
                              cfg.param_dtype)
    self.lm_head = self.param("lm_head", param_init(cfg, ("embed", "vocab")),
                              (cfg.hidden_size, cfg.vocab_size), pdt)
    self.mtp = [MTPModule(cfg) for _ in range(cfg.num_mtp_modules)]

  def embed(self, tokens_BxT):
    cdt = dtype_of(self.config.compute_dtype)
    x = jnp.take(self.embedding, tokens_BxT, axis=0).astype(cdt)
    return constrain(x, ("act_batch", "act_length", "act_embed"))

  def head(self, hidden_BxTxD):
    cdt = dtype_of(self.config.compute_dtype)
    h = self.final_norm(hidden_BxTxD)
    logits = jnp.einsum("btd,dv->btv", h.astype(cdt),
                        self.lm_head.astype(cdt),
                        preferred_element_type=jnp.float32)
    return constrain(logits, ("act_batch", "act_length", "act_vocab"))

  def __call__(self, tokens_BxT, segment_ids_BxT=None, positions_BxT=None, *,
               mtp_depth: int = 0, subtree_end_BxT=None,
               parent_BxT=None) -> ModelOutput:
    """Forward pass; `mtp_depth` MTP modules run after the main model.

    segment_ids: 0 marks padding (excluded from routing statistics); tokens
    never attend across different ids, and each id of a row is one document
    (one sequence) of the MoE's sequence-wise aux loss. positions default
    to restarting at every segment start. subtree_end (and, for MTP,
    parent) switch to the tree layout of the module docstring; positions
    are then required.
    """
    tree = subtree_end_BxT is not None
    if tree and positions_BxT is None:
      raise ValueError("the tree layout needs positions (token depths)")
    if tree and mtp_depth and parent_BxT is None:
      raise ValueError("MTP in the tree layout needs parent (the index of "
                       "each token's parent) to follow tree edges")
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones_like(tokens_BxT, dtype=jnp.int32)
    if positions_BxT is None:
      positions_BxT = positions_from_segments(segment_ids_BxT)
    valid = segment_ids_BxT != 0

    x = self.embed(tokens_BxT)
    stats = []
    for layer in self.layers:
      x, s = layer(x, segment_ids_BxT, positions_BxT, valid, subtree_end_BxT)
      stats.append(s)
    logits = self.head(x)

    mtp_logits, mtp_stats, h = [], [], x
    for k in range(1, mtp_depth + 1):
      if tree:
        h, s = self._tree_mtp(k, h, tokens_BxT, segment_ids_BxT,
                              positions_BxT, valid, subtree_end_BxT,
                              parent_BxT)
      else:
        shifted = self.embed(shift_left(tokens_BxT, k))
        # Position t of depth k is only meaningful while t + k stays inside
        # t's segment; that is also what keeps its statistics honest.
        same_seg = shift_left(segment_ids_BxT, k, fill=-1) == segment_ids_BxT
        h, s = self.mtp[k - 1](h, shifted, segment_ids_BxT, positions_BxT,
                               valid & same_seg)
      mtp_logits.append(self.head(h))
      mtp_stats.extend(s)
    return ModelOutput(logits, tuple(mtp_logits), x, _stack(stats),
                       _stack(mtp_stats))

  def _tree_mtp(self, k, h_prev, tokens, segment_ids, positions, valid,
                subtree_end, parent):
    """Depth k on tree edges (module docstring): element c reads emb(c) and
    h_prev at parent(c); elements shallower than k are cut out of the
    attention (visible to themselves only) and of the routing statistics."""
    h_in = jnp.take_along_axis(h_prev, jnp.maximum(parent, 0)[..., None],
                               axis=1)
    ok = valid & (positions >= k)
    idx = jnp.arange(tokens.shape[1], dtype=subtree_end.dtype)[None]
    subtree_end_k = jnp.where(ok, subtree_end, idx + 1)
    return self.mtp[k - 1](h_in, self.embed(tokens), segment_ids,
                           jnp.maximum(positions - k, 0), ok, subtree_end_k)
