"""Tree-attention benchmark cases (used by experiments/bench_prefix_tree.py).

Tree layouts, the candidates wrapped to one calling convention and our
kernels one by one (the timer and the error metric are benchmarks/timing.py,
FLOPs m2jax/params.py, counting live entries only). A candidate is
`(q, k, v, do) -> out` (forward) or `-> (out, dq, dk, dv)` (forward+backward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import tokamax_ops
from kernels import tree_attention as ta


def grpo_subtree_end(prompt: int, responses: int, response_len: int):
  """One GRPO group in DFS order: [prompt, r_1, ..., r_G] -> [1, T] int32."""
  T = prompt + responses * response_len
  se = np.full(T, T, np.int32)
  for g in range(responses):
    a = prompt + g * response_len
    se[a:a + response_len] = a + response_len
  return se[None]


def _fwdbwd(attn):
  def f(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out,) + vjp(do)
  return f


def ours(subtree_end, config=None, backward=False):
  se = jnp.asarray(subtree_end)
  attn = lambda q, k, v: ta.tree_attention(q, k, v, se, config=config)
  return _fwdbwd(attn) if backward else (lambda q, k, v, do: attn(q, k, v))


def cudnn_causal(backward=False):
  attn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn")
  return _fwdbwd(attn) if backward else (lambda q, k, v, do: attn(q, k, v))


def tokamax_q_end(subtree_end, implementation: str, backward=False):
  """tokamax's flash attention with a per-key q_end mask (its own form of
  the same interval: key j is read by queries < q_end[j], causal)."""
  attn = tokamax_ops.flash_attention_q_end(
      implementation, jnp.asarray(subtree_end)[:, None, :])
  return _fwdbwd(attn) if backward else (lambda q, k, v, do: attn(q, k, v))


def reference(subtree_end, backward=False):
  se = jnp.asarray(subtree_end)
  attn = lambda q, k, v: ta.tree_attention_reference(
      *(x.astype(jnp.float32) for x in (q, k, v)), se).astype(q.dtype)
  return _fwdbwd(attn) if backward else (lambda q, k, v, do: attn(q, k, v))


def inputs(T, num_heads, num_kv_heads, head_dim, dtype=jnp.bfloat16, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (1, T, num_heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (1, T, num_kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (1, T, num_kv_heads, head_dim), dtype)
  do = jax.random.normal(keys[3], (1, T, num_heads, head_dim), dtype)
  return q, k, v, do


def kernel_passes(subtree_end, cfg, q, k, v, do):
  """The three kernels of one backend as separate jitted calls, for a time
  split: {"fwd" | "dq" | "dkv": (fn, args, matmuls)}, where `matmuls`
  is the number of products each live entry costs in that kernel as written
  (fwd 2; dq 3 and dk/dv 4, as they recompute the scores): its FLOPs with
  recomputation are m2jax.params.attention_product_flops(live, N, H,
  matmuls). (The masked entries of partial tiles, also computed, are not
  counted.)
  """
  B, T, N, H = q.shape
  cfg = ta._resolve_backend(cfg, (q.dtype, k.dtype, v.dtype), H)  # pylint: disable=protected-access
  if T % cfg.pad_multiple:
    raise ValueError(f"T={T} must be a multiple of {cfg.pad_multiple}")
  se = jnp.asarray(subtree_end, jnp.int32)
  seg = jnp.zeros_like(se)
  scale = float(H ** -0.5)
  fwd_l, dq_l, dkv_l = (cfg.lists(se, seg, n) for n in ("fwd", "dq", "dkv"))
  fwd, dq, dkv = (jax.jit(functools.partial(f, scale=scale, cfg=cfg))
                  for f in ta._KERNELS[cfg.backend])  # pylint: disable=protected-access
  out, lse = fwd(q, k, v, se, seg, *fwd_l)
  bwd_args = (q, k, v, do, lse, ta.softmax_delta(out, do), se, seg)
  return {"fwd": (fwd, (q, k, v, se, seg, *fwd_l), 2),
          "dq": (dq, bwd_args + tuple(dq_l), 3),
          "dkv": (dkv, bwd_args + tuple(dkv_l), 4)}
