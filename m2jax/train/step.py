"""The jitted train and eval steps over an explicit TrainState (state.py).

State is passed in and returned: parameters, optimizer state, the expert
bias (updated outside the gradient from the step's routing load) and the
step counter. Parameters stay float32; the model casts to its compute dtype.

With a mesh (m2jax.sharding) the same step functions are jitted with the
state's and batch's shardings and traced under the mesh's logical rules, so
XLA partitions them and the MoE runs expert-parallel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from m2jax import model
from m2jax import sharding
from m2jax.config import ModelConfig
from m2jax.train import gnmr
from m2jax.train import losses, schedules
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig
from m2jax.train.optim import is_frozen
from m2jax.train.state import TrainState, variables_of


def _loss_fn(params, expert_bias, batch, step, *, mcfg: ModelConfig,
             tcfg: TrainConfig):
  if tcfg.mtp_only:
    # The frozen main model enters as a constant, so autodiff emits no
    # backward through its layers, embedding or head (not merely a zero
    # one): of the trunk, the MTP-only phase pays the forward alone.
    params = {k: jax.lax.stop_gradient(v) if is_frozen(tcfg, k) else v
              for k, v in params.items()}
  variables = state_lib.model_variables(params, expert_bias)
  chunk = mcfg.settings.loss_chunk
  out = model.forward(mcfg, variables, batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"], mtp_depth=tcfg.mtp_depth,
                      logits=not chunk)
  aux = mcfg.aux_loss_coef if tcfg.aux_loss_coef is None else tcfg.aux_loss_coef
  loss, metrics = losses.total_loss(
      out, batch, mtp_weight=schedules.mtp_weight(tcfg, step), aux_coef=aux,
      z_coef=tcfg.z_loss_coef, main_weight=0.0 if tcfg.mtp_only else 1.0,
      chunk=chunk, impl=mcfg.settings.loss_impl)
  return loss, (metrics, out)


def apply_gradients(state: TrainState, grads, out: model.ModelOutput, *,
                    model_config: ModelConfig, train_config: TrainConfig,
                    update_scale=None):
  """The optimizer update of `grads` and the expert-bias update from the
  routing load in `out` (only its routing fields are read). Returns the new
  state and float32 metrics. Shared by the pretraining and RL steps.

  `update_scale` (a scalar, may be traced) multiplies the optimizer's update
  and the logged lr: the step of a peak learning rate that many times
  train_config's, where the update is linear in it (m2jax.train.multi says
  when; it trains models of several learning rates in one program)."""
  opt = state_lib.optimizer(model_config, train_config)
  updates, opt_state = opt.update(grads, state.opt_state, state.params)
  if update_scale is not None:
    updates = jax.tree.map(lambda u: u * update_scale, updates)
  params = optax.apply_updates(state.params, updates)
  bias = model.update_expert_biases(model_config, state.expert_bias, out)
  # A frozen module keeps its routing too.
  bias = {k: state.expert_bias[k] if is_frozen(train_config, k) else v
          for k, v in bias.items()}
  lr = schedules.learning_rate(train_config)(state.step)
  metrics = {"grad_norm": optax.tree.norm(grads),
             "lr": lr if update_scale is None else lr * update_scale}
  metrics.update(gnmr.metrics(opt_state))  # {} when GNMR is off
  if out.routing is not None:
    dropped = jnp.sum(out.routing.dropped)
    if out.mtp_routing is not None:
      dropped = dropped + jnp.sum(out.mtp_routing.dropped)
    metrics["moe/dropped"] = dropped
  return TrainState(state.step + 1, params, opt_state, bias), metrics


def gradients(state: TrainState, batch, *, model_config: ModelConfig,
              train_config: TrainConfig):
  """(loss metrics, model output, raw gradients) of one batch: the first
  half of train_step, for callers that act between the two halves (the
  GNMR stress harness injects faults there)."""
  grad_fn = jax.value_and_grad(
      functools.partial(_loss_fn, mcfg=model_config, tcfg=train_config),
      has_aux=True)
  (_, (metrics, out)), grads = grad_fn(state.params, state.expert_bias, batch,
                                       state.step)
  return metrics, out, grads


def train_step(state: TrainState, batch, *, model_config: ModelConfig,
               train_config: TrainConfig, update_scale=None):
  """One optimizer step; returns the new state and float32 metrics.
  `update_scale`: see apply_gradients."""
  metrics, out, grads = gradients(state, batch, model_config=model_config,
                                  train_config=train_config)
  state, step_metrics = apply_gradients(state, grads, out,
                                        model_config=model_config,
                                        train_config=train_config,
                                        update_scale=update_scale)
  return state, dict(metrics, **step_metrics)


def eval_step(state: TrainState, batch, *, model_config: ModelConfig,
              train_config: TrainConfig):
  """Summed CE (nats), target count and target bytes of one batch (the
  targets `losses.target_mask` counts)."""
  chunk = model_config.settings.loss_chunk
  out = model.forward(model_config, variables_of(state), batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"], logits=not chunk)
  (mask, ce, _, _), = losses.head_losses(out, batch, chunk)[0]
  del train_config
  return {"nats": jnp.sum(ce), "tokens": jnp.sum(mask),
          "bytes": jnp.sum(batch["num_bytes"])}


def _step_fns(model_config: ModelConfig, train_config: TrainConfig):
  """(train_step, eval_step) closed over the configs, not yet jitted."""
  return (functools.partial(train_step, model_config=model_config,
                            train_config=train_config),
          functools.partial(eval_step, model_config=model_config,
                            train_config=train_config))


@functools.lru_cache(maxsize=8)
def _jit_single_device(model_config: ModelConfig, train_config: TrainConfig):
  train, evaluate = _step_fns(model_config, train_config)
  return jax.jit(train, donate_argnums=0), jax.jit(evaluate)


def jit_steps(model_config: ModelConfig, train_config: TrainConfig, *,
              mesh=None):
  """Jitted (train_step, eval_step) closed over the configs.

  With `mesh`: state and batch go in (and the state comes out) in the
  shardings of m2jax.sharding, metrics come out replicated, and tracing runs
  under `sharding.use_mesh(mesh)`. Batches are global
  arrays (`sharding.shard_batch`) or host arrays (single process).
  """
  if mesh is None:
    # The seed only matters for init: runs that differ by seed share one
    # compiled step (sweeps run several seeds per config).
    return _jit_single_device(model_config, train_config.replace(seed=0))
  train, evaluate = _step_fns(model_config, train_config)
  state = state_lib.state_shardings(model_config, train_config, mesh)
  batch, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  train = jax.jit(train, in_shardings=(state, batch),
                  out_shardings=(state, rep), donate_argnums=0)
  evaluate = jax.jit(evaluate, in_shardings=(state, batch),
                     out_shardings=rep)
  return sharding.on_mesh(train, mesh), sharding.on_mesh(evaluate, mesh)
