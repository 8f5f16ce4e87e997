"""The Spectral Sphere Optimizer (SSO) and MuonSphere, as optax transformations.

SSO (arXiv 2601.08393, SPEC §4) keeps every hidden matrix UNIT W (d_in x
d_out here: y = x W) on the sphere of spectral radius R = c sqrt(d_out /
d_in) and steps along it. Per unit and step:

  M  = momentum * M + G;  N = G + momentum * M       Nesterov momentum
  M^ = N / |N|_F
  sigma, u, v = top singular triplet of W            warm-started power iter.
  W  <- W R / sigma                                  retraction to the sphere
  Theta = v u^T                                      d sigma / d W
  lambda* : h(lambda) = <Theta, msign(M^ + lambda Theta)> = 0
  W  <- W - eta R msign(M^ + lambda* Theta)

h is monotone in lambda, so lambda* is bracketed and the bracket refined
(solve_lambda): each unit's search starts at its lambda* of the previous
step (kept in the state; `sso_warm_start`), steps away from it until h
changes sign (at least doubling each time, at most
`sso_bracket_doublings` doublings' reach beyond the cold search's), then
refines by Illinois-modified regula falsi (`sso_root_finder`; "bisect":
bisection) for at most `sso_bisect_steps` steps, until |h| <=
`sso_tolerance`; with no bracket it falls back to lambda = 0. Each
evaluation of h is one msign: measured on the tiny preset in training,
~4.5 a unit and step (max 6-13) against 13 (max ~20) for the cold
bracket-and-bisect search (`metrics` reports them). The step
msign(.) has spectral norm 1, so |W_new - W_retracted|_2 = eta R exactly,
and <Theta, step> = 0 keeps it tangent to the sphere (sigma moves only at
second order). MuonSphere is the same with lambda = 0: Muon's direction,
retracted each step. msign is Newton-Schulz with the Polar-Express
coefficients (arXiv 2505.16932), in float32 whatever the parameter's dtype.

Optax adds updates to parameters, so this transformation emits the whole
delta W_new - W (retraction + step) and needs `params`. eta is the WSD
schedule's learning rate at the transformation's own step count (the
`learning_rate` schedule it is given: m2jax.train.optim passes the schedule
of TrainConfig.matrix_learning_rate); nothing after it may scale or decay
the delta, so constrained matrices get no weight decay (the sphere bounds
them instead).

Units. A parameter is a stack of units: its `MuonDimensionNumbers` name the
input (reduction) and output axes, every other axis indexes units. Units
are independent, and solved together: the units of one shape, of whichever
parameters, form one stack (batched matmuls, one vectorised
bracket/bisection loop, one compiled solve per shape; a unit's result does
not depend on the others'). m2jax.train.optim.sphere_units
splits attention q/k/v per head (each head's d_model -> head_dim map is
used on its own, by its own attention) and each expert of [E, D, F] on its
own; attention o stays ONE unit (q_heads x head_dim -> d_model): it is a
single map whose input is the concatenation of the heads and whose output
is one residual-stream update, the activation whose scale the sphere is
there to control. A per-head o would bound each head's share only, letting
their sum grow with the head count.

Power iteration. The singular vectors live in the optimizer state, shaped
like the parameter with size 1 on the axes they are reduced over, so they
shard like it (m2jax.train.state). `init` runs `sso_power_iters_init` (100)
iterations from a fixed start: a cold start needs many, since at the top of
a random matrix's spectrum the singular values crowd together (measured on
normal(0.02) 1024 x 512 / 1024 x 128 matrices: sigma low by 5e-4 / 5e-3
after 50 iterations, 9e-6 / 5e-4 after 100). Each step then runs
`sso_power_iters` (5) more from the stored vectors: the weights move by
eta ~ 2% (spectral, relative) per step, so the vectors stay near-converged
and the iterations accumulate across steps. They are matrix-vector
products, a few ms a step at m2_small against ~0.1-1 s for one msign.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

from m2jax.train.config import SSO_ROOT_FINDERS, TrainConfig

# Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932): the
# minimax-optimal odd quintics a x + b x^3 + c x^5 for 8 iterations mapping
# singular values in [1e-3, 1] to 1, the last being Newton-Schulz's own
# (15/8, -10/8, 3/8), which further steps repeat.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The same paper's guard against rounding: the input is divided by 1.01 x
# its Frobenius norm and every polynomial but the last is fitted to a
# 1.01-wider interval (p(x / 1.01) with x rescaled: a/s, b/s^3, c/s^5).
POLAR_EXPRESS_SAFETY = 1.01

# The power iteration's cold start (see _cold_start): pi (3 - sqrt(5)).
GOLDEN_ANGLE = math.pi * (3 - math.sqrt(5))

# TrainConfig.sso_matmul_precision -> jnp.matmul's `precision`.
PRECISIONS = {"default": jax.lax.Precision.DEFAULT,
              "high": jax.lax.Precision.HIGH,
              "highest": jax.lax.Precision.HIGHEST,
              "BF16_BF16_F32_X3": "BF16_BF16_F32_X3",
              "BF16_BF16_F32_X6": "BF16_BF16_F32_X6"}


def polar_express_coefficients(steps: int) -> list[tuple[float, float, float]]:
  """The (a, b, c) of each of `steps` Newton-Schulz iterations."""
  s = POLAR_EXPRESS_SAFETY
  safe = [(a / s, b / s**3, c / s**5)
          for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
  safe.append(POLAR_EXPRESS_COEFFICIENTS[-1])
  return [safe[min(i, len(safe) - 1)] for i in range(steps)]


def _frobenius(x):
  """|x|_F of each matrix of x [..., m, n], as [..., 1, 1]."""
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def msign(x, *, steps: int = 8, eps: float = 1e-7, precision=None):
  """The polar factor U V^T of each matrix of x [..., m, n] (x = U S V^T),
  float32, by `steps` Polar-Express Newton-Schulz iterations.

  Singular values above 1e-3 x |x|_F reach 1 within float32 rounding after
  8 steps; a zero matrix stays zero.
  """
  x = jnp.asarray(x, jnp.float32)
  # Iterate on the smaller Gram matrix.
  tall = x.shape[-2] > x.shape[-1]
  if tall:
    x = x.mT
  x = x / (_frobenius(x) * POLAR_EXPRESS_SAFETY + eps)
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  for a, b, c in polar_express_coefficients(steps):
    gram = mm(x, x.mT)
    x = a * x + mm(b * gram + c * mm(gram, gram), x)
  return x.mT if tall else x


def top_singular(w, v, *, iters: int, eps: float = 1e-7, precision=None):
  """(sigma, u, v): the top singular triplet of each matrix of w [..., d_in,
  d_out] by `iters` power iterations from v [..., d_in, 1]: sigma [..., 1,
  1], u [..., 1, d_out], v [..., d_in, 1], w ~ sigma v u.

  sigma = |v^T w| never exceeds the true top singular value and reaches it
  as v converges.
  """
  w = jnp.asarray(w, jnp.float32)
  mm = lambda a, b: jnp.matmul(a, b, precision=precision)
  unit = lambda x: x / (_frobenius(x) + eps)

  def body(_, v):
    return unit(mm(w, unit(mm(v.mT, w)).mT))

  v = jax.lax.fori_loop(0, iters, body, unit(jnp.asarray(v, jnp.float32)))
  wv = mm(v.mT, w)
  sigma = _frobenius(wv)
  return sigma, wv / (sigma + eps), v


class LambdaSolve(NamedTuple):
  """lambda* per unit and what comes with it (each [..., 1, 1] but phi)."""
  lam: jax.Array            # the multiplier (0 where there was no bracket)
  phi: jax.Array            # msign(M^ + lam Theta), the step direction
  h: jax.Array              # h(lam) = <Theta, phi>
  bracketed: jax.Array      # bool: a sign change of h was found
  evaluations: jax.Array    # int32: the h evaluations this unit's solve used


ROOT_FINDERS = SSO_ROOT_FINDERS
# A warm start's first step away from lambda_prev, relative to |lambda_prev|
# (at least bracket_start). Measured on the tiny preset in training: lambda*
# moves by a median 17-30% a step (the new gradient is 1/10 of the
# momentum's mass, and Nesterov weighs it again), some units through 0.
WARM_STEP = 0.25

_BRACKET, _REFINE, _FALLBACK, _DONE = 0, 1, 2, 3
_NEAR, _FAR = -1, 1


def solve_lambda(m_hat, v, u, *, bracket_start: float,
                 bracket_doublings: int, bisect_steps: int, tolerance: float,
                 lam_start=None, root_finder: str = "illinois",
                 ns_steps: int = 8, eps: float = 1e-7,
                 precision=None) -> LambdaSolve:
  """The root of h(lam) = <Theta, msign(m_hat + lam Theta)>, Theta = v u,
  of each unit.

  m_hat: [..., d_in, d_out] float32 (leading axes index units); v [...,
  d_in, 1], u [..., 1, d_out] (Theta is never stored); lam_start [..., 1,
  1]: where each unit's search starts (the previous step's lambda*: a warm
  start; None: 0).

  h is nondecreasing (the derivative of the nuclear norm |m_hat + lam
  Theta|_* along Theta, a convex function of lam), so one sign change
  brackets the root. Units are solved together in one loop that evaluates
  msign for all of them per iteration and ends when each is done:

  * |h(a)| <= tolerance at the start a: lam = a.
  * Bracket: candidates a + d_k toward the root (-sign h(a)), d_0 = s =
    max(WARM_STEP |a|, bracket_start), then d_k = s 2^k ("bisect"; from a
    = 0 the original cold search) or under "illinois" the larger of 2
    d_{k-1}, s 2^k and 1.5 x the secant's root through (a, h(a)) and the
    last candidate (capped at 16 d_{k-1}). The first candidate past the
    root brackets it. None up to k = bracket_doublings and beyond the cold
    search's last candidate (+-bracket_start 2^bracket_doublings, so a
    warm start never gives up sooner than a cold one): no bracket, lam = 0
    (one more evaluation, at 0, when a != 0).
  * Refinement of the bracket until |h| <= tolerance or bisect_steps
    steps: "bisect" halves it; "illinois" is regula falsi with the
    Illinois modification (an end kept twice running has its h halved),
    superlinear on a smooth h, each candidate strictly inside the bracket
    (the midpoint where the secant is not), so it cannot diverge. lam =
    the point of smallest |h| once bracketed.

  `evaluations` counts each unit's h evaluations, the start's included;
  the loop runs max(evaluations) - 1 times.
  """
  if root_finder not in ROOT_FINDERS:
    raise ValueError(f"root_finder: must be one of {ROOT_FINDERS} (got "
                     f"{root_finder!r})")
  evaluate = lambda lam: msign(m_hat + lam * v * u, steps=ns_steps, eps=eps,
                               precision=precision)
  h_of = lambda phi: jnp.sum(v * phi * u, axis=(-2, -1), keepdims=True)
  unit_shape = m_hat.shape[:-2] + (1, 1)
  a = (jnp.zeros(unit_shape, jnp.float32) if lam_start is None
       else jnp.broadcast_to(jnp.asarray(lam_start, jnp.float32), unit_shape))
  phi_a = evaluate(a)
  h_a = h_of(phi_a)
  toward = -jnp.sign(h_a)           # the root lies this way from a
  step0 = jnp.maximum(WARM_STEP * jnp.abs(a), bracket_start)
  cold_reach = bracket_start * 2.0**bracket_doublings
  int32 = lambda x: jnp.asarray(x, jnp.int32)
  init = {
      "phase": int32(jnp.where(jnp.abs(h_a) <= tolerance, _DONE, _BRACKET)),
      "evaluations": int32(jnp.ones(unit_shape)),
      "expanded": int32(jnp.zeros(unit_shape)),
      "refined": int32(jnp.zeros(unit_shape)),
      "near": a, "h_near": h_a,    # bracket end on h(a)'s side
      "far": a, "h_far": h_a,      # bracket end past the root
      "side": int32(jnp.zeros(unit_shape)),   # the end the last step moved
      "lam": a, "h": h_a, "phi": phi_a,       # the best point
      "bracketed": jnp.zeros(unit_shape, bool),
  }

  def refine_candidate(c):
    mid = 0.5 * (c["near"] + c["far"])
    if root_finder == "bisect":
      return mid
    secant = c["far"] - c["h_far"] * (c["far"] - c["near"]) / (
        c["h_far"] - c["h_near"])
    lo = jnp.minimum(c["near"], c["far"])
    hi = jnp.maximum(c["near"], c["far"])
    inside = jnp.isfinite(secant) & (secant > lo) & (secant < hi)
    return jnp.where(inside, secant, mid)

  def expansion(c):
    """How far from a the next bracket candidate lies: step0 2^k; under
    "illinois", where the secant through (a, h(a)) and the last candidate
    puts the root farther, 1.5 x that (to pass it), at most 16 x the last
    distance. At least twice the last distance either way, so the cold
    search's reach is passed in as many candidates."""
    geometric = step0 * 2.0**c["expanded"]
    if root_finder == "bisect":
      return geometric
    last = toward * (c["near"] - a)
    secant = last * h_a / (h_a - c["h_near"])
    useful = (c["expanded"] > 0) & jnp.isfinite(secant)
    reach = jnp.minimum(1.5 * secant, 16 * jnp.maximum(last, step0))
    return jnp.maximum(jnp.maximum(geometric, 2 * last),
                       jnp.where(useful, reach, 0.0))

  def step(c):
    phase = c["phase"]
    bracketing, refining = phase == _BRACKET, phase == _REFINE
    falling_back = phase == _FALLBACK
    expand_to = a + toward * expansion(c)
    candidate = jnp.where(bracketing, expand_to,
                          jnp.where(refining, refine_candidate(c), 0.0))
    phi = evaluate(candidate)
    h = h_of(phi)
    past = h * toward >= 0          # the root lies between near and here
    small = jnp.abs(h) <= tolerance
    found = bracketing & past
    searching = bracketing | refining
    take = ((found | refining) & (jnp.abs(h) < jnp.abs(c["h"]))
            | falling_back)
    refined = c["refined"] + refining
    no_bracket = (bracketing & ~past & (c["expanded"] >= bracket_doublings)
                  & ((toward * expand_to >= cold_reach * (1 - 1e-6))
                     | (c["expanded"] >= bracket_doublings + 3)))
    done = ((found & (small | (bisect_steps <= 0)))
            | (refining & (small | (refined >= bisect_steps)))
            | (no_bracket & (a == 0)) | falling_back)
    phase = jnp.where(
        done, _DONE, jnp.where(
            found, _REFINE, jnp.where(no_bracket, _FALLBACK, phase)))
    moves_near = searching & ~past
    moves_far = searching & past
    # Illinois: an end kept twice running has its h halved, so the next
    # secant falls nearer the root's side and that end moves too.
    halve = root_finder == "illinois"
    h_near = jnp.where(moves_near, h, c["h_near"])
    h_far = jnp.where(moves_far, h, c["h_far"])
    if halve:
      h_near = jnp.where(refining & moves_far & (c["side"] == _FAR),
                         0.5 * h_near, h_near)
      h_far = jnp.where(refining & moves_near & (c["side"] == _NEAR),
                        0.5 * h_far, h_far)
    side = jnp.where(refining & moves_far, _FAR,
                     jnp.where(refining & moves_near, _NEAR, c["side"]))
    return {
        "phase": int32(phase),
        "evaluations": c["evaluations"] + (c["phase"] != _DONE),
        "expanded": c["expanded"] + bracketing,
        "refined": refined,
        "near": jnp.where(moves_near, candidate, c["near"]), "h_near": h_near,
        "far": jnp.where(moves_far, candidate, c["far"]), "h_far": h_far,
        "side": int32(side),
        "lam": jnp.where(take, candidate, c["lam"]),
        "h": jnp.where(take, h, c["h"]),
        "phi": jnp.where(take, phi, c["phi"]),
        "bracketed": c["bracketed"] | found,
    }

  out = jax.lax.while_loop(lambda c: jnp.any(c["phase"] != _DONE), step, init)
  return LambdaSolve(out["lam"], out["phi"], out["h"], out["bracketed"],
                     out["evaluations"])


