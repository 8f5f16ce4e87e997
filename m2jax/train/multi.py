"""Several models of one shape trained as one program: vmapped train steps.

A sweep trains many small models; one of them leaves a GPU mostly idle.
`pretrain_many` trains N runs whose programs are the same, up to values
that can be traced, as ONE jitted step vmapped over a leading model axis
of the stacked train states (parameters, optimizer moments, expert bias,
step counter) and batches [N, B, T]: step.train_step, the optimizer of
optim.make_optimizer and the data pipeline unchanged. Each model gets
what it would get trained alone (tests/test_multi.py checks parameters and
losses against separate runs):

  may differ  TrainConfig.seed, DataConfig.seed  init and data order: each
                  model is initialised from its own seed and reads its own
                  stream (its DataConfig), the batches pretrain would give
                  it alone, so seeds vary both init and data order
              TrainConfig.learning_rate  the peak; the step scales the
                  shared optimizer's update by lr / lr of the first run
                  (step.apply_gradients' update_scale), exact where the
                  update is linear in the peak: optimizer "adamw" or "muon"
                  with matrix_learning_rate None (SSO's retraction and a
                  separate matrix rate are not)
  must match  everything else: every ModelConfig field (shapes, attention
              pattern, gating, aux_loss_coef, bias_update_rate: the step
              reads them as Python values), every other TrainConfig and
              DataConfig field (one loop, one cadence). `check_batchable`
              names the first field that differs, in one line.

Each run's workdir is a pretrain workdir (loop.py): config.json,
tokenizer/, metrics.jsonl and checkpoints/<step> holding THAT model's state
and data-iterator state, unstacked. So a killed group resumes as a group,
or run by run with loop.pretrain, and runs trained alone can continue in a
group; runs resume together only from the same step (`resume_step` lets a
caller group them). Validation runs model by model (loop.evaluate: the same
numbers as alone; it is a small part of the work). Logged per model:
its metrics, its own tokens_per_sec, `models_in_program`, and `mfu` of the
whole program (the device's utilisation, all N models' FLOPs).
Not here (refused): a mesh, context stages, a DataSource, init states,
sampling after training.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from m2jax import params as params_lib
from m2jax.config import ConfigError, ModelConfig, config_to_dict
from m2jax.data import DataConfig, check_splits, make_iterator, make_tokenizer
from m2jax.errors import ExistingPathError
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import interrupt
from m2jax.train import loop
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import MetricsWriter, peak_flops

# Fields that may differ between the models of one program (module doc).
TRAIN_VARYING = ("seed", "learning_rate")
DATA_VARYING = ("seed",)
# Optimizers whose update is linear in the peak learning rate.
LINEAR_IN_LR = ("adamw", "muon")


@dataclasses.dataclass(frozen=True)
class Run:
  """One model of a group: its configs and its pretrain workdir."""
  model: ModelConfig
  train: TrainConfig
  data: DataConfig
  workdir: str


def _first_difference(a, b, skip=()) -> str | None:
  for f in dataclasses.fields(a):
    if f.name not in skip and getattr(a, f.name) != getattr(b, f.name):
      return f.name
  return None


def check_batchable(runs: list[Run]) -> None:
  """ConfigError (one line, naming the field and the runs) unless `runs`
  can train as one program."""
  if not runs:
    raise ConfigError("pretrain_many: no runs")
  first = runs[0]
  for i, run in enumerate(runs[1:], start=1):
    for what, a, b, skip in (
        ("ModelConfig", first.model, run.model, ()),
        ("TrainConfig", first.train, run.train, TRAIN_VARYING),
        ("DataConfig", first.data, run.data, DATA_VARYING)):
      field = _first_difference(a, b, skip)
      if field is not None:
        raise ConfigError(
            f"{what}.{field}: runs 0 and {i} differ ({getattr(a, field)!r} "
            f"vs {getattr(b, field)!r}), which changes the program; only "
            f"TrainConfig {TRAIN_VARYING} and DataConfig {DATA_VARYING} may "
            "differ between models trained in one program")
  rates = {run.train.learning_rate for run in runs}
  tcfg = first.train
  if len(rates) > 1 and (tcfg.optimizer not in LINEAR_IN_LR
                         or tcfg.matrix_learning_rate is not None):
    raise ConfigError(
        f"TrainConfig.learning_rate: runs differ ({sorted(rates)}), which one "
        f"program trains exactly only with optimizer in {LINEAR_IN_LR} and "
        f"matrix_learning_rate None (got {tcfg.optimizer!r}, "
        f"{tcfg.matrix_learning_rate!r})")
  workdirs = [os.path.abspath(run.workdir) for run in runs]
  if len(set(workdirs)) != len(workdirs):
    raise ConfigError("pretrain_many: two runs share a workdir")


def batchable(a: Run, b: Run) -> bool:
  """Whether runs `a` and `b` can train in one program."""
  try:
    check_batchable([a, b])
  except ConfigError:
    return False
  return True


def resume_step(workdir: str) -> int:
  """The step a resume of `workdir` would start from, judged by the newest
  saved checkpoint (0: none). For grouping runs; pretrain_many checks the
  restored steps again."""
  directory = os.path.join(workdir, "checkpoints")
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return max((int(n) for n in names if n.isdigit()), default=0)


def group_runs(runs: list[Run]) -> list[list[int]]:
  """Indices of `runs` in groups that can each train as one program: in
  order of first member, each run with the first group it is batchable with
  and whose runs resume from the same step."""
  groups: list[list[int]] = []
  starts = [resume_step(run.workdir) for run in runs]
  for i, run in enumerate(runs):
    for group in groups:
      if starts[group[0]] == starts[i] and batchable(runs[group[0]], run):
        group.append(i)
        break
    else:
      groups.append([i])
  return groups


def stack(trees):
  """Trees of equal structure -> one tree with a leading model axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, i: int):
  """Model `i` of a stacked tree."""
  return jax.tree.map(lambda x: x[i], tree)


