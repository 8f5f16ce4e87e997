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
returns its head's inputs instead (`model.forward(..., logits=False)`), the
heads run `chunk` positions at a time and neither pass holds more than
[B, chunk, V], in one of two ways (Settings.loss_impl):
  "fused"      fused_cross_entropy: the forward's chunk loop also computes
               each chunk's gradient (softmax - onehot, times the token's
               weight) and multiplies it into d features and d lm_head; the
               backward only scales them. One lm_head matmul forward, two
               for the gradient, none recomputed.
  "recompute"  chunked_cross_entropy under jax.checkpoint: the backward
               recomputes every chunk's logits (one more lm_head matmul).
`total_loss` takes logits or head inputs and gives the same numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m2jax.data.packing import next_token_targets
from m2jax.model import ModelOutput, shift_left
from m2jax.model.layers import constrain
from m2jax.settings import DEFAULT_LOSS_CHUNK, DEFAULT_LOSS_IMPL, LOSS_IMPLS


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


def _chunked(x_BxT, c: int):
  """x [B, T, ...] as [N, B, c, ...] chunks of c positions (zero-padded)."""
  B, T = x_BxT.shape[:2]
  n = -(-T // c)
  pad = [(0, 0), (0, n * c - T)] + [(0, 0)] * (x_BxT.ndim - 2)
  x = jnp.pad(x_BxT, pad)
  return x.reshape((B, n, c) + x_BxT.shape[2:]).swapaxes(0, 1)


def _unchunked(x_NxBxC, T: int):
  """The inverse of _chunked: [N, B, c, ...] back to [B, T, ...]."""
  N, B, c = x_NxBxC.shape[:3]
  x = x_NxBxC.swapaxes(0, 1).reshape((B, N * c) + x_NxBxC.shape[3:])
  return x[:, :T]


def _chunk_logits(f_BxCxD, w_DxV):
  """A chunk's float32 logits; w already in the compute dtype (the model's
  head: compute-dtype operands, float32 accumulation)."""
  logits = jnp.einsum("bcd,dv->bcv", f_BxCxD, w_DxV,
                      preferred_element_type=jnp.float32)
  return constrain(logits, ("act_batch", "act_length", "act_vocab"))


def _chunk_stats(logits_BxCxV, tgt_BxC):
  """(log-sum-exp, target logit, argmax int32) of a chunk's logits."""
  lse = jax.nn.logsumexp(logits_BxCxV, axis=-1)
  picked = jnp.take_along_axis(logits_BxCxV, tgt_BxC[..., None], -1)[..., 0]
  pred = jnp.argmax(jax.lax.stop_gradient(logits_BxCxV), -1)
  return lse, picked, pred.astype(jnp.int32)


def _one_pass_stats(logits_BxCxV, tgt_BxC):
  """_chunk_stats in one pass over the logits (not differentiable).

  One variadic reduction carries the running maximum, the sum of exp(logit
  - maximum), rescaled whenever the maximum grows, and the maximum's first
  index: the log-sum-exp and the argmax without the three passes over the
  float32 [B, chunk, V] logits that jax.nn.logsumexp and jnp.argmax make
  (max, sum of exps, argmax). The fused loss needs no derivative of them.
  Equal to those for finite logits (ties: the first index); a row holding
  +inf or NaN gives a NaN log-sum-exp (the logits of a matmul are finite
  unless training has already diverged).
  """
  axis = logits_BxCxV.ndim - 1
  index = jax.lax.broadcasted_iota(jnp.int32, logits_BxCxV.shape, axis)

  def merge(a, b):
    (m1, s1, i1), (m2, s2, i2) = a, b
    m = jnp.maximum(m1, m2)
    s = s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m)
    i = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
    return m, s, i

  # A finite floor, not -inf: two empty partials then merge to (floor, 0)
  # instead of exp(-inf - -inf) = NaN.
  floor = jnp.finfo(jnp.float32).min
  m, s, pred = jax.lax.reduce(
      (logits_BxCxV, jnp.ones_like(logits_BxCxV), index),
      (jnp.float32(floor), jnp.float32(0), jnp.int32(jnp.iinfo(jnp.int32).max)),
      merge, (axis,))
  picked = jnp.take_along_axis(logits_BxCxV, tgt_BxC[..., None], -1)[..., 0]
  # A row of -inf keeps the initial index: clamp it to a token.
  pred = jnp.minimum(pred, logits_BxCxV.shape[-1] - 1)
  return m + jnp.log(s), picked, pred


