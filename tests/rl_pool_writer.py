"""A rollout writer or a trainer on a data pool, for tests/test_rl_pool.py to
SIGKILL (m2jax.rl.pool; imports no jax, so it starts in a fraction of a
second).

  python tests/rl_pool_writer.py add POOL START
      adds trajectory(START), trajectory(START + 1), ... until killed,
      printing each id (flushed) once add() has returned: acknowledged
  python tests/rl_pool_writer.py train POOL BATCH
      marks the pool's untrained trajectories trained, BATCH ids per train
      step in queue order from the step after the pool's last, printing
      "ready" first and then each step once mark_trained() has returned,
      until none are left

Trajectories are big (STEPS steps of TOKENS-token states) so that a commit
takes long enough for kills to land inside it.
"""

import sys

import numpy as np

from m2jax.rl import pool

STEPS = 6
TOKENS = 40_000


def trajectory(i: int, steps: int = STEPS,
               tokens: int = TOKENS) -> pool.Trajectory:
  """The i-th trajectory, the same in every process: its arrays are drawn
  from a generator seeded by i, so every byte read back can be checked."""
  rng = np.random.default_rng(i)
  return pool.Trajectory(
      trajectory_id=f"t{i}", group_id=f"g{i // 4}", env="arithmetic",
      task_id=f"task{i // 4}", difficulty=i % 3,
      steps=tuple(pool.Step(
          state=rng.integers(0, 259, tokens, dtype=np.int32),
          action=rng.integers(0, 259, 7, dtype=np.int32),
          logprobs=-rng.random(7, dtype=np.float32), policy_version=i // 5,
          reward=float(k)) for k in range(steps)),
      reward=0.5, verification={"correct": False, "i": i}, queue_seq=i,
      submitted_at=1000.0 + i, finished_at=1001.5 + i)


def main(mode: str, path: str, number: int) -> None:
  p = pool.Pool(path)
  if mode == "add":
    for i in range(number, 10**9):
      p.add(trajectory(i))
      print(f"t{i}", flush=True)
  elif mode == "train":
    ids, last = p.untrained_ids(), p.last_train_step()
    first = 0 if last is None else last + 1  # after a killed trainer's
    print("ready", flush=True)
    for step, start in enumerate(range(0, len(ids), number), first):
      p.mark_trained(ids[start:start + number], train_step=step,
                     policy_version=step)
      print(step, flush=True)
  else:
    raise SystemExit(f"unknown mode {mode!r}: add or train")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
