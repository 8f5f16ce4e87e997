"""GNMR (m2jax.train.gnmr): detection, actions, budget, lock, non-finite
gradients, one compile; the fp8 path (m2jax.train.precision); and a short
stress run of the harness (benchmarks.gnmr_stress) on a real model."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks import gnmr_stress
from m2jax import config as config_lib
from m2jax import model
from m2jax.config import ConfigError
from m2jax.data import DataConfig
from m2jax.model.attention import Attention
from m2jax.model.moe import MoE
from m2jax.train import gnmr, precision
from m2jax.train.config import GNMRConfig, TrainConfig

# Five units: a q projection, three experts of a stacked w1, a norm gain.
AXES = {"attn": {"q_proj": P("embed", "q_heads", "head_dim")},
        "moe": {"w1": P("expert", "embed", "expert_mlp")},
        "norm": {"scale": P("norm")}}
SHAPES = {"attn": {"q_proj": (4, 2, 3)}, "moe": {"w1": (3, 4, 5)},
          "norm": {"scale": (4,)}}
UNIT_SCALE = [1.0, 0.1, 0.2, 0.3, 0.01]  # each unit's typical size
Q, W1, SCALE = 0, 1, 4                   # unit index of q_proj, w1[0], gain
CFG = GNMRConfig(warmup_steps=5, max_recovering=2, lock_steps=3)


def _zeros():
  return jax.tree.map(lambda s: np.zeros(s, np.float32), SHAPES,
                      is_leaf=lambda x: isinstance(x, tuple))


LAYOUT = gnmr.layout(AXES, _zeros())


def _grads(rng, factor=None):
  """Gradients of the usual size per unit, times factor[U] (inf/nan ok)."""
  factor = np.ones(LAYOUT.size) if factor is None else np.asarray(factor)
  size = np.asarray(UNIT_SCALE, np.float32) * factor.astype(np.float32)
  noise = jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32),
                       SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  with np.errstate(invalid="ignore"):
    return jax.tree.map(lambda n, f: n * np.asarray(f), noise,
                        LAYOUT.per_leaf(size, noise))


@functools.lru_cache(maxsize=None)
def _update(config: GNMRConfig):
  tx = gnmr.gnmr(config, AXES)
  return tx, jax.jit(tx.update)


def _warm(config=CFG, steps=12, seed=0):
  """(rng, state) after `steps` clean steps."""
  tx, update = _update(config)
  rng = np.random.default_rng(seed)
  state = tx.init(_zeros())
  for _ in range(steps):
    _, state = update(_grads(rng), state)
  return rng, state


def _units(tree):
  """[U] norms of a tree (numpy)."""
  return np.asarray(LAYOUT.norms(tree))


def test_layout_splits_experts_and_names_units():
  assert LAYOUT.unit_names() == ["attn/q_proj", "moe/w1[0]", "moe/w1[1]",
                                 "moe/w1[2]", "norm/scale"]
  g = _grads(np.random.default_rng(0))
  want = [np.linalg.norm(g["attn"]["q_proj"])] + [
      np.linalg.norm(g["moe"]["w1"][e]) for e in range(3)] + [
          np.linalg.norm(g["norm"]["scale"])]
  np.testing.assert_allclose(_units(g), want, rtol=1e-5)


def test_spike_in_one_expert_is_skipped_and_a_rise_clipped():
  rng, state = _warm()
  _, update = _update(CFG)
  factor = np.ones(LAYOUT.size)
  factor[W1 + 1] = 1000.0                 # one expert of the stacked tensor
  g = _grads(rng, factor)
  out, state = update(g, state)
  w1 = np.asarray(out["moe"]["w1"])
  assert np.all(w1[1] == 0)               # skipped: GNMR >= skip_ratio
  np.testing.assert_array_equal(w1[[0, 2]], g["moe"]["w1"][[0, 2]])
  np.testing.assert_array_equal(out["attn"]["q_proj"], g["attn"]["q_proj"])
  np.testing.assert_array_equal(out["norm"]["scale"], g["norm"]["scale"])
  m = state.metrics
  assert (m["triggered"], m["admitted"], m["skipped"], m["clipped"]) == (
      1, 1, 1, 0)
  assert int(state.action_U[W1 + 1]) == gnmr.SKIP
  assert float(m["max_ratio"]) > 500

  # A 20x rise (under skip_ratio) on q_proj: clipped to its history's
  # mean norm, direction kept.
  n = int(state.count_U[Q])
  mean_q = float(state.mean_U[Q]) / (1 - CFG.history_decay ** n)
  factor = np.ones(LAYOUT.size)
  factor[Q] = 20.0
  g = _grads(rng, factor)
  out, state = update(g, state)
  got, raw = np.asarray(out["attn"]["q_proj"]), g["attn"]["q_proj"]
  assert int(state.action_U[Q]) == gnmr.CLIP
  np.testing.assert_allclose(np.linalg.norm(got), CFG.clip_to * mean_q,
                             rtol=1e-5)
  np.testing.assert_allclose(got / np.linalg.norm(got),
                             raw / np.linalg.norm(raw), atol=1e-6)


@functools.lru_cache(maxsize=None)
def _adam(with_gnmr: bool):
  """(optimizer, jitted step) of the global clip and Adam, GNMR first."""
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  if with_gnmr:
    opt = optax.chain(gnmr.gnmr(CFG, AXES), opt)

  def step(grads, state, params):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return opt, jax.jit(step)


def test_spike_through_adamw_is_a_skipped_gradient():
  """Chained before the global clip and Adam (make_optimizer's order), a
  1000x spike in one unit trains exactly as if that unit's gradient had
  been dropped: the other units' steps are not shrunk by the clip."""
  def run(with_gnmr, spike):
    opt, step = _adam(with_gnmr)
    params = jax.tree.map(lambda x: x + 1.0, _zeros())
    state = opt.init(params)
    rng = np.random.default_rng(0)
    for i in range(14):
      factor = np.ones(LAYOUT.size)
      if i == 12:
        factor[Q] = spike
      params, state = step(_grads(rng, factor), state, params)
    return params

  recovered = run(True, 1000.0)
  dropped = run(False, 0.0)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(recovered))
  jax.tree.map(np.testing.assert_array_equal, recovered, dropped)
  unguarded = run(False, 1000.0)
  assert not np.allclose(unguarded["moe"]["w1"], dropped["moe"]["w1"],
                         rtol=1e-4)


