"""Sweep reports: markdown tables (mean ± std over seeds) and PNG plots.

`write_report(results, out_dir)` writes
  report.md           one table per grid: validation loss and bits per
                      byte, routing balance, task accuracy per context
                      length, and MQAR accuracy per gap when scored; then
                      every arm against the first: the difference of
                      means, Welch's t-test over seeds, and whether the
                      difference exceeds the seed spread (p < 0.05)
  loss_curves.png     the next-token loss: training (smoothed) and
                      validation, against steps on a log scale
  router_balance.png  the routers' load balance (max / mean expert load - 1)
                      against steps, for runs that log it (MoE)
  context_scores.png  task accuracy (mean over tasks) against context
                      length; only when some run scored above zero (a flat
                      line at zero says nothing a table does not)
  mqar.png            MQAR accuracy per gap, one bar per arm (mean, the
                      seeds as dots), chance and the all-SWA reach marked;
                      only for sweeps that scored MQAR
Every curve is the mean over seeds with a band from the lowest to the
highest seed (`plot_series` computes them; the plots only draw).

The training loss plotted is the next-token cross-entropy ("ce"), not the
total trained on ("loss" adds the MTP term and the balance loss), so arms
with and without MTP compare on what they share.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
from scipy import stats

# A difference between two arms "exceeds the seed spread" when Welch's
# t-test over their seeds gives p below this.
SIGNIFICANCE = 0.05
# Training curves are averaged over a window of this many decades of steps
# around each point (+-0.05: +-12%), so the smoothing is even on a log axis.
SMOOTH_HALF_WIDTH_DECADES = 0.05
FILES = {"report": "report.md", "loss_curves": "loss_curves.png",
         "router_balance": "router_balance.png",
         "context_scores": "context_scores.png", "mqar": "mqar.png"}


def _pm(values) -> str:
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.4f}"
  return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}"


def _by_variant(results: dict) -> dict[str, list[dict]]:
  runs = defaultdict(list)
  for run in results["runs"]:
    runs[run["variant"]].append(run)
  order = list(dict.fromkeys([*(results.get("variants") or []), *runs]))
  return {v: runs[v] for v in order if v in runs}


def _seeds(results: dict) -> list[int]:
  return sorted({run["seed"] for run in results["runs"]})


def _task_mean(run: dict, length: str) -> float:
  return float(np.mean([scores[length] for scores in run["tasks"].values()]))


def smooth_log(steps, values,
               half_width: float = SMOOTH_HALF_WIDTH_DECADES) -> np.ndarray:
  """Each value averaged with its neighbours within `half_width` decades of
  its step (steps > 0)."""
  log_steps = np.log10(np.asarray(steps, float))
  values = np.asarray(values, float)
  near_NxN = np.abs(log_steps[:, None] - log_steps[None, :]) <= half_width
  return (near_NxN @ values) / near_NxN.sum(axis=1)


@dataclasses.dataclass(frozen=True)
class Band:
  """One arm's curve: the mean over seeds and the lowest and highest seed,
  at the steps every seed logged."""
  steps: np.ndarray
  mean: np.ndarray
  low: np.ndarray
  high: np.ndarray
  seeds: int


def seed_band(curves: list[list[list[float]]], *, smooth: bool = False
              ) -> Band | None:
  """A Band of per-seed curves ([[step, value], ...] each, steps > 0 kept),
  each smoothed first when `smooth`; None when no step is common to all."""
  per_seed = []
  for curve in curves:
    points = {int(s): float(v) for s, v in curve if s > 0}
    steps = sorted(points)
    values = [points[s] for s in steps]
    if smooth and steps:
      values = smooth_log(steps, values)
    per_seed.append(dict(zip(steps, values)))
  common = sorted(set.intersection(*(set(c) for c in per_seed))
                  if per_seed else ())
  if not common:
    return None
  values_SxN = np.array([[c[s] for s in common] for c in per_seed])
  return Band(np.array(common), values_SxN.mean(0), values_SxN.min(0),
              values_SxN.max(0), len(per_seed))


def plot_series(results: dict) -> dict[str, dict[str, Band]]:
  """The plotted curves, per kind and arm:
    next_token  training next-token loss ("ce_curve"), smoothed
    validation  validation next-token loss ("val_curve"; step 0, the
                untrained model, left out)
    balance     router max/mean load - 1 ("balance_curve"), smoothed; only
                arms whose runs all logged it
  """
  series = {"next_token": {}, "validation": {}, "balance": {}}
  for name, runs in _by_variant(results).items():
    for kind, key, smooth in (("next_token", "ce_curve", True),
                              ("validation", "val_curve", False),
                              ("balance", "balance_curve", True)):
      if all(run.get(key) for run in runs):
        band = seed_band([run[key] for run in runs], smooth=smooth)
        if band is not None:
          series[kind][name] = band
  return series


def _draw(ax, bands: dict[str, Band], *, marker=None) -> None:
  for name, band in bands.items():
    line, = ax.plot(band.steps, band.mean, marker=marker,
                    label=f"{name} ({band.seeds} seed{'s' * (band.seeds > 1)})")
    if band.seeds > 1:
      ax.fill_between(band.steps, band.low, band.high, alpha=0.2,
                      color=line.get_color(), linewidth=0)
  ax.set_xscale("log")
  ax.set_xlabel("step (log scale)")
  ax.grid(True, which="both", alpha=0.3)


def _band_note(results: dict) -> str:
  n = len(_seeds(results))
  return ("mean over seeds, band: lowest to highest seed" if n > 1
          else "one seed")


def _save_figure(fig, path: str) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_loss_curves(results: dict, path: str) -> None:
  """Training next-token loss (smoothed) and validation loss, side by side."""
  series = plot_series(results)
  fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
  _draw(train_ax, series["next_token"])
  train_ax.set_ylabel("next-token loss (nats/token)")
  train_ax.set_title("training (smoothed; without the MTP term)")
  _draw(val_ax, series["validation"], marker="o")
  val_ax.set_ylabel("next-token loss (nats/token)")
  val_ax.set_title("validation (step 0, untrained, not shown)")
  for ax in (train_ax, val_ax):
    ax.legend(fontsize=8)
  fig.suptitle(f"sweep {results['sweep']['grid']}: next-token loss "
               f"({_band_note(results)})")
  _save_figure(fig, path)


def plot_balance(results: dict, path: str) -> None:
  """Router load balance: max / mean expert load - 1 (0 is even)."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  _draw(ax, plot_series(results)["balance"])
  ax.set_ylabel("max / mean expert load - 1")
  ax.set_title(f"sweep {results['sweep']['grid']}: router load balance\n"
               f"(mean over layers, smoothed; {_band_note(results)})",
               fontsize=10)
  ax.legend(fontsize=8)
  _save_figure(fig, path)


