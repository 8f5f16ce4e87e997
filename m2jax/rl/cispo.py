"""CISPO policy loss (MiniMax-M1, used by Forge; SPEC §3).

  J = mean over groups g of
        1 / sum_{i in g} |o_i| * sum_{i in g} sum_t sg(r_hat_it) A_it log pi_it
  r_hat = clip(pi / pi_old, 1 - eps_low, 1 + eps_high)

A group is the G responses to one prompt; |o_i| counts the trained tokens of
sample i. Unlike PPO no token's gradient is dropped: the clipped importance
ratio is a stop-gradient weight. Advantages are group-relative:
(reward - group mean) / group std.

Normalisation as per-token weights. The objective is a weighted sum
  loss = -sum_{s, l} w[s, l] * sg(r_hat[s, l]) * A[s, l] * log pi[s, l]
with the weights computed once for the whole batch on the host
(`token_weights`, before the batch is split into rows):
  normalize="group" (default, the seeds' objective):
    w = mask / (number of groups * trained tokens of the sample's group)
  normalize="batch" (one token-mean over the whole batch):
    w = mask / trained tokens of the batch
Groups without a trained token are left out of the mean. Because the loss is
a plain weighted sum, it decomposes exactly over packed rows and
micro-batches: the merged RL step (m2jax.rl.step) processes rows one at a
time, a group may be split over several rows by the row budget, and the row
losses and gradients still add up to the batch's. The weights sum to 1, so
every weighted metric adds up the same way.

Shared tokens. Inputs are in sample layout [S, L] (m2jax.rl.prefix_tree
gathers merged outputs back to it), so a token shared by several samples
counts once per sample that trains on it, with that sample's weight: the
objective is exactly the unmerged one (SPEC §3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The seeds write r_hat's range as [0, 1 + eps_high]: eps_low = 1 means no
# lower bound. Public implementations cap 1 + eps_high between 1.2 and 5.
EPS_LOW = 1.0
EPS_HIGH = 1.0
NORMALIZATIONS = ("group", "batch")


@dataclasses.dataclass(frozen=True)
class CISPOConfig:
  """Clip range of the importance ratio and the token normalisation."""
  eps_low: float = EPS_LOW
  eps_high: float = EPS_HIGH
  normalize: str = "group"

  def __post_init__(self):
    if not 0 <= self.eps_low <= 1:
      raise ValueError(f"CISPOConfig.eps_low: must be in [0, 1] (got "
                       f"{self.eps_low!r})")
    if self.eps_high < 0:
      raise ValueError(f"CISPOConfig.eps_high: must be >= 0 (got "
                       f"{self.eps_high!r})")
    if self.normalize not in NORMALIZATIONS:
      raise ValueError(f"CISPOConfig.normalize: must be one of "
                       f"{NORMALIZATIONS} (got {self.normalize!r})")


def group_advantages(rewards_G, eps: float = 1e-6):
  """(r - mean) / (std + eps) over one group of G responses."""
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
  mask = np.asarray(loss_mask_SxL, bool)
  groups = np.asarray(group_ids_S).reshape(-1)
  if mask.ndim != 2 or groups.shape[0] != mask.shape[0]:
    raise ValueError(f"token_weights: need loss_mask [S, L] and group_ids "
                     f"[S], got {mask.shape} and {groups.shape}")
  if config.normalize == "batch":
    return (mask / max(mask.sum(), 1)).astype(np.float32)
  _, group_of_sample = np.unique(groups, return_inverse=True)
  tokens_g = np.bincount(group_of_sample, weights=mask.sum(1))
  num_groups = max(int((tokens_g > 0).sum()), 1)
  per_sample = 1.0 / (num_groups * np.maximum(tokens_g[group_of_sample], 1))
  return (mask * per_sample[:, None]).astype(np.float32)


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
  return loss, {"cispo/loss": loss,
                # Share of the objective's weight on clipped tokens.
                "cispo/clip_fraction": jnp.sum(w * (clipped != ratio)),
                "cispo/tokens": jnp.sum(w > 0).astype(jnp.float32)}
