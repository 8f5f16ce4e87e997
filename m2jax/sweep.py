"""Ablation sweeps over the paper's design choices, resumable.

A sweep is a named grid of variants of one base model, each trained at the
same number of tokens for several seeds, then scored on validation loss,
the synthetic long-context tasks and routing balance. Grids (SPEC §2):

  attention  full attention vs hybrid sliding-window (3:1 and 1:1 SWA:full
             inter-layer patterns, with and without sink tokens, all-SWA)
  mtp        no MTP vs one module vs three modules
  experts    fine-grained (base E experts, top-k) vs coarse (E/k experts,
             top-1, k-times wider): equal active and equal total parameters
  gating     sigmoid + routing bias (aux-loss-free) vs softmax + aux loss

With `mqar_fraction` > 0 part of the synthetic training documents are MQAR
sequences (m2jax.eval.mqar) at gaps 0..max(mqar_gaps), and every run is also
scored on MQAR at each of `mqar_gaps`: the attention grid's retrieval test
(pairs inside vs beyond the sliding window).

Layout of a sweep directory:
  data/{train,validation}.jsonl   training data (synthetic task documents)
  runs/<variant>/seed<k>/         one pretrain workdir per run
  runs/<variant>/seed<k>/result.json   written when the run is finished
  results.json                    every finished run of the directory, of
                                  whichever invocation (what report.py reads)
With `parallel` the runs that can share a program (the seeds of an arm,
arms that differ only in learning rate) train as one vmapped program
(m2jax.train.multi) into the same run directories and result files.
A rerun skips finished runs and resumes a killed (or Ctrl-C'd) one from its
checkpoint; `--variants` and `--seeds` choose what to run now, never what
the results and the report cover. Invocations with different arms may run
at once on one directory (an arm per GPU): the data is written once per
content, every result file whole.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from m2jax import params as params_lib
from m2jax.config import (ConfigError, ModelConfig, config_from_dict,
                          config_to_dict, without_moved_fields)
from m2jax.data import DataConfig, make_tokenizer
from m2jax.data.tokenizer_files import unique_tmp
from m2jax.errors import MissingPathError
from m2jax.eval import mqar, scoring, tasks as tasks_lib
from m2jax.train import multi
from m2jax.train import state as state_lib
from m2jax.train.checkpoint import write_json
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import read_metrics

GRIDS = ("attention", "mtp", "experts", "gating")
# Filler before an MQAR document's first pair: BOS and these characters
# cover the sinks arm's 4 sink tokens, so no pair is visible to an SWA layer
# through a sink.
MQAR_OFFSET = 8


@dataclasses.dataclass(frozen=True)
class Variant:
  """One arm: ModelConfig and TrainConfig field overrides."""
  name: str
  model: dict = dataclasses.field(default_factory=dict)
  train: dict = dataclasses.field(default_factory=dict)


def make_grid(name: str, base: ModelConfig, *, window: int) -> list[Variant]:
  """The variants of grid `name` for `base` (window: SWA window size)."""
  if name == "attention":
    swa = lambda pattern, sinks=0: {
        "attention_pattern": pattern, "sliding_window": window,
        "num_sink_tokens": sinks}
    s, f = "sliding", "full"
    return [Variant("full", {"attention_pattern": (f,)}),
            Variant(f"swa{window}_3to1", swa((s, s, s, f))),
            Variant(f"swa{window}_3to1_sinks4", swa((s, s, s, f), 4)),
            Variant(f"swa{window}_1to1", swa((s, f))),
            Variant(f"swa{window}_all", swa((s,)))]
  if name == "mtp":
    return [Variant("mtp_off", {"num_mtp_modules": 0}, {"mtp_depth": 0}),
            Variant("mtp_1", {"num_mtp_modules": 1}, {"mtp_depth": 1}),
            Variant("mtp_3", {"num_mtp_modules": 3}, {"mtp_depth": 3})]
  if name == "experts":
    E, k, F = (base.num_experts, base.num_experts_per_tok,
               base.moe_intermediate_size)
    if E % k:
      raise ConfigError(f"experts grid: num_experts={E} must be divisible by "
                        f"num_experts_per_tok={k}")
    return [Variant(f"fine_E{E}_top{k}", {}),
            Variant(f"coarse_E{E // k}_top1",
                    {"num_experts": E // k, "num_experts_per_tok": 1,
                     "moe_intermediate_size": k * F})]
  if name == "gating":
    return [Variant("sigmoid_bias", {"gating": "sigmoid",
                                     "use_routing_bias": True,
                                     "aux_loss_coef": 0.0}),
            Variant("softmax_aux", {"gating": "softmax",
                                    "use_routing_bias": False,
                                    "aux_loss_coef": 0.01})]
  raise ConfigError(f"unknown grid {name!r}; grids: {GRIDS}")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """What a sweep trains and how it scores each run."""
  grid: str
  seeds: tuple[int, ...] = (0, 1)
  steps: int = 200
  seq_len: int = 1024
  batch_size: int = 8
  learning_rate: float = 3e-3
  window: int = 256
  data: str = "synthetic"          # "synthetic", "stdlib" or a path/glob
  train_documents: int = 4000
  drill_fraction: float = 0.0      # training documents that are drills
  variants: tuple[str, ...] = ()   # arms of the grid to run (empty: all)
  eval_lengths: tuple[int, ...] = (128, 256, 512, 960)
  eval_tasks: tuple[str, ...] = tasks_lib.TASKS
  examples_per_point: int = 16
  eval_batches: int = 8
  # Train the runs that can share a program (the seeds of an arm, and arms
  # that differ only in learning rate) as one vmapped program
  # (m2jax.train.multi): the same results, several models per device.
  parallel: bool = False
  # MQAR (m2jax.eval.mqar): this fraction of the synthetic training
  # documents, `mqar_pairs` pairs all queried, gaps drawn from
  # 0..max(mqar_gaps); each run is scored at every gap of `mqar_gaps` on
  # `mqar_examples` held-out sequences.
  mqar_fraction: float = 0.0
  mqar_pairs: int = 8
  mqar_gaps: tuple[int, ...] = ()
  mqar_examples: int = 64
  # Equal training FLOPs instead of equal tokens: each arm trains
  # `arm_steps` steps, `steps` scaled by the grid's first arm's FLOPs per
  # token over its own (params.flops_per_token), so an arm that costs more
  # per token (MTP modules) trains fewer tokens.
  equal_compute: bool = False

  def __post_init__(self):
    if self.grid not in GRIDS:
      raise ConfigError(f"SweepConfig.grid: must be one of {GRIDS} "
                        f"(got {self.grid!r})")
    if not self.seeds:
      raise ConfigError("SweepConfig.seeds: need at least one seed")
    if not 0.0 <= self.drill_fraction < 1.0:
      raise ConfigError(f"SweepConfig.drill_fraction: must be in [0, 1) "
                        f"(got {self.drill_fraction})")
    if min(self.eval_lengths) < tasks_lib.MIN_LENGTH:
      raise ConfigError(f"SweepConfig.eval_lengths: must be >= "
                        f"{tasks_lib.MIN_LENGTH} (got {self.eval_lengths})")
    if max(self.eval_lengths) + 16 > self.seq_len:
      raise ConfigError(
          f"SweepConfig.eval_lengths: {max(self.eval_lengths)} (+ answer) "
          f"exceeds seq_len={self.seq_len}; models are scored only on lengths "
          "they were trained at")
    if not 0.0 <= self.mqar_fraction < 1.0:
      raise ConfigError(f"SweepConfig.mqar_fraction: must be in [0, 1) "
                        f"(got {self.mqar_fraction})")
    if self.mqar_fraction and self.data != "synthetic":
      raise ConfigError(f"SweepConfig.mqar_fraction: MQAR documents join "
                        f"only data='synthetic' (got data={self.data!r})")
    if self.mqar_fraction and not self.mqar_gaps:
      raise ConfigError("SweepConfig.mqar_gaps: name the gaps to score "
                        "(training draws gaps up to the largest)")
    try:
      fmt = mqar_config(self)
    except ConfigError as e:
      raise ConfigError(f"SweepConfig.mqar_pairs: {e}") from None
    if self.mqar_gaps and min(self.mqar_gaps) < 0:
      raise ConfigError(f"SweepConfig.mqar_gaps: must be >= 0 (got "
                        f"{self.mqar_gaps})")
    if self.mqar_gaps:
      longest = fmt.replace(
          gap=max(self.mqar_gaps)).content_length + 2  # + BOS, EOS
      if longest > self.seq_len:
        raise ConfigError(
            f"SweepConfig.mqar_gaps: an MQAR sequence at gap "
            f"{max(self.mqar_gaps)} is {longest} tokens, longer than "
            f"seq_len={self.seq_len} (its queries would lose their pairs)")


def mqar_config(cfg: SweepConfig) -> mqar.MQARConfig:
  """The sweep's MQAR format (the gap is set per document)."""
  return mqar.MQARConfig(pairs=cfg.mqar_pairs, offset=MQAR_OFFSET)


