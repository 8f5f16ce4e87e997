r"""Forge RL on a verifiable environment: warm start, rollouts, training.

  python -m experiments.rl --preset=tiny --env=arithmetic --workdir=runs/rl
  python -m experiments.rl --workdir=runs/rl --resume          # continue
  python -m experiments.rl --preset=tiny --env=sorting --algo=dapo \
      --mode=async --schedule=windowed --latency_scale=0.01 --steps=200
  python -m experiments.rl --preset=tiny --env=multiply --agent=whitebox \
      --max_new_tokens=160 --row_len=1024 --warm_start_seq_len=768
  python -m experiments.rl --preset=tiny --env=multiply --agent=blackbox \
      --max_new_tokens=160 --row_len=1024 --warm_start_seq_len=768

A run first fine-tunes the model on the environment's generated
demonstrations (--warm_start_steps of SFT, m2jax.train.sft, in
WORKDIR/warm_start), then alternates rollouts (the generation engine, GRPO
groups of --group_size samples) and policy updates (CISPO by default, or the
GRPO / DAPO baselines) on prefix-tree-merged rows. WORKDIR holds
config.json, the data pool (pool.sqlite: every verified trajectory and what
trained on it), checkpoints/, metrics.jsonl and tensorboard/
(m2jax/rl/loop.py says what each holds).

--resume continues WORKDIR with the configs it saved: a flag left out keeps
the run's value; --steps, --max_rollouts and the cadence flags may change;
any other flag given that contradicts the run is refused, naming the field.
A killed run resumes from its newest checkpoint with its pool intact, and
trains no trajectory twice. A run started from --init=DIR records DIR in
its config.json; the resume reloads it (the tokenizer, and the weights a
run killed before its first checkpoint starts over from), or --init=DIR
names it again, checked against the run's model config.

--agent=whitebox runs a multi-step env (a tool task: --env=multiply) with
the white-box agent (m2jax/agents/whitebox.py): every sample an episode of
up to --max_turns model calls with tool calls, each call one training step;
--max_new_tokens is per call. --agent=blackbox runs the same tasks with a
separate agent program (agents/blackbox_agent.py: the `openai` client and
nothing of m2jax) through the recording gateway on 127.0.0.1
(m2jax/rl/blackbox_rollout.py); --keep_last_turns and --summarise are the
white-box agent's and refused. An agent with a single-turn env, or a
multi-step env without one, is refused. All logic is in m2jax.rl; this
file turns flags into configs.
"""

import dataclasses
import json
import os

from absl import flags, logging

from experiments import cli, run_flags, train_flags
from m2jax.agents import whitebox
from m2jax.config import ConfigError, ModelConfig, config_from_dict, \
    get_preset
from m2jax.infer.engine import EngineConfig
from m2jax.rl import envs
from m2jax.rl import loop
from m2jax.rl import rewards as rewards_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import scheduler as sched_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.train import resume, sft
from m2jax.train.config import TrainConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", "runs/rl", "Run directory.")
flags.DEFINE_bool("resume", False, "Continue from the newest checkpoint.")
flags.DEFINE_string("preset", "tiny", "Model preset (m2jax.config.PRESETS).")
flags.DEFINE_string("init", None, "Start from a pretraining or SFT run "
                    "directory (its newest checkpoint and tokenizer) instead "
                    "of a fresh init.")
# The environment.
flags.DEFINE_enum("env", "arithmetic", sorted(envs.ENVS), "Environment.")
flags.DEFINE_string("env_config", "", "Environment fields as "
                    "FIELD=VALUE;FIELD=VALUE, lists comma-separated, e.g. "
                    "'levels=1,2;ops=+' (m2jax/rl/envs says the fields).")
flags.DEFINE_enum("agent", "none", list(loop.AGENTS), "whitebox: run a "
                  "multi-step (tool) env with the white-box agent; "
                  "blackbox: with a separate agent program through the "
                  "gateway; none: a single-turn env.")
