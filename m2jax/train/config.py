"""Training configuration: optimizer, schedule, losses, MTP, logging cadence."""

from __future__ import annotations

import dataclasses

from m2jax.config import ConfigError, config_from_dict

OPTIMIZERS = ("adamw", "muon", "muonsphere", "sso")
# The optimizers that keep the hidden matrices on a spectral sphere
# (m2jax.train.sso; MuonSphere is SSO with lambda = 0).
SPHERE_OPTIMIZERS = ("muonsphere", "sso")
# How SSO refines a bracketed lambda (m2jax.train.sso.solve_lambda).
SSO_ROOT_FINDERS = ("illinois", "bisect")
# jax.lax.Precision levels, and two of jax.lax.DotAlgorithmPreset: float32
# carried by 3 or 6 bfloat16 passes on tensor cores (GPU; exact on CPU).
MATMUL_PRECISIONS = ("default", "high", "highest", "BF16_BF16_F32_X3",
                     "BF16_BF16_F32_X6")

# M2's pretraining tokens (SPEC §2): 29.2T = a constant-lr phase of 19.9T
# plus a decay phase of 9.3T.
M2_CONSTANT_TOKENS = 19.9e12
M2_DECAY_TOKENS = 9.3e12
# The fraction of training that decays: 9.3 / 29.2 = 0.318.
M2_DECAY_FRACTION = M2_DECAY_TOKENS / (M2_CONSTANT_TOKENS + M2_DECAY_TOKENS)

# Context extension as (fraction of steps where the stage starts, seq_len).
# M2 grows 8K -> 32K -> 192K in stages (SPEC §2); "cpu" is a CPU-sized copy.
# "m2_small" stops at the 128K row one H100 trains (with --remat:
# experiments/bench_long_rows.py); M2's 192K stage needs the row split over
# devices.
CONTEXT_SCHEDULES = {
    "m2": ((0.0, 8192), (0.8, 32768), (0.95, 196608)),
    "m2_small": ((0.0, 8192), (0.8, 32768), (0.95, 131072)),
    "cpu": ((0.0, 256), (0.75, 1024)),
}


