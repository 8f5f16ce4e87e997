"""The Forge RL loop: warm start, rollouts, scheduling, training, weight sync,
checkpoints and exact resume (SPEC §3).

  summary = run(model_config, train_config, RLRunConfig(env="arithmetic"),
                workdir="runs/rl")

Agents. A single-turn env (arithmetic, sorting) is one completion per
sample (m2jax/rl/rollout.py). A multi-step env (a tool task,
m2jax/rl/envs/tool_tasks.py) runs with `agent="whitebox"`: each sample is
an episode of the white-box agent (m2jax/agents/whitebox.py, configured
by `agent_config`) whose every model call is one step of a multi-step
trajectory (m2jax/rl/agent_rollout.py); or with `agent="blackbox"`: each
sample is a session of a separate agent program (agents/blackbox_agent.py)
recorded by the gateway, every call one step
(m2jax/rl/blackbox_rollout.py; agent_config's max_turns and
max_context_tokens bound it). Both warm-start on whole solved
conversations, tool calls and results included, and evaluate greedy
white-box episodes (the same prompts either way). The rollouts share one
interface (submit, poll, take_failed, update_variables, close, ...), so the
modes, the scheduler and resume are the same; a black-box group that
fails (module docstring of blackbox_rollout.py) is dropped from the
scheduler and counted (groups_failed), and another is generated.

One run directory holds everything:

  config.json          every config of the run (a resume must match it),
                       and under "init" the origin of the weights it
                       started from (sft.Init.origin; null: a fresh init)
  warm_start/          the supervised warm start: m2jax.train.sft.finetune
                       on the environment's generated demonstrations, a
                       whole SFT run directory (resumable on its own)
  pool.sqlite          the data pool (m2jax/rl/pool.py): every verified
                       trajectory, and which train step used it on which
                       policy version
  checkpoints/         the policy's train state every `checkpoint_every`
                       steps, with the policy version and queue position
  metrics.jsonl, tensorboard/   one line per step (below)

Modes. "sync": each step submits its groups, waits until all are verified,
trains on them, syncs the weights: on-policy (lag 0), the trainer idle while
the environments run. "async": a rollout thread keeps up to
`max_in_flight` groups generating and waiting on their environments while
the trainer takes batches as the scheduler allows (m2jax/rl/scheduler.py:
windowed FIFO by default); new weights go to the engine between its steps,
so rollouts in flight continue under them (their log-probs are the ones
actually sampled from, what CISPO's ratio corrects).

Each step's batch is `groups_per_step` groups of `group_size` samples. With
DAPO's dynamic sampling, groups whose rewards are all equal are discarded
in the pool (reason "no signal") and more groups are taken until the batch
is full (at most `dynamic_sampling_rounds` times its size).

Resume. A checkpoint saves the train state, the policy version and the next
queue position. On resume the pool undoes the trainings of the steps after
the checkpoint (their updates died with the process), and the verified
groups it holds that no surviving step trained are used before anything new
is generated: no trained trajectory is trained again, no verified one is
lost. Tasks and sampling seeds are functions of the run seed and the queue
position, so in sync mode a resumed run reproduces the uninterrupted one.

metrics.jsonl keys: step, reward_mean, reward_std (the outcome reward of the
trained samples), return_mean (their composite return G_0, m2jax/rl/rewards.py),
reward_generated_mean (the outcome reward of every sample the step read,
those DAPO discarded included: the number to compare across algorithms),
accuracy, policy_lag,
policy/logp_gap (the trained tokens' mean |log pi - behaviour log pi| under
the weights before the update: ~1e-6 on a sync step, where the trainer
must reproduce the rollout's log-probs),
policy_lag_max, samples_per_sec, trainer_idle_fraction, clip_fraction,
entropy, loss, difficulty_mean, rollouts (samples generated so far, the
pool's finished count), with MTP drafting (EngineConfig.mtp_draft) the
rollouts' speculative acceptance mtp/acceptance, mtp/acceptance_at_k and
mtp/rounds, the MTP co-training terms mtp/kl, mtp/ce, mtp/accept_prob
(m2jax/rl/mtp_cotrain.py), groups_failed (black-box groups dropped so
far), and eval_reward (greedy, held-out tasks)
every `eval_every` steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model
from m2jax.agents import whitebox
from m2jax.config import ConfigError, ModelConfig, config_to_dict
from m2jax.data import ByteTokenizer, chat
from m2jax.data.chat_data import ChatData
from m2jax.errors import UserError
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import agent_rollout
from m2jax.rl import blackbox_rollout
from m2jax.rl import envs
from m2jax.rl import mtp_cotrain
from m2jax.rl import objectives
from m2jax.rl import pool as pool_lib
from m2jax.rl import rewards as rewards_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import scheduler as sched_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.train import checkpoint as ckpt_lib
from m2jax.train import sft
from m2jax.train import state as state_lib
from m2jax.train.config import TrainConfig
from m2jax.train.metrics import MetricsWriter

MODES = ("sync", "async")
AGENTS = ("none", "whitebox", "blackbox")   # none: single-turn envs
CONFIG_FILE = "config.json"
INIT_KEY = "init"  # in CONFIG_FILE: the Init.origin the run started from
POOL_FILE = "pool.sqlite"
WARM_START_DIR = "warm_start"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLRunConfig:
  """What the run does (the model, optimizer and loss have their own).

  env: an environment of m2jax.rl.envs (env_fields: its config fields).
  agent: "whitebox" or "blackbox" for a multi-step env (tool tasks),
    "none" for a single-turn one (each refuses the other kind).
  mode: "sync" or "async" (module docstring).
  steps: policy updates.
  max_rollouts: a rollout budget (0: none): the run ends after the step at
    which the pool holds this many generated samples (trained, discarded
    and waiting alike), so algorithms that discard samples (DAPO's dynamic
    sampling) are compared at equal generation.
  groups_per_step: GRPO groups per update.
  max_in_flight: groups generating or waiting at once (async; None: twice
    groups_per_step).
  dynamic_sampling_rounds: DAPO takes up to this many batches' worth of
    groups to fill one with groups that carry signal.
  warm_start_steps: supervised steps on demonstrations before RL (0: none).
  warm_start_learning_rate, warm_start_batch_size, warm_start_seq_len:
    that phase's optimizer and rows; demonstrations: how many are drawn.
  eval_tasks, eval_every: greedy reward on fixed held-out tasks every
    `eval_every` steps (0: never), logged as eval_reward.
  checkpoint_every, keep_checkpoints: the policy's checkpoints
    (checkpoint_every=0: none, for benchmarks; such a run cannot resume).
  seed: tasks, sampling and the model's init.
  """
  env: str = "arithmetic"
  env_fields: tuple[tuple[str, object], ...] = ()
  agent: str = "none"
  mode: str = "sync"
  steps: int = 100
  max_rollouts: int = 0
  groups_per_step: int = 8
  max_in_flight: int | None = None
  dynamic_sampling_rounds: int = 3
  warm_start_steps: int = 200
  warm_start_learning_rate: float = 3e-3
  warm_start_batch_size: int = 16
  warm_start_seq_len: int = 256
  demonstrations: int = 4096
  eval_tasks: int = 64
  eval_every: int = 10
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  seed: int = 0

  def __post_init__(self):
    def fail(field, rule):
      raise UserError(f"RLRunConfig.{field}: {rule} (got "
                      f"{getattr(self, field)!r})")
    if self.mode not in MODES:
      fail("mode", f"must be one of {MODES}")
    if self.agent not in AGENTS:
      fail("agent", f"must be one of {AGENTS}")
    if self.env in envs.ENVS:
      multi = envs.multi_step(self.env)
      if multi and self.agent == "none":
        fail("agent", f"env {self.env!r} is solved with tool calls: run "
             "it with an agent ('whitebox' or 'blackbox')")
      if not multi and self.agent != "none":
        fail("agent", f"env {self.env!r} is single-turn; the {self.agent} "
             "agent runs multi-step tool envs ("
             f"{', '.join(n for n in envs.ENVS if envs.multi_step(n))})")
    for field in ("steps", "groups_per_step", "dynamic_sampling_rounds",
                  "keep_checkpoints"):
      if getattr(self, field) < 1:
        fail(field, "must be >= 1")
    for field in ("max_rollouts", "warm_start_steps", "eval_tasks",
                  "eval_every", "checkpoint_every"):
      if getattr(self, field) < 0:
        fail(field, "must be >= 0")
    if self.max_in_flight is not None and self.max_in_flight < 1:
      fail("max_in_flight", "must be None or >= 1")
    if self.warm_start_steps and self.demonstrations < 2:
      fail("demonstrations", "must be >= 2 with a warm start")

  @property
  def in_flight(self) -> int:
    return self.max_in_flight or 2 * self.groups_per_step


# The run's fields a resumed run may change (its length and cadences), and
# the train config's (how checkpoints are written; its length follows the
# run's).
RESUMABLE_RUN_FIELDS = frozenset({"steps", "max_rollouts", "checkpoint_every",
                                  "eval_every", "eval_tasks"})
RESUMABLE_TRAIN_FIELDS = frozenset({"async_checkpoint",
                                    "checkpoint_device_copy"})


def train_config(model_config: ModelConfig, *, steps: int,
                 learning_rate: float, **fields) -> TrainConfig:
  """RL's optimizer settings: no weight decay, every MTP module the model
  has trained at pretraining's final weight (rl_step.MTP_WEIGHT), the
  learning rate constant after warm-up unless `fields` say otherwise."""
  fields = {"warmup_steps": 5, "decay_fraction": 0.0, "min_lr_ratio": 1.0,
            **fields}
  return TrainConfig(
      steps=steps, learning_rate=learning_rate, weight_decay=0.0,
      mtp_depth=model_config.num_mtp_modules, mtp_weight=rl_step.MTP_WEIGHT,
      mtp_weight_final=rl_step.MTP_WEIGHT, **fields)


def check_same(saved: dict, configs: dict, where: str) -> None:
  """ConfigError naming the first field where a run's configs differ from
  those its checkpoint saved (RESUMABLE_RUN_FIELDS may change, and with
  the run's length the optimizer schedule's)."""
  may_change = {"run": RESUMABLE_RUN_FIELDS,
                "train": RESUMABLE_TRAIN_FIELDS | {"steps"}}
  for name, config in configs.items():
    if name not in saved:
      continue
    # Taken as this run's (also where a run saved before a field existed).
    ckpt_lib.check_same_config(
        {**saved[name], **{f: getattr(config, f)
                           for f in may_change.get(name, ())}},
        config, where)


class _Group(NamedTuple):
  """A group as the scheduler sees it (Scheduler.resume)."""
  trajectory_id: str
  queue_seq: int
  policy_version: int
  finished_at: float


# ---------------------------------------------------------------- warm start


def demonstration_data(env, tokenizer, run: RLRunConfig,
                       agent: whitebox.Agent | None = None) -> ChatData:
  """The warm start's SFT data: `run.demonstrations` generated tasks with
  correct answers (1/16 of them held out), chat-formatted; with an agent,
  whole solved conversations with the agent's tools, which must fit
  warm_start_seq_len (a cut one would not teach its last turns)."""
  rng = np.random.default_rng([run.seed, 3])
  if agent is None:
    convs = [rollout_lib.demonstration(env, env.sample(rng))
             for _ in range(run.demonstrations)]
  else:
    convs = [agent_rollout.demonstration(env, agent, env.sample(rng))
             for _ in range(run.demonstrations)]
    longest = max(len(chat.render(c["messages"], tokenizer,
                                  tools=c["tools"])[0]) for c in convs)
    if longest > run.warm_start_seq_len:
      raise UserError(f"RLRunConfig.warm_start_seq_len: {run.env}'s "
                      f"demonstrations run to {longest} tokens, more than "
                      f"{run.warm_start_seq_len} (raise it)")
  held = max(1, len(convs) // 16)
  config = sft.chat_data_config(
      tokenizer, source=f"demonstrations:{run.env}",
      seq_len=run.warm_start_seq_len, batch_size=run.warm_start_batch_size,
      seed=run.seed)
  return ChatData(config, tokenizer, conversations={
      "train": convs[held:], "validation": convs[:held]})


def warm_start(model_config: ModelConfig, train_config: TrainConfig, env,
               tokenizer, run: RLRunConfig, workdir: str, *,
               init: sft.Init | None = None, progress: bool = True,
               agent: whitebox.Agent | None = None) -> dict:
  """The variables RL starts from: `init`'s (default: a fresh init) after
  `run.warm_start_steps` SFT steps on demonstrations in workdir/warm_start
  (resumed if a previous call got part of the way); `agent` for a
  multi-step env."""
  if init is None:
    variables = model.init(model_config, jax.random.key(run.seed))
    init = sft.Init(model_config, variables, tokenizer,
                    {"init": "random", "seed": run.seed})
  if not run.warm_start_steps:  # a copy: the first step donates its state
    return jax.tree.map(jnp.copy, init.variables)
  directory = os.path.join(workdir, WARM_START_DIR)
  steps = run.warm_start_steps
  tcfg = train_config.replace(
      steps=steps, learning_rate=run.warm_start_learning_rate,
      warmup_steps=min(train_config.warmup_steps, steps // 10),
      checkpoint_every=steps, eval_every=steps, log_every=max(1, steps // 10))
  data = demonstration_data(env, tokenizer, run, agent)
  resume = os.path.isdir(os.path.join(directory, "checkpoints"))
  summary = sft.finetune(model_config, tcfg, data, directory,
                         init=None if resume else init, resume=resume,
                         progress=progress)
  return state_lib.variables_of(summary["state"])


def resumed_init(workdir: str, model_config: ModelConfig,
                 init_dir: str | None = None) -> sft.Init | None:
  """The weights and tokenizer a resumed run started from: `init_dir`
  (--init), else the directory its config.json records (INIT_KEY); None
  for a run from a fresh or an in-process init. The run continues from its
  newest checkpoint when it has one; these are what it starts over from
  when it has none (killed before its first), and its tokenizer always."""
  with open(os.path.join(workdir, CONFIG_FILE), encoding="utf-8") as f:
    origin = json.load(f).get(INIT_KEY) or {}
  saved = origin.get("init")
  # sft.load_init records an absolute directory; the other origins ("random",
  # an in-process warm start) have nothing to reload.
  path = init_dir or (saved if saved and os.path.isabs(saved) else None)
  if path is None:
    return None
  if not os.path.isdir(path):
    raise ConfigError(f"--resume: {workdir} started from {path}, which is "
                      "not a directory any more; pass --init=DIR of the same "
                      "run")
  init = sft.load_init(path)
  if init.model_config.replace(settings=model_config.settings) != model_config:
    raise ConfigError(f"--init={path}: its model config is not the one "
                      f"{workdir} was trained with")
  return init


# -------------------------------------------------------------------- eval


def evaluate(engine: Engine, env, tokenizer, run: RLRunConfig,
             max_new_tokens: int, agent: whitebox.Agent | None = None
             ) -> float:
  """Mean greedy reward on `run.eval_tasks` fixed held-out tasks (greedy
  agent episodes with an agent)."""
  rng = np.random.default_rng([run.seed, 4])
  tasks = [env.sample(rng) for _ in range(run.eval_tasks)]
  if agent is not None:
    return agent_rollout.evaluate(engine, env, agent, tasks, max_new_tokens)
  params = SamplingParams(temperature=0, max_tokens=max_new_tokens,
                          stop=(chat.END_OF_TURN,))
  results = engine.generate(
      [rollout_lib.prompt_ids(t, tokenizer) for t in tasks], params)
  return float(np.mean([
      env.verify(t, rollout_lib.completion_text(r[0].tokens, tokenizer)
                 ).reward for t, r in zip(tasks, results)]))


# --------------------------------------------------------------------- run


class _Run:
  """The state of one run (see `run`)."""

  def __init__(self, mcfg, tcfg, rl_config, run, rollout_config,
               trainer_config, schedule_config, engine_config, reward_config,
               agent_config, workdir, *, resume, init, progress, mesh):
    self.rl_config, self.run, self.progress = rl_config, run, progress
    self.rollout_config, self.workdir = rollout_config, workdir
    self.configs = {"model": mcfg, "train": tcfg, "rl": rl_config,
                    "run": run, "rollout": rollout_config,
                    "trainer": trainer_config, "schedule": schedule_config,
                    "rewards": reward_config, "agent": agent_config}
    self.reward_config = reward_config
    tcfg.check_model(mcfg)
    if run.agent != "none":
      need = agent_config.max_context_tokens + rollout_config.max_new_tokens
      if need > trainer_config.row_len:
        raise UserError(
            f"TrainerConfig.row_len: {trainer_config.row_len} cannot hold "
            f"an agent call's sample of up to {need} tokens (AgentConfig."
            "max_context_tokens + RolloutConfig.max_new_tokens): raise it "
            "or lower max_context_tokens")
    if run.agent == "blackbox" and (agent_config.summarise
                                    or agent_config.keep_last_turns):
      raise UserError("AgentConfig.summarise / keep_last_turns: context "
                      "management of the white-box agent; the black-box "
                      "agent does its own (leave them off)")
    os.makedirs(workdir, exist_ok=True)
    self.ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                      keep=run.keep_checkpoints,
                                      asynchronous=tcfg.async_checkpoint,
                                      device_copy=tcfg.checkpoint_device_copy)
    pool_path = os.path.join(workdir, POOL_FILE)
    if resume:
      self.ckpt.check_resume()
      meta = self.ckpt.newest_meta()
      if meta is not None:
        check_same(meta["configs"], self.configs,
                   f"the newest checkpoint in {workdir}")
    elif self.ckpt.steps() or os.path.exists(pool_path):
      raise UserError(f"{workdir} holds an RL run: continue it with "
                      "--resume, or use a fresh --workdir")
    # Where the run's weights came from (sft.Init.origin): a resume that
    # finds no checkpoint of its own starts from the same place again.
    ckpt_lib.write_json(os.path.join(workdir, CONFIG_FILE), {
        **self._saved_configs(),
        INIT_KEY: init.origin if init is not None else None})
    self.tokenizer = init.tokenizer if init is not None else ByteTokenizer()
    self.env = envs.make(run.env, **dict(run.env_fields))
    self.agent = None
    if run.agent != "none":
      self.agent = agent_rollout.agent_for(self.env, agent_config,
                                           self.tokenizer)
      agent_rollout.check_fits(self.env, self.agent,
                               rollout_config.max_new_tokens)
    variables = warm_start(mcfg, tcfg, self.env, self.tokenizer, run,
                           workdir, init=init, progress=progress,
                           agent=self.agent)
    state = state_lib.create_state(mcfg, tcfg, variables)
    self.step, self.version, self.next_seq = 0, 0, 0
    restored_state = None
    if resume:
      restored = self.ckpt.restore_latest(ckpt_lib.abstract(state),
                                          train_config=tcfg)
      if restored is not None:
        self.step, restored_state, data, meta = restored
        self.version, self.next_seq = meta["version"], data["next_seq"]
    self.pool = pool_lib.Pool(pool_path)
    self.pool.rollback(self.step)
    # Built on the start (the warm start), which its frozen references
    # (KL, MTP) copy, resumed or not; then the checkpoint's state.
    self.trainer = trainer_lib.Trainer(mcfg, tcfg, rl_config, trainer_config,
                                       state, mesh=mesh,
                                       rewards=reward_config)
    if restored_state is not None:
      self.trainer.load_state(restored_state)
    self.engine = Engine(mcfg, self.trainer.snapshot(), engine_config,
                         tokenizer=self.tokenizer, mesh=mesh)
    # The verified groups no surviving step trained: first in the queue.
    G = rollout_config.group_size
    groups: dict[str, list] = {}
    for t in self.pool.untrained():
      groups.setdefault(t.group_id, []).append(t)
    for gid, ts in list(groups.items()):
      if len(ts) == G:
        continue
      if run.agent != "blackbox":
        raise UserError(f"the pool holds {len(ts)} untrained samples of "
                        f"group {gid}, not group_size={G}")
      # Black-box sessions commit one by one: a group cut by the stop is
      # completed (or failed) when its task number comes up again.
      del groups[gid]
    self.present = {ts[0].queue_seq // G for ts in groups.values()}
    self.sched = sched_lib.Scheduler.resume(schedule_config, [
        _Group(gid, ts[0].queue_seq // G, min(t.policy_version for t in ts),
               max(t.finished_at for t in ts))
        for gid, ts in groups.items()])
    self.writer = MetricsWriter(workdir,
                                resume_step=self.step if resume else None)
    self.lock = threading.Condition()
    self._tried: list[float] = []   # rewards of the groups a step read
    self._drafts_seen: dict = {}    # the engine's MTP counters at last read
    self.groups_failed = 0

  # -- pieces shared by both modes --

  def _next_seq(self) -> int:
    """The next task number to generate (skipping those whose groups the
    pool holds from before a crash: they are verified already)."""
    while self.next_seq in self.present:
      self.next_seq += 1
    seq, self.next_seq = self.next_seq, self.next_seq + 1
    return seq

  def _rollout(self, pool):
    """The run's rollout on `pool`: single-turn groups, or groups of agent
    episodes (same interface)."""
    if self.agent is None:
      return rollout_lib.Rollout(self.engine, self.env, self.tokenizer, pool,
                                 self.rollout_config, seed=self.run.seed)
    if self.run.agent == "blackbox":
      return blackbox_rollout.BlackBoxRollout(
          self.engine, self.env, self.agent.config, pool,
          self.rollout_config, seed=self.run.seed,
          policy_version=self.version)
    return agent_rollout.AgentRollout(self.engine, self.env, self.agent, pool,
                                      self.rollout_config, seed=self.run.seed)

  def _submit(self, rollout: rollout_lib.Rollout, version: int) -> None:
    gid = rollout.submit(self._next_seq(), version)
    self.sched.submit(gid, version)

  def _saved_configs(self) -> dict:
    return {k: config_to_dict(v) for k, v in self.configs.items()}

  def _checkpoint(self) -> None:
    self.ckpt.save(self.step, self.trainer.state,
                   {"next_seq": self.next_seq},
                   {"version": self.version,
                    "configs": self._saved_configs()})

  def _drop_failed(self, rollout: rollout_lib.Rollout) -> int:
    """Groups the rollout could not commit (discarded in the pool already):
    out of the queue. Returns how many."""
    failed = [g for g in rollout.take_failed() if g in self.sched]
    self.sched.drop(failed)
    self.groups_failed += len(failed)
    return len(failed)

  def _drop_stale(self, rollout: rollout_lib.Rollout, pool) -> None:
    """Groups past max_lag: finished ones discarded in the pool, running
    ones cancelled (discarded when they finish); out of the queue."""
    stale = self.sched.stale(self.version)
    if not stale:
      return
    running = set(self.sched.in_flight())
    G = self.rollout_config.group_size
    for gid in stale:
      if gid in running:
        rollout.cancel(gid)
      else:
        pool.discard(rollout_lib.trajectory_ids(gid, G),
                     reason=f"stale: past max_lag at version {self.version}",
                     train_step=self.step)
    self.sched.drop(stale)

  def _batch_of(self, groups: list[str]) -> tuple[list, list[str]]:
    """The trajectories of `groups` without DAPO's zero-signal groups
    (discarded in the pool, returned second)."""
    G = self.rollout_config.group_size
    trajs = self.pool.get([tid for gid in groups
                           for tid in rollout_lib.trajectory_ids(gid, G)])
    self._tried += [t.reward for t in trajs]
    if not self.rl_config.dynamic_sampling:
      return trajs, []
    # Signal is judged on the composite return the advantages come from:
    # equal outcomes may still differ in process or speed rewards.
    kept = objectives.dynamic_sampling(
        rewards_lib.returns(trajs, self.reward_config),
        np.asarray([t.group_id for t in trajs]))
    dropped = [t.trajectory_id for t, keep in zip(trajs, kept.keep)
               if not keep]
    if dropped:
      self.pool.discard(dropped, reason="no signal: equal rewards (DAPO "
                        "dynamic sampling)", train_step=self.step + 1)
    return [t for t, keep in zip(trajs, kept.keep) if keep], list(
        kept.dropped)

  def _rollout_acceptance(self) -> dict:
    """The engine's speculative acceptance since the last call (the step's
    rollouts; {} without MTP drafting; mtp_cotrain.rollout_acceptance)."""
    draft = self.engine.config.mtp_draft
    seen = mtp_cotrain.engine_counters(self.engine.stats, draft)
    out = mtp_cotrain.rollout_acceptance(self._drafts_seen, seen, draft)
    self._drafts_seen = seen
    return out

  def _train(self, trajs, started: float, idle: float, tried: int) -> dict:
    metrics = self.trainer.train(trajs)
    self.pool.mark_trained([t.trajectory_id for t in trajs],
                           train_step=self.step + 1,
                           policy_version=self.version)
    rewards = np.asarray([t.reward for t in trajs])
    lags = [self.version - t.policy_version for t in trajs]
    self.version += 1
    self.step += 1
    elapsed = time.time() - started
    return {
        "reward_mean": rewards.mean(), "reward_std": rewards.std(),
        "return_mean": rewards_lib.returns(trajs, self.reward_config).mean(),
        "reward_generated_mean": np.mean(self._tried),
        "accuracy": np.mean([t.verification.get("correct", False)
                             for t in trajs]),
        "policy_lag": np.mean(lags), "policy_lag_max": max(lags),
        "samples_per_sec": len(trajs) / max(elapsed, 1e-9),
        "trainer_idle_fraction": idle / max(elapsed, 1e-9),
        "clip_fraction": metrics.get("policy/clip_fraction", np.nan),
        "entropy": metrics.get("policy/entropy", np.nan),
        "loss": metrics["loss"],
        "difficulty_mean": np.mean([t.difficulty for t in trajs]),
        "samples": len(trajs), "groups_tried": tried,
        "step_seconds": elapsed, **self._rollout_acceptance(),
        **{k: v for k, v in metrics.items()
           if k.startswith(("train/", "policy/", "mtp/"))}}

  def _skip(self, started: float, tried: int) -> dict:
    """A step whose groups all lacked signal (DAPO's dynamic sampling
    discarded every one, `dynamic_sampling_rounds` batches' worth): no
    update, the weights and version stay; logged with the rewards seen."""
    self.step += 1
    rewards = np.asarray(self._tried)
    return {"reward_mean": rewards.mean(), "reward_std": rewards.std(),
            "reward_generated_mean": rewards.mean(), "samples": 0, "groups_tried": tried, "skipped": 1,
            "policy_lag": 0.0, "policy_lag_max": 0,
            "samples_per_sec": 0.0, "trainer_idle_fraction": 0.0,
            "clip_fraction": np.nan, "entropy": np.nan, "loss": np.nan,
            "step_seconds": time.time() - started}

  def _log(self, metrics: dict) -> None:
    metrics["rollouts"] = self.pool.counts()["finished"]
    metrics["groups_failed"] = self.groups_failed
    if (self.run.eval_every and self.run.eval_tasks
        and self.step % self.run.eval_every == 0
        and self.run.mode == "sync"):
      metrics["eval_reward"] = evaluate(
          self.engine, self.env, self.tokenizer, self.run,
          self.rollout_config.max_new_tokens, self.agent)
      self._rollout_acceptance()  # greedy eval drafts are not rollouts
    self.writer.write(self.step, metrics)
    if self.progress:
      print(f"step {self.step}: reward {metrics['reward_mean']:.3f} "
            f"lag {metrics['policy_lag']:.2f} "
            f"samples/s {metrics['samples_per_sec']:.1f} "
            f"idle {metrics['trainer_idle_fraction']:.2f}"
            + (f" eval {metrics['eval_reward']:.3f}"
               if "eval_reward" in metrics else ""), flush=True)
    every = self.run.checkpoint_every
    if every and (self.step % every == 0 or not self._more(None)):
      self._checkpoint()

  def _more(self, stop_after: int | None) -> bool:
    """Whether another step runs: below `steps` (and `stop_after`), and
    the rollout budget not spent."""
    if self.step >= min(self.run.steps, stop_after or self.run.steps):
      return False
    budget = self.run.max_rollouts
    return not budget or self.pool.counts()["finished"] < budget

  # -- sync --

  def sync(self, stop_after: int | None) -> None:
    """Generate a batch, wait for its verification, train, sync."""
    rollout = self._rollout(self.pool)
    try:
      self._sync(rollout, stop_after)
    finally:
      rollout.close()

  def _sync(self, rollout, stop_after: int | None) -> None:
    n = self.run.groups_per_step
    while self._more(stop_after):
      started, batch, kept, tried = time.time(), [], 0, 0
      self._tried = []
      while kept < n and tried < n * self.run.dynamic_sampling_rounds:
        ready = len(self.sched) - len(self.sched.in_flight())
        for _ in range(n - kept - ready):
          self._submit(rollout, self.version)
        while rollout.in_flight:
          for gid in rollout.poll():
            self.sched.finish(gid)
          # A failed group counts as tried: a step's work stays bounded.
          tried += self._drop_failed(rollout)
          wait = rollout.next_ready_in()
          if wait and not self.engine.has_work():
            time.sleep(wait)
        self._drop_stale(rollout, self.pool)
        groups = self._take_all(n - kept)
        tried += len(groups)
        trajs, dropped = self._batch_of(groups)
        batch += trajs
        kept += len(groups) - len(dropped)
      if batch:
        metrics = self._train(batch, started, idle=0.0, tried=tried)
        rollout.update_variables(self.trainer.snapshot(), self.version)
      else:
        metrics = self._skip(started, tried)
      self._log(metrics)

  def _take_all(self, n: int) -> list[str]:
    """Up to n groups, taking again while the policy allows more (the
    window shrinks with the queue: ceil(W * N) of N finished groups)."""
    groups = []
    while len(groups) < n:
      more = self.sched.take(n - len(groups), self.version)
      if not more:
        break
      groups += more
    return groups

  # -- async --

  def async_(self, stop_after: int | None) -> None:
    """A rollout thread generates while this thread trains (module
    docstring); weights cross over between engine steps."""
    stop = threading.Event()
    weights: list = []          # the newest (version, variables)
    errors: list[BaseException] = []

    def produce():
      pool = pool_lib.Pool(os.path.join(self.workdir, POOL_FILE))
      rollout = None
      version = self.version
      try:
        rollout = self._rollout(pool)
        while not stop.is_set():
          with self.lock:
            new = weights.pop() if weights else None
          if new is not None:
            # Outside the lock: a black-box swap waits for calls in flight.
            version, variables = new
            rollout.update_variables(variables, version)
          with self.lock:
            self._drop_stale(rollout, pool)
            while (rollout.in_flight < self.run.in_flight
                   and self.sched.can_submit()):
              self._submit(rollout, version)
          done = rollout.poll()
          with self.lock:
            failed = self._drop_failed(rollout)
          if done:
            with self.lock:
              for gid in done:
                if gid in self.sched:
                  self.sched.finish(gid)
              self.lock.notify_all()
          elif not failed and not self.engine.has_work():
            time.sleep(min(rollout.next_ready_in() or 0.01, 0.01))
      except BaseException as e:  # pylint: disable=broad-except
        errors.append(e)
      finally:
        if rollout is not None:
          rollout.close()
        pool.close()
        with self.lock:
          self.lock.notify_all()

    thread = threading.Thread(target=produce, name="rollout", daemon=True)
    thread.start()
    n = self.run.groups_per_step
    try:
      while self._more(stop_after):
        started, idle, batch, kept, tried = time.time(), 0.0, [], 0, 0
        self._tried = []
        while kept < n and tried < n * self.run.dynamic_sampling_rounds:
          with self.lock:
            groups = self._take_all(n - kept)
            if not groups:
              if errors or not thread.is_alive():
                raise errors[0] if errors else RuntimeError(
                    "the rollout thread stopped")
              wait = time.time()
              self.lock.wait(timeout=0.5)
              idle += time.time() - wait
              continue
          tried += len(groups)
          trajs, dropped = self._batch_of(groups)
          batch += trajs
          kept += len(groups) - len(dropped)
        if batch:
          metrics = self._train(batch, started, idle, tried)
          with self.lock:
            weights[:] = [(self.version, self.trainer.snapshot())]
        else:
          metrics = self._skip(started, tried)
        self._log(metrics)
    finally:
      stop.set()
      thread.join()


def run(model_config: ModelConfig, train_config: TrainConfig,
        run_config: RLRunConfig, workdir: str, *,
        rl_config: rl_step.RLConfig = rl_step.RLConfig(),
        rollout_config: rollout_lib.RolloutConfig = (
            rollout_lib.RolloutConfig()),
        trainer_config: trainer_lib.TrainerConfig = (
            trainer_lib.TrainerConfig()),
        schedule_config: sched_lib.ScheduleConfig = (
            sched_lib.ScheduleConfig()),
        engine_config: EngineConfig = EngineConfig(),
        reward_config: rewards_lib.RewardConfig = rewards_lib.RewardConfig(),
        agent_config: whitebox.AgentConfig = whitebox.AgentConfig(),
        resume: bool = False, init: sft.Init | None = None,
        stop_after: int | None = None, progress: bool = True,
        mesh=None) -> dict:
  """Runs (or resumes) an RL run in `workdir` (module docstring); returns
  {"step", "version", "pool" (counts), "eval_reward" (greedy, at the end;
  with eval_tasks)}. `stop_after` ends early at that step
  (with a checkpoint), as if killed right after it."""
  r = _Run(model_config, train_config, rl_config, run_config, rollout_config,
           trainer_config, schedule_config, engine_config, reward_config,
           agent_config, workdir, resume=resume, init=init,
           progress=progress, mesh=mesh)
  try:
    if run_config.mode == "sync":
      r.sync(stop_after)
    else:
      r.async_(stop_after)
    every = run_config.checkpoint_every
    if stop_after is not None and every and r.step % every:
      r._checkpoint()  # pylint: disable=protected-access
    summary = {"step": r.step, "version": r.version,
               "pool": r.pool.counts()}
    if run_config.eval_tasks:
      summary["eval_reward"] = evaluate(
          r.engine, r.env, r.tokenizer, run_config,
          rollout_config.max_new_tokens, r.agent)
    return summary
  finally:
    r.writer.close()
    r.pool.close()
    r.ckpt.close()
