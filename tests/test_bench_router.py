"""experiments/bench_router.py's pure pieces: the CPU gather path of the
experts' grouped matmul, the violation, and the --arm parser."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_router
from m2jax import config as config_lib
from m2jax.errors import UserError


def test_gather_gmm_matches_ragged_dot_values_and_gradients():
  k1, k2 = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(k1, (50, 8))
  rhs = jax.random.normal(k2, (4, 8, 3))
  sizes = jnp.array([10, 0, 25, 10])   # an empty group; 5 rows past the end
  loss = lambda fn: lambda l, r: jnp.sum(jnp.sin(fn(l, r, sizes)))
  np.testing.assert_allclose(bench_router.gather_gmm(lhs, rhs, sizes),
                             jax.lax.ragged_dot(lhs, rhs, sizes), atol=1e-5)
  want = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(lhs, rhs)
  got = jax.grad(loss(bench_router.gather_gmm), (0, 1))(lhs, rhs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5)


def test_violation_per_router():
  load = [[8.0, 0, 0, 0, 0, 0, 0, 0], [1.0] * 8, [2.0, 0, 1, 1, 1, 1, 1, 1]]
  np.testing.assert_allclose(bench_router.violation(load), [7.0, 0.0, 1.0])


def test_parse_arm():
  name, cfg = bench_router.parse_arm(
      "prop bias_update=proportional bias_update_rate=0.02",
      config_lib.TINY)
  assert (name, cfg.bias_update, cfg.bias_update_rate) == (
      "prop", "proportional", 0.02)
  with pytest.raises(UserError, match="NAME"):
    bench_router.parse_arm("bias_update=sign", config_lib.TINY)
  with pytest.raises(config_lib.ConfigError, match="bias_update"):
    bench_router.parse_arm("x bias_update=signum", config_lib.TINY)


def test_held_out_rows_are_spread_over_the_validation_split():
  # The split is packed in key order: its first rows are chunks of a few
  # files. The held-out loads read rows from across all of it instead.
  from m2jax.data import DataConfig, make_dataset, make_tokenizer
  dcfg = DataConfig(source="stdlib", seq_len=64, batch_size=4,
                    max_documents=60)
  tokenizer = make_tokenizer(dcfg)
  total = sum(int((np.asarray(b["row_ids"]) >= 0).sum())
              for b in make_dataset(dcfg, tokenizer, "validation"))
  batches = bench_router.spread_rows(dcfg, tokenizer, 3)
  assert len(batches) == 3
  assert all(b["tokens"].shape == (4, 64) for b in batches)
  ids = np.concatenate([b["row_ids"] for b in batches])
  assert ids.min() == 0 and ids.max() == total - 1
  assert len(set(ids.tolist())) == 12  # 12 distinct rows, not 3 x the first
  with pytest.raises(UserError, match="eval_batches"):
    bench_router.spread_rows(dcfg, tokenizer, total)


def test_an_arm_may_override_the_train_config():
  from m2jax.train.config import TrainConfig
  text = "slow_router bias_update=sign train.router_lr_scale=0.1"
  name, cfg = bench_router.parse_arm(text, config_lib.TINY)
  assert (name, cfg.bias_update) == ("slow_router", "sign")
  tcfg = bench_router.arm_train_config(text, TrainConfig())
  assert tcfg.router_lr_scale == 0.1
  assert bench_router.arm_train_config("plain", TrainConfig()) == TrainConfig()
