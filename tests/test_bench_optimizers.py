"""experiments/bench_optimizers.py end to end on CPU: a run's row and the
summary reach the JSON; --resume keeps finished runs and --max_seconds
starts no new one; --merge joins the files of separate calls."""

import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_KEYS = {"optimizer", "seed", "lr", "adam_lr", "finite", "final_loss",
            "final_ce", "val_loss", "val_bpb", "load_violation_final",
            "load_violation_mean", "load_violation_max", "hidden_rms_final",
            "hidden_rms_max", "step_s", "first_step_s", "tokens_per_sec",
            "peak_memory_gib", "curves"}


def _bench(tmp_path, *extra, out="bench.json"):
  corpus = tmp_path / "corpus"
  if not corpus.exists():   # small: the stdlib's split would cost seconds
    corpus.mkdir()
    rng = random.Random(0)
    words = ["alpha", "beta", "def", "return", "(x)", "\n"]
    for i in range(200):
      (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(words)
                                                 for _ in range(30)))
  out = tmp_path / out
  # One sphere optimizer: its init, step and lrs; one compile.
  cmd = [sys.executable, "-m", "experiments.bench_optimizers",
         "--preset=tiny", "--override=num_layers=1",
         "--override=num_mtp_modules=0", "--optimizers=muonsphere",
         "--steps=3", "--batch=2", "--seq_len=32", "--last=2",
         "--eval_batches=1", "--untimed=1", f"--data={corpus}",
         f"--out={out}", *extra]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


def test_bench_writes_every_run_and_resumes(tmp_path):
  result, stdout = _bench(tmp_path, "--seeds=0", "--lrs=muonsphere:0.03")
  (run,) = result["runs"]
  assert (run["optimizer"], run["seed"]) == ("muonsphere", 0)
  assert set(run) == RUN_KEYS, set(run) ^ RUN_KEYS
  assert run["finite"] and run["step_s"] > 0
  assert len(run["curves"]["loss"]) == 3
  # A MoE model: the routers' load violation was read (0 = even load).
  assert run["load_violation_max"] >= run["load_violation_final"] >= 0
  assert run["hidden_rms_final"] > 0
  assert (run["lr"], run["adam_lr"]) == (0.03, 3e-3)
  assert result["summary"]["muonsphere"]["seeds"] == 1
  assert stdout.splitlines()[-1].split()[:2] == ["muonsphere", "1"]
  # Resumed with another seed but no time left: the finished run stays,
  # nothing new starts.
  resumed, stdout = _bench(tmp_path, "--seeds=0,1", "--lrs=muonsphere:0.03",
                           "--resume", "--max_seconds=0")
  assert "muonsphere seed 1 and later not run" in stdout
  assert resumed["runs"] == result["runs"]
  # Another call's file (here: the same run, named muon) merged with it:
  # one table, step times over Muon's.
  other = dict(result, runs=[dict(run, optimizer="muon", step_s=run[
      "step_s"] / 2)], lrs={"muon": 0.02})
  (tmp_path / "muon.json").write_text(json.dumps(other))
  merged, stdout = _bench(
      tmp_path, f"--merge={tmp_path / 'bench.json'},{tmp_path / 'muon.json'}",
      out="merged.json")
  assert [r["optimizer"] for r in merged["runs"]] == ["muonsphere", "muon"]
  assert merged["lrs"] == {"muonsphere": 0.03, "muon": 0.02}
  assert merged["summary"]["muonsphere"]["step_vs_muon"] == 2.0
  assert stdout.splitlines()[-1].split()[:2] == ["muon", "1"]
