"""GNMR under stress (issue 19): a small model trained clean and with
injected faults, GNMR on and off (m2jax.train.gnmr; the command is
experiments/bench_gnmr.py, tests/test_gnmr.py runs a short version).

Faults, each at one step on one GNMR unit (gnmr.Layout's unit names, e.g.
"layers_0/attn/q_proj", "layers_1/moe/w1[3]"):
  spike  the unit's raw gradient times `factor` (1000)
  inf    the unit's raw gradient set to +inf
  nan    the unit's raw gradient set to NaN
They enter between the backward pass and the optimizer
(m2jax.train.step.gradients, then apply_gradients), where GNMR, when on,
sees them first. A scenario may train with fake-fp8 projection inputs
(m2jax.train.precision); with GNMR on, units in recovery get their module's
input back in full precision for their lock.

Every run of a Harness trains the same batches from the same init, so runs
differ only by faults, fp8 and GNMR. A run's record: its train losses and
GNMR metrics per step, each faulted unit's GNMR action at its fault step,
the final validation loss and whether the parameters stayed finite.
`report` turns the runs into the results file: the clean run's
false-trigger rate (unit-steps triggered / unit-steps), the fate of every
fault, the budget held, and each stressed run's final loss against the
clean run's (relative difference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.data import DataConfig, make_dataset, make_iterator, make_tokenizer
from m2jax.train import gnmr, optim, precision
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

FAULT_KINDS = ("spike", "inf", "nan")
_POISON = {"inf": 1, "nan": 2}
ACTION_NAMES = {gnmr.PASS: "pass", gnmr.CLIP: "clip", gnmr.SKIP: "skip",
                gnmr.NONFINITE: "skip (non-finite)"}


@dataclasses.dataclass(frozen=True)
class Fault:
  step: int
  unit: str
  kind: str = "spike"
  factor: float = 1000.0

  def __post_init__(self):
    if self.kind not in FAULT_KINDS:
      raise ValueError(f"Fault.kind: must be one of {FAULT_KINDS} "
                       f"(got {self.kind!r})")


@dataclasses.dataclass(frozen=True)
class Scenario:
  name: str
  faults: tuple[Fault, ...] = ()
  fp8: bool = False


def unit_layout(model_config: ModelConfig) -> gnmr.Layout:
  """The GNMR units of `model_config`'s parameters (as make_optimizer's)."""
  params = jax.eval_shape(lambda: model.init(model_config,
                                             jax.random.key(0)))["params"]
  return gnmr.layout(model.logical_axes(model_config)["params"], params,
                     optim.MUON_BATCH_AXES)


def default_scenarios(lay: gnmr.Layout, steps: int, *, factor: float,
                      max_recovering: int) -> list[Scenario]:
  """clean; faults (spikes on four units of different kinds, an inf and a
  NaN); burst (2 x max_recovering units spiked at once, factors spread
  so that the most severe are known); fp8 (clean, fake-fp8 inputs); fp8 +
  faults. Fault steps fall after GNMR's warm-up, from 30% of the run."""
  names = lay.unit_names()
  pick = lambda *parts: next(n for n in names if all(p in n for p in parts))
  at = lambda fraction: int(fraction * steps)
  last = max(int(n.split("_")[1].split("/")[0]) for n in names
             if n.startswith("layers_"))
  faults = (
      Fault(at(0.30), pick("layers_0/", "q_proj"), "spike", factor),
      Fault(at(0.40), pick(f"layers_{last}/", "w1[1]"), "spike", factor),
      Fault(at(0.50), pick(f"layers_{last}/", "o_proj"), "spike", factor),
      Fault(at(0.60), pick("lm_head"), "spike", factor),
      Fault(at(0.45), pick("layers_0/", "w2[2]"), "inf"),
      Fault(at(0.55), pick("embedding"), "nan"),
  )
  # Units of the projections (not gains): a burst across the model.
  burst_units = [n for n in names if n.endswith(("proj", "]", "lm_head"))]
  burst_units = burst_units[::max(1, len(burst_units)
                                  // (2 * max_recovering))]
  # Two groups 20x apart: the first max_recovering are the most severe
  # whatever each unit's own ratio (a clean run's spread is well under 2x).
  burst = tuple(
      Fault(at(0.5), u, "spike",
            factor * (1 - 0.02 * i) / (1 if i < max_recovering else 20))
      for i, u in enumerate(burst_units[:2 * max_recovering]))
  return [Scenario("clean"), Scenario("faults", faults),
          Scenario("burst", burst), Scenario("fp8", fp8=True),
          Scenario("fp8_faults", faults, fp8=True)]


def fault_arrays(lay: gnmr.Layout, faults, steps: int):
  """([steps, U] float32 gradient factors, [steps, U] int32 poison: 0 none,
  1 inf, 2 NaN) of `faults`."""
  scale = np.ones((steps, lay.size), np.float32)
  poison = np.zeros((steps, lay.size), np.int32)
  for f in faults:
    if not 0 <= f.step < steps:
      raise ValueError(f"fault at step {f.step}: the run has {steps} steps")
    u = lay.index(f.unit)
    if f.kind == "spike":
      scale[f.step, u] *= f.factor
    else:
      poison[f.step, u] = _POISON[f.kind]
  return scale, poison


def inject(lay: gnmr.Layout, grads, scale_U, poison_U):
  """`grads` with each unit scaled by scale_U and poisoned by poison_U."""
  scale = lay.per_leaf(scale_U, grads)
  poison = lay.per_leaf(poison_U, grads)

  def one(g, s, p):
    g = g * s.astype(g.dtype)
    return jnp.where(p == 1, jnp.inf, jnp.where(p == 2, jnp.nan, g)
                     ).astype(g.dtype)

  return jax.tree.map(one, grads, scale, poison)


@functools.lru_cache(maxsize=16)
def _step_fn(model_config: ModelConfig, train_config: TrainConfig, fp8: bool):
  """The jitted stress step: (state, batch, scale_U, poison_U) -> (state,
  metrics, GNMR's action and severity per unit). Compiled once per
  (configs, fp8)."""
  lay = unit_layout(model_config)

  def step(state, batch, scale_U, poison_U):
    high = {}
    if fp8 and train_config.gnmr is not None:
      high = lay.leaf_any(gnmr.recovering(state.opt_state))
    scope = (precision.fp8_projection_inputs(high) if fp8
             else contextlib.nullcontext())
    with scope:
      metrics, out, grads = step_lib.gradients(
          state, batch, model_config=model_config, train_config=train_config)
    grads = inject(lay, grads, scale_U, poison_U)
    state, step_metrics = step_lib.apply_gradients(
        state, grads, out, model_config=model_config,
        train_config=train_config)
    found = gnmr.find_state(state.opt_state)
    if found is None:
      found = gnmr.init_state(lay.size)
    return (state, dict(metrics, **step_metrics), found.action_U,
            found.severity_U)

  return jax.jit(step, donate_argnums=0)


class Harness:
  """One model, one data stream, one init: runs that differ by scenario."""

  def __init__(self, model_config: ModelConfig, data_config: DataConfig, *,
               steps: int, eval_batches: int = 4):
    self.model_config = model_config
    self.layout = unit_layout(model_config)
    tokenizer = make_tokenizer(data_config)
    it = make_iterator(data_config, tokenizer, "train")
    self.batches = [{k: np.asarray(v) for k, v in next(it).items()}
                    for _ in range(steps)]
    it.close()
    self.val_batches = [
        {k: np.asarray(v) for k, v in b.items()} for b in itertools.islice(
            make_dataset(data_config, tokenizer, "validation"), eval_batches)]
    if eval_batches and not self.val_batches:
      raise ValueError("the validation split gave no batch; raise "
                       "DataConfig.validation_fraction or max_documents")

  @property
  def steps(self) -> int:
    return len(self.batches)

  def val_loss(self, train_config: TrainConfig, state) -> float:
    """Validation loss (nats per token) of `state`; NaN without batches."""
    if not self.val_batches:
      return math.nan
    _, evaluate = step_lib.jit_steps(self.model_config,
                                     train_config.replace(gnmr=None))
    nats = tokens = 0.0
    for b in self.val_batches:
      out = jax.device_get(evaluate(state, b))
      nats += float(out["nats"])
      tokens += float(out["tokens"])
    return nats / max(tokens, 1.0)

  def run(self, train_config: TrainConfig, scenario: Scenario) -> dict:
    """Train `scenario` for train_config.steps (<= the harness's steps)."""
    steps = train_config.steps
    if steps > self.steps:
      raise ValueError(f"train_config.steps={steps} exceeds the harness's "
                       f"{self.steps} batches")
    scale, poison = fault_arrays(self.layout, scenario.faults, steps)
    step = _step_fn(self.model_config, train_config, scenario.fp8)
    state = state_lib.create_state(self.model_config, train_config)
    loss, per_step, actions, triggered = [], [], {}, {}
    faulted = {f.step for f in scenario.faults}
    t0 = time.perf_counter()
    for i in range(steps):
      state, m, action, severity = step(state, self.batches[i], scale[i],
                                        poison[i])
      m = jax.device_get(m)
      loss.append(float(m["ce"]))
      per_step.append({k: float(v) for k, v in m.items()
                       if k.startswith(gnmr.PREFIX)})
      if per_step[-1].get(gnmr.PREFIX + "triggered"):
        triggered[i] = np.flatnonzero(np.asarray(severity) >= 1).tolist()
      if i in faulted:
        actions[i] = (np.asarray(action), np.asarray(severity))
    seconds = time.perf_counter() - t0
    finite = all(bool(np.all(np.isfinite(x)))
                 for x in jax.tree.leaves(jax.device_get(state.params)))
    return {"scenario": scenario, "gnmr": train_config.gnmr is not None,
            "loss": loss, "gnmr_metrics": per_step, "actions": actions,
            "triggered": triggered,
            "params_finite": finite,
            "val_loss": self.val_loss(train_config, state) if finite
            else math.nan,
            "seconds": seconds}


def _rel(a: float, b: float) -> float:
  """(a - b) / b; inf where a is not finite (a run that diverged), NaN
  where there is nothing to compare (no validation batches)."""
  if math.isnan(b):
    return math.nan
  return (a - b) / b if math.isfinite(a) else math.inf


def report(runs: list[dict], lay: gnmr.Layout, config) -> dict:
  """The results of `runs` (Harness.run records) under GNMR `config` (a
  GNMRConfig). The reference is the "clean" run with GNMR off, or else the
  clean run with it on."""
  cleans = [r for r in runs if r["scenario"].name == "clean"]
  if not cleans:
    raise ValueError("report needs a run of the 'clean' scenario")
  clean = next((r for r in cleans if not r["gnmr"]), cleans[0])
  names = lay.unit_names()
  out = {"units": lay.size, "reference": {"scenario": "clean",
                                          "gnmr": clean["gnmr"]},
         "runs": []}
  for r in runs:
    sc = r["scenario"]
    steps = len(r["loss"])
    # The same batches in every run: the train losses pair up step by step.
    tail = slice(steps - max(1, steps // 10), steps)
    row = {
        "scenario": sc.name, "gnmr": r["gnmr"], "fp8": sc.fp8,
        "params_finite": r["params_finite"], "val_loss": r["val_loss"],
        "val_loss_rel_to_clean": _rel(r["val_loss"], clean["val_loss"]),
        "train_loss_last10pct": float(np.mean(r["loss"][tail])),
        "train_loss_last10pct_rel_to_clean": _rel(
            float(np.mean(r["loss"][tail])),
            float(np.mean(clean["loss"][tail]))),
        "seconds": r["seconds"]}
    row["train_loss_every_10"] = [round(x, 4) for x in r["loss"][::10]]
    if r["gnmr"]:
      row.update(_gnmr_summary(r, lay, config))
    faults = []
    for f in sc.faults:
      u = names.index(f.unit)
      after = slice(f.step + 1, min(steps, f.step + 1 + config.lock_steps))
      item = {"step": f.step, "unit": f.unit, "kind": f.kind,
              "loss_after_rel_to_clean": _rel(
                  float(np.mean(r["loss"][after])),
                  float(np.mean(clean["loss"][after])))}
      if f.kind == "spike":
        item["factor"] = f.factor
      if r["gnmr"]:
        action, severity = r["actions"][f.step]
        item.update(action=ACTION_NAMES[int(action[u])],
                    handled=int(action[u]) != gnmr.PASS,
                    severity=float(severity[u]))
      faults.append(item)
    if faults:
      row["faults"] = faults
    if sc.name == "burst" and r["gnmr"]:
      row["burst"] = _burst(r, lay)
    out["runs"].append(row)
  return out


def _gnmr_summary(r: dict, lay: gnmr.Layout, config) -> dict:
  """Counts over a GNMR run, the steps where units triggered, and which
  units triggered most."""
  m, names, steps = r["gnmr_metrics"], lay.unit_names(), len(r["loss"])
  total = lambda k: sum(s[gnmr.PREFIX + k] for s in m)
  most = max(s[gnmr.PREFIX + "recovering"] for s in m)
  by_unit = {}
  for units in r["triggered"].values():
    for u in units:
      by_unit[names[u]] = by_unit.get(names[u], 0) + 1
  return {
      "unit_steps": lay.size * steps, "triggered": total("triggered"),
      "trigger_rate": total("triggered") / (lay.size * steps),
      "admitted": total("admitted"), "refused": total("refused"),
      "skipped": total("skipped"), "clipped": total("clipped"),
      "nonfinite": total("nonfinite"), "max_recovering": most,
      # Unit-steps in recovery: with fp8, their module inputs in full
      # precision (m2jax.train.precision).
      "recovering_unit_steps": total("recovering"),
      "budget": config.max_recovering,
      "budget_held": most <= config.max_recovering,
      "triggers_by_unit": dict(sorted(by_unit.items(),
                                      key=lambda kv: -kv[1])),
      "events": [{"step": i, "triggered": [names[u] for u in units],
                  **{k: m[i][gnmr.PREFIX + k]
                     for k in ("admitted", "refused", "recovering")}}
                 for i, units in sorted(r["triggered"].items())]}


def _burst(r: dict, lay: gnmr.Layout) -> dict:
  """At the burst step: how many spiked units were handled, and whether
  they were the most severe (every refused one is less severe than every
  handled one; the free places are what the locks left)."""
  sc = r["scenario"]
  step = sc.faults[0].step
  action, severity = r["actions"][step]
  spiked = [lay.index(f.unit) for f in sc.faults]
  handled = [u for u in spiked if action[u] != gnmr.PASS]
  refused = [u for u in spiked if action[u] == gnmr.PASS]
  m = r["gnmr_metrics"][step]
  return {
      "step": step, "spiked": len(spiked), "handled": len(handled),
      "recovering": m[gnmr.PREFIX + "recovering"],
      "most_severe_chosen": not handled or not refused or bool(
          min(severity[handled]) >= max(severity[refused])),
      "handled_units": [lay.unit_names()[u] for u in handled]}
