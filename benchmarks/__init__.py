"""The benchmark library: what experiments/bench_*.py time and how.

Outside both libraries (experiments -> benchmarks -> m2jax -> kernels): the
kernels and the model never import it.

  timing.py               the one device timer, the one error metric, the
                          device's measured copy bandwidth
  gmm_cases.py            grouped-matmul problems, candidates and references
  tree_attention_cases.py tree-attention layouts, candidates, kernel passes
  paged_attention_cases.py decode problems over a paged KV cache, candidates
  exchange.py             one expert-parallel exchange on n GPUs, timed
  rl_samples.py           synthetic GRPO groups and agent trajectories with
                          their rollout payloads (the merged RL step's input)
  schedule_sim.py         Forge's scheduler on a virtual clock: rollout
                          slots, heavy-tailed latencies, a trainer
  tokamax_ops.py          tokamax's kernels with tile configs and q_end
                          masks: the one module using private upstream names
FLOPs are counted in m2jax/params.py. Notes and results of past runs live in
notes/ and results/.
"""
