"""Forge, the agent-native RL side (SPEC §3): CISPO and prefix-tree merging.

  cispo.py        the CISPO policy loss with per-group (or whole-batch) token
                  weights, group-relative advantages
  prefix_tree.py  merge samples sharing prefixes into packed trees and gather
                  per-token outputs back to each sample
  step.py         the merged RL step: micro-batches of packed rows, the loss
                  (CISPO + optional MTP) in sample layout, the train step
"""