def score_mqar(mcfg: ModelConfig, variables, tokenizer,
               cfg: SweepConfig) -> dict[str, float]:
  """{gap: accuracy on the queried values} at each of `cfg.mqar_gaps`."""
  base = mqar_config(cfg)
  return {str(gap): mqar.accuracy(
      mcfg, variables, tokenizer,
      mqar.eval_examples(base.replace(gap=gap), cfg.mqar_examples))
          for gap in cfg.mqar_gaps}


def _synthetic_data(sweep_dir: str, cfg: SweepConfig) -> tuple[str, str]:
  """Training/validation JSONL of task documents (made once per sweep)."""
  data_dir = os.path.join(sweep_dir, "data")
  paths = [os.path.join(data_dir, f"{s}.jsonl")
           for s in ("train", "validation")]
  if all(os.path.exists(p) for p in paths):
    return tuple(paths)
  os.makedirs(data_dir, exist_ok=True)
  # Documents up to the row length (minus room for the answer), so that
  # every length scored later was seen in training.
  top = max(tasks_lib.MIN_LENGTH, cfg.seq_len - 32)
  lengths = sorted(set(np.linspace(tasks_lib.MIN_LENGTH, top, 8).astype(int)))
  # Validation holds only the evaluated formats (no drills).
  # MQAR documents follow the task documents (the pipeline shuffles);
  # validation, like the drills, holds none.
  n_mqar = round(cfg.train_documents * cfg.mqar_fraction)
  for path, n, seed, drills, n_mqar in (
      (paths[0], cfg.train_documents - n_mqar, 0, cfg.drill_fraction, n_mqar),
      (paths[1], max(64, cfg.train_documents // 20), 1, 0.0, 0)):
    # Invocations sharing the directory (arms on separate GPUs) may write
    # at once: each its own temporary file; the content is the same.
    tmp = unique_tmp(path)
    docs = tasks_lib.training_documents(n, lengths, seed=seed + 1,
                                        tasks=cfg.eval_tasks,
                                        drill_fraction=drills)
    if n_mqar:
      docs += mqar.training_documents(
          n_mqar, mqar_config(cfg), range(max(cfg.mqar_gaps) + 1), seed=seed)
    with open(tmp, "w", encoding="utf-8") as f:
      for doc in docs:
        f.write(json.dumps({"text": doc}) + "\n")
    os.replace(tmp, path)
  return tuple(paths)


def _data_config(sweep_dir: str, cfg: SweepConfig, seed: int) -> DataConfig:
  if cfg.data == "synthetic":
    train, val = _synthetic_data(sweep_dir, cfg)
    return DataConfig(source=train, validation_source=val, seq_len=cfg.seq_len,
                      batch_size=cfg.batch_size, seed=seed)
  return DataConfig(source=cfg.data, seq_len=cfg.seq_len,
                    batch_size=cfg.batch_size, seed=seed)


def _mtp_depth(mcfg: ModelConfig, variant: Variant) -> int:
  """The MTP modules a run of `variant` trains (TrainConfig.mtp_depth)."""
  return variant.train.get("mtp_depth", min(1, mcfg.num_mtp_modules))


def arm_steps(base: ModelConfig, variant: Variant, cfg: SweepConfig) -> int:
  """Training steps of `variant`: `cfg.steps`, or with `equal_compute` the
  steps whose training FLOPs equal `cfg.steps` of the grid's first arm."""
  if not cfg.equal_compute:
    return cfg.steps
  def per_token(v):
    mcfg = base.replace(**v.model)
    return params_lib.flops_per_token(mcfg, cfg.seq_len,
                                      mtp_depth=_mtp_depth(mcfg, v))
  reference = make_grid(cfg.grid, base, window=cfg.window)[0]
  return max(1, round(cfg.steps * per_token(reference) / per_token(variant)))


def _run_configs(base: ModelConfig, variant: Variant, seed: int,
                 cfg: SweepConfig, sweep_dir: str) -> multi.Run:
  """The model, train and data configs and workdir of one (variant, seed)."""
  mcfg = base.replace(**variant.model)
  steps = arm_steps(base, variant, cfg)
  tcfg = TrainConfig(**{"steps": steps, "seed": seed,
                        "learning_rate": cfg.learning_rate,
                        "warmup_steps": max(1, steps // 20),
                        "log_every": max(1, steps // 50),
                        "eval_every": max(1, steps // 4),
                        "eval_batches": cfg.eval_batches,
                        "checkpoint_every": max(1, steps // 4),
                        "keep_checkpoints": 1,
                        "mtp_depth": _mtp_depth(mcfg, variant),
                        **variant.train})
  dcfg = _data_config(sweep_dir, cfg, seed)
  return multi.Run(mcfg, tcfg, dcfg, _run_dir(sweep_dir, variant.name, seed))


def run_one(base: ModelConfig, variant: Variant, seed: int, cfg: SweepConfig,
            sweep_dir: str, *, progress: bool = True) -> dict:
  """Train and score one (variant, seed); reuse its result if finished."""
  finished = _finished_run(sweep_dir, variant.name, seed)
  if finished is not None:
    return finished
  run = _run_configs(base, variant, seed, cfg, sweep_dir)
  summary = pretrain(run.model, run.train, run.data, run.workdir, resume=True,
                     progress=progress, sample_tokens=0)
  return _score_run(run, variant, seed, cfg, summary)


def run_group(base: ModelConfig, members: list[tuple[Variant, int]],
              cfg: SweepConfig, sweep_dir: str, *,
              progress: bool = True) -> list[dict]:
  """Train the unfinished (variant, seed) pairs `members` as one vmapped
  program (m2jax.train.multi: they must differ only in seed or learning
  rate), then score each and write its result.json as run_one does."""
  members = [(v, s) for v, s in members
             if _finished_run(sweep_dir, v.name, s) is None]
  if not members:
    return []
  runs = [_run_configs(base, v, s, cfg, sweep_dir) for v, s in members]
  summaries = multi.pretrain_many(runs, resume=True, progress=progress)
  return [_score_run(run, v, s, cfg, summary)
          for run, (v, s), summary in zip(runs, members, summaries)]


def _score_run(run: multi.Run, variant: Variant, seed: int, cfg: SweepConfig,
               summary: dict) -> dict:
  """Score a trained run and write its result.json (the report's input)."""
  mcfg, dcfg, run_dir = run.model, run.data, run.workdir
  tokenizer = make_tokenizer(dcfg, os.path.join(run_dir, "tokenizer"))
  variables = state_lib.variables_of(summary["state"])
  scores = scoring.evaluate_tasks(
      mcfg, variables, tokenizer, lengths=list(cfg.eval_lengths),
      tasks=cfg.eval_tasks, examples_per_point=cfg.examples_per_point)
  mqar_scores = score_mqar(mcfg, variables, tokenizer, cfg)
  lines = read_metrics(run_dir)
  train_lines = [l for l in lines if "loss" in l]
  tail = train_lines[-max(1, len(train_lines) // 10):]
  mean_of = lambda key: (float(np.mean([l[key] for l in tail]))
                         if key in tail[0] else None)
  result = {
      "variant": variant.name, "seed": seed,
      "model_overrides": {k: list(v) if isinstance(v, tuple) else v
                          for k, v in variant.model.items()},
      "train_overrides": variant.train,
      "steps": run.train.steps,
      "tokens": run.train.steps * cfg.batch_size * cfg.seq_len,
      # Training FLOPs of the run (params.flops_per_token x tokens): equal
      # across arms with `equal_compute`.
      "train_flops": float(run.train.steps * cfg.batch_size * cfg.seq_len
                           * params_lib.flops_per_token(
                               mcfg, cfg.seq_len,
                               mtp_depth=run.train.mtp_depth)),
      "loss_curve": [[l["step"], l["loss"]] for l in train_lines],
      "ce_curve": [[l["step"], l["ce"]] for l in train_lines],
      "val_curve": [[l["step"], l["val_loss"]] for l in lines
                    if "val_loss" in l],
      # Router balance over steps: max / mean expert load - 1 (0: even),
      # the mean over layers of each logged step.
      "balance_curve": [[l["step"], l["router/load_max_over_mean"] - 1.0]
                        for l in train_lines
                        if "router/load_max_over_mean" in l],
      "val_loss": summary["val_loss"], "val_bpb": summary["val_bpb"],
      "tasks": {t: {str(n): a for n, a in s.items()} for t, s in scores.items()},
      # {gap: accuracy} (empty without mqar_gaps); chance 1 / value_vocab.
      "mqar": mqar_scores, "mqar_chance": mqar_config(cfg).chance,
      "routing": {"load_cv": mean_of("router/load_cv"),
                  "load_max_over_mean": mean_of("router/load_max_over_mean")},
  }
  write_json(os.path.join(run_dir, "result.json"), result)
  return result


def run_sweep(base: ModelConfig, cfg: SweepConfig, sweep_dir: str, *,
              progress: bool = True, log=print) -> dict:
  """Run every (variant, seed) of the grid (or of `cfg.variants`); returns
  and writes results.json, which holds every finished run of the sweep
  directory (arms and seeds of earlier invocations included)."""
  variants = make_grid(cfg.grid, base, window=cfg.window)
  if cfg.variants:
    names = [v.name for v in variants]
    unknown = sorted(set(cfg.variants) - set(names))
    if unknown:
      raise ConfigError(f"SweepConfig.variants: {unknown} not in the "
                        f"{cfg.grid} grid {names}")
  os.makedirs(sweep_dir, exist_ok=True)
  _check_same_sweep(sweep_dir, base, cfg)
  planned = [(v, seed) for v in variants
             if not cfg.variants or v.name in cfg.variants
             for seed in cfg.seeds]

  def write_finished():
    # Written after every run: a killed invocation still lists the runs
    # earlier invocations (and other --variants) finished.
    results = collect_results(sweep_dir, base, cfg)
    write_json(os.path.join(sweep_dir, "results.json"), results)
    return results

  write_finished()
  if cfg.parallel:
    _run_groups(base, cfg, sweep_dir, planned, progress=progress, log=log,
                after=write_finished)
    return write_finished()
  for i, (variant, seed) in enumerate(planned, start=1):
    where = (f"[sweep {cfg.grid}] run {i}/{len(planned)}: {variant.name} "
             f"seed {seed}")
    if _finished_run(sweep_dir, variant.name, seed) is not None:
      log(f"{where}: skipped (done)")
      continue
    log(where)
    run_one(base, variant, seed, cfg, sweep_dir, progress=progress)
    write_finished()
  return write_finished()


def _run_groups(base: ModelConfig, cfg: SweepConfig, sweep_dir: str,
                planned: list[tuple[Variant, int]], *, progress: bool, log,
                after):
  """run_sweep's parallel mode: the unfinished runs of `planned` in groups
  that train as one program each (multi.group_runs), `after()` each group."""
  todo = []
  for i, (variant, seed) in enumerate(planned, start=1):
    if _finished_run(sweep_dir, variant.name, seed) is not None:
      log(f"[sweep {cfg.grid}] run {i}/{len(planned)}: {variant.name} seed "
          f"{seed}: skipped (done)")
    else:
      todo.append((variant, seed))
  runs = [_run_configs(base, v, s, cfg, sweep_dir) for v, s in todo]
  groups = multi.group_runs(runs)
  for g, group in enumerate(groups, start=1):
    members = [todo[i] for i in group]
    log(f"[sweep {cfg.grid}] group {g}/{len(groups)}, one program: "
        + ", ".join(f"{v.name} seed {s}" for v, s in members))
    run_group(base, members, cfg, sweep_dir, progress=progress)
    after()


def collect_results(sweep_dir: str, base: ModelConfig,
                    cfg: SweepConfig) -> dict:
  """results.json's content: every finished run in `sweep_dir` of an arm of
  the grid, in grid order and by seed, whichever invocation ran it."""
  runs = []
  for variant in make_grid(cfg.grid, base, window=cfg.window):
    runs += [r for r in (_finished_run(sweep_dir, variant.name, seed)
                         for seed in _seeds_on_disk(sweep_dir, variant.name))
             if r is not None]
  return {"sweep": config_to_dict(cfg), "base": config_to_dict(base),
          "variants": list(dict.fromkeys(r["variant"] for r in runs)),
          "seeds": sorted({r["seed"] for r in runs}), "runs": runs}


def load_results(sweep_dir: str) -> dict:
  """The finished runs of the sweep in `sweep_dir`, read again from its run
  directories (so a report covers every arm, whichever invocation ran it);
  a directory holding only a results.json (e.g. copied without its runs)
  gives that file."""
  saved_path = os.path.join(sweep_dir, "sweep.json")
  results_path = os.path.join(sweep_dir, "results.json")
  if os.path.exists(saved_path):
    with open(saved_path, encoding="utf-8") as f:
      saved = json.load(f)
    results = collect_results(
        sweep_dir, config_from_dict(ModelConfig, saved["base"]),
        config_from_dict(SweepConfig, saved["sweep"]))
  elif os.path.exists(results_path):
    with open(results_path, encoding="utf-8") as f:
      results = json.load(f)
  else:
    raise MissingPathError(f"no sweep in {sweep_dir} (no sweep.json or "
                           "results.json): run experiments.sweep first")
  if not results["runs"]:
    raise MissingPathError(f"the sweep in {sweep_dir} has no finished run "
                           "yet")
  return results


def _run_dir(sweep_dir: str, variant: str, seed: int) -> str:
  return os.path.join(sweep_dir, "runs", variant, f"seed{seed}")


def _seeds_on_disk(sweep_dir: str, variant: str) -> list[int]:
  """The seeds of `variant` with a run directory (finished or not)."""
  variant_dir = os.path.join(sweep_dir, "runs", variant)
  names = os.listdir(variant_dir) if os.path.isdir(variant_dir) else []
  return sorted(int(name[4:]) for name in names
                if name.startswith("seed") and name[4:].isdigit())


def _finished_run(sweep_dir: str, variant: str, seed: int) -> dict | None:
  path = os.path.join(_run_dir(sweep_dir, variant, seed), "result.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# Fields that may differ between invocations on one sweep directory: which
# arms and seeds to run now, and whether in one program. Everything else
# decides what a finished run means.
_SELECTION_FIELDS = ("seeds", "variants", "parallel")


def _comparable(cfg: SweepConfig, base: ModelConfig) -> dict:
  """What sweep.json holds: the sweep's config (less what only selects runs)
  and the base model's."""
  return {"sweep": {k: v for k, v in config_to_dict(cfg).items()
                    if k not in _SELECTION_FIELDS},
          "base": config_to_dict(base)}


def _check_same_sweep(sweep_dir: str, base: ModelConfig, cfg: SweepConfig):
  """Refuse to mix runs (and data) of different sweeps in one directory."""
  path = os.path.join(sweep_dir, "sweep.json")
  now = _comparable(cfg, base)
  if not os.path.exists(path):
    write_json(path, now)
    return
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  # Read back as this code reads saved configs: a field the directory
  # predates takes its default (equal_compute; a newer ModelConfig field),
  # fields that moved to Settings drop out.
  before = _comparable(
      config_from_dict(SweepConfig, saved["sweep"]),
      config_from_dict(ModelConfig, without_moved_fields(
          ModelConfig, saved["base"], warn=False)))
  for part in ("sweep", "base"):
    changed = sorted(k for k in set(now[part]) | set(before[part])
                     if now[part].get(k) != before[part].get(k))
    if changed:
      name = "SweepConfig" if part == "sweep" else "base ModelConfig"
      raise ConfigError(
          f"{sweep_dir} holds a sweep with a different {name}: "
          + ", ".join(f"{k}={before[part].get(k)!r} there, "
                      f"{now[part].get(k)!r} now" for k in changed)
          + "; use another --sweep_dir")
