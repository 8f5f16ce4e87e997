"""Command-line errors: a user's mistake is one line and exit 2, a bug a
traceback (experiments/cli.py)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax.config import config_to_dict
from m2jax.data import DataConfig
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "num_experts=4",
         "moe_intermediate_size=16"]


def _env():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"  # one device: --mesh=data=2 cannot fit
  return env


def _python(*args, timeout=120):
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=timeout,
                        check=False)


def _pretrain(tmp_path, *flags):
  return _python("-m", "experiments.pretrain", "--preset=tiny",
                 f"--workdir={tmp_path / 'run'}", "--seq_len=16",
                 "--batch_size=2", *flags)


def _corpus(tmp_path) -> str:
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"doc{i}.txt").write_text("def f(x):\n  return x\n" * 8)
  return str(corpus)


def _assert_one_line_error(proc, *needles):
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  for needle in needles:
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("flag, needle", [
    ("--preset=m3", "unknown preset 'm3'"),
    ("--override=num_layers=0", "ModelConfig.num_layers: must be positive"),
    ("--mesh=data=2", "mesh data=2"),
    ("--steps=many", "flag --steps=many"),
])
def test_bad_flag_is_one_line(tmp_path, flag, needle):
  proc = _pretrain(tmp_path, f"--data={_corpus(tmp_path)}", flag)
  _assert_one_line_error(proc, needle)
  assert not (tmp_path / "run").exists()  # refused before any work


def test_missing_data_path_is_one_line_before_any_work(tmp_path):
  missing = str(tmp_path / "no_such_corpus")
  proc = _pretrain(tmp_path, f"--data={missing}")
  _assert_one_line_error(proc, f"data source {missing!r}: no such file")
  assert not (tmp_path / "run").exists()


def test_resume_with_another_config_is_one_line_and_moves_nothing(tmp_path):
  corpus = _corpus(tmp_path)
  mcfg = config_lib.apply_overrides(config_lib.TINY, SMALL)
  dcfg = DataConfig(source=corpus, seq_len=16, batch_size=2)
  tcfg = TrainConfig(steps=4)
  # A step-2 checkpoint as pretrain writes it, of a model with hidden 32
  # (zeros of the state's shapes: nothing to compile).
  state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(
      lambda: state_lib.create_state(mcfg, tcfg)))
  checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run" / "checkpoints"),
                                       keep=3)
  checkpointer.save(2, state, {}, {
      "model": config_to_dict(mcfg), "train": config_to_dict(tcfg),
      "data": config_to_dict(dcfg)})
  checkpointer.close()
  proc = _pretrain(tmp_path, f"--data={corpus}", "--resume",
                   *[f"--override={o}" for o in SMALL],
                   "--override=hidden_size=64")
  # The run's configs come from the checkpoint (no config.json here); the
  # explicit --override contradicts them.
  _assert_one_line_error(proc, "ModelConfig.hidden_size: the run has 32 but "
                         "--override=hidden_size=64 gives 64")
  assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
  assert not (tmp_path / "run" / "checkpoints_corrupt").exists()


def test_a_bug_keeps_its_traceback(tmp_path):
  # A ValueError from inside main (ConfigError's builtin base) is a bug, not
  # a usage error: it must not be reported as one line.
  code = (
      "import sys\n"
      "from experiments import cli, pretrain as script\n"
      "def broken(*args, **kwargs):\n"
      "  raise ValueError('an index went out of range')\n"
      "script.pretrain = broken\n"
      f"sys.argv = ['pretrain', '--data={_corpus(tmp_path)}',\n"
      f"            '--workdir={tmp_path / 'run'}']\n"
      "cli.run(script.main)\n")
  proc = _python("-c", code)
  assert proc.returncode == 1
  assert "Traceback" in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "ValueError: an index went out of range")
