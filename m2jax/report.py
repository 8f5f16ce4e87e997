"""Sweep reports: markdown tables (mean ± std over seeds) and PNG plots.

`write_report(results, out_dir)` writes
  report.md            one table per grid: validation loss and bits per
                       byte, routing balance, task accuracy per context length
  loss_curves.png      training loss per variant (mean over seeds)
  context_scores.png   task accuracy (mean over tasks) against context length
"""

from __future__ import annotations

import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np


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
  order = results.get("variants") or list(runs)
  return {v: runs[v] for v in order if v in runs}


def _task_mean(run: dict, length: str) -> float:
  return float(np.mean([scores[length] for scores in run["tasks"].values()]))


def markdown(results: dict) -> str:
  """The report's tables as markdown."""
  sweep = results["sweep"]
  runs = _by_variant(results)
  lengths = [str(n) for n in sweep["eval_lengths"]]
  tokens = next(iter(runs.values()))[0]["tokens"]
  out = [f"# Sweep `{sweep['grid']}`", "",
         f"{len(results['runs'])} runs; {tokens:,} training tokens per run; "
         f"seeds {sweep['seeds']}; mean ± std over seeds.", ""]
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
  tasks = list(next(iter(runs.values()))[0]["tasks"])
  head = ["variant", "task"] + [f"@{n}" for n in lengths]
  out.append("| " + " | ".join(head) + " |")
  out.append("|" + "---|" * len(head))
  for name, rs in runs.items():
    for task in tasks:
      row = [name, task] + [
          f"{np.mean([r['tasks'][task][n] for r in rs]):.2f}" for n in lengths]
      out.append("| " + " | ".join(row) + " |")
  return "\n".join(out) + "\n"


def plot_loss_curves(results: dict, path: str) -> None:
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, rs in _by_variant(results).items():
    steps = [s for s, _ in rs[0]["loss_curve"]]
    curves = [[l for _, l in r["loss_curve"]][:len(steps)] for r in rs]
    n = min(len(c) for c in curves)
    ax.plot(steps[:n], np.mean([c[:n] for c in curves], axis=0), label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(f"sweep {results['sweep']['grid']}: loss (mean over seeds)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_context_scores(results: dict, path: str) -> None:
  sweep = results["sweep"]
  lengths = [str(n) for n in sweep["eval_lengths"]]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, rs in _by_variant(results).items():
    means = [np.mean([_task_mean(r, n) for r in rs]) for n in lengths]
    ax.plot([int(n) for n in lengths], means, marker="o", label=name)
  if sweep["grid"] == "attention":
    ax.axvline(sweep["window"], color="gray", linestyle="--",
               label=f"window {sweep['window']}")
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("exact match (mean over tasks)")
  ax.set_ylim(-0.02, 1.02)
  ax.set_title(f"sweep {sweep['grid']}: long-context tasks")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_report(results: dict, out_dir: str) -> dict[str, str]:
  """Write report.md and the two plots into `out_dir`; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {"report": os.path.join(out_dir, "report.md"),
           "loss_curves": os.path.join(out_dir, "loss_curves.png"),
           "context_scores": os.path.join(out_dir, "context_scores.png")}
  with open(paths["report"], "w", encoding="utf-8") as f:
    f.write(markdown(results))
  plot_loss_curves(results, paths["loss_curves"])
  plot_context_scores(results, paths["context_scores"])
  return paths
