"""FLOPs and MFU (m2jax/params.py): the MTP modules a step trains are
counted, by hand for MiniMax-M2's shapes."""

import pytest

from m2jax import config as config_lib
from m2jax import params

M2 = config_lib.MINIMAX_M2

# One M2 MTP module per token: its MoE block with 8 of 256 experts
# (attention 44,040,192; router 786,432; expert bias 256; norms 13,312;
# experts 8 x 14,155,776), the 2D -> D projection and its two input norms.
MTP_ACTIVE = (44_040_192 + 786_432 + 256 + 13_312 + 8 * 14_155_776
              + 2 * 3072 * 3072 + 2 * 3072)
LM_HEAD = 200_064 * 3072


def test_mtp_active_params_per_module():
  assert params.count_params(M2)["mtp_active_params_per_module"] == \
      MTP_ACTIVE


def test_flops_per_token_counts_the_trained_mtp_modules():
  T = 4096
  f = [params.flops_per_token(M2, T, mtp_depth=d) for d in range(4)]
  # Each module: 6 FLOPs per weight of the module and of the shared
  # lm_head, and full causal attention (48 heads of 128, half a row on
  # average, 4 FLOPs per pair forward, x3 with the backward).
  per_module = 6 * (MTP_ACTIVE + LM_HEAD) + 3 * 4 * 48 * 128 * T // 2
  assert [b - a for a, b in zip(f, f[1:])] == [per_module] * 3
  with pytest.raises(ValueError, match="mtp_depth"):
    params.flops_per_token(M2, T, mtp_depth=4)
  tiny = config_lib.TINY.replace(num_mtp_modules=0)
  assert params.flops_per_token(tiny, 64, mtp_depth=0) > 0
  with pytest.raises(ValueError, match="mtp_depth"):
    params.flops_per_token(tiny, 64, mtp_depth=1)


def test_mfu():
  assert params.mfu(1000.0, 1e9, 1e12) == pytest.approx(1.0)
  assert params.mfu(1000.0, 1e9, 1e12, num_devices=4) == pytest.approx(0.25)
  assert params.mfu(1000.0, 1e9, None) is None
