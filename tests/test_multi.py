"""Several models in one vmapped program (m2jax.train.multi) vs alone."""

import os

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import sweep
from m2jax.config import ConfigError
from m2jax.data import DataConfig
from m2jax.train import multi
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

# One layer: the test compiles the vmapped step and a single one.
MODEL = config_lib.apply_overrides(config_lib.TINY, [
    "num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
    "head_dim=8", "rotary_dim=4", "num_experts=4", "num_experts_per_tok=2",
    "moe_intermediate_size=16", "num_mtp_modules=0"])
TRAIN = TrainConfig(steps=3, mtp_depth=0, learning_rate=3e-3, warmup_steps=1)


def _batch(rng, B=2, T=32):
  return {"tokens": rng.integers(3, 200, (B, T)).astype(np.int32),
          "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
          "num_bytes": np.ones((B, T), np.int32)}


def test_vmapped_step_equals_the_model_alone_at_its_learning_rate():
  # Seed 0 at the base lr, seed 1 at twice it, each with its own batches.
  # Model 1 (update scaled by 2) must be what training it alone at 2 x lr
  # gives. (Equal learning rates, data order and resume: test_sweep.py's
  # parallel sweep against the sequential one.)
  rng = np.random.default_rng(0)
  trains = [TRAIN.replace(seed=0), TRAIN.replace(seed=1, learning_rate=6e-3)]
  runs = [multi.Run(MODEL, t, DataConfig(seed=t.seed), f"/tmp/run{t.seed}")
          for t in trains]
  tcfg, scale = multi.shared_train_config(runs)
  np.testing.assert_allclose(scale, [1.0, 2.0])
  batches = [[_batch(rng) for _ in trains] for _ in range(TRAIN.steps)]
  states = [state_lib.create_state(MODEL, t) for t in trains]
  stacked = multi.stack(states)
  step = multi.jit_multi_step(MODEL, tcfg)
  losses = []
  for b in batches:
    stacked, metrics = step(stacked, multi.stack(b), scale)
    losses.append(np.asarray(metrics["loss"]))
  np.testing.assert_allclose(metrics["lr"][1], 2 * metrics["lr"][0],
                             rtol=1e-6)
  alone, _ = step_lib.jit_steps(MODEL, trains[1])
  state = jax.tree.map(np.array, states[1])
  for k, b in enumerate(batches):
    state, m = alone(state, b[1])
    np.testing.assert_allclose(losses[k][1], m["loss"], rtol=1e-5)
  for want, got in zip(jax.tree.leaves(state),
                       jax.tree.leaves(multi.unstack(stacked, 1))):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
  # The models differ (init, data, lr): the match is model 1's own.
  p0, p1 = (jax.tree.leaves(multi.unstack(stacked, i).params)[0]
            for i in (0, 1))
  assert not np.allclose(p0, p1)


def _runs(grid, seeds=(0, 1), **train):
  cfg = sweep.SweepConfig(grid=grid, seeds=seeds, steps=4, seq_len=160,
                          batch_size=2, eval_lengths=(128,), data="stdlib")
  return [sweep._run_configs(MODEL, v, s, cfg, "/nonexistent/sweep")
          for v in sweep.make_grid(grid, MODEL, window=64) for s in seeds]


def test_refuses_what_changes_the_program_and_groups_the_rest():
  gating = _runs("gating")  # sigmoid_bias x 2 seeds, softmax_aux x 2 seeds
  assert multi.group_runs(gating) == [[0, 1], [2, 3]]
  with pytest.raises(ConfigError, match=r"^ModelConfig\.gating: runs 0 and "
                     r"1 differ \('sigmoid'"):
    multi.check_batchable([gating[0], gating[2]])
  # Learning rates may differ (the update scales with the peak) ...
  lr = [r.__class__(r.model, r.train.replace(learning_rate=x), r.data,
                    f"/nonexistent/lr{x}") for r, x in zip(gating[:2],
                                                            (1e-3, 3e-3))]
  multi.check_batchable(lr)
  assert multi.group_runs(lr + gating[2:]) == [[0, 1], [2, 3]]
  # ... unless it is not linear in it.
  sso = [r.__class__(r.model, r.train.replace(optimizer="sso"), r.data,
                     r.workdir) for r in lr]
  with pytest.raises(ConfigError, match=r"^TrainConfig\.learning_rate: runs "
                     "differ .* optimizer in"):
    multi.check_batchable(sso)
  multi.check_batchable([sso[0], sso[0].__class__(
      sso[0].model, sso[0].train.replace(seed=5), sso[0].data, "/x")])
  tcfg = gating[1].train.replace(steps=7)
  with pytest.raises(ConfigError, match=r"^TrainConfig\.steps: runs 0 and 1"):
    multi.check_batchable([gating[0], multi.Run(
        gating[1].model, tcfg, gating[1].data, gating[1].workdir)])
  with pytest.raises(ConfigError, match="share a workdir"):
    multi.check_batchable([gating[0], gating[0]])


def test_runs_resuming_from_different_steps_are_not_grouped(tmp_path):
  a, b = (multi.Run(MODEL, TRAIN.replace(seed=s), DataConfig(seed=s),
                    str(tmp_path / f"seed{s}")) for s in (0, 1))
  assert multi.group_runs([a, b]) == [[0, 1]]
  for name in ("4", "12", "16.orbax-checkpoint-tmp-1", "other"):
    os.makedirs(os.path.join(b.workdir, "checkpoints", name))
  assert multi.resume_step(b.workdir) == 12
  assert multi.resume_step(a.workdir) == 0
  assert multi.group_runs([a, b]) == [[0], [1]]
