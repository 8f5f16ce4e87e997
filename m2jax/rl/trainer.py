"""Forge's train engine: trajectories from the pool -> prefix-tree-merged
rows -> the merged RL step -> new weights for the rollout engine (SPEC §3).

Samples. Every step of a trajectory is one sample, its state followed by its
action; only the action's tokens are trained, with the behaviour log-probs
the rollout recorded. Successive steps of one trajectory share their history
(step t's state extends step t-1's), and the samples of a GRPO group share
their prompt: `prefix_tree.pack` stores each shared prefix once.

Advantages are per step (m2jax.rl.rewards): the composite reward of each
step (process, speed, outcome; RewardConfig), its reward-to-go, and a
group-relative baseline, the group's mean return from the start; every
trained token of step t gets that step's A_t. With single-step samples and
only an outcome reward this is objectives.group_advantages of the final
rewards. (DAPO's dynamic sampling, which drops groups whose rewards are
all equal, happens before: the loop refills the batch.)

KL to a reference policy (RLConfig.kl_coef > 0): the reference is the
policy the trainer started from (the warm start), kept frozen; its
log-probs are computed on the same merged rows before each step. Likewise
RLConfig.mtp_reference keeps the MTP modules it started with and scores
them against the current policy on each batch (the co-training metrics
without co-training, on the same policy).

Shapes. The step compiles once per shape; a batch is padded to buckets:
rows to a power-of-two number of micro-batches of `rows_per_micro_batch`
rows, sample slots and sample length to powers of two. A new bucket compiles
once and is reused.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model, sharding
from m2jax.config import ModelConfig
from m2jax.errors import UserError
from m2jax.rl import prefix_tree
from m2jax.rl import rewards as rewards_lib
from m2jax.rl import step as rl_step
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """How a batch becomes rows.

  row_len: tokens per packed row (a sample must fit one).
  rows_per_micro_batch: rows per forward/backward (memory of one).
  merge: prefix-tree merging (False: every sample its own chain, the
    unmerged baseline the benchmark compares against).
  minibatches: optimizer updates per batch: its groups split into this many
    mini-batches, one update each, in order (the later ones off-policy:
    the clipped importance ratio corrects them). The weights are synced to
    the rollout engine once per batch.
  """
  row_len: int = 512
  rows_per_micro_batch: int = 4
  merge: bool = True
  minibatches: int = 1

  def __post_init__(self):
    if self.row_len < 2:
      raise UserError(f"TrainerConfig.row_len: must be >= 2 (got "
                      f"{self.row_len!r})")
    if self.rows_per_micro_batch < 1:
      raise UserError(f"TrainerConfig.rows_per_micro_batch: must be >= 1 "
                      f"(got {self.rows_per_micro_batch!r})")
    if self.minibatches < 1:
      raise UserError(f"TrainerConfig.minibatches: must be >= 1 (got "
                      f"{self.minibatches!r})")


def _pow2(n: int) -> int:
  return 1 << max(0, (max(n, 1) - 1).bit_length())


def samples_of(trajectories):
  """(sequences, loss masks, old log-probs, group ids, trajectory index)
  with one entry per step of every trajectory (module docstring)."""
  seqs, masks, old, groups, owner = [], [], [], [], []
  for i, traj in enumerate(trajectories):
    for step in traj.steps:
      state, action = np.asarray(step.state), np.asarray(step.action)
      seqs.append(np.concatenate([state, action]).astype(np.int32))
      masks.append(np.r_[np.zeros(len(state), bool), np.ones(len(action),
                                                              bool)])
      old.append(np.r_[np.zeros(len(state), np.float32),
                       np.asarray(step.logprobs, np.float32)])
      groups.append(traj.group_id)
      owner.append(i)
  return seqs, masks, old, groups, np.asarray(owner, np.int64)


def build_batches(trajectories, rl_config: rl_step.RLConfig,
                  config: TrainerConfig, *,
                  rewards: rewards_lib.RewardConfig = (
                      rewards_lib.RewardConfig()),
                  floor=(1, 1, 1)) -> tuple[rl_step.RLBatch, dict]:
  """Stacked micro-batches [M, ...] of the merged rows of `trajectories`,
  with per-step advantages (`rewards`; module docstring), and statistics
  of the packing (tokens computed and trained, and the bucketed shape (M,
  sample slots, sample length) it used, at least `floor`: a trainer passes
  the largest shape so far, so its step compiles a few times per run, not
  once per new small shape)."""
  if not trajectories:
    raise UserError("build_batches: no trajectories")
  seqs, masks, old, groups, _ = samples_of(trajectories)
  too_long = [len(s) for s in seqs if len(s) > config.row_len]
  if too_long:
    raise UserError(f"a sample of {max(too_long)} tokens does not fit "
                    f"TrainerConfig.row_len={config.row_len}")
  # One advantage per sample: samples_of's order, trajectories then steps.
  adv_S = np.concatenate(rewards_lib.step_advantages(
      trajectories, rewards, std=rl_config.advantage_std))
  advantages = [np.where(m, a, 0).astype(np.float32)
                for m, a in zip(masks, adv_S)]
  k = config.rows_per_micro_batch
  trees = prefix_tree.pack(
      seqs, row_len=config.row_len, loss_masks=masks,
      payloads={"old_logprobs": old, "advantages": advantages},
      merge=config.merge, max_len=max(_pow2(max(map(len, seqs))), floor[2]))
  rows = max(_pow2(-(-trees.tokens.shape[0] // k)), floor[0]) * k
  trees = trees.padded_to(rows)
  sample_groups = np.unique(np.asarray(groups), return_inverse=True)[1]
  # Sample slots per micro-batch to a power of two (the most any holds).
  row_of_sample = trees.sample_index[:, 0] // config.row_len
  slots = max(_pow2(int(np.bincount(row_of_sample // k).max())), floor[1])
  batches = rl_step.make_batches(trees, sample_groups, rl_config,
                                 rows_per_batch=k, samples_per_batch=slots)
  stats = {"tokens_computed": trees.num_tokens,
           "attention_entries": trees.attention_entries(),
           "tokens_in_samples": int(sum(map(len, seqs))),
           "tokens_trained": int(sum(m.sum() for m in masks)),
           "samples": len(seqs),
           "shape": (rows // k, slots, trees.sample_index.shape[1])}
  return rl_step.stack_batches(batches), stats


@functools.lru_cache(maxsize=8)
def _compiled(model_config: ModelConfig, train_config: TrainConfig,
              rl_config: rl_step.RLConfig, mesh=None):
  """(step, reference pass, reference MTP metrics), jitted once per configs
  and mesh in a process: runs of one program (a sweep over seeds) share
  their compilations."""
  step = functools.partial(rl_step.train_step, model_config=model_config,
                           train_config=train_config, config=rl_config)
  mtp_reference = functools.partial(rl_step.mtp_reference_metrics,
                                    model_config=model_config,
                                    config=rl_config)

  def with_reference(variables, batches):
    logprobs = jax.lax.map(lambda b: rl_step.reference_logprobs(
        variables["params"], variables.get(model.EXPERT_BIAS, {}), b,
        model_config=model_config), batches)
    return batches._replace(ref_logprobs=logprobs)

  if mesh is None:
    return (jax.jit(step, donate_argnums=0), jax.jit(with_reference),
            jax.jit(mtp_reference))
  shardings = state_lib.state_shardings(model_config, train_config, mesh)
  rep = sharding.replicated(mesh)
  return (sharding.on_mesh(jax.jit(
      step, in_shardings=(shardings, rep), out_shardings=(shardings, rep),
      donate_argnums=0), mesh),
          sharding.on_mesh(jax.jit(with_reference), mesh),
          sharding.on_mesh(jax.jit(mtp_reference), mesh))


class Trainer:
  """The policy's train state and its compiled merged RL step.

    trainer = Trainer(mcfg, tcfg, RLConfig(), TrainerConfig(), state,
                      rewards=RewardConfig())
    metrics = trainer.train(trajectories)   # one policy update
    engine.update_variables(trainer.snapshot())
  """

  def __init__(self, model_config: ModelConfig, train_config: TrainConfig,
               rl_config: rl_step.RLConfig, config: TrainerConfig,
               state: state_lib.TrainState, *, mesh=None,
               rewards: rewards_lib.RewardConfig = (
                   rewards_lib.RewardConfig())):
    """`state`: where training starts, and what the frozen references (the
    KL's policy, RLConfig.mtp_reference's MTP modules) are copied from; a
    resumed run then `load_state`s its checkpoint. `rewards`: the composite
    reward and its per-step advantages."""
    if not isinstance(rewards, rewards_lib.RewardConfig):
      raise UserError(f"Trainer: rewards is a {type(rewards).__name__}, "
                      "expected a RewardConfig")
    self.rl_config, self.config, self.rewards = rl_config, config, rewards
    self._floor = (1, 1, 1)
    self._shardings = None if mesh is None else state_lib.state_shardings(
        model_config, train_config, mesh)
    # The seed only matters for init: runs that differ by it share a step.
    self._step, self._reference, self._mtp_reference = _compiled(
        model_config, train_config.replace(seed=0), rl_config, mesh)
    self.state = None
    self.load_state(state)
    # The frozen reference policy (a copy: the state's buffers are donated).
    self.reference = self.snapshot() if rl_config.kl_coef else None
    # The MTP modules as they started, frozen (RLConfig.mtp_reference).
    self.mtp_reference = None
    if rl_config.mtp_reference:  # copies of the MTP subtrees only
      variables = state_lib.variables_of(self.state)
      self.mtp_reference = jax.tree.map(jnp.copy, {
          name: {k: v for k, v in variables.get(name, {}).items()
                 if k.startswith("mtp_")}
          for name in ("params", model.EXPERT_BIAS)})

  def load_state(self, state: state_lib.TrainState) -> None:
    """Continue from `state` (a resumed checkpoint's), placed on the mesh;
    the frozen references stay those of the state the trainer was built
    with."""
    if self._shardings is not None:
      state = jax.device_put(state, self._shardings)
    self.state = state

  def snapshot(self) -> dict:
    """A copy of the policy's variables (the state's own buffers are
    donated to the next step): what the rollout engine is given."""
    return jax.tree.map(jnp.copy, state_lib.variables_of(self.state))

  def train(self, trajectories) -> dict:
    """One update per mini-batch of `trajectories` (whole groups each, in
    order); returns float metrics: the step's, averaged over mini-batches,
    and the packing's, summed (tokens computed / in samples, seconds)."""
    start = time.perf_counter()
    groups: dict[str, list] = {}
    for t in trajectories:
      groups.setdefault(t.group_id, []).append(t)
    ordered = list(groups.values())
    parts = np.array_split(np.arange(len(ordered)),
                           min(self.config.minibatches, len(ordered)))
    totals, stats_sum = {}, {}
    for part in parts:
      chunk = [t for i in part for t in ordered[i]]
      batches, stats = build_batches(chunk, self.rl_config, self.config,
                                     rewards=self.rewards, floor=self._floor)
      shape = stats.pop("shape")
      self._floor = tuple(map(max, self._floor, shape))
      if self.reference is not None:
        batches = self._reference(self.reference, batches)
      reference = {}
      if self.mtp_reference is not None:  # at the weights the step reads
        reference = self._mtp_reference(self.state.params,
                                        self.state.expert_bias,
                                        self.mtp_reference, batches)
      self.state, metrics = self._step(self.state, batches)
      metrics = dict(metrics, **reference)
      for k, v in jax.device_get(metrics).items():
        totals[k] = totals.get(k, 0.0) + float(v) / len(parts)
      for k, v in stats.items():
        stats_sum[k] = stats_sum.get(k, 0) + v
    totals.update({f"train/{k}": float(v) for k, v in stats_sum.items()})
    totals["train/merge_ratio"] = (stats_sum["tokens_in_samples"]
                                   / max(stats_sum["tokens_computed"], 1))
    totals["train/seconds"] = time.perf_counter() - start
    return totals
