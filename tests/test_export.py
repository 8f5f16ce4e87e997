"""A training run exported to the hub layout (m2jax.eval.runs.export_run,
experiments/export.py) loads back with m2jax.hf.load to the same logits."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import run_dirs
from m2jax import hf, model
from m2jax.errors import ExistingPathError, MissingPathError
from m2jax.eval import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = (np.arange(2 * 12, dtype=np.int32).reshape(2, 12) * 7) % 256


@jax.jit
def _jit_logits(variables, tokens):
  return model.logits(run_dirs.MODEL, variables, tokens)


def _logits(cfg, variables):
  assert cfg == run_dirs.MODEL  # compiled once, for this config
  return np.asarray(_jit_logits(variables, TOKENS))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("export") / "run")
  return workdir, run_dirs.write_run(workdir, steps=(1, 2))


def test_export_then_load_gives_identical_logits(run, tmp_path):
  workdir, saved = run
  cfg, step = runs.export_run(workdir, str(tmp_path / "hub"))
  assert step == 2
  loaded_cfg, loaded = hf.load(str(tmp_path / "hub"))  # no dtype arguments
  assert loaded_cfg == cfg == run_dirs.MODEL
  want = _logits(cfg, saved[2])
  np.testing.assert_array_equal(_logits(loaded_cfg, loaded), want)
  # --step: an older checkpoint, into an existing empty directory.
  (tmp_path / "empty").mkdir()
  _, step = runs.export_run(workdir, str(tmp_path / "empty"), step=1)
  assert step == 1
  older = _logits(*hf.load(str(tmp_path / "empty")))
  np.testing.assert_array_equal(older, _logits(cfg, saved[1]))
  assert np.abs(older - want).max() > 1e-3


def test_export_refuses_before_reading(run, tmp_path):
  workdir, _ = run
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "notes.txt").write_text("mine")
  with pytest.raises(ExistingPathError, match="--overwrite"):
    runs.export_run(workdir, str(tmp_path / "full"))
  assert os.listdir(tmp_path / "full") == ["notes.txt"]
  with pytest.raises(MissingPathError, match="no checkpoint of step 7; its "
                     "steps: 1, 2"):
    runs.export_run(workdir, str(tmp_path / "out"), step=7)
  with pytest.raises(MissingPathError, match="holds no config.json"):
    runs.export_run(str(tmp_path), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
  runs.export_run(workdir, str(tmp_path / "full"), overwrite=True)
  assert sorted(os.listdir(tmp_path / "full")) == ["config.json",
                                                   "model.safetensors"]


def test_export_refuses_a_model_the_hub_cannot_hold(tmp_path):
  sliding = run_dirs.MODEL.replace(attention_pattern=("sliding",),
                                   sliding_window=8)
  run_dirs.write_run(str(tmp_path / "run"), steps=(1,), mcfg=sliding)
  with pytest.raises(hf.CheckpointError, match="sliding-window"):
    runs.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_export_command(run, tmp_path):
  workdir, saved = run
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.export", f"--workdir={workdir}",
       f"--out={tmp_path / 'hub'}", "--step=1"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert f"wrote step 1 of {workdir}" in proc.stdout
  _, loaded = hf.load(str(tmp_path / "hub"))
  np.testing.assert_array_equal(loaded["params"]["embedding"],
                                saved[1]["params"]["embedding"])
