"""The jitted train and eval steps over an explicit TrainState.

State is passed in and returned: parameters, optimizer state, the expert
bias (updated outside the gradient from the step's routing load) and the
step counter. Parameters stay float32; the model casts to its compute dtype.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.data.packing import next_token_targets
from m2jax.train import losses, schedules
from m2jax.train.config import TrainConfig
from m2jax.train.optim import make_optimizer


class TrainState(NamedTuple):
  step: jax.Array
  params: Any
  opt_state: Any
  expert_bias: Any


def init_state(train_config: TrainConfig, variables) -> TrainState:
  """Step 0 state from model variables (params + expert bias)."""
  opt = make_optimizer(train_config, variables["params"])
  return TrainState(jnp.zeros((), jnp.int32), variables["params"],
                    opt.init(variables["params"]),
                    variables.get(model.EXPERT_BIAS, {}))


def variables_of(state: TrainState) -> dict:
  """The model variables held by `state`."""
  v = {"params": state.params}
  if state.expert_bias:
    v[model.EXPERT_BIAS] = state.expert_bias
  return v


def _loss_fn(params, expert_bias, batch, step, *, mcfg: ModelConfig,
             tcfg: TrainConfig):
  variables = {"params": params}
  if expert_bias:
    variables[model.EXPERT_BIAS] = expert_bias
  out = model.forward(mcfg, variables, batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"], mtp_depth=tcfg.mtp_depth)
  aux = mcfg.aux_loss_coef if tcfg.aux_loss_coef is None else tcfg.aux_loss_coef
  loss, metrics = losses.total_loss(
      out, batch, mtp_weight=schedules.mtp_weight(tcfg, step), aux_coef=aux,
      z_coef=tcfg.z_loss_coef, main_weight=0.0 if tcfg.mtp_only else 1.0)
  return loss, (metrics, out)


def train_step(state: TrainState, batch, *, model_config: ModelConfig,
               train_config: TrainConfig):
  """One optimizer step; returns the new state and float32 metrics."""
  opt = make_optimizer(train_config, state.params)
  grad_fn = jax.value_and_grad(
      functools.partial(_loss_fn, mcfg=model_config, tcfg=train_config),
      has_aux=True)
  (_, (metrics, out)), grads = grad_fn(state.params, state.expert_bias, batch,
                                       state.step)
  updates, opt_state = opt.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  bias = model.update_expert_biases(model_config, state.expert_bias, out)
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads),
                 lr=schedules.learning_rate(train_config)(state.step))
  return TrainState(state.step + 1, params, opt_state, bias), metrics


def eval_step(state: TrainState, batch, *, model_config: ModelConfig,
              train_config: TrainConfig):
  """Summed CE (nats), target count and target bytes of one batch."""
  out = model.forward(model_config, variables_of(state), batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"])
  targets, mask = next_token_targets(batch["tokens"], batch["segment_ids"], 1)
  ce, _ = losses.cross_entropy(out.logits, targets, mask)
  del train_config
  return {"nats": jnp.sum(ce), "tokens": jnp.sum(mask),
          "bytes": jnp.sum(batch["num_bytes"])}


def jit_steps(model_config: ModelConfig, train_config: TrainConfig):
  """Jitted (train_step, eval_step) closed over the configs."""
  train = jax.jit(functools.partial(train_step, model_config=model_config,
                                    train_config=train_config),
                  donate_argnums=0)
  evaluate = jax.jit(functools.partial(eval_step, model_config=model_config,
                                       train_config=train_config))
  return train, evaluate
