"""CISPO policy loss (MiniMax-M1, used by Forge; SPEC §3).

  J = 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_it) * A_it * log pi(o_it | q, o_i<t)
  r_hat = clip(pi / pi_old, 1 - eps_low, 1 + eps_high)

Unlike PPO no token's gradient is dropped: the clipped importance ratio is
a stop-gradient weight. The mean is over all trained tokens of the batch
(token-level normalisation over the whole group). Advantages are
group-relative: (reward - group mean) / group std.

Inputs are in sample layout [S, L] (m2jax.rl.prefix_tree gathers merged
outputs back to it), so a token shared by several samples counts once per
sample that trains on it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The seeds write r_hat's range as [0, 1 + eps_high]: eps_low = 1 means no
# lower bound. Public implementations cap 1 + eps_high between 1.2 and 5.
EPS_LOW = 1.0
EPS_HIGH = 1.0


@dataclasses.dataclass(frozen=True)
class CISPOConfig:
  eps_low: float = EPS_LOW
  eps_high: float = EPS_HIGH

  def __post_init__(self):
    if not 0 <= self.eps_low <= 1:
      raise ValueError(f"CISPOConfig.eps_low: must be in [0, 1] (got "
                       f"{self.eps_low!r})")
    if self.eps_high < 0:
      raise ValueError(f"CISPOConfig.eps_high: must be >= 0 (got "
                       f"{self.eps_high!r})")


def group_advantages(rewards_G, eps: float = 1e-6):
  """(r - mean) / (std + eps) over one group of G responses."""
  r = jnp.asarray(rewards_G, jnp.float32)
  return (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + eps)


def cispo_loss(logprobs_SxL, old_logprobs_SxL, advantages_SxL, mask_SxL,
               config: CISPOConfig = CISPOConfig()):
  """Token-mean CISPO loss (the negative objective) and metrics.

  Args: per-token current and rollout log-probabilities, advantages, and the
  mask of trained tokens, all [S, L]. Returns (loss, metrics dict).
  """
  mask = mask_SxL.astype(jnp.float32)
  ratio = jnp.exp(logprobs_SxL - old_logprobs_SxL)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  weight = jax.lax.stop_gradient(clipped) * advantages_SxL
  n = jnp.maximum(mask.sum(), 1.0)
  loss = -jnp.sum(weight * logprobs_SxL * mask) / n
  clip_frac = jnp.sum((clipped != ratio) * mask) / n
  return loss, {"cispo/loss": loss, "cispo/clip_fraction": clip_frac,
                "cispo/tokens": mask.sum()}
