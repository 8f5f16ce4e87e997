"""MTP growth (m2jax.train.mtp_growth): the copy rule, Plateau, the MTP-only
phase's backward, and the phases continuing one optimizer and schedule."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.data import DataConfig
from m2jax.model.layers import positions_from_segments
from m2jax.train import losses, mtp_growth, optim, schedules
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import read_metrics

SMALL = ["num_layers=1", "hidden_size=32", "num_heads=4", "num_kv_heads=2",
         "head_dim=8", "rotary_dim=4", "num_experts=4",
         "moe_intermediate_size=16"]
MCFG = config_lib.apply_overrides(config_lib.TINY, SMALL)


def _batch(seed=0, rows=2, length=16):
  """Random tokens in two documents per row."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, MCFG.vocab_size, (rows, length), dtype=np.int32)
  segment_ids = np.ones((rows, length), np.int32)
  segment_ids[:, length // 2:] = 2
  return {"tokens": tokens, "segment_ids": segment_ids,
          "positions": np.asarray(positions_from_segments(segment_ids))}


def _random_variables(mcfg, seed=0):
  """Variables of `mcfg`, every leaf distinct random values (model.init
  takes seconds to compile on CPU), as device arrays."""
  shapes = jax.eval_shape(lambda: model.init(mcfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(
      rng.normal(scale=0.1, size=s.shape).astype(s.dtype)), shapes)


def _objective(mcfg, tcfg, batch, step=0):
  """The train step's loss as a function of (params, expert_bias)."""
  return lambda params, bias: step_lib._loss_fn(  # pylint: disable=W0212
      params, bias, batch, step, mcfg=mcfg, tcfg=tcfg)[0]


def _count_dots(jaxpr) -> int:
  """dot_general (and ragged_dot) equations, sub-jaxprs included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += "dot" in eqn.primitive.name
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          n += _count_dots(sub)
  return n


# The MTP-only phase: no backward through the frozen main model.

def test_mtp_only_gradient_stops_at_the_frozen_main_model():
  tcfg = TrainConfig(mtp_only=True, aux_loss_coef=1e-2, z_loss_coef=1e-3)
  variables = _random_variables(MCFG)
  batch = _batch()
  grads = jax.jit(jax.grad(_objective(MCFG, tcfg, batch)))(
      variables["params"], variables[model.EXPERT_BIAS])

  def reference(params):
    """The same objective, the main model differentiated through."""
    out = model.forward(MCFG, {**variables, "params": params},
                        batch["tokens"], segment_ids=batch["segment_ids"],
                        positions=batch["positions"], mtp_depth=1)
    return losses.total_loss(
        out, batch, mtp_weight=schedules.mtp_weight(tcfg, 0),
        aux_coef=tcfg.aux_loss_coef, z_coef=tcfg.z_loss_coef,
        main_weight=0.0)[0]

  ref = jax.jit(jax.grad(reference))(variables["params"])
  for name in ref:
    if name.startswith("mtp_"):
      # The trunk is frozen either way: MTP's own gradient is unchanged (to
      # float32 summation order: the train step's fused loss accumulates
      # d lm_head chunk by chunk, the dispatch sums a token's K copies in
      # its own order; gradients here are ~1e-4, an element that cancels
      # to ~1e-6 may differ by ~1e-10).
      jax.tree.map(lambda a, b: np.testing.assert_allclose(
          a, b, rtol=1e-5, atol=1e-9), grads[name], ref[name])
    else:
      assert all(not np.any(g) for g in jax.tree.leaves(grads[name])), name
  # Without the stop the MTP loss reaches the trunk, embedding and head.
  for name in ("layers_0", "embedding", "lm_head"):
    assert any(np.any(g) for g in jax.tree.leaves(ref[name])), name


def test_mtp_only_backward_does_not_grow_with_the_trunk():
  """The dot products of the gradient beyond the forward's are the MTP
  module's backward alone: the same for a 1- and a 3-layer main model."""
  batch = _batch()
  backward = {}
  for mtp_only in (True, False):
    tcfg = TrainConfig(mtp_only=mtp_only, aux_loss_coef=1e-2)
    for layers in (1, 3):
      mcfg = MCFG.replace(num_layers=layers)
      variables = jax.eval_shape(
          lambda c=mcfg: model.init(c, jax.random.key(0)))
      args = variables["params"], variables[model.EXPERT_BIAS]
      loss = _objective(mcfg, tcfg, batch)
      forward = _count_dots(jax.make_jaxpr(loss)(*args).jaxpr)
      grad = _count_dots(jax.make_jaxpr(jax.grad(loss))(*args).jaxpr)
      backward[mtp_only, layers] = grad - forward
  assert backward[True, 1] == backward[True, 3] > 0, backward
  # The count does see a trunk's backward where there is one.
  assert backward[False, 3] > backward[False, 1] > backward[True, 1], backward


# grow_mtp: which weights go where.

def _same_values(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                           jax.tree.leaves(b)))


def _buffers(tree) -> set:
  return {x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)}


