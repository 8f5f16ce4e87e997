"""Settings (how a step runs): validation, never saved with the model, part
of every jit cache key, and the one path from a flag to the layer."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from experiments import run_flags
from kernels.tree_attention import TreeAttentionConfig
from m2jax import config as config_lib
from m2jax import model, sharding
from m2jax.settings import Settings, SettingsError

CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=0)


@pytest.mark.parametrize("changes, field", [
    ({"attention": "flash"}, "attention"),
    ({"gmm_backend": "cuda"}, "gmm_backend"),
    ({"gmm_backend": "pallas"}, "gmm_backend"),
    ({"all_to_all": "nccl"}, "all_to_all"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"exchange_chunks": 0}, "exchange_chunks"),
    ({"loss_chunk": -1}, "loss_chunk"),
    ({"loss_impl": "remat"}, "loss_impl"),
    ({"interpret": "yes"}, "interpret"),
    ({"tree_attention": "mosaic"}, "tree_attention"),
    ({"tree_attention": TreeAttentionConfig(interpret=True)},
     "tree_attention"),
    # The Triton grouped matmul only runs interpreted (kernels/gmm.py).
    ({"gmm_backend": "triton"}, "gmm_backend"),
])
def test_validation_names_the_field(changes, field):
  with pytest.raises(SettingsError, match=f"Settings.{field}"):
    Settings(**changes)


def test_interpret_is_one_switch_for_both_kernels():
  s = Settings(tree_attention=TreeAttentionConfig(backend="triton"),
               interpret=True)
  assert s.tree_attention.interpret and s.tree_attention.backend == "triton"
  assert not Settings().tree_attention.interpret
  assert Settings(gmm_backend="triton", interpret=True).gmm_backend == "triton"


def test_replace_interpret_round_trips():
  """interpret lives on Settings only: replacing it reaches the kernel
  configs' copies both ways, and other fields survive."""
  on = Settings(interpret=True, remat=True,
                tree_attention=TreeAttentionConfig(backend="triton"))
  off = on.replace(interpret=False)
  assert not off.interpret
  assert not off.tree_attention.interpret
  assert not off.paged_attention.interpret
  assert off == Settings(remat=True,
                         tree_attention=TreeAttentionConfig(backend="triton"))
  assert off.replace(interpret=True) == on
  assert hash(off.replace(interpret=True)) == hash(on)
  # A kernel config given with the change takes the new value too.
  both = off.replace(interpret=True,
                     tree_attention=TreeAttentionConfig(backend="mosaic"))
  assert both.tree_attention.interpret and both.paged_attention.interpret
  with pytest.raises(SettingsError, match="Settings.interpret"):
    on.replace(interpret="no")


def test_settings_are_not_saved_with_the_model():
  cfg = CFG.replace(settings=Settings(gmm_backend="xla", remat=True))
  saved = config_lib.config_to_dict(cfg)
  assert "settings" not in saved
  assert config_lib.config_from_dict(config_lib.ModelConfig, saved) == \
      CFG.replace(settings=Settings())
  with pytest.raises(config_lib.ConfigError, match="expected FIELD=VALUE"):
    config_lib.apply_overrides(CFG, ["settings=remat"])
  # The old ModelConfig fields point at their new home.
  with pytest.raises(config_lib.ConfigError, match="Settings.attention"):
    config_lib.apply_overrides(CFG, ["attention_impl=xla"])


def test_settings_are_part_of_the_jit_cache_key():
  """Two configs that differ only in how they run never share a compiled
  function: the settings are in the static model config."""
  traces = []

  def f(cfg, x):
    traces.append(cfg.settings)
    return x * 2

  g = jax.jit(f, static_argnums=0)
  x = jnp.ones(3)
  a = CFG.replace(settings=Settings(capacity_factor=1.0))
  b = CFG.replace(settings=Settings(capacity_factor=2.0))
  g(a, x), g(b, x), g(a, x)
  assert traces == [a.settings, b.settings]
  assert hash(a) != hash(b) and a != b


def test_remat_setting_reaches_the_blocks():
  v = model.init(CFG, jax.random.key(0))
  tokens = jnp.arange(8)[None] % CFG.vocab_size

  def grad_jaxpr(cfg):
    loss = lambda p: model.logits(cfg, dict(v, params=p), tokens).sum()
    return str(jax.make_jaxpr(jax.grad(loss))(v["params"]))

  plain = grad_jaxpr(CFG)
  remat = grad_jaxpr(CFG.replace(settings=Settings(remat=True)))
  assert "remat" not in plain and "checkpoint" not in plain
  assert "remat" in remat or "checkpoint" in remat


