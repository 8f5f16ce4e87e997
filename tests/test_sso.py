"""SSO and MuonSphere (m2jax.train.sso): msign, the lambda root, the sphere,
the atomic units, and how they sit in make_optimizer."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from m2jax import config as config_lib
from m2jax import model
from m2jax import sharding
from m2jax.config import ConfigError
from m2jax.train import optim, sso
from m2jax.train import state as state_lib
from m2jax.train.checkpoint import Checkpointer, abstract
from m2jax.train.config import MATMUL_PRECISIONS, TrainConfig

# One parameter of each kind of unit, tiny: q [D, H, hd] (per head), o
# [H, hd, D] (one unit), experts [E, D, F] / [E, F, D] (per expert), and
# AdamW kinds beside them. Two shapes of unit (8 x 4, and 8 x 8 for o and
# the experts, solved as one stack): two compiled solves per optimizer.
D, H, HD, E, F, V = 8, 2, 4, 3, 8, 10
AXES = {
    "embedding": P("vocab", "embed"),
    "attn": {"q_proj": P("embed", "q_heads", "head_dim"),
             "o_proj": P("q_heads", "head_dim", "embed")},
    "moe": {"router": P("embed", "router"),
            "w1": P("expert", "embed", "expert_mlp"),
            "w2": P("expert", "expert_mlp", "embed")},
    "final_norm": {"scale": P("norm")},
}
ADAMW_LEAVES = (("embedding",), ("moe", "router"), ("final_norm", "scale"))
ETA = 1e-3      # the matrices' learning rate (the AdamW kinds': 0.01)
NS_TOL = 1e-5   # msign vs the SVD polar factor, max abs (measured ~1.5e-6)


def _unit(rng, d_in, d_out, top):
  """A d_in x d_out matrix with singular values top, top/2, top/4, ...: a
  gap that the power iteration resolves to float32 in the init's 50 steps."""
  k = min(d_in, d_out)
  a, _ = np.linalg.qr(rng.normal(size=(d_in, k)))
  b, _ = np.linalg.qr(rng.normal(size=(d_out, k)))
  return (a * (top * 0.5 ** np.arange(k))) @ b.T


def _params():
  """Each unit at its own spectral norm, so a wrong split shows."""
  rng = np.random.default_rng(0)
  q = np.stack([_unit(rng, D, HD, 1 + h) for h in range(H)], axis=1)
  o = _unit(rng, H * HD, D, 0.7).reshape(H, HD, D)
  w1 = np.stack([_unit(rng, D, F, 0.5 + e) for e in range(E)])
  w2 = np.stack([_unit(rng, F, D, 2.0 - 0.5 * e) for e in range(E)])
  p = {"embedding": rng.normal(size=(V, D)),
       "attn": {"q_proj": q, "o_proj": o},
       "moe": {"router": rng.normal(size=(D, E)), "w1": w1, "w2": w2},
       "final_norm": {"scale": 1 + 0.1 * rng.normal(size=(D,))}}
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def _grads(seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), _params())


def _tcfg(opt, **kw):
  return TrainConfig(**{"steps": 10, "optimizer": opt, "learning_rate": 0.01,
                        "matrix_learning_rate": ETA, "warmup_steps": 0,
                        "decay_fraction": 0.0, "weight_decay": 0.1,
                        "grad_clip": 1e9, **kw})


TRACES = collections.Counter()


@functools.lru_cache(maxsize=None)
def _optimizer(opt):
  """(init, jitted update) of `opt`, shared by the tests (one compile each);
  TRACES[opt] counts how often its update was traced."""
  tx = optim.make_optimizer(_tcfg(opt), AXES)

  def update(grads, state, params):
    TRACES[opt] += 1
    return tx.update(grads, state, params)

  return tx.init, jax.jit(update)


def _step(opt, grads=None):
  """(updates, new state) of one step of `opt` from a fresh state."""
  init, update = _optimizer(opt)
  params = _params()
  return update(_grads() if grads is None else grads, init(params), params)


def _get(tree, path):
  return functools.reduce(lambda t, k: t[k], path, tree)


