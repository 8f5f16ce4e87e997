"""tokamax's kernels as the benchmarks call them: the one module of the
repository that reads a third party's private names.

tokamax (a peer kernel library, installed only on the GPU machines) offers
`tokamax.ragged_dot` and `tokamax.dot_product_attention`, but neither takes
what the benchmarks compare against:
  - its Mosaic GPU ragged dot with an explicit tile `Config` (benchmarks/
    gmm_cases.py sweeps them; the public call picks its own);
  - flash attention under a per-key `q_end` mask (key j read by queries
    < q_end[j]: tokamax's own form of the tree-attention interval; the public
    call builds masks from per-row lengths only).
Both live in `tokamax._src`, which may move without notice. Every private
name used is spelled once in PRIVATE_NAMES and loaded by `_load`, and
tests/test_private_api.py loads each of them where tokamax is installed,
failing with the name that moved.
"""

from __future__ import annotations

import importlib

_SRC = "tokamax._src.ops."
RAGGED_DOT = _SRC + "ragged_dot.pallas_mosaic_gpu.PallasMosaicGpuRaggedDot"
RAGGED_DOT_CONFIG = _SRC + "ragged_dot.pallas_mosaic_gpu_common.Config"
ATTENTION_MASK = _SRC + "attention.base.Mask"
FLASH_ATTENTION = {
    "mosaic": _SRC + "attention.pallas_mosaic_gpu."
              "PallasMosaicGpuFlashAttention",
    "triton": _SRC + "attention.pallas_triton.PallasTritonFlashAttention",
}
PRIVATE_NAMES = (RAGGED_DOT, RAGGED_DOT_CONFIG, ATTENTION_MASK,
                 *FLASH_ATTENTION.values())


def load(name: str):
  """The object `name` ("package.module.Attribute") names."""
  module, _, attribute = name.rpartition(".")
  return getattr(importlib.import_module(module), attribute)


def ragged_dot_op(config: dict | None = None):
  """tokamax's Mosaic GPU ragged-dot op, with its tile `Config(**config)`
  (default: tokamax's own choice); pass it as `implementation=[op]`."""
  op_class = load(RAGGED_DOT)
  if config is None:
    return op_class()
  return op_class(config=load(RAGGED_DOT_CONFIG)(**config))


def flash_attention_q_end(implementation: str, q_end_Bx1xS):
  """(q, k, v) -> out: tokamax's causal flash attention ("mosaic" or
  "triton") in which key j is read by queries < q_end_Bx1xS[..., j]."""
  if implementation not in FLASH_ATTENTION:
    raise ValueError(f"tokamax flash attention: implementation must be one "
                     f"of {sorted(FLASH_ATTENTION)}, got {implementation!r}")
  op = load(FLASH_ATTENTION[implementation])()
  mask = load(ATTENTION_MASK)(q_end=q_end_Bx1xS, is_causal=True)
  return lambda q, k, v: op(q, k, v, mask=mask)