def _any_task_solved(results: dict) -> bool:
  return any(score > 0 for run in results["runs"]
             for scores in run["tasks"].values() for score in scores.values())


def plot_context_scores(results: dict, path: str) -> None:
  sweep = results["sweep"]
  lengths = [str(n) for n in sweep["eval_lengths"]]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, runs in _by_variant(results).items():
    per_seed = np.array([[_task_mean(r, n) for n in lengths] for r in runs])
    xs = [int(n) for n in lengths]
    line, = ax.plot(xs, per_seed.mean(0), marker="o", label=name)
    if len(runs) > 1:
      ax.fill_between(xs, per_seed.min(0), per_seed.max(0), alpha=0.2,
                      color=line.get_color(), linewidth=0)
  if sweep["grid"] == "attention":
    ax.axvline(sweep["window"], color="gray", linestyle="--",
               label=f"window {sweep['window']}")
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("exact match (mean over tasks)")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(f"sweep {sweep['grid']}: long-context tasks\n"
               f"({_band_note(results)})", fontsize=10)
  ax.legend()
  _save_figure(fig, path)


def _mqar_runs(results: dict) -> dict[str, list[dict]]:
  """The arms whose every run scored MQAR."""
  return {name: rs for name, rs in _by_variant(results).items()
          if all(r.get("mqar") for r in rs)}