def _units(w, name):
  """The units of parameter `name` as a list of [d_in, d_out] matrices."""
  w = np.asarray(w, np.float64)
  if name == "q_proj":
    return [w[:, h] for h in range(w.shape[1])]
  if name == "o_proj":
    return [w.reshape(-1, w.shape[-1])]
  return list(w)          # experts


def _map_units(fn, name, *ws):
  """The parameter whose units are fn(units of ws...)."""
  units = [fn(*us) for us in zip(*(_units(w, name) for w in ws))]
  if name == "q_proj":
    return np.stack(units, axis=1)
  if name == "o_proj":
    return units[0].reshape(np.shape(ws[0]))
  return np.stack(units)


SPHERE_LEAVES = (("attn", "q_proj"), ("attn", "o_proj"), ("moe", "w1"),
                 ("moe", "w2"))


def _sigma(m):
  return np.linalg.svd(m, compute_uv=False)


def _polar(m):
  u, _, vt = np.linalg.svd(np.asarray(m, np.float64), full_matrices=False)
  return u @ vt


_msign = jax.jit(sso.msign)


def test_msign_is_the_svd_polar_factor():
  rng = np.random.default_rng(0)
  for shape in [(3, 6, 10), (10, 6)]:   # wide (a stack), tall
    x = rng.normal(size=shape).astype(np.float32)
    np.testing.assert_allclose(_msign(x), _polar(x), atol=NS_TOL)
  # Singular values down to 2e-3 of the top still reach 1.
  a, _ = np.linalg.qr(rng.normal(size=(6, 6)))
  b, _ = np.linalg.qr(rng.normal(size=(10, 6)))
  x = (a * np.geomspace(1, 2e-3, 6)) @ b.T
  np.testing.assert_allclose(_msign(x[None].astype(np.float32))[0], a @ b.T,
                             atol=NS_TOL)
  assert not np.any(np.asarray(_msign(np.zeros((10, 6), np.float32))))
  # Every TrainConfig.sso_matmul_precision is a precision jnp.matmul takes.
  assert set(sso.PRECISIONS) == set(MATMUL_PRECISIONS)
  x3 = jax.jit(functools.partial(sso.msign,
                                 precision=sso.PRECISIONS["BF16_BF16_F32_X3"]))
  np.testing.assert_allclose(x3(x[None].astype(np.float32))[0], a @ b.T,
                             atol=NS_TOL)
  # The coefficients themselves: their composition maps every singular
  # value in [1e-3, 1] (after the 1.01 safety scaling) to 1.
  s = np.geomspace(1e-3, 1, 2000) / sso.POLAR_EXPRESS_SAFETY
  for a, b, c in sso.polar_express_coefficients(8):
    s = a * s + b * s**3 + c * s**5
  np.testing.assert_allclose(s, 1, atol=1e-6)


def _solve_inputs(n=6, d_in=6, d_out=10, seed=0):
  """(m_hat, v, u, theta) of n random units: v u = theta, each W's top
  singular pair."""
  rng = np.random.default_rng(seed)
  m = rng.normal(size=(n, d_in, d_out))
  m_hat = m / np.linalg.norm(m, axis=(-2, -1), keepdims=True)
  a, _, bt = np.linalg.svd(rng.normal(size=(n, d_in, d_out)))
  v, u = a[:, :, :1], bt[:, :1, :]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(m_hat), f32(v), f32(u), v * u


SOLVER = dict(bracket_start=1e-3, bracket_doublings=10, bisect_steps=20,
              tolerance=2e-4)
# The limits are traced: both solver tests share one compile.
_solve = jax.jit(sso.solve_lambda, static_argnames=("root_finder",))


