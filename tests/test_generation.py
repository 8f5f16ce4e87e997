"""Generation: the model over a paged KV cache, the engine (continuous
batching, prefix sharing, preemption, stops), sampling and its log-probs,
and MTP speculative decoding (greedy identity, the acceptance rule)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.data import single_document_batch
from m2jax.infer import sampling, speculative
from m2jax.infer.engine import Engine, EngineConfig, EngineError
from m2jax.infer.kv_cache import PagePool
from m2jax.infer.sampling import SamplingParams
from m2jax.model import paged
from m2jax.settings import Settings
from m2jax.train import state as state_lib
from m2jax.train import step as step_lib
from m2jax.train.config import TrainConfig

CFG = config_lib.TINY.replace(num_mtp_modules=2,
                              settings=Settings(attention="xla"))


@functools.lru_cache(maxsize=None)
def _variables(cfg=CFG):
  return model.init(cfg, jax.random.key(0))


def _prompts(seed, lengths, vocab=CFG.vocab_size):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, vocab, n)) for n in lengths]


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, variables, tokens):
  return model.logits(cfg, variables, tokens)


def _greedy_reference(cfg, variables, prompt, n, length=64):
  """Plain greedy decoding: the whole sequence through the model for every
  token (causality makes the unfilled tail irrelevant; one compile)."""
  buf = np.zeros((1, length), np.int32)
  buf[0, :len(prompt)] = prompt
  for i in range(len(prompt), len(prompt) + n):
    buf[0, i] = int(np.argmax(_logits(cfg, variables, buf)[0, i - 1]))
  return [int(t) for t in buf[0, len(prompt):len(prompt) + n]]


# ----------------------------------------------- the model with a cache ----

@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, variables, tokens):
  return model.forward(cfg, variables, tokens, mtp_depth=2)


def test_cached_forward_equals_full_forward_across_pages_and_rows():
  """Two rows of different lengths: a prefill chunk (left-padded), then
  token-by-token decoding over pages scattered in the pool; logits and MTP
  logits equal the ordinary forward pass."""
  v = _variables()
  L, S = 19, 4
  toks = jnp.asarray(np.asarray(_prompts(1, [L, L])), jnp.int32)
  full = _forward(CFG, v, toks)
  pages = paged.empty(CFG.num_layers, 32, S, CFG.num_kv_heads, CFG.head_dim,
                      jnp.float32)
  tables = jnp.asarray([[5, 9, 2, 30, 7, 11], [3, 1, 28, 4, 6, 8]],
                       jnp.int32)
  # Row 0 prefills 11 tokens, row 1 only 6, in one chunk of 12.
  first = np.array([11, 6])
  T = 12
  chunk = np.zeros((2, T), np.int32)
  valid = np.zeros((2, T), bool)
  for r in range(2):
    chunk[r, T - first[r]:] = np.asarray(toks[r, :first[r]])
    valid[r, T - first[r]:] = True
  decode = jax.jit(functools.partial(model.decode, CFG))
  logits, _, pages = decode(v, jnp.asarray(chunk), pages, tables,
                            jnp.asarray(first), jnp.asarray(valid))
  for r in range(2):
    np.testing.assert_allclose(logits[r, T - first[r]:],
                               full.logits[r, :first[r]], atol=2e-5)
  for step in range(8):
    pos = first + step
    tok = jnp.asarray(np.asarray(toks)[np.arange(2), pos][:, None])
    logits, _, pages = decode(v, tok, pages, tables, jnp.asarray(pos + 1),
                              jnp.ones((2, 1), bool))
    for r in range(2):
      np.testing.assert_allclose(logits[r, 0], full.logits[r, pos[r]],
                                 atol=2e-5)


def test_mtp_over_the_cache_equals_training_mtp():
  """Module k over the cache (the element at p reads h^{k-1}_p and the
  token at p + k) gives the training forward's depth-k logits."""
  v = _variables()
  L, S = 13, 4
  toks = jnp.asarray(np.asarray(_prompts(2, [L])), jnp.int32)
  full = _forward(CFG, v, toks)
  tables = jnp.asarray([[3, 1, 7, 5]], jnp.int32)
  pages = paged.empty(CFG.num_layers, 8, S, CFG.num_kv_heads, CFG.head_dim,
                      jnp.float32)
  n = L - 2    # positions 0..n-1 have their token 2 ahead
  valid = jnp.ones((1, n), bool)
  _, h, _ = jax.jit(functools.partial(model.decode, CFG))(
      v, toks[:, :n], pages, tables, jnp.array([n]), valid)
  mtp = jax.jit(functools.partial(model.mtp_decode, CFG), static_argnums=1)
  for k in (1, 2):
    mtp_pages = paged.empty(1, 8, S, CFG.num_kv_heads, CFG.head_dim,
                            jnp.float32)
    logits, h, _ = mtp(v, k, h, toks[:, k:k + n], mtp_pages, tables,
                       jnp.array([n]), valid)
    np.testing.assert_allclose(logits[0], full.mtp_logits[k - 1][0, :n],
                               atol=2e-5)


