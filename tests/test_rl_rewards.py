"""The composite reward and per-step advantages (m2jax.rl.rewards) and the
trainer's use of them (trainer.build_batches: step t's advantage on exactly
step t's action tokens, merged and unmerged). Numpy only, no model step."""

import dataclasses
import math

import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax.config import ConfigError
from m2jax.errors import UserError
from m2jax.rl import objectives
from m2jax.rl import pool as pool_lib
from m2jax.rl import rewards as rw
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.train.config import TrainConfig

VOCAB = 1000


def _traj(tid, group, process, outcome, *, times=None, rng=None, prompt=None,
          seq=0, verification=None):
  """A trajectory of len(process) steps with those process rewards: each
  state extends the previous state + action + an observation (an agent's
  history), the first state is the group's `prompt`. times: (completion,
  baseline) seconds or None; verification: the whole dict instead."""
  rng = rng or np.random.default_rng(seq)
  state = list(prompt if prompt is not None else rng.integers(1, VOCAB, 4))
  steps = []
  for p in process:
    action = rng.integers(1, VOCAB, int(rng.integers(1, 4)))
    steps.append(pool_lib.Step(
        state=np.asarray(state), action=action,
        logprobs=rng.normal(-3, 1, len(action)).astype(np.float32),
        policy_version=0, reward=p))
    state = state + list(action) + list(rng.integers(1, VOCAB, 2))
  if verification is None:
    verification = {} if times is None else {rw.COMPLETION_KEY: times[0],
                                             rw.BASELINE_KEY: times[1]}
  return pool_lib.Trajectory(
      trajectory_id=tid, group_id=group, env="e", task_id="t", difficulty=0,
      steps=tuple(steps), reward=outcome, verification=verification,
      queue_seq=seq, submitted_at=0.0, finished_at=1.0)


def test_reward_config_names_the_bad_field():
  for field, value in (("alpha", -0.1), ("alpha", math.inf), ("beta", -1.0),
                       ("beta", math.nan), ("gamma", 1.5), ("gamma", -0.1),
                       ("speed_min", 0.1), ("speed_min", -math.inf),
                       ("speed_max", -0.1), ("eps", 0.0),
                       ("baseline", "episode")):
    with pytest.raises(ConfigError, match=f"RewardConfig.{field}:"):
      rw.RewardConfig(**{field: value})
  rw.RewardConfig(alpha=0.0, beta=0.0, gamma=0.0, speed_min=0.0,
                  speed_max=0.0)


def test_speed_reward_is_linear_clipped_and_zero_at_the_baseline():
  h = rw.RewardConfig()
  np.testing.assert_allclose(
      rw.speed_reward([0.0, 0.5, 1.0, 1.5, 2.0, 7.0], h),
      [1.0, 0.5, 0.0, -0.5, -1.0, -1.0])
  tight = rw.RewardConfig(speed_min=-0.3, speed_max=0.2)
  np.testing.assert_allclose(rw.speed_reward([0.0, 0.9, 1.0, 1.1, 4.0],
                                             tight),
                             [0.2, 0.1, 0.0, -0.1, -0.3])


def test_composite_step_rewards():
  """alpha on every step's process reward; beta * h and the outcome only
  on the last step; no times, no speed reward."""
  config = rw.RewardConfig(alpha=0.5, beta=2.0)
  t = _traj("x", "g", [0.2, -0.4, 1.0], 0.75, times=(3.0, 4.0))
  # h(3/4) = 0.25
  np.testing.assert_allclose(rw.step_rewards(t, config),
                             [0.1, -0.2, 0.5 + 2.0 * 0.25 + 0.75])
  assert rw.speed_of(t, config) == pytest.approx(0.25)
  untimed = _traj("y", "g", [0.2, 0.4], -1.0)
  np.testing.assert_allclose(rw.step_rewards(untimed, config),
                             [0.1, 0.2 - 1.0])
  # Integer seconds (JSON) are seconds too; 0 s is allowed for completion.
  assert rw.speed_of(_traj("z", "g", [0.0], 0.0, times=(0, 5)),
                     config) == 1.0


