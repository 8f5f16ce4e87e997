"""Reading safetensors tensor by tensor, and FP8 128x128 block dequantisation."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from m2jax.errors import MissingPathError
from m2jax.hf.hub_config import (FP8_BLOCK, INDEX_FILE, SINGLE_FILE,
                                    CheckpointError)

# ----------------------------------------------------------------------------
# Reading safetensors, tensor by tensor.

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_FP8 = (np.dtype(ml_dtypes.float8_e4m3fn),)


class _Reader:
  """Tensor-by-tensor access to a checkpoint's safetensors files.

  safetensors' numpy backend (0.8.0) cannot return float8 tensors, so this
  parses the format's header itself (8-byte length, JSON, raw little-endian
  data) and reads one tensor at a time from its byte offsets.
  """

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      weight_map, files = None, [SINGLE_FILE]
    else:
      raise MissingPathError(
          f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    self._where: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
    for name in files:
      self._where.update(self._header(os.path.join(directory, name)))
    if weight_map is not None:
      for name, file in weight_map.items():
        got = self._where.get(name)
        if got is None or os.path.basename(got[0]) != file:
          raise CheckpointError(f"{INDEX_FILE} maps {name!r} to {file!r}, "
                                "which does not hold it")

  @staticmethod
  def _header(path: str):
    with open(path, "rb") as f:
      (n,) = np.frombuffer(f.read(8), "<u8")
      header = json.loads(f.read(int(n)))
    base = 8 + int(n)
    for name, info in header.items():
      if name == "__metadata__":
        continue
      if info["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype "
                              f"{info['dtype']}")
      start, end = info["data_offsets"]
      dtype = np.dtype(_ST_DTYPES[info["dtype"]])
      shape = tuple(info["shape"])
      if end - start != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{path}: tensor {name!r} has a corrupt header")
      yield name, (path, dtype, shape, base + start)

  def names(self) -> set[str]:
    return set(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def dtype(self, name: str) -> np.dtype:
    return self._where[name][1]

  def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Tensor `name`; checks its shape against `shape` when given."""
    if name not in self._where:
      raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
    path, dtype, got, offset = self._where[name]
    if shape is not None and tuple(shape) != got:
      raise CheckpointError(f"tensor {name!r}: expected shape {tuple(shape)}, "
                            f"got {got}")
    count = math.prod(got)
    return np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count,
                       offset=offset).reshape(got)


# ----------------------------------------------------------------------------
# FP8 block quantisation.

def dequantize_fp8_blocks(w8: np.ndarray, scale_inv: np.ndarray,
                          block_size: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
  """float32 W[r, c] = float(w8[r, c]) * scale_inv[r // br, c // bc].

  `weight_scale_inv` is a multiplier despite its name (SPEC §1); edge blocks
  are partial, so scale_inv has shape [ceil(R / br), ceil(C / bc)].
  """
  (R, C), (br, bc) = w8.shape, block_size
  want = (-(-R // br), -(-C // bc))
  if scale_inv.shape != want:
    raise CheckpointError(f"weight_scale_inv: expected shape {want} for a "
                          f"{(R, C)} weight in {block_size} blocks, got "
                          f"{scale_inv.shape}")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0)[:R],
                    bc, axis=1)[:, :C]
  return w8.astype(np.float32) * scale


def _fp8_block_size(hf: Mapping[str, Any]) -> tuple[int, int] | None:
  """Block size from config.json's quantization_config (None: unquantised)."""
  qc = hf.get("quantization_config")
  if not qc:
    return None
  method = qc.get("quant_method")
  if method != "fp8":
    raise CheckpointError(
        f"config.json quantization_config.quant_method={method!r}: only 'fp8' "
        "(e4m3 with block weight_scale_inv) is supported")
  fmt = qc.get("fmt", "float8_e4m3fn")
  if fmt not in ("e4m3", "float8_e4m3fn"):
    raise CheckpointError(f"config.json quantization_config.fmt={fmt!r}: only "
                          "float8_e4m3fn is supported")
  block = tuple(qc.get("weight_block_size") or FP8_BLOCK)
  if len(block) != 2:
    raise CheckpointError(f"quantization_config.weight_block_size={block}: "
                          "expected [rows, cols]")
  return block


def _read_weight(reader: _Reader, name: str, shape, block) -> np.ndarray:
  """Hub tensor `name`, dequantised to float32 if it is stored as FP8."""
  x = reader.read(name, shape)
  if x.dtype not in _FP8:
    return x
  if block is None:
    raise CheckpointError(f"tensor {name!r} is float8 but config.json has no "
                          "quantization_config")
  scale_name = name + "_scale_inv"
  if scale_name not in reader:
    raise CheckpointError(f"{reader.directory}: missing tensor {scale_name!r} "
                          f"(the block scales of float8 {name!r})")
  return dequantize_fp8_blocks(x, reader.read(scale_name), block)
