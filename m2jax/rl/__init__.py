"""Forge, the agent-native RL side (SPEC §3): the loop, its parts, the
policy objectives and prefix-tree merging.

  loop.py         the RL run: warm start, sync or async rollouts and
                  training, weight sync, checkpoints, exact resume
                  (python -m experiments.rl)
  rollout.py      the engine's GRPO groups, simulated environment latency,
                  verification, one pool transaction per group
  agent_rollout.py  the same for tool tasks: groups of white-box agent
                  episodes, one pool step per model call
  blackbox_rollout.py  the same through the gateway: groups of sessions of
                  a separate agent program (agents/blackbox_agent.py)
  pool.py         the data pool: trajectories in SQLite (WAL), what trained
                  on which version, rollback on resume
  gateway.py      the OpenAI server recording black-box agents' sessions
                  (a session header) as prefix-tree trajectories, committed
                  to the pool when verified (python -m experiments.serve
                  --record)
  scheduler.py    which finished rollouts the trainer takes: windowed FIFO,
                  strict FIFO, greedy; the policy-lag cap and its bound
  trainer.py      trajectories -> prefix-tree-merged rows -> the RL step
  rewards.py      the composite reward (process, speed, outcome), its
                  reward-to-go and per-step group-relative advantages
  envs/           environments with verifiers, demonstrations and latency
                  models: arithmetic, sorting, multiply (a tool task)
  cispo.py        the CISPO policy loss (the default objective)
  objectives.py   token weights (per group, per sequence, per batch),
                  group-relative advantages, the PPO-clip baselines GRPO
                  and DAPO, DAPO's dynamic sampling, the k3 KL to a
                  reference policy, the policy's entropy
  prefix_tree.py  merge samples sharing prefixes into packed trees and gather
                  per-token outputs back to each sample
  step.py         the merged RL step: micro-batches of packed rows, the loss
                  (CISPO, GRPO or DAPO + optional KL and MTP) in sample
                  layout, reference log-probs on the same rows, the train
                  step
"""
