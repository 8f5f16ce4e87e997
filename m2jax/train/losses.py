"""Training losses and the metrics that come with them.

  loss = w_main * (CE(next token) + aux_coef * mean_layers(aux))
         + w_mtp * (mean_k CE_k(token t+k+1) + aux_coef * mean_mtp_blocks(aux))
         + z_coef * mean(logsumexp^2)

Every router that ran pays the balance loss (moe.summarize_routing: the
sequence-wise loss, mean over documents) at the weight of the loss its
module trains on: the main layers' at w_main (1, or 0 while the MTP
modules grow alone), the MTP blocks' at w_mtp, averaged over the blocks of
all depths that ran as the CE is over depths. So the balance term keeps the
same ratio to the CE on every router; the MTP routers are not balanced
harder than their own objective is weighted.

Every term averages over valid targets only: a pair (t, t+s) counts when
both tokens sit in the same non-padding segment, so documents packed in one
row never predict each other, and, when the batch has a `loss_mask`
(m2jax/data/source.py; fine-tuning's assistant mask), when token t+s is
marked in it (`target_mask`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m2jax.data.packing import next_token_targets
from m2jax.model import ModelOutput, shift_left


def target_mask(batch, shift: int = 1):
  """(targets_BxT, mask_BxT) of the batch's tokens `shift` ahead: the
  same-segment pairs of next_token_targets, and of those only the targets
  marked in the batch's `loss_mask` when it has one."""
  targets_BxT, mask_BxT = next_token_targets(batch["tokens"],
                                             batch["segment_ids"], shift)
  if "loss_mask" in batch:
    mask_BxT = mask_BxT & shift_left(jnp.asarray(batch["loss_mask"]) != 0,
                                     shift)
  return targets_BxT, mask_BxT


def cross_entropy(logits_BxTxV, targets_BxT, mask_BxT):
  """Per-token CE and log-sum-exp, both [B, T] float32, zero where masked."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BxT[..., None], -1)[..., 0]
  m = mask_BxT.astype(jnp.float32)
  return (lse - picked) * m, lse * m


def _mean(x, mask):
  return jnp.sum(x) / jnp.maximum(jnp.sum(mask), 1)


def routing_metrics(stats) -> dict:
  """Load balance (max/mean, coefficient of variation), entropy, aux loss."""
  load = stats.load_E
  mean = jnp.maximum(jnp.mean(load, -1), 1e-9)
  return {
      "router/load_max_over_mean": jnp.mean(jnp.max(load, -1) / mean),
      "router/load_cv": jnp.mean(jnp.std(load, -1) / mean),
      "router/entropy": jnp.mean(stats.entropy),
      "router/aux_loss": jnp.mean(stats.aux_loss),
  }


def total_loss(out: ModelOutput, batch, *, mtp_weight, aux_coef: float,
               z_coef: float, main_weight: float = 1.0):
  """The training objective and its metrics for one batch.

  `main_weight` = 0 trains the MTP modules alone (growth phase); the main CE
  is still reported. `aux_coef` scales the routers' balance loss (module
  docstring for how the main and MTP routers are weighted).
  """
  targets, mask = target_mask(batch, 1)
  ce, lse = cross_entropy(out.logits, targets, mask)
  main_ce = _mean(ce, mask)
  loss = main_weight * main_ce
  # The residual stream's scale where it leaves the blocks (before the
  # final norm), over the tokens that count: what spectral control bounds.
  hidden_sq = jnp.mean(jnp.square(out.hidden.astype(jnp.float32)), axis=-1)
  metrics = {"ce": main_ce, "tokens": jnp.sum(mask),
             "act/hidden_rms": jnp.sqrt(_mean(hidden_sq * mask, mask))}
  if z_coef:
    z = _mean(jnp.square(lse), mask)
    loss = loss + z_coef * z
    metrics["z_loss"] = z

  main_pred = jnp.argmax(out.logits, -1)
  mtp_ces = []
  for k, logits_k in enumerate(out.mtp_logits, start=1):
    tgt_k, mask_k = target_mask(batch, k + 1)
    ce_k = _mean(cross_entropy(logits_k, tgt_k, mask_k)[0], mask_k)
    mtp_ces.append(ce_k)
    metrics[f"mtp/ce_{k}"] = ce_k
    # Acceptance: depth k's guess for token t+k+1 equals the main model's
    # own guess for that token (made at position t+k).
    agree = jnp.argmax(logits_k, -1) == shift_left(main_pred, k)
    metrics[f"mtp/acceptance_{k}"] = _mean(agree & mask_k, mask_k)
  if mtp_ces:
    mtp_ce = jnp.mean(jnp.stack(mtp_ces))
    loss = loss + mtp_weight * mtp_ce
    metrics["mtp/ce"] = mtp_ce
    metrics["mtp/weight"] = jnp.asarray(mtp_weight, jnp.float32)

  if out.routing is not None:
    if aux_coef:
      loss = loss + main_weight * aux_coef * jnp.mean(out.routing.aux_loss)
    metrics.update(routing_metrics(out.routing))
  if out.mtp_routing is not None:
    if aux_coef:
      loss = loss + mtp_weight * aux_coef * jnp.mean(out.mtp_routing.aux_loss)
    metrics.update({f"mtp/{k}": v
                    for k, v in routing_metrics(out.mtp_routing).items()})
  metrics["loss"] = loss
  return loss, metrics