flags.DEFINE_integer("max_turns", whitebox.AgentConfig.max_turns,
                     "Agent: model calls per episode at most.")
flags.DEFINE_integer("keep_last_turns", whitebox.AgentConfig.keep_last_turns,
                     "Agent: turns kept in the context (0: all).")
flags.DEFINE_bool("summarise", whitebox.AgentConfig.summarise, "Agent: offer "
                  "the summarise tool, whose summary replaces older turns.")
flags.DEFINE_integer("max_context_tokens", None, "Agent: the longest prompt "
                     "(default: --row_len minus --max_new_tokens).")
flags.DEFINE_float("latency_scale", 0.0, "Wall seconds per simulated "
                   "environment second (0: the environment answers at once).")
# The algorithm.
flags.DEFINE_enum("algo", "cispo", list(rl_step.ALGORITHMS), "Policy loss: "
                  "CISPO, or the GRPO (PPO-clip) and DAPO baselines.")
flags.DEFINE_float("kl_coef", 0.0, "KL to the warm-start policy (0: off).")
flags.DEFINE_float("reward_alpha", 1.0, "Weight of the per-step process "
                   "reward (m2jax/rl/rewards.py).")
flags.DEFINE_float("reward_beta", 0.0, "Weight of the speed reward "
                   "h(T_completion / T_baseline) (0: off).")
flags.DEFINE_float("reward_gamma", 1.0, "Discount of the reward-to-go.")
flags.DEFINE_float("speed_min", -1.0, "Lower clip of the speed reward.")
flags.DEFINE_float("speed_max", 1.0, "Upper clip of the speed reward.")
flags.DEFINE_enum("reward_baseline", "step", ["step", "trajectory"], "What "
                  "each step's reward-to-go is compared with: the group's "
                  "mean at that step, or its mean return (rewards.py).")
flags.DEFINE_enum("mode", "sync", list(loop.MODES), "sync: generate, then "
                  "train; async: rollouts and training overlap.")
flags.DEFINE_enum("schedule", "windowed", list(sched_lib.POLICIES),
                  "Which finished groups the trainer may take.")
flags.DEFINE_float("window", sched_lib.ScheduleConfig.window, "Windowed "
                   "FIFO: the share of the queue the trainer may take from.")
flags.DEFINE_integer("max_lag", sched_lib.ScheduleConfig.max_lag,
                     "Most policy versions a trained group may lag.")
# Rollouts.
flags.DEFINE_integer("steps", 100, "Policy updates.")
flags.DEFINE_integer("max_rollouts", 0, "Rollout budget: end after the step "
                     "at which this many samples were generated (0: none).")
