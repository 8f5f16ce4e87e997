"""The merged RL step: Forge's policy update on prefix-tree rows (SPEC §3).

Samples are merged into prefix trees and packed into rows
(m2jax.rl.prefix_tree.pack, with the loss masks and the "old_logprobs" and
"advantages" payloads). The step runs the model once per row in tree
layout, gathers every sample's per-token log-probs back to its own layout
and computes the loss there, so the objective is exactly the unmerged one:

  loss = policy loss(log pi, old log pi, A; token weights w)
           CISPO (cispo.py, the default) or PPO-clip (GRPO, DAPO;
           objectives.py), by RLConfig.algorithm
       + kl_coef * sum w * k3(ref log pi, log pi)      (optional)
       + mtp_weight * mean_k sum w_k * mtp_k          (optional, depth k)

mtp_k is the top-K KL from the policy's next-token distribution to depth
k's (RLConfig.mtp_loss "topk_kl", the default; m2jax/rl/mtp_cotrain.py) or
the cross-entropy -log p_k of the sampled token ("ce").

The algorithms (RLConfig.algorithm; clip ranges and normalisations in
RLConfig.cispo / .grpo / .dapo):
  "cispo"  clipped ratio as a stop-gradient weight, per-group token mean
  "grpo"   PPO-clip, eps 0.2, a token mean per sample then over samples
  "dapo"   PPO-clip with Clip-Higher (eps 0.2 / 0.28), one token mean over
           the batch; the trainer drops groups of equal rewards first
           (objectives.dynamic_sampling, RLConfig.dynamic_sampling)
Advantages come in as a payload; the trainer computes them with
objectives.group_advantages(rewards, groups, std=config.advantage_std).

KL (kl_coef > 0): the reference policy's log-probs are computed on the
same merged rows (`reference_logprobs`, a forward pass with the reference
parameters) and stored in the batch before the step. The metrics
"policy/entropy" (the policy's entropy on trained tokens, weighted like the
loss), "policy/clip_fraction", "policy/logp_gap" (mean |log pi - behaviour
log pi|, ~1e-6 on an on-policy step) and "policy/kl" are means under the
algorithm's normalisation.

MTP (k = 1..mtp_depth): depth k's term for token l of a sample is read
from the tree-layout MTP logits at the token's parent (valid where
depth(parent) >= k, i.e. l >= k + 1), on the trained tokens (the policy's
outputs, which the MTP modules draft at rollout). As in pretraining, each
depth's term is a token mean over the batch and the depths are averaged.
With RLConfig.mtp_detach (the default) the term trains the MTP modules
only: the policy's gradient is that of the policy loss (and KL) alone.

Every term is a weighted sum whose weights are computed once for the whole
batch on the host (`make_batches`), so a batch can be cut into micro-batches
of rows (a group may straddle rows): their losses, gradients and metrics
add up to the batch's. `train_step` accumulates them with a scan (memory of
one micro-batch) and applies the optimizer and the expert-bias update
(m2jax.train.step.apply_gradients); `grad_step` is one micro-batch. Of the
routing statistics only the counts add up (expert loads, dropped pairs);
the router entropy (a mean over tokens) and aux loss (a mean over
documents) of the batch are the micro-batches' means weighted by their
tokens and documents, reported as pretraining reports them
(m2jax.train.losses.routing_metrics).

  trees = prefix_tree.pack(seqs, row_len=T, loss_masks=masks, payloads={
      "old_logprobs": old, "advantages": adv})
  batches = make_batches(trees, group_ids, config, rows_per_batch=1)
  if config.kl_coef:
    batches = [b._replace(ref_logprobs=ref_fn(ref_params, ref_bias, b))
               for b in batches]   # ref_fn: jit(reference_logprobs)
  state, metrics = train_step(state, stack_batches(batches),
                              model_config=mcfg, train_config=tcfg,
                              config=config)

The step adds no router auxiliary loss: the expert bias balances the load,
updated from the load of the tokens actually computed (a shared prefix
routes once, as it runs once).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.rl import cispo
from m2jax.rl import mtp_cotrain
from m2jax.rl import objectives
from m2jax.rl import prefix_tree
from m2jax.train import losses
from m2jax.train import state as state_lib
from m2jax.train import step as train_lib
from m2jax.train.config import TrainConfig

# The MTP loss weight at the end of pretraining's decay phase (the paper
# anneals 0.3 -> 0.1; SPEC §2): RL continues from there.
MTP_WEIGHT = 0.1
# The policy's tokens the MTP KL matches one by one (the rest is one
# outcome; mtp_cotrain.py). Ours: the report names a top-K KL, not its K.
MTP_TOPK = 32
ALGORITHMS = ("cispo", "grpo", "dapo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
  """The policy objective, the KL to a reference policy, the advantages and
  the MTP modules trained alongside (module docstring).

  algorithm: "cispo" | "grpo" | "dapo"; the clip range and normalisation
    are the field of that name (`policy`).
  kl_coef: weight of the k3 KL to the reference policy; 0 turns it off
    (no reference forward pass).
  advantage_std: divide group-relative advantages by the group std (GRPO,
    DAPO) or not (Dr. GRPO); read by the trainer for
    objectives.group_advantages.
  mtp_depth: MTP modules trained alongside (0: none).
  mtp_weight: their term's weight. With mtp_detach it scales only the MTP
    modules' gradients (which still count in the global-norm clip).
  mtp_loss: "topk_kl" (co-training to the current policy; mtp_cotrain.py)
    or "ce" (the sampled tokens' cross-entropy, as in pretraining).
  mtp_topk: K of the top-K KL; mtp_tail: the rest of the mass, "bucket"
    (one outcome) or "renormalize" (ignored).
  mtp_detach: the MTP term trains the MTP modules only, never the policy
    (trunk, embedding, final norm, lm_head); False lets it reach them as
    in pretraining.
  mtp_reference: also score, on every batch, the MTP modules the trainer
    started with (kept frozen) against the current policy: the metrics
    "mtp/ref_accept_prob", "mtp/ref_kl" (and per depth) are what the
    co-trained "mtp/accept_prob" and "mtp/kl" would be without
    co-training, on the same policy and tokens (one more forward pass a
    step; `mtp_reference_metrics`).
  """
  algorithm: str = "cispo"
  cispo: cispo.CISPOConfig = cispo.CISPOConfig()
  grpo: objectives.PPOClipConfig = objectives.GRPO
  dapo: objectives.PPOClipConfig = objectives.DAPO
  kl_coef: float = 0.0
  advantage_std: bool = True
  mtp_depth: int = 0
  mtp_weight: float = MTP_WEIGHT
  mtp_loss: str = "topk_kl"
  mtp_topk: int = MTP_TOPK
  mtp_tail: str = "bucket"
  mtp_detach: bool = True
  mtp_reference: bool = False

  @property
  def policy(self):
    """The selected algorithm's config (clip range, normalisation)."""
    return getattr(self, self.algorithm)

  @property
  def dynamic_sampling(self) -> bool:
    """Whether the trainer drops groups of equal rewards
    (objectives.dynamic_sampling): part of DAPO."""
    return self.algorithm == "dapo"

  def __post_init__(self):
    if self.algorithm not in ALGORITHMS:
      raise ValueError(f"RLConfig.algorithm: must be one of {ALGORITHMS} "
                       f"(got {self.algorithm!r})")
    if not 0 <= self.kl_coef < float("inf"):
      raise ValueError(f"RLConfig.kl_coef: must be finite and >= 0 (got "
                       f"{self.kl_coef!r})")
    if self.mtp_depth < 0:
      raise ValueError(f"RLConfig.mtp_depth: must be >= 0 (got "
                       f"{self.mtp_depth!r})")
    if not 0 <= self.mtp_weight < float("inf"):
      raise ValueError(f"RLConfig.mtp_weight: must be finite and >= 0 (got "
                       f"{self.mtp_weight!r})")
    if self.mtp_loss not in mtp_cotrain.LOSSES:
      raise ValueError(f"RLConfig.mtp_loss: must be one of "
                       f"{mtp_cotrain.LOSSES} (got {self.mtp_loss!r})")
    if not isinstance(self.mtp_topk, int) or self.mtp_topk < 1:
      raise ValueError(f"RLConfig.mtp_topk: must be an integer >= 1 (got "
                       f"{self.mtp_topk!r})")
    if self.mtp_tail not in mtp_cotrain.TAILS:
      raise ValueError(f"RLConfig.mtp_tail: must be one of "
                       f"{mtp_cotrain.TAILS} (got {self.mtp_tail!r})")
    if self.mtp_reference and not self.mtp_depth:
      raise ValueError("RLConfig.mtp_reference: needs MTP modules "
                       "(mtp_depth >= 1)")


class RLBatch(NamedTuple):
  """One micro-batch: R packed rows of T tokens in tree layout and the S
  samples they hold (L tokens at most), with whole-batch weights."""
  tokens: np.ndarray        # [R, T] int32
  segment_ids: np.ndarray   # [R, T] int32, 0 = padding
  positions: np.ndarray     # [R, T] int32, depths
  subtree_end: np.ndarray   # [R, T] int32
  parent: np.ndarray        # [R, T] int32, -1 at roots and padding
  sample_index: np.ndarray  # [S, L] int32, r * T + t in these rows, -1 pad
  old_logprobs: np.ndarray  # [S, L] float32
  ref_logprobs: np.ndarray  # [S, L] float32, reference policy (KL only)
  advantages: np.ndarray    # [S, L] float32
  weights: np.ndarray       # [S, L] float32, the objective's token weights
  mtp_weights: np.ndarray   # [K, S, L] float32, depth-k MTP weights


def _mtp_weights(loss_mask_SxL, depth: int) -> np.ndarray:
  """[K, S, L]: depth k's token mean over trained tokens l >= k + 1."""
  L = loss_mask_SxL.shape[1]
  out = np.zeros((depth,) + loss_mask_SxL.shape, np.float32)
  for k in range(1, depth + 1):
    m = loss_mask_SxL & (np.arange(L)[None] >= k + 1)
    out[k - 1] = m / max(m.sum(), 1)
  return out


def make_batches(trees: prefix_tree.PackedTrees, group_ids_S,
                 config: RLConfig, *, rows_per_batch: int | None = None,
                 samples_per_batch: int | None = None) -> list[RLBatch]:
  """Cuts packed trees into micro-batches of `rows_per_batch` rows (default:
  all rows), weights computed over the whole batch first.

  Every micro-batch has the same shapes (one compiled step): the last one
  gets padding rows, and each holds `samples_per_batch` sample slots
  (default: the most any micro-batch needs; padding slots weigh 0).
  `trees.payloads` must hold "old_logprobs" and "advantages". With
  `config.kl_coef` > 0, `ref_logprobs` is the payload of that name if
  given, else NaN until `reference_logprobs` fills it (a forgotten
  reference pass shows as a NaN loss, not as a wrong KL).
  """
  missing = {"old_logprobs", "advantages"} - set(trees.payloads)
  if missing:
    raise ValueError(f"make_batches: trees.payloads lacks {sorted(missing)}")
  R, T = trees.tokens.shape
  k = R if rows_per_batch is None else rows_per_batch
  if k < 1:
    raise ValueError(f"make_batches: rows_per_batch must be >= 1, got {k}")
  weights = objectives.token_weights(trees.loss_mask, group_ids_S,
                                     config.policy.normalize)
  ref = trees.payloads.get("ref_logprobs")
  if ref is None:
    ref = np.full(trees.loss_mask.shape,
                  np.nan if config.kl_coef else 0.0, np.float32)
  mtp_weights = _mtp_weights(trees.loss_mask, config.mtp_depth)
  row_of_sample = trees.sample_index[:, 0] // T
  starts = range(0, R, k)
  members = [np.nonzero((row_of_sample >= a) & (row_of_sample < a + k))[0]
             for a in starts]
  S = max(map(len, members)) if samples_per_batch is None else (
      samples_per_batch)
  if S < max(map(len, members)):
    raise ValueError(f"make_batches: a micro-batch holds "
                     f"{max(map(len, members))} samples, samples_per_batch="
                     f"{S}")

  def rows(x, a, fill):  # rows a .. a+k of x, padding rows set to `fill`
    part = x[a:a + k]
    pad = np.broadcast_to(np.asarray(fill, x.dtype), (k - len(part), T))
    return np.concatenate([part, pad])

  def slots(x, ids, fill, axis=0):  # samples `ids` of x in S slots
    part = np.take(x, ids, axis=axis)
    shape = list(part.shape)
    shape[axis] = S - len(ids)
    return np.concatenate([part, np.full(shape, fill, x.dtype)], axis=axis)

  out = []
  for a, ids in zip(starts, members):
    index = slots(trees.sample_index, ids, -1)
    out.append(RLBatch(
        tokens=rows(trees.tokens, a, 0),
        segment_ids=rows(trees.segment_ids, a, 0),
        positions=rows(trees.positions, a, 0),
        # In a padding row every token sees only itself.
        subtree_end=rows(trees.subtree_end, a, np.arange(1, T + 1)),
        parent=rows(trees.parent, a, -1),
        sample_index=np.where(index >= 0, index - a * T, -1).astype(np.int32),
        old_logprobs=slots(trees.payloads["old_logprobs"], ids, 0),
        ref_logprobs=slots(ref, ids, 0),
        advantages=slots(trees.payloads["advantages"], ids, 0),
        weights=slots(weights, ids, 0),
        mtp_weights=slots(mtp_weights, ids, 0, axis=1)))
  return out


def stack_batches(batches) -> RLBatch:
  """Micro-batches stacked on a leading axis [M, ...] for `train_step`."""
  return RLBatch(*(np.stack(field) for field in zip(*batches)))


def policy_loss(logprobs_SxL, old_logprobs_SxL, advantages_SxL, weights_SxL,
                ref_logprobs_SxL=None, *, config: RLConfig):
  """(loss, metrics): the algorithm's policy loss plus kl_coef times the
  k3 KL to the reference log-probs (used only when kl_coef > 0), all
  [S, L] inputs, weighted sums with the weights of
  objectives.token_weights. Metrics: "policy/loss" (the policy term),
  "policy/clip_fraction", "policy/tokens", "policy/logp_gap" (the weighted
  mean |log pi - old log pi|: the importance ratio's distance from 1) and,
  with KL, "policy/kl"."""
  if config.algorithm == "cispo":
    loss, metrics = cispo.cispo_loss(logprobs_SxL, old_logprobs_SxL,
                                     advantages_SxL, weights_SxL,
                                     config.cispo)
  else:
    loss, metrics = objectives.ppo_clip_loss(logprobs_SxL, old_logprobs_SxL,
                                             advantages_SxL, weights_SxL,
                                             config.policy)
  # How far the trainer's log-probs are from the behaviour log-probs the
  # rollout recorded: ~1e-6 on an on-policy step (the same weights), so a
  # larger value on a sync run's tokens means the two computations of
  # log pi disagree (a shifted mask, a mismatched context); off-policy
  # steps add the policy's own movement.
  metrics["policy/logp_gap"] = jnp.sum(
      weights_SxL * jax.lax.stop_gradient(
          jnp.abs(logprobs_SxL - old_logprobs_SxL)))
  if config.kl_coef:
    if ref_logprobs_SxL is None:
      raise ValueError("policy_loss: RLConfig.kl_coef > 0 needs the "
                       "reference log-probs (ref_logprobs_SxL)")
    kl = objectives.reference_kl(logprobs_SxL, ref_logprobs_SxL,
                                 weights_SxL)
    loss = loss + config.kl_coef * kl
    metrics["policy/kl"] = kl
  return loss, metrics


def _forward(params, expert_bias, batch: RLBatch, model_config, mtp_depth,
             mtp_detach=False):
  return model.forward(model_config,
                       state_lib.model_variables(params, expert_bias),
                       batch.tokens, segment_ids=batch.segment_ids,
                       positions=batch.positions,
                       subtree_end=batch.subtree_end, parent=batch.parent,
                       mtp_depth=mtp_depth, mtp_detach=mtp_detach)


def reference_logprobs(ref_params, expert_bias, batch: RLBatch, *,
                       model_config: ModelConfig):
  """[S, L] float32: the reference policy's log-probs of every sample token
  of `batch`, computed on its merged rows (jittable). `expert_bias` is the
  reference model's. Store them with batch._replace(ref_logprobs=...)."""
  out = _forward(ref_params, expert_bias, batch, model_config, 0)
  return prefix_tree.sample_logprobs(out.logits, batch.tokens, batch.parent,
                                     batch.sample_index)


def mtp_reference_metrics(params, expert_bias, ref_mtp, batches: RLBatch, *,
                          model_config: ModelConfig, config: RLConfig):
  """The co-training metrics of the frozen reference MTP modules
  (RLConfig.mtp_reference) on micro-batches stacked on axis 0: the policy's
  `params` and `expert_bias` with the MTP subtrees (top-level "mtp_*") of
  `ref_mtp` = {"params": ..., EXPERT_BIAS: ...} in their place, one forward
  pass; returns mtp_cotrain.mtp_loss's metrics renamed "mtp/ref_*", summed
  over micro-batches like the step's (jittable)."""
  params = {**params, **ref_mtp["params"]}
  expert_bias = {**expert_bias, **ref_mtp[model.EXPERT_BIAS]}

  def one(batch):
    out = _forward(params, expert_bias, batch, model_config, config.mtp_depth)
    _, metrics = mtp_cotrain.mtp_loss(
        out.logits, out.mtp_logits, batch.tokens, batch.parent,
        batch.sample_index, batch.mtp_weights, loss="topk_kl",
        topk=config.mtp_topk, tail=config.mtp_tail)
    return {k.replace("mtp/", "mtp/ref_", 1): v for k, v in metrics.items()
            if not k.startswith("mtp/ce")}

  return jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.lax.map(one, batches))


