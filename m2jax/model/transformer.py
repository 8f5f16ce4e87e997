"""The decoder: embedding, pre-norm blocks, final norm, untied head, MTP.

  x = embedding[tokens]
  for each layer:  x = x + attn(rmsnorm(x));  x = x + ffn(rmsnorm(x))
  logits = lm_head(final_norm(x))
  h^0 = x;  for k in 1..mtp_depth:  h^k = mtp_k(h^{k-1}, emb(token k ahead))
  mtp_logits[k - 1] = lm_head(final_norm(h^k))

The blocks are m2jax/model/block.py; the MTP modules and how their inputs
follow a row (chain) or a prefix tree are m2jax/model/mtp.py. The embedding,
final norm and lm_head are shared by the main model and the MTP modules.
With `mtp_detach` the MTP modules read h^0, the embedding, the final norm
and lm_head without passing gradients back to them: an MTP loss then trains
the modules' own weights only (RL's co-training, m2jax/rl/mtp_cotrain.py, must
not move the policy).

Tree layout (`subtree_end` and `parent` given; m2jax.rl.prefix_tree): every
token appears once, attention follows the tree (attention.py), the MoE and
norms see each token once, and the MTP shift follows tree edges (mtp.py).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.config import ModelConfig
from m2jax.model import context_parallel
from m2jax.model import mtp as mtp_lib
from m2jax.model import paged
from m2jax.model.block import block_class
from m2jax.model.layers import (RMSNorm, constrain, dtype_of, param_init,
                                positions_from_segments)
from m2jax.model.moe import RoutingStats


class ModelOutput(NamedTuple):
  """What the forward pass returns. With `logits=False` the head is not
  applied: `logits` is None, `mtp_logits` holds K Nones (its length is still
  the MTP depth that ran), and `head_inputs` with `lm_head` give every
  logit on demand (logits = head_inputs[k] @ lm_head: depth 0 the main
  model), for a loss that never holds [B, T, V] (m2jax.train.losses)."""
  logits: jax.Array | None            # [B, T, V] float32
  mtp_logits: tuple                   # K x [B, T, V]; depth k predicts t+k+1
  hidden: jax.Array                   # [B, T, D] last hidden, before the norm
  routing: RoutingStats | None        # fields stacked over layers [L, ...]
  mtp_routing: RoutingStats | None    # fields stacked over MTP blocks
  head_inputs: tuple = ()             # (1 + K) x [B, T, D] final-normed
  lm_head: jax.Array | None = None    # [D, V] the head's weight


def _stack(stats):
  stats = [s for s in stats if s is not None]
  if not stats:
    return None
  return RoutingStats(*(jnp.stack(f) for f in zip(*stats)))


class Transformer(nn.Module):
  """MiniMax-M2: embedding, blocks, final norm, lm_head, MTP modules."""
  config: ModelConfig

  def setup(self):
    cfg = self.config
    pdt = dtype_of(cfg.param_dtype)
    self.embedding = self.param(
        "embedding", param_init(cfg, ("vocab", "embed")),
        (cfg.vocab_size, cfg.hidden_size), pdt)
    block = block_class(cfg)
    # Lists get the names layers_0, layers_1, ... and mtp_0, mtp_1, ...
    self.layers = [block(cfg, cfg.layer_window(i))
                   for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm((cfg.hidden_size,), cfg.rms_norm_eps, ("norm",),
                              cfg.param_dtype)
    self.lm_head = self.param("lm_head", param_init(cfg, ("embed", "vocab")),
                              (cfg.hidden_size, cfg.vocab_size), pdt)
    self.mtp = [mtp_lib.MTPModule(cfg) for _ in range(cfg.num_mtp_modules)]

  def embed(self, tokens_BxT):
    cdt = dtype_of(self.config.compute_dtype)
    x = jnp.take(self.embedding, tokens_BxT, axis=0).astype(cdt)
    return constrain(x, ("act_batch", "act_length", "act_embed"))

  def head_input(self, hidden_BxTxD, detach: bool = False):
    """The final norm, in the compute dtype: what lm_head multiplies."""
    cdt = dtype_of(self.config.compute_dtype)
    return self.final_norm(hidden_BxTxD, detach_scale=detach).astype(cdt)

  def head(self, hidden_BxTxD, detach: bool = False):
    """Final norm and lm_head; `detach`: no gradient reaches their weights
    (it still reaches `hidden`)."""
    cdt = dtype_of(self.config.compute_dtype)
    h = self.head_input(hidden_BxTxD, detach)
    w = jax.lax.stop_gradient(self.lm_head) if detach else self.lm_head
    logits = jnp.einsum("btd,dv->btv", h, w.astype(cdt),
                        preferred_element_type=jnp.float32)
    return constrain(logits, ("act_batch", "act_length", "act_vocab"))

  def __call__(self, tokens_BxT, segment_ids_BxT=None, positions_BxT=None, *,
               mtp_depth: int = 0, subtree_end_BxT=None,
               parent_BxT=None, mtp_detach: bool = False,
               logits: bool = True) -> ModelOutput:
    """Forward pass; `mtp_depth` MTP modules run after the main model.

    segment_ids: 0 marks padding (excluded from routing statistics); tokens
    never attend across different ids, and each id of a row is one document
    (one sequence) of the MoE's sequence-wise aux loss. positions default
    to restarting at every segment start. subtree_end (and, for MTP,
    parent) switch to the tree layout of the module docstring; positions
    are then required. mtp_detach: the MTP modules pass no gradient to
    the main model's weights (module docstring).
    """
    tree = subtree_end_BxT is not None
    if tree and positions_BxT is None:
      raise ValueError("the tree layout needs positions (token depths)")
    if tree and mtp_depth and parent_BxT is None:
      raise ValueError("MTP in the tree layout needs parent (the index of "
                       "each token's parent) to follow tree edges")
    context_parallel.check_length(tokens_BxT.shape[1],
                                  self.config.settings.sequence_balance)
    if mtp_detach and not logits:
      raise ValueError("mtp_detach needs logits=True (the detached head "
                       "is applied inside the model)")
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones_like(tokens_BxT, dtype=jnp.int32)
    if positions_BxT is None:
      positions_BxT = positions_from_segments(segment_ids_BxT)
    valid = segment_ids_BxT != 0

    x = self.embed(tokens_BxT)
    stats = []
    for layer in self.layers:
      x, s, _ = layer(x, segment_ids_BxT, positions_BxT, valid,
                      subtree_end_BxT)
      stats.append(s)
    head = self.head if logits else self.head_input
    outs = [head(x)]

    sg = jax.lax.stop_gradient if mtp_detach else (lambda a: a)
    mtp_stats, h = [], sg(x)
    for k in range(1, mtp_depth + 1):
      if tree:
        inputs = mtp_lib.tree_inputs(k, h, tokens_BxT, positions_BxT, valid,
                                     subtree_end_BxT, parent_BxT)
      else:
        inputs = mtp_lib.chain_inputs(k, h, tokens_BxT, segment_ids_BxT,
                                      positions_BxT, valid)
      h, s, _ = self.mtp[k - 1](inputs.hidden, sg(self.embed(inputs.tokens)),
                                segment_ids_BxT, inputs.positions,
                                inputs.valid, inputs.subtree_end)
      outs.append(head(h, detach=mtp_detach))
      mtp_stats.extend(s)
    if logits:
      return ModelOutput(outs[0], tuple(outs[1:]), x, _stack(stats),
                         _stack(mtp_stats))
    return ModelOutput(None, (None,) * mtp_depth, x, _stack(stats),
                       _stack(mtp_stats), tuple(outs), self.lm_head)

  # Generation over the paged KV cache (m2jax/model/paged.py) -------------

  def _layer_caches(self, pages: paged.PagedKV, first: int, count: int,
                    block_tables, kv_lens, valid):
    return [paged.LayerCache(pages.k[i], pages.v[i], block_tables, kv_lens,
                             valid) for i in range(first, first + count)]

  def decode(self, tokens_BxT, pages: paged.PagedKV, block_tables_BxM,
             kv_lens_B, valid_BxT):
    """The main model on T right-aligned new tokens per row.

    Returns (logits [B, T, V] float32, hidden [B, T, D] before the final
    norm, the main layers' new pages as a PagedKV of num_layers entries).
    """
    cfg = self.config
    positions = paged.positions(kv_lens_B, valid_BxT)
    segment_ids = valid_BxT.astype(jnp.int32)
    caches = self._layer_caches(pages, 0, cfg.num_layers, block_tables_BxM,
                                kv_lens_B, valid_BxT)
    x = self.embed(tokens_BxT)
    new_k, new_v = [], []
    for layer, cache in zip(self.layers, caches):
      x, _, (k, v) = layer(x, segment_ids, positions, valid_BxT, None, cache)
      new_k.append(k)
      new_v.append(v)
    return self.head(x), x, paged.PagedKV(tuple(new_k), tuple(new_v))

  def mtp_decode(self, depth: int, hidden_BxTxD, tokens_BxT,
                 pages: paged.PagedKV, block_tables_BxM, kv_lens_B,
                 valid_BxT):
    """MTP module `depth` (1-based) on T right-aligned elements per row: the
    element at position p reads hidden (h^{depth-1} at p) and the embedding
    of `tokens` (the token at p + depth), as in training (mtp.py).

    `pages` holds the module's own layers (mtp_transformer_layers entries).
    Returns (logits [B, T, V], h^depth [B, T, D], its new pages).
    """
    positions = paged.positions(kv_lens_B, valid_BxT)
    segment_ids = valid_BxT.astype(jnp.int32)
    n = self.config.mtp_transformer_layers
    caches = self._layer_caches(pages, 0, n, block_tables_BxM, kv_lens_B,
                                valid_BxT)
    h, _, new = self.mtp[depth - 1](hidden_BxTxD, self.embed(tokens_BxT),
                                    segment_ids, positions, valid_BxT, None,
                                    caches)
    return (self.head(h), h,
            paged.PagedKV(tuple(c[0] for c in new), tuple(c[1] for c in new)))
