"""Forge, the agent-native RL side (SPEC §3): the policy objectives and
prefix-tree merging.

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
