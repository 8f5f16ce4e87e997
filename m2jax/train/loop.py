"""The pretraining loop: data -> jitted steps -> logs, evals, checkpoints.

`pretrain(...)` is what experiments/pretrain.py and `make demo` run. A run
lives in WORKDIR:
  config.json        the model, train and data configs
  tokenizer/         the tokenizer (trained BPE or the byte tokenizer)
  checkpoints/<n>/   orbax: train state, data-iterator state, meta
  metrics.jsonl      one object per logged step; eval lines with val_loss
  tensorboard/       the same scalars for TensorBoard
  sample.txt         a greedy sample from the final model
Resuming restores the newest complete checkpoint (state and data position)
and continues exactly: losses and parameters equal an uninterrupted run,
and metrics.jsonl holds each step once. SIGINT (Ctrl-C) or SIGTERM stops
the run after the step in flight, with a checkpoint of that step
(m2jax.train.interrupt); experiments.pretrain --resume reads WORKDIR's
configs (m2jax.train.resume).

The data is a DataConfig (pretraining's grain pipelines, context stages
included) or a DataSource (m2jax/data/source.py) that brings its own
batches, e.g. supervised fine-tuning's chat data (m2jax.train.sft): one
stage, its batches' `loss_mask` choosing the targets that count.

With `mesh` (m2jax.sharding) the state lives sharded, batches are split over
data x fsdp x expert and the MoE runs expert-parallel; checkpoints are saved
and restored sharded (onto whatever mesh the resuming run uses). In a
multi-host run every process runs this loop on its own rows of the same
global batches (m2jax.sharding.process_rows); process 0 alone writes
config.json, the tokenizer, metrics and the sample; every process writes
its shards of each checkpoint.
"""

from __future__ import annotations

import math
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from m2jax import params as params_lib
from m2jax import sharding
from m2jax.config import ConfigError, ModelConfig, config_to_dict
from m2jax.data import (DataConfig, check_splits, make_dataset, make_iterator,
                        make_tokenizer, next_stage_start)
from m2jax.data.source import DataSource
from m2jax.errors import ExistingPathError
from m2jax.infer import sample
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import interrupt
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import MetricsWriter, peak_flops


def _validation_batches(data: DataConfig | DataSource, tokenizer, rows):
  if isinstance(data, DataConfig):
    return make_dataset(data, tokenizer, "validation", rows=rows)
  return data.validation_batches(rows=rows)


def evaluate(eval_fn, state, data_config: DataConfig | DataSource, tokenizer,
             max_batches: int, mesh=None) -> dict:
  """Validation loss in nats per token and bits per byte."""
  nats = tokens = nbytes = 0.0
  for i, batch in enumerate(_validation_batches(data_config, tokenizer,
                                                _rows(mesh, data_config))):
    if i >= max_batches:
      break
    out = eval_fn(state, _device_batch(batch, mesh, data_config.batch_size))
    nats += float(out["nats"])
    tokens += float(out["tokens"])
    nbytes += float(out["bytes"])
  return {"val_loss": nats / max(tokens, 1.0),
          "val_bpb": nats / math.log(2) / max(nbytes, 1.0)}


def _stages(mcfg: ModelConfig, tcfg: TrainConfig,
            dcfg: DataConfig | DataSource):
  """[(first step, DataConfig)] per context stage, tokens per batch fixed
  (a DataSource: [(0, the source)])."""
  if isinstance(dcfg, DataSource):
    if tcfg.context_schedule:
      raise ConfigError(
          "TrainConfig.context_schedule: context stages re-pack pretraining's"
          f" document stream; a {type(dcfg).__name__} has one stage")
    stages = [(0, dcfg)]
  elif not tcfg.context_schedule:
    if dcfg.context_documents is not None:
      raise ConfigError(
          f"DataConfig.context_documents: {dcfg.context_documents!r} is for "
          "the stages of TrainConfig.context_schedule, which is empty")
    stages = [(0, dcfg)]
  else:
    stages = [(first, dcfg.context_stage(i, n))
              for i, (first, n) in enumerate(tcfg.context_stages())]
  for _, cfg in stages:
    if cfg.seq_len > mcfg.max_position_embeddings:
      raise ConfigError(
          f"ModelConfig.max_position_embeddings: {mcfg.max_position_embeddings}"
          f" is below the training seq_len {cfg.seq_len}")
  return stages


def _stage_at(stages, step: int) -> int:
  return max(i for i, (first, _) in enumerate(stages) if first <= step)