def test_flags_build_the_settings():
  """--moe_capacity_factor and the other Settings flags arrive in one
  Settings, the value the model config carries to its layers."""
  fv = flags.FlagValues()
  run_flags.define(fv)
  fv(["prog", "--moe_capacity_factor=1.5", "--all_to_all=slabs",
      "--exchange_chunks=2", "--gmm_backend=mosaic", "--gmm_tiles=128.64.4",
      "--tree_attention=mosaic:128.64.64.3", "--attention=blockwise", "--remat",
      "--loss_chunk=256", "--loss_impl=recompute"])
  s = run_flags.settings_from_flags(fv)
  assert (s.capacity_factor, s.all_to_all, s.exchange_chunks) == (
      1.5, "slabs", 2)
  assert (s.gmm_backend, s.gmm_tiles.tile_n, s.gmm_tiles.stages) == (
      "mosaic", 128, 4)
  assert (s.tree_attention.backend, s.tree_attention.mosaic_stages) == (
      "mosaic", 3)
  assert s.attention == "blockwise" and s.remat and s.loss_chunk == 256
  assert s.loss_impl == "recompute"
  for bad, field in (("--gmm_tiles=1.2", "--gmm_tiles"),
                     ("--tree_attention=cuda:1.2", "--tree_attention"),
                     ("--gmm_backend=cuda", "Settings.gmm_backend")):
    fv = flags.FlagValues()
    run_flags.define(fv)
    fv(["prog", bad])
    with pytest.raises(SettingsError, match=field):
      run_flags.settings_from_flags(fv)


def test_ragged_decomposer_added_only_where_it_applies():
  flag = run_flags.RAGGED_DECOMPOSER_FLAG
  xla_flags_for = run_flags.xla_flags_for
  assert xla_flags_for("data=2,expert=4", "ragged", True) == flag
  assert xla_flags_for("expert=2", "ragged", True, "--a=1") == \
      f"--a=1 {flag}"
  # Not without expert parallelism, another exchange, when switched off, or
  # when the user already chose a value.
  for args in (("data=8", "auto", True), ("", "auto", True),
               ("expert=4", "slabs", True), ("expert=4", "dense", True),
               ("expert=4", "auto", True), ("expert=4", "allgather", True),
               ("expert=4", "ragged", False)):
    assert xla_flags_for(*args, "--a=1") == "--a=1", args
  mine = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=false"
  assert xla_flags_for("expert=4", "ragged", True, mine) == mine
  with pytest.raises(sharding.MeshError, match="expected AXIS=SIZE"):
    xla_flags_for("experts=4", "auto", True)


def test_gmm_settings_reach_the_experts(monkeypatch):
  """settings.gmm_backend and gmm_tiles are what the MoE hands the grouped
  matmul (recorded at the kernels' entry point)."""
  from kernels import gmm as gmm_lib  # pylint: disable=import-outside-toplevel
  from m2jax.model import moe  # pylint: disable=import-outside-toplevel
  seen = []
  real = gmm_lib.gmm

  def spy(*args, **kwargs):
    seen.append((kwargs["backend"], kwargs["tiles"], kwargs["interpret"]))
    return real(*args, **{**kwargs, "backend": "xla", "tiles": None,
                          "interpret": False})

  monkeypatch.setattr(moe, "gmm", spy)
  from kernels import gmm_mosaic  # pylint: disable=import-outside-toplevel
  tiles = gmm_mosaic.TileConfig(tile_n=128)
  cfg = CFG.replace(settings=Settings(gmm_backend="xla", gmm_tiles=tiles))
  v = model.init(cfg, jax.random.key(0))
  # One compiled forward (the spy sees the trace), not an op-by-op one.
  out = jax.jit(lambda v, t: model.logits(cfg, v, t))(
      v, jnp.zeros((1, 4), jnp.int32))
  assert np.isfinite(np.asarray(out)).all()
  assert seen and all(s == ("xla", tiles, False) for s in seen)


def test_from_flags_reads_the_given_flag_values(monkeypatch):
  """from_flags works on a test's own FlagValues (absl's FLAGS, unparsed
  here, is never read), and a script may give its own defaults."""
  jax.devices()  # XLA has read XLA_FLAGS: the value below is never parsed
  monkeypatch.setenv("XLA_FLAGS", "--a=1")
  fv = flags.FlagValues()
  run_flags.define(fv, moe_capacity_factor=1.5)
  fv(["prog", "--mesh=data=1", "--all_to_all=dense", "--exchange_chunks=2"])
  mesh, s = run_flags.from_flags(fv)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "sequence": 1,
                              "expert": 1, "tensor": 1}
  assert (s.capacity_factor, s.all_to_all, s.exchange_chunks) == (
      1.5, "dense", 2)
  assert run_flags.extend_xla_flags("expert=2", "ragged", True)
  assert os.environ["XLA_FLAGS"] == f"--a=1 {run_flags.RAGGED_DECOMPOSER_FLAG}"
  with pytest.raises(ValueError, match="capacity_factor"):
    run_flags.define(flags.FlagValues(), capacity_factor=1.5)


def test_a_run_saved_before_the_move_to_settings_still_reads():
  """A saved model config holding fields that moved to Settings (a run made
  before the move) reads with a warning and matches its checkpoints; an
  override naming such a field is still refused."""
  from m2jax.train import checkpoint  # pylint: disable=import-outside-toplevel
  saved = dict(config_lib.config_to_dict(CFG), remat=True, gmm_backend="xla",
               attention_impl="xla")
  with pytest.warns(UserWarning, match="ignoring.*remat.*Settings"):
    got = config_lib.config_from_dict(config_lib.ModelConfig, saved)
  assert got == CFG
  assert checkpoint.config_differences(saved, CFG) == []
  with pytest.raises(config_lib.ConfigError, match="Settings.remat"):
    config_lib.apply_overrides(CFG, ["remat=true"])
  # Other unknown fields are still refused.
  with pytest.raises(config_lib.ConfigError, match="unknown fields"), \
       pytest.warns(UserWarning):
    config_lib.config_from_dict(config_lib.ModelConfig,
                                dict(saved, no_such_field=1))
