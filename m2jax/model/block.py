"""One pre-norm decoder block: x + attn(rmsnorm(x)), then x + ffn(rmsnorm(x)).

The main model stacks `num_layers` of them (m2jax/model/transformer.py) and
each MTP module runs `mtp_transformer_layers` more (m2jax/model/mtp.py). The
FFN is the sparse MoE (M2) or, for the ablation, a dense SwiGLU.
"""

from __future__ import annotations

import flax.linen as nn

from m2jax.config import ModelConfig
from m2jax.model.attention import Attention
from m2jax.model.layers import RMSNorm
from m2jax.model.moe import DenseFFN, MoE


class Block(nn.Module):
  """One pre-norm decoder block."""
  config: ModelConfig
  window: int | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions, valid, subtree_end=None,
               cache=None):
    """Returns (x, RoutingStats or None, the attention's new pages or None);
    `cache` is the layer's m2jax.model.paged.LayerCache when generating."""
    cfg = self.config
    norm = lambda name: RMSNorm((cfg.hidden_size,), cfg.rms_norm_eps,
                                ("norm",), cfg.param_dtype, name=name)
    h = norm("attn_norm")(x)
    a, new_cache = Attention(cfg, self.window, name="attn")(
        h, segment_ids, positions, subtree_end, cache)
    x = x + a
    h = norm("ffn_norm")(x)
    if cfg.ffn_type == "moe":
      # Generation (a cache) needs no routing statistics.
      y, stats = MoE(cfg, name="moe")(h, segment_ids, valid,
                                      stats=cache is None)
    else:
      y, stats = DenseFFN(cfg, name="mlp")(h), None
    return x + y, stats, new_cache


def block_class(config: ModelConfig):
  """Block, rematerialised in the backward pass when settings.remat."""
  return nn.remat(Block) if config.settings.remat else Block
