"""MTP co-training during RL (Forge's rollout acceleration, SPEC §3).

The rollout engine drafts with the MTP modules (m2jax/infer/speculative.py);
a draft of depth k is accepted with probability sum_x min(p(x), q_k(x)) for
the policy p and the draft distribution q_k at the same context, so as RL
moves the policy, drafts that no longer follow it are rejected and rollout
slows down. The RL step therefore trains the MTP modules towards the
current policy's next-token distribution on the batch's own rows:

  loss_k = sum_{s,l} w_k[s, l] * KL(p_S || q_S)(at the position predicting
           token l of sample s)                 (RLConfig.mtp_loss "topk_kl")

p is the main model's softmax at the position that predicts token l (its
logits one position later than depth k's, which predicts the same token
from k positions further back), under stop-gradient; q is depth k's softmax
there. S is the policy's top-K tokens (K = RLConfig.mtp_topk; ties at the
K-th logit keep every tied token, as m2jax/infer/sampling.py does). Both
are taken at temperature 1: logits that match give matching distributions
at any rollout temperature.

Direction: forward KL(p || q), the mass-covering one. It is a cross-entropy
with soft targets p (on the full vocabulary its gradient in q's logits is
q - p, and on S token by token; tests/test_rl_mtp.py), it penalises a
draft that gives little mass to what the policy samples, and it is the
direction in which cutting the sum to S is sound: the terms it drops are
weighted by p, small outside p's top-K. (The reverse KL(q || p) weights by
q, so exactly the mass a bad draft puts outside p's top-K would be dropped,
and it is mode-seeking, which would sharpen q and lose acceptance on the
policy's other likely tokens.)

The rest of the mass (RLConfig.mtp_tail):
  "bucket" (default): the tokens outside S are one outcome, "other", with
    mass p(rest) = 1 - p(S) and q(rest) = 1 - q(S): KL over K + 1
    outcomes, a lower bound of the full KL that is 0 iff q equals p on every
    token of S and on the total rest. At that minimum the acceptance is at
    least p(S) (sum min(p, q) >= sum_S p), so the loss controls the mass
    q drafts outside the policy's likely tokens.
  "renormalize": p and q renormalised over S, the rest ignored: only q's
    shape inside S is trained, and q may keep any mass outside S.
Both are computed over the whole vocabulary with S as a mask (one top_k for
the threshold, no gather), in float32; the rest's log-mass is a
log-sum-exp over the masked logits, exact even when it is tiny.

Positions. In the tree layout (m2jax/model/mtp.py) the depth-k element at
node c and the main model's logits at c both predict c's children, so the
KL pairs the two logits of the same element and is read for token l at its
parent, like a log-prob: every sample follows its own branch, and the
merged loss is the unmerged one (tests/test_prefix_tree.py). The weights
w_k are the depth-k CE weights of RLConfig.mtp_loss "ce" (trained tokens
l >= k + 1, a token mean over the batch): the positions at which the
rollout drafted action tokens.

Gradients reach the MTP modules only when RLConfig.mtp_detach (the default;
model.forward(mtp_detach=True)): the modules read the trunk's hidden state,
the embedding, final norm and lm_head without training them, so co-training
tracks the policy without moving it.

Measured acceptance: `rollout_acceptance` turns the engine's counters
(Engine.stats "drafted", "accepted", "accepted_at_k") over one RL step into
the metrics "mtp/acceptance" (accepted / drafted) and
"mtp/acceptance_at_k" (the fraction of rounds whose first k drafts were all
accepted); the loop logs them each step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m2jax.rl import prefix_tree

LOSSES = ("ce", "topk_kl")
TAILS = ("bucket", "renormalize")
# A finite stand-in for -inf in masked log-sum-exps: an empty set then has
# log-mass about -1e30 (mass 0) with finite gradients, never NaN.
_NEG = -1e30


def _lse(x, mask):
  return jax.nn.logsumexp(jnp.where(mask, x, _NEG), axis=-1)


def topk_kl(target_logits_RxTxV, logits_RxTxV, *, topk: int,
            tail: str = "bucket"):
  """[R, T] float32: KL(p || q) of every element over the policy's top-`topk`
  tokens (module docstring). p = softmax(target_logits) under
  stop-gradient, q = softmax(logits); `tail` treats the rest of the mass."""
  if tail not in TAILS:
    raise ValueError(f"topk_kl: tail must be one of {TAILS} (got {tail!r})")
  p = jax.lax.stop_gradient(target_logits_RxTxV).astype(jnp.float32)
  q = logits_RxTxV.astype(jnp.float32)
  k = min(topk, p.shape[-1])
  kth = jax.lax.top_k(p, k)[0][..., -1:]
  top = p >= kth
  if tail == "renormalize":
    lp = p - _lse(p, top)[..., None]
    lq = q - _lse(q, top)[..., None]
    return jnp.sum(jnp.where(top, jnp.exp(lp) * (lp - lq), 0.0), axis=-1)
  lse_p = jax.nn.logsumexp(p, axis=-1)
  lse_q = jax.nn.logsumexp(q, axis=-1)
  lp = p - lse_p[..., None]
  lq = q - lse_q[..., None]
  head = jnp.sum(jnp.where(top, jnp.exp(lp) * (lp - lq), 0.0), axis=-1)
  lp_rest = _lse(p, ~top) - lse_p
  lq_rest = _lse(q, ~top) - lse_q
  return head + jnp.exp(lp_rest) * (lp_rest - lq_rest)


def acceptance_probability(target_logits_RxTxV, logits_RxTxV):
  """[R, T]: sum_x min(p(x), q(x)), the probability that speculative
  sampling at temperature 1 accepts a draft from q against p
  (speculative.py), p and q the two softmaxes; no gradient."""
  lp = jax.nn.log_softmax(target_logits_RxTxV.astype(jnp.float32), axis=-1)
  lq = jax.nn.log_softmax(logits_RxTxV.astype(jnp.float32), axis=-1)
  return jax.lax.stop_gradient(jnp.sum(jnp.exp(jnp.minimum(lp, lq)), -1))


def at_parent(values_RxT, parent_RxT, sample_index_SxL):
  """[S, L]: the value of the element that predicts token l of sample s
  (its parent; 0 at l = 0 and past the end), as token_logprobs reads a
  log-prob."""
  v = jnp.take_along_axis(values_RxT, jnp.maximum(parent_RxT, 0), axis=1)
  return prefix_tree.gather_samples(jnp.where(parent_RxT >= 0, v, 0.0),
                                    sample_index_SxL)


def mtp_loss(logits_RxTxV, mtp_logits, tokens_RxT, parent_RxT,
             sample_index_SxL, weights_KxSxL, *, loss: str, topk: int,
             tail: str):
  """(the MTP term, metrics) of one micro-batch: the mean over depths of
  each depth's weighted sum (module docstring), `loss` "ce" (the sampled
  token's cross-entropy) or "topk_kl". Metrics per depth k and their mean
  over depths: "mtp/ce_k" (always), "mtp/kl_k" (topk_kl) and
  "mtp/accept_prob_k" (the expected acceptance at temperature 1 on these
  positions), weighted sums like the loss."""
  if loss not in LOSSES:
    raise ValueError(f"mtp_loss: loss must be one of {LOSSES} (got "
                     f"{loss!r})")
  metrics, terms = {}, []
  for k, logits_k in enumerate(mtp_logits, start=1):
    w = weights_KxSxL[k - 1]
    lp = prefix_tree.sample_logprobs(logits_k, tokens_RxT, parent_RxT,
                                     sample_index_SxL)
    metrics[f"mtp/ce_{k}"] = -jnp.sum(w * lp)
    accept = acceptance_probability(logits_RxTxV, logits_k)
    metrics[f"mtp/accept_prob_{k}"] = jnp.sum(
        w * at_parent(accept, parent_RxT, sample_index_SxL))
    if loss == "topk_kl":
      kl = topk_kl(logits_RxTxV, logits_k, topk=topk, tail=tail)
      metrics[f"mtp/kl_{k}"] = jnp.sum(
          w * at_parent(kl, parent_RxT, sample_index_SxL))
      terms.append(metrics[f"mtp/kl_{k}"])
    else:
      terms.append(metrics[f"mtp/ce_{k}"])
  depth = len(mtp_logits)
  for name in ("ce", "accept_prob") + (("kl",) if loss == "topk_kl" else ()):
    metrics[f"mtp/{name}"] = sum(metrics[f"mtp/{name}_{k}"]
                                 for k in range(1, depth + 1)) / depth
  return sum(terms) / depth, metrics


def rollout_acceptance(before: dict, after: dict, draft: int) -> dict:
  """Speculative acceptance over the engine's work between two readings of
  Engine.stats (counters), `draft` = EngineConfig.mtp_draft = K:
  "mtp/acceptance" = accepted / drafted drafts, "mtp/acceptance_at_k" =
  the fraction of rounds whose first k drafts were all accepted, and
  "mtp/rounds". NaN where no round ran; {} without drafting (K = 0)."""
  if not draft:
    return {}
  delta = lambda key: after.get(key, 0) - before.get(key, 0)
  drafted = delta("drafted")
  rounds = drafted / draft
  ratio = lambda n, d: n / d if d > 0 else float("nan")
  out = {"mtp/acceptance": ratio(delta("accepted"), drafted),
         "mtp/rounds": rounds}
  for k in range(1, draft + 1):
    out[f"mtp/acceptance_at_{k}"] = ratio(delta(f"accepted_at_{k}"), rounds)
  return out


def engine_counters(stats, draft: int) -> dict:
  """The counters `rollout_acceptance` reads, copied one key at a time (the
  rollout thread may be adding keys to `stats` meanwhile)."""
  keys = ["drafted", "accepted"] + [f"accepted_at_{k}"
                                    for k in range(1, draft + 1)]
  return {k: int(stats.get(k, 0)) for k in keys}
