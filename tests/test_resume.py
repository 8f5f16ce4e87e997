"""Resuming a run: a user's mistake moves nothing, damage is quarantined;
the run's saved configs are read back, and each step is logged once."""

import dataclasses
import os
import random
import shutil

import pytest

from m2jax import config as config_lib
from m2jax.config import ConfigError, ModelConfig, config_to_dict
from m2jax.data import DataConfig
from m2jax.errors import MissingPathError
from m2jax.train import resume
from m2jax.train.checkpoint import ResumeError
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import MetricsWriter, read_metrics

SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "num_experts=4",
         "moe_intermediate_size=16"]
MCFG = config_lib.apply_overrides(config_lib.TINY, SMALL)
TCFG = TrainConfig(steps=4, learning_rate=3e-3, warmup_steps=1, log_every=2,
                   eval_every=100, eval_batches=1, checkpoint_every=2)


def _data(root) -> DataConfig:
  corpus = os.path.join(root, "corpus")
  os.makedirs(corpus)
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "def", "return", "(x)", "\n"]
  for i in range(20):
    with open(os.path.join(corpus, f"doc{i}.txt"), "w") as f:
      f.write(" ".join(rng.choice(words) for _ in range(40)))
  return DataConfig(source=corpus, seq_len=16, batch_size=2,
                    validation_fraction=0.2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(DataConfig, workdir) of a 4-step run with checkpoints at 2 and 4."""
  root = str(tmp_path_factory.mktemp("trained"))
  dcfg = _data(root)
  workdir = os.path.join(root, "run")
  pretrain(MCFG, TCFG, dcfg, workdir, progress=False, sample_tokens=0)
  return dcfg, workdir


@pytest.fixture
def run(trained, tmp_path):
  """A fresh copy of the trained run for one test to damage."""
  dcfg, workdir = trained
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  return dcfg, copy


def _contents(workdir) -> dict:
  """Every step directory of the run, kept and quarantined."""
  def listing(name):
    path = os.path.join(workdir, name)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  return {"checkpoints": listing("checkpoints"),
          "corrupt": listing("checkpoints_corrupt")}


def _corrupt(workdir, step, what=("state",)):
  """Overwrite the step's files (not its commit markers) with garbage."""
  for item in what:
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints",
                                               str(step), item)):
      for name in files:
        if name != "commit_success.txt":
          with open(os.path.join(root, name), "wb") as f:
            f.write(b"garbage")


def _resume(run, mcfg=MCFG, tcfg=TCFG, **kw):
  dcfg, workdir = run
  return pretrain(mcfg, tcfg, kw.pop("dcfg", dcfg), workdir, resume=True,
                  progress=False, sample_tokens=0, **kw)


def test_wrong_config_is_refused_naming_the_field_and_moves_nothing(
    run, capsys):
  before = _contents(run[1])
  assert before == {"checkpoints": ["2", "4"], "corrupt": []}
  # A preset of another size: every state shape differs.
  wrong = MCFG.replace(hidden_size=64)
  with pytest.raises(ConfigError, match=r"ModelConfig\.hidden_size: .*has 32 "
                     r"but this run has 64"):
    _resume(run, wrong)
  with pytest.raises(ConfigError, match=r"DataConfig\.seq_len: .*has 16 but "
                     r"this run has 32"):
    _resume(run, dcfg=dataclasses.replace(run[0], seq_len=32))
  # Another optimizer: same configs, another train-state tree.
  with pytest.raises(ConfigError, match=r"opt_state.*optimizer \('adamw' in "
                     r"the checkpoint, 'muon' here\)"):
    _resume(run, tcfg=TCFG.replace(optimizer="muon"))
  assert _contents(run[1]) == before
  # The right config still finds every step and continues from the last
  # (more steps is allowed: the train config may differ).
  summary = _resume(run, tcfg=TCFG.replace(steps=8), stop_after=4)
  assert "resumed from step 4" in capsys.readouterr().out
  assert summary["step"] == 4  # the restored state's step counter
  assert _contents(run[1]) == before