def test_nonfinite_gradients_are_skipped_without_touching_history():
  # During warm-up and with no budget at all: skipping is never optional,
  # while a finite spike passes (a unit triggers only once warm).
  config = GNMRConfig(warmup_steps=5, max_recovering=0)
  rng, state = _warm(config, steps=2)
  _, update = _update(config)
  factor = np.ones(LAYOUT.size)
  factor[Q], factor[W1 + 2], factor[SCALE] = np.inf, np.nan, 1000.0
  g = _grads(rng, factor)
  out, new = update(g, state)
  np.testing.assert_array_equal(out["norm"]["scale"], g["norm"]["scale"])
  assert int(new.metrics["triggered"]) == 0
  assert np.all(np.asarray(out["attn"]["q_proj"]) == 0)
  w1 = np.asarray(out["moe"]["w1"])
  assert np.all(w1[2] == 0) and np.all(np.isfinite(w1))
  assert int(new.metrics["nonfinite"]) == 2
  assert int(new.metrics["skipped"]) == 2
  for u in (Q, W1 + 2):
    assert int(new.count_U[u]) == int(state.count_U[u])
    assert float(new.mean_U[u]) == float(state.mean_U[u])
    assert int(new.action_U[u]) == gnmr.NONFINITE
  assert int(new.count_U[W1]) == int(state.count_U[W1]) + 1
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new))


