"""Meshes, logical rules and expert parallelism.

The multi-device checks run tests/sharding_check.py once, in its own process
with 8 fake CPU devices (the rest of the suite keeps one device), and assert
on the differences it reports: sharded forward, loss and gradients against
one device for three meshes (and the slab exchange); the same on rows
split over "sequence" (context parallelism); the training loop on
a fourth (data=2,fsdp=2,expert=2: its losses, parameters after two steps,
expert bias and drops against one device); a checkpoint
restored onto another mesh; MTP growth's MTP-only phase on a mesh, its run
read back on one device; the drop counter; the exchange against its numpy
reference (the plan alone, on one device: tests/test_expert_parallel.py).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model, sharding
from m2jax.eval import runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


# One process -----------------------------------------------------------------


def test_mesh_flag_parsing_and_errors():
  assert sharding.parse_mesh("data=2, expert=4") == {
      "data": 2, "fsdp": 1, "sequence": 1, "expert": 4, "tensor": 1}
  assert sharding.parse_mesh("sequence=8")["sequence"] == 8
  assert sharding.parse_mesh("") == dict.fromkeys(sharding.AXES, 1)
  with pytest.raises(sharding.MeshError, match=r"8 devices .* but 1 devices"):
    sharding.make_mesh("data=2,fsdp=2,expert=2,tensor=1")
  for bad in ("pipeline=2", "data=2,data=2", "data:2", "data=0"):
    with pytest.raises(sharding.MeshError):
      sharding.parse_mesh(bad)
  mesh = sharding.make_mesh("tensor=1")
  assert mesh.axis_names == sharding.AXES and mesh.size == 1


def test_check_mesh_names_the_field():
  mesh = jax.sharding.AbstractMesh((1, 1, 1, 3, 1), sharding.AXES)
  with pytest.raises(sharding.MeshError, match="num_experts=8 .* expert=3"):
    sharding.check_mesh(config_lib.TINY, mesh)
  mesh = jax.sharding.AbstractMesh((3, 1, 1, 1, 1), sharding.AXES)
  with pytest.raises(sharding.MeshError, match=r"batch_size=8 .*=3"):
    sharding.check_mesh(config_lib.TINY, mesh, batch_size=8)
  # Context parallelism splits every row into equal parts.
  mesh = jax.sharding.AbstractMesh((1, 1, 8, 1, 1), sharding.AXES)
  sharding.check_mesh(config_lib.TINY, mesh, batch_size=8, seq_len=64)
  with pytest.raises(sharding.MeshError,
                     match=r"seq_len=60 .* sequence=8 \(data=1,fsdp=1,"):
    sharding.check_mesh(config_lib.TINY, mesh, batch_size=8, seq_len=60)


def test_rules_cover_every_logical_name():
  rules = dict(sharding.LOGICAL_RULES)
  names = set()
  for cfg in (config_lib.TINY, config_lib.TINY.replace(
      ffn_type="dense", dense_intermediate_size=32)):
    for spec in jax.tree.leaves(model.logical_axes(cfg),
                                is_leaf=lambda x: isinstance(x, jax.P)):
      names.update(n for n in spec if n is not None)
  names |= {"act_batch", "act_length", "act_embed", "act_heads",
            "act_kv_heads", "act_vocab", "act_tokens"}
  assert names <= set(rules), names - set(rules)
  mesh_axes = {a for v in rules.values() if v
               for a in ((v,) if isinstance(v, str) else v)}
  assert mesh_axes <= set(sharding.AXES)
  # Experts over "expert", their FFN dim over "tensor", tokens over every
  # axis but "tensor": [B * T] flattened, the row's length part last.
  assert rules["expert"] == "expert" and rules["expert_mlp"] == "tensor"
  assert rules["act_tokens"] == ("data", "fsdp", "expert", "sequence")
  assert rules["act_length"] == "sequence"


# Eight fake devices, one subprocess ------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  mtp_growth_dir = str(tmp_path_factory.mktemp("sharded") / "mtp_only")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      "--xla_force_host_platform_device_count=8 "
      # Compile time dominates on CPU; the arrays are tiny.
      "--xla_backend_optimization_level=0 "
      "--xla_llvm_disable_expensive_passes=true"))
  # The script's own directory heads sys.path, not ROOT: without this the
  # child imports whichever m2jax is installed, not the one under test.
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "sharding_check.py"),
       mtp_growth_dir], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return {**json.loads(proc.stdout.strip().splitlines()[-1]),
          "mtp_growth_dir": mtp_growth_dir}


# data=2,fsdp=2,expert=2: test_sharded_training_loop_matches_one_device
# checks the whole train step on it (loss, gradients through the updates).
@pytest.mark.parametrize("mesh", ["data=8", "fsdp=2,expert=4",
                                  "data=2,expert=2,tensor=2",
                                  "fsdp=2,expert=4 slabs",
                                  "fsdp=2,expert=4 allgather"])
def test_sharded_forward_loss_and_grads_equal_one_device(report, mesh):
  r = report["meshes"][mesh]
  assert r["loss"] <= TOL and r["logits"] <= TOL and r["grads"] <= TOL, r
  assert r["load"] == 0 and r["dropped"] == 0, r


@pytest.mark.parametrize("mesh", ["sequence=8", "data=2,sequence=2,tensor=2",
                                  "sequence=8 tree", "sequence=8 balanced"])
def test_context_parallel_loss_and_grads_equal_one_device(report, mesh):
  # Packed rows of 2 to 5 documents crossing shard boundaries, a sliding
  # window with a sink and a full-attention MTP block, the balance loss on
  # (sharding_check.py); with tensor=2 each shard also splits its heads;
  # "tree": the MTP block's shards run the tree kernels on their query rows
  # (a GPU's path), the windowed main layer's the blockwise flash kernel;
  # "balanced": the zig-zag placement (Settings.sequence_balance), whose
  # queries and outputs are gathered too.
  r = report["context_parallel"][mesh]
  if mesh.endswith("balanced"):
    plain = report["context_parallel"]["sequence=8"]["all_gathers"]
    assert r["all_gathers"] > plain, (r, plain)
  assert r["loss"] <= TOL and r["logits"] <= TOL and r["grads"] <= TOL, r
  assert r["load"] == 0, r  # the expert-bias update sees the global load
  # The head inputs [B, T, D] (the loss reads them in chunks) stay split
  # along T.
  assert r["logits_spec"] in ("P(None, 'sequence')",
                              "P('data', 'sequence')"), r
  # Attention ran context-parallel: K, V, segment ids and positions are
  # gathered along T, and dK, dV come back by reduce-scatter (the program
  # before partitioning holds only the collectives written out; without
  # an expert axis the MoE's are all-reduces over "tensor").
  assert r["all_gathers"] >= 4 and r["reduce_scatters"] >= 2, r


def test_context_parallel_refuses_an_indivisible_row(report):
  assert report["context_parallel"]["indivisible"] == (
      "row length T=12 is not divisible by the mesh axis sequence=8: context "
      "parallelism splits every row into 8 equal parts (choose seq_len a "
      "multiple of 8)")


def test_balanced_context_parallel_refuses_rows_not_in_2n_chunks(report):
  assert report["context_parallel"]["indivisible_balanced"] == (
      "row length T=24 is not divisible by 16: Settings.sequence_balance "
      "splits every row into 2 x sequence=8 chunks (choose seq_len a "
      "multiple of 16, or --nosequence_balance)")


def test_sharded_training_loop_matches_one_device(report):
  r = report["train"]
  np.testing.assert_allclose(r["losses"], r["ref_losses"], atol=TOL)
  np.testing.assert_allclose(*r["val_loss"], atol=TOL)
  assert r["params"] <= TOL and r["bias"] == 0, r
  assert r["dropped"] == [0, 0]
  # Parameters and their Adam moments share one layout.
  assert r["param_spec"] == r["mu_spec"] == "P('fsdp', 'tensor', None)"


def test_checkpoint_restores_onto_another_mesh(report):
  r = report["checkpoint"]
  assert r["step"] == 2 and r["diff"] == 0
  assert r["w1_mesh"] == "data=1,fsdp=2,sequence=1,expert=4,tensor=1"
  assert r["w1_spec"] == "P('expert', 'fsdp', 'tensor')"


def test_mtp_growth_phase_on_a_mesh_reads_on_one_device(report):
  # MTP growth's MTP-only phase trains on a mesh (data=2,expert=4): the main
  # model stays frozen, the new module moves.
  r = report["mtp_growth"]
  assert r["step"] == 2 and np.isfinite(r["loss"])
  assert r["main_change"] == 0 and r["mtp_change"] > 1e-4, r
  # Its checkpoint, saved from 8 devices, reads on this process's one
  # device (evaluate, export) and nothing is moved aside as corrupt.
  workdir = report["mtp_growth_dir"]
  *_, variables, step = runs.load_run(workdir)
  assert step == 2 and sorted(k for k in variables["params"]
                              if k.startswith("mtp_")) == ["mtp_0", "mtp_1"]
  assert sum(float(np.sum(np.asarray(x, np.float64))) for x in
             jax.tree.leaves(variables["params"]["mtp_1"])) == pytest.approx(
                 r["mtp_1_sum"], rel=1e-12)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
  assert not os.path.exists(os.path.join(workdir, "checkpoints_corrupt"))


def test_drop_counter_counts_only_real_drops(report):
  # Zero everywhere above (worst-case buffer); a quarter of the average
  # rows per device must drop some, and the output stays finite.
  for impl in ("dense", "slabs", "allgather"):
    assert report["capacity"][impl]["dropped"] > 0, impl
    assert report["capacity"][impl]["logits_finite"], impl


def test_exchange_primitives(report):
  # The CPU emulation gives ragged_all_to_all's documented example, and the
  # GPU path (ragged_all_to_all: 2 per MoE layer forward, 2 backward; main
  # layer + MTP block) traces and differentiates.
  assert report["dense_all_to_all"] == [[1, 3, 0, 0], [2, 2, 4, 0]]
  assert report["ragged_lowering"] == 8


def test_exchange_values_with_drops(report):
  # Small buffers on skewed routing: each kept row returns through its own
  # expert, each dropped row as zeros, counted per device as a numpy model of
  # the plan predicts (slabs: first rows of each pair; dense: first arrivals).
  r = report["exchange_values"]
  for name, got in r.items():
    assert got["max_err"] <= TOL, (name, got)
    assert got["dropped"] == got["want_dropped"], (name, got)
  assert sum(r["slabs@0.5"]["dropped"]) > 0 and sum(r["dense@0.5"]["dropped"]) > 0
  assert sum(r["slabs@0.0"]["dropped"]) == 0  # worst-case slabs: dropless


def test_gather_exchange_values_with_drops(report):
  # The all-gather exchange on skewed routing: every kept pair's output,
  # weighted, in its token's sum; the pairs past a small buffer dropped and
  # counted as the numpy model says; none dropped with the worst-case
  # buffer, whose token and weight gradients equal the direct sum's.
  r = report["gather_exchange"]
  for name, got in r.items():
    assert got["max_err"] <= TOL, (name, got)
    assert got["dropped"] == got["want_dropped"], (name, got)
  assert sum(r["0.5"]["dropped"]) > 0 and sum(r["0.0"]["dropped"]) == 0
  assert r["0.0"]["grad_err"] <= TOL, r
