"""The train state: parameters, optimizer state, expert bias, step counter.

A run's whole mutable state is one `TrainState`, passed into every step and
returned by it (nothing hidden). Here it is created (fresh or from given
variables, on one device or directly in its shardings on a mesh) and its
shardings are derived: parameters follow the model's logical axes
(m2jax.sharding), optimizer moments follow their parameters (SSO's singular
vectors too, unsplit on the axes they are reduced over), the step counter
and the expert bias are replicated.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from m2jax import model
from m2jax import sharding
from m2jax.config import ModelConfig
from m2jax.train.config import TrainConfig
from m2jax.train.optim import make_optimizer


class TrainState(NamedTuple):
  step: jax.Array
  params: Any
  opt_state: Any
  expert_bias: Any


@functools.lru_cache(maxsize=8)
def _param_axes(model_config: ModelConfig):
  return model.logical_axes(model_config)["params"]


def optimizer(model_config: ModelConfig, train_config: TrainConfig):
  """The optimizer of `train_config` over the model's parameters (optim)."""
  return make_optimizer(train_config, _param_axes(model_config))


def init_state(model_config: ModelConfig, train_config: TrainConfig,
               variables) -> TrainState:
  """Step 0 state from model variables (params + expert bias)."""
  opt = optimizer(model_config, train_config)
  return TrainState(jnp.zeros((), jnp.int32), variables["params"],
                    opt.init(variables["params"]),
                    variables.get(model.EXPERT_BIAS, {}))


def _like_param(x, param_sharding: NamedSharding, param):
  """The sharding of an optimizer-state leaf `x` kept per parameter: the
  parameter's, except on the axes where `x` has size 1 and the parameter
  not (SSO's singular vectors, reduced over those axes): not split there."""
  if x.shape == param.shape:
    return param_sharding
  if len(x.shape) != len(param.shape):
    return NamedSharding(param_sharding.mesh, PartitionSpec())
  spec = tuple(param_sharding.spec)
  spec += (None,) * (len(param.shape) - len(spec))
  return NamedSharding(param_sharding.mesh, PartitionSpec(*(
      axis if n == pn else None
      for axis, n, pn in zip(spec, x.shape, param.shape))))


def state_shardings(model_config: ModelConfig, train_config: TrainConfig,
                    mesh, rules=sharding.LOGICAL_RULES) -> TrainState:
  """A TrainState of NamedShardings: optimizer moments follow their params."""
  var = sharding.variable_shardings(model_config, mesh, rules)
  params = jax.eval_shape(lambda: model.init(model_config,
                                             jax.random.key(0)))["params"]
  opt = optimizer(model_config, train_config)
  opt_shapes = jax.eval_shape(opt.init, params)
  # Partitioned optimizers (Muon + AdamW) hold each family's moments with
  # optax.MaskedNode where the other family's parameters are: keep those.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  replicated = sharding.replicated(mesh)
  opt_sh = optax.tree_map_params(
      opt, lambda x, s, p: x if masked(x) else _like_param(x, s, p),
      opt_shapes, var["params"], params,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, NamedSharding) or masked(x))
  return TrainState(replicated, var["params"], opt_sh,
                    var.get(model.EXPERT_BIAS, {}))


def create_state(model_config: ModelConfig, train_config: TrainConfig,
                 variables=None, *, mesh=None) -> TrainState:
  """Step-0 state from `variables` (default: a fresh init from the seed).

  With a mesh every leaf is created directly in its sharding (a fresh init
  never exists whole on one device).
  """
  if mesh is None:
    if variables is None:
      variables = model.init(model_config, jax.random.key(train_config.seed))
    # Committed to the device, as a restored state is: a train step then
    # compiles once for a fresh and a resumed state (and for a fresh state
    # whose variables were restored, as SFT's --init, and its own outputs).
    return jax.device_put(init_state(model_config, train_config, variables),
                          jax.devices()[0])
  shardings = state_shardings(model_config, train_config, mesh)
  if variables is None:
    make = jax.jit(lambda key: init_state(model_config, train_config,
                                          model.init(model_config, key)),
                   out_shardings=shardings)
    return make(jax.random.key(train_config.seed))
  variables = sharding.place(
      variables, sharding.variable_shardings(model_config, mesh))
  return jax.jit(functools.partial(init_state, model_config, train_config),
                 out_shardings=shardings)(variables)


def model_variables(params, expert_bias) -> dict:
  """{"params", "expert_bias"} as m2jax.model takes them (no empty bias)."""
  v = {"params": params}
  if expert_bias:
    v[model.EXPERT_BIAS] = expert_bias
  return v


def variables_of(state: TrainState) -> dict:
  """The model variables held by `state`."""
  return model_variables(state.params, state.expert_bias)
