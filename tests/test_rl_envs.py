"""Forge's RL environments (m2jax.rl.envs): prompts and reference answers
checked against an independent computation, the verifiers' exact and
partial rewards, demonstrations, determinism, the difficulty and task
mixes, the latency model and config validation."""

import dataclasses
import json
import operator
import re

import numpy as np
import pytest

from m2jax.config import ConfigError
from m2jax.errors import UserError
from m2jax.rl import envs
from m2jax.rl.envs import Arithmetic, Sorting, Task

ARITH = re.compile(r"(\d+)([+*])(\d+)=")
SORT = re.compile(r"sort ((?:\d+ )*\d+):")


def test_arithmetic_tasks_are_right_and_demonstrations_verify():
  env, rng, ops_seen = Arithmetic(), np.random.default_rng(0), set()
  for d in env.levels:
    for _ in range(200):
      task = env.sample(rng, d)
      a, op, b = ARITH.fullmatch(task.prompt).groups()
      ops_seen.add(op)
      assert task.env == "arithmetic" and task.difficulty == d
      for x in (a, b):  # exactly d digits; level 1 operands are 0..9
        assert len(x) == d and (d == 1 or x[0] != "0")
      truth = {"+": operator.add, "*": operator.mul}[op](int(a), int(b))
      assert task.answer == str(truth)
      check = env.verify(task, env.demonstration(task))
      assert check.reward == 1.0 and check.correct
  assert ops_seen == {"+", "*"}
  rng = np.random.default_rng(1)
  assert {Arithmetic(ops=("*",)).sample(rng).prompt[1:-1].strip("0123456789")
          for _ in range(50)} == {"*"}


def test_sorting_tasks_are_right_and_demonstrations_verify():
  env, rng = Sorting(max_value=12), np.random.default_rng(0)
  values_seen = set()
  for d in env.levels:
    for _ in range(200):
      task = env.sample(rng, d)
      values = [int(x) for x in SORT.fullmatch(task.prompt).group(1).split()]
      values_seen.update(values)
      assert len(values) == d == task.difficulty
      assert task.answer == " ".join(map(str, sorted(values)))
      check = env.verify(task, env.demonstration(task))
      assert check.reward == 1.0 and check.correct
  assert values_seen == set(range(13))


def _arith_task(answer="95", prompt="37+58="):
  return Task("arithmetic-2-0", "arithmetic", 2, prompt, answer)


@pytest.mark.parametrize("completion, parsed, canonical", [
    ("96", "96", True),        # wrong number
    ("095", "95", False),      # right number, leading zero
    ("95 ", None, False), (" 95", None, False), ("95\n", None, False),
    ("9 5", None, False), ("+95", None, False), ("95=", None, False),
    ("", None, False), ("\u0669\u0665", None, False),  # Arabic-Indic 9 5
])
def test_arithmetic_verify_rejects_all_but_the_exact_answer(
    completion, parsed, canonical):
  env = Arithmetic()
  right = env.verify(_arith_task(), "95")
  assert right.reward == 1.0 and right.correct
  assert right.detail == {"parsed": "95", "canonical": True, "answer": "95"}
  wrong = env.verify(_arith_task(), completion)
  assert wrong.reward == 0.0 and not wrong.correct
  assert wrong.detail == {"parsed": parsed, "canonical": canonical,
                          "answer": "95"}
  json.dumps(wrong.detail)


def test_arithmetic_verify_zero_answer():
  env, task = Arithmetic(), _arith_task("0", "0*7=")
  assert env.verify(task, "0").correct
  assert env.verify(task, "00").detail["parsed"] == "0"
  assert not env.verify(task, "00").correct


@pytest.mark.parametrize("completion, reward, right", [
    ("1 2 3", 1.0, 3),
    ("1 3 2", 1 / 3, 1), ("3 2 1", 1 / 3, 1),
    ("1 2", 2 / 3, 2),            # too short: the missing position is wrong
    ("1 2 3 4", 3 / 4, 3),        # too long: the extra item counts against
    ("1 2 3 ", 3 / 4, 3),         # a trailing space makes an empty item
    ("1  2 3", 1 / 4, 1),         # a double space makes an empty item
    ("01 2 3", 2 / 3, 2),         # "01" is not "1"
    ("1,2,3", 0.0, 0), ("", 0.0, 0), ("sort 1 2 3:", 0.0, 0),
])
def test_sorting_verify_partial_credit(completion, reward, right):
  env = Sorting()
  task = Task("sorting-3-0", "sorting", 3, "sort 3 1 2:", "1 2 3")
  check = env.verify(task, completion)
  assert check.reward == pytest.approx(reward, abs=1e-12)
  assert check.correct == (reward == 1.0)
  assert check.detail["positions_right"] == right
  assert check.detail["items"] == completion.split(" ")
  assert check.detail["length"] == 3
  json.dumps(check.detail)


def test_verify_refuses_another_envs_task():
  with pytest.raises(ValueError, match="sorting: cannot verify"):
    Sorting().verify(_arith_task(), "95")


def test_sampling_is_deterministic_given_the_rng():
  env_list = [Arithmetic(), Sorting()]

  def draw(seed):
    rng = np.random.default_rng(seed)
    tasks = envs.sample_tasks(env_list, 300, rng)
    by_name = {e.name: e for e in env_list}
    return tasks, [by_name[t.env].latency(t, rng) for t in tasks]

  tasks, times = draw(7)
  assert draw(7) == (tasks, times)
  other, other_times = draw(8)
  assert [t.prompt for t in other] != [t.prompt for t in tasks]
  assert other_times != times
  ids = [t.task_id for t in tasks + other]
  assert len(set(ids)) == len(ids)


