"""Warmup-stable-decay learning rate and the annealed MTP loss weight.

Steps run 0 .. steps - 1. Warm-up: step s trains at peak * (s + 1) / warmup,
so step warmup - 1 is the first at the peak. Decay: the steps decay_start ..
steps - 1 (TrainConfig.decay_start) move linearly from the peak towards the
floor, one equal step each, so decay_start - 1 is the last step at the peak
and the last step, steps - 1, trains exactly at the floor (a one-step decay
is that one step at the floor). Should warm-up still be running at
decay_start (very short runs), the decay takes over from the peak. The MTP
weight follows the same decay progress, from mtp_weight to mtp_weight_final.
"""

from __future__ import annotations

import jax.numpy as jnp

from m2jax.train.config import TrainConfig


def decay_progress(config: TrainConfig, step):
  """0 up to decay_start - 1, then linearly to 1 at the last step."""
  decay_len = config.steps - config.decay_start
  frac = (jnp.asarray(step, jnp.float32) + 1 - config.decay_start) / max(
      decay_len, 1)
  return jnp.clip(frac, 0.0, 1.0)


def learning_rate(config: TrainConfig):
  """WSD: linear warmup, constant, linear decay to min_lr_ratio * lr."""
  peak = config.learning_rate
  floor = peak * config.min_lr_ratio
  warmup = max(config.warmup_steps, 1)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum((step + 1) / warmup, 1.0)
    decayed = peak + (floor - peak) * decay_progress(config, step)
    return jnp.where(step < config.decay_start, warm, decayed)

  return schedule


def mtp_weight(config: TrainConfig, step):
  """mtp_weight in the stable phase, linearly to mtp_weight_final in decay."""
  return config.mtp_weight + (config.mtp_weight_final - config.mtp_weight
                              ) * decay_progress(config, step)
