"""Greedy decoding without a KV cache (short samples at the end of a run).

The sequence lives in a fixed [1, prompt + new] buffer; each step runs the
causal model over the buffer and reads the logits at the last filled
position. Causality makes the not-yet-filled tail irrelevant, so one compiled
function serves every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m2jax import model
from m2jax.config import ModelConfig


@functools.partial(jax.jit, static_argnums=(0, 3))
def _greedy(config: ModelConfig, variables, buffer_1xL, prompt_len: int):
  L = buffer_1xL.shape[1]

  def body(t, buf):
    logits = model.logits(config, variables, buf)
    nxt = jnp.argmax(logits[0, t - 1]).astype(buf.dtype)
    return buf.at[0, t].set(nxt)

  return jax.lax.fori_loop(prompt_len, L, body, buffer_1xL)


def greedy(config: ModelConfig, variables, prompt_ids, max_new_tokens: int):
  """Prompt followed by `max_new_tokens` greedy tokens, as a 1-D int array."""
  prompt = jnp.asarray(prompt_ids, jnp.int32).reshape(-1)
  if prompt.size == 0:
    raise ValueError("greedy: the prompt must hold at least one token")
  buf = jnp.zeros((1, prompt.size + max_new_tokens), jnp.int32)
  buf = buf.at[0, :prompt.size].set(prompt)
  return _greedy(config, variables, buf, int(prompt.size))[0]
