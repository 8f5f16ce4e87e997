"""Growing MTP from K=1 to K=3 modules (SPEC §2, M2's continued pretraining).

M2 pretrains with one MTP module (loss weight 0.3, annealed to 0.1 over the
decay phase), then, during the decay phase, expands to three for multi-step
speculative decoding by *copying weights from the main model* rather than
random init: copied modules converge faster and do not disturb the main
model. Then the main model is frozen and only MTP trains until its loss
settles, then everything trains jointly. Keeping the main model frozen to
the end gives worse MTP quality than joint training (the paper's negative
arm, which `run_experiment` runs too).

Copy rule (`init="copy"`), for each new module k > existing depth:
  block_j      <- the main model's last transformer layer (its expert bias
                  too): the one piece of the main model shaped like an MTP
                  block, and the one whose input distribution (late hidden
                  states) is closest to what the module sees;
  proj, norms  <- the existing MTP module 1 (the main model has no 2D -> D
                  projection to copy).
`init="random"` is the baseline: new modules take a fresh initialisation.

One run, one schedule (`run_experiment`). The phases are stretches of a
single warmup-stable-decay run of T = base_steps + growth_steps steps
(m2jax.train.schedules), whose decay phase must start no later than the
growth (step B = base_steps), as in M2:

  phase                 steps          trains       lr and MTP weight
  base, K=1             [0, B)         everything   the schedule at each
  MTP only, K=3         [B, B+S)       MTP modules  global step s:
  joint                 [B+S, T)       everything   learning_rate(s),
  MTP only to the end   [B+S, T)       MTP modules  mtp_weight(s)
  (negative arm)

S is where the MTP loss settled (`Plateau`), at most mtp_only_max_steps.
No phase restarts the warm-up or re-anneals the MTP weight from 0.3: both
go on from the values the schedule has reached at B and decay linearly to
min_lr_ratio x peak and mtp_weight_final (0.1) at T. So the new modules
train, and then pull on the trunk, at decay-phase strength (M2 grows in
its decay phase, where the weight is near 0.1), not at the stable phase's
0.3 and peak lr. Both arms after S see the same steps, learning rates,
MTP weights and batches.

The optimizer state is carried too (`carry_state`): every parameter that
existed keeps its Adam moments, the step count (which drives the lr
schedule and Adam's bias correction) continues, and only the new modules
start from zero moments. Adam's bias correction being near 1 at that count,
a new module's first updates are about (1 - b1) / sqrt(1 - b2) (0.45 at
the defaults) of a full Adam step and reach it within ~1 / (1 - b2) steps:
a short warm-up of the new modules alone. The MTP-only optimizer holds no
state for the frozen main model; its moments wait unchanged and resume in
the joint phase. The MTP-only phase differentiates the MTP modules alone
(m2jax.train.step): no backward runs through the frozen trunk.

Each phase reads the training stream from its start, so phases repeat the
base run's first batches (the model saw them hundreds of steps earlier).
"""

from __future__ import annotations

import copy
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.config import ModelConfig
from m2jax.data import make_dataset, make_tokenizer
from m2jax.errors import ExistingPathError
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import losses, optim, schedules
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig
from m2jax.train.loop import pretrain
from m2jax.train.metrics import read_metrics

INITS = ("copy", "random")