def plot_mqar(results: dict, path: str) -> None:
  runs = _mqar_runs(results)
  first = next(iter(runs.values()))[0]
  gaps = list(first["mqar"])
  width = 0.8 / len(runs)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for a, (name, rs) in enumerate(runs.items()):
    xs = np.arange(len(gaps)) + (a - (len(runs) - 1) / 2) * width
    per_seed = np.array([[r["mqar"][g] for g in gaps] for r in rs])
    ax.bar(xs, per_seed.mean(0), width, label=name, alpha=0.8)
    for seed_values in per_seed:  # every seed, so a split arm shows
      ax.plot(xs, seed_values, "o", color="black", markersize=3)
  ax.axhline(first["mqar_chance"], color="gray", linestyle=":",
             label=f"chance {first['mqar_chance']:.3f}")
  ax.set_xticks(range(len(gaps)), [f"gap {g}" for g in gaps])
  sweep, layers = results["sweep"], results.get("base", {}).get("num_layers")
  reach = ""
  if sweep.get("grid") == "attention" and layers:
    reach = (f"; all-SWA reaches {layers * (sweep['window'] - 1)} tokens "
             "back")
  ax.set_ylabel("accuracy on the queried values")
  ax.set_ylim(0, 1.05)
  ax.set_title(f"sweep {sweep['grid']}: MQAR, {sweep.get('mqar_pairs')} "
               f"pairs{reach}\n(bars: mean over seeds; dots: each seed)",
               fontsize=10)
  ax.legend(fontsize=8)
  _save_figure(fig, path)


def markdown(results: dict) -> str:
  """The report's tables as markdown."""
  sweep = results["sweep"]
  runs = _by_variant(results)
  lengths = [str(n) for n in sweep["eval_lengths"]]
  tokens = {name: rs[0]["tokens"] for name, rs in runs.items()}
  if len(set(tokens.values())) == 1:
    budget = f"{next(iter(tokens.values())):,} training tokens per run"
  else:  # SweepConfig.equal_compute: equal FLOPs, so unequal tokens
    budget = ("equal training FLOPs per run, so training tokens per run: "
              + ", ".join(f"{name} {n:,}" for name, n in tokens.items()))
  out = [f"# Sweep `{sweep['grid']}`", "",
         f"{len(results['runs'])} runs of {len(runs)} arms; {budget}; "
         f"seeds {_seeds(results)}; mean ± std over "
         "seeds. Losses are next-token cross-entropy on the validation "
         "split; load balance is max / mean expert load.", ""]
  head = ["variant", "seeds", "val loss (nats)", "val bits/byte", "load CV",
          "load max/mean"] + [f"tasks @{n}" for n in lengths]
  out.append("| " + " | ".join(head) + " |")
  out.append("|" + "---|" * len(head))
  for name, rs in runs.items():
    row = [name, str(len(rs)), _pm([r["val_loss"] for r in rs]),
           _pm([r["val_bpb"] for r in rs]),
           _pm([r["routing"]["load_cv"] for r in rs]),
           _pm([r["routing"]["load_max_over_mean"] for r in rs])]
    row += [_pm([_task_mean(r, n) for r in rs]) for n in lengths]
    out.append("| " + " | ".join(row) + " |")
  out += ["", "## Accuracy per task (mean over seeds)", ""]
  if not _any_task_solved(results):
    out += ["Every run scored 0 on every task at every length (so no "
            "context_scores.png).", ""]
  tasks = list(next(iter(runs.values()))[0]["tasks"])
  head = ["variant", "task"] + [f"@{n}" for n in lengths]
  out.append("| " + " | ".join(head) + " |")
  out.append("|" + "---|" * len(head))
  for name, rs in runs.items():
    for task in tasks:
      row = [name, task] + [
          f"{np.mean([r['tasks'][task][n] for r in rs]):.2f}" for n in lengths]
      out.append("| " + " | ".join(row) + " |")
  out += mqar_table(results)
  out += differences_table(results)
  return "\n".join(out) + "\n"


