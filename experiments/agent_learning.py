r"""Does a tiny model learn the tool task through the black-box agent as it
does through the white-box one? (issue 16's CPU learning target.)

One supervised warm start on the multiply tool task, then for each agent
(white-box: m2jax/agents/whitebox.py in this process; black-box:
agents/blackbox_agent.py through the recording gateway) and each seed the
same RL run from it: same flags, the seed picking the tasks and the
sampling (the two agents see the same tasks and seeds). Writes every run's
per-step outcome reward and the curves' mean and std over seeds per agent
to --out (and their plot next to it, .png), with the two agents compared
per 25-step window (Welch's t-test over seeds), and prints them.

  python -m experiments.agent_learning --workdir=runs/agent_learning \
      --out=benchmarks/results/agents_learning_cpu.json

--stage=warm only builds the warm start and measures it (greedy and
sampled reward on held-out tasks, saved in WORKDIR/warm/measured.json): how
much room RL has. The runs share this process's compilations
(m2jax/rl/trainer.py caches its step per config), so later runs start at
once. Every run checkpoints (--checkpoint_every) and resumes where it
stopped when started again; a finished run is read, not rerun. So the runs
can be spread over processes (one GPU each) and over several calls:

  python -m experiments.agent_learning --stage=warm ...        # once
  python -m experiments.agent_learning --agents=whitebox --seeds=0 ...
  ...                                                          # any order
  python -m experiments.agent_learning --stage=report --out=... # all runs

benchmarks/notes/agents.md says what was chosen and why (the model, the
task's size, the warm start).
"""

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import flags

from experiments import cli
from kernels.paged_attention import PagedAttentionConfig
from kernels.tree_attention import TreeAttentionConfig
from m2jax import report
from m2jax.agents import whitebox
from m2jax.config import get_preset
from m2jax.data import ByteTokenizer, chat
from m2jax.errors import UserError
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import agent_rollout
from m2jax.rl import envs
from m2jax.rl import loop
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.settings import Settings
from m2jax.train import sft
from m2jax.train import state as state_lib
from m2jax.train.checkpoint import Checkpointer, write_json
from m2jax.train.checkpoint import abstract as ckpt_abstract
from m2jax.train.metrics import read_metrics

_WORKDIR = flags.DEFINE_string("workdir", "runs/agent_learning",
                               "Holds warm/ and one run directory per arm.")
_OUT = flags.DEFINE_string("out", None, "JSON results.")
_STAGE = flags.DEFINE_enum("stage", "all", ["warm", "all", "report"],
                           "report: collect the finished and partial runs "
                           "of --agents x --seeds without training; warm: the warm "
                           "start and its measurement only.")
_AGENTS = flags.DEFINE_list("agents", ["whitebox", "blackbox"], "Arms.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds per agent.")
_FFN = flags.DEFINE_enum("ffn", "dense", ["dense", "moe"], "The tiny "
                         "preset's feed-forward: its MoE, or a dense SwiGLU "
                         "of --dense_intermediate_size (notes: why dense).")
_HIDDEN = flags.DEFINE_integer("hidden_size", None, "Model width (default: "
                               "the tiny preset's).")
_LAYERS = flags.DEFINE_integer("num_layers", None, "Layers (default: the "
                               "tiny preset's).")
_CKPT = flags.DEFINE_integer("checkpoint_every", 25, "RL steps between "
                             "checkpoints (a run resumes from its last).")
_DENSE = flags.DEFINE_integer("dense_intermediate_size", 128, "Dense FFN "
                              "width.")
_LEVELS = flags.DEFINE_string("levels", "1", "multiply: digits per operand "
                              "(comma-separated levels).")
_CALL_THINK = flags.DEFINE_string("call_reasoning", "Calculate.",
                                  "The demonstration's first think block.")
_ANSWER_THINK = flags.DEFINE_string("answer_reasoning", "Answer.",
                                    "The demonstration's last think block.")
_DEMO_CORRECT = flags.DEFINE_float(
    "demo_correct_fraction", 1.0, "multiply: the share of SFT "
    "demonstrations answering with the tool's result (the rest answer "
    "another product: the warm start learns the protocol, RL to read the "
    "result).")
_KL = flags.DEFINE_float("kl_coef", 0.0, "RL: weight of the KL to the warm "
                         "start (0: off).")
_WARM_STEPS = flags.DEFINE_integer("warm_start_steps", 150, "SFT steps.")
_WARM_LR = flags.DEFINE_float("warm_start_learning_rate", 3e-3, "SFT lr.")
_STEPS = flags.DEFINE_integer("steps", 30, "RL steps per run.")
_GROUPS = flags.DEFINE_integer("groups_per_step", 8, "Tasks per step.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Episodes per task.")
_LR = flags.DEFINE_float("learning_rate", 3e-4, "RL learning rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 5, "RL lr warmup.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per call.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 3, "Calls per episode.")
_ROW_LEN = flags.DEFINE_integer("row_len", 832, "Trainer row length (a "
                                "call's prompt may use all but "
                                "--max_new_tokens of it).")
