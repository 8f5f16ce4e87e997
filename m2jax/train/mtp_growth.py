"""Growing MTP from K=1 to K=3 modules (SPEC §2, M2's continued pretraining).

M2 pretrains with one MTP module, then expands to three for multi-step
speculative decoding by *copying weights from the main model* rather than
random init: copied modules converge faster and do not disturb the main
model. Then the main model is frozen and only MTP trains until its loss
settles, then everything trains jointly.

Copy rule (`init="copy"`), for each new module k > existing depth:
  block_j      <- the main model's last transformer layer (its expert bias
                  too): the one piece of the main model shaped like an MTP
                  block, and the one whose input distribution (late hidden
                  states) is closest to what the module sees;
  proj, norms  <- the existing MTP module 1 (the main model has no 2D -> D
                  projection to copy).
`init="random"` is the baseline: new modules take a fresh initialisation.
"""

from __future__ import annotations

import copy
import functools
import os

import jax
import jax.numpy as jnp

from m2jax import model
from m2jax.config import ModelConfig

INITS = ("copy", "random")


def grow_mtp(config: ModelConfig, variables, new_depth: int, *,
             init: str = "copy", rng=None):
  """(new_config, new_variables) with `new_depth` MTP modules.

  Existing modules are kept as they are; the main model is untouched.
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
  new_config = config.replace(num_mtp_modules=new_depth)
  fresh = model.init(new_config, rng if rng is not None else jax.random.key(1))
  params = dict(variables["params"])
  bias = dict(variables.get(model.EXPERT_BIAS, {}))
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
  return jax.tree.map(lambda x: jnp.array(x, copy=True), copy.copy(tree))


class Plateau:
  """Says when a loss has settled: its EMA improved by less than `tol`
  (relative) over the last `window` updates."""

  def __init__(self, window: int = 20, tol: float = 0.01, decay: float = 0.9):
    self.window, self.tol, self.decay = window, tol, decay
    self._ema = None
    self._history: list[float] = []

  def update(self, loss: float) -> bool:
    self._ema = loss if self._ema is None else (
        self.decay * self._ema + (1 - self.decay) * loss)
    self._history.append(self._ema)
    if len(self._history) <= self.window:
      return False
    past = self._history[-self.window - 1]
    return (past - self._ema) < self.tol * abs(past)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _batch_metrics(config: ModelConfig, depth: int, variables, batch):
  """Loss metrics of one batch, MTP to `depth` (compiled once per config)."""
  from m2jax.train import losses  # pylint: disable=import-outside-toplevel
  out = model.forward(config, variables, batch["tokens"],
                      segment_ids=batch["segment_ids"],
                      positions=batch["positions"], mtp_depth=depth)
  return losses.total_loss(out, batch, mtp_weight=0.0, aux_coef=0.0,
                           z_coef=0.0)[1]


def evaluate_mtp(config: ModelConfig, variables, data_config, tokenizer, *,
                 depth: int, max_batches: int = 8) -> dict:
  """Held-out main CE, per-depth MTP CE and acceptance (validation split)."""
  # pylint: disable=import-outside-toplevel
  import numpy as np
  from m2jax.data import make_dataset

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


def run_experiment(model_config: ModelConfig, data_config, workdir: str, *,
                   base_steps: int, depth: int, inits=INITS,
                   mtp_only_max_steps: int, joint_steps: int,
                   learning_rate: float, settle: Plateau, seed: int = 0,
                   progress: bool = True, mesh=None,
                   expert_options=None) -> dict:
  """Pretrain K=1, then grow to `depth` with each init; see the experiment.

  `mesh` / `expert_options` shard every training phase (m2jax.sharding).

  Every reported number is measured on the validation split: main CE, MTP
  CE per depth and acceptance per depth (depth k's argmax equals the main
  model's argmax for the same future token).
  """
  # pylint: disable=import-outside-toplevel
  import numpy as np
  from m2jax.train import step as step_lib
  from m2jax.train.config import TrainConfig
  from m2jax.data import make_tokenizer
  from m2jax.train.loop import pretrain
  from m2jax.train.metrics import read_metrics

  base_config = model_config.replace(num_mtp_modules=1)
  common = dict(learning_rate=learning_rate, seed=seed, log_every=1,
                eval_every=10**9, warmup_steps=10, checkpoint_every=10**9)
  sharded = dict(mesh=mesh, expert_options=expert_options)
  base_dir = os.path.join(workdir, "base")
  base = pretrain(base_config,
                  TrainConfig(steps=base_steps, mtp_depth=1, **common),
                  data_config, base_dir, resume=True, progress=progress,
                  sample_tokens=0, **sharded)
  base_vars = jax.tree.map(np.array, step_lib.variables_of(base["state"]))
  tokenizer = make_tokenizer(data_config, os.path.join(base_dir, "tokenizer"))
  held_out = lambda cfg, v, d: evaluate_mtp(cfg, v, data_config, tokenizer,
                                            depth=d)
  results = {"base": {"steps": base_steps,
                      **held_out(base_config, base_vars, 1)},
             "depth": depth, "runs": {}}

  for init in inits:
    cfg, variables = grow_mtp(base_config, jax.tree.map(np.array, base_vars),
                              depth, init=init, rng=jax.random.key(seed + 1))
    # Phase A: MTP only, until the mean MTP loss settles.
    start = held_out(cfg, variables, depth)
    plateau = copy.deepcopy(settle)
    a_dir = os.path.join(workdir, init, "mtp_only")
    phase_a = pretrain(
        cfg, TrainConfig(steps=mtp_only_max_steps, mtp_depth=depth,
                         mtp_only=True, decay_fraction=0.0, **common),
        data_config, a_dir, resume=False, progress=progress, sample_tokens=0,
        init_variables=variables, **sharded,
        should_stop=lambda step, m, p=plateau: p.update(float(m["mtp/ce"])))
    a_vars = jax.tree.map(np.array, step_lib.variables_of(phase_a["state"]))
    after_a = held_out(cfg, a_vars, depth)
    # Phase B: joint training.
    b_dir = os.path.join(workdir, init, "joint")
    phase_b = pretrain(
        cfg, TrainConfig(steps=joint_steps, mtp_depth=depth, **common),
        data_config, b_dir, resume=False, progress=progress, sample_tokens=0,
        init_variables=a_vars, **sharded)
    results["runs"][init] = {
        "mtp_only_steps": phase_a["step"],
        "settled": phase_a["step"] < mtp_only_max_steps,
        "start": start,
        "after_mtp_only": after_a,
        "after_joint": held_out(cfg, step_lib.variables_of(phase_b["state"]),
                                depth),
        # Training-batch MTP loss per step over both phases.
        "mtp_ce_curve": [l["mtp/ce"] for l in read_metrics(a_dir)
                         + read_metrics(b_dir) if "mtp/ce" in l],
    }
  return results


def format_table(results: dict) -> str:
  """A plain-text table of per-depth MTP loss and acceptance per phase."""
  depth = results["depth"]
  head = ["init", "phase", "steps", "main_ce"]
  head += [f"mtp_ce_{k}" for k in range(1, depth + 1)]
  head += [f"acc_{k}" for k in range(1, depth + 1)]
  rows = [head]
  fmt = lambda x: "-" if x is None else f"{x:.3f}"
  for init, run in results["runs"].items():
    for phase, steps in (("start", 0), ("after_mtp_only", run["mtp_only_steps"]),
                         ("after_joint", None)):
      m = run[phase]
      rows.append([init, phase, str(steps if steps is not None else "+joint"),
                   fmt(m["main_ce"])] + [fmt(x) for x in m["mtp_ce"]]
                  + [fmt(x) for x in m["acceptance"]])
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                   for r in rows)
