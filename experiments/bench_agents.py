"""Rollout benchmark of the two agents (issue 16): --groups groups of
--group_size tool-task episodes submitted at once through the white-box
rollout (the engine driven in this process) and the black-box one (a
separate agent program through the recording gateway over HTTP), on one
engine; each --rounds times (the first compiles), a fresh pool each time.
Prints and writes (--out) the wall time, sessions, calls and tokens per
second, and whether every session's trajectory is in the pool exactly
once (the load target: 128 concurrent black-box sessions).

  python -m experiments.bench_agents --preset=tiny --groups=16 \\
      --group_size=8 --out=benchmarks/results/agents_cpu.json
"""

import json
import os
import tempfile

import jax
from absl import flags

from benchmarks import agent_rollouts
from experiments import cli
from m2jax import model
from m2jax.agents import whitebox
from m2jax.config import get_preset
from m2jax.data import ByteTokenizer
from m2jax.infer.engine import Engine, EngineConfig
from m2jax.rl import envs
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib

_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (random "
                              "weights: the timing, not the skill).")
_AGENTS = flags.DEFINE_list("agents", list(agent_rollouts.AGENTS),
                            "Which rollouts to time.")
flags.register_validator(
    "agents", lambda a: bool(a) and set(a) <= set(agent_rollouts.AGENTS),
    f"--agents: each must be one of {agent_rollouts.AGENTS}")
_GROUPS = flags.DEFINE_integer("groups", 16, "Groups submitted at once.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Episodes per group.")
_LEVELS = flags.DEFINE_integer("digits", 3, "multiply: digits per operand.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 160, "Tokens per call.")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 3, "Calls per episode.")
_CONTEXT = flags.DEFINE_integer("max_context_tokens", 864, "Longest prompt.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 128, "Engine: batch rows.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 4096, "Engine: KV pages.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Engine: page tokens.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Runs per agent (the first "
                               "compiles).")
_OUT = flags.DEFINE_string("out", None, "JSON results.")


def main(argv):
  del argv
  mcfg = get_preset(_PRESET.value)
  variables = model.init(mcfg, jax.random.key(0))
  engine = Engine(mcfg, variables, EngineConfig(
      max_batch=_MAX_BATCH.value, num_pages=_NUM_PAGES.value,
      page_size=_PAGE_SIZE.value), tokenizer=ByteTokenizer())
  env = envs.make("multiply", levels=(_LEVELS.value,))
  agent = whitebox.AgentConfig(max_turns=_MAX_TURNS.value,
                               max_context_tokens=_CONTEXT.value)
  rollout = rollout_lib.RolloutConfig(group_size=_GROUP_SIZE.value,
                                      max_new_tokens=_MAX_NEW.value)
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(_ROUNDS.value):
      for name in _AGENTS.value:
        with pool_lib.Pool(os.path.join(tmp, f"{name}{r}.sqlite")) as pool:
          out = agent_rollouts.run(
              name, engine, env, agent, rollout, pool,
              seqs=range(r * _GROUPS.value, (r + 1) * _GROUPS.value))
        out["round"] = r
        results.append(out)
        print(json.dumps(out), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump({"device": str(jax.devices()[0]), "results": results}, f,
                indent=2)


if __name__ == "__main__":
  cli.run(main)
