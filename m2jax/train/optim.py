"""Optimizers: AdamW, or Muon for hidden matrices with AdamW for the rest.

Muon (optax.contrib.muon) orthogonalises each weight matrix's update. Its
defaults would treat every 2-D leaf as a matrix (embedding and lm_head too)
and send 3-D leaves to Adam, so the dimension numbers are set per leaf:
  attention q/k/v [D, N, hd]: reduce D, output (N, hd); o [N, hd, D] reverse;
  experts [E, D, F] / [E, F, D]: axis 0 is a batch axis, so each expert is
  orthogonalised on its own;
  dense FFN and the MTP projection: plain matrices;
  embedding, lm_head, router, norms: AdamW.
Weight decay applies to matrices only (no norms or 1-D leaves).
"""

from __future__ import annotations

import jax
import optax
from optax.contrib._muon import MuonDimensionNumbers

from m2jax.train import schedules
from m2jax.train.config import TrainConfig

_MATRIX = MuonDimensionNumbers(reduction_axis=0, output_axis=1)


def muon_dimension_numbers(params):
  """Per-leaf MuonDimensionNumbers, None for leaves that stay on AdamW."""

  def rule(path, leaf):
    names = [getattr(k, "key", str(k)) for k in path]
    leaf_name = names[-1]
    if leaf_name in ("q_proj", "k_proj", "v_proj"):
      return MuonDimensionNumbers(reduction_axis=0, output_axis=(1, 2))
    if leaf_name == "o_proj":
      return MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2)
    if leaf_name in ("w1", "w2", "w3"):
      if leaf.ndim == 3:  # [E, in, out]: per-expert matrices
        return MuonDimensionNumbers(reduction_axis=1, output_axis=2)
      return _MATRIX
    if leaf_name == "proj":
      return _MATRIX
    return None

  return jax.tree_util.tree_map_with_path(rule, params)


def is_frozen(config: TrainConfig, name: str) -> bool:
  """Whether the top-level variable `name` stays fixed under `config`.

  MTP growth (`mtp_only`) freezes the main model, embedding and head
  included, and trains the `mtp_*` modules: their parameters here, their
  routing bias in the train step.
  """
  return config.mtp_only and not name.startswith("mtp_")


def _decay_mask(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: TrainConfig, params) -> optax.GradientTransformation:
  """Gradient clipping, then AdamW or Muon(+AdamW), on the WSD schedule."""
  lr = schedules.learning_rate(config)
  if config.optimizer == "adamw":
    opt = optax.adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=_decay_mask)
  else:
    opt = optax.contrib.muon(
        lr, beta=config.b1, eps=config.eps, weight_decay=config.weight_decay,
        weight_decay_mask=_decay_mask, adam_b1=config.b1, adam_b2=config.b2,
        # Adam's part holds norms and 1-D leaves, which must not decay, and
        # optax offers no mask for it.
        adam_weight_decay=0.0,
        muon_weight_dimension_numbers=muon_dimension_numbers(params))
  opt = optax.chain(optax.clip_by_global_norm(config.grad_clip), opt)
  if config.mtp_only:
    labels = {k: "frozen" if is_frozen(config, k) else "train" for k in params}
    opt = optax.multi_transform(
        {"train": opt, "frozen": optax.set_to_zero()}, labels)
  return opt
