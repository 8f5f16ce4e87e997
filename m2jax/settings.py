"""How a step runs: kernel backends and tiles, attention, expert exchange.

`Settings` is everything that changes how the model's math is executed but
never what it computes: which grouped-matmul and attention kernels run and
with which tiles, whether Pallas kernels are interpreted (CPU tests), how
the expert-parallel MoE exchanges tokens, and what the backward pass
recomputes. It is a frozen, hashable dataclass held by the model config
(`ModelConfig.settings`), so it is part of every jit cache key by
construction: two settings never share a compiled step.

  settings = Settings(gmm_backend="mosaic", capacity_factor=1.5)
  config = config.M2_SMALL.replace(settings=settings)
  model.forward(config, variables, tokens)     # the MoE reads
                                               # config.settings

The settings are not part of a saved model: checkpoints and hub configs
record what the model is, and each run chooses how to execute it
(`experiments/run_flags.py` builds them from the command line).

Where each field is read:
  attention        m2jax/model/attention.py (causal and sliding-window rows)
  tree_attention   m2jax/model/attention.py -> kernels/tree_attention.py
  paged_attention  m2jax/model/attention.py -> kernels/paged_attention.py
  gmm_backend, gmm_tiles
                   m2jax/model/moe.py -> kernels/gmm.py
  interpret        both kernels (Pallas interpreters on a CPU)
  all_to_all, capacity_factor, exchange_chunks
                   m2jax/model/moe.py -> m2jax/model/expert_parallel.py
  remat            m2jax/model/block.py
  sequence_balance m2jax/model/attention.py -> m2jax/model/context_parallel.py
  loss_chunk, loss_impl
                   m2jax/train/step.py -> m2jax/train/losses.py
"""

from __future__ import annotations

import dataclasses

from kernels import gmm as gmm_lib
from kernels.gmm_mosaic import TileConfig
from kernels.paged_attention import PagedAttentionConfig
from kernels.tree_attention import TreeAttentionConfig
from m2jax.errors import UserError

# Attention of ordinary (causal / sliding-window) rows; what "auto" picks and
# what each runs: m2jax.model.attention.attention_impl.
ATTENTIONS = ("auto", "xla", "cudnn", "tree", "blockwise")
# Expert-parallel exchanges (m2jax/model/expert_parallel.py).
ALL_TO_ALLS = ("auto", "ragged", "dense", "slabs", "allgather")
# Positions per lm_head / cross-entropy chunk of the train and eval steps:
# [B, 1024, V] float32 logits at a time (128 MiB a row at V = 32768).
DEFAULT_LOSS_CHUNK = 1024
# How the chunked loss gets its gradient (m2jax/train/losses.py): "fused"
# computes it in the forward's chunk loop, "recompute" recomputes each
# chunk's logits in the backward.
LOSS_IMPLS = ("fused", "recompute")
DEFAULT_LOSS_IMPL = "fused"


class SettingsError(UserError, ValueError):
  """A Settings field holds a value outside its allowed range."""