def chunked_cross_entropy(features_BxTxD, lm_head_DxV, targets_BxT, mask_BxT,
                          *, chunk: int = DEFAULT_LOSS_CHUNK):
  """cross_entropy of logits = features @ lm_head without [B, T, V].

  The logits are computed in float32 from `features` (the final-normed
  hidden state in the compute dtype; lm_head is cast to it, as the model's
  head does) `chunk` positions of every row at a time; the backward pass
  recomputes each chunk's logits (jax.checkpoint inside lax.map), so its
  largest array is also [B, chunk, V]. Returns (ce, lse, argmax), [B, T]
  each: ce and lse float32, zero where masked; argmax int32 (the predicted
  token, for metrics; no gradient). Settings.loss_impl="recompute";
  fused_cross_entropy computes the same without the recomputation.
  """
  T = features_BxTxD.shape[1]
  c = max(1, min(chunk, T))

  @jax.checkpoint
  def one(f_BxCxD, tgt_BxC, w_DxV):
    return _chunk_stats(_chunk_logits(f_BxCxD, w_DxV.astype(f_BxCxD.dtype)),
                        tgt_BxC)

  lse, picked, pred = jax.lax.map(
      lambda a: one(*a, lm_head_DxV),
      (_chunked(features_BxTxD, c),
       _chunked(targets_BxT.astype(jnp.int32), c)))
  lse, picked, pred = (_unchunked(x, T) for x in (lse, picked, pred))
  m = mask_BxT.astype(jnp.float32)
  return (lse - picked) * m, lse * m, pred


def _fused_scan(f_BxTxD, w_DxV, tgt_BxT, wce_BxT, wz_BxT, c: int,
                grads: bool):
  """The chunk loop of fused_cross_entropy: (loss, ce, lse, argmax) [B, T]
  (ce and lse unmasked), and with `grads` also (d features [B, T, D] in
  the features' dtype, d lm_head [D, V] float32) of the loss."""
  B, T, D = f_BxTxD.shape
  cdt = f_BxTxD.dtype
  w = w_DxV.astype(cdt)
  xs = tuple(_chunked(x, c) for x in (f_BxTxD, tgt_BxT.astype(jnp.int32),
                                      wce_BxT, wz_BxT))

  def body(dw_DxV, x):
    f_BxCxD, tgt_BxC, wce_BxC, wz_BxC = x
    logits = _chunk_logits(f_BxCxD, w)
    lse, picked, pred = _one_pass_stats(logits, tgt_BxC)
    if not grads:
      return dw_DxV, (lse, picked, pred)
    # d/dlogits of wce * (lse - picked) + wz * lse^2.
    p = jnp.exp(logits - lse[..., None])
    onehot = jnp.arange(logits.shape[-1]) == tgt_BxC[..., None]
    dlogits = ((wce_BxC + 2 * wz_BxC * lse)[..., None] * p
               - jnp.where(onehot, wce_BxC[..., None], 0.0)).astype(cdt)
    # Written once in the compute dtype, then read by both matmuls (the
    # barrier keeps XLA from recomputing the float32 softmax inside either).
    dlogits = jax.lax.optimization_barrier(dlogits)
    # Compute-dtype operands, float32 accumulation: the head's matmul.
    # Output in the compute dtype from the matmul itself (cuBLAS accumulates
    # in float32 on a GPU): a cuBLAS call, where a float32 output and a
    # cast became one Triton GEMM fusion (0.3 ms slower a step on an H100).
    dx = jnp.einsum("bcv,dv->bcd", dlogits, w, preferred_element_type=cdt)
    dw_DxV = dw_DxV + jnp.einsum("bcd,bcv->dv", f_BxCxD, dlogits,
                                 preferred_element_type=jnp.float32)
    return dw_DxV, (lse, picked, pred, dx)

  dw0 = jnp.zeros(w_DxV.shape, jnp.float32) if grads else None
  dw, ys = jax.lax.scan(body, dw0, xs)
  lse, picked, pred = (_unchunked(y, T) for y in ys[:3])
  ce = lse - picked
  loss = jnp.sum(wce_BxT * ce + wz_BxT * jnp.square(lse))
  if not grads:
    return loss, ce, lse, pred
  return loss, ce, lse, pred, _unchunked(ys[3], T), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(f_BxTxD, w_DxV, tgt_BxT, wce_BxT, wz_BxT, c):
  return _fused_scan(f_BxTxD, w_DxV, tgt_BxT, wce_BxT, wz_BxT, c, False)


def _fused_fwd(f_BxTxD, w_DxV, tgt_BxT, wce_BxT, wz_BxT, c):
  loss, ce, lse, pred, dx, dw = _fused_scan(f_BxTxD, w_DxV, tgt_BxT, wce_BxT,
                                            wz_BxT, c, True)
  return (loss, ce, lse, pred), (dx, dw.astype(w_DxV.dtype), ce, lse)