@pytest.mark.parametrize("what", [("state",), ("meta",)])
def test_corrupt_newest_step_is_quarantined_after_a_mistake(run, capsys,
                                                            what):
  _corrupt(run[1], 4, what)
  # A wrong config is still the user's mistake: nothing is quarantined.
  with pytest.raises(ConfigError, match="hidden_size"):
    _resume(run, MCFG.replace(hidden_size=64))
  assert _contents(run[1])["corrupt"] == []
  summary = _resume(run, stop_after=2)
  out = capsys.readouterr().out
  assert "checkpoint step 4 is corrupt or partial" in out
  assert "resumed from step 2" in out
  assert summary["step"] == 2
  contents = _contents(run[1])
  assert contents["checkpoints"] == ["2"]
  assert [c.split(".")[0] for c in contents["corrupt"]] == ["4"]


def test_no_loadable_step_is_refused_not_restarted(run):
  _corrupt(run[1], 2)
  _corrupt(run[1], 4)
  with pytest.raises(ResumeError, match="no checkpoint .* loads"):
    _resume(run)
  assert _contents(run[1])["checkpoints"] == []
  # Only quarantined steps left: refused again, never a fresh start at 0.
  with pytest.raises(ResumeError, match=r"checkpoints_corrupt holds 2"):
    _resume(run)


def test_resumed_config_keeps_the_run_and_refuses_contradictions():
  saved = config_to_dict(MCFG)
  # Nothing given: the run's config (how a step runs is never saved).
  assert resume.resumed_config(ModelConfig, saved, {}) == MCFG
  same = {"hidden_size": resume.Given(32, "--override=hidden_size=32")}
  assert resume.resumed_config(ModelConfig, saved, same) == MCFG
  preset = {f: resume.Given(v, "--preset=m2_small")
            for f, v in config_to_dict(config_lib.M2_SMALL).items()
            if f in ("hidden_size", "num_layers", "rope_theta")}
  with pytest.raises(ConfigError, match=(
      r"^ModelConfig\.hidden_size: the run has 32 but --preset=m2_small "
      r"gives 1024 \(2 more fields differ: num_layers, rope_theta\)")):
    resume.resumed_config(ModelConfig, saved, preset)
  # Steps and cadence may change on resume; the optimisation may not.
  train = config_to_dict(TCFG)
  more = resume.resumed_config(
      TrainConfig, train, {"steps": resume.Given(8, "--steps=8"),
                           "log_every": resume.Given(1, "--log_every=1")},
      may_change=resume.RESUMABLE_TRAIN_FIELDS)
  assert more == TCFG.replace(steps=8, log_every=1)
  with pytest.raises(ConfigError, match=r"TrainConfig\.learning_rate: the run "
                     r"has 0\.003 but --learning_rate=0\.01 gives 0\.01"):
    resume.resumed_config(
        TrainConfig, train,
        {"learning_rate": resume.Given(0.01, "--learning_rate=0.01")},
        may_change=resume.RESUMABLE_TRAIN_FIELDS)


def test_resume_refuses_a_missing_or_mistyped_run(trained, tmp_path):
  dcfg, workdir = trained
  saved = resume.read_run_configs(workdir)
  assert saved["model"] == config_to_dict(MCFG)
  assert saved["data"] == config_to_dict(dcfg)
  with pytest.raises(MissingPathError, match=(
      r"cannot resume .*/rnu: the directory does not exist \(did you mean "
      r".*/run\?\)")):
    resume.read_run_configs(os.path.join(os.path.dirname(workdir), "rnu"))
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(MissingPathError, match="holds no run"):
    resume.read_run_configs(str(empty))
  # Without config.json the newest checkpoint's configs are the run's.
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  os.remove(os.path.join(copy, "config.json"))
  assert resume.read_run_configs(copy) == saved


def test_metrics_after_a_resume_hold_each_step_once(tmp_path):
  # A run logged steps 1..6 (an eval line at 4) but its newest checkpoint
  # is step 4, and a kill cut its last line short.
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  for step in range(1, 7):
    writer.write(step, {"loss": 1.0 / step})
    if step == 4:
      writer.write(step, {"val_loss": 0.5})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "lo')
  resumed = MetricsWriter(str(tmp_path), resume_step=4, tensorboard=False)
  for step in (5, 6, 7):
    resumed.write(step, {"loss": 2.0 / step})
  resumed.close()
  lines = read_metrics(str(tmp_path))
  assert [(l["step"], "val_loss" in l) for l in lines] == [
      (1, False), (2, False), (3, False), (4, False), (4, True), (5, False),
      (6, False), (7, False)]
  assert lines[-1]["loss"] == 2.0 / 7
