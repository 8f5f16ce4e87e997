"""GNMR: per-unit gradient-norm monitoring and recovery, before the optimizer.

GNMR (arXiv 2606.00539) publishes only its abstract: per recoverable unit,
the ratio of the current gradient norm to its historical mean (GNMR) and a
signal for abrupt short-window rises (Delta-GNMR), mapped to bounded recovery
actions under a hard budget `maxO` of units in recovery and a short lock
interval, without changing number format, kernel or backend. Everything
below is our reconstruction; every constant is a GNMRConfig field
(m2jax/train/config.py, TrainConfig.gnmr; None = off).

Unit. A parameter leaf, except that a leaf with a batch axis (`expert`, the
axis m2jax.train.optim.MUON_BATCH_AXES orthogonalises per slice, passed in by
make_optimizer) is one unit per slice: each expert of a stacked [E, D, F]
tensor is recovered on its own, since one expert's load (and so its
gradient) moves independently of the others'. Units are named after their
parameter ("layers_0/attn/q_proj", "layers_0/moe/w1[3]"); Layout holds
them, in the order of the flattened parameter tree, as one vector [U].

Statistics, per unit, from g = the float32 L2 norm of its raw gradient:
  m      long EMA of g (`history_decay`, 0.95: ~20 steps of memory),
         bias-corrected like Adam's moments (m-hat = m / (1 - b^n), n the
         unit's observations), so the first observations are its mean
         rather than a pull towards zero.
  s      short EMA of g (`short_decay`, 0.5: ~2 steps), bias-corrected too.
  GNMR   = g / m-hat: the level against the unit's history. Catches spikes
         and rises that persist.
  Delta  = g / s-hat: the rise over the last couple of steps. Catches an
         abrupt jump the long history hides: where norms have been falling
         (the lm_head's fall 6-fold over its first 40 steps), m-hat lags
         above the current level and a 10x jump reads as a GNMR of 3 to 5;
         against s-hat it reads 10.
A unit is observed when g is finite and non-zero (an expert no token chose,
or a frozen module, has a zero gradient and says nothing about its scale).
An observation enters both EMAs winsorised, as min(g, history_cap * m-hat)
(cap 3) once the unit is past warm-up: a 1000x spike then moves the mean by
(1 - b)(cap - 1) = 10%, not 50x, while a genuine, lasting rise of the scale
is still followed, geometrically at 10% a step. During warm-up
(`warmup_steps` = 50 observations) a unit's history is built unclipped and
the unit never triggers (non-finite gradients are still skipped): early in
training norms move by 10x and more within tens of steps (the MTP modules'
start near zero and grow 100-fold; attention's rise 10-fold once the loss
drops), so a shorter warm-up mistakes that growth for faults (a clean tiny
run: 0.6% of unit-steps trigger with a 20-step warm-up, 0.07% with 50).

Trigger: a warm unit whose GNMR >= ratio_threshold (8) or whose Delta >=
delta_threshold (8). On clean tiny-preset runs (300 steps, AdamW and Muon;
benchmarks/notes/gnmr.md) the median GNMR is 1.0, its 99th percentile 3.2
to 3.5 and its 99.9th 7 to 7.5, the tail made by experts whose load, and
so gradient, jumps from batch to batch; 8 sits just past that (about 0.1%
of unit-steps trigger, the issue's bar is 0.5%) and two orders of magnitude
below a 1000x fault. Severity = max(GNMR / ratio_threshold,
Delta / delta_threshold).

Budget and lock. At most `max_recovering` (maxO, 8) units are in recovery
at once. Triggered units not already in recovery are admitted most severe
first into the free places; the rest are refused and pass unchanged (the
optimizer's global-norm clip after GNMR still bounds them). When more units
than that fail at once the fault is not unit-local (a bad batch, a learning
rate too high) and per-unit surgery on a large part of the model would
itself perturb training more than it protects it; the count of refused
units is logged so such an event is visible. An admitted unit stays in
recovery for `lock_steps` (10) steps, its admission step included: it is
neither released early nor re-admitted while locked, so a unit that keeps
flickering around the threshold does not churn the budget, and a fault
whose cause persists for a few steps (a bad region of activations) is
covered by one admission.

Actions, on each step a unit is in recovery, by its GNMR that step:
  skip   GNMR >= skip_ratio (100): the gradient is dropped (zeros; the
         optimizer's moments carry the unit on): such a gradient carries no
         usable direction (an fp8 overflow, a corrupted reduction).
  clip   otherwise, if g > clip_to * m-hat (2.0): rescaled to that norm,
         direction kept: a rise that may be real, taken at no more than
         twice the unit's usual size (room for its ordinary spread: with 1.0
         a clean run's locks clipped about half of their steps).
  higher precision  for the following steps of the lock, the unit is in
         `recovering(opt_state)`; a forward pass with a low-precision path
         (m2jax.train.precision: fake-quantised fp8 projection inputs, the
         stress harness's) computes the unit's module input without it.
         The path is per module input (all of q/k/v, or w1/w3 of every
         expert and the router), the finest place the model can be reached
         without editing it; the standard train step has no low-precision
         path, so there the unit is clipped or skipped only.
Non-finite gradients (inf or NaN anywhere in the unit, or a norm that
overflows float32) are always skipped, outside the budget and without a
lock: applying them is never an option, and they leave the history as it
was. Number formats, kernels and backends never change.

State (GNMRState) is a few [U] vectors (history, lock counters, the last
step's action and severity per unit) and the last step's metrics, all jnp:
`update` runs inside the jitted train step, one trace per step.
Metrics (metrics(opt_state), logged by m2jax.train.step when gnmr is on):
  gnmr/triggered   units that crossed a threshold this step
  gnmr/admitted    of those, units that entered recovery
  gnmr/refused     triggered, not in recovery, no room in the budget
  gnmr/recovering  units in recovery this step (<= max_recovering)
  gnmr/skipped     units whose gradient was dropped (non-finite included)
  gnmr/clipped     units whose gradient was clipped
  gnmr/nonfinite   units with a non-finite gradient
  gnmr/max_ratio   largest GNMR, gnmr/max_delta largest Delta-GNMR

  opt = optax.chain(gnmr.gnmr(GNMRConfig(), param_axes), optimizer)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from m2jax.train.config import GNMRConfig

PREFIX = "gnmr/"
METRICS = ("triggered", "admitted", "refused", "recovering", "skipped",
           "clipped", "nonfinite", "max_ratio", "max_delta")
# GNMRState.action_U: what happened to each unit's gradient at the last step.
PASS, CLIP, SKIP, NONFINITE = 0, 1, 2, 3
_TINY = 1e-30


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter leaf's units: `count` of them from `offset` in [U]."""
  name: str
  split: int | None   # the axis cut into units (experts); None: one unit
  count: int
  offset: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each unit of a parameter tree sits in the unit vector [U]."""
  leaves: tuple[Leaf, ...]

  @property
  def size(self) -> int:
    return sum(leaf.count for leaf in self.leaves)

  def unit_names(self) -> list[str]:
    return [leaf.name if leaf.split is None else f"{leaf.name}[{i}]"
            for leaf in self.leaves for i in range(leaf.count)]

  def index(self, unit: str) -> int:
    """The position of unit `unit` ("layers_0/moe/w1[3]") in [U]."""
    names = self.unit_names()
    if unit not in names:
      raise ValueError(f"no GNMR unit {unit!r}; units look like "
                       f"{names[:3]} ({len(names)} in all)")
    return names.index(unit)

  def norms(self, tree) -> jax.Array:
    """[U] float32 L2 norm of each unit's slice of `tree`."""
    parts = []
    for leaf, x in zip(self.leaves, jax.tree.leaves(tree)):
      x2 = jnp.square(x.astype(jnp.float32))
      if leaf.split is None:
        parts.append(jnp.sum(x2)[None])
      else:
        axes = tuple(a for a in range(x.ndim) if a != leaf.split)
        parts.append(jnp.sum(x2, axis=axes))
    return jnp.sqrt(jnp.concatenate(parts))

  def per_leaf(self, values_U, tree) -> Any:
    """`tree`'s structure with each leaf's units of `values_U` (shaped to
    broadcast against the leaf: [E, 1, 1] along a split axis, [] else)."""
    out = []
    for leaf, x in zip(self.leaves, jax.tree.leaves(tree)):
      v = values_U[leaf.offset:leaf.offset + leaf.count]
      if leaf.split is None:
        out.append(v[0])
      else:
        shape = [1] * x.ndim
        shape[leaf.split] = leaf.count
        out.append(v.reshape(shape))
    return jax.tree.unflatten(jax.tree.structure(tree), out)

  def leaf_any(self, mask_U) -> dict[str, jax.Array]:
    """{leaf name: whether any of its units is set in `mask_U`}."""
    return {leaf.name: jnp.any(mask_U[leaf.offset:leaf.offset + leaf.count])
            for leaf in self.leaves}