# ------------------------------------------------------------ the engine ----

# One engine shape for most tests: compiled steps are shared between them.
ENGINE = EngineConfig(page_size=4, num_pages=64, max_batch=4, prefill_chunk=8)


@pytest.mark.parametrize("max_batch, decode_steps", [(1, 1), (4, 4)])
def test_engine_greedy_equals_reference_decoding(max_batch, decode_steps):
  """Continuous batching (more prompts than batch rows, prompts across page
  boundaries, chunked prefill) gives plain greedy decoding's tokens."""
  v = _variables()
  prompts = _prompts(3, [5, 17, 9, 2, 12])
  want = [_greedy_reference(CFG, v, p, 6) for p in prompts]
  eng = Engine(CFG, v, dataclasses.replace(ENGINE, max_batch=max_batch,
                                            decode_steps=decode_steps))
  out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
  assert [o[0].tokens for o in out] == want
  assert all(o[0].finish_reason == "length" for o in out)
  assert eng.pool.used_pages() == 0       # every page given back


def test_greedy_logprobs_are_the_models():
  v = _variables()
  prompt = _prompts(4, [7])[0]
  eng = Engine(CFG, v, ENGINE)
  [[s]] = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
  # The sequence in the 64-token buffer of _greedy_reference: its compiled
  # forward (causality makes the unfilled tail irrelevant).
  seq = np.zeros((1, 64), np.int32)
  seq[0, :len(prompt) + len(s.tokens)] = prompt + s.tokens
  lp = jax.nn.log_softmax(_logits(CFG, v, seq)[0], axis=-1)
  want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(s.tokens)]
  np.testing.assert_allclose(s.logprobs, want, atol=1e-5)


def test_n_samples_share_the_prompt_and_follow_their_seeds():
  """n samples prefill the prompt once and share its full pages; each
  sample's tokens depend only on its own seed (not on the batch)."""
  v = _variables()
  prompt = _prompts(5, [21])[0]
  cfg = ENGINE
  params = SamplingParams(temperature=1.0, top_k=20, n=4, seed=7,
                          max_tokens=5)
  eng = Engine(CFG, v, cfg)
  rid = eng.add_request(prompt, params)
  eng.step()
  # Prompt tokens 0..19 prefilled once: 5 pages shared by all 4 samples,
  # plus one own page each for the last prompt token.
  assert eng.stats["prefill_tokens"] == 20
  assert eng.pool.used_pages() == 5 + 4
  while eng.has_work():
    eng.step()
  samples = eng.result(rid)
  assert len({tuple(s.tokens) for s in samples}) > 1
  alone = Engine(CFG, v, cfg).generate(
      [prompt], SamplingParams(temperature=1.0, top_k=20, n=1, seed=9,
                               max_tokens=5))[0][0]
  assert alone.tokens == samples[2].tokens     # seed 7 + 2, alone