_EVAL_TASKS = flags.DEFINE_integer("eval_tasks", 64, "Held-out tasks of the "
                                   "warm start's measurement.")


# Every episode of a step decoded in one batch (64 of up to ~830 tokens).
ENGINE = EngineConfig(max_batch=128, num_pages=4096)


def model_config():
  # XLA's attention everywhere: the tiny model computes in float32, which
  # cuDNN's attention and the GPU kernels do not take. The trainer's tree
  # rows: on a GPU XLA's dense reference; on a CPU "auto", which finds no
  # kernel there and runs the blockwise path with the tree's intervals
  # (skipping key blocks no query sees: the dense reference's T^2 work
  # made the step ~3x slower on CPU cores, benchmarks/notes/agents.md).
  tree = "auto" if jax.default_backend() == "cpu" else "xla"
  mcfg = get_preset("tiny").replace(settings=Settings(
      attention="xla", tree_attention=TreeAttentionConfig(backend=tree),
      paged_attention=PagedAttentionConfig(backend="xla"),
      gmm_backend="xla"))
  if _FFN.value == "dense":
    mcfg = mcfg.replace(ffn_type="dense",
                        dense_intermediate_size=_DENSE.value)
  if _HIDDEN.value is not None:
    mcfg = mcfg.replace(hidden_size=_HIDDEN.value)
  if _LAYERS.value is not None:
    mcfg = mcfg.replace(num_layers=_LAYERS.value)
  return mcfg


def env_fields():
  return (("levels", tuple(int(x) for x in _LEVELS.value.split(","))),
          ("call_reasoning", _CALL_THINK.value),
          ("answer_reasoning", _ANSWER_THINK.value),
          ("demo_correct_fraction", _DEMO_CORRECT.value))


def configs(seed: int, agent: str, mcfg):
  run = loop.RLRunConfig(
      env="multiply", env_fields=env_fields(), agent=agent, mode="sync",
      steps=_STEPS.value, groups_per_step=_GROUPS.value,
      warm_start_steps=0, eval_tasks=0, eval_every=0,
      checkpoint_every=_CKPT.value, seed=seed)
  return dict(
      train_config=loop.train_config(mcfg, steps=_STEPS.value, seed=seed,
                                     learning_rate=_LR.value,
                                     warmup_steps=_WARMUP.value),
      run_config=run,
      rl_config=rl_step.RLConfig(mtp_depth=mcfg.num_mtp_modules,
                                 kl_coef=_KL.value),
      rollout_config=rollout_lib.RolloutConfig(
          group_size=_GROUP_SIZE.value, max_new_tokens=_MAX_NEW.value),
      trainer_config=trainer_lib.TrainerConfig(row_len=_ROW_LEN.value),
      agent_config=whitebox.AgentConfig(
          max_turns=_MAX_TURNS.value,
          max_context_tokens=_ROW_LEN.value - _MAX_NEW.value),
      engine_config=ENGINE)


def warm_start(mcfg) -> sft.Init:
  """The shared warm start (in WORKDIR/warm/warm_start; resumed when there).
  A finished one (measured.json written) is read and nothing written, so
  the runs of several processes can load it at once."""
  directory = os.path.join(_WORKDIR.value, "warm")
  tokenizer = ByteTokenizer()
  if os.path.exists(os.path.join(directory, "measured.json")):
    ckpt = Checkpointer(os.path.join(directory, loop.WARM_START_DIR,
                                     "checkpoints"), keep=1, read_only=True)
    abstract = ckpt_abstract(state_lib.create_state(
        mcfg, configs(0, "whitebox", mcfg)["train_config"]))
    state, _, _ = ckpt.restore(max(ckpt.steps()), abstract)
    return sft.Init(mcfg, state_lib.variables_of(state), tokenizer,
                    {"init": "warm start", "steps": _WARM_STEPS.value})
  env = envs.make("multiply", **dict(env_fields()))
  c = configs(0, "whitebox", mcfg)
  agent = agent_rollout.agent_for(env, c["agent_config"], tokenizer)
  agent_rollout.check_fits(env, agent, _MAX_NEW.value)
  run = dataclasses.replace(c["run_config"],
                            warm_start_steps=_WARM_STEPS.value,
                            warm_start_learning_rate=_WARM_LR.value,
                            warm_start_seq_len=_ROW_LEN.value)
  # Not sft.load_init: it rebuilds the model from the saved config, whose
  # Settings are the defaults (cuDNN attention on a GPU: no float32).
  variables = loop.warm_start(mcfg, c["train_config"], env, tokenizer, run,
                              directory, agent=agent)
  return sft.Init(mcfg, variables, tokenizer,
                  {"init": "warm start", "steps": _WARM_STEPS.value})


