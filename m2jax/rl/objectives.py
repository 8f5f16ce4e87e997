"""Policy objectives of the train engine (Forge, SPEC §3): token weights,
group-relative advantages, the PPO-clip baselines GRPO and DAPO, DAPO's
dynamic sampling, the KL to a reference policy and the policy's entropy.

CISPO, the default objective, is in cispo.py; m2jax.rl.step picks the
algorithm (`RLConfig.algorithm`) and adds the terms:

  loss = policy loss (CISPO or PPO-clip) + kl_coef * sum w * k3

Normalisation as per-token weights. Every term is a weighted sum
  sum_{s, l} w[s, l] * term[s, l]
with the weights computed once for the whole batch on the host
(`token_weights`, before the batch is split into rows):
  "group" (CISPO, the seeds' objective):
    w = mask / (number of groups * trained tokens of the sample's group)
  "sequence" (GRPO: a token mean per sample, then a mean over samples):
    w = mask / (number of samples * trained tokens of the sample)
  "batch" (DAPO's token-level loss: one token mean over the whole batch):
    w = mask / trained tokens of the batch
Groups (samples) without a trained token are left out of the mean. Because
each term is a plain weighted sum, it decomposes exactly over packed rows
and micro-batches: the merged RL step processes rows one at a time, a group
may be split over several rows by the row budget, and the row losses and
gradients still add up to the batch's. The weights sum to 1, so every
weighted metric (clip fraction, KL, entropy) adds up the same way and is a
mean under the algorithm's normalisation.

Shared tokens. Inputs are in sample layout [S, L] (m2jax.rl.prefix_tree
gathers merged outputs back to it), so a token shared by several samples
counts once per sample that trains on it, with that sample's weight: the
objective is exactly the unmerged one (SPEC §3).

PPO-clip (GRPO, DAPO), with r = pi / pi_old per token:
  term = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
A token whose ratio left the range in the direction its advantage pushes
gets no gradient (PPO drops it; CISPO would only reweight it).

KL to a reference policy, the k3 estimator (Schulman 2020, "Approximating
KL divergence"; GRPO's penalty), per trained token:
  k3 = exp(ref - log pi) - (ref - log pi) - 1 >= 0
an unbiased estimate of KL(pi || ref) on tokens sampled from pi.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m2jax.rl import prefix_tree

NORMALIZATIONS = ("group", "sequence", "batch")

# PPO's clip range (Schulman et al. 2017), which GRPO keeps (Shao et al.
# 2024, DeepSeekMath).
GRPO_EPS = 0.2
# DAPO's Clip-Higher (Yu et al. 2025, DAPO, §4.1): eps_low 0.2, eps_high
# 0.28, so low-probability tokens can grow and entropy does not collapse.
DAPO_EPS_LOW = 0.2
DAPO_EPS_HIGH = 0.28
# Keeps (r - mean) / (std + eps) finite for a group of equal rewards.
ADVANTAGE_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class ClipConfig:
  """Clip range of the importance ratio, [1 - eps_low, 1 + eps_high], and
  the token normalisation (module docstring); each objective's config is
  one with its own defaults (PPOClipConfig, cispo.CISPOConfig)."""
  eps_low: float = GRPO_EPS
  eps_high: float = GRPO_EPS
  normalize: str = "sequence"

  def __post_init__(self):
    name = type(self).__name__
    if not 0 <= self.eps_low <= 1:
      raise ValueError(f"{name}.eps_low: must be in [0, 1] (got "
                       f"{self.eps_low!r})")
    if self.eps_high < 0:
      raise ValueError(f"{name}.eps_high: must be >= 0 (got "
                       f"{self.eps_high!r})")
    if self.normalize not in NORMALIZATIONS:
      raise ValueError(f"{name}.normalize: must be one of "
                       f"{NORMALIZATIONS} (got {self.normalize!r})")


@dataclasses.dataclass(frozen=True)
class PPOClipConfig(ClipConfig):
  """The PPO-clip objectives' (GRPO, DAPO) clip range and normalisation."""


