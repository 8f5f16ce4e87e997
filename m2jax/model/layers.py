"""Small building blocks shared by the model: RMSNorm, partial RoPE, dtypes.

Logical axis names used on parameters and activations (m2jax.sharding maps
them to mesh axes; without a mesh they are no-ops):
  params:      vocab, embed, q_heads, kv_heads, head_dim, expert, expert_mlp,
               mlp, router, norm, mtp_concat
  activations: act_batch, act_length, act_embed, act_heads, act_kv_heads,
               act_vocab, act_tokens
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from m2jax.config import ModelConfig


def dtype_of(name: str):
  return jnp.dtype(name)


def param_init(config: ModelConfig, names: tuple[str, ...], init=None):
  """A normal(initializer_range) initializer annotated with logical axes."""
  init = init or nn.initializers.normal(config.initializer_range)
  return nn.with_logical_partitioning(init, names)


def constrain(x, names: tuple[str, ...]):
  """Annotate an activation with logical axes (a no-op without a mesh)."""
  return nn.with_logical_constraint(x, names)


class RMSNorm(nn.Module):
  """RMSNorm over the trailing `len(shape)` axes, computed in float32.

  `shape` is the weight's shape: (D,) for the residual stream; (H, hd) for
  M2's per-layer QK norm, which normalises the whole q projection at once
  (all heads together), not each head separately.
  """
  shape: tuple[int, ...]
  eps: float
  names: tuple[str, ...]
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x, detach_scale: bool = False):
    """`detach_scale`: no gradient reaches the weight (RL's MTP modules read
    the shared final norm without training it; transformer.py)."""
    scale = self.param(
        "scale", nn.with_logical_partitioning(nn.initializers.ones, self.names),
        self.shape, dtype_of(self.param_dtype))
    if detach_scale:
      scale = jax.lax.stop_gradient(scale)
    axes = tuple(range(x.ndim - len(self.shape), x.ndim))
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=axes, keepdims=True)
    y = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
    return scale.astype(x.dtype) * y


def rope_frequencies(positions, rotary_dim: int, theta: float):
  """cos and sin of shape [..., rotary_dim] for rotate-half RoPE."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32)
                              / rotary_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


@jax.named_scope("rope")  # profiles (benchmarks.train_profile_table)
def apply_partial_rope(x_BxTxNxH, positions_BxT, rotary_dim: int, theta: float):
  """Rotate-half RoPE on dims [0, rotary_dim) of each head; the rest pass.

  Pairs (i, i + rotary_dim/2) rotate by angle pos * theta^(-2i/rotary_dim),
  as in HF's `apply_rotary_pos_emb` with a partial rotary factor.
  """
  cos, sin = rope_frequencies(positions_BxT, rotary_dim, theta)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x_rot = x_BxTxNxH[..., :rotary_dim].astype(jnp.float32)
  x_pass = x_BxTxNxH[..., rotary_dim:]
  half = rotary_dim // 2
  rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
  x_rot = (x_rot * cos + rotated * sin).astype(x_BxTxNxH.dtype)
  return jnp.concatenate([x_rot, x_pass], axis=-1)


def positions_from_segments(segment_ids_BxT):
  """Positions restarting at 0 at every change of segment id."""
  T = segment_ids_BxT.shape[1]
  idx = jnp.arange(T, dtype=jnp.int32)[None, :]
  starts = jnp.concatenate(
      [jnp.ones_like(segment_ids_BxT[:, :1], dtype=bool),
       segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
  start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  return (idx - start_idx).astype(jnp.int32)
