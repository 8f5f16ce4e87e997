"""Optimizers: which parameters decay, and how Muon reshapes each kind."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

from m2jax import config as config_lib
from m2jax import model
from m2jax import sharding
from m2jax.train import optim
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig

# Side by side, a MoE model with an MTP module and a dense-FFN one hold
# every kind of parameter; one tree keeps it to one compile per optimizer.
CONFIGS = {
    "moe": config_lib.TINY.replace(num_layers=1),
    "dense": config_lib.TINY.replace(num_layers=1, ffn_type="dense",
                                     dense_intermediate_size=48,
                                     num_mtp_modules=0),
}

# Written out by hand from what each weight means, independently of
# optim.PARAM_RULES: which leaves decay, and Muon's (reduction, output).
DECAYS = {"embedding", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj",
          "w1", "w2", "w3", "proj"}
NO_DECAY = {"router", "scale"}      # router gate; every norm gain
DIMS = {
    "q_proj": Dims(0, (1, 2)), "k_proj": Dims(0, (1, 2)),
    "v_proj": Dims(0, (1, 2)), "o_proj": Dims((0, 1), 2),
    "w1": Dims(1, 2), "w3": Dims(1, 2), "w2": Dims(1, 2),  # [E, in, out]
    "proj": Dims(0, 1),
}
DENSE_DIMS = {**DIMS, "w1": Dims(0, 1), "w3": Dims(0, 1), "w2": Dims(0, 1)}


@functools.lru_cache(maxsize=None)
def _model():
  """(logical axes, random float32 parameters) of CONFIGS' models."""
  axes, params = {}, {}
  rng = np.random.default_rng(0)
  for name, mcfg in CONFIGS.items():
    axes[name] = model.logical_axes(mcfg)["params"]
    shapes = jax.eval_shape(lambda c=mcfg: model.init(c, jax.random.key(0)))
    params[name] = jax.tree.map(
        lambda s: rng.normal(size=s.shape).astype(np.float32),
        shapes["params"])
  return axes, params


def _leaf(path) -> str:
  return path[-1].key


def _tcfg(opt, **kw):
  # router_lr_scale 1.0: these tests compare against plain optax.
  kw = {"steps": 10, "optimizer": opt, "learning_rate": 0.5,
        "warmup_steps": 0, "decay_fraction": 0.0, "weight_decay": 0.1,
        "grad_clip": 1e9, "router_lr_scale": 1.0, **kw}
  return TrainConfig(**kw)


@functools.lru_cache(maxsize=None)
def _optimizer(opt):
  tx = optim.make_optimizer(_tcfg(opt), _model()[0])
  return tx.init, jax.jit(tx.update)


def _updates(opt, grads=None, steps=1):
  """The updates of `steps` steps of `opt` on `grads` (default zeros)."""
  params = _model()[1]
  init, update = _optimizer(opt)
  state = init(params)
  grads = jax.tree.map(jnp.zeros_like, params) if grads is None else grads
  for _ in range(steps):
    updates, state = update(grads, state, params)
  return updates


def _decayed(opt):
  """{parameter path: whether one step on a zero gradient shrinks it}."""
  params = _model()[1]
  out = {}
  for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(_updates(opt)),
                          jax.tree.leaves(params)):
    shrinks = bool(np.any(np.asarray(u) != 0))
    if shrinks:  # decoupled decay: -lr * wd * p exactly
      np.testing.assert_allclose(u, -0.5 * 0.1 * p, rtol=1e-6)
    out[jax.tree_util.keystr(path)] = shrinks
  return out


def test_adamw_and_muon_decay_the_same_parameters():
  adamw, muon = _decayed("adamw"), _decayed("muon")
  assert adamw == muon
  for name, decays in adamw.items():
    leaf = name.split("'")[-2]
    assert leaf in DECAYS | NO_DECAY, name
    assert decays == (leaf in DECAYS), name


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_qk_norm_gains_do_not_decay(opt):
  decayed = _decayed(opt)
  qk = [k for k in decayed if "q_norm" in k or "k_norm" in k]
  assert len(qk) == 2 * sum(c.num_layers + c.num_mtp_modules
                            for c in CONFIGS.values())
  assert not any(decayed[k] for k in qk), qk