@dataclasses.dataclass(frozen=True)
class Difference:
  """Arm b's mean minus arm a's over seeds, and Welch's two-sided t-test."""
  delta: float
  p: float | None        # None: fewer than 2 seeds in an arm
  exceeds_spread: bool | None

  @classmethod
  def of(cls, a, b) -> "Difference":
    a, b = np.asarray(a, float), np.asarray(b, float)
    delta = float(b.mean() - a.mean())
    if min(len(a), len(b)) < 2:
      return cls(delta, None, None)
    if a.std() == 0 and b.std() == 0:  # no spread: any difference is real
      p = 1.0 if delta == 0 else 0.0
    else:
      with warnings.catch_warnings():  # near-equal seeds (accuracy 1.0)
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(stats.ttest_ind(b, a, equal_var=False).pvalue)
    return cls(delta, p, p < SIGNIFICANCE)

  def cells(self) -> list[str]:
    if self.p is None:
      return [f"{self.delta:+.4f}", "-", "- (one seed)"]
    return [f"{self.delta:+.4f}", f"{self.p:.3f}",
            "**yes**" if self.exceeds_spread else "no"]


def differences_table(results: dict) -> list[str]:
  """Markdown lines: every arm against the first arm of the report, for the
  validation loss, the routers' balance (MoE runs) and (when scored) MQAR
  accuracy at each gap."""
  runs = _by_variant(results)
  if len(runs) < 2:
    return []
  (first, base), *others = runs.items()
  metrics = [("val loss", lambda r: r["val_loss"])]
  if all(r["routing"].get("load_max_over_mean") is not None
         for rs in runs.values() for r in rs):
    metrics.append(("load max/mean",
                    lambda r: r["routing"]["load_max_over_mean"]))
  if len(_mqar_runs(results)) == len(runs):
    metrics += [(f"MQAR gap {g}", lambda r, g=g: r["mqar"][g])
                for g in base[0]["mqar"]]
  out = ["", f"## Against `{first}`", "",
         "Difference of the means over seeds (arm minus "
         f"`{first}`), Welch's t-test (two-sided); a difference exceeds "
         f"the seed spread when p < {SIGNIFICANCE}.", "",
         "| variant | metric | difference | p | exceeds seed spread |",
         "|---|---|---|---|---|"]
  for name, rs in others:
    for metric, value in metrics:
      diff = Difference.of([value(r) for r in base], [value(r) for r in rs])
      out.append("| " + " | ".join([name, metric] + diff.cells()) + " |")
  return out


def mqar_table(results: dict) -> list[str]:
  """Markdown lines: MQAR accuracy (mean ± std over seeds) per arm and gap,
  for sweeps that scored it (SweepConfig.mqar_gaps); else no lines."""
  runs = _mqar_runs(results)
  if not runs:
    return []
  first = next(iter(runs.values()))[0]
  gaps = list(first["mqar"])
  sweep = results["sweep"]
  pairs, window = sweep.get("mqar_pairs"), sweep.get("window")
  layers = results.get("base", {}).get("num_layers")
  out = ["", "## MQAR: accuracy on the queried values per gap", "",
         f"{pairs} key-value pairs, `gap` filler characters, then every key "
         f"queried: a query is gap + 2 to gap + {4 * pairs - 2} tokens after "
         f"its pair. Chance {first['mqar_chance']:.3f}."]
  if sweep.get("grid") == "attention" and layers:
    out[-1] += (f" All-SWA ({layers} layers, window {window}) reaches "
                f"{layers * (window - 1)} tokens back: at gap >= "
                f"{layers * (window - 1)} no pair is in its reach.")
  out.append("")
  head = ["variant", "seeds"] + [f"gap {g}" for g in gaps]
  out.append("| " + " | ".join(head) + " |")
  out.append("|" + "---|" * len(head))
  for name, rs in runs.items():
    out.append("| " + " | ".join(
        [name, str(len(rs))] + [_pm([r["mqar"][g] for r in rs])
                                for g in gaps]) + " |")
  return out


# Steps per window of the agents' comparison (agent_curves).
AGENT_WINDOW = 25