@pytest.mark.parametrize("root_finder", ["bisect", "illinois"])
def test_lambda_root_is_within_tolerance(root_finder):
  m_hat, v, u, theta = _solve_inputs()
  h = lambda lam: np.sum(theta * _polar(m_hat + lam * theta), axis=(-2, -1))
  assert np.all(np.abs(h(np.zeros((6, 1, 1)))) > 1e-2)  # lambda* != 0
  out = _solve(m_hat, v, u, **SOLVER, root_finder=root_finder)
  assert np.all(np.asarray(out.bracketed))
  assert np.all(np.abs(np.asarray(out.h)) <= SOLVER["tolerance"])
  # Checked independently: the SVD polar factor at lambda*.
  assert np.all(np.abs(h(np.asarray(out.lam))) <= SOLVER["tolerance"]
                + NS_TOL)
  np.testing.assert_allclose(out.phi, _polar(m_hat + out.lam * theta),
                             atol=NS_TOL)
  # The cold search's cost (measured: bisection 13-19 evaluations a unit,
  # Illinois 7-12: the same bracket, then ~3 secant steps for ~10 halvings).
  assert np.max(out.evaluations) <= {"bisect": 21, "illinois": 13}[
      root_finder], np.asarray(out.evaluations).ravel()


def _nearby(m_hat, seed, size=0.05):
  """m_hat moved by ~`size` (relative, Frobenius), renormalised: the next
  step's M^ under momentum."""
  noise = np.random.default_rng(seed).normal(size=m_hat.shape)
  m = np.asarray(m_hat) + size * noise / np.linalg.norm(
      noise, axis=(-2, -1), keepdims=True)
  return jnp.asarray(m / np.linalg.norm(m, axis=(-2, -1), keepdims=True),
                     jnp.float32)


def test_a_warm_start_from_the_last_lambda_needs_few_evaluations():
  """Step 2 of each unit, started at its lambda* of step 1: a few
  evaluations (measured 3-4: lambda_prev, the step that brackets, one or two
  Illinois steps) against a cold solve's (the loop's, its max: bisection
  20, Illinois 7), and the same root as cold bisection (both within
  tolerance of h = 0)."""
  m_hat, v, u, theta = _solve_inputs()
  first = _solve(m_hat, v, u, **SOLVER, root_finder="illinois")
  m_next = _nearby(m_hat, 7)
  warm = _solve(m_next, v, u, **SOLVER, lam_start=first.lam,
                root_finder="illinois")
  cold = _solve(m_next, v, u, **SOLVER, root_finder="bisect")
  cold_illinois = _solve(m_next, v, u, **SOLVER, root_finder="illinois")
  # The loop runs until its last unit is done: the max is the cost.
  assert np.max(warm.evaluations) <= 4, np.asarray(warm.evaluations).ravel()
  assert np.max(cold.evaluations) >= 3 * np.max(warm.evaluations)
  # Measured: warm 3-4 a unit (20 in all), cold Illinois 3-7 (33).
  assert np.max(cold_illinois.evaluations) > np.max(warm.evaluations)
  assert (np.sum(warm.evaluations)
          <= 2 / 3 * np.sum(cold_illinois.evaluations)), (
              np.asarray(cold_illinois.evaluations).ravel())
  assert np.all(np.asarray(warm.bracketed))
  # lambda* moved (the warm start had work to do: h(lambda_prev) was off) ...
  assert np.min(warm.evaluations) >= 3
  # ... and agrees with bisection's: |lam - lam'| h'(lam) within 2 tol, h'
  # by a central difference of the SVD polar factor.
  h = lambda lam: np.sum(theta * _polar(m_next + lam * theta), axis=(-2, -1),
                         keepdims=True)
  lam = np.asarray(warm.lam, np.float64)
  slope = (h(lam + 1e-4) - h(lam - 1e-4)) / 2e-4
  assert np.all(np.abs(h(lam)) <= SOLVER["tolerance"] + NS_TOL)
  assert np.all(np.abs(lam - np.asarray(cold.lam)) * slope
                <= 2 * SOLVER["tolerance"])