# Parameters <-> their units' matrices [units..., d_in, d_out].

def _axes(ndim: int, dims: MuonDimensionNumbers):
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
  reduction, output = as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)
  batch = tuple(a for a in range(ndim) if a not in reduction + output)
  return batch, reduction, output


def _to_units(x, dims: MuonDimensionNumbers):
  """x (a parameter's layout) -> [batch..., prod(input), prod(output)]."""
  batch, reduction, output = _axes(x.ndim, dims)
  shape = ([x.shape[a] for a in batch]
           + [math.prod(x.shape[a] for a in reduction),
              math.prod(x.shape[a] for a in output)])
  return jnp.transpose(x, batch + reduction + output).reshape(shape)


def _from_units(y, dims: MuonDimensionNumbers, shape):
  """_to_units's inverse, back to a parameter-layout array of `shape`."""
  perm = sum(_axes(len(shape), dims), ())
  return jnp.transpose(y.reshape([shape[a] for a in perm]), np.argsort(perm))


def _vector_shape(shape, dims: MuonDimensionNumbers, side: str):
  """The parameter-layout shape of a singular vector: 1 on the axes it is
  reduced over ("u", the output side: the input axes; "v": the output
  axes); of a per-unit scalar ("unit": lambda*), 1 on both."""
  _, reduction, output = _axes(len(shape), dims)
  gone = {"u": reduction, "v": output, "unit": reduction + output}[side]
  return tuple(1 if a in gone else n for a, n in enumerate(shape))


