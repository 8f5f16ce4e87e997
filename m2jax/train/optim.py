"""Optimizers: AdamW, or Muon for the hidden matrices and AdamW for the rest.

Every parameter carries logical axis names (m2jax.model.logical_axes; the
names are listed in m2jax/model/layers.py). Its KIND, and so how it is
optimised, is read from those names, never from its rank. PARAM_RULES is the
single source; this table mirrors it. The "muon" column is each kind's
family under optimizer="muon" (under "adamw" every kind gets AdamW); for
Muon kinds the axes read "batch | reduction -> output":

  kind              logical axes                    muon      decay
  embedding         vocab, embed                    AdamW     yes
  lm_head           embed, vocab                    AdamW     yes
  attention q       embed -> q_heads, head_dim      Muon      yes
  attention k/v     embed -> kv_heads, head_dim     Muon      yes
  attention o       q_heads, head_dim -> embed      Muon      yes
  expert w1/w3      expert | embed -> expert_mlp    Muon      yes
  expert w2         expert | expert_mlp -> embed    Muon      yes
  dense FFN w1/w3   embed -> mlp                    Muon      yes
  dense FFN w2      mlp -> embed                    Muon      yes
  MTP projection    mtp_concat -> embed             Muon      yes
  router gate       embed, router                   AdamW     no
  norm gain         norm                            AdamW     no
  q_norm gain       q_heads, head_dim               AdamW     no
  k_norm gain       kv_heads, head_dim              AdamW     no

"norm gain" is every residual RMSNorm: attn_norm and ffn_norm of each block
(MTP blocks too), the MTP modules' embed_norm and hidden_norm, final_norm.
The expert bias is not a parameter: it lives in its own variable collection
("expert_bias"), is updated by the train step from the routing load, and the
optimizer never sees it.

Choices. Muon is for hidden matrices (Jordan's Muon; Moonlight, "Muon is
Scalable"): the embedding and lm_head, indexed by tokens rather than a hidden
space, stay on AdamW, and so does the router gate, which is a small output
head over experts. Attention q/k/v/o are orthogonalised as one matrix over
all heads; `expert` is a batch axis, so each expert is orthogonalised on its
own. Muon's update is scaled by sqrt(max(1, fan_out / fan_in)) (optax's
default) and shares the learning-rate schedule with AdamW. Weight decay is
decoupled (AdamW style, times the learning rate) and applies to every weight
matrix, embedding, lm_head and MTP projection included, but never to a gain
(decay would pull the normalised activations towards zero, not regularise a
map) and not to the router gate: its scale is the routing temperature that
the expert bias (SPEC §1) is compared against, so decay would slowly hand
expert choice from the scores to the bias.

Both optimizers share one decay transformation and one mask, so they agree on
which parameters decay by construction. The AdamW kinds get the same AdamW
under either optimizer (optax.contrib.muon's Adam branch would add Nesterov
momentum and takes no decay mask, so Muon is composed here from public optax
pieces instead).

Under "muonsphere" and "sso" (m2jax.train.sso) the Muon kinds are held on a
spectral sphere instead, in SSO's atomic units (`sphere_units`): as Muon's
matrices, except that attention q/k/v split per head (each head its own
d_model -> head_dim unit; o stays one unit, sso.py says why). Their update
is the whole step, retraction included, at the schedule of
`matrix_learning_rate`: no decay and no lr scaling follow it. The AdamW
kinds get the same AdamW (and decay) as under "adamw". Under "muon",
`matrix_learning_rate` scales Muon's direction by its ratio to
`learning_rate` (decay stays lr x weight_decay).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec
import optax
from optax.contrib import MuonDimensionNumbers

from m2jax.train import gnmr
from m2jax.train import schedules
from m2jax.train import sso
from m2jax.train.config import SPHERE_OPTIMIZERS, TrainConfig

MUON, ADAMW = "muon", "adamw"
# The label of the Muon kinds under muonsphere and sso.
SPHERE = "sphere"
ROUTER_GATE = "router gate"  # the kind TrainConfig.router_lr_scale scales


@dataclasses.dataclass(frozen=True)
class ParamRule:
  """How one kind of parameter is optimised (a row of the table above).

  A dataclass, not a NamedTuple, so a tree of rules has rules as leaves.
  `reduction` and `output` name Muon's input and output axes; any other
  axis of a Muon kind must be one of MUON_BATCH_AXES.
  """
  kind: str
  family: str                     # MUON or ADAMW under optimizer="muon"
  decay: bool
  reduction: tuple[str, ...] = ()
  output: tuple[str, ...] = ()


def _muon(kind, reduction, output):
  return ParamRule(kind, MUON, True, reduction, output)


# Logical axes of a parameter -> its rule. The module docstring's table.
PARAM_RULES: dict[tuple[str, ...], ParamRule] = {
    ("vocab", "embed"): ParamRule("embedding", ADAMW, decay=True),
    ("embed", "vocab"): ParamRule("lm_head", ADAMW, decay=True),
    ("embed", "q_heads", "head_dim"):
        _muon("attention q", ("embed",), ("q_heads", "head_dim")),
    ("embed", "kv_heads", "head_dim"):
        _muon("attention k/v", ("embed",), ("kv_heads", "head_dim")),
    ("q_heads", "head_dim", "embed"):
        _muon("attention o", ("q_heads", "head_dim"), ("embed",)),
    ("expert", "embed", "expert_mlp"):
        _muon("expert w1/w3", ("embed",), ("expert_mlp",)),
    ("expert", "expert_mlp", "embed"):
        _muon("expert w2", ("expert_mlp",), ("embed",)),
    ("embed", "mlp"): _muon("dense FFN w1/w3", ("embed",), ("mlp",)),
    ("mlp", "embed"): _muon("dense FFN w2", ("mlp",), ("embed",)),
    ("mtp_concat", "embed"): _muon("MTP projection", ("mtp_concat",),
                                   ("embed",)),
    ("embed", "router"): ParamRule(ROUTER_GATE, ADAMW, decay=False),
    ("norm",): ParamRule("norm gain", ADAMW, decay=False),
    ("q_heads", "head_dim"): ParamRule("q_norm gain", ADAMW, decay=False),
    ("kv_heads", "head_dim"): ParamRule("k_norm gain", ADAMW, decay=False),
}

# Axes that index independent matrices: Muon orthogonalises each on its own.
MUON_BATCH_AXES = ("expert",)


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _rule_map(param_axes, fn):
  """tree -> the tree of fn(axis names, rule) at every leaf of tree.

  `param_axes`: the parameters' logical axes, a pytree of PartitionSpecs
  (`m2jax.model.logical_axes(config)["params"]`). Leaves are matched by path,
  so `tree` may be a subset of it (a checkpoint without MTP modules) or hold
  optax's masked-out nodes.
  """
  flat = jax.tree_util.tree_flatten_with_path(
      param_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
  names_of = {_name(path): tuple(spec) for path, spec in flat}

  def one(path, _):
    name = _name(path)
    if name not in names_of:
      raise ValueError(f"parameter {name} has no logical axes in param_axes")
    names = names_of[name]
    if names not in PARAM_RULES:
      raise ValueError(
          f"parameter {name}: logical axes {names} match no kind in "
          "m2jax.train.optim.PARAM_RULES; add a row saying how to optimise it")
    return fn(names, PARAM_RULES[names])

  return lambda tree: jax.tree_util.tree_map_with_path(one, tree)


def param_kinds(param_axes, params):
  """The tree of kind names ("attention q", "norm gain", ...) of `params`."""
  return _rule_map(param_axes, lambda _, rule: rule.kind)(params)


def decay_mask(param_axes):
  """params -> tree of bools: which leaves weight decay applies to."""
  return _rule_map(param_axes, lambda _, rule: rule.decay)


def families(param_axes):
  """params -> tree of MUON / ADAMW labels for optimizer="muon"."""
  return _rule_map(param_axes, lambda _, rule: rule.family)


def _dimension_numbers(names, rule: ParamRule) -> MuonDimensionNumbers:
  batch = [n for n in names if n not in rule.reduction + rule.output]
  if any(n not in MUON_BATCH_AXES for n in batch):
    raise ValueError(f"PARAM_RULES[{names}] ({rule.kind}): axes {batch} are "
                     f"neither reduction, output nor in {MUON_BATCH_AXES}")
  return MuonDimensionNumbers(
      reduction_axis=tuple(names.index(n) for n in rule.reduction),
      output_axis=tuple(names.index(n) for n in rule.output))


def muon_dimension_numbers(param_axes):
  """params -> tree of MuonDimensionNumbers (None for the AdamW kinds).

  Axes not named as reduction or output are batch axes (vmapped over by
  optax), which is how each expert of an [E, D, F] tensor gets its own
  orthogonalisation.
  """
  return _rule_map(param_axes, lambda names, rule: (
      _dimension_numbers(names, rule) if rule.family == MUON else None))


# SSO's atomic units: a head axis among a Muon kind's output axes indexes
# units (q/k/v per head; SPEC §4).
SPHERE_HEAD_AXES = ("q_heads", "kv_heads")


def _sphere_units(names, rule: ParamRule) -> MuonDimensionNumbers:
  output = tuple(n for n in rule.output if n not in SPHERE_HEAD_AXES)
  batch = [n for n in names if n not in rule.reduction + output]
  if any(n not in MUON_BATCH_AXES + SPHERE_HEAD_AXES for n in batch):
    raise ValueError(f"PARAM_RULES[{names}] ({rule.kind}): axes {batch} do "
                     "not index SSO units")
  return MuonDimensionNumbers(
      reduction_axis=tuple(names.index(n) for n in rule.reduction),
      output_axis=tuple(names.index(n) for n in output))


def sphere_units(param_axes):
  """params -> tree of MuonDimensionNumbers of SSO's units (None for the
  AdamW kinds): the axes neither input nor output index units."""
  return _rule_map(param_axes, lambda names, rule: (
      _sphere_units(names, rule) if rule.family == MUON else None))


def _scale_by_width(dimension_numbers) -> optax.GradientTransformation:
  """Muon's update scale sqrt(max(1, fan_out / fan_in)) per matrix.

  Jordan's Muon, and optax.contrib.muon's default (consistent_rms=None),
  whose own transformation for it is not public.
  """

  def update(updates, state, params=None):
    del params

    def one(u, dims: MuonDimensionNumbers):
      fan_in = math.prod(u.shape[a] for a in dims.reduction_axis)
      fan_out = math.prod(u.shape[a] for a in dims.output_axis)
      return u * math.sqrt(max(1.0, fan_out / fan_in))

    return jax.tree.map(one, updates, dimension_numbers(updates)), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _scale_kind(param_axes, kind: str,
                factor: float) -> optax.GradientTransformation:
  """Multiplies the updates of the parameters of one kind by `factor`."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, k: u * factor if k == kind else u,
                        updates, param_kinds(param_axes, updates)), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def is_frozen(config: TrainConfig, name: str) -> bool:
  """Whether the top-level variable `name` stays fixed under `config`.

  MTP growth (`mtp_only`) freezes the main model, embedding and head
  included, and trains the `mtp_*` modules: their parameters here, their
  routing bias in the train step.
  """
  return config.mtp_only and not name.startswith("mtp_")