flags.DEFINE_integer("groups_per_step", 8, "GRPO groups per update.")
flags.DEFINE_integer("group_size", 8, "Samples per task.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
flags.DEFINE_integer("max_new_tokens", 32, "Action length at most.")
flags.DEFINE_integer("max_in_flight", None, "Groups in flight (async; "
                     "default 2 x groups_per_step).")
flags.DEFINE_integer("max_batch", 128, "Engine: sequences decoded at once.")
flags.DEFINE_integer("num_pages", 2048, "Engine: KV pages.")
flags.DEFINE_integer("page_size", 16, "Engine: tokens per KV page.")
flags.DEFINE_integer("mtp_draft", 0, "Engine: MTP speculative draft tokens "
                     "per round in rollouts (0: plain decoding; at most the "
                     "model's MTP modules). Acceptance is logged per step.")
flags.DEFINE_enum("mtp_loss", "topk_kl", ["topk_kl", "ce"], "MTP co-training "
                  "in RL: top-K KL to the policy, or CE on sampled tokens.")
flags.DEFINE_integer("mtp_topk", rl_step.MTP_TOPK, "K of the MTP top-K KL.")
flags.DEFINE_enum("mtp_tail", "bucket", ["bucket", "renormalize"], "Mass "
                  "outside the top K: one outcome, or renormalised away.")
flags.DEFINE_bool("mtp_detach", True, "The MTP term trains only the MTP "
                  "modules (the policy's trunk, embedding and head detached).")
flags.DEFINE_float("mtp_weight", rl_step.MTP_WEIGHT, "Weight of the MTP "
                   "term; with --mtp_detach, 0 freezes the MTP modules (no "
                   "co-training: the baseline its acceptance is compared "
                   "against).", lower_bound=0.0)
flags.DEFINE_bool("mtp_reference", False, "Also score the MTP modules the "
                  "run started with (frozen) against the current policy on "
                  "each batch: mtp/ref_accept_prob and mtp/ref_kl, the "
                  "co-training metrics without co-training on the same "
                  "policy (one more forward pass a step).")
# Training.
flags.DEFINE_float("learning_rate", 1e-3, "RL learning rate.")
flags.DEFINE_integer("warmup_steps", 5, "RL learning-rate warmup.")
flags.DEFINE_float("decay_fraction", 0.0, "Last share of the RL steps over "
                   "which the learning rate decays (to --min_lr_ratio).")
flags.DEFINE_float("min_lr_ratio", 0.1, "Learning rate at the end of the "
                   "decay, as a share of --learning_rate.")
flags.DEFINE_float("grad_clip", 1.0, "Global-norm gradient clipping.")
flags.DEFINE_integer("row_len", 512, "Tokens per merged row.")
flags.DEFINE_integer("rows_per_micro_batch", 4, "Rows per micro-batch.")
flags.DEFINE_bool("merge", True, "Prefix-tree merging of the batch.")
flags.DEFINE_integer("minibatches", 1, "Optimizer updates per batch (its "
                     "groups split in order).")
flags.DEFINE_integer("warm_start_steps", 200, "SFT steps on demonstrations "
                     "before RL (0: none).")
flags.DEFINE_float("warm_start_learning_rate", 3e-3, "SFT learning rate.")
flags.DEFINE_integer("eval_every", 10, "Steps between greedy evals on "
                     "held-out tasks (0: none).")
flags.DEFINE_integer("eval_tasks", 64, "Held-out tasks per eval.")
flags.DEFINE_integer("checkpoint_every", 10, "Steps between checkpoints.")
train_flags.define_save_modes()
flags.DEFINE_integer("warm_start_seq_len", loop.RLRunConfig.warm_start_seq_len,
                     "Tokens per SFT row (a demonstration must fit one).")
flags.DEFINE_integer("seed", 0, "Tasks, sampling and init.")

run_flags.define()  # --mesh, the Settings flags, multi-host

# {flag: field} per config, for --resume.
RUN_FLAGS = {"env": "env", "agent": "agent", "mode": "mode", "steps": "steps",
             "max_rollouts": "max_rollouts",
             "groups_per_step": "groups_per_step",
             "max_in_flight": "max_in_flight",
             "warm_start_steps": "warm_start_steps",
             "warm_start_learning_rate": "warm_start_learning_rate",
             "warm_start_seq_len": "warm_start_seq_len",
             "eval_every": "eval_every", "eval_tasks": "eval_tasks",
             "checkpoint_every": "checkpoint_every", "seed": "seed"}
ROLLOUT_FLAGS = {"group_size": "group_size", "temperature": "temperature",
                 "max_new_tokens": "max_new_tokens",
                 "latency_scale": "latency_scale"}
SCHEDULE_FLAGS = {"schedule": "policy", "window": "window",
                  "max_lag": "max_lag"}
TRAINER_FLAGS = {"row_len": "row_len", "minibatches": "minibatches",
                 "rows_per_micro_batch": "rows_per_micro_batch",
                 "merge": "merge"}
RL_FLAGS = {"algo": "algorithm", "kl_coef": "kl_coef", "mtp_loss": "mtp_loss",
            "mtp_topk": "mtp_topk", "mtp_tail": "mtp_tail",
            "mtp_detach": "mtp_detach", "mtp_weight": "mtp_weight",
            "mtp_reference": "mtp_reference"}
REWARD_FLAGS = {"reward_alpha": "alpha", "reward_beta": "beta",
                "reward_gamma": "gamma", "speed_min": "speed_min",
                "speed_max": "speed_max", "reward_baseline": "baseline"}
AGENT_FLAGS = {"max_turns": "max_turns", "keep_last_turns": "keep_last_turns",
               "summarise": "summarise",
               "max_context_tokens": "max_context_tokens"}
TRAIN_FLAGS = {"learning_rate": "learning_rate",
               "warmup_steps": "warmup_steps", "grad_clip": "grad_clip",
               "decay_fraction": "decay_fraction",
               "min_lr_ratio": "min_lr_ratio",
               "async_checkpoint": "async_checkpoint",
               "checkpoint_device_copy": "checkpoint_device_copy",
               "seed": "seed"}


def _env_fields() -> tuple:
  """((field, value), ...) of --env_config, typed like the env's defaults."""
  cls = envs.ENVS[FLAGS.env]
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}
  out = []
  for item in filter(None, FLAGS.env_config.split(";")):
    key, sep, text = item.partition("=")
    if not sep or key not in defaults:
      raise ConfigError(f"--env_config: {item!r} is not FIELD=VALUE with a "
                        f"field of {cls.__name__} ({', '.join(defaults)})")
    default = defaults[key]
    try:
      if isinstance(default, tuple) or default is None:
        kind = type(default[0]) if default else float
        value = tuple(kind(v) for v in text.split(","))
      else:
        value = type(default)(text)
    except ValueError:
      raise ConfigError(f"--env_config: {key}={text!r} does not read as "
                        f"{cls.__name__}.{key}") from None
    out.append((key, value))
  return tuple(out)


