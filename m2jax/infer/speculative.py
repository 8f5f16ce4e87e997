"""MTP speculative decoding: the acceptance rule (Leviathan et al. 2023).

The MTP modules draft K tokens, d_1..d_K, each sampled from its own
distribution q_i (the module's logits under the request's sampling
transform, m2jax/infer/sampling.py); the main model then scores the K + 1
positions [x, d_1, .., d_K] in one forward, giving target distributions
p_0..p_K (p_i predicts the token after position i). Drafts are checked in
order:

  accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i));
  at the first rejection, emit a token from normalise(max(0, p_{i-1} - q_i))
  and stop; if all K are accepted, emit one more token from p_K.

Every emitted token is then distributed exactly as p (the model's own
sampling distribution), so its reported log-prob is log p(token), the
target's. Greedy rows are the special case of one-hot p and q: a draft is
accepted iff it equals the main model's argmax, and the first mismatch is
replaced by that argmax, so the output is token for token that of plain
greedy decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept(drafts_BxK, draft_logq_BxKxV, target_logits_BxK1xV,
           target_logp_BxK1xV, greedy_B, key_B):
  """(accepted [B] int32 in 0..K, tokens [B, K+1], logprobs [B, K+1]).

  tokens[:, :accepted + 1] are the emitted tokens (accepted drafts, then
  the correction or bonus token); later entries are padding. draft_logq
  and target_logp are log-probabilities of the sampling distributions
  (-1e30 outside their support); target_logits are the raw logits (greedy
  rows compare against their argmax). key_B: one PRNG key per row.
  """
  B, K = drafts_BxK.shape
  argmax = jnp.argmax(target_logits_BxK1xV, axis=-1).astype(jnp.int32)
  pick = lambda lp, tok: jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]
  logp_d = pick(target_logp_BxK1xV[:, :K], drafts_BxK)
  logq_d = pick(draft_logq_BxKxV, drafts_BxK)
  keys = jax.vmap(lambda k: jax.random.split(k, 2))(key_B)
  u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(keys[:, 0])
  ok = jnp.where(greedy_B[:, None], drafts_BxK == argmax[:, :K],
                 jnp.log(u) < logp_d - logq_d)
  # accepted = length of the all-True prefix.
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

  # The last emitted token: a correction from the residual at the first
  # rejection, or the bonus token from p_K.
  p_at = jnp.take_along_axis(target_logp_BxK1xV, accepted[:, None, None],
                             axis=1)[:, 0]                       # [B, V]
  q_pad = jnp.concatenate([draft_logq_BxKxV,
                           jnp.full_like(draft_logq_BxKxV[:, :1], -jnp.inf)],
                          axis=1)
  q_at = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(jnp.exp(p_at) - jnp.exp(q_at), 0.0)
  # p == q leaves no residual mass (a rejection then has probability 0);
  # fall back to p so the draw stays defined.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual,
                       jnp.exp(p_at))
  # log(0) spelled out: XLA's log of a flushed denormal floor is NaN.
  positive = residual > 0
  log_residual = jnp.where(positive, jnp.log(jnp.where(positive, residual,
                                                       1.0)), -jnp.inf)
  drawn = jax.vmap(jax.random.categorical)(keys[:, 1], log_residual).astype(
      jnp.int32)
  last = jnp.where(greedy_B, jnp.take_along_axis(
      argmax, accepted[:, None], axis=1)[:, 0], drawn)

  idx = jnp.arange(K + 1)[None]
  padded = jnp.concatenate([drafts_BxK, jnp.zeros((B, 1), jnp.int32)], 1)
  tokens = jnp.where(idx < accepted[:, None], padded,
                     jnp.where(idx == accepted[:, None], last[:, None], 0))
  logprobs = jnp.where(idx <= accepted[:, None],
                       pick(target_logp_BxK1xV, tokens), 0.0)
  return accepted.astype(jnp.int32), tokens.astype(jnp.int32), logprobs