@pytest.mark.parametrize("verification, match", [
    ({rw.COMPLETION_KEY: 3.0}, "has 'completion_s' but not 'baseline_s'"),
    ({rw.BASELINE_KEY: 3.0}, "has 'baseline_s' but not 'completion_s'"),
    ({rw.COMPLETION_KEY: 3.0, rw.BASELINE_KEY: 0.0}, r"baseline_s'\] is 0"),
    ({rw.COMPLETION_KEY: -1.0, rw.BASELINE_KEY: 2.0}, "completion_s'] is -1"),
    ({rw.COMPLETION_KEY: "3", rw.BASELINE_KEY: 2.0}, "completion_s'] is '3'"),
    ({rw.COMPLETION_KEY: True, rw.BASELINE_KEY: 2.0}, "is True"),
])
def test_bad_times_are_refused_naming_the_trajectory(verification, match):
  t = _traj("bad", "g", [0.0], 1.0, verification=verification)
  with pytest.raises(UserError, match="trajectory 'bad'"):
    rw.speed_of(t, rw.RewardConfig())
  with pytest.raises(UserError, match=match):
    rw.step_rewards(t, rw.RewardConfig(beta=1.0))


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.97, 1.0])
def test_rewards_to_go_against_the_double_sum(gamma):
  r = np.random.default_rng(3).normal(size=9)
  want = [sum(gamma ** (tau - t) * r[tau] for tau in range(t, len(r)))
          for t in range(len(r))]
  np.testing.assert_allclose(rw.rewards_to_go(r, gamma), want, rtol=1e-12,
                             atol=1e-15)
  assert rw.rewards_to_go([2.5], gamma).tolist() == [2.5]
  with pytest.raises(ValueError, match="finite rewards"):
    rw.rewards_to_go([1.0, np.inf], gamma)


# The hand-computed example: alpha 0.5, beta 1, gamma 0.5, h on [-1, 1];
# three groups of 3, 2 and 1 trajectories of 1 to 3 steps, interleaved.
HAND = rw.RewardConfig(alpha=0.5, beta=1.0, gamma=0.5, baseline="trajectory")


def _hand_trajectories():
  return [
      # r = [0.1, 0.2 + h(5/10) + 1] = [0.1, 1.7]; G = [0.95, 1.7]
      _traj("a1", "a", [0.2, 0.4], 1.0, times=(5.0, 10.0), seq=0),
      # r = [0.5, 0]; G = [0.5, 0]
      _traj("b1", "b", [1.0, 0.0], 0.0, seq=1),
      # r = [0, 0.2 + 1]; G = [0.6, 1.2]
      _traj("c1", "c", [0.0, 0.4], 1.0, seq=2),
      # G = [0]
      _traj("a2", "a", [0.0], 0.0, seq=3),
      # G = [1]
      _traj("b2", "b", [0.0], 1.0, seq=4),
      # r = [0, 0, 0.1 + h(30/10) + 0.5] = [0, 0, -0.4]; G = [-.1, -.2, -.4]
      _traj("a3", "a", [0.0, 0.0, 0.2], 0.5, times=(30.0, 10.0), seq=5)]


HAND_G = [[0.95, 1.7], [0.5, 0.0], [0.6, 1.2], [0.0], [1.0],
          [-0.1, -0.2, -0.4]]
HAND_GROUPS = {"a": [0, 3, 5], "b": [1, 4], "c": [2]}