def _fresh_configs(mcfg: ModelConfig):
  steps = FLAGS.steps
  train = loop.train_config(
      mcfg, steps=steps * FLAGS.minibatches, seed=FLAGS.seed,
      learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
      decay_fraction=FLAGS.decay_fraction, min_lr_ratio=FLAGS.min_lr_ratio,
      grad_clip=FLAGS.grad_clip, async_checkpoint=FLAGS.async_checkpoint,
      checkpoint_device_copy=FLAGS.checkpoint_device_copy)
  rl = rl_step.RLConfig(algorithm=FLAGS.algo, kl_coef=FLAGS.kl_coef,
                        mtp_depth=mcfg.num_mtp_modules,
                        mtp_loss=FLAGS.mtp_loss, mtp_topk=FLAGS.mtp_topk,
                        mtp_tail=FLAGS.mtp_tail, mtp_detach=FLAGS.mtp_detach,
                        mtp_weight=FLAGS.mtp_weight,
                        mtp_reference=FLAGS.mtp_reference)
  run = loop.RLRunConfig(
      env=FLAGS.env, env_fields=_env_fields(), agent=FLAGS.agent,
      mode=FLAGS.mode, steps=steps, max_rollouts=FLAGS.max_rollouts,
      groups_per_step=FLAGS.groups_per_step,
      max_in_flight=FLAGS.max_in_flight,
      warm_start_steps=FLAGS.warm_start_steps,
      warm_start_learning_rate=FLAGS.warm_start_learning_rate,
      warm_start_seq_len=FLAGS.warm_start_seq_len,
      eval_every=FLAGS.eval_every, eval_tasks=FLAGS.eval_tasks,
      checkpoint_every=FLAGS.checkpoint_every, seed=FLAGS.seed)
  rollout = rollout_lib.RolloutConfig(
      group_size=FLAGS.group_size, temperature=FLAGS.temperature,
      max_new_tokens=FLAGS.max_new_tokens, latency_scale=FLAGS.latency_scale)
  trainer = trainer_lib.TrainerConfig(
      row_len=FLAGS.row_len, rows_per_micro_batch=FLAGS.rows_per_micro_batch,
      merge=FLAGS.merge, minibatches=FLAGS.minibatches)
  schedule = sched_lib.ScheduleConfig(
      policy=FLAGS.schedule, window=FLAGS.window, max_lag=FLAGS.max_lag)
  rewards = rewards_lib.RewardConfig(
      alpha=FLAGS.reward_alpha, beta=FLAGS.reward_beta,
      gamma=FLAGS.reward_gamma, speed_min=FLAGS.speed_min,
      speed_max=FLAGS.speed_max, baseline=FLAGS.reward_baseline)
  context = FLAGS.max_context_tokens or (
      FLAGS.row_len - FLAGS.max_new_tokens if FLAGS.agent != "none"
      else whitebox.AgentConfig.max_context_tokens)
  agent = whitebox.AgentConfig(
      max_turns=FLAGS.max_turns, keep_last_turns=FLAGS.keep_last_turns,
      summarise=FLAGS.summarise, max_context_tokens=context)
  return dict(model=mcfg, train=train, rl=rl, run=run, rollout=rollout,
              trainer=trainer, schedule=schedule, agent=agent,
              rewards=rewards)


