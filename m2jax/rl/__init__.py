"""Forge, the agent-native RL side (SPEC §3): CISPO and prefix-tree merging.

  cispo.py        the CISPO token-mean policy loss, group-relative advantages
  prefix_tree.py  merge samples sharing prefixes into packed trees and gather
                  per-token outputs back to each sample
"""
