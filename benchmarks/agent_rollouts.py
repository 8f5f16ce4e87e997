"""The white-box and black-box agents' rollouts on one engine (issue 16):
the same groups of tool-task episodes through AgentRollout
(m2jax/rl/agent_rollout.py) and BlackBoxRollout
(m2jax/rl/blackbox_rollout.py: the agent program, the gateway, HTTP),
timed, and the pool checked: every session's trajectory stored exactly
once."""

from __future__ import annotations

import time

import numpy as np

from m2jax.rl import agent_rollout, blackbox_rollout
from m2jax.rl import rollout as rollout_lib

AGENTS = ("whitebox", "blackbox")


def run(agent: str, engine, env, agent_config, rollout_config, pool, *,
        seqs, seed: int = 0) -> dict:
  """Submit the groups of task numbers `seqs` at once and wait for them;
  returns the wall time, throughput and the pool check."""
  if agent == "whitebox":
    rollout = agent_rollout.AgentRollout(
        engine, env, agent_rollout.agent_for(env, agent_config,
                                             engine.tokenizer),
        pool, rollout_config, seed=seed)
  else:
    rollout = blackbox_rollout.BlackBoxRollout(
        engine, env, agent_config, pool, rollout_config, seed=seed)
  failed = []
  try:
    started = time.perf_counter()
    for seq in seqs:
      rollout.submit(seq, 0)
    while rollout.in_flight:
      rollout.poll()
      failed += rollout.take_failed()
      wait = rollout.next_ready_in()
      if wait and not engine.has_work():
        time.sleep(wait)
    seconds = time.perf_counter() - started
    rows = (rollout.engine_loop.stats["max_rows"] if agent == "blackbox"
            else None)
  finally:
    rollout.close()
  G = rollout_config.group_size
  expected = sorted(tid for seq in seqs for tid in rollout_lib.trajectory_ids(
      rollout_lib.group_id(seq), G))
  stored = pool.untrained()
  calls = sum(len(t.steps) for t in stored)
  tokens = sum(len(s.action) for t in stored for s in t.steps)
  return {
      "agent": agent, "groups": len(seqs), "sessions": len(expected),
      "seconds": seconds, "sessions_per_s": len(expected) / seconds,
      "calls": calls, "calls_per_s": calls / seconds,
      "tokens_per_s": tokens / seconds, "failed_groups": len(failed),
      "reward_mean": float(np.mean([t.reward for t in stored] or [np.nan])),
      "exactly_once": (sorted(t.trajectory_id for t in stored) == expected
                       and pool.counts()["finished"] == len(expected)),
      "max_rows": rows}
