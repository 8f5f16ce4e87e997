"""A grid of training runs compared in one JSON (experiments/
bench_optimizers.py, experiments/bench_router.py): the runs' shared train
config, resuming from the JSON of an earlier call, and the loop that writes
the JSON after every run so a call cut short by a time limit keeps what
finished.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterable

import jax

from benchmarks import timing
from m2jax.data import DataConfig, check_splits, make_tokenizer
from m2jax.errors import UserError
from m2jax.train.checkpoint import write_json
from m2jax.train.config import TrainConfig


def train_config(mcfg, *, steps: int, seed: int, optimizer: str, lr: float,
                 adam_lr: float, warmup_steps: int | None) -> TrainConfig:
  """A run's TrainConfig: `lr` is the peak learning rate of everything
  under AdamW, of the hidden matrices under the other optimizers (whose
  AdamW kinds get `adam_lr`); warm-up steps // 20 (at least 1) unless
  given; one MTP module trained if the model has one."""
  return TrainConfig(
      steps=steps, seed=seed, optimizer=optimizer,
      learning_rate=lr if optimizer == "adamw" else adam_lr,
      matrix_learning_rate=None if optimizer == "adamw" else lr,
      warmup_steps=(max(1, steps // 20) if warmup_steps is None
                    else warmup_steps),
      mtp_depth=min(1, mcfg.num_mtp_modules))


def data(source: str, seq_len: int, batch: int) -> tuple[DataConfig, object]:
  """The runs' DataConfig (its splits checked) and tokenizer."""
  dcfg = DataConfig(source=source, seq_len=seq_len, batch_size=batch)
  check_splits(dcfg)
  return dcfg, make_tokenizer(dcfg)


def previous(path: str, result: dict, same: Iterable[str]) -> dict | None:
  """The JSON at `path` (None if there is none), refused with a UserError
  unless it holds the same comparison: `result`'s values of `same`."""
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    old = json.load(f)
  if any(old.get(k) != result[k] for k in same):
    raise UserError(f"--resume: {path} holds another comparison "
                    f"({', '.join(f'{k}={old.get(k)}' for k in same)})")
  return old


def run_all(plan: Iterable[dict], run: Callable[[dict], dict], result: dict,
            *, out: str, summarize: Callable[[list], dict], start: float,
            max_seconds: float) -> None:
  """run(item) for each item of `plan` (the keys that name a run, e.g.
  {"optimizer", "seed"}), in order, each row appended to result["runs"]
  and result["summary"] = summarize(runs), the JSON at `out` rewritten
  after each. A run out of device memory becomes an error row; any other
  error is raised. No run starts once `max_seconds` have passed since
  `start` (a time.perf_counter value)."""
  for item in plan:
    elapsed = time.perf_counter() - start
    if elapsed > max_seconds:
      name = " ".join(f"{k} {v}" for k, v in item.items())
      print(f"--max_seconds={max_seconds:g} reached after {elapsed:.0f} s: "
            f"{name} and later not run")
      break
    try:
      row = run(item)
    except jax.errors.JaxRuntimeError as e:
      if not timing.out_of_memory(e):  # anything else is a bug to see
        raise
      row = {**item,
             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    result["runs"].append(row)
    result["summary"] = summarize(result["runs"])
    write_json(out, result)
    print(json.dumps({k: v for k, v in row.items() if k != "curves"}),
          flush=True)
  result["summary"] = summarize(result["runs"])
  write_json(out, result)