def test_every_rule_is_used_and_documented():
  kinds = set(jax.tree.leaves(optim.param_kinds(*_model())))
  assert kinds == {r.kind for r in optim.PARAM_RULES.values()}
  for rule in optim.PARAM_RULES.values():
    assert f"  {rule.kind}  " in optim.__doc__, rule.kind


def test_unknown_axes_name_the_parameter():
  params = {"attn": {"q_proj": jnp.zeros((4, 2, 2)),
                     "gate": jnp.zeros((4, 3))}}
  axes = {"attn": {"q_proj": P("embed", "q_heads", "head_dim"),
                   "gate": P("embed", "gates")}}
  for opt in ("adamw", "muon"):
    tx = optim.make_optimizer(_tcfg(opt), axes)
    with pytest.raises(ValueError, match=r"attn/gate: logical axes "
                       r"\('embed', 'gates'\)"):
      tx.update(params, tx.init(params), params)
  # A subset of the parameters (a checkpoint without MTP modules) is fine.
  assert optim.param_kinds(axes, {"attn": {"q_proj": params["attn"][
      "q_proj"]}}) == {"attn": {"q_proj": "attention q"}}
  with pytest.raises(ValueError, match="attn/k_proj has no logical axes"):
    optim.param_kinds(axes, {"attn": {"k_proj": jnp.zeros((4, 2, 2))}})


def _want_dims(path, _=None):
  return (DENSE_DIMS if path[0].key == "dense" else DIMS).get(_leaf(path))


def test_muon_dimension_numbers_of_each_kind():
  axes, params = _model()
  got = optim.muon_dimension_numbers(axes)(params)
  want = jax.tree_util.tree_map_with_path(_want_dims, params)
  norm = lambda d: None if d is None else tuple(
      (a,) if isinstance(a, int) else tuple(a) for a in d)
  is_leaf = lambda x: x is None or isinstance(x, Dims)
  assert (jax.tree.map(norm, got, is_leaf=is_leaf)
          == jax.tree.map(norm, want, is_leaf=is_leaf))


def _random_grads(seed=1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: (1e-2 * rng.normal(size=p.shape)).astype(np.float32),
      _model()[1])


def test_muon_matches_optax_muon_given_the_dimension_numbers():
  """The composed Muon equals optax.contrib.muon with hand-written dimension
  numbers on the matrices, and the AdamW kinds equal optax.adamw."""
  params, grads = _model()[1], _random_grads()
  got = _updates("muon", grads, steps=2)
  tcfg = _tcfg("muon")
  ref_muon = optax.contrib.muon(
      0.5, beta=tcfg.b1, eps=tcfg.eps, weight_decay=0.1,
      muon_weight_dimension_numbers=jax.tree_util.tree_map_with_path(
          _want_dims, params))
  ref_adamw = optax.adamw(
      0.5, b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps, weight_decay=0.1,
      mask=jax.tree_util.tree_map_with_path(
          lambda path, _: _leaf(path) in DECAYS, params))
  refs = {}
  for name, tx in (("muon", ref_muon), ("adamw", ref_adamw)):
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(2):
      refs[name], state = update(grads, state, params)
  for path, u in jax.tree_util.tree_leaves_with_path(got):
    ref = refs["muon" if _want_dims(path) else "adamw"]
    want = functools.reduce(lambda t, k: t[k.key], path, ref)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-8,
                               err_msg=jax.tree_util.keystr(path))


def _flatness(m):
  """Largest over smallest singular value: ~1.66 after optax's 5
  Newton-Schulz steps, 5 or more for a wrongly grouped matrix."""
  s = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
  return s.max() / s.min()