class SphereState(NamedTuple):
  """Per unit-family state: the step count (which the schedule reads), the
  momentum, each unit's top singular vectors (parameter layout, size 1 on
  the axes they are reduced over), each unit's lambda* of the last step
  (size 1 on the input and output axes; the next solve starts there; 0
  under MuonSphere) and the last step's METRICS (float32 scalars, see
  `metrics`)."""
  count: jax.Array
  momentum: optax.Updates
  u: optax.Updates
  v: optax.Updates
  lam: optax.Updates
  metrics: dict[str, jax.Array]


# SphereState.metrics: the lambda solve's h evaluations (msign of a unit;
# MuonSphere's one msign counts 1) per unit, mean and max over the units,
# and the step's msign work in msigns of every unit: each stack's loop
# runs until its last unit is done, so a stack costs its max, weighted
# here by its share of one msign's FLOPs. The step's msign time is about
# msign_cost x MuonSphere's.
METRICS = ("evaluations_mean", "evaluations_max", "msign_cost")


def _no_metrics():
  return {k: jnp.ones((), jnp.float32) for k in METRICS}


def find_state(opt_state) -> SphereState | None:
  """The SphereState inside an optimizer state, None if there is none."""
  return optax.tree_utils.tree_get(opt_state, "SphereState")


