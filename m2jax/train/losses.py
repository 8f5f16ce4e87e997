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

Long rows: the [B, T, V] float32 logits of a 131,072-token row are 16 GiB
at M2-small's vocabulary, and their gradient as much again. When the model
returns its head's inputs instead (`model.forward(..., logits=False)`),
`chunked_cross_entropy` computes logits, log-sum-exp and the target logit
`chunk` positions at a time under a rematerialised map, so neither pass
holds more than [B, chunk, V]; `total_loss` takes either form and gives the
same numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m2jax.data.packing import next_token_targets
from m2jax.model import ModelOutput, shift_left
from m2jax.model.layers import constrain
from m2jax.settings import DEFAULT_LOSS_CHUNK


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


def chunked_cross_entropy(features_BxTxD, lm_head_DxV, targets_BxT, mask_BxT,
                          *, chunk: int = DEFAULT_LOSS_CHUNK):
  """cross_entropy of logits = features @ lm_head without [B, T, V].

  The logits are computed in float32 from `features` (the final-normed
  hidden state in the compute dtype; lm_head is cast to it, as the model's
  head does) `chunk` positions of every row at a time; the backward pass
  recomputes each chunk's logits (jax.checkpoint inside lax.map), so its
  largest array is also [B, chunk, V]. Returns (ce, lse, argmax), [B, T]
  each: ce and lse float32, zero where masked; argmax int32 (the predicted
  token, for metrics; no gradient).
  """
  B, T, D = features_BxTxD.shape
  c = max(1, min(chunk, T))
  n = -(-T // c)
  pad = ((0, 0), (0, n * c - T))
  f = jnp.pad(features_BxTxD, pad + ((0, 0),))
  tgt = jnp.pad(targets_BxT.astype(jnp.int32), pad)
  f_NxBxCxD = f.reshape(B, n, c, D).swapaxes(0, 1)
  tgt_NxBxC = tgt.reshape(B, n, c).swapaxes(0, 1)

  @jax.checkpoint
  def one(f_BxCxD, tgt_BxC, w_DxV):
    logits = jnp.einsum("bcd,dv->bcv", f_BxCxD, w_DxV.astype(f_BxCxD.dtype),
                        preferred_element_type=jnp.float32)
    logits = constrain(logits, ("act_batch", "act_length", "act_vocab"))
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tgt_BxC[..., None], -1)[..., 0]
    pred = jnp.argmax(jax.lax.stop_gradient(logits), -1).astype(jnp.int32)
    return lse, picked, pred

  lse, picked, pred = jax.lax.map(lambda a: one(*a, lm_head_DxV),
                                  (f_NxBxCxD, tgt_NxBxC))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * c)[:, :T]
  lse, picked, pred = unchunk(lse), unchunk(picked), unchunk(pred)
  m = mask_BxT.astype(jnp.float32)
  return (lse - picked) * m, lse * m, pred


def _head_losses(out: ModelOutput, batch, chunk: int):
  """[(targets, mask, ce, lse, argmax)] of the main head then each MTP
  depth, from the logits or, without them, chunk by chunk."""
  depths = range(1 + len(out.mtp_logits))
  res = []
  for k in depths:
    targets, mask = target_mask(batch, k + 1)
    if out.logits is None:
      ce, lse, pred = chunked_cross_entropy(out.head_inputs[k], out.lm_head,
                                            targets, mask, chunk=chunk)
    else:
      logits = out.logits if k == 0 else out.mtp_logits[k - 1]
      ce, lse = cross_entropy(logits, targets, mask)
      pred = jnp.argmax(logits, -1)
    res.append((targets, mask, ce, lse, pred))
  return res


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
               z_coef: float, main_weight: float = 1.0,
               chunk: int = DEFAULT_LOSS_CHUNK):
  """The training objective and its metrics for one batch.

  `main_weight` = 0 trains the MTP modules alone (growth phase); the main CE
  is still reported. `aux_coef` scales the routers' balance loss (module
  docstring for how the main and MTP routers are weighted). `out` has
  logits, or head inputs (model.forward(logits=False)): then the heads run
  `chunk` positions at a time (chunked_cross_entropy).
  """
  heads = _head_losses(out, batch, chunk)
  _, mask, ce, lse, main_pred = heads[0]
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

  mtp_ces = []
  for k, (_, mask_k, ce_k, _, pred_k) in enumerate(heads[1:], start=1):
    ce_k = _mean(ce_k, mask_k)
    mtp_ces.append(ce_k)
    metrics[f"mtp/ce_{k}"] = ce_k
    # Acceptance: depth k's guess for token t+k+1 equals the main model's
    # own guess for that token (made at position t+k).
    agree = pred_k == shift_left(main_pred, k)
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