def measure(init: sft.Init) -> dict:
  """Greedy and sampled (temperature 1) reward of the warm start on
  held-out tasks, through the white-box agent."""
  env = envs.make("multiply", **dict(env_fields()))
  c = configs(0, "whitebox", init.model_config)
  agent = agent_rollout.agent_for(env, c["agent_config"], init.tokenizer)
  engine = Engine(init.model_config, init.variables, ENGINE,
                  tokenizer=init.tokenizer)
  rng = np.random.default_rng([99, 4])
  tasks = [env.sample(rng) for _ in range(_EVAL_TASKS.value)]
  greedy = agent_rollout.evaluate(engine, env, agent, tasks, _MAX_NEW.value)
  # Sampled: the first call as RL samples it, the rest greedy is not what
  # RL sees; run whole sampled episodes one request per episode.
  params = SamplingParams(temperature=1.0, max_tokens=_MAX_NEW.value, seed=7,
                          stop=(chat.END_OF_TURN,), include_stop_str_in_output=True)
  episodes = agent_rollout.run_episodes(engine, env, agent, tasks, params)
  verdicts = [env.verify(t, e.answer or "") for t, e in zip(tasks, episodes)]
  calls = [c for e in episodes for c in e.calls if c.results]
  good = [c for c in calls if not any(r.error for r in c.results)]
  return {"greedy_reward": greedy,
          "sampled_reward": float(np.mean([v.reward for v in verdicts])),
          "sampled_valid_call_fraction": len(good) / max(len(episodes), 1),
          "examples": [e.history[1:] for e in episodes[:2]]}


def main(argv):
  del argv
  mcfg = model_config()
  measured = os.path.join(_WORKDIR.value, "warm", "measured.json")
  if _STAGE.value == "report":
    if not os.path.exists(measured):
      raise UserError(f"--stage=report: no warm start in "
                          f"{_WORKDIR.value} (run --stage=warm first)")
    init, warm = None, _read_json(measured)
  else:
    started = time.time()
    init = warm_start(mcfg)
    warm_s = time.time() - started
    if os.path.exists(measured):  # measured once, by whichever came first
      warm = _read_json(measured)
    else:
      warm = measure(init)
      warm["seconds"] = warm_s
      _write_json(measured, warm)
    print(json.dumps({"warm_start": warm}, default=str), flush=True)
  result = {"device": str(jax.devices()[0]), "model": mcfg.ffn_type,
            "flags": {f: flags.FLAGS[f].value for f in (
                "ffn", "hidden_size", "num_layers", "dense_intermediate_size",
                "levels", "call_reasoning", "answer_reasoning",
                "demo_correct_fraction", "kl_coef",
                "warm_start_steps", "warm_start_learning_rate", "steps",
                "groups_per_step", "group_size", "learning_rate",
                "warmup_steps", "max_new_tokens", "max_turns", "row_len")},
            "warm_start": warm, "runs": []}
  if _STAGE.value != "warm":
    for agent in _AGENTS.value:
      for seed in map(int, _SEEDS.value):
        workdir = os.path.join(_WORKDIR.value, f"{agent}-s{seed}")
        t0 = time.time()
        summary = {}
        if _STAGE.value == "all" and len(_rows(workdir)) < _STEPS.value:
          # A started run resumes (from its newest checkpoint, or from the
          # warm start again if it wrote none); --steps may grow.
          resume = os.path.exists(os.path.join(workdir, "config.json"))
          summary = loop.run(mcfg, workdir=workdir, init=init, progress=True,
                             resume=resume, **configs(seed, agent, mcfg))
        rows = _rows(workdir)
        if not rows:
          continue  # --stage=report: not started yet
        run = {"agent": agent, "seed": seed, "steps": len(rows),
               "seconds_this_call": time.time() - t0,
               "reward": [r["reward_mean"] for r in rows],
               "return": [r["return_mean"] for r in rows],
               "logp_gap": [r.get("policy/logp_gap") for r in rows],
               "entropy": [r["entropy"] for r in rows],
               "pool": summary.get("pool")}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        if _OUT.value:
          write(result)
    result["curves"] = report.agent_curves(result["runs"])
  if _OUT.value:
    write(result)


def _rows(workdir: str) -> list[dict]:
  """The run's per-step metrics (none before it starts)."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return []
  return read_metrics(workdir)


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json(path: str, obj) -> None:
  """write_json of `obj` with what JSON cannot hold as its str()."""
  write_json(path, json.loads(json.dumps(obj, default=str)))


def write(result) -> None:
  _write_json(_OUT.value, result)
  if result.get("runs"):
    report.plot_agent_curves(result,
                             os.path.splitext(_OUT.value)[0] + ".png")


if __name__ == "__main__":
  cli.run(main)
