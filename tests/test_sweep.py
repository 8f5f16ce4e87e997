"""A CPU-sized ablation sweep end to end: runs, resume, report."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import params, report, sweep
from m2jax.config import ConfigError
from m2jax.eval import recall
from m2jax.train import multi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One layer: the sweep's runs, resume and report do not depend on the depth,
# and each program compiles in about half the time of two layers.
BASE = config_lib.apply_overrides(config_lib.TINY, [
    "num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
    "head_dim=8", "rotary_dim=4", "num_experts=4", "num_experts_per_tok=2",
    "moe_intermediate_size=16", "num_mtp_modules=0"])


def test_grids_hold_their_promises(tmp_path):
  fine, coarse = sweep.make_grid("experts", BASE, window=64)
  c = BASE.replace(**coarse.model)
  # Equal active and total expert parameters.
  assert (c.num_experts_per_tok * c.moe_intermediate_size
          == BASE.num_experts_per_tok * BASE.moe_intermediate_size)
  assert (c.num_experts * c.moe_intermediate_size
          == BASE.num_experts * BASE.moe_intermediate_size)
  assert fine.model == {}
  names = [v.name for v in sweep.make_grid("attention", BASE, window=64)]
  assert names[0] == "full" and all("swa64" in n for n in names[1:])
  for v in sweep.make_grid("attention", BASE, window=64):
    BASE.replace(**v.model)  # every variant is a valid config
  with pytest.raises(ConfigError, match="grid"):
    sweep.make_grid("nope", BASE, window=64)
  with pytest.raises(ConfigError, match="eval_lengths"):
    sweep.SweepConfig(grid="mtp", seq_len=128, eval_lengths=(128,))
  with pytest.raises(ConfigError, match="drill_fraction"):
    sweep.SweepConfig(grid="mtp", drill_fraction=1.5)
  with pytest.raises(ConfigError, match=r"\['mtp_9'\] not in the mtp grid"):
    sweep.run_sweep(BASE, sweep.SweepConfig(grid="mtp", variants=("mtp_9",)),
                    str(tmp_path / "never"), log=lambda _: None)
  assert not (tmp_path / "never").exists()


def test_equal_compute_gives_an_mtp_arm_fewer_steps_of_equal_flops():
  cfg = sweep.SweepConfig(grid="mtp", steps=400, seq_len=256,
                          eval_lengths=(128,), equal_compute=True)
  base = BASE.replace(num_mtp_modules=3)
  flops = {}
  for v in sweep.make_grid("mtp", base, window=64):
    run = sweep._run_configs(base, v, 0, cfg, "/unused")
    per_token = params.flops_per_token(run.model, cfg.seq_len,
                                       mtp_depth=run.train.mtp_depth)
    flops[v.name] = (run.train.steps, run.train.steps * per_token)
  assert flops["mtp_off"][0] == 400
  assert flops["mtp_off"][0] > flops["mtp_1"][0] > flops["mtp_3"][0]
  for steps, total in flops.values():  # equal up to one step's rounding
    assert abs(total / flops["mtp_off"][1] - 1) <= 0.5 / steps
  # Without it every arm trains the same steps (equal tokens).
  plain = dataclasses.replace(cfg, equal_compute=False)
  assert {sweep._run_configs(base, v, 0, plain, "/unused").train.steps
          for v in sweep.make_grid("mtp", base, window=64)} == {400}


def test_a_sweep_directory_older_than_a_field_still_resumes(tmp_path):
  # sweep.json written before SweepConfig.equal_compute (and a ModelConfig
  # field) existed: they were at their defaults, so the same sweep goes on;
  # a real difference is still refused.
  cfg = sweep.SweepConfig(grid="mtp", seq_len=256, eval_lengths=(128,))
  d = tmp_path / "old"
  sweep._check_same_sweep(str(d), BASE, cfg)  # writes sweep.json
  saved = json.loads((d / "sweep.json").read_text())
  del saved["sweep"]["equal_compute"], saved["base"]["bias_update"]
  (d / "sweep.json").write_text(json.dumps(saved))
  sweep._check_same_sweep(str(d), BASE, cfg)
  with pytest.raises(ConfigError, match="equal_compute=False there, True"):
    sweep._check_same_sweep(str(d), BASE,
                            dataclasses.replace(cfg, equal_compute=True))


def test_cpu_sweep_end_to_end(tmp_path, monkeypatch):
  cfg = sweep.SweepConfig(grid="gating", seeds=(0, 1), steps=4, seq_len=160,
                          batch_size=2, eval_lengths=(128,),
                          examples_per_point=2, train_documents=40,
                          eval_batches=1)
  d = str(tmp_path / "sweep")
  results = sweep.run_sweep(BASE, cfg, d, progress=False, log=lambda _: None)
  assert [(r["variant"], r["seed"]) for r in results["runs"]] == [
      ("sigmoid_bias", 0), ("sigmoid_bias", 1), ("softmax_aux", 0),
      ("softmax_aux", 1)]
  for r in results["runs"]:
    assert r["tokens"] == 4 * 2 * 160
    assert len(r["loss_curve"]) == 4 and r["val_loss"] > 0
    assert set(r["tasks"]) == set(cfg.eval_tasks)
    assert r["routing"]["load_cv"] is not None

  # --parallel: one arm's two seeds as one vmapped program (m2jax.train.multi)
  # write the result files the sequential runs wrote.
  # Killed after its third step, then resumed from the checkpoints of step 2.
  real_step = multi.jit_multi_step

  def killed_at_step_3(*configs):
    step, calls = real_step(*configs), []

    def run(*args):
      calls.append(1)
      if len(calls) == 3:
        raise KeyboardInterrupt
      return step(*args)
    return run

  logged = []
  d_parallel = str(tmp_path / "parallel")
  parallel = dataclasses.replace(cfg, parallel=True, variants=("sigmoid_bias",))
  monkeypatch.setattr(multi, "jit_multi_step", killed_at_step_3)
  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(BASE, parallel, d_parallel, progress=False,
                    log=logged.append)
  monkeypatch.setattr(multi, "jit_multi_step", real_step)
  together = sweep.run_sweep(BASE, parallel, d_parallel, progress=False,
                             log=logged.append)["runs"]
  assert logged == 2 * ["[sweep gating] group 1/1, one program: sigmoid_bias "
                        "seed 0, sigmoid_bias seed 1"]
  metrics = [json.loads(l) for l in open(os.path.join(
      d_parallel, "runs", "sigmoid_bias", "seed1", "metrics.jsonl"))]
  assert metrics[1]["models_in_program"] == 2
  assert [(r["variant"], r["seed"]) for r in together] == [
      ("sigmoid_bias", 0), ("sigmoid_bias", 1)]
  curves = ("loss_curve", "ce_curve", "val_curve", "balance_curve",
            "val_loss", "val_bpb")
  for alone, run in zip(results["runs"][:2], together):
    for key in curves:
      np.testing.assert_allclose(run[key], alone[key], rtol=1e-4)
    for key, value in alone["routing"].items():
      np.testing.assert_allclose(run["routing"][key], value, rtol=1e-3)
    rest = lambda r: {k: v for k, v in r.items()
                      if k not in curves and k != "routing"}
    assert rest(run) == rest(alone)  # tasks, overrides, steps, tokens
  # The seeds differ in init and data order, not only in name.
  assert together[0]["loss_curve"] != together[1]["loss_curve"]

  # A rerun reuses finished runs (their result files are not rewritten).
  done = os.path.join(d, "runs", "softmax_aux", "seed1", "result.json")
  mtime = os.path.getmtime(done)
  again = sweep.run_sweep(BASE, cfg, d, progress=False, log=lambda _: None)
  assert os.path.getmtime(done) == mtime
  assert again["runs"] == results["runs"]

  # A different sweep config is refused in the same directory.
  with pytest.raises(ConfigError, match="drill_fraction=0.0 there, 0.5 now"):
    sweep.run_sweep(BASE, dataclasses.replace(cfg, drill_fraction=0.5), d,
                    log=lambda _: None)
  with pytest.raises(ConfigError, match="base ModelConfig: num_layers"):
    sweep.run_sweep(BASE.replace(num_layers=2), cfg, d, log=lambda _: None)

  # Another invocation for one arm only: its runs are done (skipped, and
  # the progress says so), and results.json and the report still cover
  # every finished arm of the directory.
  logged = []
  sweep.run_sweep(BASE, dataclasses.replace(cfg, variants=("softmax_aux",)),
                  d, progress=False, log=logged.append)
  assert logged == [
      "[sweep gating] run 1/2: softmax_aux seed 0: skipped (done)",
      "[sweep gating] run 2/2: softmax_aux seed 1: skipped (done)"]
  on_disk = json.load(open(os.path.join(d, "results.json")))
  assert on_disk["runs"] == results["runs"]
  assert on_disk["variants"] == ["sigmoid_bias", "softmax_aux"]
  assert sweep.load_results(d)["runs"] == results["runs"]  # experiments.report

  paths = report.write_report(on_disk, d)
  text = open(paths["report"]).read()
  rows = [l for l in text.splitlines() if l.startswith("| sigmoid_bias")
          or l.startswith("| softmax_aux")]
  # Two arms' summary rows, their task rows, softmax_aux against the first
  # (validation loss and balance).
  assert len(rows) == 2 + 2 * len(cfg.eval_tasks) + 2
  assert any(r.startswith("| softmax_aux | load max/mean |") for r in rows)
  assert "±" in rows[0]  # mean ± std over the two seeds
  # The gating grid gets the router balance plot, logged at every step.
  assert len(results["runs"][0]["balance_curve"]) == 4
  for key in ("loss_curves", "router_balance"):
    with open(paths[key], "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"

  # Seed 0 of every arm finished, seed 1 of none; the next invocation is
  # killed in its first new run: results.json still lists every finished run
  # (not only those before the kill in plan order).
  for v in ("sigmoid_bias", "softmax_aux"):
    shutil.rmtree(os.path.join(d, "runs", v, "seed1"))
  real_run_one = sweep.run_one

  def killed_at_seed_1(base, variant, seed, *args, **kwargs):
    if seed == 1:
      raise KeyboardInterrupt
    return real_run_one(base, variant, seed, *args, **kwargs)

  monkeypatch.setattr(sweep, "run_one", killed_at_seed_1)
  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(BASE, cfg, d, progress=False, log=lambda _: None)
  on_disk = json.load(open(os.path.join(d, "results.json")))
  assert [(r["variant"], r["seed"]) for r in on_disk["runs"]] == [
      ("sigmoid_bias", 0), ("softmax_aux", 0)]


def _run(variant, seed, *, ce, mtp=0.0, balance=True, score=0.0):
  """A result.json of a run whose curves are flat at `ce` (its total loss
  adds `mtp`); validation at steps 0 (untrained), 10 and 20."""
  steps = range(2, 22, 2)
  run = {"variant": variant, "seed": seed, "tokens": 1000,
         "loss_curve": [[s, ce + mtp] for s in steps],
         "ce_curve": [[s, ce] for s in steps],
         "val_curve": [[0, 5.5], [10, ce + 0.1], [20, ce]],
         "val_loss": ce, "val_bpb": ce * 1.4,
         "tasks": {"niah_single": {"128": score}},
         "routing": {"load_cv": 0.1, "load_max_over_mean": 1.2}}
  if balance:
    run["balance_curve"] = [[s, 0.2 + seed] for s in steps]
  return run


def _results(*runs, grid="mtp"):
  return {"sweep": {"grid": grid, "eval_lengths": [128], "window": 64},
          "variants": ["mtp_off", "mtp_1"], "runs": list(runs)}


def test_plots_show_next_token_and_validation_loss_with_seed_bands(tmp_path):
  # mtp_1's total loss is 1.5 nats above its next-token loss: the plot must
  # not show that as mtp_1 being worse.
  results = _results(_run("mtp_off", 0, ce=2.0), _run("mtp_off", 1, ce=2.4),
                     _run("mtp_1", 0, ce=2.1, mtp=1.5),
                     _run("mtp_1", 1, ce=2.3, mtp=1.5, balance=False))
  series = report.plot_series(results)
  train = series["next_token"]
  np.testing.assert_allclose(train["mtp_off"].mean, 2.2)
  np.testing.assert_allclose(train["mtp_1"].mean, 2.2)
  np.testing.assert_allclose(train["mtp_1"].low, 2.1)
  np.testing.assert_allclose(train["mtp_1"].high, 2.3)
  assert list(train["mtp_1"].steps) == list(range(2, 22, 2))
  val = series["validation"]["mtp_off"]
  assert list(val.steps) == [10, 20]  # step 0 (untrained) left out
  np.testing.assert_allclose(val.mean, [2.3, 2.2])
  np.testing.assert_allclose([val.low, val.high], [[2.1, 2.0], [2.5, 2.4]])
  assert val.seeds == 2
  # Balance only for arms whose every run logged it.
  assert list(series["balance"]) == ["mtp_off"]
  np.testing.assert_allclose(series["balance"]["mtp_off"].low, 0.2)
  np.testing.assert_allclose(series["balance"]["mtp_off"].high, 1.2)

  # Smoothing averages within +-0.05 decades of steps, so it is even on a
  # log axis: close steps are averaged, steps a decade apart are not.
  np.testing.assert_allclose(report.smooth_log([1, 10, 100], [1., 2., 3.]),
                             [1., 2., 3.])
  np.testing.assert_allclose(
      report.smooth_log([100, 105, 1000, 1100], [1., 3., 5., 7.]),
      [2., 2., 6., 6.])

  # Every run scored 0: no flat context plot, and the report says why; an
  # old one in the directory is removed, never passed off as this report's.
  (tmp_path / "context_scores.png").write_bytes(b"old")
  paths = report.write_report(results, str(tmp_path))
  assert set(paths) == {"report", "loss_curves", "router_balance"}
  assert not (tmp_path / "context_scores.png").exists()
  text = open(paths["report"]).read()
  assert "Every run scored 0" in text and "seeds [0, 1]" in text
  solved = _results(_run("mtp_off", 0, ce=2.0, balance=False, score=0.5),
                    grid="attention")
  paths = report.write_report(solved, str(tmp_path / "solved"))
  assert set(paths) == {"report", "loss_curves", "context_scores"}
  # A sweep that scored MQAR gets its per-gap plot (and only such a sweep).
  mqar_runs = [dict(_run(v, seed, ce=2.0, balance=False),
                    mqar={"0": 0.9, "64": acc}, mqar_chance=0.038)
               for v, acc in (("mtp_off", 1.0), ("mtp_1", 0.04))
               for seed in (0, 1)]
  scored = _results(*mqar_runs, grid="attention")
  scored["sweep"]["mqar_pairs"] = 8
  paths = report.write_report(scored, str(tmp_path / "mqar"))
  assert set(paths) == {"report", "loss_curves", "mqar"}
  assert os.path.getsize(paths["mqar"]) > 1000


def test_report_says_whether_each_difference_exceeds_the_seed_spread():
  seeds = lambda name, values, **kw: [_run(name, i, ce=v, **kw)
                                      for i, v in enumerate(values)]
  results = _results(*seeds("mtp_off", [2.00, 2.01, 2.02]),
                     *seeds("mtp_1", [2.30, 2.31, 2.29]),    # far apart
                     *seeds("mtp_3", [2.02, 1.99, 2.01]),    # within noise
                     *seeds("mtp_9", [2.5]))                 # one seed
  results["variants"] = ["mtp_off", "mtp_1", "mtp_3", "mtp_9"]
  rows = {line.split(" | ")[0][2:]: line.split(" | ")[2:]
          for line in report.differences_table(results)
          if "| mtp_" in line and "| val loss |" in line}
  balance = [line for line in report.differences_table(results)
             if "| load max/mean |" in line]  # equal in every run: no
  assert len(balance) == 3
  assert all(l.endswith("| 1.000 | no |") for l in balance[:2])
  assert rows["mtp_1"][0] == "+0.2900" and rows["mtp_1"][2] == "**yes** |"
  assert float(rows["mtp_1"][1]) < 0.01
  assert rows["mtp_3"][0] == "-0.0033" and rows["mtp_3"][2] == "no |"
  assert float(rows["mtp_3"][1]) > 0.5
  assert rows["mtp_9"][1:] == ["-", "- (one seed) |"]
  # Arms without seed spread (MQAR accuracy 1.0 in every seed): any
  # difference is real, none is none.
  assert report.Difference.of([1.0, 1.0], [0.5, 0.5]).exceeds_spread
  assert not report.Difference.of([1.0, 1.0], [1.0, 1.0]).exceeds_spread
  assert "## Against `mtp_off`" in report.markdown(results)


def test_recall_check_verdict_and_refused_pairs():
  # Chance is 0.1; a pass needs chance + max(margin, 3 standard errors).
  assert recall.recall_verdict(0.10, 256, 0.1)[0] is False
  passed, line = recall.recall_verdict(0.30, 256, 0.1)
  assert passed and line.startswith("PASS: held-out recall accuracy 0.300")
  assert "0.200" in line  # 0.1 + margin 0.1 (3 SE over 256 digits: 0.056)
  # Over 8 digits 3 standard errors are 0.318: 0.3 is no evidence.
  passed, line = recall.recall_verdict(0.30, 8, 0.1)
  assert not passed and line.startswith("FAIL") and "0.418" in line
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.recall_check", "--pairs=0"],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "error: flag --pairs=0: 0 is not an integer in the range [1, 676]"]



@pytest.mark.parametrize("flag, message", [
    ("--gmm_backend=nope", "Settings.gmm_backend: gmm backend must be one of"),
    ("--mesh=data=1", "a sweep trains each run on one device"),
])
def test_sweep_cli_takes_the_settings_flags(flag, message):
  """experiments.sweep reads the training scripts' Settings flags (e.g.
  --gmm_backend=xla for a vmapped run) and refuses a mesh, in one line."""
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.sweep", flag, "--steps=1"],
      cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, proc.stderr[-2000:]


def test_agent_curves_compare_the_agents_per_window(tmp_path):
  """agent_learning's report: per agent the mean and std over seeds of the
  steps every seed reached; per 25-step window over the steps every run
  reached, black-box minus white-box with Welch's t over seeds: equal
  curves are within the spread, a shifted one is beyond it. The plot is
  written."""
  rng = np.random.default_rng(0)
  ramp = np.minimum(np.arange(60) / 30, 1.0)

  def runs(shift):
    out = []
    for seed in range(3):
      for agent, extra, steps in (("whitebox", 0.0, 60), ("blackbox", shift, 55)):
        noise = rng.normal(0, 0.02, steps)
        out.append({"agent": agent, "seed": seed,
                    "reward": (ramp[:steps] * 0.8 + extra + noise).tolist()})
    return out

  same = report.agent_curves(runs(0.0))
  assert same["whitebox"]["seeds"] == 3 and len(same["whitebox"]["mean"]) == 60
  assert len(same["blackbox"]["mean"]) == 55
  assert [w["steps"] for w in same["windows"]] == [[1, 25], [26, 50]]
  assert not any(w["exceeds_spread"] for w in same["windows"])
  shifted = report.agent_curves(runs(-0.2))
  assert all(w["exceeds_spread"] for w in shifted["windows"])
  assert np.isclose(shifted["windows"][1]["difference"], -0.2, atol=0.03)
  assert "windows" not in report.agent_curves(
      [r for r in runs(0.0) if r["agent"] == "whitebox"])
  path = str(tmp_path / "curves.png")
  report.plot_agent_curves({"runs": runs(0.0), "warm_start": {
      "sampled_reward": 0.1}}, path)
  assert os.path.getsize(path) > 1000
