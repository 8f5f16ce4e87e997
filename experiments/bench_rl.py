r"""Forge RL on one GPU: CISPO against the GRPO and DAPO baselines, and the
merged train step inside the loop.

  python -m experiments.bench_rl --preset=m2_small \
      --out=benchmarks/results/rl_h100.json

Sections:
  algos   one supervised warm start (m2jax.rl.loop.warm_start), then a
          sync RL run per (algorithm, seed) from it, all with the same
          environment, rollout budget (groups x samples per step) and
          steps: per run the reward curve, the first step whose moving
          mean reward (over --smooth steps) reaches --target, the final
          reward (mean of the last --smooth steps) and the greedy reward on
          held-out tasks at the end; per algorithm mean +- std over seeds.
  merge   real rollout batches (the first run's trained batches, read back
          from its data pool) through the trainer's step merged (prefix
          trees) and unmerged (each sample its own chain): seconds per
          step, tokens computed and the FLOPs ratio.

Everything a run writes is under --workdir (one RL run directory each).
"""

import gc
import json
import os
import shutil
import time

from absl import flags, logging
import jax
import numpy as np

from benchmarks import timing
from experiments import cli
from m2jax import params as params_lib
from m2jax.config import get_preset
from m2jax.data import ByteTokenizer
from m2jax.infer.engine import EngineConfig
from m2jax.rl import envs
from m2jax.rl import loop
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.train import sft
from m2jax.train import state as state_lib

_OUT = flags.DEFINE_string("out", "benchmarks/results/rl.json",
                           "JSON results")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_rl", "Run directories.")
_SECTIONS = flags.DEFINE_list("sections", ["algos", "merge"], "What runs.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset.")
_ENV = flags.DEFINE_string("env", "arithmetic", "Environment.")
_LEVELS = flags.DEFINE_list("levels", ["1"], "Environment levels.")
_OPS = flags.DEFINE_list("ops", ["+"], "Arithmetic operations.")
_ALGOS = flags.DEFINE_list("algos", list(rl_step.ALGORITHMS), "Algorithms.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds.")
_STEPS = flags.DEFINE_integer("steps", 100, "RL steps per run.")
_GROUPS = flags.DEFINE_integer("groups_per_step", 32, "Groups per step.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 12, "Action length.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "RL learning rate.")
_WARM = flags.DEFINE_integer("warm_start_steps", 60, "SFT steps.")
_WARM_LR = flags.DEFINE_float("warm_start_learning_rate", 3e-3, "SFT lr.")
_TARGET = flags.DEFINE_float("target", 0.7, "Reward the runs race to.")
_SMOOTH = flags.DEFINE_integer("smooth", 10, "Steps in the moving mean.")
_MERGE_REPS = flags.DEFINE_integer("merge_reps", 5, "Timed steps (merge).")


def _configs():
  mcfg = get_preset(_PRESET.value)
  train = loop.train_config(mcfg, steps=_STEPS.value,
                            learning_rate=_LR.value)
  env_fields = (("levels", tuple(int(x) for x in _LEVELS.value)),)
  if _ENV.value == "arithmetic":
    env_fields += (("ops", tuple(_OPS.value)),)
  rollout = rollout_lib.RolloutConfig(group_size=_GROUP_SIZE.value,
                                      max_new_tokens=_MAX_NEW.value)
  engine = EngineConfig(max_batch=min(256, _GROUPS.value * _GROUP_SIZE.value),
                        num_pages=4096, prefill_chunk=128)
  return mcfg, train, env_fields, rollout, engine


def _run_config(env_fields, seed: int, **kw) -> loop.RLRunConfig:
  fields = dict(env=_ENV.value, env_fields=env_fields, steps=_STEPS.value,
                groups_per_step=_GROUPS.value, warm_start_steps=0,
                eval_tasks=128, eval_every=0, checkpoint_every=0,
                seed=seed)
  return loop.RLRunConfig(**{**fields, **kw})


def _first_reaching(rewards, target: float, smooth: int):
  """1-based step whose trailing mean over `smooth` steps first reaches
  `target`, or None."""
  for i in range(len(rewards)):
    window = rewards[max(0, i + 1 - smooth):i + 1]
    if len(window) == smooth and np.mean(window) >= target:
      return i + 1
  return None