def _direction(grads):
  """Muon's step direction: the update of one step without lr and decay."""
  return jax.tree.map(lambda u, p: -(np.asarray(u) + 0.5 * 0.1 * p) / 0.5,
                      _updates("muon", grads), _model()[1])


def _perturbed(grads, path, index):
  """`grads` with noise added to grads[path][index]."""
  grads = jax.tree.map(np.copy, grads)
  g = functools.reduce(lambda t, k: t[k], path, grads)
  g[index] += 1e-2 * np.random.default_rng(2).normal(size=g[index].shape)
  return grads


def test_muon_orthogonalises_each_expert_on_its_own():
  path = ("moe", "layers_0", "moe", "w1")          # [E, D, F]
  get = lambda t: functools.reduce(lambda t, k: t[k], path, t)
  grads = _random_grads()
  update = get(_direction(grads))
  assert update.shape[0] == CONFIGS["moe"].num_experts
  for e in range(update.shape[0]):
    assert _flatness(update[e]) < 2.0, e
  # Another expert's gradient leaves expert 0's update exactly as it was.
  moved = get(_direction(_perturbed(grads, path, 1)))
  np.testing.assert_array_equal(moved[0], update[0])
  assert np.abs(moved[1] - update[1]).max() > 1e-3


def test_muon_orthogonalises_attention_over_all_heads():
  attn = lambda t: t["moe"]["layers_0"]["attn"]
  grads = _random_grads()
  update = attn(_direction(grads))
  D = CONFIGS["moe"].hidden_size
  for name in ("q_proj", "k_proj", "v_proj"):       # [D, N, hd]
    assert _flatness(update[name].reshape(D, -1)) < 2.0, name
  assert _flatness(update["o_proj"].reshape(-1, D)) < 2.0   # [N, hd, D]
  # One matrix over all heads: head 1's gradient moves head 0's update.
  path = ("moe", "layers_0", "attn", "q_proj")
  moved = attn(_direction(_perturbed(grads, path, (slice(None), 1))))
  assert np.abs(moved["q_proj"][:, 0] - update["q_proj"][:, 0]).max() > 1e-3


@pytest.mark.parametrize("opt,mtp_only", [("muon", False), ("muon", True),
                                          ("adamw", True), ("sso", True)])
def test_optimizer_state_gets_shardings(opt, mtp_only):
  """Each family's moments (masked where the other family's parameters
  are) get their parameters' shardings: Muon runs on a mesh."""
  mcfg = CONFIGS["moe"]
  tcfg = TrainConfig(optimizer=opt, mtp_only=mtp_only, mtp_depth=1)
  mesh = sharding.make_mesh("data=1")
  got = state_lib.state_shardings(mcfg, tcfg, mesh).opt_state
  want = jax.eval_shape(lambda: state_lib.init_state(
      mcfg, tcfg, model.init(mcfg, jax.random.key(0)))).opt_state
  assert jax.tree.structure(got) == jax.tree.structure(want)


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_router_lr_scale_scales_only_the_router_gates(opt):
  """TrainConfig.router_lr_scale multiplies the router gates' updates (main
  and MTP routers) and leaves every other parameter's update as it was."""
  axes, params = _model()
  grads = _random_grads()
  base = _updates(opt, grads)
  tx = optim.make_optimizer(_tcfg(opt, router_lr_scale=0.1), axes)
  scaled, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  routers = 0
  for path, u in jax.tree_util.tree_leaves_with_path(scaled):
    want = functools.reduce(lambda t, k: t[k.key], path, base)
    if _leaf(path) == "router":
      routers += 1
      want = 0.1 * np.asarray(want)
    np.testing.assert_allclose(u, want, rtol=1e-6, atol=1e-9,
                               err_msg=jax.tree_util.keystr(path))
  assert routers == 2  # the main layer's and the MTP block's
  with pytest.raises(ValueError, match="router_lr_scale"):
    _tcfg(opt, router_lr_scale=0.0)