def grow_mtp(config: ModelConfig, variables, new_depth: int, *,
             init: str = "copy", rng=None):
  """(new_config, new_variables) with `new_depth` MTP modules.

  The main model and the existing modules are passed through as they are
  (arrays are immutable; copying the main model would double its memory);
  `variables` itself is not modified. Every leaf of a new module is a fresh
  buffer, never the main model's or module 1's: a state handed to a
  donating train step must not hold one buffer twice.
  """
  if init not in INITS:
    raise ValueError(f"grow_mtp init must be one of {INITS}, got {init!r}")
  old_depth = config.num_mtp_modules
  if new_depth <= old_depth:
    raise ValueError(f"new_depth={new_depth} must exceed the current "
                     f"num_mtp_modules={old_depth}")
  if old_depth < 1 and init == "copy":
    raise ValueError("init='copy' needs an existing MTP module to copy the "
                     "projection and norms from")
  params = dict(variables["params"])
  missing = [f"mtp_{k}" for k in range(old_depth) if f"mtp_{k}" not in params]
  if missing:
    raise ValueError(f"variables have no parameters for MTP modules "
                     f"{missing} of the config's {old_depth}")
  new_config = config.replace(num_mtp_modules=new_depth)
  bias = dict(variables.get(model.EXPERT_BIAS, {}))
  if init == "random":
    fresh = model.init(new_config,
                       rng if rng is not None else jax.random.key(1))
  last = f"layers_{config.num_layers - 1}"
  for k in range(old_depth, new_depth):
    name = f"mtp_{k}"
    if init == "random":
      params[name] = fresh["params"][name]
      if name in fresh.get(model.EXPERT_BIAS, {}):
        bias[name] = fresh[model.EXPERT_BIAS][name]
      continue
    module = {key: _copy(val) for key, val in params["mtp_0"].items()
              if not key.startswith("block_")}
    for j in range(config.mtp_transformer_layers):
      module[f"block_{j}"] = _copy(params[last])
      if last in bias:
        bias.setdefault(name, {})[f"block_{j}"] = _copy(bias[last])
    params[name] = module
  out = {"params": params}
  if bias:
    out[model.EXPERT_BIAS] = bias
  return new_config, out


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class Plateau:
  """Says when a loss has settled: its EMA improved by less than `tol`
  (relative) over the last `window` updates.

  `update(loss)` returns False for the first `window` updates (there is no
  EMA `window` updates back yet), then True exactly when
  ema[n - window] - ema[n] < tol * |ema[n - window]|, n the update count.
  `settled` holds the last answer.
  """

  def __init__(self, window: int = 20, tol: float = 0.01, decay: float = 0.9):
    if window < 1:
      raise ValueError(f"Plateau.window: must be >= 1 (got {window!r})")
    if tol < 0:
      raise ValueError(f"Plateau.tol: must be >= 0 (got {tol!r})")
    if not 0 <= decay < 1:
      raise ValueError(f"Plateau.decay: must be in [0, 1) (got {decay!r})")
    self.window, self.tol, self.decay = window, tol, decay
    self._ema = None
    self._history: list[float] = []
    self.settled = False

  def update(self, loss: float) -> bool:
    self._ema = loss if self._ema is None else (
        self.decay * self._ema + (1 - self.decay) * loss)
    self._history.append(self._ema)
    if len(self._history) > self.window:
      past = self._history[-self.window - 1]
      self.settled = (past - self._ema) < self.tol * abs(past)
    return self.settled


