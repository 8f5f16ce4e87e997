"""Forge's composite reward and the per-step advantages of multi-step
trajectories (SPEC §3), computed by the trainer from what the pool stores.

For trajectory i of T steps (t = 0 .. T-1; an agent makes one step per
model call):

  r_t = alpha * r_process,t + [t = T-1] * (beta * r_speed + r_perf)
  r_speed = h(T_completion / T_baseline)
  G_t = sum_{tau >= t} gamma^(tau - t) r_tau             (reward-to-go)
  A_t = (G_t - b_t) / (s + eps)  (RLConfig.advantage_std; else G_t - b_t)
  b_t = mean of G_{j,t} over the trajectories j of i's GRPO group (same
      Trajectory.group_id in the batch) that have a step t
      (RewardConfig.baseline "step", the default), or b_t = b = the
      group's mean of G_0 for every t ("trajectory")
  s^2 = mean over the group's trajectories j of
          mean over j's steps t of (G_{j,t} - b_t)^2

Every token of step t's action is trained with A_t (trainer.build_batches).

What comes from where. The pool stores the pieces, not the sum, so alpha,
beta and gamma can change without regenerating: r_process,t is Step.reward
(the env's own reward for that step), r_perf is Trajectory.reward (the
verifier's outcome), T_completion and T_baseline are seconds in
Trajectory.verification under COMPLETION_KEY and BASELINE_KEY. A
trajectory with neither key gets r_speed = 0 (the env does not time its
tasks); one with only one of them is refused.

Speed, "linear, clipped": h(x) = clip(1 - x, speed_min, speed_max). h(1) = 0
(as fast as the baseline earns nothing) and h decreases: half the
baseline's time earns +0.5, twice it -1 with the default bounds [-1, 1].
Linear in the time saved, so a second saved is worth the same on a slow and
a fast run of one task; the bounds keep one very slow run (a hung tool)
from outweighing its outcome.

Baseline. The SPEC's "reward-to-go with a trajectory-level baseline" read
literally is "trajectory": one b per group, the mean return from the start,
for every step. It fails with process rewards (RewardConfig says how), so
the default "step" compares each step's reward-to-go with the group's mean
at the same step index: the trajectories' own group is still the baseline,
taken where each step stands in its episode. One step, or rewards only at
the end with gamma = 1, make the two the same.

Scale. s is the root mean square of the advantages before scaling, each
trajectory weighing as one whatever its length: GRPO's std where G is
constant along every trajectory, and bounded otherwise. Not the std of G_0
alone: a group whose G_0 are all equal (one trajectory; or equal outcomes
and lengths with gamma < 1) has std 0, while its later steps' G_t differ
from b (discounting, process rewards already earned), and (G_t - b) / eps
would be ~1e6. With s as above, |A_t| <= sqrt(trajectories in the group *
steps of the trajectory), and a group with every G_{j,t} = b_t gets A = 0.

What it reduces to. One step, no process reward, no times: G_0 = r_perf
and A = objectives.group_advantages(r_perf), GRPO's advantage, exactly.
gamma = 1 and no process reward: every step of a trajectory gets
group_advantages of the trajectories' returns (one advantage per
trajectory, up to rounding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from m2jax.config import ConfigError
from m2jax.errors import UserError
from m2jax.rl import objectives
from m2jax.rl import pool as pool_lib

# Trajectory.verification keys of the speed reward, in seconds: how long the
# task took, and how long a reference run of it takes (the env's baseline).
COMPLETION_KEY = "completion_s"
BASELINE_KEY = "baseline_s"


BASELINES = ("step", "trajectory")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The composite reward and its advantages (module docstring).

  alpha: weight of the process reward (Step.reward) of every step.
  beta: weight of the speed reward on the last step. 0 (the default): a run
    opts in, since an env that starts reporting times would otherwise
    change what is optimised.
  gamma: discount of the reward-to-go, in [0, 1]; 1 credits every step with
    everything after it.
  speed_min, speed_max: the bounds of h(x) = clip(1 - x, ., .); they
    bracket 0 so that h(1) = 0.
  eps: added to the group std before dividing (a group of equal returns).
  baseline: what G_t is compared with. "step" (default): b_t, the group's
    mean of G_{j,t} over its trajectories that have a step t. "trajectory":
    b, the group's mean return G_0, the same for every step (the SPEC's
    literal reading). Both are unbiased (neither depends on the action);
    "trajectory" is not usable with process rewards: when every episode of
    a group earns the same process reward on its first call and nothing
    else, every later step gets G_t - b < 0 and is pushed down, though no
    episode did better than another (measured: the multiply task's final
    answers and then its tool-call format collapsed within 3 steps, see
    benchmarks/notes/agents.md). "step" gives such a group A = 0.
  Whether to divide is RLConfig.advantage_std (the objective's config, its
  one home).
  """
  alpha: float = 1.0
  beta: float = 0.0
  gamma: float = 1.0
  speed_min: float = -1.0
  speed_max: float = 1.0
  eps: float = objectives.ADVANTAGE_EPS
  baseline: str = "step"

  def __post_init__(self):
    if self.baseline not in BASELINES:
      raise ConfigError(f"RewardConfig.baseline: must be one of {BASELINES} "
                        f"(got {self.baseline!r})")
    for name in ("alpha", "beta"):
      value = getattr(self, name)
      if not 0 <= value < math.inf:
        raise ConfigError(f"RewardConfig.{name}: must be finite and >= 0 "
                          f"(got {value!r})")
    if not 0 <= self.gamma <= 1:
      raise ConfigError(f"RewardConfig.gamma: must be in [0, 1] (got "
                        f"{self.gamma!r})")
    if not -math.inf < self.speed_min <= 0:
      raise ConfigError(f"RewardConfig.speed_min: must be finite and <= 0, "
                        f"so that h(1) = 0 (got {self.speed_min!r})")
    if not 0 <= self.speed_max < math.inf:
      raise ConfigError(f"RewardConfig.speed_max: must be finite and >= 0, "
                        f"so that h(1) = 0 (got {self.speed_max!r})")
    if not 0 < self.eps < math.inf:
      raise ConfigError(f"RewardConfig.eps: must be finite and > 0 (got "
                        f"{self.eps!r})")