def multi_train_step(states, batches, update_scale=None, *,
                     model_config: ModelConfig, train_config: TrainConfig):
  """step.train_step of N models at once: stacked states and batches
  [N, ...] in, stacked states and metrics [N] out. `update_scale` [N] (or
  None: all 1) is each model's peak lr over train_config's."""
  one = functools.partial(step_lib.train_step, model_config=model_config,
                          train_config=train_config)
  if update_scale is None:
    return jax.vmap(one)(states, batches)
  return jax.vmap(lambda s, b, u: one(s, b, update_scale=u))(
      states, batches, update_scale)


@functools.lru_cache(maxsize=8)
def jit_multi_step(model_config: ModelConfig, train_config: TrainConfig):
  """multi_train_step jitted (states donated), closed over the configs."""
  return jax.jit(functools.partial(multi_train_step, model_config=model_config,
                                   train_config=train_config),
                 donate_argnums=0)


def shared_train_config(runs: list[Run]) -> tuple[TrainConfig, np.ndarray |
                                                                 None]:
  """(the one TrainConfig the program is traced with, each model's
  update_scale [N] float32 or None when all learning rates are equal)."""
  check_batchable(runs)
  tcfg = runs[0].train.replace(seed=0)
  rates = np.array([run.train.learning_rate for run in runs], np.float64)
  if np.all(rates == tcfg.learning_rate):
    return tcfg, None
  return tcfg, (rates / tcfg.learning_rate).astype(np.float32)