def test_lambda_falls_back_to_zero_without_a_bracket():
  m_hat, v, u, _ = _solve_inputs()
  # Candidates 1e-6 and 2e-6 only: too close to 0 to pass any root.
  out = _solve(m_hat, v, u, **dict(SOLVER, bracket_start=1e-6,
                                    bracket_doublings=1))
  assert not np.any(np.asarray(out.bracketed))
  assert not np.any(np.asarray(out.lam))
  np.testing.assert_array_equal(out.phi, _msign(m_hat))
  # From a warm start too (steps of 1e-6 x 2^k from 1e-6 pass the cold
  # search's reach without a bracket, then one evaluation at 0): lam = 0
  # and msign(M^).
  lam = jnp.full((6, 1, 1), 1e-6, jnp.float32)
  out = _solve(m_hat, v, u, **dict(SOLVER, bracket_start=1e-6,
                                    bracket_doublings=1), lam_start=lam)
  assert not np.any(np.asarray(out.bracketed))
  assert not np.any(np.asarray(out.lam))
  np.testing.assert_allclose(out.phi, _msign(m_hat), atol=1e-6)


def test_a_step_lands_every_unit_on_its_sphere_and_moves_eta_r():
  """Per head of q, per expert, o whole: sigma_max after the step is R
  (the retraction, and a step tangent to the sphere), and the step part
  W_new - W R / sigma has spectral norm eta R."""
  params = _params()
  updates, _ = _step("sso")
  sphere_updates, _ = _step("muonsphere")
  worst = {"sso": 0.0, "muonsphere": 0.0}
  for path in SPHERE_LEAVES:
    name = path[-1]
    old = _units(_get(params, path), name)
    for opt, upd in (("sso", updates), ("muonsphere", sphere_updates)):
      new = _units(_get(params, path) + _get(upd, path), name)
      for w, w_new in zip(old, new):
        d_in, d_out = w.shape
        radius = np.sqrt(d_out / d_in)
        worst[opt] = max(worst[opt], abs(_sigma(w_new)[0] / radius - 1))
        step = w_new - w * radius / _sigma(w)[0]
        np.testing.assert_allclose(_sigma(step)[0], ETA * radius, rtol=2e-3,
                                   err_msg=f"{opt} {path}")
  # SSO's step is tangent (sigma moves at second order, ~eta^2); MuonSphere's
  # moves sigma at first order, by eta |h(0)| (the test can tell them apart).
  assert worst["sso"] < 2e-5, worst
  assert worst["muonsphere"] > 1e-4, worst


def test_sso_at_lambda_zero_is_muonsphere():
  """Gradients with no component along each unit's top input direction
  v (v^T G = 0, so h(0) = 0): SSO takes lambda = 0 and equals MuonSphere
  exactly, updates and state."""
  params, grads = _params(), jax.tree.map(np.asarray, _grads())
  for path in SPHERE_LEAVES:
    def tangent(w, g):
      v = np.linalg.svd(w)[0][:, :1]
      return g - v @ (v.T @ g)
    _get(grads, path[:-1])[path[-1]] = _map_units(
        tangent, path[-1], _get(params, path), _get(grads, path))
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
  got, got_state = _step("sso", grads)
  want, want_state = _step("muonsphere", grads)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  jax.tree.map(np.testing.assert_array_equal, got_state, want_state)


def test_units_are_independent():
  """Another expert's (head's) gradient leaves this expert's (head's)
  update exactly as it was."""
  base, _ = _step("sso")
  for path, index, units in ((("moe", "w1"), 1, E),
                             (("attn", "q_proj"), (slice(None), 1), H)):
    grads = jax.tree.map(np.array, _grads())
    _get(grads, path)[index] *= -3.0
    moved, _ = _step("sso", jax.tree.map(jnp.asarray, grads))
    before, after = _get(base, path), _get(moved, path)
    take = (lambda x, i: x[i]) if path[-1] == "w1" else (lambda x, i: x[:, i])
    for i in range(units):
      if i == 1:
        assert np.abs(take(after, i) - take(before, i)).max() > 1e-5
      else:
        np.testing.assert_array_equal(take(after, i), take(before, i))
    for other in SPHERE_LEAVES:   # stacked with them, not coupled
      if other != path:
        np.testing.assert_array_equal(_get(moved, other), _get(base, other))