def test_grow_mtp_copy_rule():
  mcfg = MCFG.replace(num_layers=2)
  variables = _random_variables(mcfg)
  params, bias = variables["params"], variables[model.EXPERT_BIAS]
  before = {k: dict(v) for k, v in variables.items()}
  new_cfg, grown = mtp_growth.grow_mtp(mcfg, variables, 3)
  assert new_cfg == mcfg.replace(num_mtp_modules=3)
  # The grown variables are exactly a 3-module model's layout.
  want = jax.eval_shape(lambda: model.init(new_cfg, jax.random.key(0)))
  assert jax.tree.structure(grown) == jax.tree.structure(want)
  new_p, new_b = grown["params"], grown[model.EXPERT_BIAS]
  seen = set()
  for name in ("mtp_1", "mtp_2"):
    # block_0 <- the main model's *last* layer, expert bias included.
    assert _same_values(new_p[name]["block_0"], params["layers_1"])
    assert not _same_values(new_p[name]["block_0"], params["layers_0"])
    assert _same_values(new_b[name]["block_0"], bias["layers_1"])
    # proj and both norms <- MTP module 1.
    rest = {k: v for k, v in new_p[name].items() if k != "block_0"}
    assert set(rest) == {"proj", "embed_norm", "hidden_norm"}
    assert _same_values(rest, {k: params["mtp_0"][k] for k in rest})
    # Copies: no buffer shared with a source or with another new module.
    mine = _buffers(new_p[name]) | _buffers(new_b[name])
    assert not mine & (_buffers(variables) | seen), name
    seen |= mine
  # The main model and module 1 are passed through untouched, and the
  # caller's tree is not modified.
  for name, value in params.items():
    assert new_p[name] is value, name
  for name, value in bias.items():
    assert new_b[name] is value, name
  assert {k: dict(v) for k, v in variables.items()} == before


def test_grow_mtp_random_init_and_errors():
  mcfg = MCFG.replace(num_layers=2)
  variables = _random_variables(mcfg)
  new_cfg, grown = mtp_growth.grow_mtp(mcfg, variables, 3, init="random",
                                       rng=jax.random.key(7))
  fresh = model.init(new_cfg, jax.random.key(7))
  for name in ("mtp_1", "mtp_2"):
    assert _same_values(grown["params"][name], fresh["params"][name])
    assert _same_values(grown[model.EXPERT_BIAS][name],
                        fresh[model.EXPERT_BIAS][name])
  assert _same_values(grown["params"]["mtp_0"], variables["params"]["mtp_0"])
  assert _same_values(grown["params"]["layers_1"],
                      variables["params"]["layers_1"])

  with pytest.raises(ValueError, match="must exceed"):
    mtp_growth.grow_mtp(mcfg, variables, 1)
  with pytest.raises(ValueError, match="init must be one of"):
    mtp_growth.grow_mtp(mcfg, variables, 3, init="zeros")
  no_mtp = mcfg.replace(num_mtp_modules=0)
  with pytest.raises(ValueError, match="needs an existing MTP module"):
    mtp_growth.grow_mtp(no_mtp, _random_variables(no_mtp), 3)
  hub_like = {"params": {k: v for k, v in variables["params"].items()
                         if k != "mtp_0"}}  # hub checkpoints ship no MTP
  with pytest.raises(ValueError, match=r"no parameters for MTP modules"):
    mtp_growth.grow_mtp(mcfg, hub_like, 3)


# Plateau: when the MTP-only phase ends.

