"""A CPU-sized ablation sweep end to end: runs, resume, report."""

import dataclasses
import json
import os
import shutil

import pytest

from m2jax import config as config_lib
from m2jax import report, sweep
from m2jax.config import ConfigError

BASE = config_lib.apply_overrides(config_lib.TINY, [
    "num_layers=2", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
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
    sweep.run_sweep(BASE.replace(num_layers=1), cfg, d, log=lambda _: None)

  paths = report.write_report(json.load(open(os.path.join(d, "results.json"))),
                              d)
  text = open(paths["report"]).read()
  rows = [l for l in text.splitlines() if l.startswith("| sigmoid_bias")
          or l.startswith("| softmax_aux")]
  assert len(rows) == 2 + 2 * len(cfg.eval_tasks)
  assert "±" in rows[0]  # mean ± std over the two seeds
  for key in ("loss_curves", "context_scores"):
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