def loss_fn(params, expert_bias, batch: RLBatch, *, model_config: ModelConfig,
            config: RLConfig):
  """(loss, (metrics, model output)) of one micro-batch (module docstring).

  Metrics are weighted sums, so a batch's are the sums over its
  micro-batches.
  """
  tokens, parent = batch.tokens, batch.parent
  out = _forward(params, expert_bias, batch, model_config, config.mtp_depth,
                 config.mtp_detach)
  logprobs_SxL = prefix_tree.sample_logprobs(out.logits, tokens, parent,
                                             batch.sample_index)
  loss, metrics = policy_loss(logprobs_SxL, batch.old_logprobs,
                              batch.advantages, batch.weights,
                              batch.ref_logprobs, config=config)
  entropy_SxL = objectives.sample_entropy(jax.lax.stop_gradient(out.logits),
                                          parent, batch.sample_index)
  metrics["policy/entropy"] = jnp.sum(batch.weights * entropy_SxL)
  if config.mtp_depth:
    mtp_term, mtp_metrics = mtp_cotrain.mtp_loss(
        out.logits, out.mtp_logits, tokens, parent, batch.sample_index,
        batch.mtp_weights, loss=config.mtp_loss, topk=config.mtp_topk,
        tail=config.mtp_tail)
    loss = loss + config.mtp_weight * mtp_term
    metrics.update(mtp_metrics)
  metrics["loss"] = loss
  return loss, (metrics, out)