def test_plateau_settles_exactly_when_the_ema_stops_improving():
  # decay 0.5: EMA of 8, 4, 4, 4, 4, 4 is 8, 6, 5, 4.5, 4.25, 4.125; over
  # 2 updates it improves by 3, 1.5, 0.75, 0.375: relative 0.375, 0.25,
  # 0.15, 0.083 of the EMA 2 updates back.
  p = mtp_growth.Plateau(window=2, tol=0.2, decay=0.5)
  assert [p.update(x) for x in (8, 4, 4, 4, 4, 4)] == [
      False, False, False, False, True, True]
  assert p.settled
  # Nothing is settled before `window` updates, however flat.
  p = mtp_growth.Plateau(window=3, tol=0.5, decay=0.5)
  assert [p.update(1.0) for _ in range(5)] == [False] * 3 + [True] * 2
  # "Less than tol": an improvement of exactly tol is not settled (8 -> 6
  # is 0.25 of 8, exact in floating point).
  for tol, settled in ((0.25, False), (0.2501, True)):
    p = mtp_growth.Plateau(window=1, tol=tol, decay=0.5)
    assert [p.update(8.0), p.update(4.0)] == [False, settled]
  # A rising loss has settled too.
  p = mtp_growth.Plateau(window=1, tol=0.0, decay=0.5)
  assert [p.update(1.0), p.update(2.0)] == [False, True]


def test_plateau_rejects_bad_settings():
  for kwargs, field in (({"window": 0}, "window"), ({"tol": -0.1}, "tol"),
                        ({"decay": 1.0}, "decay")):
    with pytest.raises(ValueError, match=f"Plateau.{field}"):
      mtp_growth.Plateau(**kwargs)


# One optimizer and one schedule across the phases.

def _moments(state):
  """{name: (mu, nu)} of Adam's moments per top-level variable (the MTP-only
  optimizer holds none for the frozen ones)."""
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  nu = optax.tree_utils.tree_get(state.opt_state, "nu")
  return {k: (mu[k], nu[k]) for k in mu if jax.tree.leaves(mu[k])}


def _counts(state) -> list[int]:
  return [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(
      state.opt_state, "count")]


def _trained(mcfg, tcfg, variables, step, seed):
  """A state as if trained `step` steps: random moments, counts = step."""
  state = state_lib.init_state(mcfg, tcfg, variables)
  rng = np.random.default_rng(seed)
  opt_state = jax.tree.map(
      lambda x: (np.full(x.shape, step, x.dtype) if x.ndim == 0 else
                 rng.random(x.shape).astype(x.dtype)), state.opt_state)
  return state._replace(step=jnp.asarray(step, jnp.int32),
                        opt_state=opt_state)


def test_carry_state_keeps_moments_and_the_step_count():
  schedule = mtp_growth.growth_schedule(
      base_steps=7, growth_steps=5, learning_rate=1e-3, decay_fraction=0.5)
  base_tc = schedule.replace(mtp_depth=1)
  mtp_only_tc = schedule.replace(mtp_depth=3, mtp_only=True)
  joint_tc = schedule.replace(mtp_depth=3)
  base = _trained(MCFG, base_tc, _random_variables(MCFG), 7, seed=1)
  grown_cfg, grown = mtp_growth.grow_mtp(MCFG, state_lib.variables_of(base), 3)

  # Growth -> MTP only: the step count goes on (no second warm-up); module
  # 1 keeps its moments, the new modules start at zero.
  start_a = mtp_growth.carry_state(grown_cfg, mtp_only_tc, grown, (base_tc, base))
  assert int(start_a.step) == 7 and set(_counts(start_a)) == {7}
  moments = _moments(start_a)
  assert sorted(moments) == ["mtp_0", "mtp_1", "mtp_2"]
  assert _same_values(moments["mtp_0"], _moments(base)["mtp_0"])
  for name in ("mtp_1", "mtp_2"):
    assert not any(np.any(x) for x in jax.tree.leaves(moments[name]))

  # MTP only -> joint: the main model's moments come back as the base run
  # left them (frozen in between), MTP's are the MTP-only phase's.
  end_a = _trained(grown_cfg, mtp_only_tc, grown, 9, seed=2)
  start_b = mtp_growth.carry_state(grown_cfg, joint_tc, grown, (mtp_only_tc, end_a),
                                   (base_tc, base))
  assert int(start_b.step) == 9 and set(_counts(start_b)) == {9}
  moments, before, mtp = _moments(start_b), _moments(base), _moments(end_a)
  assert set(moments) == set(grown["params"])
  for name, value in moments.items():
    assert _same_values(value, mtp[name] if name.startswith("mtp_")
                        else before[name]), name
  # The carried state is one the joint train step takes as it is.
  assert jax.tree.structure(start_b) == jax.tree.structure(
      state_lib.init_state(grown_cfg, joint_tc, grown))