def _stage_iterator(stages, stage: int, tokenizer, data_state, mesh=None):
  """The train iterator of `stage` (this process's rows of its batches).

  `data_state` ({"stage", "iterator"}: a checkpoint's, or the stage before's
  at its end, or None) resumes it when it is this stage's; otherwise the stage
  continues the stream where stage data_state["stage"] stopped.
  """
  config = stages[stage][1]
  rows = _rows(mesh, config)
  if isinstance(config, DataSource):
    return config.train_iterator(
        None if data_state is None else data_state["iterator"], rows=rows)
  if data_state is None:
    return make_iterator(config, tokenizer, "train", rows=rows)
  if data_state["stage"] == stage:
    return make_iterator(config, tokenizer, "train",
                         state=data_state["iterator"], rows=rows)
  start = next_stage_start(stages[data_state["stage"]][1],
                           data_state["iterator"], config)
  return make_iterator(config, tokenizer, "train", start_document=start,
                       rows=rows)


def _rows(mesh, config: DataConfig | DataSource):
  """The rows of each global batch this process reads (None: all)."""
  return None if mesh is None else sharding.process_rows(mesh,
                                                          config.batch_size)


def _device_batch(batch, mesh=None, batch_size=None):
  """A batch of `_rows(mesh, ...)` of global batches of `batch_size` rows."""
  if mesh is not None:
    return sharding.shard_batch(batch, mesh, batch_size)
  return {k: np.asarray(v) for k, v in batch.items()}


def _place_state(state, mcfg: ModelConfig, tcfg: TrainConfig, mesh=None):
  """(`state` on device, its step) after checking it fits the configs."""
  want = jax.eval_shape(lambda: state_lib.create_state(mcfg, tcfg))
  if jax.tree.structure(state) != jax.tree.structure(want) or any(
      np.shape(x) != w.shape
      for x, w in zip(jax.tree.leaves(state), jax.tree.leaves(want))):
    raise ValueError("init_state does not have the layout of a train state "
                     "for this model and train config")
  step = int(np.asarray(state.step))
  if mesh is None:  # committed, as create_state's and a restored state are
    return jax.device_put(state, jax.devices()[0]), step
  return sharding.place(state,
                        state_lib.state_shardings(mcfg, tcfg, mesh)), step


def loss_terms(mcfg: ModelConfig, tcfg: TrainConfig) -> str:
  """What the total training loss ("loss" in metrics.jsonl) adds up, e.g.
  "next-token+MTP"; the next-token loss alone is "ce" (m2jax.train.losses)."""
  aux = mcfg.aux_loss_coef if tcfg.aux_loss_coef is None else tcfg.aux_loss_coef
  terms = [name for name, on in (("next-token", not tcfg.mtp_only),
                                 ("MTP", tcfg.mtp_depth > 0),
                                 ("balance", aux > 0),
                                 ("z-loss", tcfg.z_loss_coef > 0)) if on]
  return "+".join(terms)


def _postfix(metrics, total_terms: str, tokens_per_sec: float) -> str:
  """The progress bar's loss, labelled: the next-token loss, and the total
  trained on when it holds more terms."""
  text = f"next-token loss {float(metrics['ce']):.3f}"
  if total_terms != "next-token":
    text += f", total ({total_terms}) {float(metrics['loss']):.3f}"
  return f"{text}, {tokens_per_sec:,.0f} tok/s"


class _NoWriter:
  """What processes other than 0 log to."""

  def write(self, step, scalars):
    del step, scalars

  def close(self):
    pass


