"""MTP growth (m2jax.train.mtp_growth): the copy rule, Plateau, the MTP-only
phase's backward, and the phases continuing one optimizer and schedule."""

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import config as config_lib
from m2jax import model
from m2jax.model.layers import positions_from_segments
from m2jax.train import losses, schedules
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "num_experts=4",
         "moe_intermediate_size=16"]
MCFG = config_lib.apply_overrides(config_lib.TINY, SMALL)


def _batch(seed=0, rows=2, length=16):
  """Random tokens in two documents per row."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, MCFG.vocab_size, (rows, length), dtype=np.int32)
  segment_ids = np.ones((rows, length), np.int32)
  segment_ids[:, length // 2:] = 2
  return {"tokens": tokens, "segment_ids": segment_ids,
          "positions": np.asarray(positions_from_segments(segment_ids))}


def _random_variables(mcfg, seed=0):
  """Variables of `mcfg`, every leaf distinct random values (model.init
  takes seconds to compile on CPU), as device arrays."""
  shapes = jax.eval_shape(lambda: model.init(mcfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(
      rng.normal(scale=0.1, size=s.shape).astype(s.dtype)), shapes)


def _objective(mcfg, tcfg, batch, step=0):
  """The train step's loss as a function of (params, expert_bias)."""
  return lambda params, bias: step_lib._loss_fn(  # pylint: disable=W0212
      params, bias, batch, step, mcfg=mcfg, tcfg=tcfg)[0]


def _count_dots(jaxpr) -> int:
  """dot_general (and ragged_dot) equations, sub-jaxprs included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += "dot" in eqn.primitive.name
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          n += _count_dots(sub)
  return n


# The MTP-only phase: no backward through the frozen main model.

def test_mtp_only_gradient_stops_at_the_frozen_main_model():
  tcfg = TrainConfig(mtp_only=True, aux_loss_coef=1e-2, z_loss_coef=1e-3)
  variables = _random_variables(MCFG)
  batch = _batch()
  grads = jax.jit(jax.grad(_objective(MCFG, tcfg, batch)))(
      variables["params"], variables[model.EXPERT_BIAS])

  def reference(params):
    """The same objective, the main model differentiated through."""
    out = model.forward(MCFG, {**variables, "params": params},
                        batch["tokens"], segment_ids=batch["segment_ids"],
                        positions=batch["positions"], mtp_depth=1)
    return losses.total_loss(
        out, batch, mtp_weight=schedules.mtp_weight(tcfg, 0),
        aux_coef=tcfg.aux_loss_coef, z_coef=tcfg.z_loss_coef,
        main_weight=0.0)[0]

  ref = jax.jit(jax.grad(reference))(variables["params"])
  for name in ref:
    if name.startswith("mtp_"):
      # The trunk is frozen either way: MTP's own gradient is unchanged.
      jax.tree.map(lambda a, b: np.testing.assert_allclose(
          a, b, rtol=1e-6, atol=1e-12), grads[name], ref[name])
    else:
      assert all(not np.any(g) for g in jax.tree.leaves(grads[name])), name
  # Without the stop the MTP loss reaches the trunk, embedding and head.
  for name in ("layers_0", "embedding", "lm_head"):
    assert any(np.any(g) for g in jax.tree.leaves(ref[name])), name


def test_mtp_only_backward_does_not_grow_with_the_trunk():
  """The dot products of the gradient beyond the forward's are the MTP
  module's backward alone: the same for a 1- and a 3-layer main model."""
  batch = _batch()
  backward = {}
  for mtp_only in (True, False):
    tcfg = TrainConfig(mtp_only=mtp_only, aux_loss_coef=1e-2)
    for layers in (1, 3):
      mcfg = MCFG.replace(num_layers=layers)
      variables = jax.eval_shape(
          lambda c=mcfg: model.init(c, jax.random.key(0)))
      args = variables["params"], variables[model.EXPERT_BIAS]
      loss = _objective(mcfg, tcfg, batch)
      forward = _count_dots(jax.make_jaxpr(loss)(*args).jaxpr)
      grad = _count_dots(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr)
      backward[mtp_only, layers] = grad - forward
  assert backward[True, 1] == backward[True, 3] > 0, backward
  # The count does see a trunk's backward where there is one.
  assert backward[False, 3] > backward[False, 1] > backward[True, 1], backward

