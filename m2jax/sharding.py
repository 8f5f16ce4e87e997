"""Meshes, the logical-axis rules, and where every array of a run lives.

One mesh over five named axes, any of them of size 1:
  data    pure data parallelism: batch split, parameters replicated;
  fsdp    batch split and parameters (their "embed" dimension) sharded,
          gathered by XLA where a layer needs them (ZeRO-3 style);
  sequence  context parallelism for rows longer than one device holds:
          every activation's length axis split, keys and values gathered
          for attention (m2jax.model.context_parallel); parameters
          replicated;
  expert  batch split outside the MoE; inside it each device owns
          E / n_expert experts and tokens travel to them by all-to-all
          (m2jax.model.expert_parallel);
  tensor  attention heads, the expert FFN dimension, the dense FFN and the
          vocabulary split (Megatron style); the batch is not split.

  mesh = make_mesh("data=2,fsdp=2,expert=2,tensor=1")   # 8 devices
  mesh = make_mesh("data=2,sequence=4")                  # 8 devices
  with use_mesh(mesh):            # traced model code sees mesh and rules
    ...
  variables = place(variables, variable_shardings(model_config, mesh))

The train state's shardings (optimizer moments follow their parameters) are
m2jax.train.state.state_shardings; the command-line flags that build a mesh
are experiments/run_flags.py.

`LOGICAL_RULES` is the single table from the model's logical axis names
(m2jax.model.layers) to mesh axes. The expert bias is replicated: every
device routes its own tokens over all experts.

Batches are split by rows only (`batch_sharding`): under "sequence" every
device of a row's group holds the row's whole token ids (4 bytes a token
per field, small beside any activation) and the model's first constraint
splits the embeddings along the length.

Multi-host runs call `initialize_distributed` first. Each process then reads
only `process_rows(mesh, batch_size)` of every global batch (the data
pipeline's `rows`), and `shard_batch` assembles the global array from those
rows; the union over processes is exactly the batch one process would read.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Callable, TypeVar

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from m2jax import model
from m2jax.model.context_parallel import SEQUENCE_AXIS
from m2jax.config import ModelConfig
from m2jax.errors import UserError

T = TypeVar("T")

# Device order: "data" and "fsdp" outermost (they may span hosts), then the
# axes whose collectives run every layer, "tensor" innermost.
AXES = ("data", "fsdp", "sequence", "expert", "tensor")
# Axes the batch (and every token-indexed activation) is split over.
BATCH_AXES = ("data", "fsdp", "expert")
# The axis every activation's length dimension is split over: SEQUENCE_AXIS
# (m2jax.model.context_parallel).

# Logical name -> mesh axes. Names are those of m2jax.model.layers.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Activations.
    ("act_batch", BATCH_AXES),
    # [B * T] flattened: rows over the batch axes, each row's length over
    # "sequence" (the reshape of [B, T] moves nothing).
    ("act_tokens", BATCH_AXES + (SEQUENCE_AXIS,)),
    ("act_length", SEQUENCE_AXIS),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    # Parameters.
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("mlp", "tensor"),
    ("router", None),
    ("norm", None),
    ("mtp_concat", None),
)


class MeshError(UserError, ValueError):
  """A mesh flag or a mesh that does not fit the devices, model or batch."""


def parse_mesh(text: str) -> dict[str, int]:
  """"data=2,fsdp=2,expert=2,tensor=1" -> sizes of all five axes (default
  1)."""
  sizes = dict.fromkeys(AXES, 1)
  seen = set()
  for item in filter(None, (s.strip() for s in text.split(","))):
    m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", item)
    if not m or m.group(1) not in AXES or m.group(1) in seen:
      raise MeshError(f"--mesh item {item!r}: expected AXIS=SIZE with AXIS one "
                      f"of {AXES}, each at most once (got {text!r})")
    if int(m.group(2)) < 1:
      raise MeshError(f"--mesh axis {m.group(1)} must be >= 1 (got {text!r})")
    seen.add(m.group(1))
    sizes[m.group(1)] = int(m.group(2))
  return sizes


def make_mesh(spec: str | dict[str, int], devices=None) -> jax.sharding.Mesh:
  """A Mesh over AXES (in that order) of `devices` (default: all).

  The product of the sizes must equal the number of devices. Axes are laid
  out with "tensor" innermost, then "expert", then "sequence", so those
  stay on the fastest links (one host's NVLink) and "data" / "fsdp" span
  hosts.
  """
  sizes = parse_mesh(spec) if isinstance(spec, str) else {
      **dict.fromkeys(AXES, 1), **spec}
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(sizes[a] for a in AXES)
  if math.prod(shape) != len(devices):
    raise MeshError(
        f"mesh {format_mesh(sizes)} has {math.prod(shape)} devices "
        f"({' x '.join(map(str, shape))}) but {len(devices)} devices are "
        f"available; the sizes must multiply to {len(devices)}")
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,)
                       * len(AXES), devices=devices)


def format_mesh(sizes) -> str:
  """"data=2,fsdp=1,sequence=1,expert=4,tensor=1" for a mesh or a dict of
  sizes."""
  if hasattr(sizes, "shape"):
    sizes = dict(sizes.shape)
  return ",".join(f"{a}={sizes.get(a, 1)}" for a in AXES)


def batch_shards(mesh) -> int:
  """Number of ways the batch is split."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_mesh(config: ModelConfig, mesh, batch_size: int | None = None,
               seq_len: int | None = None):
  """Raise MeshError naming the field that a mesh axis does not divide."""
  s = mesh.shape
  need = [("hidden_size", config.hidden_size, "fsdp"),
          ("vocab_size", config.vocab_size, "tensor"),
          ("num_heads", config.num_heads, "tensor"),
          ("num_kv_heads", config.num_kv_heads, "tensor")]
  if config.ffn_type == "moe":
    need += [("num_experts", config.num_experts, "expert"),
             ("moe_intermediate_size", config.moe_intermediate_size, "tensor")]
  else:
    need += [("dense_intermediate_size", config.dense_intermediate_size,
              "tensor")]
  for field, value, axis in need:
    if value % s[axis]:
      raise MeshError(f"ModelConfig.{field}={value} is not divisible by the "
                      f"mesh axis {axis}={s[axis]} ({format_mesh(mesh)})")
  if batch_size is not None and batch_size % batch_shards(mesh):
    raise MeshError(
        f"batch_size={batch_size} is not divisible by data*fsdp*expert="
        f"{batch_shards(mesh)} ({format_mesh(mesh)})")
  n_seq = s.get(SEQUENCE_AXIS, 1)
  if seq_len is not None and seq_len % n_seq:
    raise MeshError(f"seq_len={seq_len} is not divisible by the mesh axis "
                    f"{SEQUENCE_AXIS}={n_seq} ({format_mesh(mesh)}): context "
                    "parallelism splits every row into equal parts")


