"""Scheduling benchmark: windowed FIFO against strict FIFO and greedy on
heterogeneous rollout latencies (issue 15), simulated on a virtual clock
(benchmarks.schedule_sim; CPU, seconds).

Every policy runs on the same task stream per seed: difficulties drawn from
--mix, latencies lognormal with a median per difficulty (--latency_median)
and spread --latency_sigma. Prints a table of the mean and std over seeds of
samples/s, trainer idle fraction, policy lag, the batches' drift from the
task mix (total variation; drift_tv_iid is what sampling noise alone
gives), the mean difficulty trained and the share of rollouts discarded as
stale, for each trainer speed of --step_times, and writes them with every
run to --out.

  python -m experiments.bench_schedule --out=benchmarks/results/schedule.json
"""

import json
import os

from absl import flags
import numpy as np

from benchmarks import schedule_sim
from benchmarks import timing
from experiments import cli
from m2jax.rl import envs
from m2jax.rl import scheduler


def _positive(text: str) -> bool:
  try:
    return float(text) > 0
  except ValueError:
    return False


def _level_map(text: str) -> dict[int, float]:
  """"1:0.4,2:0.6" -> {1: 0.4, 2: 0.6}."""
  pairs = [item.split(":") for item in text.split(",")]
  return {int(level): float(value) for level, value in pairs}


def _parses(text: str) -> bool:
  try:
    return bool(_level_map(text))
  except ValueError:
    return False


_OUT = flags.DEFINE_string("out", "benchmarks/results/schedule.json",
                           "JSON results")
_POLICIES = flags.DEFINE_list("policies", list(scheduler.POLICIES),
                              f"scheduling policies, of {scheduler.POLICIES}")
flags.register_validator(
    "policies", lambda p: bool(p) and set(p) <= set(scheduler.POLICIES),
    f"--policies: each must be one of {scheduler.POLICIES}")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"],
                           "task-stream seeds (each policy runs each)")
cli.integer_lists("seeds")
_SLOTS = flags.DEFINE_integer("slots", 64, "concurrent rollouts (P)",
                              lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 16,
                              "trajectories per train step (B)", lower_bound=1)
_STEP_TIMES = flags.DEFINE_list(
    "step_times", ["5", "10", "20"],
    "virtual seconds per train step; each is a workload of its own (how "
    "fast the trainer is against the rollouts)")
flags.register_validator(
    "step_times", lambda ts: bool(ts) and all(_positive(t) for t in ts),
    "--step_times: expected positive numbers")
_STEPS = flags.DEFINE_integer("steps", 300, "train steps per run",
                              lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup_steps", 30,
                               "first steps left out of the metrics",
                               lower_bound=0)
flags.register_multi_flags_validator(
    ["steps", "warmup_steps"], lambda f: f["warmup_steps"] < f["steps"],
    "--warmup_steps: must be below --steps")
_WINDOW = flags.DEFINE_float("window", scheduler.WINDOW_FRACTION,
                             "windowed: W, the window's share of the queue")
_MAX_LAG = flags.DEFINE_integer("max_lag", 8,
                                "most versions of policy lag; -1: no limit")
_MAX_QUEUED = flags.DEFINE_integer(
    "max_queued", 128, "most rollouts queued (running and finished, not yet "
    "trained); 0: no limit")


_ENV = flags.DEFINE_string(
    "env", "", "take the task mix and latencies from this environment's "
    "level mix and latency model (m2jax.rl.envs, its default config, e.g. "
    "arithmetic); empty: --mix, --latency_median and --latency_sigma")
_MIX = flags.DEFINE_string("mix", "1:0.4,2:0.3,3:0.2,4:0.1",
                           "task mix, DIFFICULTY:PROBABILITY,...")
_MEDIAN = flags.DEFINE_string(
    "latency_median", "1:5,2:15,3:45,4:135",
    "median rollout seconds per difficulty, DIFFICULTY:SECONDS,...")