def layout(param_axes, tree, split_axes: tuple[str, ...] = ("expert",)
           ) -> Layout:
  """The units of `tree` (parameters, or gradients shaped like them).

  `param_axes`: the parameters' logical axes, a pytree of PartitionSpecs
  (m2jax.model.logical_axes(config)["params"]); `tree` may hold a subset
  of them (optax's masked-out nodes have no leaves). A leaf with an axis of
  `split_axes` is one unit per index of the first such axis.
  """
  flat = jax.tree_util.tree_flatten_with_path(
      param_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
  axes_of = {_name(path): tuple(spec) for path, spec in flat}
  leaves, offset = [], 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = _name(path)
    if name not in axes_of:
      raise ValueError(f"parameter {name} has no logical axes in param_axes")
    split = next((i for i, a in enumerate(axes_of[name]) if a in split_axes),
                 None)
    count = 1 if split is None else x.shape[split]
    leaves.append(Leaf(name, split, count, offset))
    offset += count
  return Layout(tuple(leaves))


class GNMRState(NamedTuple):
  """Per-unit history and recovery, and the last step's metrics."""
  count_U: jax.Array    # int32 observations (finite, non-zero norms)
  mean_U: jax.Array     # long EMA of the norm, not bias-corrected
  short_U: jax.Array    # short EMA of the norm, not bias-corrected
  lock_U: jax.Array     # int32 steps the unit stays in recovery after this
  action_U: jax.Array   # int32 PASS / CLIP / SKIP / NONFINITE, last step
  severity_U: jax.Array  # last step's severity (>= 1: triggered; 0: cold)
  metrics: dict[str, jax.Array]


def init_state(num_units: int) -> GNMRState:
  zeros = lambda dtype: jnp.zeros((num_units,), dtype)
  return GNMRState(zeros(jnp.int32), zeros(jnp.float32), zeros(jnp.float32),
                   zeros(jnp.int32), zeros(jnp.int32), zeros(jnp.float32),
                   {k: jnp.zeros((), jnp.float32) for k in METRICS})


class Verdict(NamedTuple):
  """judge's decision for one step: per-unit gradient scale and drops."""
  state: GNMRState
  skip_U: jax.Array    # bool: the unit's gradient becomes zeros
  scale_U: jax.Array   # float32: the factor on the gradients not skipped


def _debiased(ema_U, count_U, decay: float):
  correction = 1.0 - jnp.power(jnp.float32(decay), count_U)
  return jnp.where(count_U > 0, ema_U / jnp.maximum(correction, _TINY), 0.0)


def _admit(candidate_U, severity_U, free, max_recovering: int):
  """The (at most `free`) most severe candidates; `free` is traced."""
  k = min(max_recovering, candidate_U.shape[0])
  if k == 0:
    return jnp.zeros_like(candidate_U)
  score_U = jnp.where(candidate_U, severity_U, -1.0)
  top, idx = jax.lax.top_k(score_U, k)
  take = (jnp.arange(k) < free) & (top >= 0)
  return jnp.zeros_like(candidate_U).at[idx].set(take)


def judge(config: GNMRConfig, state: GNMRState, norms_U) -> Verdict:
  """One step of GNMR on the units' gradient norms [U] (module docstring)."""
  c = config
  finite = jnp.isfinite(norms_U)
  g = jnp.where(finite, norms_U, 0.0)
  observed = finite & (g > 0)
  n = state.count_U
  mean = _debiased(state.mean_U, n, c.history_decay)
  short = _debiased(state.short_U, n, c.short_decay)
  warm = (n >= c.warmup_steps) & (mean > 0)
  ratio = jnp.where(warm & finite, g / jnp.maximum(mean, _TINY), 0.0)
  delta = jnp.where(warm & finite & (short > 0),
                    g / jnp.maximum(short, _TINY), 0.0)
  triggered = (ratio >= c.ratio_threshold) | (delta >= c.delta_threshold)

  locked = state.lock_U > 0
  candidate = triggered & ~locked
  severity = jnp.maximum(ratio / c.ratio_threshold, delta / c.delta_threshold)
  free = jnp.maximum(c.max_recovering - jnp.sum(locked), 0)
  admitted = _admit(candidate, severity, free, c.max_recovering)
  recovering = locked | admitted

  skip = ~finite | (recovering & (ratio >= c.skip_ratio))
  cap = c.clip_to * mean
  clipped = recovering & ~skip & (g > cap)
  scale = jnp.where(clipped, cap / jnp.maximum(g, _TINY), 1.0)

  seen = jnp.where(warm, jnp.minimum(g, c.history_cap * mean), g)
  ema = lambda old, b: jnp.where(observed, b * old + (1 - b) * seen, old)
  action = jnp.where(~finite, NONFINITE,
                     jnp.where(skip, SKIP, jnp.where(clipped, CLIP, PASS)))
  count = lambda x: jnp.sum(x).astype(jnp.float32)
  metrics = {
      "triggered": count(triggered), "admitted": count(admitted),
      "refused": count(candidate & ~admitted),
      "recovering": count(recovering), "skipped": count(skip),
      "clipped": count(clipped), "nonfinite": count(~finite),
      "max_ratio": jnp.max(ratio, initial=0.0),
      "max_delta": jnp.max(delta, initial=0.0)}
  new = GNMRState(
      count_U=n + observed.astype(jnp.int32),
      mean_U=ema(state.mean_U, c.history_decay),
      short_U=ema(state.short_U, c.short_decay),
      lock_U=jnp.where(admitted, c.lock_steps - 1,
                       jnp.maximum(state.lock_U - 1, 0)),
      action_U=action.astype(jnp.int32), severity_U=severity,
      metrics=metrics)
  return Verdict(new, skip, scale.astype(jnp.float32))


def gnmr(config: GNMRConfig, param_axes,
         split_axes: tuple[str, ...] = ("expert",)
         ) -> optax.GradientTransformation:
  """GNMR as an optax transformation over raw gradients (chain it first).

  `param_axes`: the parameters' logical axes (see `layout`); a leaf with an
  axis of `split_axes` is recovered per slice of it.
  """

  def init(params):
    return init_state(layout(param_axes, params, split_axes).size)

  def update(updates, state, params=None):
    del params
    lay = layout(param_axes, updates, split_axes)
    verdict = judge(config, state, lay.norms(updates))
    skip = lay.per_leaf(verdict.skip_U, updates)
    scale = lay.per_leaf(verdict.scale_U, updates)
    updates = jax.tree.map(
        lambda u, s, k: jnp.where(k, jnp.zeros_like(u), u * s.astype(u.dtype)),
        updates, scale, skip)
    return updates, verdict.state

  return optax.GradientTransformation(init, update)


def find_state(opt_state) -> GNMRState | None:
  """The GNMRState inside an optimizer state, None when GNMR is off."""
  return optax.tree_utils.tree_get(opt_state, "GNMRState")


def metrics(opt_state) -> dict[str, jax.Array]:
  """{"gnmr/<name>": float32} of the last update ({} when GNMR is off)."""
  state = find_state(opt_state)
  if state is None:
    return {}
  return {PREFIX + k: v for k, v in state.metrics.items()}


def recovering(opt_state) -> jax.Array:
  """[U] bool: the units in recovery at the next step (their lock holds)."""
  state = find_state(opt_state)
  if state is None:
    raise ValueError("the optimizer state holds no GNMR state "
                     "(TrainConfig.gnmr is None)")
  return state.lock_U > 0