def test_prefix_cache_reuses_pages_across_requests():
  v = _variables()
  shared = _prompts(6, [16])[0]
  a, b = shared + [5, 6, 7], shared + [9, 10]
  eng = Engine(CFG, v, ENGINE)
  params = SamplingParams(temperature=0, max_tokens=3)
  eng.generate([a], params)
  before = eng.stats["prefill_tokens"]
  [[got]] = eng.generate([b], params)
  assert eng.stats["prefix_hit_tokens"] == 16
  assert eng.stats["prefill_tokens"] - before == len(b) - 1 - 16
  assert got.tokens == _greedy_reference(CFG, v, b, 3)


def test_preemption_when_the_pool_runs_out_keeps_outputs_exact():
  v = _variables()
  prompts = _prompts(7, [6, 7, 8, 5])
  want = [_greedy_reference(CFG, v, p, 10) for p in prompts]
  eng = Engine(CFG, v, dataclasses.replace(ENGINE, num_pages=13,
                                            prefix_cache=False))
  out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
  assert eng.stats["preemptions"] > 0
  assert [o[0].tokens for o in out] == want


def test_stop_tokens_and_strings():
  from m2jax.data import ByteTokenizer  # pylint: disable=import-outside-toplevel
  v = _variables()
  tok = ByteTokenizer()
  prompt = _prompts(8, [6])[0]
  free = _greedy_reference(CFG, v, prompt, 8)
  # Several tokens per compiled call: the stop lands inside a call.
  eng = Engine(CFG, v, dataclasses.replace(ENGINE, decode_steps=4),
               tokenizer=tok)
  [[s]] = eng.generate([prompt], SamplingParams(
      temperature=0, max_tokens=8, stop_token_ids=(free[3],)))
  assert s.tokens == free[:free.index(free[3]) + 1]
  assert s.finish_reason == "stop"
  text = tok.decode(np.asarray(free))
  if len(text) >= 3:
    stop = text[1:3]
    [[s]] = eng.generate([prompt], SamplingParams(temperature=0,
                                                  max_tokens=8, stop=(stop,)))
    assert s.finish_reason == "stop"
    assert stop not in tok.decode(np.asarray(s.tokens))
    assert tok.decode(np.asarray(s.tokens)) == text[:text.find(stop)]


def test_bad_requests_are_refused():
  eng = Engine(CFG, _variables(), EngineConfig(page_size=4, num_pages=8))
  with pytest.raises(EngineError, match="at least one token"):
    eng.add_request([])
  with pytest.raises(EngineError, match="token ids"):
    eng.add_request([CFG.vocab_size])
  with pytest.raises(EngineError, match="KV pages"):
    eng.add_request(list(range(3, 40)))
  with pytest.raises(sampling.SamplingError, match="top_p"):
    SamplingParams(top_p=0)
  with pytest.raises(EngineError, match="num_mtp_modules"):
    Engine(CFG, _variables(), EngineConfig(mtp_draft=3))


# -------------------------------------------------------------- sampling ----

def test_log_q_is_temperature_top_k_top_p():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 10)).astype(np.float32)
  sa = sampling.arrays([SamplingParams(temperature=0.5),
                        SamplingParams(temperature=1.0, top_k=3),
                        SamplingParams(temperature=2.0, top_p=0.6)],
                       [0, 0, 0], [0, 0, 0], 3)
  lq = np.asarray(sampling.log_q(jnp.asarray(logits), sa))

  def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()

  np.testing.assert_allclose(np.exp(lq[0]), softmax(logits[0] / 0.5),
                             atol=1e-6)
  top3 = np.argsort(-logits[1])[:3]
  want = np.zeros(10)
  want[top3] = softmax(logits[1][top3])
  np.testing.assert_allclose(np.exp(lq[1]), want, atol=1e-6)
  p = softmax(logits[2] / 2.0)
  order = np.argsort(-p)
  keep = order[:np.searchsorted(np.cumsum(p[order]), 0.6) + 1]
  want = np.zeros(10)
  want[keep] = p[keep] / p[keep].sum()
  np.testing.assert_allclose(np.exp(lq[2]), want, atol=1e-6)


