"""Flags every training script shares: the mesh, multi-host, and Settings.

  run_flags.define()                       # at import of the script
  ...
  def main(argv):
    mesh, settings = run_flags.from_flags()  # before anything touches a device
    model_config = preset.replace(settings=settings)

One path from each flag to its use: `from_flags` turns the flags into an
m2jax.settings.Settings (how a step runs), which the model config carries
to the layer that reads it, e.g.

  --moe_capacity_factor=1.5  ->  Settings.capacity_factor
                             ->  m2jax/model/moe.py (the expert exchange)

`from_flags` also extends XLA_FLAGS (the ragged all-to-all decomposer) and
initialises the multi-host runtime, both of which must happen before JAX
touches a device. Only `main` functions call it; nothing here writes flags.
"""

import os

import jax
from absl import flags, logging

from kernels import gmm_mosaic
from kernels.tree_attention import TreeAttentionConfig
from m2jax import settings as settings_lib
from m2jax import sharding

FLAGS = flags.FLAGS

# XLA's decomposition of ragged_all_to_all into ordinary collectives: with
# jax 0.11.2 the default GPU ragged all-to-all ran at 7.5 GB/s per GPU on
# 4 x H200, the decomposed one at 46 (benchmarks/notes/scaling.md).
RAGGED_DECOMPOSER_FLAG = (
    "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true")


def define(flag_values: flags.FlagValues = FLAGS, **defaults) -> None:
  """Define the mesh, multi-host and Settings flags (absl) in `flag_values`.

  `defaults` are a script's own defaults for some of them, e.g.
  define(moe_capacity_factor=1.5) (experiments/bench_scaling.py).
  """
  d = dict(flag_values=flag_values)
  before = set(flag_values)
  flags.DEFINE_string(
      "mesh", "", "Device mesh AXIS=SIZE,... over data, fsdp, sequence, "
      "expert, tensor (e.g. data=2,fsdp=2,expert=2,tensor=1; sizes multiply "
      "to the number of devices of all hosts; sequence=N splits every row "
      "into N parts, for rows longer than one device holds). Empty: no mesh "
      "(one device).", **d)
  # Settings (m2jax/settings.py): how a step runs, never what it computes.
  flags.DEFINE_enum("attention", "auto", list(settings_lib.ATTENTIONS),
                    "Attention of ordinary rows: tree (mask-free kernels, "
                    "full layers), blockwise (XLA flash, no [T, T] array), "
                    "cudnn or xla (dense [T, T] mask), or auto (tree on a "
                    "GPU; m2jax.model.attention.attention_impl).", **d)
  flags.DEFINE_string(
      "tree_attention", "auto", "Prefix-tree attention kernels: auto, xla, "
      "mosaic, triton, or tiles as mosaic:BK.BK_DQ.BQ_DKV.STAGES "
      "(kernels.tree_attention.TreeAttentionConfig.from_string).", **d)
  flags.DEFINE_string("gmm_backend", "auto", "Experts' grouped matmul: auto, "
                      "xla (ragged_dot) or mosaic (Hopper); triton runs only "
                      "interpreted (Settings.interpret, CPU tests).", **d)
  flags.DEFINE_string("gmm_tiles", "", "Mosaic grouped-matmul tiles "
                      "TILE_N.TILE_K.STAGES for every shape (empty: the "
                      "widest tile that fits each shape).", **d)
  flags.DEFINE_float(
      "moe_capacity_factor", 0.0, "Expert-parallel receive buffer in "
      "multiples of a device's average rows (T*K); 0 = the worst case, so "
      "no token is ever dropped (moe/dropped counts drops otherwise).", **d)
  flags.DEFINE_enum("all_to_all", "auto", list(settings_lib.ALL_TO_ALLS),
                    "Expert-parallel exchange: allgather (tokens gathered "
                    "over the expert axis, sums reduce-scattered back), "
                    "ragged_all_to_all, its dense emulation, or fixed "
                    "per-peer slabs sized by --moe_capacity_factor (auto: "
                    "allgather; dense on CPU).", **d)
  flags.DEFINE_integer("exchange_chunks", 1, "Independent expert exchanges "
                       "per device and layer (overlap all-to-all and "
                       "grouped matmuls).", **d)
  flags.DEFINE_bool("remat", False, "Recompute each block's activations in "
                    "the backward pass (less activation memory).", **d)
  flags.DEFINE_bool("sequence_balance", False, "Under a mesh 'sequence' "
                    "axis, each device attends for an early and a late "
                    "chunk of the row (zig-zag), evening out causal rows.",
                    **d)
  flags.DEFINE_integer(
      "loss_chunk", settings_lib.DEFAULT_LOSS_CHUNK, "Positions per row "
      "for which lm_head and cross-entropy run at once (never [B, T, V] "
      "float32 logits); 0 = whole rows.", **d)
  flags.DEFINE_enum(
      "loss_impl", settings_lib.DEFAULT_LOSS_IMPL, settings_lib.LOSS_IMPLS,
      "How the chunked loss gets its gradient: 'fused' in the forward's "
      "chunk loop, 'recompute' by recomputing each chunk's logits in the "
      "backward.", **d)
  flags.DEFINE_bool("ragged_decomposer", True,
                    "With expert parallelism over ragged_all_to_all, add "
                    f"{RAGGED_DECOMPOSER_FLAG} to XLA_FLAGS (6.2x faster "
                    "exchange on 4 x H200 with jax 0.11.2; "
                    "benchmarks/notes/scaling.md).", **d)
  # Multi-host.
  flags.DEFINE_bool("distributed", False,
                    "Multi-host: call jax.distributed.initialize (auto-detects "
                    "SLURM / Open MPI unless the three flags below are given).", **d)
  flags.DEFINE_string("coordinator_address", None,
                      "Multi-host: host:port of process 0.", **d)
  flags.DEFINE_integer("num_processes", None, "Multi-host: process count.", **d)
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's id.", **d)
  flags.DEFINE_integer(
      "heartbeat_timeout", sharding.HEARTBEAT_TIMEOUT_S,
      "Multi-host: seconds without heartbeats after which a process counts "
      "as dead and the coordinator ends every other process.", **d)
  ours = set(flag_values) - before
  for name, value in defaults.items():
    if name not in ours:
      raise ValueError(f"run_flags.define: {name!r} is not one of its flags "
                       f"{sorted(ours)}")
    flag_values.set_default(name, value)


