"""Router bookkeeping: the sequence-wise aux loss per document, the aux loss
of the MTP blocks' routers, and which load moves which expert bias."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.model import moe
from m2jax.model.layers import positions_from_segments
from m2jax.train import losses
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

# Small enough to compile fast; two MTP modules so that each must find its
# own bias.
CFG = config_lib.apply_overrides(config_lib.TINY, [
    "hidden_size=32", "num_heads=2", "num_kv_heads=1", "head_dim=8",
    "rotary_dim=4", "moe_intermediate_size=16", "num_mtp_modules=2"])


def _stats(experts, scores, doc_ids, num_experts):
  experts = np.reshape(experts, (-1, np.shape(experts)[-1]))
  routing = moe.Routing(jnp.asarray(scores, jnp.float32),
                        jnp.asarray(experts, jnp.int32), None)
  return moe.summarize_routing(routing, jnp.asarray(doc_ids), num_experts)


# ---------------------------------------------------------------------------
# The aux loss formula

# Two rows of 5 tokens, E = 2 experts, top-1. Row 0: document A (tokens 0-1),
# document B (2-3), padding. Row 1: document C (0-2), padding.
HAND_IDS = [[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]]
HAND_EXPERTS = [[[0], [0], [0], [1], [1]], [[1], [1], [0], [0], [0]]]
# Gate scores; normalised (s / sum s): A (.75, .25), B (.5, .5), C (.25, .75).
# Padding gets scores and choices that would change every value if counted.
HAND_SCORES = [[[.6, .2], [.6, .2], [.3, .3], [.3, .3], [.9, .1]],
               [[.1, .3], [.1, .3], [.1, .3], [.9, .1], [.9, .1]]]


def test_aux_loss_hand_computed_two_documents_in_a_row():
  """f_e = E/(K n) * count_e, P_e = mean normalised score, L = sum f P,
  averaged over the three documents:
    A: n=2, counts (2, 0): f = (2, 0),     P = (.75, .25): L = 1.5
    B: n=2, counts (1, 1): f = (1, 1),     P = (.5, .5):   L = 1.0
    C: n=3, counts (1, 2): f = (2/3, 4/3), P = (.25, .75): L = 7/6
  """
  stats = _stats(HAND_EXPERTS, np.reshape(HAND_SCORES, (10, 2)),
                 HAND_IDS, 2)
  want = (1.5 + 1.0 + 7 / 6) / 3
  np.testing.assert_allclose(stats.aux_loss, want, rtol=1e-6)
  # What a per-row loss gives instead: row 0 as one sequence has counts
  # (3, 1), f = (1.5, .5), P = (.625, .375), L = 1.125; row 1 is C.
  per_row = (1.125 + 7 / 6) / 2
  # And a mean over rows of each row's document mean.
  per_row_of_docs = ((1.5 + 1.0) / 2 + 7 / 6) / 2
  assert abs(want - per_row) > 0.07 and abs(want - per_row_of_docs) > 0.01
  np.testing.assert_allclose(stats.load_E, [4, 3])   # padding not counted


def test_aux_loss_groups_tokens_by_id_not_by_position():
  """Any ids, in any order within a row: a document is the set of a row's
  tokens with one id (as attention defines it)."""
  base = _stats(HAND_EXPERTS, np.reshape(HAND_SCORES, (10, 2)), HAND_IDS, 2)
  perm = [[3, 0, 4, 2, 1], [4, 2, 0, 3, 1]]
  relabel = {0: 0, 1: 70, 2: 3}
  ids = [[relabel[HAND_IDS[b][t]] for t in perm[b]] for b in range(2)]
  experts = [[HAND_EXPERTS[b][t] for t in perm[b]] for b in range(2)]
  scores = [[HAND_SCORES[b][t] for t in perm[b]] for b in range(2)]
  moved = _stats(experts, np.reshape(scores, (10, 2)), ids, 2)
  np.testing.assert_allclose(moved.aux_loss, base.aux_loss, rtol=1e-6)
  # The same id in two rows is two documents.
  one_row = _stats([HAND_EXPERTS[0][:4] + HAND_EXPERTS[1][:3]],
                   np.reshape(HAND_SCORES[0][:4] + HAND_SCORES[1][:3], (7, 2)),
                   [[1, 1, 2, 2, 3, 3, 3]], 2)
  np.testing.assert_allclose(one_row.aux_loss, base.aux_loss, rtol=1e-6)


def _numpy_aux(experts, scores, ids, E):
  """The sequence-wise balance loss, document by document, in float64."""
  B, T = ids.shape
  K = experts.shape[-1]
  experts = experts.reshape(B, T, K)
  probs = scores / scores.sum(-1, keepdims=True)
  probs = probs.reshape(B, T, E)
  losses_d = []
  for b in range(B):
    for d in sorted(set(ids[b]) - {0}):
      toks = np.flatnonzero(ids[b] == d)
      counts = np.zeros(E)
      for t in toks:
        for e in experts[b, t]:
          counts[e] += 1
      f = E / (K * len(toks)) * counts
      p = probs[b, toks].mean(0)
      losses_d.append(np.sum(f * p))
  return np.mean(losses_d)


def test_aux_loss_matches_numpy_reference_on_random_routing():
  rng = np.random.default_rng(0)
  B, T, E, K = 3, 16, 6, 2
  x = jnp.asarray(rng.normal(size=(B * T, 4)), jnp.float32)
  router = jnp.asarray(rng.normal(size=(4, E)), jnp.float32)
  routing = moe.route(x, router, None, top_k=K, gating="sigmoid", scaling=1.0)
  ids = rng.choice([0, 1, 2, 5, 1000], size=(B, T))
  ids[2] = 0                                       # an all-padding row
  stats = moe.summarize_routing(routing, jnp.asarray(ids), E)
  want = _numpy_aux(np.asarray(routing.experts_TxK),
                    np.asarray(routing.scores_TxE, np.float64), ids, E)
  np.testing.assert_allclose(stats.aux_loss, want, rtol=1e-5)
  empty = moe.summarize_routing(routing, jnp.zeros((B, T), jnp.int32), E)
  assert float(empty.aux_loss) == 0.0


def test_router_logits_from_bf16_pieces_match_float32():
  """The bf16 x's router logits and both gradients equal the float32
  matmul's to float32 precision (a router split into fewer pieces misses
  by ~1e-3 forward, a gradient's pieces dropped by ~1e-3 too)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(96, 64)), jnp.bfloat16)
  router = jnp.asarray(rng.normal(size=(64, 16)) * 0.02, jnp.float32)
  g = jnp.asarray(rng.normal(size=(96, 16)), jnp.float32)
  x64, r64, g64 = (np.asarray(a, np.float64) for a in (x, router, g))

  logits, vjp = jax.vjp(moe.router_logits, x, router)
  dx, drouter = vjp(g)
  assert dx.dtype == jnp.bfloat16 and drouter.dtype == jnp.float32

  def rel(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()

  assert rel(logits, x64 @ r64) < 3e-6
  assert rel(drouter, x64.T @ g64) < 3e-6
  # dx is bfloat16 (one rounding, 2^-9); its float32 sum is good to 2^-16.
  assert rel(dx, g64 @ r64.T) < 2 ** -8


@functools.lru_cache(maxsize=None)
def _variables(cfg):
  """Random variables with model.init's tree (from numpy: no compilation);
  norm gains 1, every expert bias a different random vector, routers
  large enough that documents route differently."""
  shapes = jax.eval_shape(lambda: model.init(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)

  def fill(path, s):
    if path[-1].key == "scale":
      return jnp.ones(s.shape, s.dtype)
    std = {"bias": 0.1, "router": 0.5}.get(path[-1].key, 0.05)
    return jnp.asarray(rng.normal(0, std, s.shape), s.dtype)
  return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.lru_cache(maxsize=None)
def _forward(cfg, mtp_depth):
  return jax.jit(functools.partial(model.forward, cfg, mtp_depth=mtp_depth))


# One packed row: documents of 7 and 12 tokens, then 3 padding tokens.
ROW_SEG = jnp.array([[1] * 7 + [2] * 12 + [0] * 3])


def _row_batch(cfg, seg=ROW_SEG, seed=1):
  tokens = jax.random.randint(jax.random.key(seed), seg.shape, 0,
                              cfg.vocab_size)
  return {"tokens": tokens, "segment_ids": seg,
          "positions": positions_from_segments(seg)}


def test_model_aux_loss_is_the_mean_over_packed_documents():
  """A row packing documents a and b (and padding) reports, in every main
  layer and MTP block, the mean of what a and b report alone."""
  cfg = CFG
  v = _variables(cfg)
  fwd = _forward(cfg, 2)
  batch = _row_batch(cfg)
  out = fwd(v, batch["tokens"], segment_ids=ROW_SEG)
  # Each document alone in the row (same shape: one compilation).
  alone = [fwd(v, batch["tokens"], segment_ids=jnp.where(ROW_SEG == d, 1, 0))
           for d in (1, 2)]
  for field in ("routing", "mtp_routing"):
    got = getattr(out, field).aux_loss
    la, lb = (getattr(o, field).aux_loss for o in alone)
    # The documents differ, so a token-weighted mean would differ too.
    assert np.all(np.abs(la - lb) > 1e-3), field
    np.testing.assert_allclose(got, (la + lb) / 2, rtol=1e-5, err_msg=field)


# ---------------------------------------------------------------------------
# The MTP routers' aux loss in the objective

def test_measure_routing_counts_each_real_token_of_every_layer():
  """model.measure_routing runs the whole forward: K choices per counted
  token in each main layer's load, padding not counted."""
  measure = jax.jit(functools.partial(model.measure_routing, CFG))  # 1 compile
  stats = measure(_variables(CFG), _row_batch(CFG)["tokens"],
                  segment_ids=ROW_SEG)
  K, L = CFG.num_experts_per_tok, CFG.num_layers
  assert stats.load_E.shape == (L, CFG.num_experts)
  assert stats.aux_loss.shape == stats.entropy.shape == (L,)
  np.testing.assert_array_equal(stats.load_E.sum(-1), [19 * K] * L)


def test_mtp_aux_loss_reaches_the_total_loss():
  cfg = CFG
  batch = _row_batch(cfg)
  out = _forward(cfg, 2)(_variables(cfg), batch["tokens"],
                         segment_ids=batch["segment_ids"],
                         positions=batch["positions"])
  w_mtp, coef = 0.3, 0.01
  loss = lambda out, aux_coef: losses.total_loss(
      out, batch, mtp_weight=w_mtp, aux_coef=aux_coef, z_coef=0.0)
  (with_aux, metrics), (without, _) = loss(out, coef), loss(out, 0.0)
  main_aux = jnp.mean(out.routing.aux_loss)
  mtp_aux = jnp.mean(out.mtp_routing.aux_loss)
  np.testing.assert_allclose(with_aux - without,
                             coef * (main_aux + w_mtp * mtp_aux), rtol=1e-4)
  np.testing.assert_allclose(metrics["mtp/router/aux_loss"], mtp_aux)
  # Each MTP block's aux loss enters with weight w_mtp * coef / #blocks.
  grad = jax.grad(lambda a: loss(out._replace(
      mtp_routing=out.mtp_routing._replace(aux_loss=a)), coef)[0])(
          out.mtp_routing.aux_loss)
  np.testing.assert_allclose(grad, w_mtp * coef / 2, rtol=1e-6)
  # While the MTP modules grow alone, the frozen main routers pay nothing.
  grown = losses.total_loss(out, batch, mtp_weight=w_mtp, aux_coef=coef,
                            z_coef=0.0, main_weight=0.0)[0]
  grown0 = losses.total_loss(out, batch, mtp_weight=w_mtp, aux_coef=0.0,
                             z_coef=0.0, main_weight=0.0)[0]
  np.testing.assert_allclose(grown - grown0, coef * w_mtp * mtp_aux, rtol=1e-4)


# ---------------------------------------------------------------------------
# Which load moves which bias

def _bias_leaf(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return np.asarray(tree)


def _mtp_paths(cfg, depth):
  return [f"mtp_{k}/block_{j}/moe/bias" for k in range(depth)
          for j in range(cfg.mtp_transformer_layers)]


def test_update_expert_biases_maps_each_load_row_to_its_router():
  cfg = CFG.replace(num_layers=3, mtp_transformer_layers=2)
  E, rate = cfg.num_experts, 0.5
  bias = _variables(cfg)[model.EXPERT_BIAS]
  main_paths = [f"layers_{i}/moe/bias" for i in range(cfg.num_layers)]
  for depth in (2, 1):
    paths = main_paths + _mtp_paths(cfg, depth)
    # Row i overloads expert i only: every router's update is distinct.
    load = np.ones((len(paths), E))
    load[np.arange(len(paths)), np.arange(len(paths))] = 10.0
    stats = lambda rows: moe.RoutingStats(jnp.asarray(rows), None, None)
    out = model.ModelOutput(None, (None,) * depth, None,
                            stats(load[:cfg.num_layers]),
                            stats(load[cfg.num_layers:]))
    new = model.update_expert_biases(cfg, bias, out, rate)
    for i, path in enumerate(paths):
      step = np.full(E, rate)
      step[i] = -rate
      np.testing.assert_allclose(
          _bias_leaf(new, path) - _bias_leaf(bias, path), step, atol=1e-6,
          err_msg=path)
    for path in _mtp_paths(cfg, 2)[len(paths) - cfg.num_layers:]:
      np.testing.assert_array_equal(_bias_leaf(new, path),
                                    _bias_leaf(bias, path))   # did not run
  no_mtp = {k: x for k, x in bias.items() if not k.startswith("mtp_")}
  with pytest.raises(ValueError, match="mtp_0/block_0/moe/bias"):
    model.update_expert_biases(cfg, no_mtp, out, rate)


def test_train_step_moves_every_mtp_bias_by_its_own_load():
  cfg = CFG.replace(bias_update="sign", bias_update_rate=0.01)
  v = _variables(cfg)
  # MTP module k's bias sends every token to experts 2k and 2k+1, a load no
  # main layer has: its update tells its own load from any other router's.
  bias = dict(v[model.EXPERT_BIAS])
  for k in range(2):
    pushed = jnp.zeros(cfg.num_experts).at[2 * k:2 * k + 2].set(5.0)
    bias[f"mtp_{k}"] = {"block_0": {"moe": {"bias": pushed}}}
  v = dict(v, **{model.EXPERT_BIAS: bias})
  tcfg = TrainConfig(steps=4, warmup_steps=1, mtp_depth=2)
  state = state_lib.create_state(cfg, tcfg, v)
  batch = _row_batch(cfg, seed=4)
  train = jax.jit(functools.partial(step_lib.train_step, model_config=cfg,
                                    train_config=tcfg))
  new, metrics = train(state, batch)
  assert "mtp/router/load_cv" in metrics
  out = _forward(cfg, 2)(v, batch["tokens"], segment_ids=batch["segment_ids"],
                         positions=batch["positions"])
  sign = lambda load: np.sign(load.mean(-1, keepdims=True) - load)
  main_signs = sign(np.asarray(out.routing.load_E))
  mtp_signs = sign(np.asarray(out.mtp_routing.load_E))
  paths = [f"layers_{i}/moe/bias" for i in range(cfg.num_layers)]
  paths += _mtp_paths(cfg, 2)
  for path, want in zip(paths, np.concatenate([main_signs, mtp_signs])):
    got = (_bias_leaf(new.expert_bias, path)
           - _bias_leaf(state.expert_bias, path))
    np.testing.assert_allclose(got, want * cfg.bias_update_rate, atol=1e-5,
                               err_msg=path)
  for k, want in enumerate(mtp_signs):
    np.testing.assert_array_equal(want[2 * k:2 * k + 2], -1)
    assert not any(np.array_equal(want, m) for m in main_signs)


# ---------------------------------------------------------------------------
# The bias update rules

def test_proportional_rule_moves_each_expert_by_its_relative_load_error():
  # mean load 6: relative errors (6 - load) / 6 = (-4, 4, 0, 0) / 6.
  load = jnp.array([[10.0, 2.0, 6.0, 6.0], [0.0, 0.0, 0.0, 24.0]])
  new = moe.update_expert_bias(jnp.ones((2, 4)), load, 0.03, "proportional")
  np.testing.assert_allclose(
      new, 1 + 0.03 * np.array([[-4 / 6, 4 / 6, 0, 0], [1, 1, 1, -3]]),
      rtol=1e-6)
  sign = moe.update_expert_bias(jnp.zeros(4), load[0], 0.03, "sign")
  np.testing.assert_allclose(sign, [-0.03, 0.03, 0, 0])


def _violation_after(rule, rate, steps=40):
  """Max violation of the last step when the bias follows a fixed router
  whose scores have m2_small's measured spread (benchmarks/notes/router.md:
  batch-mean sigmoid scores 0.19 apart across experts, token-specific
  0.2): logits = a shared per-expert part + a per-token part."""
  E, K, T = 64, 8, 2048
  k1, k2 = jax.random.split(jax.random.key(0))
  logits = (0.9 * jax.random.normal(k1, (1, E))
            + 0.9 * jax.random.normal(k2, (T, E)))

  def step(bias, _):
    routing = moe.route(logits, jnp.eye(E), bias, top_k=K, gating="sigmoid",
                        scaling=1.0)
    load = jnp.bincount(routing.experts_TxK.reshape(-1), length=E)
    return moe.update_expert_bias(bias, load, rate, rule), load

  _, loads = jax.lax.scan(step, jnp.zeros(E), None, length=steps)
  load = np.asarray(loads[-1], np.float64)
  return load.max() / load.mean() - 1


def test_m2_small_rule_closes_the_measured_score_gap_in_40_steps():
  small = config_lib.M2_SMALL
  assert _violation_after(small.bias_update, small.bias_update_rate) < 0.3
  # DeepSeek-V3's rule at its rate has not moved far enough yet.
  assert _violation_after("sign", 1e-3) > 2.0


def test_m2_small_balances_with_the_proportional_rule():
  """The preset's rule and rate (benchmarks/notes/router.md: sign at 1e-3
  stays collapsed at this size); the hub config keeps DeepSeek-V3's."""
  small = config_lib.M2_SMALL
  assert (small.bias_update, small.bias_update_rate) == ("proportional", 1e-2)
  assert (config_lib.MINIMAX_M2.bias_update,
          config_lib.MINIMAX_M2.bias_update_rate) == ("sign", 1e-3)


def test_bias_update_rule_is_validated():
  with pytest.raises(config_lib.ConfigError, match="bias_update"):
    CFG.replace(bias_update="signum")
  with pytest.raises(ValueError, match="signum"):
    moe.update_expert_bias(jnp.zeros(4), jnp.ones(4), 0.1, "signum")


def test_update_expert_biases_follows_the_configs_rule():
  cfg = CFG.replace(bias_update="proportional")
  bias = _variables(cfg)[model.EXPERT_BIAS]
  L, E = cfg.num_layers, cfg.num_experts
  load = np.ones((L + 1, E))
  load[:, 0] = 1.0 + E   # mean 2: relative errors (1 - E) / 2, then 1 / 2
  stats = lambda rows: moe.RoutingStats(jnp.asarray(rows), None, None)
  out = model.ModelOutput(None, (None,), None, stats(load[:L]),
                          stats(load[L:]))
  new = model.update_expert_biases(cfg, bias, out, 0.1)
  want = 0.1 * np.r_[(1 - E) / 2, np.full(E - 1, 0.5)]
  for path in [f"layers_{i}/moe/bias" for i in range(L)] + _mtp_paths(cfg, 1):
    np.testing.assert_allclose(_bias_leaf(new, path) - _bias_leaf(bias, path),
                               want, rtol=1e-5, err_msg=path)