def grad_step(params, expert_bias, batch: RLBatch, *,
              model_config: ModelConfig, config: RLConfig):
  """Gradients, metrics and routing of one micro-batch (jittable).

  Returns (grads, metrics, routing): `routing` is the ModelOutput with only
  its routing statistics kept (what the expert-bias update reads), so it
  can be summed over micro-batches like the rest.
  """
  grad_fn = jax.grad(functools.partial(loss_fn, model_config=model_config,
                                       config=config), has_aux=True)
  grads, (metrics, out) = grad_fn(params, expert_bias, batch)
  routing = out._replace(logits=None, hidden=None,
                         mtp_logits=(None,) * len(out.mtp_logits))
  return grads, metrics, routing


def _routing_sums(out: model.ModelOutput, invert: bool = False):
  """`out` with each routing mean times its count (entropy x counted
  tokens, aux loss x documents), so micro-batches add up; `invert` turns
  such sums back into means."""

  def convert(stats):
    if stats is None:
      return None
    tokens = jnp.sum(stats.load_E, axis=-1)  # K x the counted tokens
    docs = stats.documents.astype(jnp.float32)
    if invert:
      tokens, docs = 1 / jnp.maximum(tokens, 1), 1 / jnp.maximum(docs, 1)
    return stats._replace(entropy=stats.entropy * tokens,
                          aux_loss=stats.aux_loss * docs)

  return out._replace(routing=convert(out.routing),
                      mtp_routing=convert(out.mtp_routing))


