"""Warmup-stable-decay learning rate and the annealed MTP loss weight."""

from __future__ import annotations

import jax.numpy as jnp

from m2jax.train.config import TrainConfig


def learning_rate(config: TrainConfig):
  """WSD: linear warmup, constant, linear decay to min_lr_ratio * lr."""
  peak = config.learning_rate
  floor = peak * config.min_lr_ratio
  warmup = max(config.warmup_steps, 1)
  decay_start = config.decay_start
  decay_len = max(config.steps - decay_start, 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum((step + 1) / warmup, 1.0)
    frac = jnp.clip((step - decay_start) / decay_len, 0.0, 1.0)
    return jnp.where(step < decay_start, warm, peak + (floor - peak) * frac)

  return schedule


def mtp_weight(config: TrainConfig, step):
  """mtp_weight in the stable phase, linearly to mtp_weight_final in decay."""
  decay_len = max(config.steps - config.decay_start, 1)
  frac = jnp.clip((jnp.asarray(step, jnp.float32) - config.decay_start)
                  / decay_len, 0.0, 1.0)
  return config.mtp_weight + (config.mtp_weight_final - config.mtp_weight) * frac