def test_level_mix_frequencies():
  rng = np.random.default_rng(0)
  env = Arithmetic(levels=(1, 2, 3), mix=(1, 0, 3))
  assert env.level_mix() == {1: 0.25, 2: 0.0, 3: 0.75}
  levels = np.array([env.sample(rng).difficulty for _ in range(4000)])
  assert not np.any(levels == 2)
  assert abs(np.mean(levels == 3) - 0.75) < 0.03  # 4 sigma
  uniform = np.array([Sorting().sample(rng).difficulty
                      for _ in range(4000)])
  for d in Sorting().levels:
    assert abs(np.mean(uniform == d) - 0.2) < 0.03
  with pytest.raises(ValueError, match=r"difficulty 7 is not one"):
    Sorting().sample(rng, 7)


def test_task_mix_and_batches_drawn_from_it():
  arith, sort = Arithmetic(levels=(1, 2), mix=(1, 3)), Sorting(levels=(4,))
  mix = envs.task_mix([arith, sort], weights=(2, 2))
  assert mix == pytest.approx({("arithmetic", 1): 0.125,
                               ("arithmetic", 2): 0.375,
                               ("sorting", 4): 0.5})
  tasks = envs.sample_tasks([arith, sort], 4000, np.random.default_rng(0),
                            mix)
  observed = envs.batch_mix(tasks)
  assert envs.total_variation(observed, mix) < 0.03
  only = envs.sample_tasks([arith, sort], 20, np.random.default_rng(1),
                           {("arithmetic", 2): 1.0})
  assert envs.batch_mix(only) == {("arithmetic", 2): 1.0}
  with pytest.raises(ValueError, match=r"\('sorting', 5\)"):
    envs.sample_tasks([arith, sort], 1, np.random.default_rng(0),
                      {("sorting", 5): 1.0})
  assert envs.total_variation({"a": 0.5, "b": 0.5}, {"a": 1.0}) == 0.5
  assert envs.total_variation({"a": 1.0}, {"b": 1.0}) == 1.0


@pytest.mark.parametrize("env", [Arithmetic(), Sorting()],
                         ids=lambda e: e.name)
def test_latency_is_heavy_tailed_and_grows_with_difficulty(env):
  rng, medians = np.random.default_rng(0), []
  for d in env.levels:
    task = env.sample(rng, d)
    t = np.array([env.latency(task, rng) for _ in range(4000)])
    assert np.all(t > 0)
    median = np.median(t)
    expected = env.latency_median_s * env.latency_growth ** (d - 1)
    assert abs(median / expected - 1) < 0.1   # ~4 sigma of the median
    assert np.percentile(t, 99) / median > 8  # exp(2.33 * 1.2) = 16
    medians.append(median)
  assert np.all(np.diff(medians) > 0)
  # Seconds to minutes: a second or more typical, a minute in the tail.
  assert medians[0] >= 1 and np.percentile(t, 99) >= 60


@pytest.mark.parametrize("name, fields, field", [
    ("arithmetic", {"levels": ()}, "Arithmetic.levels"),
    ("arithmetic", {"levels": (2, 1)}, "Arithmetic.levels"),
    ("arithmetic", {"levels": (0, 1)}, "Arithmetic.levels"),
    ("arithmetic", {"levels": (19,)}, "Arithmetic.levels"),
    ("arithmetic", {"levels": (1.5,)}, "Arithmetic.levels"),
    ("arithmetic", {"levels": 3}, "Arithmetic.levels"),
    ("arithmetic", {"mix": (1, 2)}, "Arithmetic.mix"),
    ("arithmetic", {"mix": (0, 0, 0, 0, 0)}, "Arithmetic.mix"),
    ("arithmetic", {"mix": (-1, 1, 1, 1, 1)}, "Arithmetic.mix"),
    ("arithmetic", {"ops": ("-",)}, "Arithmetic.ops"),
    ("arithmetic", {"ops": ()}, "Arithmetic.ops"),
    ("arithmetic", {"ops": ("+", "+")}, "Arithmetic.ops"),
    ("arithmetic", {"latency_median_s": 0.0}, "Arithmetic.latency_median_s"),
    ("arithmetic", {"latency_growth": 0.5}, "Arithmetic.latency_growth"),
    ("sorting", {"latency_sigma": 0.0}, "Sorting.latency_sigma"),
    ("sorting", {"latency_sigma": float("nan")}, "Sorting.latency_sigma"),
    ("sorting", {"max_value": 0}, "Sorting.max_value"),
    ("sorting", {"levels": (0, 2)}, "Sorting.levels"),
    ("sorting", {"colour": 1}, "Sorting: unknown field.*'colour'"),
    ("chess", {}, "unknown env 'chess' .known: arithmetic, sorting"),
])
def test_config_errors_name_the_field(name, fields, field):
  with pytest.raises(ConfigError, match=field) as err:
    envs.make(name, **fields)
  assert isinstance(err.value, UserError) and "\n" not in str(err.value)


def test_configs_are_frozen_and_hashable():
  env = envs.make("arithmetic", levels=[1, 2], mix=[1, 1])
  assert env.levels == (1, 2) and env.mix == (1, 1)
  assert hash(env) == hash(Arithmetic(levels=(1, 2), mix=(1, 1)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    env.levels = (3,)
  assert set(envs.ENVS) == {"arithmetic", "sorting", "multiply"}