def test_step_advantages_hand_computed():
  trajs = _hand_trajectories()
  G = [rw.rewards_to_go(rw.step_rewards(t, HAND), HAND.gamma) for t in trajs]
  for got, want in zip(G, HAND_G):
    np.testing.assert_allclose(got, want, atol=1e-12)
  np.testing.assert_allclose(rw.returns(trajs, HAND),
                             [g[0] for g in HAND_G], atol=1e-12)
  # b = the group's mean G_0; s^2 = the mean over its trajectories of the
  # mean over steps of (G_t - b)^2.
  b = {"a": (0.95 + 0.0 - 0.1) / 3, "b": 0.75, "c": 0.6}
  s = {"a": math.sqrt((((0.95 - b["a"]) ** 2 + (1.7 - b["a"]) ** 2) / 2
                       + (0.0 - b["a"]) ** 2
                       + ((-0.1 - b["a"]) ** 2 + (-0.2 - b["a"]) ** 2
                          + (-0.4 - b["a"]) ** 2) / 3) / 3),
       "b": math.sqrt(((0.25 ** 2 + 0.75 ** 2) / 2 + 0.25 ** 2) / 2),
       "c": math.sqrt((0.0 + 0.6 ** 2) / 2)}
  got = rw.step_advantages(trajs, HAND)
  plain = rw.step_advantages(trajs, HAND, std=False)
  for i, t in enumerate(trajs):
    g = t.group_id
    want = (np.asarray(HAND_G[i]) - b[g]) / (s[g] + HAND.eps)
    np.testing.assert_allclose(got[i], want, rtol=1e-6)
    np.testing.assert_allclose(plain[i], np.asarray(HAND_G[i]) - b[g],
                               rtol=1e-6, atol=1e-7)
    assert got[i].dtype == plain[i].dtype == np.float32
    assert got[i].shape == (len(t.steps),)
  # The group of one trajectory, equal G_0 (std 0): bounded, not / eps.
  np.testing.assert_allclose(got[2], [0.0, math.sqrt(2)], rtol=1e-5)
  # Every group's advantages have RMS 1, trajectories weighing as one.
  for members in HAND_GROUPS.values():
    ms = np.mean([np.mean(got[i].astype(np.float64) ** 2) for i in members])
    assert ms == pytest.approx(1.0, rel=1e-5)


def test_step_baseline_hand_computed_and_equal_episodes_get_nothing():
  """baseline="step": b_t is the group's mean G_t over its trajectories
  with a step t. A group whose episodes all earned the same rewards gets
  A = 0 at every step; the "trajectory" baseline pushes their later steps
  down (G_t < G_0 once a process reward is behind them), which collapsed
  the multiply task's answers in a CPU run."""
  trajs = _hand_trajectories()
  step = dataclasses.replace(HAND, baseline="step")
  plain = rw.step_advantages(trajs, step, std=False)
  b = {"a": [(0.95 + 0.0 - 0.1) / 3, (1.7 - 0.2) / 2, -0.4],
       "b": [0.75, 0.0], "c": [0.6, 1.2]}
  for i, t in enumerate(trajs):
    want = [g - b[t.group_id][k] for k, g in enumerate(HAND_G[i])]
    np.testing.assert_allclose(plain[i], want, rtol=1e-6, atol=1e-7)
  # Four episodes: a valid tool call (process reward 0.1), then a wrong
  # answer (outcome 0): nobody did better than anybody.
  same = [_traj(f"s{i}", "g", [0.1, 0.0], 0.0, seq=i) for i in range(4)]
  for adv in rw.step_advantages(same, rw.RewardConfig()):
    np.testing.assert_array_equal(adv, [0.0, 0.0])
  old = rw.step_advantages(same, rw.RewardConfig(baseline="trajectory"),
                           std=False)
  assert all(a[1] < 0 for a in old)


def _reference_advantages(trajs, config, std):
  """The module docstring's formulas written out with loops (either
  baseline)."""
  G = []
  for t in trajs:
    n = len(t.steps)
    r = [config.alpha * s.reward for s in t.steps]
    v = t.verification
    speed = 0.0
    if rw.COMPLETION_KEY in v:
      x = v[rw.COMPLETION_KEY] / v[rw.BASELINE_KEY]
      speed = min(max(1.0 - x, config.speed_min), config.speed_max)
    r[-1] += config.beta * speed + t.reward
    G.append([sum(config.gamma ** (k - j) * r[k] for k in range(j, n))
              for j in range(n)])
  out = []
  for i, t in enumerate(trajs):
    members = [j for j, u in enumerate(trajs) if u.group_id == t.group_id]

    def b(step):
      if config.baseline == "trajectory":
        return sum(G[j][0] for j in members) / len(members)
      there = [G[j][step] for j in members if len(G[j]) > step]
      return sum(there) / len(there)
    s = math.sqrt(sum(sum((x - b(k)) ** 2 for k, x in enumerate(G[j]))
                      / len(G[j]) for j in members) / len(members))
    out.append([(x - b(k)) / ((s + config.eps) if std else 1.0)
                for k, x in enumerate(G[i])])
  return out