def metrics(opt_state) -> dict[str, jax.Array]:
  """{"sso/<name>": float32} of the last update (METRICS; {} without SSO
  or MuonSphere in `opt_state`)."""
  state = find_state(opt_state)
  if state is None:
    return {}
  return {"sso/" + k: v for k, v in state.metrics.items()}


def _stacks(shapes, dims) -> dict[tuple[int, int], list[int]]:
  """{(d_in, d_out): the indices of the leaves whose units have that shape}.

  Units of one shape are solved as one batch, whichever parameter they
  belong to: one compiled solve per shape, not per parameter, and one
  device loop.
  """
  out = {}
  for i, (shape, d) in enumerate(zip(shapes, dims)):
    _, reduction, output = _axes(len(shape), d)
    key = (math.prod(shape[a] for a in reduction),
           math.prod(shape[a] for a in output))
    out.setdefault(key, []).append(i)
  return out


def _stacked(units, index):
  """The units of units[i] ([..., d_in, d_out]) for i in `index` as one
  [N, d_in, d_out] batch."""
  return jnp.concatenate(
      [units[i].reshape((-1,) + units[i].shape[-2:]) for i in index])


def _unstacked(stack, batch_shapes, index):
  """_stacked's inverse: {i: stack's part, [*batch_shapes[i], ...]}."""
  sizes = np.cumsum([math.prod(batch_shapes[i]) for i in index])[:-1]
  return {i: part.reshape(batch_shapes[i] + part.shape[-2:])
          for i, part in zip(index, jnp.split(stack, sizes))}