def speed_reward(ratio, config: RewardConfig):
  """h(ratio) = clip(1 - ratio, speed_min, speed_max), ratio =
  T_completion / T_baseline >= 0 (a scalar or an array)."""
  return np.clip(1.0 - np.asarray(ratio, np.float64), config.speed_min,
                 config.speed_max)


def _seconds(trajectory, key: str, positive: bool) -> float:
  value = trajectory.verification[key]
  bad = (isinstance(value, bool) or not isinstance(value, (int, float))
         or not math.isfinite(value) or value < 0 or (positive and
                                                      value == 0))
  if bad:
    raise UserError(
        f"trajectory {trajectory.trajectory_id!r}: verification[{key!r}] "
        f"is {value!r}, expected seconds {'> 0' if positive else '>= 0'}")
  return float(value)


def speed_of(trajectory: pool_lib.Trajectory, config: RewardConfig
             ) -> float:
  """r_speed of a trajectory: h(T_completion / T_baseline) from its
  verification, 0 without the times (module docstring)."""
  has = [key in trajectory.verification
         for key in (COMPLETION_KEY, BASELINE_KEY)]
  if not any(has):
    return 0.0
  if not all(has):
    given, missing = ((COMPLETION_KEY, BASELINE_KEY) if has[0]
                      else (BASELINE_KEY, COMPLETION_KEY))
    raise UserError(f"trajectory {trajectory.trajectory_id!r}: verification "
                    f"has {given!r} but not {missing!r} (the speed reward "
                    "needs both, or neither)")
  ratio = (_seconds(trajectory, COMPLETION_KEY, positive=False)
           / _seconds(trajectory, BASELINE_KEY, positive=True))
  return float(speed_reward(ratio, config))


def step_rewards(trajectory: pool_lib.Trajectory, config: RewardConfig
                 ) -> np.ndarray:
  """r_t [T] float64: alpha * each step's process reward, and on the last
  step also beta * r_speed + the outcome reward."""
  r_T = config.alpha * np.asarray([s.reward for s in trajectory.steps],
                                  np.float64)
  r_T[-1] += config.beta * speed_of(trajectory, config) + trajectory.reward
  return r_T


def rewards_to_go(rewards_T, gamma: float) -> np.ndarray:
  """G_t = sum_{tau >= t} gamma^(tau - t) r_tau, [T] float64."""
  r_T = np.asarray(rewards_T, np.float64)
  if r_T.ndim != 1 or not np.isfinite(r_T).all():
    raise ValueError(f"rewards_to_go: need finite rewards [T], got shape "
                     f"{r_T.shape}")
  G_T = np.empty_like(r_T)
  acc = 0.0
  for t in range(r_T.shape[0] - 1, -1, -1):
    acc = r_T[t] + gamma * acc
    G_T[t] = acc
  return G_T


def returns(trajectories: Sequence[pool_lib.Trajectory],
            config: RewardConfig) -> np.ndarray:
  """G_0 of each trajectory, [N] float64: the composite return, what the
  advantages compare within a group (and what DAPO's dynamic sampling
  should find equal or not)."""
  return np.asarray([rewards_to_go(step_rewards(t, config), config.gamma)[0]
                     for t in trajectories], np.float64)


def step_advantages(trajectories: Sequence[pool_lib.Trajectory],
                    config: RewardConfig, *, std: bool = True
                    ) -> list[np.ndarray]:
  """A_t of every step, one [T_i] float32 array per trajectory (module
  docstring); groups are the trajectories' group_id. std: divide by the
  group's scale s + eps (RLConfig.advantage_std)."""
  if not trajectories:
    raise UserError("step_advantages: no trajectories")
  G = [rewards_to_go(step_rewards(t, config), config.gamma)
       for t in trajectories]
  group_of = [t.group_id for t in trajectories]
  if config.baseline == "trajectory":
    b_N, _ = objectives.group_mean_std([g[0] for g in G], group_of,
                                       what="step_advantages")
    centred = [g - b for g, b in zip(G, b_N)]
  else:  # b_t: the group's mean G_t over its trajectories with a step t
    sums: dict = {}
    for g, group in zip(G, group_of):
      for t, value in enumerate(g):
        total, count = sums.get((group, t), (0.0, 0))
        sums[(group, t)] = (total + value, count + 1)
    centred = [g - np.asarray([sums[(group, t)][0] / sums[(group, t)][1]
                               for t in range(len(g))])
               for g, group in zip(G, group_of)]
  if not std:
    return [c.astype(np.float32) for c in centred]
  # One trajectory, one weight: the mean square of its steps, then the
  # group's mean of those (the same operations as GRPO's std for one step).
  square_N, _ = objectives.group_mean_std(
      [np.mean(c ** 2) for c in centred], group_of, what="step_advantages")
  return [(c / (np.sqrt(m) + config.eps)).astype(np.float32)
          for c, m in zip(centred, square_N)]
