"""A training command's mistakes are refused at start-up, in one line that
says what to change, before any work (issue 21: each of these once failed
late, from inside a jitted step, or under an unrelated traceback)."""

import os
import subprocess
import sys

import jax
import pytest

from experiments import run_flags
from m2jax import config as config_lib
from m2jax.config import ConfigError
from m2jax.data import DataConfig, hash_fraction
from m2jax.errors import ExistingPathError
from m2jax.settings import Settings, SettingsError
from m2jax.train import mtp_growth
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(directory, n, validation_fraction=0.02):
  """`n` documents that the hash split at `validation_fraction` sends to
  training, none to validation."""
  names = [f"doc{i}.txt" for i in range(10 * n)
           if hash_fraction(f"doc{i}.txt") >= validation_fraction][:n]
  directory.mkdir()
  for i, name in enumerate(names):
    (directory / name).write_text(f"def f{i}(x):\n  return x\n" * 8)
  return str(directory)


def _pretrain(tmp_path, *flags, code=None):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  args = ["-c", code] if code else ["-m", "experiments.pretrain"]
  return subprocess.run(
      [sys.executable, *args, f"--workdir={tmp_path / 'run'}", *flags],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=False)


def _one_line_error(proc) -> str:
  lines = [line for line in proc.stderr.strip().splitlines()
           if line.strip() and not line.startswith("pretrain:")]  # tqdm
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: "), lines[0]
  return lines[0]


def test_mtp_depth_beyond_the_model_is_refused_before_any_work(tmp_path):
  tcfg = TrainConfig(steps=2, mtp_depth=3)
  with pytest.raises(ConfigError, match=r"TrainConfig.mtp_depth=3 exceeds "
                     r"ModelConfig.num_mtp_modules=1: .*--mtp_depth=1.*"
                     r"--override=num_mtp_modules=3"):
    pretrain(config_lib.TINY, tcfg, DataConfig(), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  tcfg.check_model(config_lib.TINY.replace(num_mtp_modules=3))  # fits


def test_empty_splits_name_the_flags_before_any_work(tmp_path):
  small = _corpus(tmp_path / "small", 3)
  with pytest.raises(ConfigError, match=r"validation split .* has no "
                     r"documents.*--validation_fraction.*--validation_data"):
    pretrain(config_lib.TINY, TrainConfig(steps=1), DataConfig(source=small),
             str(tmp_path / "run"))
  # One document that the hash split sends to validation: no train split.
  name = next(f"doc{i}.txt" for i in range(100)
              if hash_fraction(f"doc{i}.txt") < 0.5)
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / name).write_text("def f(x):\n  return x\n")
  with pytest.raises(ConfigError, match=r"train split .* has no documents.*"
                     r"--validation_fraction"):
    pretrain(config_lib.TINY, TrainConfig(steps=1),
             DataConfig(source=str(tmp_path / "one"), validation_fraction=0.5),
             str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_ragged_exchange_on_cpu_is_refused():
  ep2 = jax.sharding.AbstractMesh((1, 1, 2, 1), ("data", "fsdp", "expert",
                                                 "tensor"))
  with pytest.raises(SettingsError, match=r"--all_to_all=ragged needs a GPU.*"
                     r"--all_to_all=dense.*--all_to_all=slabs"):
    run_flags.check_exchange(Settings(all_to_all="ragged"), ep2)
  for fine in ((Settings(all_to_all="dense"), ep2),
               (Settings(all_to_all="ragged"), None)):  # no exchange at all
    run_flags.check_exchange(*fine)


def test_bpe_sizes_the_vocabulary_and_the_validation_flags_reach_the_data(
    tmp_path):
  proc = _pretrain(tmp_path, "--tokenizer=bpe", "--bpe_vocab_size=320",
                   f"--data={_corpus(tmp_path / 'corpus', 4)}",
                   "--validation_fraction=0.6")  # refused by DataConfig
  assert proc.stdout.splitlines()[0] == (
      "note: ModelConfig.vocab_size 264 -> 320, the BPE tokenizer's "
      "(--bpe_vocab_size; --override=vocab_size=N sets it yourself)")
  assert "DataConfig.validation_fraction: must be a number in [0, 0.5]" in (
      _one_line_error(proc))
  proc = _pretrain(tmp_path, "--tokenizer=bpe", "--override=vocab_size=300",
                   f"--validation_data={tmp_path / 'missing'}")
  assert ("--override=vocab_size=300 is below --bpe_vocab_size=4096" in
          _one_line_error(proc))
  proc = _pretrain(tmp_path, f"--validation_data={tmp_path / 'missing'}",
                   f"--data={tmp_path / 'corpus'}")
  assert f"data source {str(tmp_path / 'missing')!r}" in _one_line_error(proc)
  assert not (tmp_path / "run").exists()


def test_metric_writers_close_on_an_error_inside_the_loop(tmp_path):
  # An error once the writers are open (here: in the first eval) is one
  # line, with no tensorboardX thread traceback at exit under it. (The
  # state is zeros of its shapes: nothing to compile.)
  code = (
      "import sys\n"
      "import jax, numpy as np\n"
      "from experiments import cli, pretrain as script\n"
      "from m2jax.errors import UserError\n"
      "from m2jax.train import loop\n"
      "create = loop.state_lib.create_state\n"
      "def zeros(mcfg, tcfg, *args, **kwargs):\n"
      "  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),\n"
      "                      jax.eval_shape(lambda: create(mcfg, tcfg)))\n"
      "def broken(*args, **kwargs):\n"
      "  raise UserError('the first eval failed')\n"
      "loop.state_lib.create_state = zeros\n"
      "loop.evaluate = broken\n"
      "sys.argv = ['pretrain'] + sys.argv[1:]\n"
      "cli.run(script.main)\n")
  proc = _pretrain(tmp_path, "--override=num_layers=1", "--seq_len=16",
                   "--batch_size=2", code=code)
  assert _one_line_error(proc) == "error: the first eval failed"
  assert os.listdir(tmp_path / "run" / "tensorboard")  # the writer was open


def test_mtp_growth_refuses_a_used_workdir_before_any_work(tmp_path):
  # The phases of an earlier experiment: only base/ is reused.
  (tmp_path / "copy" / "joint" / "checkpoints" / "5").mkdir(parents=True)
  with pytest.raises(ExistingPathError, match=r"copy/joint\); only its base/ "
                     r"is reused: start a fresh --workdir"):
    mtp_growth.run_experiment(
        config_lib.TINY, DataConfig(), str(tmp_path), base_steps=2,
        growth_steps=3, depth=3, inits=("copy",), mtp_only_max_steps=1,
        learning_rate=1e-3, decay_fraction=0.75,
        settle=mtp_growth.Plateau(), progress=False)
  assert not (tmp_path / "base").exists()