@pytest.mark.parametrize("baseline", rw.BASELINES)
@pytest.mark.parametrize("std", [True, False])
def test_step_advantages_against_loops_on_random_groups(std, baseline):
  """Groups of 1 to 5 trajectories of 1 to 5 steps, random process and
  outcome rewards, half of them timed (some past the clip bounds)."""
  rng = np.random.default_rng(11)
  config = rw.RewardConfig(alpha=0.7, beta=0.3, gamma=0.9, speed_min=-0.5,
                           speed_max=0.8, baseline=baseline)
  trajs, seq = [], 0
  for g, size in enumerate([3, 1, 5, 2, 4]):
    for _ in range(size):
      times = ((float(rng.uniform(0, 30)), float(rng.uniform(1, 10)))
               if rng.random() < 0.5 else None)
      trajs.append(_traj(f"t{seq}", f"g{g}",
                         rng.normal(size=int(rng.integers(1, 6))).tolist(),
                         float(rng.normal()), times=times, rng=rng, seq=seq))
      seq += 1
  order = rng.permutation(len(trajs))
  trajs = [trajs[i] for i in order]
  got = rw.step_advantages(trajs, config, std=std)
  want = _reference_advantages(trajs, config, std)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)


def test_single_step_outcome_only_is_grpo_exactly():
  """One step, no process reward, no times: exactly
  objectives.group_advantages of the outcomes, for any alpha, beta, gamma
  (groups of unequal sizes, one of equal rewards, one of one sample)."""
  rng = np.random.default_rng(5)
  groups = ["b", "a", "b", "c", "a", "b", "c", "d", "a", "e", "e"]
  outcomes = rng.normal(size=len(groups)).tolist()
  outcomes[3] = outcomes[6] = 0.3   # group c: equal rewards
  trajs = [_traj(f"t{i}", g, [0.0], r, rng=rng, seq=i)
           for i, (g, r) in enumerate(zip(groups, outcomes))]
  for config in (rw.RewardConfig(),
                 rw.RewardConfig(alpha=0.3, beta=2.0, gamma=0.5)):
    for std in (True, False):
      got = np.concatenate(rw.step_advantages(trajs, config, std=std))
      want = objectives.group_advantages(outcomes, groups, std=std)
      np.testing.assert_array_equal(got, want)
  # gamma = 1 and only outcomes: every step of a multi-step trajectory
  # gets GRPO's advantage of its trajectory's outcome.
  multi = [_traj(f"m{i}", g, [0.0] * (1 + i % 3), r, rng=rng, seq=i)
           for i, (g, r) in enumerate(zip(groups, outcomes))]
  want = objectives.group_advantages(outcomes, groups)
  trajectory = rw.RewardConfig(baseline="trajectory")
  for adv, w in zip(rw.step_advantages(multi, trajectory), want):
    np.testing.assert_allclose(adv, np.full(adv.shape, w), rtol=1e-6,
                               atol=1e-7)


TRAINER = trainer_lib.TrainerConfig(row_len=64, rows_per_micro_batch=2)


def _group_trajectories(rng):
  """Two groups (3 and 2 trajectories of 1 to 4 steps) whose trajectories
  share their group's prompt: merging has prefixes to share."""
  trajs, seq = [], 0
  for g, size in enumerate([3, 2]):
    prompt = rng.integers(1, VOCAB, 5)
    for _ in range(size):
      n = int(rng.integers(1, 5))
      trajs.append(_traj(f"t{seq}", f"g{g}", rng.normal(size=n).tolist(),
                         float(rng.integers(0, 2)), prompt=prompt, rng=rng,
                         seq=seq))
      seq += 1
  return trajs


