"""Checkpointer housekeeping (resuming is tests/test_resume.py)."""

import os
import shutil

import numpy as np
import orbax.checkpoint as ocp

from m2jax.train.checkpoint import Checkpointer


def test_opening_removes_the_unfinished_steps_of_a_killed_run(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ck = Checkpointer(directory, keep=3)
  ck.save(1, {"w": np.arange(4.0)}, {"next_document": 3}, {"step": 1})
  ck.close()
  # What a run killed while writing step 2 leaves: orbax's temporary
  # directory, never renamed to "2".
  tmp = os.path.join(directory, f"2{ocp.path.step.TMP_DIR_SUFFIX}-1234")
  shutil.copytree(os.path.join(directory, "1"), tmp)
  assert ocp.path.step.all_temporary_paths(directory)
  ck = Checkpointer(directory, keep=3)
  # Gone once the Checkpointer exists (no background thread left running).
  assert sorted(os.listdir(directory)) == ["1"]
  assert ck.steps() == [1]
  ck.close()