# GRPO: PPO-clip, a token mean per sample then a mean over samples
# (DeepSeekMath, eq. 3).
GRPO = PPOClipConfig(eps_low=GRPO_EPS, eps_high=GRPO_EPS,
                     normalize="sequence")
# DAPO: Clip-Higher and the token-level loss (DAPO §3.1, §3.3).
DAPO = PPOClipConfig(eps_low=DAPO_EPS_LOW, eps_high=DAPO_EPS_HIGH,
                     normalize="batch")


# ----------------------------------------------------- host (numpy) -----

def _labels(group_ids_S, S: int, name: str) -> np.ndarray:
  """Group ids [S] as indices 0..G-1 (in sorted order of the ids)."""
  groups = np.asarray(group_ids_S).reshape(-1)
  if groups.shape[0] != S:
    raise ValueError(f"{name}: need one group id per sample ({S}), got "
                     f"{groups.shape[0]}")
  return np.unique(groups, return_inverse=True)[1].reshape(-1)


def _rewards(rewards_S, name: str) -> np.ndarray:
  r = np.asarray(rewards_S, np.float64).reshape(-1)
  if not np.isfinite(r).all():
    raise ValueError(f"{name}: rewards must be finite (got {r.tolist()})")
  return r


def token_weights(loss_mask_SxL, group_ids_S, normalize: str = "group"
                  ) -> np.ndarray:
  """Per-token weights [S, L] float32 of the whole batch (numpy, host).

  Args:
    loss_mask_SxL: True where token l of sample s is trained.
    group_ids_S: any label per sample; samples with equal labels answer
      the same prompt.
    normalize: "group", "sequence" or "batch" (module docstring).
  """
  mask = np.asarray(loss_mask_SxL, bool)
  if mask.ndim != 2:
    raise ValueError(f"token_weights: need loss_mask [S, L], got "
                     f"{mask.shape}")
  if normalize not in NORMALIZATIONS:
    raise ValueError(f"token_weights: normalize must be one of "
                     f"{NORMALIZATIONS} (got {normalize!r})")
  S = mask.shape[0]
  group_of_sample = _labels(group_ids_S, S, "token_weights")
  if normalize == "batch":
    return (mask / max(mask.sum(), 1)).astype(np.float32)
  if normalize == "sequence":   # every sample its own group
    group_of_sample = np.arange(S)
  tokens_g = np.bincount(group_of_sample, weights=mask.sum(1))
  num_groups = max(int((tokens_g > 0).sum()), 1)
  per_sample = 1.0 / (num_groups * np.maximum(tokens_g[group_of_sample], 1))
  return (mask * per_sample[:, None]).astype(np.float32)