@contextlib.contextmanager
def use_mesh(mesh, rules=LOGICAL_RULES):
  """Trace model code against `mesh`: logical constraints and the
  expert-parallel MoE apply inside (how it exchanges tokens is the model
  config's `settings`). Enter it around calls of jitted functions (tracing
  happens at the first call)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


class on_mesh:  # pylint: disable=invalid-name
  """A jitted function whose calls (and `.lower`) run under `use_mesh`."""

  def __init__(self, jitted, mesh, rules=LOGICAL_RULES):
    self.jitted, self.mesh = jitted, mesh
    self._ctx = lambda: use_mesh(mesh, rules)

  def __call__(self, *args, **kwargs):
    with self._ctx():
      return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with self._ctx():
      return self.jitted.lower(*args, **kwargs)


# Placement ---------------------------------------------------------------


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  """Rows over data x fsdp x expert; every other dimension whole."""
  return NamedSharding(mesh, P(BATCH_AXES))


def _check_divisible(path, shape, sharding):
  for dim, axes in zip(shape, sharding.spec):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    if dim % n:
      raise MeshError(f"{jax.tree_util.keystr(path)}: dimension {dim} is not "
                      f"divisible by mesh axes {axes} ({n})")


def variable_shardings(config: ModelConfig, mesh, rules=LOGICAL_RULES):
  """NamedShardings of the model variables {"params", "expert_bias"}."""
  specs = model.logical_axes(config)
  shapes = jax.eval_shape(lambda: model.init(config, jax.random.key(0)))

  def one(path, spec, shape):
    sharding = NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(spec), rules)
                             if spec is not None else P())
    _check_divisible(path, shape.shape, sharding)
    return sharding

  return jax.tree_util.tree_map_with_path(
      one, specs, shapes, is_leaf=lambda x: isinstance(x, P) or x is None)


def place(tree, shardings):
  """`tree` (host or device arrays) moved onto `shardings`."""
  return jax.tree.map(_place_one, tree, shardings)


def _place_one(x, sharding):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(x, sharding)  # already global: reshard
  x = np.asarray(x) if not isinstance(x, jax.Array) else x
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])


def process_rows(mesh, batch_size: int) -> np.ndarray:
  """[R] int64: the rows of a global batch of `batch_size` rows that this
  process's devices hold under `batch_sharding(mesh)`, ascending.

  All rows with one process. Processes split over data / fsdp / expert hold
  disjoint rows; ones that differ only along `tensor` or `sequence` hold the
  same rows.
  """
  if batch_size % batch_shards(mesh):
    raise MeshError(f"batch_size={batch_size} is not divisible by data*fsdp*"
                    f"expert={batch_shards(mesh)} ({format_mesh(mesh)})")
  rows_B = np.arange(batch_size)
  held = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
  return np.unique(np.concatenate([rows_B[index[0]]
                                   for index in held.values()]))


def shard_batch(batch: dict, mesh, batch_size: int | None = None) -> dict:
  """A host batch as global arrays split by `batch_sharding(mesh)`.

  `batch` is the whole global batch (`batch_size` None: every process holds
  the same one) or this process's rows of a global batch of `batch_size`
  rows: `process_rows(mesh, batch_size)`, in that order (what the data
  pipeline yields for `rows=process_rows(...)`). Each process uploads only
  its own rows either way.
  """
  sharding = batch_sharding(mesh)
  if batch_size is None:
    return {k: _place_one(np.asarray(v), sharding) for k, v in batch.items()}
  rows_R = process_rows(mesh, batch_size)

  def one(key, local):
    local = np.asarray(local)
    if local.shape[0] != len(rows_R):
      raise MeshError(
          f"batch[{key!r}] has {local.shape[0]} rows but this process holds "
          f"{len(rows_R)} of the {batch_size} rows of a global batch "
          f"({format_mesh(mesh)})")
    # A device's rows are a slice of the global batch; `rows_R` says where
    # each of them is in `local`.
    where = lambda index: local[np.searchsorted(
        rows_R, np.arange(batch_size)[index[0]])][(slice(None),) + index[1:]]
    return jax.make_array_from_callback(
        (batch_size,) + local.shape[1:], sharding, where)

  return {k: one(k, v) for k, v in batch.items()}


# Multi-host --------------------------------------------------------------

# jax.distributed.initialize's default, in seconds: how long the coordinator
# waits for a process that stopped sending heartbeats before it ends every
# other process.
HEARTBEAT_TIMEOUT_S = 100


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           local_device_ids=None, *,
                           heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S
                           ) -> None:
  """`jax.distributed.initialize` for multi-host runs (before any JAX use).

  With no address, count or id JAX auto-detects SLURM / Open MPI / cloud
  TPU settings; otherwise give all three: host:port of process 0 (which
  serves the coordination service there), the number of processes and this
  process's id. On CPU the processes' collectives go over gloo (TCP), jax
  0.11.2's default `jax_cpu_collectives_implementation`.

  A process that dies (killed, out of memory, its host gone) stops sending
  heartbeats; within `heartbeat_timeout_s` (8 s for 10 on CPU) the
  coordination service on process 0 ends every other process with the
  one-line fatal error "Terminating process because the JAX distributed
  service detected fatal errors. This most likely indicates that another
  task died", followed by the dead task's number, instead of leaving them
  blocked in a collective. If process 0 dies, the others end at once (their
  link to the service breaks). That error is JAX's own: the hook that would
  replace it (jaxlib's `missed_heartbeat_callback`) is not reachable through
  `jax.distributed.initialize` in jax 0.11.2.
  """
  given = [coordinator_address, num_processes, process_id]
  if any(v is not None for v in given) and any(v is None for v in given):
    raise MeshError("multi-host: give all of --coordinator_address, "
                    "--num_processes and --process_id, or none of them "
                    "(auto-detect)")
  if heartbeat_timeout_s < 1:
    raise MeshError(f"multi-host: --heartbeat_timeout must be >= 1 second, "
                    f"got {heartbeat_timeout_s}")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             local_device_ids=local_device_ids,
                             heartbeat_timeout_seconds=heartbeat_timeout_s)


def primary_first(make: Callable[[], T]) -> T:
  """`make()` on process 0, then on the others once process 0 is done.

  For what process 0 creates in the shared run directory (the tokenizer)
  and the others then read rather than write at the same time.
  """
  if jax.process_count() == 1:
    return make()
  primary = jax.process_index() == 0
  if primary:
    out = make()
  multihost_utils.sync_global_devices("m2jax.primary_first")
  return out if primary else make()