class _Member:
  """What the loop keeps per model: tokenizer, writers, iterator, ckpts."""

  def __init__(self, run: Run, resume: bool):
    mcfg, tcfg, dcfg = run.model, run.train, run.data
    tcfg.check_model(mcfg)
    check_splits(dcfg)
    os.makedirs(run.workdir, exist_ok=True)
    self.run = run
    self.tokenizer = make_tokenizer(dcfg, os.path.join(run.workdir,
                                                       "tokenizer"))
    if self.tokenizer.vocab_size > mcfg.vocab_size:
      raise ConfigError(
          f"ModelConfig.vocab_size: {mcfg.vocab_size} is smaller than the "
          f"tokenizer's vocabulary ({self.tokenizer.vocab_size})")
    self.checkpointer = ckpt_lib.Checkpointer(
        os.path.join(run.workdir, "checkpoints"), keep=tcfg.keep_checkpoints,
        asynchronous=tcfg.async_checkpoint,
        device_copy=tcfg.checkpoint_device_copy)
    if self.checkpointer.steps() and not resume:
      raise ExistingPathError(
          f"{run.workdir} already holds checkpoints "
          f"{self.checkpointer.steps()}; resume it or choose another workdir")
    self.configs = {"model": mcfg, "data": dcfg}
    if resume:
      self.checkpointer.check_resume(self.configs)
    self.meta = {"model": config_to_dict(mcfg), "train": config_to_dict(tcfg),
                 "data": config_to_dict(dcfg)}
    self.writer = None
    self.iterator = None

  def restore(self, fresh_state):
    """(start step, state, data state) from the newest checkpoint, or
    (0, fresh_state, None)."""
    restored = self.checkpointer.restore_latest(
        ckpt_lib.abstract(fresh_state), configs=self.configs,
        train_config=self.run.train)
    if restored is None:
      return 0, fresh_state, None
    step, state, data_state, _ = restored
    return step, state, data_state

  def close(self):
    if self.writer is not None:
      self.writer.close()
    if self.iterator is not None:
      self.iterator.close()
    self.checkpointer.close()


def pretrain_many(runs: list[Run], *, resume: bool = True,
                  progress: bool = True) -> list[dict]:
  """Train `runs` as one program (module docstring); returns per run a
  summary as loop.pretrain's: {step, val_loss, val_bpb, state,
  train_next_token_loss, ...}.

  SIGINT or SIGTERM finishes the step in flight, checkpoints every model at
  it and raises interrupt.TrainingInterrupted; resuming continues there.
  """
  tcfg, update_scale = shared_train_config(runs)
  mcfg, dcfg = runs[0].model, runs[0].data
  if jax.process_count() > 1:
    raise ConfigError("pretrain_many runs in one process (no multi-host)")
  if tcfg.context_schedule:
    raise ConfigError("TrainConfig.context_schedule: pretrain_many trains "
                      "one context stage; train staged runs with pretrain")
  if dcfg.context_documents is not None:
    raise ConfigError(f"DataConfig.context_documents: "
                      f"{dcfg.context_documents!r} is for context stages")
  if dcfg.seq_len > mcfg.max_position_embeddings:
    raise ConfigError(
        f"ModelConfig.max_position_embeddings: {mcfg.max_position_embeddings}"
        f" is below the training seq_len {dcfg.seq_len}")
  members = []
  try:
    for run in runs:
      members.append(_Member(run, resume))
    return _train(members, mcfg, tcfg, dcfg, update_scale, progress)
  finally:
    for m in members:
      m.close()