# Each saved config, its class and the flags that set its fields.
RESUMED = {"run": (loop.RLRunConfig, RUN_FLAGS),
           "train": (TrainConfig, TRAIN_FLAGS),
           "rl": (rl_step.RLConfig, RL_FLAGS),
           "rollout": (rollout_lib.RolloutConfig, ROLLOUT_FLAGS),
           "trainer": (trainer_lib.TrainerConfig, TRAINER_FLAGS),
           "schedule": (sched_lib.ScheduleConfig, SCHEDULE_FLAGS),
           "rewards": (rewards_lib.RewardConfig, REWARD_FLAGS),
           "agent": (whitebox.AgentConfig, AGENT_FLAGS)}


def _resumed_configs(workdir: str):
  path = os.path.join(workdir, loop.CONFIG_FILE)
  if not os.path.exists(path):
    raise ConfigError(f"--resume: {workdir} holds no RL run ({path} is "
                      "missing)")
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  out = {name: resume.resumed_config(
      # A run saved before it had a config of this name used its defaults.
      cls, saved.get(name, {}), train_flags.given(table),
      may_change={"run": loop.RESUMABLE_RUN_FIELDS,
                  "train": loop.RESUMABLE_TRAIN_FIELDS}.get(name, frozenset()))
         for name, (cls, table) in RESUMED.items()}
  out["model"] = config_from_dict(ModelConfig, saved["model"])
  out["train"] = out["train"].replace(
      steps=out["run"].steps * out["trainer"].minibatches)
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes
  mesh, settings = run_flags.from_flags()
  init = None
  if FLAGS.resume:
    configs = _resumed_configs(FLAGS.workdir)
    init = loop.resumed_init(FLAGS.workdir, configs["model"], FLAGS.init)
  else:
    if FLAGS.init is not None:
      init = sft.load_init(FLAGS.init)
      mcfg = init.model_config
    else:
      mcfg = get_preset(FLAGS.preset)
    configs = _fresh_configs(mcfg)
  mcfg = configs["model"].replace(settings=settings)
  engine = EngineConfig(max_batch=FLAGS.max_batch, num_pages=FLAGS.num_pages,
                        mtp_draft=FLAGS.mtp_draft,
                        page_size=FLAGS.page_size)
  summary = loop.run(
      mcfg, configs["train"], configs["run"], FLAGS.workdir,
      rl_config=configs["rl"], rollout_config=configs["rollout"],
      trainer_config=configs["trainer"], schedule_config=configs["schedule"],
      reward_config=configs["rewards"], engine_config=engine,
      agent_config=configs["agent"], resume=FLAGS.resume, init=init,
      mesh=mesh)
  summary["workdir"] = FLAGS.workdir
  print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
  cli.run(main)