def algos(results: dict) -> None:
  mcfg, train, env_fields, rollout, engine = _configs()
  tok = ByteTokenizer()
  base = _WORKDIR.value
  warm_dir = os.path.join(base, "warm")  # reused if a call finished it
  start = time.time()
  warm_run = _run_config(env_fields, 0, warm_start_steps=_WARM.value,
                         warm_start_learning_rate=_WARM_LR.value)
  variables = loop.warm_start(mcfg, train, envs.make(
      _ENV.value, **dict(env_fields)), tok, warm_run, warm_dir,
                              progress=False)
  results["warm_start_seconds"] = time.time() - start
  init = sft.Init(mcfg, variables, tok, {"init": warm_dir})
  runs = []
  for algo in _ALGOS.value:
    for seed in map(int, _SEEDS.value):
      workdir = os.path.join(base, f"{algo}_{seed}")
      shutil.rmtree(workdir, ignore_errors=True)
      gc.collect()  # the previous run's engine and state
      start = time.time()
      summary = loop.run(
          mcfg, train, _run_config(env_fields, seed), workdir,
          rl_config=rl_step.RLConfig(algorithm=algo,
                                     mtp_depth=mcfg.num_mtp_modules),
          rollout_config=rollout, engine_config=engine, init=init,
          progress=False)
      lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                        "metrics.jsonl"))]
      rewards = [l["reward_mean"] for l in lines]
      run = {"algo": algo, "seed": seed, "seconds": time.time() - start,
             "rewards": rewards,
             "steps_to_target": _first_reaching(rewards, _TARGET.value,
                                                _SMOOTH.value),
             "final_reward": float(np.mean(rewards[-_SMOOTH.value:])),
             "first_reward": float(np.mean(rewards[:_SMOOTH.value])),
             "eval_reward": summary.get("eval_reward"),
             "samples_per_sec": float(np.median([l["samples_per_sec"]
                                                 for l in lines])),
             "clip_fraction": float(np.mean([l["clip_fraction"]
                                             for l in lines])),
             "entropy_last": lines[-1]["entropy"], "pool": summary["pool"]}
      runs.append(run)
      results["runs"] = runs
      _save(results)  # a run cut short by a time limit keeps the others
      print(f"{algo} seed {seed}: first {run['first_reward']:.3f} final "
            f"{run['final_reward']:.3f} eval {run['eval_reward']:.3f} "
            f"steps to {_TARGET.value}: {run['steps_to_target']} "
            f"({run['seconds']:.0f} s)", flush=True)
  results["runs"] = runs
  table = {}
  for algo in _ALGOS.value:
    mine = [r for r in runs if r["algo"] == algo]
    reached = [r["steps_to_target"] for r in mine
               if r["steps_to_target"] is not None]
    finals = [r["final_reward"] for r in mine]
    evals = [r["eval_reward"] for r in mine]
    table[algo] = {
        "reached": f"{len(reached)}/{len(mine)}",
        "steps_to_target_mean": float(np.mean(reached)) if reached else None,
        "steps_to_target_std": float(np.std(reached)) if reached else None,
        "final_reward_mean": float(np.mean(finals)),
        "final_reward_std": float(np.std(finals)),
        "eval_reward_mean": float(np.mean(evals)),
        "eval_reward_std": float(np.std(evals))}
    t = table[algo]
    print(f"{algo:6s} reached {t['reached']}  steps "
          f"{t['steps_to_target_mean']} +- {t['steps_to_target_std']}  "
          f"final {t['final_reward_mean']:.3f} +- {t['final_reward_std']:.3f}"
          f"  eval {t['eval_reward_mean']:.3f} +- {t['eval_reward_std']:.3f}",
          flush=True)
  results["algos"] = table


def merge(results: dict) -> None:
  """The train step on real rollout batches, merged vs unmerged."""
  mcfg, train, _, _, _ = _configs()
  source = os.path.join(_WORKDIR.value,
                        f"{_ALGOS.value[0]}_{_SEEDS.value[0]}")
  with pool_lib.Pool(os.path.join(source, loop.POOL_FILE)) as pool:
    batches = [pool.trained_in(s) for s in range(1, 1 + _MERGE_REPS.value)]
  rl_config = rl_step.RLConfig(mtp_depth=mcfg.num_mtp_modules)
  gc.collect()
  state = state_lib.create_state(mcfg, train)
  row = {}
  for name, merged in (("merged", True), ("unmerged", False)):
    config = trainer_lib.TrainerConfig(row_len=512, rows_per_micro_batch=2,
                                       merge=merged)
    trainer = trainer_lib.Trainer(mcfg, train, rl_config, config,
                                  jax.tree.map(jax.numpy.copy, state))
    trainer.train(batches[0])  # compile
    seconds, tokens, entries = [], [], []
    for batch in batches:
      metrics = trainer.train(batch)
      seconds.append(metrics["train/seconds"])
      tokens.append(int(metrics["train/tokens_computed"]))
      entries.append(int(metrics["train/attention_entries"]))
    flops = [params_lib.train_flops(mcfg, t, e)
             for t, e in zip(tokens, entries)]
    row[name] = {"seconds_median": float(np.median(seconds)),
                 "tokens_mean": float(np.mean(tokens)),
                 "flops_mean": float(np.mean(flops)),
                 "tflops": float(np.mean(flops) / np.median(seconds) / 1e12)}
    print(f"{name:8s} {row[name]['seconds_median'] * 1e3:.1f} ms/step "
          f"{row[name]['tokens_mean']:.0f} tokens "
          f"{row[name]['tflops']:.1f} TFLOP/s", flush=True)
  row["speedup"] = (row["unmerged"]["seconds_median"]
                    / row["merged"]["seconds_median"])
  row["flops_ratio"] = (row["unmerged"]["flops_mean"]
                        / row["merged"]["flops_mean"])
  print(f"merged speedup {row['speedup']:.2f}x, FLOPs ratio "
        f"{row['flops_ratio']:.2f}x", flush=True)
  results["merge"] = row


def _save(results: dict) -> None:
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes
  results = {**timing.run_header()}
  sections = {"algos": algos, "merge": merge}
  for name in _SECTIONS.value:
    sections[name](results)
    _save(results)


if __name__ == "__main__":
  cli.run(main)