def _fail(field: str, rule: str, value) -> None:
  raise SettingsError(f"Settings.{field}: {rule} (got {value!r})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """How a step runs (see the module docstring). Defaults pick the fastest
  implementation for the device and never drop a token.

  attention: "auto" | "tree" | "blockwise" | "cudnn" | "xla", for causal
    and sliding-window rows (m2jax.model.attention.attention_impl): "tree"
    the mask-free tree kernels (tree_attention's backend and tiles; full
    layers), "blockwise" flash attention in XLA (any layer, any backend),
    "cudnn" / "xla" a dense [B, T, T] mask into cuDNN or XLA. "auto": tree
    for full layers on a GPU in bf16/fp16, else the dense mask up to 2048
    tokens (cuDNN on a GPU in half precision, else XLA), blockwise beyond.
  tree_attention: backend and tiles of the prefix-tree attention kernels
    (kernels.tree_attention.TreeAttentionConfig; backend "auto" | "xla" |
    "mosaic" | "triton"); used by full-attention layers of tree-layout rows,
    and of packed rows where `attention` resolves to "tree".
  paged_attention: backend and tiles of the decode attention over the paged
    KV cache (kernels.paged_attention.PagedAttentionConfig); generation.
  gmm_backend: the experts' grouped matmul, "auto" | "xla" | "mosaic" |
    "triton" (kernels.gmm.BACKENDS); "triton" needs interpret=True (Triton
    rejects the compiled kernel on an H100: kernels/gmm.py).
  gmm_tiles: Mosaic tile config for every grouped matmul, or None to pick
    the widest that fits each shape (kernels.gmm_mosaic.pick_config).
  interpret: run the chosen Pallas kernels in Pallas' interpreters (CPU
    tests of the kernel paths). The one switch for every kernel: it sets
    tree_attention.interpret and paged_attention.interpret, and the MoE
    passes it to the grouped matmul.
  all_to_all: expert-parallel exchange, "ragged" (ragged_all_to_all; GPU and
    TPU), "dense" (its exact emulation; any backend), "slabs" (fixed
    per-peer slabs sized by capacity_factor; NCCL's all-to-all),
    "allgather" (every device gathers the "expert" group's tokens and runs
    its experts on the rows routed to them; a reduce-scatter returns the
    sums: m2jax.model.expert_parallel.gather_exchange) or "auto"
    ("allgather", "dense" on CPU).
  capacity_factor: expert-parallel receive buffer (for "allgather": the
    rows of its local experts) in multiples of a device's average rows
    (T_local * top_k); 0 sizes it for the worst case so no token is ever
    dropped; rows past it are dropped and counted
    (RoutingStats.dropped).
  exchange_chunks: split each device's tokens into this many independent
    exchanges (when they divide), so one chunk's all-to-all can overlap
    another's grouped matmuls.
  remat: recompute each block's activations in the backward pass (saves
    activation memory).
  sequence_balance: under a mesh "sequence" axis of n devices, each device
    computes attention for two of the row's 2n chunks, an early and a late
    one (zig-zag), so a causal row's pairs split evenly instead of the last
    device holding the most; two more all-gathers a layer, rows divisible
    by 2n (m2jax.model.context_parallel).
  loss_chunk: the train and eval steps compute lm_head and cross-entropy
    this many positions of every row at a time, never holding [B, T, V]
    float32 logits (m2jax.train.losses.chunked_cross_entropy); 0 applies
    the head to the whole row (the model's logits).
  loss_impl: how the chunked loss (loss_chunk > 0) is differentiated:
    "fused" (m2jax.train.losses.fused_cross_entropy) computes each chunk's
    gradient of features and lm_head in the forward's chunk loop (one
    lm_head matmul forward, two for the gradient; d features and a float32
    d lm_head are held until the backward); "recompute"
    (chunked_cross_entropy) keeps only the features and recomputes every
    chunk's logits in the backward (one matmul more). Same loss and
    gradients up to rounding; the fused one rounds d logits to the compute
    dtype before its matmuls.
  """
  attention: str = "auto"
  tree_attention: TreeAttentionConfig = TreeAttentionConfig()
  paged_attention: PagedAttentionConfig = PagedAttentionConfig()
  gmm_backend: str = "auto"
  gmm_tiles: TileConfig | None = None
  interpret: bool = False
  all_to_all: str = "auto"
  capacity_factor: float = 0.0
  exchange_chunks: int = 1
  remat: bool = False
  sequence_balance: bool = False
  loss_chunk: int = DEFAULT_LOSS_CHUNK
  loss_impl: str = DEFAULT_LOSS_IMPL

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      _fail("attention", f"must be one of {ATTENTIONS}", self.attention)
    if not isinstance(self.tree_attention, TreeAttentionConfig):
      _fail("tree_attention", "must be a kernels.tree_attention."
            "TreeAttentionConfig", self.tree_attention)
    try:
      gmm_lib.check_backend(self.gmm_backend)
    except ValueError as e:
      raise SettingsError(f"Settings.gmm_backend: {e}") from None
    if self.gmm_backend == "triton" and not self.interpret:
      _fail("gmm_backend", "'triton' runs only with interpret=True (Triton "
            "rejects its compiled form on an H100); use 'mosaic' or 'xla'",
            self.gmm_backend)
    if self.gmm_tiles is not None and not isinstance(self.gmm_tiles,
                                                     TileConfig):
      _fail("gmm_tiles", "must be None or a kernels.gmm_mosaic.TileConfig",
            self.gmm_tiles)
    if not isinstance(self.interpret, bool):
      _fail("interpret", "must be True or False", self.interpret)
    if self.tree_attention.interpret and not self.interpret:
      _fail("tree_attention", "interpret is set by Settings.interpret, not "
            "by the tree-attention config", self.tree_attention)
    if not isinstance(self.paged_attention, PagedAttentionConfig):
      _fail("paged_attention", "must be a kernels.paged_attention."
            "PagedAttentionConfig", self.paged_attention)
    if self.paged_attention.interpret and not self.interpret:
      _fail("paged_attention", "interpret is set by Settings.interpret, not "
            "by the paged-attention config", self.paged_attention)
    # One switch for every kernel: the attention configs carry it.
    for name in ("tree_attention", "paged_attention"):
      object.__setattr__(self, name, dataclasses.replace(
          getattr(self, name), interpret=self.interpret))
    if self.all_to_all not in ALL_TO_ALLS:
      _fail("all_to_all", f"must be one of {ALL_TO_ALLS}", self.all_to_all)
    if not self.capacity_factor >= 0:
      _fail("capacity_factor", "must be >= 0", self.capacity_factor)
    if not isinstance(self.exchange_chunks, int) or self.exchange_chunks < 1:
      _fail("exchange_chunks", "must be an integer >= 1",
            self.exchange_chunks)
    if not isinstance(self.remat, bool):
      _fail("remat", "must be True or False", self.remat)
    if not isinstance(self.sequence_balance, bool):
      _fail("sequence_balance", "must be True or False",
            self.sequence_balance)
    if (not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk,
                                                           bool)
        or self.loss_chunk < 0):
      _fail("loss_chunk", "must be an integer >= 0 (0: whole rows)",
            self.loss_chunk)
    if self.loss_impl not in LOSS_IMPLS:
      _fail("loss_impl", f"must be one of {LOSS_IMPLS}", self.loss_impl)

  def replace(self, **changes) -> "Settings":
    """A copy with `changes` applied (validated again).

    A new `interpret` reaches the kernel configs too (they hold a copy of
    it), so `s.replace(interpret=False)` undoes `interpret=True`.
    """
    if isinstance(changes.get("interpret"), bool):  # else __post_init__ says
      for name in ("tree_attention", "paged_attention"):
        cfg = changes.get(name, getattr(self, name))
        if isinstance(cfg, (TreeAttentionConfig, PagedAttentionConfig)):
          changes[name] = dataclasses.replace(
              cfg, interpret=changes["interpret"])
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """A JSON-ready record of the settings (for a run's config.json)."""
    return dataclasses.asdict(self)