@functools.partial(jax.jit,
                   static_argnames=("dims", "iters", "eps", "precision"))
def _cold_start(ps, dims, *, iters, eps, precision):
  """(us, vs): each parameter's singular vectors (parameter layout) by
  `iters` power iterations, a stack of units of one shape at a time, from
  cos(golden angle x i): deterministic, cheap (no random-bits program to
  compile) and equidistributed, so no more likely orthogonal to a top
  singular vector than a random start."""
  ws = [_to_units(p, d) for p, d in zip(ps, dims)]
  batch_shapes = [w.shape[:-2] for w in ws]
  us, vs = [None] * len(ps), [None] * len(ps)
  for index in _stacks([p.shape for p in ps], dims).values():
    w = _stacked(ws, index)
    n = math.prod(w.shape[:-1])
    start = jnp.cos(GOLDEN_ANGLE * jnp.arange(n, dtype=jnp.float32)).reshape(
        w.shape[:-1] + (1,))
    _, u, v = top_singular(w, start, iters=iters, eps=eps, precision=precision)
    for i, part in _unstacked(u, batch_shapes, index).items():
      us[i] = _from_units(part, dims[i],
                          _vector_shape(ps[i].shape, dims[i], "u"))
    for i, part in _unstacked(v, batch_shapes, index).items():
      vs[i] = _from_units(part, dims[i],
                          _vector_shape(ps[i].shape, dims[i], "v"))
  return us, vs