def _slots(batches):
  """{sample tokens: (advantages, old log-probs, sample index)} of every
  filled sample slot of stacked micro-batches."""
  out = {}
  for m in range(batches.tokens.shape[0]):
    flat = batches.tokens[m].reshape(-1)
    for k in range(batches.sample_index.shape[1]):
      index = batches.sample_index[m, k]
      n = int((index >= 0).sum())
      if n:
        key = tuple(flat[index[:n]].tolist())
        assert key not in out
        out[key] = (batches.advantages[m, k, :n],
                    batches.old_logprobs[m, k, :n])
  return out


@pytest.mark.parametrize("merge", [True, False])
def test_build_batches_puts_each_steps_advantage_on_its_action(merge):
  trajs = _group_trajectories(np.random.default_rng(2))
  config = rw.RewardConfig(alpha=0.5, gamma=0.8)
  batches, stats = trainer_lib.build_batches(
      trajs, rl_step.RLConfig(), dataclasses.replace(TRAINER, merge=merge),
      rewards=config)
  if merge:
    assert stats["tokens_computed"] < stats["tokens_in_samples"]
  else:
    assert stats["tokens_computed"] == stats["tokens_in_samples"]
  slots = _slots(batches)
  advantages = rw.step_advantages(trajs, config)
  assert len(slots) == stats["samples"] == sum(len(t.steps) for t in trajs)
  distinct = set()
  for t, adv in zip(trajs, advantages):
    for step, a in zip(t.steps, adv):
      ls, la = len(step.state), len(step.action)
      got_adv, got_old = slots[tuple(step.state.tolist()
                                     + step.action.tolist())]
      np.testing.assert_array_equal(got_adv, np.r_[np.zeros(ls), [a] * la])
      np.testing.assert_array_equal(got_old, np.r_[np.zeros(ls),
                                                   step.logprobs])
      distinct.add(float(a))
  assert len(distinct) > len(trajs)   # steps of a trajectory differ


def test_build_batches_single_step_matches_grpo():
  """The trainer's advantages of single-step outcome-only trajectories
  (the rollout's today) are GRPO's of the outcomes, as before."""
  rng = np.random.default_rng(4)
  trajs = [_traj(f"t{i}", f"g{i // 3}", [0.0], float(rng.integers(0, 2)),
                 rng=rng, seq=i) for i in range(9)]
  batches, _ = trainer_lib.build_batches(trajs, rl_step.RLConfig(), TRAINER)
  slots = _slots(batches)
  want = objectives.group_advantages([t.reward for t in trajs],
                                     [t.group_id for t in trajs])
  for t, w in zip(trajs, want):
    s = t.steps[0]
    got, _ = slots[tuple(s.state.tolist() + s.action.tolist())]
    assert (got[len(s.state):] == w).all() and not got[:len(s.state)].any()


def test_trainer_trains_with_its_reward_config(monkeypatch):
  """Trainer(rewards=...) reaches build_batches (no compile: the step is
  never reached)."""
  config = rw.RewardConfig(gamma=0.5)
  seen = {}

  def capture(trajectories, rl_config, trainer_config, **kw):
    seen.update(kw)
    raise StopIteration

  trainer = trainer_lib.Trainer(config_lib.TINY, TrainConfig(steps=1),
                                rl_step.RLConfig(), TRAINER, None,
                                rewards=config)
  monkeypatch.setattr(trainer_lib, "build_batches", capture)
  with pytest.raises(StopIteration):
    trainer.train(_hand_trajectories())
  assert seen["rewards"] is config
  with pytest.raises(UserError, match="expected a RewardConfig"):
    trainer_lib.Trainer(config_lib.TINY, TrainConfig(steps=1),
                        rl_step.RLConfig(), TRAINER, None, rewards={})