def pretrain(model_config: ModelConfig, train_config: TrainConfig,
             data_config: DataConfig | DataSource, workdir: str, *,
             resume: bool = False,
             sample_prompt: str = "def ", sample_tokens: int = 64,
             stop_after: int | None = None, progress: bool = True,
             init_variables=None, init_state=None, should_stop=None,
             mesh=None) -> dict:
  """Train; returns a summary {step, loss, val_loss, val_bpb, sample, ...}.

  `stop_after` ends the loop early at that step (with a checkpoint);
  `init_variables` starts from given variables instead of a fresh init (MTP
  growth); their buffers are donated to the first step. `init_state` (a
  state_lib.TrainState for these configs, donated as well) starts from a
  whole state instead, at its step, with its optimizer moments: one
  schedule continued over several calls (MTP growth's phases).
  `should_stop(step, metrics)` is asked at every logged step; True saves a
  checkpoint and ends the run there (e.g. once a loss has settled).
  `mesh` shards the run (m2jax.sharding.make_mesh); how its steps run
  (kernels, the expert exchange) is `model_config.settings`.
  `data_config` may be a DataSource: its batches, tokenizer (saved with the
  run) and config (saved and checked as the run's data config) are used.

  SIGINT or SIGTERM during the loop finishes the step in flight, saves its
  checkpoint, closes the writers and raises interrupt.TrainingInterrupted
  (a KeyboardInterrupt); resuming continues from that step.
  """
  mcfg, tcfg, dcfg = model_config, train_config, data_config
  primary = jax.process_index() == 0
  # Mistakes fail here, before any work: a model without the MTP modules
  # asked for, a wrong data path, a split without documents.
  tcfg.check_model(mcfg)
  if isinstance(dcfg, DataSource):
    tokenizer, saved_data = dcfg.tokenizer, dcfg.config
  else:
    check_splits(dcfg)
    tokenizer, saved_data = None, dcfg
  os.makedirs(workdir, exist_ok=True)
  if tokenizer is None:  # process 0 builds and saves it, the others load it
    tokenizer = sharding.primary_first(
        lambda: make_tokenizer(dcfg, os.path.join(workdir, "tokenizer")))
  elif primary:
    tokenizer.save(os.path.join(workdir, "tokenizer"))
  if tokenizer.vocab_size > mcfg.vocab_size:
    raise ConfigError(
        f"ModelConfig.vocab_size: {mcfg.vocab_size} is smaller than the "
        f"tokenizer's vocabulary ({tokenizer.vocab_size})")

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=tcfg.keep_checkpoints,
                                       asynchronous=tcfg.async_checkpoint,
                                       device_copy=tcfg.checkpoint_device_copy)
  if checkpointer.steps() and not resume:
    raise ExistingPathError(
        f"{workdir} already holds checkpoints {checkpointer.steps()}; pass "
        "--resume to continue it or choose another --workdir")
  # Before any work: a checkpoint of another config is the user's mistake.
  configs = {"model": mcfg, "data": saved_data}
  if resume:
    checkpointer.check_resume(configs)

  stages = _stages(mcfg, tcfg, dcfg)
  if mesh is not None:
    for _, cfg in stages:
      sharding.check_mesh(mcfg, mesh, cfg.batch_size, cfg.seq_len)
  if init_state is None:
    state = state_lib.create_state(mcfg, tcfg, init_variables, mesh=mesh)
    start = 0
  else:
    if init_variables is not None:
      raise ValueError("pass init_variables or init_state, not both")
    state, start = _place_state(init_state, mcfg, tcfg, mesh)
  data_state = None
  if resume:
    restored = checkpointer.restore_latest(
        ckpt_lib.abstract(state), configs=configs, train_config=tcfg)
    if restored is not None:  # None: nothing saved yet, start at step 0
      start, state, data_state, _ = restored
      print(f"resumed from step {start} in {checkpointer.directory}")
  meta = {"model": config_to_dict(mcfg), "train": config_to_dict(tcfg),
          "data": config_to_dict(saved_data)}
  if primary:
    ckpt_lib.write_json(os.path.join(workdir, "config.json"),
                        dict(meta, settings=mcfg.settings.to_dict()))

  stage = _stage_at(stages, start)
  sdcfg = stages[stage][1]
  train_it = _stage_iterator(stages, stage, tokenizer, data_state, mesh)
  train_fn, eval_fn = step_lib.jit_steps(mcfg, tcfg, mesh=mesh)
  # A resume that found no checkpoint starts over: its metrics too (the
  # step-0 eval line would otherwise be written twice).
  resumed = resume and start > 0
  writer = (MetricsWriter(workdir, resume_step=start if resumed else None)
            if primary else _NoWriter())
  summary = {}
  bar = tqdm(total=tcfg.steps, initial=start, disable=not (progress and primary),
             desc="pretrain", unit="step", dynamic_ncols=True)
  total_terms = loss_terms(mcfg, tcfg)
  flops_per_token = params_lib.flops_per_token(mcfg, sdcfg.seq_len,
                                               mtp_depth=tcfg.mtp_depth)
  peak = peak_flops()
  end = tcfg.steps if stop_after is None else min(stop_after, tcfg.steps)

  def eval_and_log(step):
    ev = evaluate(eval_fn, state, sdcfg, tokenizer, tcfg.eval_batches, mesh)
    writer.write(step, ev)
    summary.update(ev)
    bar.write(f"step {step}: validation next-token loss {ev['val_loss']:.4f} "
              f"nats/token, {ev['val_bpb']:.4f} bits/byte")

  # From here a signal only asks to stop after the step in flight (see
  # m2jax.train.interrupt): the checkpoint of that step is written first.
  # The writer and the bar close on every way out: an unclosed tensorboardX
  # writer prints a thread traceback at exit under the real error, an
  # unclosed bar leaves the error on the bar's line. So does the
  # checkpointer: a save still being written in the background is
  # completed (inside StopOnSignal on the ordinary ways out, so that a
  # signal cannot cut it short).
  done, stopping = start, False
  try:
    with interrupt.StopOnSignal() as stop:
      if start == 0 and end > 0:
        eval_and_log(0)  # where training starts from (about ln V untrained)
      tick, tick_tokens = time.perf_counter(), 0
      for step in range(start, end):
        if _stage_at(stages, step) != stage:
          ended = {"stage": stage, "iterator": train_it.get_state()}
          train_it.close()
          stage = _stage_at(stages, step)
          sdcfg = stages[stage][1]
          train_it = _stage_iterator(stages, stage, tokenizer, ended, mesh)
          flops_per_token = params_lib.flops_per_token(
              mcfg, sdcfg.seq_len, mtp_depth=tcfg.mtp_depth)
          bar.write(f"step {step}: context stage {stage}, seq_len "
                    f"{sdcfg.seq_len}, batch {sdcfg.batch_size}")
        batch = next(train_it)
        state, metrics = train_fn(state, _device_batch(batch, mesh,
                                                       sdcfg.batch_size))
        tick_tokens += sdcfg.batch_size * sdcfg.seq_len
        done = step + 1
        if done % tcfg.log_every == 0 or done == end:
          metrics = jax.device_get(metrics)
          elapsed = time.perf_counter() - tick
          tps = tick_tokens / max(elapsed, 1e-9)
          metrics["tokens_per_sec"] = tps
          metrics["seq_len"] = sdcfg.seq_len
          if peak:
            metrics["mfu"] = params_lib.mfu(tps, flops_per_token, peak,
                                            jax.device_count())
          writer.write(done, metrics)
          summary["train_next_token_loss"] = float(metrics["ce"])
          summary["train_total_loss"] = float(metrics["loss"])
          summary["train_total_loss_terms"] = total_terms
          summary["metrics"] = {k: float(v) for k, v in metrics.items()}
          if should_stop is not None and should_stop(done, metrics):
            end = done
          bar.set_postfix_str(_postfix(metrics, total_terms, tps))
          tick, tick_tokens = time.perf_counter(), 0
        if done % tcfg.eval_every == 0 or done == tcfg.steps:
          eval_and_log(done)
        stopping = stop.requested()
        if (done % tcfg.checkpoint_every == 0 or done in (tcfg.steps, end)
            or stopping):
          checkpointer.save(done, state, {"stage": stage,
                                          "iterator": train_it.get_state()},
                            meta)
        bar.update(1)
        if done >= end or stopping:
          break
      checkpointer.close()
  finally:
    bar.close()
    writer.close()
    checkpointer.close()  # an error's way out: no-op when already closed
  # A signal after the last check came while the run's end was saved; other
  # processes may not know of it, so only a single process stops for it.
  if stopping or (stop.signum is not None and jax.process_count() == 1):
    raise interrupt.TrainingInterrupted(
        stop.signum, done, os.path.join(checkpointer.directory, str(done)))


  if "val_loss" not in summary and int(state.step) == tcfg.steps:
    # Resumed when already finished (killed after its last checkpoint,
    # before the caller read its summary): the final validation again, for
    # the summary only (metrics.jsonl has it).
    summary.update(evaluate(eval_fn, state, sdcfg, tokenizer,
                            tcfg.eval_batches, mesh))
  summary["step"] = int(state.step)
  summary["state"] = state
  if int(state.step) == tcfg.steps and sample_tokens:
    prompt = np.concatenate([[tokenizer.bos_id],
                             tokenizer.encode(sample_prompt)])
    ids = sample.greedy(mcfg, state_lib.variables_of(state), prompt,
                        sample_tokens)
    text = tokenizer.decode(np.asarray(ids))
    if primary:
      with open(os.path.join(workdir, "sample.txt"), "w",
                encoding="utf-8") as f:
        f.write(text)
    summary["sample"] = text
  return summary