def scale_by_sphere(config: TrainConfig, unit_dims,
                    learning_rate: Callable[[jax.Array], jax.Array], *,
                    solve: bool) -> optax.GradientTransformation:
  """SSO (`solve`) or MuonSphere (lambda = 0) over every leaf it is given.

  `unit_dims`: a tree of MuonDimensionNumbers over the parameters, or a
  function of the parameters returning one (m2jax.train.optim.sphere_units);
  `learning_rate`: step -> eta. The constants are TrainConfig's sso_*
  fields. Emits W_new - W (module docstring): apply it as is.
  """
  c = config
  precision = PRECISIONS[c.sso_matmul_precision]
  dims_of = unit_dims if callable(unit_dims) else (lambda _: unit_dims)

  def leaves(params, *trees):
    treedef = jax.tree.structure(params)
    dims = treedef.flatten_up_to(dims_of(params))
    return treedef, dims, [treedef.flatten_up_to(t) for t in trees]

  def init(params):
    treedef, dims, (ps,) = leaves(params, params)
    us, vs = _cold_start(tuple(ps), tuple(dims), iters=c.sso_power_iters_init,
                         eps=c.sso_eps, precision=precision) if ps else ([], [])
    lams = [jnp.zeros(_vector_shape(p.shape, d, "unit"), jnp.float32)
            for p, d in zip(ps, dims)]
    return SphereState(jnp.zeros((), jnp.int32),
                       optax.tree.zeros_like(params),
                       treedef.unflatten(us), treedef.unflatten(vs),
                       treedef.unflatten(lams), _no_metrics())

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("SSO/MuonSphere retract the parameters: call "
                       "update(grads, state, params)")
    eta = jnp.asarray(learning_rate(state.count), jnp.float32)
    momentum = jax.tree.map(lambda m, g: c.sso_momentum * m + g,
                            state.momentum, updates)
    treedef, dims, (gs, ms, ps, us, vs, lams) = leaves(
        params, updates, momentum, params, state.u, state.v, state.lam)
    f32 = lambda x, d: _to_units(x, d).astype(jnp.float32)
    ws = [f32(p, d) for p, d in zip(ps, dims)]
    ns = [f32(g + c.sso_momentum * m, d) for g, m, d in zip(gs, ms, dims)]
    v_units = [f32(v, d) for v, d in zip(vs, dims)]
    lam_units = [_to_units(x, d) for x, d in zip(lams, dims)]
    batch_shapes = [w.shape[:-2] for w in ws]
    deltas, new_u, new_v = [None] * len(ps), [None] * len(ps), [None] * len(ps)
    new_lam = list(lams)
    # Per stack: (each unit's evaluations, msign FLOPs of the stack).
    counts, flops = [], []
    for (d_in, d_out), index in _stacks([p.shape for p in ps], dims).items():
      radius = c.sso_radius_scale * math.sqrt(d_out / d_in)
      w = _stacked(ws, index)
      sigma, u, v = top_singular(w, _stacked(v_units, index),
                                 iters=c.sso_power_iters, eps=c.sso_eps,
                                 precision=precision)
      n = _stacked(ns, index)
      m_hat = n / (_frobenius(n) + c.sso_eps)
      if solve:
        solved = solve_lambda(
            m_hat, v, u, bracket_start=c.sso_bracket_start,
            bracket_doublings=c.sso_bracket_doublings,
            bisect_steps=c.sso_bisect_steps, tolerance=c.sso_tolerance,
            lam_start=(_stacked(lam_units, index) if c.sso_warm_start
                       else None),
            root_finder=c.sso_root_finder, ns_steps=c.sso_ns_steps,
            eps=c.sso_eps, precision=precision)
        phi = solved.phi
        counts.append(solved.evaluations.reshape(-1))
        for i, part in _unstacked(solved.lam, batch_shapes, index).items():
          new_lam[i] = _from_units(part, dims[i], lams[i].shape)
      else:
        # At the stored lambda (always 0): the same program as SSO's first
        # evaluation, so where SSO stops there the two agree to the bit.
        lam = _stacked(lam_units, index)
        phi = msign(m_hat + lam * v * u, steps=c.sso_ns_steps, eps=c.sso_eps,
                    precision=precision)
        counts.append(jnp.ones(m_hat.shape[:-2], jnp.int32).reshape(-1))
      flops.append(m_hat.shape[0] * min(d_in, d_out)**2 * max(d_in, d_out))
      retract = radius / jnp.maximum(sigma, c.sso_eps)
      delta = w * (retract - 1.0) - eta * radius * phi
      for i, part in _unstacked(delta, batch_shapes, index).items():
        deltas[i] = _from_units(part, dims[i], ps[i].shape).astype(
            ps[i].dtype)
      for i, part in _unstacked(u, batch_shapes, index).items():
        new_u[i] = _from_units(part, dims[i], us[i].shape).astype(us[i].dtype)
      for i, part in _unstacked(v, batch_shapes, index).items():
        new_v[i] = _from_units(part, dims[i], vs[i].shape).astype(vs[i].dtype)
    if counts:
      every = jnp.concatenate(counts).astype(jnp.float32)
      # Weights as Python floats: m2_small's stacks count ~5e9 FLOPs, more
      # than an int32 (the counts' dtype) holds.
      cost = sum(f / sum(flops) * jnp.max(n).astype(jnp.float32)
                 for f, n in zip(flops, counts))
      step_metrics = {"evaluations_mean": jnp.mean(every),
                      "evaluations_max": jnp.max(every),
                      "msign_cost": jnp.asarray(cost, jnp.float32)}
    else:
      step_metrics = _no_metrics()
    return (treedef.unflatten(deltas),
            SphereState(state.count + 1, momentum, treedef.unflatten(new_u),
                        treedef.unflatten(new_v), treedef.unflatten(new_lam),
                        step_metrics))

  return optax.GradientTransformation(init, update)