def test_adamw_kinds_get_adamw():
  got, _ = _step("sso")
  want, _ = _step("adamw")
  for path in ADAMW_LEAVES:
    np.testing.assert_allclose(_get(got, path), _get(want, path), rtol=1e-6,
                               err_msg=str(path))


def test_the_step_compiles_once():
  init, update = _optimizer("sso")
  params = _params()
  state = init(params)
  for seed in range(3):
    updates, state = update(_grads(seed), state, params)
    params = jax.tree.map(jnp.add, params, updates)
  assert TRACES["sso"] == 1


def test_state_survives_a_checkpoint(tmp_path):
  init, update = _optimizer("sso")
  params = _params()
  _, state = update(_grads(), init(params), params)
  ck = Checkpointer(str(tmp_path), keep=1)
  ck.save(1, state, {}, {})
  ck.close()
  ck = Checkpointer(str(tmp_path), keep=1)
  restored, _, _ = ck.restore(1, abstract(state))
  ck.close()
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)


def test_singular_vectors_shard_like_their_parameter():
  mcfg = config_lib.TINY.replace(num_layers=1)
  mesh = sharding.make_mesh("data=1")
  got = state_lib.state_shardings(mcfg, _tcfg("sso"), mesh).opt_state
  want = jax.eval_shape(lambda: state_lib.init_state(
      mcfg, _tcfg("sso"), model.init(mcfg, jax.random.key(0)))).opt_state
  assert jax.tree.structure(got) == jax.tree.structure(want)
  inner = got[1].inner_states[optim.SPHERE].inner_state
  w1 = lambda t: t["layers_0"]["moe"]["w1"]         # [E, D, F]
  q = lambda t: t["layers_0"]["attn"]["q_proj"]     # [D, H, hd]
  assert w1(inner.momentum).spec == P("expert", "fsdp", "tensor")
  assert w1(inner.u).spec == P("expert", None, "tensor")
  assert w1(inner.v).spec == P("expert", "fsdp", None)
  assert q(inner.u).spec == P(None, "tensor", None)
  assert q(inner.v).spec == P("fsdp", "tensor", None)
  # lambda*: one per unit, split like the units.
  assert w1(inner.lam).spec == P("expert", None, None)
  assert q(inner.lam).spec == P(None, "tensor", None)


def test_the_state_keeps_lambda_and_counts_the_evaluations():
  """SSO's state holds each unit's lambda* (the next step's start; 0 under
  MuonSphere) and the step's evaluation counts, which sso.metrics reads."""
  _, state = _step("sso")
  _, sphere_state = _step("muonsphere")
  lam = _get(sso.find_state(state).lam, ("moe", "w1"))
  assert lam.shape == (E, 1, 1) and np.all(np.asarray(lam) != 0)
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(
      sso.find_state(sphere_state).lam))
  got = {k: float(x) for k, x in sso.metrics(state).items()}
  assert set(got) == {"sso/evaluations_mean", "sso/evaluations_max",
                      "sso/msign_cost"}
  # A cold first step: the bracket, then Illinois steps, for every unit.
  assert 3 <= got["sso/evaluations_mean"] <= got["sso/evaluations_max"]
  assert got["sso/msign_cost"] <= got["sso/evaluations_max"]
  assert {float(x) for x in sso.metrics(sphere_state).values()} == {1.0}
  assert sso.metrics(_step("adamw")[1]) == {}


def test_bad_constants_are_refused_naming_the_field():
  for field, value in (("sso_tolerance", 0.0), ("sso_momentum", 1.0),
                       ("sso_ns_steps", 0), ("sso_matmul_precision", "tf32"),
                       ("sso_root_finder", "newton"),
                       ("sso_warm_start", "yes"),
                       ("matrix_learning_rate", -1.0)):
    with pytest.raises(ConfigError, match=f"TrainConfig.{field}: "):
      TrainConfig(**{field: value})
  with pytest.raises(ConfigError, match="TrainConfig.optimizer: must be one "
                     r"of \('adamw', 'muon', 'muonsphere', 'sso'\)"):
    TrainConfig(optimizer="soap")