def carry_state(model_config: ModelConfig, train_config: TrainConfig,
                variables, *sources) -> state_lib.TrainState:
  """The train state that continues `sources` under `train_config`.

  `model_config`, `variables`: the model and its variables for the new phase (grown or trained).
  `sources`: (TrainConfig, TrainState) of earlier phases, newest first; the
  new state takes the newest one's step. Each optimizer-state leaf (a
  parameter's moment, or a step count) comes from the first source holding
  it at the same place; leaves no source holds keep optax's init: the new
  modules' zero moments. A frozen parameter has no state in an MTP-only
  phase, so its moments come from the phase before that one.
  """
  if not sources:
    raise ValueError("carry_state needs at least one source state")
  held = {}
  for src_config, src in reversed(sources):
    flat, _ = jax.tree_util.tree_flatten_with_path(
        optim.joint_opt_state(src_config, src.opt_state),
        is_leaf=optim.is_masked)
    held.update({jax.tree_util.keystr(path): leaf for path, leaf in flat
                 if not optim.is_masked(leaf)})
  fresh = state_lib.init_state(model_config, train_config, variables)
  carried_moments = []

  def take(path, leaf):
    if optim.is_masked(leaf):
      return leaf
    old = held.get(jax.tree_util.keystr(path))
    if old is None:
      return leaf
    if np.shape(old) != np.shape(leaf):
      raise ValueError(f"optimizer state {jax.tree_util.keystr(path)}: "
                       f"shape {np.shape(old)} in the source, "
                       f"{np.shape(leaf)} here")
    if np.ndim(leaf):  # not a step count
      carried_moments.append(path)
    return old

  inner = jax.tree_util.tree_map_with_path(
      take, optim.joint_opt_state(train_config, fresh.opt_state),
      is_leaf=optim.is_masked)
  if not carried_moments:
    raise ValueError(
        f"carry_state: no parameter's optimizer state in the sources has a "
        f"place in this phase's (optimizer "
        f"{[c.optimizer for c, _ in sources]} -> {train_config.optimizer!r}): "
        f"every moment would restart from zero")
  return fresh._replace(
      step=jnp.asarray(sources[0][1].step, jnp.int32),
      opt_state=optim.replace_joint_opt_state(train_config, fresh.opt_state,
                                              inner))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _batch_metrics(config: ModelConfig, depth: int, variables, batch):
  """Loss metrics of one batch, MTP to `depth` (compiled once per config)."""
  out = model.forward(config, variables, batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"], mtp_depth=depth)
  return losses.total_loss(out, batch, mtp_weight=0.0, aux_coef=0.0,
                           z_coef=0.0)[1]


def evaluate_mtp(config: ModelConfig, variables, data_config, tokenizer, *,
                 depth: int, max_batches: int = 8) -> dict:
  """Held-out main CE, per-depth MTP CE and acceptance (validation split)."""
  sums, weight = {}, 0.0
  for i, batch in enumerate(make_dataset(data_config, tokenizer, "validation")):
    if i >= max_batches:
      break
    m = jax.device_get(_batch_metrics(
        config, depth, variables, {k: np.asarray(v) for k, v in batch.items()}))
    w = float(m["tokens"])
    weight += w
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + float(v) * w
  mean = {k: v / max(weight, 1.0) for k, v in sums.items()}
  return {
      "main_ce": mean["ce"],
      "mtp_ce": [mean[f"mtp/ce_{k}"] for k in range(1, depth + 1)],
      "acceptance": [mean[f"mtp/acceptance_{k}"] for k in range(1, depth + 1)],
  }


def growth_schedule(*, base_steps: int, growth_steps: int,
                    learning_rate: float, decay_fraction: float,
                    warmup_steps: int = 10, seed: int = 0) -> TrainConfig:
  """The one schedule every phase of `run_experiment` follows (module
  docstring); raises unless the growth falls in its decay phase."""
  if base_steps < 1 or growth_steps < 2:
    raise ValueError(f"need base_steps >= 1 and growth_steps >= 2 (got "
                     f"{base_steps} and {growth_steps})")
  schedule = TrainConfig(
      steps=base_steps + growth_steps, learning_rate=learning_rate,
      warmup_steps=warmup_steps, decay_fraction=decay_fraction, seed=seed,
      log_every=1, eval_every=10**9, checkpoint_every=10**9)
  if schedule.decay_start > base_steps:
    raise ValueError(
        f"decay_fraction={decay_fraction} starts the decay phase at step "
        f"{schedule.decay_start}, after the growth at step {base_steps}; M2 "
        "grows MTP during the decay phase (SPEC §2): use a decay_fraction "
        f">= {growth_steps / schedule.steps:.3g}")
  return schedule


def _host(tree):
  """A host copy: a phase donates the device buffers it is given."""
  return jax.tree.map(np.array, tree)


PHASES = ("mtp_only", "joint", "mtp_only_to_end")


def _check_no_arms(workdir: str, inits) -> None:
  """Refuse, before any work, a WORKDIR that already holds the phases of an
  earlier experiment (only WORKDIR/base is reused; a phase would otherwise
  be refused after the base run, as a pretrain workdir in use)."""
  used = [f"{init}/{phase}" for init in inits for phase in PHASES
          if any(name.isdigit() for name in _listdir(
              os.path.join(workdir, init, phase, "checkpoints")))]
  if used:
    raise ExistingPathError(
        f"{workdir} holds the phases of an earlier mtp_growth run "
        f"({', '.join(used)}); only its base/ is reused: start a fresh "
        f"--workdir (copy {os.path.join(workdir, 'base')} into it to skip the "
        "base pretraining) or remove those directories")


def _listdir(path: str) -> list[str]:
  return os.listdir(path) if os.path.isdir(path) else []


def run_experiment(model_config: ModelConfig, data_config, workdir: str, *,
                   base_steps: int, growth_steps: int, depth: int,
                   inits=INITS, mtp_only_max_steps: int,
                   learning_rate: float, decay_fraction: float,
                   settle: Plateau, warmup_steps: int = 10, seed: int = 0,
                   progress: bool = True, mesh=None) -> dict:
  """Pretrain K=1, then grow to `depth` with each init; see the experiment.

  The phases and their schedule are the module docstring's. For each init,
  the MTP-only phase runs until `settle` says the training MTP loss has
  settled (at most `mtp_only_max_steps`); from there two arms run to the
  end of the schedule, `growth_steps` after the growth: joint training,
  and MTP-only training (the paper's negative arm). WORKDIR/base is reused
  when it holds a finished base run of the same configs.
  `mesh` shards every training phase (m2jax.sharding); how the steps run
  is `model_config.settings`.

  Every reported number is measured on the validation split: main CE, MTP
  CE per depth and acceptance per depth (depth k's argmax equals the main
  model's argmax for the same future token).
  """
  if not 1 <= mtp_only_max_steps < growth_steps:
    raise ValueError(f"mtp_only_max_steps={mtp_only_max_steps} must be in "
                     f"[1, growth_steps={growth_steps}) so that the joint "
                     "phase gets steps")
  schedule = growth_schedule(
      base_steps=base_steps, growth_steps=growth_steps,
      learning_rate=learning_rate, decay_fraction=decay_fraction,
      warmup_steps=warmup_steps, seed=seed)
  base_tc = schedule.replace(mtp_depth=1)
  mtp_only_tc = schedule.replace(mtp_depth=depth, mtp_only=True)
  joint_tc = schedule.replace(mtp_depth=depth)
  lr_at = schedules.learning_rate(schedule)
  at = lambda step: {"step": step, "lr": float(lr_at(step)),
                     "mtp_weight": float(schedules.mtp_weight(schedule, step))}

  def train(mcfg, tcfg, name, **kwargs):
    return pretrain(mcfg, tcfg, data_config, os.path.join(workdir, name),
                    progress=progress, sample_tokens=0, mesh=mesh, **kwargs)

  _check_no_arms(workdir, inits)
  base_config = model_config.replace(num_mtp_modules=1)
  base_dir = os.path.join(workdir, "base")
  saved = os.path.join(base_dir, "config.json")
  if os.path.exists(saved):  # a base run on another schedule is no base
    with open(saved, encoding="utf-8") as f:
      ckpt_lib.check_same_config(json.load(f)["train"], base_tc,
                                 "train config")
  base_state = _host(train(base_config, base_tc, "base", resume=True,
                           stop_after=base_steps)["state"])
  base_vars = state_lib.variables_of(base_state)
  tokenizer = make_tokenizer(data_config, os.path.join(base_dir, "tokenizer"))
  held_out = lambda cfg, v: evaluate_mtp(cfg, v, data_config, tokenizer,
                                         depth=cfg.num_mtp_modules)
  results = {"base": {"steps": base_steps, **held_out(base_config, base_vars)},
             "depth": depth,
             "schedule": {"steps": schedule.steps,
                          "decay_start": schedule.decay_start,
                          "growth": at(base_steps),
                          "last_step": at(schedule.steps - 1)},
             "runs": {}}

  for init in inits:
    cfg, variables = grow_mtp(base_config, base_vars, depth, init=init,
                              rng=jax.random.key(seed + 1))
    start = held_out(cfg, variables)
    plateau = copy.deepcopy(settle)
    phase_a = train(
        cfg, mtp_only_tc, os.path.join(init, "mtp_only"),
        init_state=carry_state(cfg, mtp_only_tc, variables,
                               (base_tc, base_state)),
        stop_after=base_steps + mtp_only_max_steps,
        should_stop=lambda step, m, p=plateau: p.update(float(m["mtp/ce"])))
    end_a = _host(phase_a["state"])
    settled_at = int(end_a.step)
    joint = train(cfg, joint_tc, os.path.join(init, "joint"),
                  init_state=carry_state(
                      cfg, joint_tc, state_lib.variables_of(end_a),
                      (mtp_only_tc, end_a), (base_tc, base_state)))
    frozen = train(cfg, mtp_only_tc, os.path.join(init, "mtp_only_to_end"),
                   init_state=end_a)
    curve = lambda arm: [
        l["mtp/ce"] for name in ("mtp_only", arm)
        for l in read_metrics(os.path.join(workdir, init, name))
        if "mtp/ce" in l]
    results["runs"][init] = {
        "mtp_only_steps": settled_at - base_steps,
        "settled": plateau.settled,
        "joint_from": at(settled_at),
        "start": start,
        "after_mtp_only": held_out(cfg, state_lib.variables_of(end_a)),
        "after_joint": held_out(cfg, state_lib.variables_of(joint["state"])),
        "after_mtp_only_to_end": held_out(
            cfg, state_lib.variables_of(frozen["state"])),
        # Training-batch MTP loss per step after the growth, per arm.
        "mtp_ce_curve": {"joint": curve("joint"),
                         "mtp_only_to_end": curve("mtp_only_to_end")},
    }
  return results


def format_table(results: dict) -> str:
  """A plain-text table of per-depth MTP loss and acceptance per phase.

  `steps` counts the steps trained since the growth; both arms end at
  growth_steps, the same budget.
  """
  depth = results["depth"]
  growth_steps = results["schedule"]["steps"] - results["base"]["steps"]
  head = ["init", "phase", "steps", "main_ce"]
  head += [f"mtp_ce_{k}" for k in range(1, depth + 1)]
  head += [f"acc_{k}" for k in range(1, depth + 1)]
  rows = [head]
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  for init, run in results["runs"].items():
    for phase, steps in (("start", 0),
                         ("after_mtp_only", run["mtp_only_steps"]),
                         ("after_joint", growth_steps),
                         ("after_mtp_only_to_end", growth_steps)):
      m = run[phase]
      rows.append([init, phase, str(steps), fmt(m["main_ce"])]
                  + [fmt(x) for x in m["mtp_ce"]]
                  + [fmt(x) for x in m["acceptance"]])
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                   for r in rows)