_SIGMA = flags.DEFINE_float("latency_sigma", 1.0,
                            "lognormal spread of the latencies")
for _name in ("mix", "latency_median"):
  flags.register_validator(_name, _parses,
                           f"--{_name}: expected LEVEL:NUMBER,... pairs")
flags.register_validator(
    "mix", lambda text: not _parses(text) or (
        min(_level_map(text).values()) >= 0
        and abs(sum(_level_map(text).values()) - 1) < 1e-6),
    "--mix: the probabilities must be >= 0 and sum to 1")
flags.register_multi_flags_validator(
    ["mix", "latency_median"],
    lambda f: set(_level_map(f["mix"])) <= set(_level_map(f["latency_median"])),
    "--latency_median: needs a median for every difficulty of --mix")

_METRICS = ("samples_per_sec", "trainer_idle_fraction", "lag_mean", "lag_max",
            "drift_tv", "difficulty_mean", "stale_fraction", "in_flight_mean")


def _runs(workload, configs, results):
  """Every policy on every seed of `workload`: the runs and their summary,
  the mean and std over seeds of each metric."""
  summary = {}
  for policy, config in configs.items():
    runs = [{"policy": policy, "step_time": workload.step_time,
             "seed": int(seed),
             **schedule_sim.simulate(workload, config, int(seed))}
            for seed in _SEEDS.value]
    results["runs"] += runs
    summary[policy] = {
        m: {"mean": float(np.mean([r[m] for r in runs])),
            "std": float(np.std([r[m] for r in runs]))} for m in _METRICS}
  return summary


# Column headers of the printed table (the JSON keeps _METRICS' names).
_HEADERS = ("samples/s", "trainer idle", "lag mean", "lag max", "drift TV",
            "difficulty", "stale", "in flight")


def _print_table(step_time, summary):
  print(f"\nstep_time {step_time:g} s")
  print(f"{'policy':<9}" + "".join(f"{h:>16}" for h in _HEADERS))
  for policy, by_metric in summary.items():
    print(f"{policy:<9}" + "".join(
        f"{by_metric[m]['mean']:>8.3f} ({by_metric[m]['std']:.3f})"
        for m in _METRICS))


def main(argv):
  del argv
  configs = {policy: scheduler.ScheduleConfig(
      policy=policy, window=_WINDOW.value,
      max_lag=None if _MAX_LAG.value < 0 else _MAX_LAG.value,
      max_queued=_MAX_QUEUED.value or None) for policy in _POLICIES.value}
  results = timing.run_header()
  if _ENV.value:
    env = envs.make(_ENV.value)
    mix = env.level_mix()
    # A task of that difficulty drawn by the env, then its latency.
    latency_fn = lambda d, rng: env.latency(env.sample(rng, d), rng)  # pylint: disable=unnecessary-lambda-assignment
  else:
    mix = _level_map(_MIX.value)
    latency_fn = schedule_sim.lognormal_latency(_level_map(_MEDIAN.value),
                                                _SIGMA.value)
  results["drift_tv_iid"] = schedule_sim.iid_drift(mix, _BATCH.value)
  results["task_difficulty_mean"] = sum(d * p for d, p in mix.items())
  print(f"{len(_SEEDS.value)} seeds, mean (std) over seeds. Drift of B iid "
        f"draws from the mix: {results['drift_tv_iid']:.3f}; the mix's mean "
        f"difficulty: {results['task_difficulty_mean']:.2f}")
  results["runs"], results["summary"] = [], {}
  for step_time in _STEP_TIMES.value:
    workload = schedule_sim.Workload(
        mix=mix, latency_fn=latency_fn,
        slots=_SLOTS.value, batch_size=_BATCH.value,
        step_time=float(step_time), steps=_STEPS.value,
        warmup_steps=_WARMUP.value)
    summary = _runs(workload, configs, results)
    results["summary"][step_time] = summary
    _print_table(workload.step_time, summary)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1)
  print("wrote", _OUT.value)


if __name__ == "__main__":
  cli.run(main)