def _train(members, mcfg, tcfg, dcfg, update_scale, progress):
  n = len(members)
  starts, states = [], []
  for m in members:
    fresh = state_lib.create_state(mcfg, m.run.train)
    start, state, data_state = m.restore(fresh)
    starts.append(start)
    states.append(state)
    m.iterator = make_iterator(
        m.run.data, m.tokenizer, "train",
        state=None if data_state is None else data_state["iterator"])
  if len(set(starts)) > 1:
    raise ConfigError(
        f"pretrain_many: the runs resume from different steps "
        f"{dict(zip((m.run.workdir for m in members), starts))}; train them "
        "apart (loop.pretrain) or group them by multi.resume_step")
  start = starts[0]
  if start:
    print(f"resumed {n} models from step {start}")
  for m in members:
    ckpt_lib.write_json(os.path.join(m.run.workdir, "config.json"),
                        dict(m.meta, settings=mcfg.settings.to_dict()))
    m.writer = MetricsWriter(m.run.workdir,
                             resume_step=start if start else None)
  stacked = jax.device_put(stack(states), jax.devices()[0])
  del states
  train_fn = jit_multi_step(mcfg, tcfg)
  _, eval_fn = step_lib.jit_steps(mcfg, tcfg)
  scale = None if update_scale is None else jnp.asarray(update_scale)
  summaries = [{} for _ in members]
  flops_per_token = params_lib.flops_per_token(mcfg, dcfg.seq_len,
                                               mtp_depth=tcfg.mtp_depth)
  peak = peak_flops()
  total_terms = loop.loss_terms(mcfg, tcfg)
  tokens_per_step = dcfg.batch_size * dcfg.seq_len  # per model

  def eval_and_log(step):
    for i, m in enumerate(members):
      ev = loop.evaluate(eval_fn, unstack(stacked, i), m.run.data,
                         m.tokenizer, tcfg.eval_batches)
      m.writer.write(step, ev)
      summaries[i].update(ev)

  def save(step):
    for i, m in enumerate(members):
      m.checkpointer.save(step, unstack(stacked, i),
                          {"stage": 0, "iterator": m.iterator.get_state()},
                          m.meta)

  bar = tqdm(total=tcfg.steps, initial=start, disable=not progress,
             desc=f"pretrain x{n}", unit="step", dynamic_ncols=True)
  done, stopping = start, False
  try:
    with interrupt.StopOnSignal() as stop:
      if start == 0:
        eval_and_log(0)
      elif start == tcfg.steps:  # finished before: its summary, no new line
        for i, m in enumerate(members):
          summaries[i].update(loop.evaluate(eval_fn, unstack(stacked, i),
                                            m.run.data, m.tokenizer,
                                            tcfg.eval_batches))
      tick, tick_steps = time.perf_counter(), 0
      for step in range(start, tcfg.steps):
        # Stacked on the host: one transfer per array when the step runs.
        batches = jax.tree.map(lambda *xs: np.stack(xs),
                               *(next(m.iterator) for m in members))
        stacked, metrics = train_fn(stacked, batches, scale)
        tick_steps += 1
        done = step + 1
        if done % tcfg.log_every == 0 or done == tcfg.steps:
          metrics = jax.device_get(metrics)
          elapsed = max(time.perf_counter() - tick, 1e-9)
          tps = tick_steps * tokens_per_step / elapsed
          for i, m in enumerate(members):
            line = {k: float(v[i]) for k, v in metrics.items()}
            line.update(tokens_per_sec=tps, seq_len=dcfg.seq_len,
                        models_in_program=n)
            if peak:
              line["mfu"] = params_lib.mfu(n * tps, flops_per_token, peak)
            m.writer.write(done, line)
            summaries[i].update(
                train_next_token_loss=line["ce"],
                train_total_loss=line["loss"],
                train_total_loss_terms=total_terms, metrics=line)
          bar.set_postfix_str(
              f"next-token loss {np.mean(metrics['ce']):.3f} (mean of {n}), "
              f"{n * tps:,.0f} tok/s")
          tick, tick_steps = time.perf_counter(), 0
        if done % tcfg.eval_every == 0 or done == tcfg.steps:
          eval_and_log(done)
        stopping = stop.requested()
        if done % tcfg.checkpoint_every == 0 or done == tcfg.steps or stopping:
          save(done)
        bar.update(1)
        if stopping:
          break
      for m in members:  # the saves in flight, before a signal can end us
        m.checkpointer.wait()
  finally:
    bar.close()
  if stopping or stop.signum is not None:
    raise interrupt.TrainingInterrupted(
        stop.signum, done, ", ".join(m.checkpointer.directory
                                     for m in members))
  for i, summary in enumerate(summaries):
    summary["step"] = done
    summary["state"] = unstack(stacked, i)
  return summaries