def _fail(field, rule, value):
  raise ConfigError(f"TrainConfig.{field}: {rule} (got {value!r})")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How to train. Model shape lives in ModelConfig, data in DataConfig.

  The learning rate is warmup-stable-decay (m2jax.train.schedules): linear
  warm-up over `warmup_steps`, constant, then a linear decay over the last
  `decay_fraction` of steps that reaches `min_lr_ratio` of the peak at the
  last step. `decay_fraction` defaults to M2's split (SPEC §2): 29.2T
  pretraining tokens = 19.9T at constant lr + 9.3T of decay, so 9.3 / 29.2 =
  0.318 of training decays (tokens per step are constant, context extension
  included, so the token fraction is the step fraction).
  """

  steps: int = 1000
  seed: int = 0
  # Optimizer.
  optimizer: str = "adamw"
  learning_rate: float = 3e-4
  min_lr_ratio: float = 0.1          # lr at the end of the decay phase
  warmup_steps: int = 100
  # The last `decay_fraction` of steps decay (M2: 0.318, class docstring).
  decay_fraction: float = M2_DECAY_FRACTION
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0
  # Peak learning rate of the hidden matrices (optim.PARAM_RULES' Muon
  # kinds) under muon, muonsphere and sso, on the same WSD schedule; the
  # AdamW kinds keep `learning_rate`. None: `learning_rate` for both.
  matrix_learning_rate: float | None = None
  # Multiplies the router gates' updates (optim.PARAM_RULES' "router gate"
  # kind, main and MTP routers): their learning rate is this x theirs.
  # At 1.0, m2_small's routers (AdamW, lr 3e-3) move their scores faster
  # than the loss-free bias update follows: the bias only rotates the
  # overload and the frozen router stays at a max violation of 2.93 on
  # held-out rows; at 0.1 it is 0.19 +- 0.02 with a lower loss (three
  # seeds, 2,000 steps, benchmarks/notes/router.md). 1.0: the plain
  # optimizer's updates. Stateless: any value keeps the state's layout.
  router_lr_scale: float = 0.1
  # SSO and MuonSphere (m2jax.train.sso; SPEC §4 for the algorithm).
  sso_radius_scale: float = 1.0      # c in R = c sqrt(d_out / d_in)
  sso_momentum: float = 0.9          # Nesterov momentum
  sso_power_iters: int = 5           # per step, warm-started (sso.py)
  sso_power_iters_init: int = 100    # cold start, in the optimizer's init
  sso_ns_steps: int = 8              # Polar-Express Newton-Schulz steps
  sso_bracket_start: float = 1e-3    # first |lambda| tried
  sso_bracket_doublings: int = 10    # then doubled at most this often
  sso_bisect_steps: int = 20         # refinement steps at most ...
  sso_tolerance: float = 2e-4        # ... until |h(lambda)| <= this
  # The refinement: "illinois" (regula falsi, Illinois-modified: a few
  # steps) or "bisect" (one bit a step), inside the bracket either way.
  sso_root_finder: str = "illinois"
  # Start each unit's search at its lambda* of the previous step (kept in
  # the optimizer state); False: from 0 every step.
  sso_warm_start: bool = True
  sso_eps: float = 1e-7              # guards the normalisations
  # Matmul precision of msign and the power iteration (float32 inputs,
  # MATMUL_PRECISIONS): "highest" is true float32 (no tensor cores on a
  # GPU); "default" lets a GPU use TF32, whose ~1e-3 error in h(lambda) is
  # above sso_tolerance; BF16_BF16_F32_X3 keeps ~16 bits on tensor cores.
  sso_matmul_precision: str = "highest"
  # Losses. MTP weight 0.3 in the stable phase, annealed to 0.1 over the
  # decay phase (the paper's pretraining recipe).
  mtp_depth: int = 1
  mtp_weight: float = 0.3
  mtp_weight_final: float = 0.1
  z_loss_coef: float = 0.0
  # None = the model config's aux_loss_coef.
  aux_loss_coef: float | None = None
  # Train only the MTP modules (the main model frozen): MTP growth phase.
  mtp_only: bool = False
  # Context extension: ((start fraction, seq_len), ...), empty = the data
  # config's seq_len throughout. Tokens per batch stay constant across stages.
  context_schedule: tuple[tuple[float, int], ...] = ()
  # Per-unit gradient-norm monitoring and recovery before the optimizer
  # (m2jax.train.gnmr); None = off.
  gnmr: GNMRConfig | None = None
  # Cadence.
  log_every: int = 10
  eval_every: int = 100
  eval_batches: int = 8
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  # Write checkpoints in the background while training goes on
  # (m2jax.train.checkpoint); False: each save blocks until written.
  async_checkpoint: bool = True
  # With async_checkpoint: copy the state on the device and move that copy
  # to host memory in the background too (a save then pauses training for
  # milliseconds instead of the ~1 s host copy of a large state; it holds
  # one more state in device memory meanwhile, and falls back to the host
  # copy where that memory is not there).
  checkpoint_device_copy: bool = True

  def __post_init__(self):
    if self.steps <= 0:
      _fail("steps", "must be positive", self.steps)
    if self.optimizer not in OPTIMIZERS:
      _fail("optimizer", f"must be one of {OPTIMIZERS}", self.optimizer)
    if self.learning_rate <= 0:
      _fail("learning_rate", "must be positive", self.learning_rate)
    if not 0 <= self.min_lr_ratio <= 1:
      _fail("min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
    if self.warmup_steps < 0:
      _fail("warmup_steps", "must be >= 0", self.warmup_steps)
    if not 0 <= self.decay_fraction <= 1:
      _fail("decay_fraction", "must be in [0, 1]", self.decay_fraction)
    if self.grad_clip <= 0:
      _fail("grad_clip", "must be positive", self.grad_clip)
    if not self.router_lr_scale > 0:
      _fail("router_lr_scale", "must be positive", self.router_lr_scale)
    if (self.matrix_learning_rate is not None
        and self.matrix_learning_rate <= 0):
      _fail("matrix_learning_rate", "must be positive or None",
            self.matrix_learning_rate)
    for name in ("sso_radius_scale", "sso_bracket_start", "sso_tolerance",
                 "sso_eps"):
      if not getattr(self, name) > 0:
        _fail(name, "must be positive", getattr(self, name))
    if not 0 <= self.sso_momentum < 1:
      _fail("sso_momentum", "must be in [0, 1)", self.sso_momentum)
    for name in ("sso_power_iters", "sso_power_iters_init",
                 "sso_bracket_doublings", "sso_bisect_steps"):
      if getattr(self, name) < 0:
        _fail(name, "must be >= 0", getattr(self, name))
    if self.sso_ns_steps <= 0:
      _fail("sso_ns_steps", "must be positive", self.sso_ns_steps)
    if self.sso_root_finder not in SSO_ROOT_FINDERS:
      _fail("sso_root_finder", f"must be one of {SSO_ROOT_FINDERS}",
            self.sso_root_finder)
    if not isinstance(self.sso_warm_start, bool):
      _fail("sso_warm_start", "must be a bool", self.sso_warm_start)
    if self.sso_matmul_precision not in MATMUL_PRECISIONS:
      _fail("sso_matmul_precision", f"must be one of {MATMUL_PRECISIONS}",
            self.sso_matmul_precision)
    if self.mtp_depth < 0:
      _fail("mtp_depth", "must be >= 0", self.mtp_depth)
    if self.mtp_only and self.mtp_depth == 0:
      _fail("mtp_only", "needs mtp_depth >= 1", self.mtp_only)
    for name in ("mtp_weight", "mtp_weight_final", "z_loss_coef"):
      if getattr(self, name) < 0:
        _fail(name, "must be >= 0", getattr(self, name))
    if self.context_schedule:
      starts = [f for f, _ in self.context_schedule]
      if starts[0] != 0.0 or any(b <= a for a, b in zip(starts, starts[1:])):
        _fail("context_schedule", "stage starts must begin at 0.0 and "
              "increase", self.context_schedule)
      if any(not 0 <= f < 1 for f in starts) or any(
          n <= 0 for _, n in self.context_schedule):
        _fail("context_schedule", "starts must be in [0, 1) and lengths "
              "positive", self.context_schedule)
    if isinstance(self.gnmr, dict):  # read back from a saved config
      object.__setattr__(self, "gnmr", config_from_dict(GNMRConfig, self.gnmr))
    if self.gnmr is not None and not isinstance(self.gnmr, GNMRConfig):
      _fail("gnmr", "must be None or a GNMRConfig", self.gnmr)
    for name in ("log_every", "eval_every", "checkpoint_every",
                 "keep_checkpoints", "eval_batches"):
      if getattr(self, name) <= 0:
        _fail(name, "must be positive", getattr(self, name))
    for name in ("async_checkpoint", "checkpoint_device_copy"):
      if not isinstance(getattr(self, name), bool):
        _fail(name, "must be True or False", getattr(self, name))

  @property
  def decay_start(self) -> int:
    """First step of the decay phase."""
    return self.steps - int(round(self.decay_fraction * self.steps))

  def context_stages(self) -> list[tuple[int, int]]:
    """[(first step, seq_len), ...] of the context schedule."""
    return [(int(round(f * self.steps)), n) for f, n in self.context_schedule]

  def check_model(self, model_config) -> None:
    """Refuse, before any work, what this config asks of a model that does
    not have it (else the jitted train step fails, after the first eval)."""
    modules = model_config.num_mtp_modules
    if self.mtp_depth > modules:
      raise ConfigError(
          f"TrainConfig.mtp_depth={self.mtp_depth} exceeds "
          f"ModelConfig.num_mtp_modules={modules}: train fewer "
          f"(--mtp_depth={modules}) or give the model more "
          f"(--override=num_mtp_modules={self.mtp_depth})")

  def replace(self, **changes) -> "TrainConfig":
    return dataclasses.replace(self, **changes)


def parse_context_schedule(text: str) -> tuple[tuple[float, int], ...]:
  """A named schedule ("m2", "cpu") or "0:256,0.75:1024" (fraction:seq_len)."""
  if not text:
    return ()
  if text in CONTEXT_SCHEDULES:
    return CONTEXT_SCHEDULES[text]
  try:
    return tuple((float(f), int(n)) for f, n in
                 (item.split(":") for item in text.split(",")))
  except ValueError:
    raise ConfigError(
        f"TrainConfig.context_schedule: {text!r} is neither a name in "
        f"{sorted(CONTEXT_SCHEDULES)} nor FRACTION:SEQ_LEN,...") from None


@dataclasses.dataclass(frozen=True)
class GNMRConfig:
  """GNMR's constants; m2jax.train.gnmr's docstring says what each does
  and why its default is what it is."""

  history_decay: float = 0.95     # long EMA of a unit's norm (~20 steps)
  short_decay: float = 0.5        # short window of Delta-GNMR (~2 steps)
  warmup_steps: int = 50          # observations before a unit may trigger
  ratio_threshold: float = 8.0    # GNMR = norm / history mean
  delta_threshold: float = 8.0    # Delta-GNMR = norm / short-window mean
  skip_ratio: float = 100.0       # GNMR from which the update is dropped
  clip_to: float = 2.0            # a recovering unit's norm cap / its mean
  history_cap: float = 3.0        # an observation enters as <= cap * mean
  max_recovering: int = 8         # maxO: units in recovery at once
  lock_steps: int = 10            # steps a unit stays in recovery

  def __post_init__(self):
    def fail(field, rule):
      raise ConfigError(f"GNMRConfig.{field}: {rule} (got "
                        f"{getattr(self, field)!r})")

    for name in ("history_decay", "short_decay"):
      if not 0 <= getattr(self, name) < 1:
        fail(name, "must be in [0, 1)")
    for name in ("ratio_threshold", "delta_threshold"):
      if not getattr(self, name) > 1:
        fail(name, "must be > 1 (a ratio to a mean)")
    if not self.skip_ratio >= self.ratio_threshold:
      fail("skip_ratio", f"must be >= ratio_threshold ({self.ratio_threshold})")
    if not self.clip_to > 0:
      fail("clip_to", "must be positive")
    if not self.history_cap >= 1:
      fail("history_cap", "must be >= 1")
    if self.warmup_steps < 1:
      fail("warmup_steps", "must be >= 1")
    if self.max_recovering < 0:
      fail("max_recovering", "must be >= 0")
    if self.lock_steps < 1:
      fail("lock_steps", "must be >= 1")