def _corpus(tmp_path):
  d = tmp_path / "corpus"
  d.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "\n"]
  for i in range(40):
    (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 60)))
  return str(d)


def test_experiment_continues_one_schedule_and_runs_both_arms(
    tmp_path, monkeypatch):
  calls = {}

  def recording_pretrain(mcfg, tcfg, dcfg, workdir, **kwargs):
    init = kwargs.get("init_state")
    if init is not None:
      init = jax.tree.map(np.array, init)  # the phase donates it
    out = pretrain(mcfg, tcfg, dcfg, workdir, **kwargs)
    name = os.path.relpath(workdir, tmp_path / "exp")
    calls[name] = (tcfg, init, jax.tree.map(np.array, out["state"]))
    return out

  monkeypatch.setattr(mtp_growth, "pretrain", recording_pretrain)
  dcfg = DataConfig(source=_corpus(tmp_path), seq_len=32, batch_size=2,
                    validation_fraction=0.2)
  # Steps 0-2 base (warm-up 0-1, decay from step 2), 3-4 MTP only (it
  # settles at its 2nd update: window 1, any improvement < 100x), 5-6 each
  # arm.
  kwargs = dict(base_steps=3, growth_steps=4, depth=2, inits=("copy",),
                mtp_only_max_steps=3, learning_rate=1e-2, decay_fraction=0.75,
                warmup_steps=2, settle=mtp_growth.Plateau(1, tol=100.0))
  results = mtp_growth.run_experiment(MCFG, dcfg, str(tmp_path / "exp"),
                                      progress=False, **kwargs)
  schedule = calls["base"][0].replace(mtp_depth=0)
  assert schedule.steps == 7 and schedule.decay_start == 2
  run = results["runs"]["copy"]
  assert run["mtp_only_steps"] == 2 and run["settled"]

  base_end = calls["base"][2]
  a_tc, a_start, a_end = calls["copy/mtp_only"]
  b_tc, b_start, b_end = calls["copy/joint"]
  c_tc, c_start, c_end = calls["copy/mtp_only_to_end"]
  assert a_tc.mtp_only and c_tc == a_tc and not b_tc.mtp_only
  # Each phase starts at the step (and optimizer count) where the last
  # stopped; both arms end at the schedule's end: the same budget.
  assert [int(s.step) for s in (base_end, a_start, a_end, b_start, c_start,
                                b_end, c_end)] == [3, 3, 5, 5, 5, 7, 7]
  for state in (a_start, b_start, c_start):
    assert set(_counts(state)) == {int(state.step)}
  # The lr and MTP weight the phases trained at are the schedule's at the
  # global step: no warm-up, no re-annealing from 0.3.
  lines = {name: [l for l in read_metrics(tmp_path / "exp" / name)
                  if "loss" in l] for name in calls}
  lr = schedules.learning_rate(schedule)
  for name, first in (("copy/mtp_only", 3), ("copy/joint", 5),
                      ("copy/mtp_only_to_end", 5)):
    steps = range(first, first + len(lines[name]))
    np.testing.assert_allclose([l["lr"] for l in lines[name]],
                               [lr(s) for s in steps], rtol=1e-6)
    np.testing.assert_allclose(
        [l["mtp/weight"] for l in lines[name]],
        [schedules.mtp_weight(schedule, s) for s in steps], rtol=1e-6)
  # Step 3 is the decay's 2nd of 5 steps (the last, step 6, is at the floor).
  first = lines["copy/mtp_only"][0]
  np.testing.assert_allclose([first["lr"], first["mtp/weight"]],
                             [1e-2 * (1 - 0.9 * 2 / 5), 0.3 - 0.2 * 2 / 5],
                             rtol=1e-6)
  assert results["schedule"]["growth"] == {
      "step": 3, "lr": pytest.approx(first["lr"], rel=1e-6),
      "mtp_weight": pytest.approx(first["mtp/weight"], rel=1e-6)}
  # Moments: the main model's at the start of the joint phase are those
  # at the end of the MTP-only phase (which kept them frozen) = the base
  # run's last; MTP's continue from the MTP-only phase.
  before, mtp, joint = _moments(base_end), _moments(a_end), _moments(b_start)
  for name, value in joint.items():
    assert _same_values(value, mtp[name] if name.startswith("mtp_")
                        else before[name]), name
  assert _same_values(c_start, a_end)
  # The negative arm leaves the main model as it was; the joint arm trains
  # it.
  assert run["after_mtp_only_to_end"]["main_ce"] == (
      run["after_mtp_only"]["main_ce"])
  assert run["after_joint"]["main_ce"] != run["after_mtp_only"]["main_ce"]
  table = mtp_growth.format_table(json.loads(json.dumps(results)))
  for phase, steps in (("after_mtp_only", 2), ("after_joint", 4),
                       ("after_mtp_only_to_end", 4)):
    assert re.search(rf"copy\s+{phase}\s+{steps}\s", table), table

  grown_config = MCFG.replace(num_mtp_modules=2)
  with pytest.raises(ValueError, match="init_state does not have the layout"):
    pretrain(grown_config, b_tc, dcfg, str(tmp_path / "wrong"),
             init_state=base_end, progress=False)

  with pytest.raises(ValueError, match="decay phase"):
    mtp_growth.run_experiment(MCFG, dcfg, str(tmp_path / "never"),
                              **dict(kwargs, decay_fraction=0.3))
  with pytest.raises(ValueError, match="mtp_only_max_steps"):
    mtp_growth.run_experiment(MCFG, dcfg, str(tmp_path / "never"),
                              **dict(kwargs, mtp_only_max_steps=4))
  assert not (tmp_path / "never").exists()