def test_speculative_acceptance_rule_samples_the_target():
  """Drafts from q, target p on a vocabulary of 4: the first emitted token
  and the pair of the first two are distributed as p (chi-square); greedy
  rows accept exactly the argmax prefix."""
  K, V, N = 2, 4, 40000
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(V), size=K + 1).astype(np.float32)
  q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)
  keys = jax.random.split(jax.random.key(0), N + 1)
  accept = jax.jit(speculative.accept)

  @jax.jit   # the drafts and the rule in one compile, not op by op
  def sampled(keys):
    drafts = jax.vmap(lambda k: jax.vmap(jax.random.categorical)(
        jax.random.split(k, K), jnp.log(q)))(keys[:N]).astype(jnp.int32)
    logp = jnp.broadcast_to(jnp.log(p), (N, K + 1, V))
    logq = jnp.broadcast_to(jnp.log(q), (N, K, V))
    return accept(drafts, logq, logp, logp, jnp.zeros(N, bool),
                  jax.random.split(keys[N], N))

  acc, tokens, lps = sampled(keys)
  tokens, acc = np.asarray(tokens), np.asarray(acc)
  first = np.bincount(tokens[:, 0], minlength=V) / N
  chi2 = N * np.sum((first - p[0]) ** 2 / p[0])
  assert chi2 < 16.3, (chi2, first, p[0])     # 3 dof, p = 0.001
  # Second token, among rows that accepted the first draft (it is then
  # the second position's token): distributed as p_1.
  two = acc >= 1
  second = np.bincount(tokens[two, 1], minlength=V) / two.sum()
  chi2 = two.sum() * np.sum((second - p[1]) ** 2 / p[1])
  assert chi2 < 16.3, (chi2, second, p[1])
  np.testing.assert_allclose(
      np.asarray(lps)[np.arange(N), 0], np.log(p[0])[tokens[:, 0]],
      rtol=1e-5)
  # Greedy: accept while the draft is the argmax.
  g_drafts = jnp.asarray([[np.argmax(p[0]), np.argmax(p[1])],
                          [np.argmax(p[0]), (np.argmax(p[1]) + 1) % V],
                          [(np.argmax(p[0]) + 1) % V, 0]], jnp.int32)
  logp = jnp.broadcast_to(jnp.log(p), (3, K + 1, V))
  logq = jnp.broadcast_to(jnp.log(q), (3, K, V))
  acc, tokens, _ = accept(g_drafts, logq, logp, logp, jnp.ones(3, bool),
                          jax.random.split(keys[0], 3))
  np.testing.assert_array_equal(acc, [2, 1, 0])
  np.testing.assert_array_equal(np.asarray(tokens)[:, :1],
                                [[np.argmax(p[0])]] * 3)
  assert int(tokens[1, 1]) == np.argmax(p[1])
  assert int(tokens[0, 2]) == np.argmax(p[2])


# ----------------------------------------------- speculative decoding -------

# A tiny model trained on a periodic sequence with a random branch, so that
# its MTP modules draft well but not perfectly: rounds see full, partial and
# no acceptance.
_SPEC_CFG = config_lib.TINY.replace(num_layers=1, num_mtp_modules=3,
                                    settings=Settings(attention="xla"))
_PATTERN = np.array([11, 23, 35, 47, 59, 71, 83])


@functools.lru_cache(maxsize=None)
def _trained_spec_variables():
  # 40 steps learn the pattern as well as 80 did (same final loss, the same
  # greedy and sampled tokens and acceptance in the tests below, measured).
  tc = TrainConfig(steps=40, learning_rate=1e-2, warmup_steps=5,
                   mtp_depth=3, mtp_weight=1.0, mtp_weight_final=1.0)
  state = state_lib.init_state(_SPEC_CFG, tc,
                               model.init(_SPEC_CFG, jax.random.key(0)))
  train, _ = step_lib.jit_steps(_SPEC_CFG, tc)
  rng = np.random.default_rng(0)
  for _ in range(tc.steps):
    rows = []
    for _ in range(8):
      row = list(_PATTERN[rng.integers(7):])
      while len(row) < 48:   # after 83 comes 11 or (rarely) 99 then 11
        row += ([99] if rng.random() < 0.3 else []) + list(_PATTERN)
      rows.append(row[:48])
    state, _ = train(state, single_document_batch(np.asarray(rows)))
  return state_lib.variables_of(state)