def group_mean_std(values_S, group_ids_S, *, what: str = "group_mean_std"
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Each sample's group mean and population std (ddof 0) of `values_S`,
  two [S] float64 arrays (numpy, host): the baseline and scale of
  group-relative advantages. `what` names the caller in errors."""
  r = _rewards(values_S, what)
  g = _labels(group_ids_S, r.shape[0], what)
  n = np.bincount(g)
  mean_S = (np.bincount(g, weights=r) / n)[g]
  sd_S = np.sqrt(np.bincount(g, weights=(r - mean_S) ** 2) / n)[g]
  return mean_S, sd_S


def group_advantages(rewards_S, group_ids_S, *, std: bool = True,
                     eps: float = ADVANTAGE_EPS) -> np.ndarray:
  """Group-relative advantages [S] float32 (numpy, host).

  std=True: (reward - group mean) / (group std + eps), GRPO's and DAPO's
  advantage. std=False: reward - group mean (Dr. GRPO, Liu et al. 2025,
  which drops the std's difficulty bias). The std is the population std
  (ddof 0) of the group's rewards; a group of equal rewards gets 0.
  Multi-step trajectories: m2jax.rl.rewards.step_advantages.
  """
  r = _rewards(rewards_S, "group_advantages")
  mean_S, sd_S = group_mean_std(r, group_ids_S, what="group_advantages")
  centred = r - mean_S
  if not std:
    return centred.astype(np.float32)
  return (centred / (sd_S + eps)).astype(np.float32)


class Filtered(NamedTuple):
  """What `dynamic_sampling` kept and dropped."""
  keep: np.ndarray   # [S] bool, the samples of groups whose rewards differ
  dropped: list      # ids of the dropped groups, in order of first sample


def dynamic_sampling(rewards_S, group_ids_S) -> Filtered:
  """DAPO's dynamic sampling (DAPO §3.2): drop every group whose rewards
  are all equal (all right, all wrong, or one partial-credit value; a
  group of one sample too). Its advantages are all 0, so it adds no policy
  gradient but would still count in the token normalisation. The trainer
  reports `dropped` and refills the batch with other groups."""
  r = _rewards(rewards_S, "dynamic_sampling")
  groups = np.asarray(group_ids_S).reshape(-1)
  g = _labels(groups, r.shape[0], "dynamic_sampling")
  lo = np.full(g.max(initial=-1) + 1, np.inf)
  hi = -lo
  np.minimum.at(lo, g, r)
  np.maximum.at(hi, g, r)
  constant_S = (lo == hi)[g]
  _, first = np.unique(g[constant_S], return_index=True)
  dropped = groups[constant_S][np.sort(first)]
  return Filtered(keep=~constant_S, dropped=dropped.tolist())


# ----------------------------------------------- device (jnp) terms -----

def ppo_clip_loss(logprobs_SxL, old_logprobs_SxL, advantages_SxL,
                  weights_SxL, config: PPOClipConfig = GRPO):
  """The PPO-clip loss (GRPO, DAPO) and metrics, weighted sums.

  Args: per-token current and rollout log-probabilities, advantages and
  the weights of `token_weights` (0 on untrained tokens), all [S, L].
  Returns (loss, metrics); every metric is a sum over tokens, so metrics of
  rows or micro-batches add up to the batch's. "policy/clip_fraction" is
  the weight share of tokens the clip drops (no gradient).
  """
  w = weights_SxL.astype(jnp.float32)
  # Untrained tokens weigh 0; their ratio is set to 1 so that an overflow
  # there (old log-probs of prompt tokens are arbitrary) cannot give 0 * inf.
  log_ratio = jnp.where(w > 0, logprobs_SxL - old_logprobs_SxL, 0.0)
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  unclipped_obj = ratio * advantages_SxL
  clipped_obj = clipped * advantages_SxL
  loss = -jnp.sum(w * jnp.minimum(unclipped_obj, clipped_obj))
  return loss, {"policy/loss": loss,
                "policy/clip_fraction": jnp.sum(
                    w * (clipped_obj < unclipped_obj)),
                "policy/tokens": jnp.sum(w > 0).astype(jnp.float32)}


def reference_kl(logprobs_SxL, ref_logprobs_SxL, weights_SxL):
  """sum w * k3(ref, log pi): the weighted mean k3 KL estimate to the
  reference policy (module docstring), differentiable in log pi."""
  w = weights_SxL.astype(jnp.float32)
  delta = jnp.where(w > 0, ref_logprobs_SxL - logprobs_SxL, 0.0)
  return jnp.sum(w * (jnp.exp(delta) - delta - 1.0))


def sample_entropy(logits_RxTxV, parent_RxT, sample_index_SxL):
  """[S, L] float32: the entropy of the distribution each sample token was
  drawn from, i.e. of softmax(logits at the token's parent); 0 at l = 0
  and past the end. Computed once per tree position, then gathered to the
  samples like their log-probs (m2jax.rl.prefix_tree.sample_logprobs)."""
  x = logits_RxTxV.astype(jnp.float32)
  lse_RxT = jax.nn.logsumexp(x, axis=-1)
  p = jnp.exp(x - lse_RxT[..., None])
  entropy_RxT = lse_RxT - jnp.sum(p * x, axis=-1)
  of_parent = jnp.take_along_axis(entropy_RxT, jnp.maximum(parent_RxT, 0),
                                  axis=1)
  return prefix_tree.gather_samples(
      jnp.where(parent_RxT >= 0, of_parent, 0.0), sample_index_SxL)
