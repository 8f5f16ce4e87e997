"""CISPO policy loss (MiniMax-M1, used by Forge; SPEC §3).

  J = mean over groups g of
        1 / sum_{i in g} |o_i| * sum_{i in g} sum_t sg(r_hat_it) A_it log pi_it
  r_hat = clip(pi / pi_old, 1 - eps_low, 1 + eps_high)

A group is the G responses to one prompt; |o_i| counts the trained tokens of
sample i. Unlike PPO no token's gradient is dropped: the clipped importance
ratio is a stop-gradient weight. Advantages are group-relative:
(reward - group mean) / group std.

The objective is a weighted sum of per-token terms
  loss = -sum_{s, l} w[s, l] * sg(r_hat[s, l]) * A[s, l] * log pi[s, l]
with the weights computed once for the whole batch on the host
(`token_weights`; m2jax.rl.objectives gives the rules and why the sum
decomposes exactly over packed rows and micro-batches):
  normalize="group" (default, the seeds' objective):
    w = mask / (number of groups * trained tokens of the sample's group)
  normalize="batch" (one token-mean over the whole batch):
    w = mask / trained tokens of the batch
  normalize="sequence" (a token mean per sample, then over samples).
Inputs are in sample layout [S, L], so a token shared by several merged
samples counts once per sample that trains on it (SPEC §3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from m2jax.rl import objectives

# The seeds write r_hat's range as [0, 1 + eps_high]: eps_low = 1 means no
# lower bound. Public implementations cap 1 + eps_high between 1.2 and 5.
EPS_LOW = 1.0
EPS_HIGH = 1.0


@dataclasses.dataclass(frozen=True)
class CISPOConfig(objectives.ClipConfig):
  """Clip range of the importance ratio and the token normalisation."""
  eps_low: float = EPS_LOW
  eps_high: float = EPS_HIGH
  normalize: str = "group"


def group_advantages(rewards_G, eps: float = 1e-6):
  """(r - mean) / (std + eps) over one group of G responses (jnp; the
  trainer's host version over a batch of groups is
  m2jax.rl.objectives.group_advantages)."""
  r = jnp.asarray(rewards_G, jnp.float32)
  return (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + eps)


def token_weights(loss_mask_SxL, group_ids_S,
                  config: CISPOConfig = CISPOConfig()) -> np.ndarray:
  """Per-token weights [S, L] float32 of the whole batch (numpy, host).

  Args:
    loss_mask_SxL: True where token l of sample s is trained.
    group_ids_S: any integer label per sample; samples with equal labels
      answer the same prompt.
    config: `config.normalize` picks the rule (module docstring).
  """
  return objectives.token_weights(loss_mask_SxL, group_ids_S,
                                  config.normalize)


def cispo_loss(logprobs_SxL, old_logprobs_SxL, advantages_SxL, weights_SxL,
               config: CISPOConfig = CISPOConfig()):
  """The CISPO loss (the negative objective) and metrics, weighted sums.

  Args: per-token current and rollout log-probabilities, advantages and
  the weights of `token_weights` (0 on untrained tokens), all [S, L].
  Returns (loss, metrics); every metric is a sum over tokens, so metrics of
  rows or micro-batches add up to the batch's.
  """
  w = weights_SxL.astype(jnp.float32)
  ratio = jnp.exp(logprobs_SxL - old_logprobs_SxL)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  coef = jax.lax.stop_gradient(clipped) * advantages_SxL
  loss = -jnp.sum(w * coef * logprobs_SxL)
  return loss, {"policy/loss": loss,
                # Share of the objective's weight on clipped tokens
                # (reweighted, never dropped).
                "policy/clip_fraction": jnp.sum(w * (clipped != ratio)),
                "policy/tokens": jnp.sum(w > 0).astype(jnp.float32)}