@pytest.mark.parametrize("K, rounds", [(1, 1), (3, 4)])
def test_speculative_greedy_equals_plain_greedy(K, rounds):
  v = _trained_spec_variables()
  prompts = [list(_PATTERN[:5]), list(_PATTERN) + [99, 11, 23],
             list(_PATTERN[3:]) * 2]
  want = [_greedy_reference(_SPEC_CFG, v, p, 13) for p in prompts]
  eng = Engine(_SPEC_CFG, v, dataclasses.replace(ENGINE, mtp_draft=K,
                                                 decode_steps=rounds))
  out = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=13))
  assert [o[0].tokens for o in out] == want
  st = eng.stats
  assert st["accepted"] > 0.5 * st["drafted"]       # the drafts do work
  assert st["decode_steps"] < 3 * 13
  assert eng.pool.used_pages() == 0


def test_speculative_rounds_per_call_change_nothing_but_the_calls():
  """Sampled speculative decoding with 4 rounds per compiled call gives the
  tokens and log-probs of one round per call (the same keys), and stops at
  a stop token inside a round. Three drafts, 4 rounds: the engine of the
  greedy test's [3-4] case (its compiled steps, when it ran first)."""
  v = _trained_spec_variables()
  prompts = [list(_PATTERN[:5]), list(_PATTERN) + [99, 11]]
  params = SamplingParams(temperature=1.0, max_tokens=11, seed=3, n=2,
                          stop_token_ids=(99,))
  results = []
  for rounds in (1, 4):
    eng = Engine(_SPEC_CFG, v, dataclasses.replace(ENGINE, mtp_draft=3,
                                                   decode_steps=rounds))
    results.append(eng.generate(prompts, params))
    assert eng.pool.used_pages() == 0
  one, four = results
  assert [[s.tokens for s in r] for r in one] == \
      [[s.tokens for s in r] for r in four]
  np.testing.assert_allclose(
      [lp for r in four for s in r for lp in s.logprobs],
      [lp for r in one for s in r for lp in s.logprobs], atol=1e-5)
  for r in four:
    for s in r:
      assert 99 not in s.tokens[:-1]
      assert s.finish_reason == ("stop" if s.tokens[-1] == 99 else "length")


def test_sharded_generation_equals_one_device():
  """Tensor and expert parallel meshes over 8 fake CPU devices give the
  one-device engine's greedy tokens and log-probs (its own process)."""
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "tests", "generation_mesh_check.py")],
      capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  for spec, r in report.items():
    assert all(r["tokens_equal"]), (spec, r)
    assert r["logprob_diff"] < 1e-4, (spec, r)


def test_warmup_compiles_every_shape_a_load_then_meets():
  """After warmup, 1..max_batch concurrent requests of the warmed lengths
  compile nothing (a config of its own: no other test compiled its steps;
  one layer, which compiles faster)."""
  import logging  # pylint: disable=import-outside-toplevel
  cfg = CFG.replace(rope_theta=CFG.rope_theta + 1.0, num_layers=1,
                    num_mtp_modules=0)
  eng = Engine(cfg, _variables(cfg), dataclasses.replace(ENGINE,
                                                         decode_steps=2))
  with pytest.raises(EngineError, match="prompt_tokens"):
    eng.warmup(0, 4)
  eng.warmup(prompt_tokens=14, new_tokens=6)
  assert eng.pool.used_pages() == 0 and not eng.stats

  compiles = []

  class Record(logging.Handler):
    def emit(self, record):
      if "Compiling" in record.getMessage():
        compiles.append(record.getMessage()[:80])

  handler, logger = Record(), logging.getLogger("jax._src.interpreters.pxla")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      rng = np.random.default_rng(5)
      for batch in (3, 1, 4):
        prompts = [list(rng.integers(3, cfg.vocab_size, 14))
                   for _ in range(batch)]
        for _ in range(2):   # the second time with prefix-cache hits
          eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
  finally:
    logger.removeHandler(handler)
  assert not compiles, compiles
