"""Per-request sampling: temperature, top-k, top-p, seeds, and log-probs.

Every request carries its own SamplingParams; a decode step samples all rows
of a batch at once from per-row parameter arrays (`SamplingArrays`), so
requests with different settings share one compiled step.

The log-prob returned with each token is log q(token), where q is the
distribution the token was sampled from:

  q = softmax(logits / temperature), restricted to the top_k highest
      logits (top_k > 0) and then to the smallest set of highest-probability
      tokens whose mass reaches top_p (top_p < 1), renormalised.

That is the behaviour log-prob RL needs (pi_old of the tokens actually
sampled). Greedy rows (temperature 0) take the argmax and report its
log-prob under softmax(logits), the temperature-1 distribution: a point mass
would say nothing. Ties at the top-k / top-p threshold keep every tied
token.

Randomness is per request and per token: row b's key for its i-th sampled
token is fold_in(key(seed_b), i), so a request's output depends on its seed
and never on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m2jax.errors import UserError

_NEG = -1e30


class SamplingError(UserError, ValueError):
  """A sampling parameter outside its allowed range."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples (OpenAI's names where they exist).

  temperature: 0 is greedy; > 0 scales the logits.
  top_k: keep the k highest logits (0: all).
  top_p: nucleus sampling mass (1: all).
  seed: the request's random seed (None: drawn by the engine).
  max_tokens: new tokens at most (per sample).
  stop_token_ids: tokens that end a sample (kept in its output? no: the
    stop token is not returned, its reason is "stop").
  stop: strings that end a sample; the text is cut before the first one.
  n: independent samples of the prompt (they share its KV pages).
  include_stop_str_in_output: keep the stop string's tokens (and their
    log-probs) at the end of the output instead of cutting before it (vLLM's
    name): RL trains on the end-of-turn marker the policy emitted.
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  max_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  n: int = 1
  include_stop_str_in_output: bool = False

  def __post_init__(self):
    def fail(field, rule):
      raise SamplingError(f"SamplingParams.{field}: {rule} (got "
                          f"{getattr(self, field)!r})")
    if not self.temperature >= 0:
      fail("temperature", "must be >= 0")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      fail("top_k", "must be an integer >= 0")
    if not 0 < self.top_p <= 1:
      fail("top_p", "must be in (0, 1]")
    if self.seed is not None and not (isinstance(self.seed, int)
                                      and 0 <= self.seed < 2**32):
      fail("seed", "must be None or an integer in [0, 2**32)")
    if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      fail("max_tokens", "must be an integer >= 1")
    if not isinstance(self.n, int) or self.n < 1:
      fail("n", "must be an integer >= 1")
    object.__setattr__(self, "stop_token_ids",
                       tuple(int(t) for t in self.stop_token_ids))
    object.__setattr__(self, "stop", tuple(self.stop))
    if any(not s for s in self.stop):
      fail("stop", "stop strings must be non-empty")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


class SamplingArrays(NamedTuple):
  """Per-row parameters of a batch (device arrays, [B] each)."""
  temperature: jax.Array   # float32; 0 = greedy
  top_k: jax.Array         # int32; 0 = all
  top_p: jax.Array         # float32
  seed: jax.Array          # uint32
  counter: jax.Array       # int32: index of the token being sampled


def arrays(params: list[SamplingParams], seeds: list[int],
           counters: list[int], batch: int) -> SamplingArrays:
  """SamplingArrays for the rows of a batch bucket (padded greedily)."""
  pad = batch - len(params)
  f = lambda xs, fill, dt: np.asarray(list(xs) + [fill] * pad, dt)
  return SamplingArrays(
      f((p.temperature for p in params), 0.0, np.float32),
      f((p.top_k for p in params), 0, np.int32),
      f((p.top_p for p in params), 1.0, np.float32),
      f(seeds, 0, np.uint32),
      f(counters, 0, np.int32))


def log_q(logits_BxV, sa: SamplingArrays):
  """log of the sampling distribution q of every row (module docstring);
  -1e30 outside its support. Greedy rows get log softmax(logits).

  The top-k / top-p truncation sorts the vocabulary of every row; a batch
  in which no row truncates skips that sort.
  """
  truncates = jnp.any((sa.top_k > 0) | (sa.top_p < 1.0))
  return jax.lax.cond(truncates, _log_q_truncated, _log_q_plain,
                      logits_BxV.astype(jnp.float32), sa)


def _log_q_plain(logits, sa: SamplingArrays):
  t = jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]
  return jax.nn.log_softmax(logits / t, axis=-1)


def _log_q_truncated(logits, sa: SamplingArrays):
  V = logits.shape[-1]
  t = jnp.where(sa.temperature > 0, sa.temperature, 1.0)[:, None]
  scaled = logits / t
  desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(sa.top_k > 0, jnp.minimum(sa.top_k, V), V)
  kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
  # top_p over the top-k survivors, in descending order.
  in_k = jnp.arange(V)[None] < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_k, desc, _NEG), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs     # mass strictly above
  keep = in_k & (before < sa.top_p[:, None])
  count = jnp.maximum(keep.sum(-1), 1)
  pth = jnp.take_along_axis(desc, (count - 1)[:, None], axis=-1)
  threshold = jnp.maximum(kth, pth)
  greedy = (sa.temperature <= 0)[:, None]
  masked = jnp.where(greedy | (scaled >= threshold), scaled, _NEG)
  return jax.nn.log_softmax(masked, axis=-1)


def keys(sa: SamplingArrays):
  """[B] PRNG keys: fold_in(key(seed), counter) per row."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(
      sa.seed, sa.counter)


def sample(logits_BxV, sa: SamplingArrays):
  """(tokens [B] int32, log q(token) [B] float32) for one position per row."""
  lq = log_q(logits_BxV, sa)
  best = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  # An all-greedy batch draws no random numbers.
  drawn = jax.lax.cond(
      jnp.any(sa.temperature > 0),
      lambda: jax.vmap(jax.random.categorical)(keys(sa), lq).astype(
          jnp.int32),
      lambda: best)
  token = jnp.where(sa.temperature > 0, drawn, best)
  return token, jnp.take_along_axis(lq, token[:, None], axis=-1)[:, 0]