def train_step(state: state_lib.TrainState, batches: RLBatch, *,
               model_config: ModelConfig, train_config: TrainConfig,
               config: RLConfig):
  """One policy update over micro-batches stacked on axis 0
  (`stack_batches`): gradients, metrics and expert loads summed by a scan
  (routing means weighted, module docstring), then the optimizer and
  expert-bias update of the pretraining step. Returns the new state and
  metrics."""

  def step(params, expert_bias, batch):
    grads, metrics, routing = grad_step(params, expert_bias, batch,
                                        model_config=model_config,
                                        config=config)
    return grads, metrics, _routing_sums(routing)

  def body(total, batch):
    part = step(state.params, state.expert_bias, batch)
    return jax.tree.map(jnp.add, total, part), None

  first = jax.tree.map(lambda x: x[0], batches)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(step, state.params, state.expert_bias,
                                      first))
  (grads, metrics, routing), _ = jax.lax.scan(body, zeros, batches)
  routing = _routing_sums(routing, invert=True)
  if routing.routing is not None:
    metrics.update(losses.routing_metrics(routing.routing))
  if routing.mtp_routing is not None:
    metrics.update({f"mtp/{k}": v for k, v in
                    losses.routing_metrics(routing.mtp_routing).items()})
  state, step_metrics = train_lib.apply_gradients(
      state, grads, routing, model_config=model_config,
      train_config=train_config)
  return state, dict(metrics, **step_metrics)