def test_budget_admits_the_most_severe_and_never_more():
  rng, state = _warm()
  _, update = _update(CFG)
  # Every unit spiked at once, by different factors: maxO = 2 take the
  # two most severe (w1[1] x 900 and norm/scale x 600).
  factor = np.array([30.0, 200.0, 900.0, 50.0, 600.0])
  g = _grads(rng, factor)
  out, state = update(g, state)
  m = state.metrics
  assert (m["triggered"], m["admitted"], m["refused"], m["recovering"]) == (
      5, 2, 3, 2)
  handled = set(np.flatnonzero(np.asarray(state.action_U)))
  assert handled == {W1 + 1, SCALE}
  np.testing.assert_array_equal(out["attn"]["q_proj"], g["attn"]["q_proj"])
  # The next step, spiking the refused units again: the budget is held by
  # the locked two, so none enters and the recovering count stays 2.
  factor = np.array([50.0, 300.0, 1.0, 80.0, 1.0])
  for _ in range(CFG.lock_steps - 1):
    _, state = update(_grads(rng, factor), state)
    assert int(state.metrics["recovering"]) == 2
    assert int(state.metrics["admitted"]) == 0
  # The locks have run out: the two most severe of the three enter.
  _, state = update(_grads(rng, factor), state)
  assert int(state.metrics["admitted"]) == 2
  assert set(np.flatnonzero(np.asarray(state.lock_U))) == {W1, W1 + 2}


def test_lock_interval_holds_a_unit_for_lock_steps():
  rng, state = _warm()
  _, update = _update(CFG)
  spike = np.ones(LAYOUT.size)
  spike[Q] = 1000.0
  _, state = update(_grads(rng, spike), state)
  assert int(state.metrics["admitted"]) == 1
  in_recovery = [bool(gnmr.recovering((state,))[Q])]
  # Inside the lock, another spike is handled without a new admission.
  _, state = update(_grads(rng, spike), state)
  assert int(state.metrics["admitted"]) == 0
  assert int(state.action_U[Q]) == gnmr.SKIP
  assert int(state.metrics["recovering"]) == 1
  in_recovery.append(bool(gnmr.recovering((state,))[Q]))
  _, state = update(_grads(rng), state)
  assert int(state.metrics["recovering"]) == 1     # the lock's last step
  in_recovery.append(bool(gnmr.recovering((state,))[Q]))
  assert in_recovery == [True, True, False]         # lock_steps = 3
  _, state = update(_grads(rng), state)
  assert int(state.metrics["recovering"]) == 0
  _, state = update(_grads(rng, spike), state)      # out of the lock
  assert int(state.metrics["admitted"]) == 1


def test_update_compiles_once():
  traces = []
  tx = gnmr.gnmr(CFG, AXES)

  def update(g, s):
    traces.append(1)
    return tx.update(g, s)

  step = jax.jit(update)
  rng = np.random.default_rng(0)
  state = tx.init(_zeros())
  for i in range(8):
    factor = np.ones(LAYOUT.size)
    factor[i % LAYOUT.size] = [1.0, 1000.0, np.inf][i % 3]
    _, state = step(_grads(rng, factor), state)
  assert len(traces) == 1


def test_config_is_validated_and_saved():
  with pytest.raises(ConfigError, match=r"^GNMRConfig.ratio_threshold: must "
                     r"be > 1 .*\(got 0.5\)$"):
    GNMRConfig(ratio_threshold=0.5)
  with pytest.raises(ConfigError, match="GNMRConfig.skip_ratio"):
    GNMRConfig(skip_ratio=3.0)
  with pytest.raises(ConfigError, match="TrainConfig.gnmr"):
    TrainConfig(gnmr="on")
  tcfg = TrainConfig(gnmr=GNMRConfig(lock_steps=4))
  back = config_lib.config_from_dict(TrainConfig,
                                     config_lib.config_to_dict(tcfg))
  assert back == tcfg and isinstance(back.gnmr, GNMRConfig)


# A one-layer MoE model: the fp8 path and the stress run.
MCFG = config_lib.apply_overrides(config_lib.TINY, [
    "num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
    "head_dim=8", "rotary_dim=4", "num_experts=4",
    "moe_intermediate_size=16"])