def _rewards(runs, agent: str, steps: int | None = None) -> np.ndarray:
  """[seeds, steps] outcome rewards of `agent`'s runs, cut to `steps`
  (default: the most every one of its seeds reached)."""
  ours = [r["reward"] for r in runs if r["agent"] == agent]
  steps = min(map(len, ours)) if steps is None else steps
  return np.asarray([r[:steps] for r in ours])


def agent_curves(runs) -> dict:
  """experiments.agent_learning's runs ({"agent", "seed", "reward": per
  step}): per agent, the outcome reward per step, mean and std over seeds (over
  the steps every seed has reached). With both agents, "windows": over the
  steps every run has reached, per window of AGENT_WINDOW steps, each agent's
  mean reward (a seed's mean over the window, then over seeds), black-box
  minus white-box and Welch's t-test over seeds (report.Difference): the
  "within seed noise" test of the target."""
  out = {}
  for agent in sorted({r["agent"] for r in runs}):
    rewards = _rewards(runs, agent)
    out[agent] = {"mean": rewards.mean(0).tolist(),
                  "std": rewards.std(0).tolist(), "seeds": len(rewards)}
  if {"whitebox", "blackbox"} <= set(out):
    common = min(len(r["reward"]) for r in runs)
    white, black = (_rewards(runs, a, common) for a in ("whitebox", "blackbox"))
    out["windows"] = []
    for lo in range(0, common - AGENT_WINDOW + 1, AGENT_WINDOW):
      w, b = (x[:, lo:lo + AGENT_WINDOW].mean(1) for x in (white, black))
      diff = Difference.of(w, b)
      out["windows"].append({
          "steps": [lo + 1, lo + AGENT_WINDOW], "whitebox": float(w.mean()),
          "blackbox": float(b.mean()), "difference": diff.delta,
          "p": diff.p, "exceeds_spread": diff.exceeds_spread})
  return out


def plot_agent_curves(result, path: str) -> None:
  """Each agent's reward per step (a 10-step moving average), the mean over
  seeds with the band from the lowest to the highest seed."""
  fig, ax = plt.subplots(figsize=(7, 4))
  agents = {r["agent"] for r in result["runs"]}
  for agent, colour in (("whitebox", "C0"), ("blackbox", "C1")):
    if agent not in agents:
      continue
    rewards = _rewards(result["runs"], agent)
    kernel = np.ones(min(10, rewards.shape[1])) / min(10, rewards.shape[1])
    smooth = np.asarray([np.convolve(r, kernel, "valid") for r in rewards])
    steps = np.arange(smooth.shape[1]) + len(kernel)
    ax.plot(steps, smooth.mean(0), color=colour,
            label=f"{agent} ({len(rewards)} seeds)")
    ax.fill_between(steps, smooth.min(0), smooth.max(0), color=colour,
                    alpha=0.2)
  warm = result.get("warm_start") or {}
  if "sampled_reward" in warm:
    ax.axhline(warm["sampled_reward"], color="grey", ls=":",
               label="warm start (sampled)")
  ax.set(xlabel="RL step", ylabel="outcome reward (10-step average)",
         ylim=(-0.02, 1.02), title="multiply with the calculator: "
         "white-box vs black-box agent")
  ax.legend(loc="lower right")
  _save_figure(fig, path)


def write_report(results: dict, out_dir: str) -> dict[str, str]:
  """Write report.md and the plots that have data into `out_dir`; returns
  {name: path} of what was written (a plot without data is removed, so an
  old one never passes for this report's)."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {name: os.path.join(out_dir, f) for name, f in FILES.items()}
  with open(paths["report"], "w", encoding="utf-8") as f:
    f.write(markdown(results))
  plot_loss_curves(results, paths["loss_curves"])
  plots = {"router_balance": (plot_balance,
                              bool(plot_series(results)["balance"])),
           "context_scores": (plot_context_scores,
                              _any_task_solved(results)),
           "mqar": (plot_mqar, bool(_mqar_runs(results)))}
  for name, (plot, has_data) in plots.items():
    if has_data:
      plot(results, paths[name])
    else:
      if os.path.exists(paths[name]):
        os.remove(paths[name])
      del paths[name]
  return paths
