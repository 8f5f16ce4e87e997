"""WSD learning rate and MTP weight: the endpoints the runs train at."""

import numpy as np
import pytest

from m2jax.train import schedules
from m2jax.train.config import TrainConfig

PEAK, RATIO = 2.0, 0.1


def _config(steps, decay_fraction, warmup_steps=3):
  return TrainConfig(steps=steps, decay_fraction=decay_fraction,
                     warmup_steps=warmup_steps, learning_rate=PEAK,
                     min_lr_ratio=RATIO, mtp_weight=0.3, mtp_weight_final=0.1)


# (steps, decay_fraction): ordinary, the paper's fraction, a one-step decay
# (round(0.1 * 10) = 1), a two-step decay, everything decaying.
CASES = [(100, 0.2), (50, TrainConfig.decay_fraction), (10, 0.1), (10, 0.2),
         (8, 1.0)]


@pytest.mark.parametrize("steps,fraction", CASES)
def test_last_step_trains_at_the_floor(steps, fraction):
  cfg = _config(steps, fraction, warmup_steps=0)
  lr = schedules.learning_rate(cfg)
  np.testing.assert_allclose(lr(steps - 1), PEAK * RATIO, rtol=1e-6)
  np.testing.assert_allclose(schedules.mtp_weight(cfg, steps - 1), 0.1,
                             rtol=1e-6)


@pytest.mark.parametrize("steps,fraction", CASES[:4])
def test_decay_starts_right_after_the_stable_phase_and_is_linear(steps,
                                                                 fraction):
  cfg = _config(steps, fraction)
  lr = schedules.learning_rate(cfg)
  start = cfg.decay_start
  assert 0 < start < steps
  np.testing.assert_allclose(lr(start - 1), PEAK, rtol=1e-6)
  np.testing.assert_allclose(schedules.mtp_weight(cfg, start - 1), 0.3,
                             rtol=1e-6)
  decay = np.array([lr(s) for s in range(start - 1, steps)])
  # Equal steps down from the peak to the floor: the first already lower.
  np.testing.assert_allclose(np.diff(decay),
                             (PEAK * RATIO - PEAK) / (steps - start),
                             rtol=1e-5)
  mtp = np.array([schedules.mtp_weight(cfg, s) for s in range(start - 1,
                                                                steps)])
  np.testing.assert_allclose(np.diff(mtp), (0.1 - 0.3) / (steps - start),
                             rtol=1e-5)


def test_warmup_reaches_the_peak_on_its_last_step():
  cfg = _config(100, 0.2, warmup_steps=10)
  lr = schedules.learning_rate(cfg)
  np.testing.assert_allclose([lr(0), lr(4), lr(9), lr(50)],
                             [PEAK / 10, PEAK / 2, PEAK, PEAK], rtol=1e-6)


def test_no_decay_keeps_the_peak_to_the_end():
  cfg = _config(20, 0.0)
  lr = schedules.learning_rate(cfg)
  np.testing.assert_allclose(lr(19), PEAK, rtol=1e-6)
  np.testing.assert_allclose(schedules.mtp_weight(cfg, 19), 0.3, rtol=1e-6)


def test_default_decay_fraction_is_the_papers():
  # SPEC §2: 19.9T constant + 9.3T decay tokens.
  assert TrainConfig().decay_fraction == pytest.approx(9.3 / 29.2)
  assert TrainConfig(steps=1000).decay_start == 1000 - 318
