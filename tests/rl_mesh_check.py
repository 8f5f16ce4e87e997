"""The Forge RL loop on a mesh of 4 fake CPU devices equals one device.

  python tests/rl_mesh_check.py [ONE_DEVICE_RUN]   # about a minute on 2 cores

Runs the tiny sync run of tests/test_rl_loop.py (3 steps) on the mesh
data=2,expert=2 (one run: the trainer's state and the engine's weights and
KV pages sharded as pretraining and serving shard them), and checks that it
generates the same batches as the same run on one device and ends with the
same parameters (to float32 reduction-order noise). The one-device run is
ONE_DEVICE_RUN, a directory of that run (tests/test_rl_loop.py passes the
one its tests made), or without it one run here. Its own process (the fake
devices must be set before jax starts): tests/test_rl_loop.py runs it.
"""

import os
import sys
import tempfile

# Added to the flags it inherits (the test session's fast-compile flags,
# tests/conftest.py), not in place of them.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from m2jax import sharding  # pylint: disable=wrong-import-position
from m2jax.rl import trainer as trainer_lib  # pylint: disable=wrong-import-position
import test_rl_loop as t  # pylint: disable=wrong-import-position


def _placements(seen: list):
  """Trainer.train, recording where the state's parameters live."""
  train = trainer_lib.Trainer.train

  def recorded(self, trajectories):
    seen.append([(len(x.sharding.device_set), x.sharding.is_fully_replicated)
                 for x in jax.tree.leaves(self.state.params)])
    return train(self, trajectories)
  return recorded


STEPS = 3  # test_rl_loop.py's _run_config()


def main() -> None:
  workdir = tempfile.mkdtemp()
  if len(sys.argv) > 1:
    one = sys.argv[1]
  else:
    one = os.path.join(workdir, "one")
    t._run(one, t._run_config())
  # Both axes in one mesh: one compile of the loop instead of one per axis.
  for spec in ("data=2,expert=2",):
    here = os.path.join(workdir, spec)
    seen = []
    original = trainer_lib.Trainer.train
    trainer_lib.Trainer.train = _placements(seen)
    try:
      t._run(here, t._run_config(), mesh=sharding.make_mesh(spec))
    finally:
      trainer_lib.Trainer.train = original
    # The mesh was used: every parameter on all four devices, and with
    # expert parallelism the experts' weights split between them.
    assert seen and all(n == 4 for step in seen for n, _ in step), spec
    split = sum(not replicated for step in seen for _, replicated in step)
    assert split > 0, (spec, split)
    steps = list(range(1, STEPS + 1))
    assert t._batches(one, steps) == t._batches(here, steps), spec
    (step, _, want), (got_step, _, got) = t._params(one), t._params(here)
    assert step == got_step == STEPS, (step, got_step)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(want, got))
    assert err < 1e-4, (spec, err)
    print(f"{spec}: same batches, max |parameter difference| {err:.2e}")


if __name__ == "__main__":
  main()