def make_optimizer(config: TrainConfig,
                   param_axes) -> optax.GradientTransformation:
  """Gradient clipping, then AdamW, Muon(+AdamW) or MuonSphere/SSO(+AdamW),
  on the WSD schedule.

  `param_axes`: the parameters' logical axes, a pytree of PartitionSpecs
  (`m2jax.model.logical_axes(model_config)["params"]`); each parameter is
  optimised by the rule of its kind (PARAM_RULES).
  """
  lr = schedules.learning_rate(config)
  adam = optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps)
  decay = optax.add_decayed_weights(config.weight_decay,
                                    decay_mask(param_axes))
  matrix_lr = config.matrix_learning_rate or config.learning_rate
  if config.optimizer in SPHERE_OPTIMIZERS:
    # The sphere's update is the whole step, retraction included, at the
    # matrices' own schedule: nothing decays or rescales it afterwards.
    labels = _rule_map(param_axes, lambda _, rule: (
        SPHERE if rule.family == MUON else ADAMW))
    sphere = sso.scale_by_sphere(
        config, sphere_units(param_axes),
        schedules.learning_rate(config.replace(learning_rate=matrix_lr)),
        solve=config.optimizer == "sso")
    update = optax.partition(
        {SPHERE: sphere,
         ADAMW: optax.chain(adam, decay, optax.scale_by_learning_rate(lr))},
        labels)
  else:
    if config.optimizer == ADAMW:
      direction = adam
    else:
      dims = muon_dimension_numbers(param_axes)
      muon = [optax.contrib.scale_by_muon(beta=config.b1, eps=config.eps,
                                          weight_dimension_numbers=dims),
              _scale_by_width(dims)]
      if matrix_lr != config.learning_rate:
        muon.append(optax.scale(matrix_lr / config.learning_rate))
      direction = optax.partition({MUON: optax.chain(*muon), ADAMW: adam},
                                  families(param_axes))
    # optax.adamw's own composition, with the direction swapped for Muon:
    # one decay mask for both optimizers.
    update = optax.chain(direction, decay, optax.scale_by_learning_rate(lr))
  # The router scale last and always: it is stateless (no leaves), so the
  # state's paths are those of the optimizer without it, whatever the
  # factor (a run may change router_lr_scale on resume; older checkpoints
  # load).
  opt = optax.chain(optax.clip_by_global_norm(config.grad_clip), update,
                    _scale_kind(param_axes, ROUTER_GATE,
                                config.router_lr_scale))
  if config.gnmr is not None:
    # Per-unit recovery sees the raw gradients, before the global clip.
    opt = optax.chain(gnmr.gnmr(config.gnmr, param_axes, MUON_BATCH_AXES),
                      opt)
  if config.mtp_only:
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if is_frozen(config, path[0].key)
        else "train", params)
    opt = optax.multi_transform(
        {"train": opt, "frozen": optax.set_to_zero()}, labels)
  return opt


# Where make_optimizer's state keeps what (m2jax.train.mtp_growth.carry_state
# reads and writes the moments and step counts here).

def joint_opt_state(config: TrainConfig, opt_state):
  """The state of the all-parameter optimizer inside `opt_state` (made by
  make_optimizer(config, ...)): `opt_state` itself, or under `mtp_only`
  the "train" group of the multi_transform, frozen leaves masked out
  (optax.MaskedNode: see is_masked)."""
  if not config.mtp_only:
    return opt_state
  return opt_state.inner_states["train"].inner_state


def replace_joint_opt_state(config: TrainConfig, opt_state, inner):
  """`opt_state` with its joint_opt_state part replaced by `inner`."""
  if not config.mtp_only:
    return inner
  groups = dict(opt_state.inner_states)
  groups["train"] = groups["train"]._replace(inner_state=inner)
  return opt_state._replace(inner_states=groups)


def is_masked(x) -> bool:
  """Whether an optimizer-state leaf is a placeholder for a parameter the
  transformation does not see (frozen, or of the other Muon family)."""
  return isinstance(x, optax.MaskedNode)