def xla_flags_for(mesh_spec: str, all_to_all: str, decomposer: bool,
                  xla_flags: str = "") -> str:
  """XLA_FLAGS for a run: `xla_flags` plus the ragged all-to-all decomposer
  when experts are split over devices and the exchange is ragged; a value
  the user set wins."""
  experts_split = bool(mesh_spec) and sharding.parse_mesh(mesh_spec)[
      "expert"] > 1
  wanted = (decomposer and experts_split and all_to_all == "ragged"
            and "ragged_all_to_all_decomposer" not in xla_flags)
  return f"{xla_flags} {RAGGED_DECOMPOSER_FLAG}".strip() if wanted else xla_flags


def _gmm_tiles(text: str):
  if not text:
    return None
  try:
    tile_n, tile_k, stages = (int(x) for x in text.split("."))
  except ValueError:
    raise settings_lib.SettingsError(
        f"--gmm_tiles: expected TILE_N.TILE_K.STAGES, got {text!r}") from None
  try:
    return gmm_mosaic.TileConfig(tile_n=tile_n, tile_k=tile_k, stages=stages)
  except ValueError as e:
    raise settings_lib.SettingsError(f"--gmm_tiles: {e}") from None


def _tree_attention(text: str) -> TreeAttentionConfig:
  try:
    return TreeAttentionConfig.from_string(text)
  except ValueError as e:
    raise settings_lib.SettingsError(f"--tree_attention: {e}") from None


def settings_from_flags(
    flag_values: flags.FlagValues = FLAGS) -> settings_lib.Settings:
  """The Settings the flags ask for."""
  f = flag_values
  return settings_lib.Settings(
      attention=f.attention,
      tree_attention=_tree_attention(f.tree_attention),
      gmm_backend=f.gmm_backend,
      gmm_tiles=_gmm_tiles(f.gmm_tiles),
      all_to_all=f.all_to_all,
      capacity_factor=f.moe_capacity_factor,
      exchange_chunks=f.exchange_chunks,
      remat=f.remat,
      sequence_balance=f.sequence_balance,
      loss_chunk=f.loss_chunk,
      loss_impl=f.loss_impl)


def extend_xla_flags(mesh_spec: str, all_to_all: str,
                     decomposer: bool) -> bool:
  """Extend XLA_FLAGS as xla_flags_for says (before JAX touches a device);
  True if it changed."""
  old = os.environ.get("XLA_FLAGS", "")
  new = xla_flags_for(mesh_spec, all_to_all, decomposer, old)
  if new != old:
    os.environ["XLA_FLAGS"] = new
  return new != old


def from_flags(flag_values: flags.FlagValues = FLAGS):
  """(mesh or None, Settings) from the flags of `define` in `flag_values`.

  Call it in `main` before anything touches a device: it may extend
  XLA_FLAGS (--ragged_decomposer) and initialise the multi-host runtime.
  """
  f = flag_values
  settings = settings_from_flags(f)  # bad values fail before any work
  extended = extend_xla_flags(f.mesh, f.all_to_all, f.ragged_decomposer)
  if f.distributed or f.coordinator_address is not None:
    sharding.initialize_distributed(
        f.coordinator_address, f.num_processes, f.process_id,
        heartbeat_timeout_s=f.heartbeat_timeout)
  mesh = sharding.make_mesh(f.mesh) if f.mesh else None
  check_exchange(settings, mesh)
  if extended:  # said once the run is known to go ahead
    logging.warning("XLA_FLAGS += %s (--noragged_decomposer to leave it out)",
                    RAGGED_DECOMPOSER_FLAG)
  return mesh, settings


def check_exchange(settings: settings_lib.Settings, mesh) -> None:
  """Refuse the ragged exchange where XLA cannot run it: on CPU it fails
  only at the first step, with XLA's raw UNIMPLEMENTED error."""
  if (settings.all_to_all == "ragged" and mesh is not None
      and mesh.shape["expert"] > 1 and jax.default_backend() == "cpu"):
    raise settings_lib.SettingsError(
        "--all_to_all=ragged needs a GPU (XLA's CPU backend has no "
        "ragged_all_to_all); on CPU use --all_to_all=dense (what auto picks "
        "there) or --all_to_all=slabs")
