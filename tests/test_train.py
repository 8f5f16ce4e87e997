"""Training: falling loss, exact resume after SIGKILL, checkpoint safety."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.config import ConfigError
from m2jax.data import DataConfig
from m2jax.settings import Settings
from m2jax.train import schedules
from m2jax.train.checkpoint import Checkpointer
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "num_experts=4",
         "moe_intermediate_size=16"]
MCFG = config_lib.apply_overrides(config_lib.TINY, SMALL)
# The command-line runs of a kill or a signal (here and in
# test_interrupts.py) leave out the MTP module: what they check is the
# resume, which restores it like every other parameter, and their programs
# compile faster without it.
NO_MTP = ("--override=num_mtp_modules=0", "--mtp_depth=0")


def _corpus(tmp_path):
  d = tmp_path / "corpus"
  d.mkdir()
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "\n"]
  for i in range(40):
    (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words)
                                            for _ in range(60)))
  return str(d)


def _configs(tmp_path, **train):
  # One train config (40 steps) for the tests that train MCFG in-process:
  # one compiled step serves them; shorter tests stop early (stop_after).
  dcfg = DataConfig(source=_corpus(tmp_path), seq_len=32, batch_size=2,
                    validation_fraction=0.2)
  tcfg = TrainConfig(**{"steps": 40, "learning_rate": 3e-3, "warmup_steps": 2,
                        "log_every": 1, "eval_every": 20, "eval_batches": 2,
                        "checkpoint_every": 3, **train})
  return dcfg, tcfg


def test_wsd_schedule_and_mtp_anneal():
  tcfg = TrainConfig(steps=100, warmup_steps=10, decay_fraction=0.2,
                     learning_rate=1.0, min_lr_ratio=0.1)
  lr = schedules.learning_rate(tcfg)
  # Steps run 0..99: the decay phase is steps 80..99, ending at the floor.
  np.testing.assert_allclose([lr(0), lr(9), lr(50), lr(79), lr(99)],
                             [0.1, 1.0, 1.0, 1.0, 0.1], rtol=1e-6)
  np.testing.assert_allclose(
      [schedules.mtp_weight(tcfg, s) for s in (0, 79, 89, 99)],
      [0.3, 0.3, 0.2, 0.1], rtol=1e-6)


def test_loss_falls_and_outputs_exist(tmp_path):
  dcfg, tcfg = _configs(tmp_path)
  workdir = str(tmp_path / "run")
  summary = pretrain(MCFG, tcfg, dcfg, workdir, progress=False,
                     sample_tokens=8)
  lines = read_metrics(workdir)
  losses = [l["loss"] for l in lines if "loss" in l]
  vals = [l["val_loss"] for l in lines if "val_loss" in l]
  assert len(losses) == 40 and len(vals) == 3  # steps 0, 20, 40
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
  assert vals[-1] < vals[0]
  train_line = next(l for l in lines if "loss" in l)
  assert "mtp/acceptance_1" in train_line and "router/load_cv" in train_line
  assert os.path.exists(os.path.join(workdir, "sample.txt"))
  assert summary["step"] == 40
  # Every 3 steps plus the last, keeping the newest three.
  assert Checkpointer(os.path.join(workdir, "checkpoints"),
                      keep=3).steps() == [36, 39, 40]
  # Resumed when already finished (killed after its last checkpoint, before
  # a sweep read its summary): the same validation, not logged twice.
  again = pretrain(MCFG, tcfg, dcfg, workdir, progress=False, resume=True,
                   sample_tokens=0)
  assert again["step"] == 40
  assert again["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
  assert len([l for l in read_metrics(workdir) if "val_loss" in l]) == 3


def _run_cli(workdir, corpus, cache, *extra):
  cmd = [sys.executable, "-m", "experiments.pretrain", "--preset=tiny",
         f"--workdir={workdir}", f"--data={corpus}", "--seq_len=32",
         "--batch_size=2", "--steps=14", "--log_every=1", "--eval_every=7",
         "--eval_batches=2", "--checkpoint_every=2", "--sample_tokens=0",
         "--warmup_steps=2", *[f"--override={o}" for o in SMALL],
         *NO_MTP, *extra]
  # Every program of the first process cached, however fast it compiled:
  # the later processes run the same programs and compile none.
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _final_params(workdir):
  ck = Checkpointer(os.path.join(workdir, "checkpoints"), keep=3)
  import orbax.checkpoint as ocp
  step = ck.steps()[-1]
  restored = ocp.StandardCheckpointer().restore(
      os.path.join(workdir, "checkpoints", str(step), "state"))
  return step, restored


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
  corpus = _corpus(tmp_path)
  cache = str(tmp_path / "jax_cache")
  ref_dir, kill_dir = str(tmp_path / "ref"), str(tmp_path / "killed")
  # The victim alone first (it compiles); the reference and the resume run
  # from its compiled programs, side by side.
  victim = _run_cli(kill_dir, corpus, cache)
  kill_at = random.Random().randint(3, 11)
  metrics = os.path.join(kill_dir, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline:
    if os.path.exists(metrics):
      with open(metrics) as f:
        if sum(1 for _ in f) >= kill_at:
          break
    if victim.poll() is not None:
      break
    time.sleep(0.05)
  victim.send_signal(signal.SIGKILL)
  victim.wait()
  ref = _run_cli(ref_dir, corpus, cache)
  resumed = _run_cli(kill_dir, corpus, cache, "--resume")
  assert ref.wait() == 0, ref.stderr.read()
  assert resumed.wait() == 0, resumed.stderr.read()

  ref_lines, kill_lines = read_metrics(ref_dir), read_metrics(kill_dir)
  assert [l["step"] for l in kill_lines] == [l["step"] for l in ref_lines]
  for a, b in zip(ref_lines, kill_lines):
    for key in ("loss", "val_loss", "grad_norm"):
      assert a.get(key) == b.get(key), (key, a["step"], kill_at)
  (s1, p1), (s2, p2) = _final_params(ref_dir), _final_params(kill_dir)
  assert s1 == s2 == 14
  jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_corrupt_latest_checkpoint_falls_back(tmp_path, capsys):
  dcfg, tcfg = _configs(tmp_path)
  workdir = str(tmp_path / "run")
  pretrain(MCFG, tcfg, dcfg, workdir, progress=False, stop_after=6,
           sample_tokens=0)
  state_dir = os.path.join(workdir, "checkpoints", "6", "state")
  for root, _, files in os.walk(state_dir):
    for name in files:
      if name != "commit_success.txt":
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")
  summary = pretrain(MCFG, tcfg, dcfg, workdir, progress=False, resume=True,
                     stop_after=12, sample_tokens=0)
  out = capsys.readouterr().out
  assert "checkpoint step 6 is corrupt or partial" in out
  assert "resumed from step 3" in out
  assert summary["step"] == 12


def test_an_error_mid_run_completes_the_checkpoint_in_flight(tmp_path,
                                                            monkeypatch):
  """The asynchronous save of step 3 is still being written (its rename
  held back for 0.5 s) when a bug raises at step 4: pretrain completes it
  before the error leaves."""
  from test_checkpoint import _HeldFinalize  # pylint: disable=import-outside-toplevel
  dcfg, tcfg = _configs(tmp_path)
  workdir = str(tmp_path / "run")
  held = _HeldFinalize(monkeypatch)

  def bug_at_4(step, metrics):
    del metrics
    if step == 3:  # asked before step 3's checkpoint is saved
      held.release(after=0.5)
    if step == 4:
      raise RuntimeError("a bug at step 4")
    return False

  with pytest.raises(RuntimeError, match="a bug at step 4"):
    pretrain(MCFG, tcfg, dcfg, workdir, progress=False, sample_tokens=0,
             should_stop=bug_at_4)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "3"))


def test_config_mismatch_is_refused_naming_the_field(tmp_path):
  dcfg, tcfg = _configs(tmp_path)
  workdir = str(tmp_path / "run")
  settings = Settings(attention="xla", capacity_factor=2.0)
  pretrain(MCFG.replace(settings=settings), tcfg, dcfg, workdir,
           progress=False, stop_after=3, sample_tokens=0)
  # The run's Settings are recorded beside its configs (informational: a
  # resume may run differently).
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["settings"] == settings.to_dict()
  other = MCFG.replace(rope_theta=123.0)
  with pytest.raises(ConfigError, match="rope_theta"):
    pretrain(other, tcfg, dcfg, workdir, progress=False, resume=True)
  with pytest.raises(FileExistsError, match="--resume"):
    pretrain(MCFG, tcfg, dcfg, workdir, progress=False)


def test_mtp_only_freezes_the_main_model(tmp_path):
  dcfg, tcfg = _configs(tmp_path, steps=3, mtp_only=True)
  variables = model.init(MCFG, jax.random.key(0))
  before = jax.tree.map(np.array, variables)  # pretrain donates the buffers
  summary = pretrain(MCFG, tcfg, dcfg, str(tmp_path / "run"), progress=False,
                     sample_tokens=0, init_variables=variables)
  state = summary["state"]
  # The frozen main model keeps its routing bias too; MTP's bias moves.
  for name, old in before[model.EXPERT_BIAS].items():
    same = np.array_equal(jax.tree.leaves(old)[0],
                          jax.tree.leaves(state.expert_bias[name])[0])
    assert same == (not name.startswith("mtp_")), name
  new = state.params
  for name, old in before["params"].items():
    same = jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)), old, new[name]))
    assert all(same) == (not name.startswith("mtp_")), name


def test_context_schedule_switches_length_and_resumes(tmp_path):
  dcfg, tcfg = _configs(tmp_path, steps=8, checkpoint_every=2,
                        context_schedule=((0.0, 16), (0.5, 64)))
  ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
  pretrain(MCFG, tcfg, dcfg, ref, progress=False, sample_tokens=0)
  lines = [l for l in read_metrics(ref) if "seq_len" in l]
  assert [l["seq_len"] for l in lines] == [16] * 4 + [64] * 4
  # Tokens per batch stay fixed: 2 x 32 = 4 rows of 16 (<= 4 x 15 targets).
  assert all(30 < l["tokens"] <= 60 for l in lines[:4])
  pretrain(MCFG, tcfg, dcfg, cut, progress=False, sample_tokens=0,
           stop_after=4)  # a checkpoint exactly at the stage boundary
  pretrain(MCFG, tcfg, dcfg, cut, progress=False, sample_tokens=0,
           resume=True)
  assert [l.get("loss") for l in read_metrics(cut)] == [
      l.get("loss") for l in read_metrics(ref)]
  with pytest.raises(ConfigError, match="max_position_embeddings"):
    pretrain(MCFG.replace(max_position_embeddings=32), tcfg, dcfg,
             str(tmp_path / "x"), progress=False)