def test_carry_state_with_muon_and_refuses_to_carry_nothing():
  """Under Muon (Muon and AdamW families, masked leaves in each) every
  moment of an existing parameter and every step count is carried, the new
  modules' moments start at zero; an optimizer change that leaves nothing
  to carry is refused."""
  schedule = mtp_growth.growth_schedule(
      base_steps=7, growth_steps=5, learning_rate=1e-3, decay_fraction=0.5)
  base_tc = schedule.replace(mtp_depth=1, optimizer="muon")
  mtp_only_tc = base_tc.replace(mtp_depth=3, mtp_only=True)
  base = _trained(MCFG, base_tc, _random_variables(MCFG), 7, seed=1)
  grown_cfg, grown = mtp_growth.grow_mtp(MCFG, state_lib.variables_of(base), 3)
  start = mtp_growth.carry_state(grown_cfg, mtp_only_tc, grown,
                                 (base_tc, base))
  assert int(start.step) == 7 and set(_counts(start)) == {7}
  flat = lambda tc, s: {
      jax.tree_util.keystr(p): x for p, x in
      jax.tree_util.tree_flatten_with_path(
          optim.joint_opt_state(tc, s.opt_state), is_leaf=optim.is_masked)[0]
      if not optim.is_masked(x)}
  before, after = flat(base_tc, base), flat(mtp_only_tc, start)
  new = [p for p in after if "'mtp_1'" in p or "'mtp_2'" in p]
  is_muon = lambda p: "['muon']" in p and ".mu[" in p
  muon_new = [p for p in new if is_muon(p)]
  assert muon_new and all(not np.any(after[p]) for p in new)
  kept = [p for p in after if p not in new]
  assert any(is_muon(p) and "'mtp_0'" in p for p in kept)
  assert {p for p in kept if np.ndim(after[p])} == {
      p for p in before if np.ndim(before[p]) and "'layers_" not in p
      and "'embedding'" not in p and "'lm_head'" not in p
      and "'final_norm'" not in p}  # frozen: no state in this phase
  for p in kept:
    np.testing.assert_array_equal(after[p], before[p], err_msg=p)
  with pytest.raises(ValueError, match="no parameter's optimizer state"):
    mtp_growth.carry_state(grown_cfg, mtp_only_tc.replace(optimizer="adamw"),
                           grown, (base_tc, base))