def test_fake_fp8_and_the_higher_precision_path():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)),
                  jnp.float32)
  q = precision.fake_fp8(x)
  assert not np.array_equal(q, x)
  np.testing.assert_allclose(q, x, rtol=0.07, atol=1e-2)
  np.testing.assert_array_equal(precision.fake_fp8(q), q)  # on the grid
  np.testing.assert_array_equal(
      jax.grad(lambda v: jnp.sum(precision.fake_fp8(v) * 3.0))(x), 3.0)

  variables = model.init(MCFG, jax.random.key(0))
  tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 200)

  @jax.jit
  def inputs(attn_high):
    """The inputs Attention and MoE compute with, k_proj in recovery or
    not."""
    seen = {}

    def record(next_fun, args, kwargs, context):
      if isinstance(context.module, (Attention, MoE)):
        seen["/".join(context.module.path)] = args[0]
      return next_fun(*args, **kwargs)

    high = {"layers_0/attn/k_proj": attn_high}
    with precision.fp8_projection_inputs(high), nn.intercept_methods(record):
      model.forward(MCFG, variables, tokens)
    return seen

  # On the fp8 grid: rounding again moves nothing (beyond float32 noise).
  on_grid = lambda a: np.allclose(precision.fake_fp8(a), a, rtol=1e-5,
                                  atol=0)
  low, high = inputs(jnp.asarray(False)), inputs(jnp.asarray(True))
  assert on_grid(low["layers_0/attn"]) and on_grid(low["layers_0/moe"])
  # k_proj in recovery: the attention input (q, k and v's) is full
  # precision, the MoE's stays fp8.
  assert not on_grid(high["layers_0/attn"])
  assert on_grid(high["layers_0/moe"])


def _corpus(tmp_path) -> str:
  """40 documents of 60 words drawn from a small vocabulary (JSONL)."""
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "\n"]
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(
      json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n"
      for _ in range(40)))
  return str(path)


def test_stress_run_recovers_spikes_and_infs(tmp_path):
  """Clean and stressed runs of a real model, GNMR on: few false triggers,
  every fault handled within the budget, the final loss near the clean
  run's (benchmarks/notes/gnmr.md has the full-size runs)."""
  steps = 120
  dcfg = DataConfig(source=_corpus(tmp_path), seq_len=32, batch_size=4,
                    validation_fraction=0.2)
  # Final loss: the last 12 train losses, on the same batches in both runs.
  harness = gnmr_stress.Harness(MCFG, dcfg, steps=steps, eval_batches=0)
  gcfg = GNMRConfig()
  tcfg = TrainConfig(steps=steps, learning_rate=3e-3, warmup_steps=10,
                     gnmr=gcfg)
  faults = (gnmr_stress.Fault(70, "layers_0/attn/q_proj", "spike"),
            gnmr_stress.Fault(80, "layers_0/moe/w1[2]", "spike"),
            gnmr_stress.Fault(90, "layers_0/moe/w2[1]", "inf"),
            gnmr_stress.Fault(95, "embedding", "nan"))
  runs = [harness.run(tcfg, gnmr_stress.Scenario("clean")),
          harness.run(tcfg, gnmr_stress.Scenario("faults", faults))]
  result = gnmr_stress.report(runs, harness.layout, gcfg)
  clean, stressed = result["runs"]
  assert clean["trigger_rate"] <= 0.005
  assert stressed["params_finite"] and stressed["budget_held"]
  assert [f["action"] for f in stressed["faults"]] == [
      "skip", "skip", "skip (non-finite)", "skip (non-finite)"]
  assert abs(stressed["train_loss_last10pct_rel_to_clean"]) <= 0.01
  assert stressed["unit_steps"] == harness.layout.size * steps


def test_the_training_scripts_gnmr_flag():
  """--gnmr: unset is off, 'on' the defaults, FIELD=VALUE overrides, and a
  field GNMRConfig lacks is a one-line error naming the choices."""
  from experiments import train_flags
  assert train_flags.parse_gnmr(None) is None
  assert train_flags.parse_gnmr(["on"]) == GNMRConfig()
  got = train_flags.parse_gnmr(["on", "max_recovering=4", "lock_steps=20"])
  assert (got.max_recovering, got.lock_steps) == (4, 20)
  with pytest.raises(ConfigError, match="max_recovering"):
    train_flags.parse_gnmr(["max_recover=4"])
