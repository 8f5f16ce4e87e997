"""MiniMax-M2 hub checkpoints in and out (SPEC §1).

  config, variables = m2jax.hf.load("path/to/MiniMax-M2")          # hub layout
  m2jax.hf.save("out/dir", config, variables, max_shard_bytes=5 << 30)

`load` reads `config.json` and one `model.safetensors` or the shards named by
`model.safetensors.index.json`; FP8 e4m3 weights with 128x128
`weight_scale_inv` blocks are dequantised (`W = float(w8) * scale[r//128,
c//128]`, edge blocks partial). It streams tensor by tensor: each stacked
[E, ...] expert array is allocated once and filled expert by expert, so the
peak is the model plus one tensor. Variables come back as host numpy arrays
(place them with `jax.device_put(variables, shardings)`).

Dtypes. `dtype=None` keeps the checkpoint's dtype: the dtype of its
unquantised weights (`model.embed_tokens.weight`), so fp32 stays fp32 and the
released bf16+FP8 checkpoint loads as bf16 (FP8 blocks are dequantised in
float32, then cast). A float8 embedding falls back to config.json's
`dtype`/`torch_dtype`, else bf16. The router gate and the expert bias are
float32 whatever `dtype` says. `config.param_dtype` reports the result.
The compute dtype follows the checkpoint's dtype too (not `dtype`): a
float32 checkpoint computes in float32, so `save` -> `load` gives the saved
model's logits exactly, and the released bf16+FP8 checkpoint computes in
bf16. `compute_dtype=` overrides it.

`save` writes the hub layout unquantised (HF transformers >= 5.18 and `load`
read it back), sharded with an index above `max_shard_bytes`, into a temp
directory renamed into place at the end. Two m2jax extensions:
  * MTP modules (none in the released checkpoint) are written under
    `mtp.{k}.` (`embed_norm.weight`, `hidden_norm.weight`, `proj.weight`
    [D, 2D], `layers.{j}.` + the decoder-layer names); HF ignores them with
    an "unexpected keys" warning, `load` reads them back.
  * A dense-FFN model (`ffn_type="dense"`) has no hub counterpart (HF's
    MiniMaxM2 is MoE in every layer): `save` refuses it.

Modules: hub_config.py (config.json <-> ModelConfig), layout.py (which hub
tensor feeds which variable), files.py (safetensors reading, FP8 blocks);
load and save live here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Iterator, Mapping

import numpy as np
from safetensors.numpy import save_file

from m2jax.config import DTYPES, ModelConfig
from m2jax.errors import ExistingPathError, MissingPathError

from m2jax.hf.files import (_FP8, _Reader, _fp8_block_size, _read_weight,
                            dequantize_fp8_blocks)
from m2jax.hf.hub_config import (CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES,
                                  INDEX_FILE, MTP_PREFIX, PARAMS, SINGLE_FILE,
                                  CheckpointError, config_from_hf, config_to_hf)
from m2jax.hf.layout import _main_tensors, _mtp_tensors

__all__ = ["CheckpointError", "config_from_hf", "config_to_hf",
           "dequantize_fp8_blocks", "load", "save"]


# ----------------------------------------------------------------------------
# load / save

def _checkpoint_dtype(reader: _Reader, hf: Mapping[str, Any]) -> np.dtype:
  name = "model.embed_tokens.weight"
  if name in reader and reader.dtype(name) not in _FP8:
    return reader.dtype(name)
  return np.dtype(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")


def _dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def _set(tree: dict, keys: tuple[str, ...], value) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def load(path: str, *, dtype=None, **config_overrides):
  """(ModelConfig, variables) of the hub-layout checkpoint in directory `path`.

  `dtype`: None keeps the checkpoint's dtype (module doc), otherwise every
  weight but the router and expert bias is cast to it. MTP modules are
  returned only where the checkpoint has them (`mtp.{k}.`); the config keeps
  config.json's num_mtp_modules. `config_overrides` set non-hub fields;
  compute_dtype defaults to the checkpoint's dtype (module doc), e.g.
  compute_dtype="bfloat16" runs a float32 checkpoint in bf16.
  """
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(config_path):
    raise MissingPathError(f"{path}: no {CONFIG_FILE} (not a hub checkpoint)")
  with open(config_path) as f:
    hf = json.load(f)
  block = _fp8_block_size(hf)
  reader = _Reader(path)
  saved = _checkpoint_dtype(reader, hf)
  target = np.dtype(dtype) if dtype is not None else saved
  if _dtype_name(target) not in DTYPES:
    raise CheckpointError(f"weights would load as {_dtype_name(target)}, not "
                          f"one of {DTYPES}: pass dtype=")
  # A float8 checkpoint's `saved` is its unquantised dtype (bf16 on the hub).
  overrides = {"compute_dtype": _dtype_name(saved), **config_overrides}
  if overrides["compute_dtype"] not in DTYPES:
    raise CheckpointError(f"the checkpoint's dtype {_dtype_name(saved)} is "
                          f"not one of {DTYPES}: pass compute_dtype=")
  config = config_from_hf(hf, param_dtype=_dtype_name(target), **overrides)

  tensors = _main_tensors(config)
  for k in range(config.num_mtp_modules):
    if f"{MTP_PREFIX}.{k}.proj.weight" in reader:
      tensors += _mtp_tensors(config, k)
  used = set()
  variables: dict[str, dict] = {PARAMS: {}}
  for t in tensors:
    want = np.float32 if t.float32 else target
    if t.stacked:
      value = np.empty(t.shape, want)
      for e, name in enumerate(t.hub_names()):
        value[e] = t.to_m2jax(_read_weight(reader, name, t.hub_shape, block))
    else:
      value = t.to_m2jax(_read_weight(reader, t.hub, t.hub_shape, block))
      value = value.astype(want)
    used.update(t.hub_names())
    _set(variables.setdefault(t.collection, {}), t.path, value)

  if not config.use_routing_bias:
    for i in range(config.num_layers):
      name = f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"
      if name in reader:
        used.add(name)
        if np.any(reader.read(name)):
          raise CheckpointError(
              f"{name!r} is non-zero but config.json says use_routing_bias="
              "false (HF would apply it, m2jax would not)")
  used |= {n + "_scale_inv" for n in used}
  unexpected = sorted(reader.names() - used)
  if unexpected:
    more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
    raise CheckpointError(f"{path}: tensors with no m2jax counterpart: "
                          f"{unexpected[:5]}{more}")
  return config, variables


def _flatten(tree, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from _flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _save_plan(config: ModelConfig, variables):
  """[(hub name, nbytes, make)] for every variable; refuses strays."""
  leaves = dict(_flatten(variables))
  tensors = _main_tensors(config)
  params = variables.get(PARAMS, {})
  for k in range(config.num_mtp_modules):
    if f"mtp_{k}" in params:
      tensors += _mtp_tensors(config, k)
  stray = set(leaves) - {(t.collection,) + t.path for t in tensors}
  extra = sorted("/".join(p) for p in stray)
  if any(p[1].startswith("mtp_") for p in stray if len(p) > 1):
    extra.append(f"(config.num_mtp_modules={config.num_mtp_modules})")
  if stray:
    raise CheckpointError(f"variables with no hub counterpart: {extra}")

  plan = []
  for t in tensors:
    key = (t.collection,) + t.path
    if key not in leaves:
      raise CheckpointError(f"variables lack {'/'.join(key)}")
    leaf = leaves[key]
    if tuple(leaf.shape) != t.shape:
      raise CheckpointError(f"variable {'/'.join(key)}: expected shape "
                            f"{t.shape}, got {tuple(leaf.shape)}")
    dtype = np.float32 if t.float32 else np.dtype(leaf.dtype)
    nbytes = math.prod(t.hub_shape) * np.dtype(dtype).itemsize
    for e, name in enumerate(t.hub_names()):
      part = (lambda leaf=leaf, e=e: np.asarray(leaf[e])) if t.stacked else (
          lambda leaf=leaf: np.asarray(leaf))
      plan.append((name, nbytes,
                   lambda t=t, part=part, dtype=dtype:
                   t.to_hub(part()).astype(dtype, copy=False)))
  if not config.use_routing_bias:   # HF always holds the buffer: write zeros
    for i in range(config.num_layers):
      plan.append((f"model.layers.{i}.block_sparse_moe.e_score_correction_bias",
                   4 * config.num_experts,
                   lambda: np.zeros((config.num_experts,), np.float32)))
  return plan


def save(path: str, config: ModelConfig, variables, *,
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
         overwrite: bool = False) -> None:
  """Write `variables` as an unquantised hub checkpoint in directory `path`.

  One `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at
  most `max_shard_bytes` (a larger single tensor gets its own shard) and
  `model.safetensors.index.json`. Atomic: written to a temp directory next
  to `path` and renamed into place. Each weight keeps its dtype.
  """
  path = os.path.abspath(path)
  if os.path.exists(path) and not overwrite:
    raise ExistingPathError(f"{path} exists (pass overwrite=True)")
  hf = config_to_hf(config)
  embedding = variables[PARAMS]["embedding"]
  hf["dtype"] = hf["torch_dtype"] = _dtype_name(np.dtype(embedding.dtype))
  plan = _save_plan(config, variables)

  shards, size = [[]], 0
  for item in plan:
    if shards[-1] and size + item[1] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += item[1]
  if len(shards) == 1:
    names = [SINGLE_FILE]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
             for i in range(len(shards))]

  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
  try:
    weight_map = {}
    for file, shard in zip(names, shards):
      save_file({name: make() for name, _, make in shard},
                os.path.join(tmp, file), metadata={"format": "pt"})
      weight_map.update({name: file for name, _, _ in shard})
    if len(shards) > 1:
      index = {"metadata": {"total_size": sum(n for _, n, _ in plan)},
               "weight_map": weight_map}
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
      json.dump(hf, f, indent=2)
    if os.path.exists(path):
      trash = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-",
                               dir=parent)
      os.rename(path, os.path.join(trash, "old"))
      os.rename(tmp, path)
      shutil.rmtree(trash)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