def _fused_bwd(c, res, cts):
  # Only the loss has a cotangent: fused_cross_entropy returns the per-token
  # values through stop_gradient, so theirs are always zero.
  del c
  dx, dw, ce, lse = res
  g = cts[0]
  return ((dx * g).astype(dx.dtype), (dw * g).astype(dw.dtype), None,
          ce * g, jnp.square(lse) * g)


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_cross_entropy(features_BxTxD, lm_head_DxV, targets_BxT, mask_BxT,
                        *, ce_weight, z_weight=0.0,
                        chunk: int = DEFAULT_LOSS_CHUNK):
  """A weighted cross-entropy of logits = features @ lm_head, its gradient
  computed in the same chunk loop as its value: no [B, T, V], no
  recomputation.

    loss = sum over the tokens of mask of
           ce_weight * (lse - logit[target]) + z_weight * lse^2

  (ce_weight = 1 / tokens gives the mean CE; z_weight the z-loss). The
  forward runs `chunk` positions of every row at a time: logits in float32
  from compute-dtype operands (lm_head cast to the features' dtype, as the
  model's head does), their log-sum-exp, target logit and argmax and, when
  differentiated, d logits = (w_ce + 2 w_z lse) softmax - w_ce onehot,
  cast to the compute dtype and multiplied into d features (saved in their
  dtype) and d lm_head (accumulated over the chunks in float32, returned in
  lm_head's dtype). The backward scales the two by the loss's cotangent.
  The weights may be traced scalars (a schedule's value) and have exact
  gradients.

  Returns (loss, ce, lse, argmax): loss a float32 scalar, the only output
  with a gradient; ce and lse [B, T] float32, zero where masked, and argmax
  [B, T] int32, under stop_gradient (metrics; a loss built from them would
  get no gradient, so weight tokens through ce_weight instead). Without
  differentiation only the forward half runs.
  """
  T = features_BxTxD.shape[1]
  m = mask_BxT.astype(jnp.float32)
  loss, ce, lse, pred = _fused(features_BxTxD, lm_head_DxV, targets_BxT,
                               m * ce_weight, m * z_weight,
                               max(1, min(chunk, T)))
  ce, lse = jax.lax.stop_gradient((ce * m, lse * m))
  return loss, ce, lse, pred


def head_losses(out: ModelOutput, batch, chunk: int, fused_weights=None):
  """[(mask, ce, lse, argmax)] of the main head then each MTP depth, from
  the logits or, without them, chunk by chunk; and the fused heads' loss.

  `fused_weights` = (ce weight, z weight) of each depth's mean: the heads
  run fused_cross_entropy and the second result is their weighted sum (the
  objective's CE and z terms, differentiable); else it is None and ce, lse
  carry the gradient."""
  res, fused_loss = [], None
  for k in range(1 + len(out.mtp_logits)):
    targets, mask = target_mask(batch, k + 1)
    if out.logits is not None:
      logits = out.logits if k == 0 else out.mtp_logits[k - 1]
      ce, lse = cross_entropy(logits, targets, mask)
      pred = jnp.argmax(logits, -1)
    elif fused_weights is None:
      ce, lse, pred = chunked_cross_entropy(out.head_inputs[k], out.lm_head,
                                            targets, mask, chunk=chunk)
    else:
      ce_w, z_w = fused_weights[k]
      tokens = jnp.maximum(jnp.sum(mask), 1)
      part, ce, lse, pred = fused_cross_entropy(
          out.head_inputs[k], out.lm_head, targets, mask,
          ce_weight=ce_w / tokens, z_weight=z_w / tokens, chunk=chunk)
      fused_loss = part if fused_loss is None else fused_loss + part
    res.append((mask, ce, lse, pred))
  return res, fused_loss


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
               chunk: int = DEFAULT_LOSS_CHUNK,
               impl: str = DEFAULT_LOSS_IMPL):
  """The training objective and its metrics for one batch.

  `main_weight` = 0 trains the MTP modules alone (growth phase); the main CE
  is still reported. `aux_coef` scales the routers' balance loss (module
  docstring for how the main and MTP routers are weighted). `out` has
  logits, or head inputs (model.forward(logits=False)): then the heads run
  `chunk` positions at a time, `impl` "fused" (fused_cross_entropy) or
  "recompute" (chunked_cross_entropy; Settings.loss_impl).
  """
  fused = None
  if out.logits is None and impl == "fused":
    depths = len(out.mtp_logits)
    fused = [(main_weight, z_coef)] + [
        (mtp_weight / depths, 0.0) for _ in range(depths)]
  elif impl not in LOSS_IMPLS:
    raise ValueError(f"total_loss: impl must be one of {LOSS_IMPLS} "
                     f"(got {impl!r})")
  heads, fused_loss = head_losses(out, batch, chunk, fused)
  mask, ce, lse, main_pred = heads[0]
  main_ce = _mean(ce, mask)
  # The CE and z terms from the metrics' values; the fused heads' own sum
  # replaces them below (these came through stop_gradient and carry none).
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
  for k, (mask_k, ce_k, _, pred_k) in enumerate(heads[1:], start=1):
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
  if fused_loss is not None:
    loss = fused_loss

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
