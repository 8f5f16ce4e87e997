"""The generation engine: paged KV cache, continuous batching, MTP drafts.

  engine = Engine(config, variables, EngineConfig(mtp_draft=3))
  rid = engine.add_request(prompt_ids, SamplingParams(temperature=0.7, n=4))
  while engine.has_work():
    for event in engine.step():       # tokens as they are generated
      ...
  engine.result(rid)                   # per sample: tokens, log-probs, reason

On a mesh (`mesh=`, m2jax/sharding.py) the parameters follow the model's
logical-axis rules (tensor and expert parallel), the KV pages are split over
their kv_heads axis the same way, and every compiled step runs under the
mesh, so a model larger than one device can be served.

One `step` admits waiting requests, prefills them, and advances every running
sequence by `decode_steps` decode steps in one compiled call (a token each,
or with `mtp_draft` = K a speculative round of 1..K+1 tokens each). Requests join and leave between steps;
the compiled functions see only bucketed shapes (batch rows, block-table
width, prompt chunk), so no request triggers a compilation of its own.

Prompts. A request's prompt is prefilled once in chunks of `prefill_chunk`
tokens, all but its last token; its n samples then share the prompt's pages
(the last, partly filled page is copied for each) and feed the last prompt
token themselves, so each samples its own first token. Full pages of known
tokens enter the prefix cache (m2jax/infer/kv_cache.py): a later prompt that
starts with the same tokens reuses them instead of recomputing them.

Memory. When the pool runs out of pages, the most recently admitted sequence
is preempted: its pages are released and it waits to be prefilled again with
what it has generated so far (recompute preemption).

Speculative decoding (`mtp_draft` = K <= the model's MTP modules): each
round the MTP modules draft K tokens from the last position, the main model
verifies the K + 1 positions in one forward, and m2jax/infer/speculative.py
decides which are kept. Module k's KV cache is refreshed over a window of
the last 2K positions every round (the window covers every position whose
entry was computed from a draft that may have been rejected); the main
model's hidden states of those positions are kept per sequence on the
device (the "h0 ring"). Greedy output is identical to plain decoding.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m2jax import model, sharding
from m2jax.config import ModelConfig
from m2jax.errors import UserError
from m2jax.infer import sampling, speculative
from m2jax.infer.kv_cache import OutOfPages, PagePool, PageTable
from m2jax.infer.sampling import SamplingArrays, SamplingParams
from m2jax.model import paged


class EngineError(UserError, ValueError):
  """A request or engine setting the engine cannot serve."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the engine batches and caches (not what it computes).

  page_size: token slots per KV page (a power of two).
  num_pages: pages in the pool (page 0 is reserved), shared by all layers.
  max_batch: sequences decoded together at most (the largest batch bucket).
  prefill_chunk: prompt tokens per prefill call and row.
  decode_steps: decode steps per compiled call, with no return to the host
    in between (amortises dispatch and the host sync; requests join and
    leave between calls): tokens per sequence in plain decoding, rounds
    (1..K+1 tokens each) in speculative decoding.
  mtp_draft: speculative draft tokens per round, K (0: plain decoding).
  prefix_cache: keep full prompt pages for reuse by later requests.
  max_seq_len: longest sequence (prompt + output); None: the model's
    max_position_embeddings.
  """
  page_size: int = 16
  num_pages: int = 1024
  max_batch: int = 32
  prefill_chunk: int = 128
  decode_steps: int = 1
  mtp_draft: int = 0
  prefix_cache: bool = True
  max_seq_len: int | None = None

  def __post_init__(self):
    def fail(field, rule):
      raise EngineError(f"EngineConfig.{field}: {rule} (got "
                        f"{getattr(self, field)!r})")
    if self.page_size < 1 or self.page_size & (self.page_size - 1):
      fail("page_size", "must be a power of two")
    if self.num_pages < 2:
      fail("num_pages", "must be >= 2 (page 0 is reserved)")
    if self.max_batch < 1:
      fail("max_batch", "must be >= 1")
    if self.prefill_chunk < 1:
      fail("prefill_chunk", "must be >= 1")
    if self.decode_steps < 1:
      fail("decode_steps", "must be >= 1")
    if self.mtp_draft < 0:
      fail("mtp_draft", "must be >= 0")
    if self.max_seq_len is not None and self.max_seq_len < 2:
      fail("max_seq_len", "must be None or >= 2")


def _bucket(n: int, cap: int | None = None, low: int = 1) -> int:
  """The smallest power of two >= max(n, low) (at most cap, when given):
  the shapes the compiled steps see."""
  b = 1 << max(0, (max(n, low) - 1).bit_length())
  return b if cap is None else min(b, cap)


# Smallest block-table width and prompt chunk (fewer shapes to compile).
_MIN_PAGES, _MIN_CHUNK = 8, 8
# Stop token ids a row checks on the device (more are checked on the host).
_MAX_STOP_IDS = 8


class Sample(NamedTuple):
  """One finished (or running) sample of a request."""
  tokens: list[int]           # generated token ids (a stop token included)
  logprobs: list[float]       # log q(token) of each (sampling.py)
  finish_reason: str | None   # "stop", "length", "abort" or None (running)


class Event(NamedTuple):
  """New tokens of one sample after a step (for streaming)."""
  request_id: int
  index: int                  # sample index in 0..n-1
  tokens: list[int]
  logprobs: list[float]
  finish_reason: str | None


@dataclasses.dataclass
class _Request:
  rid: int
  prompt: list[int]
  params: SamplingParams
  seeds: list[int]
  samples: list["_Seq"] = dataclasses.field(default_factory=list)
  prefilled: bool = False


@dataclasses.dataclass
class _Seq:
  request: _Request
  index: int
  tokens: list[int]            # prompt + committed output
  table: PageTable
  computed: int = 0            # tokens whose main-model keys are cached
  generated: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  slot: int = -1               # row of the device-side h0 ring
  sent: int = 0                # tokens already reported in events
  ring: jax.Array | None = None  # h0 of the last 2K positions, from prefill

  @property
  def params(self) -> SamplingParams:
    return self.request.params


def inference_variables(config: ModelConfig, variables):
  """The variables as generation reads them: every weight in the compute
  dtype (decoding reads all active weights each step, so bf16 halves the
  bytes), except the router, which routing keeps in float32 (SPEC §1)."""
  cdt = jnp.dtype(config.compute_dtype)

  def cast(path, x):
    name = getattr(path[-1], "key", "")
    if name == "router" or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jnp.asarray(x, cdt)

  return {**variables, "params": jax.tree_util.tree_map_with_path(
      cast, variables["params"])}


class Engine:
  """Continuous batching over a paged KV cache (see the module docstring)."""

  def __init__(self, model_config: ModelConfig, variables,
               engine_config: EngineConfig = EngineConfig(), *,
               tokenizer=None, mesh=None, seed: int = 0):
    cfg, ec = model_config, engine_config
    if ec.mtp_draft > cfg.num_mtp_modules:
      raise EngineError(
          f"EngineConfig.mtp_draft={ec.mtp_draft} exceeds the model's "
          f"num_mtp_modules={cfg.num_mtp_modules}")
    if ec.mtp_draft and any(f"mtp_{k}" not in variables["params"]
                            for k in range(ec.mtp_draft)):
      raise EngineError("mtp_draft needs trained MTP modules; these "
                        "variables have none for some depth <= "
                        f"{ec.mtp_draft} (hub checkpoints ship none)")
    self.model_config, self.config = cfg, ec
    self.tokenizer = tokenizer
    self.mesh = mesh
    if mesh is not None:
      sharding.check_mesh(cfg, mesh)
      if mesh.shape.get(sharding.SEQUENCE_AXIS, 1) > 1:
        raise sharding.MeshError(
            f"generation does not split rows: the engine's mesh needs "
            f"{sharding.SEQUENCE_AXIS}=1 ({sharding.format_mesh(mesh)})")
    self.variables = self._weights(variables)
    self.max_seq_len = min(ec.max_seq_len or cfg.max_position_embeddings,
                           cfg.max_position_embeddings)
    K = ec.mtp_draft
    self.pool = PagePool(ec.num_pages, ec.page_size,
                         prefix_cache=ec.prefix_cache, lookahead=K,
                         margin=2 * K)
    dtype = jnp.dtype(cfg.compute_dtype)
    shape = (ec.num_pages, ec.page_size, cfg.num_kv_heads, cfg.head_dim)
    self.pages = self._place(paged.empty(cfg.num_layers, *shape, dtype))
    self.mtp_pages = [
        self._place(paged.empty(cfg.mtp_transformer_layers, *shape, dtype))
        for _ in range(K)]
    # The main model's hidden states of each sequence's last 2K positions
    # (speculative decoding), one row per batch slot.
    self.ring = self._place(jnp.zeros((ec.max_batch, 2 * K,
                                       cfg.hidden_size), dtype))
    self._free_slots = list(range(ec.max_batch))
    self._seed_rng = np.random.default_rng(seed)
    self._ids = itertools.count()
    self.requests: dict[int, _Request] = {}
    self.waiting: collections.deque[_Seq | _Request] = collections.deque()
    self.running: list[_Seq] = []
    self.stats = collections.Counter()

  def _place(self, tree, spec=None):
    """Device arrays of the engine on its mesh: KV pages split over their
    kv_heads axis as the model's rules say, everything else replicated."""
    if self.mesh is None:
      return tree
    if spec is None and isinstance(tree, paged.PagedKV):
      rules = dict(sharding.LOGICAL_RULES)
      axis = rules["kv_heads"]
      if self.model_config.num_kv_heads % self.mesh.shape[axis]:
        axis = None
      spec = jax.P(None, None, axis, None)
    target = jax.NamedSharding(self.mesh, spec or jax.P())
    return jax.tree.map(lambda x: jax.device_put(x, target), tree)

  def _weights(self, variables):
    """`variables` as the compiled steps read them: in the compute dtype
    (inference_variables), placed on the mesh by the model's rules."""
    variables = inference_variables(self.model_config, variables)
    if self.mesh is None:
      return variables
    return sharding.place(variables, sharding.variable_shardings(
        self.model_config, self.mesh))

  def _call(self, fn, *args):
    """Run a compiled step (under the mesh and its logical rules)."""
    if self.mesh is None:
      return fn(*args)
    with sharding.use_mesh(self.mesh):
      return fn(*args)

  def update_variables(self, variables) -> None:
    """New weights (RL's weight sync): later compiled steps read them.

    The prefix cache is emptied (its pages hold the old weights' keys and
    values). Running sequences go on from their cached entries: their next
    tokens come from the new weights, over a context whose keys and values
    the old weights computed, and the log-probs they report are those of
    that computation, the behaviour RL corrects for."""
    variables = self._weights(variables)
    old = jax.tree.structure(self.variables)
    if jax.tree.structure(variables) != old:
      raise EngineError("update_variables: the new variables' tree differs "
                        "from the engine's (another model config?)")
    self.variables = variables
    self.pool.new_epoch()

  # ------------------------------------------------------------ requests --

  def add_request(self, prompt_ids, params: SamplingParams = SamplingParams()
                  ) -> int:
    """Queue a prompt; returns its request id."""
    prompt = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
    if not prompt:
      raise EngineError("the prompt must hold at least one token")
    vocab = self.model_config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
      raise EngineError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt) >= self.max_seq_len:
      raise EngineError(f"the prompt has {len(prompt)} tokens; the context "
                        f"holds {self.max_seq_len}")
    need = self.pool.pages_for(len(prompt) + self.config.mtp_draft)
    if need > self.pool.num_pages - 1:
      raise EngineError(f"the prompt needs {need} KV pages; the pool has "
                        f"{self.pool.num_pages - 1}")
    if params.n > self.config.max_batch:
      raise EngineError(f"n={params.n} samples exceed the engine's "
                        f"max_batch={self.config.max_batch}")
    rid = next(self._ids)
    seeds = [int(s) for s in (
        np.arange(params.n) + params.seed if params.seed is not None
        else self._seed_rng.integers(0, 2**31, params.n))]
    req = _Request(rid, prompt, params, seeds)
    self.requests[rid] = req
    self.waiting.append(req)
    return rid

  def abort(self, rid: int) -> None:
    """Stop a request now and free its pages (a closed client)."""
    req = self.requests.get(rid)
    if req is None:
      return
    if req in self.waiting:
      self.waiting.remove(req)
    for seq in req.samples:
      if seq.finish_reason is None:
        self._finish(seq, "abort")
      if seq in self.waiting:
        self.waiting.remove(seq)

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def result(self, rid: int) -> list[Sample]:
    """The request's samples (finished or not)."""
    req = self.requests[rid]
    return [Sample(list(s.generated), list(s.logprobs), s.finish_reason)
            for s in req.samples]

  def done(self, rid: int) -> bool:
    req = self.requests[rid]
    return bool(req.samples) and all(s.finish_reason is not None
                                     for s in req.samples)

  def release(self, rid: int) -> None:
    """Forget a finished request (its results are no longer kept)."""
    self.requests.pop(rid, None)

  def generate(self, prompts, params: SamplingParams = SamplingParams()
               ) -> list[list[Sample]]:
    """Run `prompts` to completion; per prompt, its samples."""
    rids = [self.add_request(p, params) for p in prompts]
    while self.has_work():
      self.step()
    out = [self.result(r) for r in rids]
    for r in rids:
      self.release(r)
    return out

  def warmup(self, prompt_tokens: int, new_tokens: int, seed: int = 0
             ) -> None:
    """Compile, before any traffic, the shapes that batches of 1, 2, 4, ...,
    max_batch concurrent requests with `prompt_tokens`-token prompts meet
    while each generates `new_tokens` tokens: every prefill call (with and
    without prefix-cache hits), batch bucket and block-table width on the
    way (a server's first requests then wait for no compilation). The requests are greedy on random prompts and
    leave no trace but idle prefix-cache pages: their pages are released and
    the statistics reset. Longer prompts or outputs still compile their own
    block-table widths when they first come."""
    if prompt_tokens < 1 or new_tokens < 1:
      raise EngineError(f"warmup needs prompt_tokens and new_tokens >= 1, "
                        f"got {prompt_tokens} and {new_tokens}")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    batch = 1
    while True:
      batch = min(batch, self.config.max_batch)
      prompts = [list(rng.integers(0, self.model_config.vocab_size,
                                   prompt_tokens)) for _ in range(batch)]
      self.generate(prompts, params)
      if batch == self.config.max_batch:
        break
      batch *= 2
    if self.config.prefix_cache:   # the same prompts again: prefix hits
      self.generate(prompts, params)  # prefill only their uncached tails
    self.stats.clear()

  # ---------------------------------------------------------------- step --

  def step(self) -> list[Event]:
    """Admit and prefill waiting work, then one decode step for all."""
    self.admit()
    ready = [s for s in self.running if s.finish_reason is None]
    if ready:
      if self.config.mtp_draft:
        self._speculative_round(ready)
      else:
        self._decode(ready)
    events = []
    for seq in list(self.running):
      new = seq.generated[seq.sent:]
      if new or seq.finish_reason is not None:
        events.append(Event(seq.request.rid, seq.index, new,
                            seq.logprobs[seq.sent:], seq.finish_reason))
        seq.sent = len(seq.generated)
      if seq.finish_reason is not None:
        self.running.remove(seq)
    return events

  # ----------------------------------------------------------- admission --

  def admit(self):
    """Admit and prefill waiting requests (and preempted sequences) while
    there is room in the batch and the pool (`step` does this first)."""
    while self.waiting:
      item = self.waiting[0]
      n = item.params.n if isinstance(item, _Request) else 1
      if len(self.running) + n > self.config.max_batch:
        return
      try:
        if isinstance(item, _Request):
          self._admit_request(item)
        else:
          self._admit_sequence(item)
      except OutOfPages:
        if not self.running:
          raise
        return
      self.waiting.popleft()

  def _prefill_table(self, tokens: list[int]) -> tuple[PageTable, int]:
    """Pages holding tokens[:-1] (cached prefix reused, the rest
    prefilled); returns the table and the number of tokens computed."""
    table = self.pool.match_prefix(tokens)
    cached = len(table.pages) * self.pool.page_size
    self.stats["prefix_hit_tokens"] += cached
    try:
      self.pool.grow(table, len(tokens))
    except OutOfPages:
      self.pool.release(table)
      raise
    return table, cached

  def _admit_request(self, req: _Request):
    prompt = req.prompt
    table, cached = self._prefill_table(prompt)
    head = _Seq(req, 0, list(prompt), table, computed=cached)
    self._prefill([head])
    self.pool.commit(table, prompt, head.computed)
    n = req.params.n
    if n > 1:
      try:
        tables, moves = self.pool.fork(table, head.computed, n - 1)
      except OutOfPages:
        self.pool.release(table)
        raise
      if moves:
        self._copy_pages(moves)
      req.samples = [head] + [
          _Seq(req, i + 1, list(prompt), t, computed=head.computed,
               ring=head.ring)
          for i, t in enumerate(tables)]
      # Each sample writes its last prompt token itself: give it the page.
      for seq in req.samples[1:]:
        self.pool.grow(seq.table, len(prompt))
    else:
      req.samples = [head]
    for seq in req.samples:
      self._start(seq)

  def _admit_sequence(self, seq: _Seq):
    """A preempted sequence: prefill its tokens again."""
    table, cached = self._prefill_table(seq.tokens)
    seq.table, seq.computed = table, cached
    self._prefill([seq])
    self.pool.commit(table, seq.tokens, seq.computed)
    self._start(seq)

  def _start(self, seq: _Seq):
    seq.slot = self._free_slots.pop()
    self.running.append(seq)
    if self.config.mtp_draft:
      self.ring = self._call(_set_row, self.ring, seq.slot, seq.ring)
      seq.ring = None

  def _finish(self, seq: _Seq, reason: str):
    seq.finish_reason = reason
    if seq.table.pages:
      self.pool.commit(seq.table, seq.tokens, seq.computed)
      self.pool.release(seq.table)
    if seq.slot >= 0:
      self._free_slots.append(seq.slot)
      seq.slot = -1

  def _preempt(self) -> bool:
    """Free the newest running sequence's pages; it waits to be prefilled
    again. False when nothing can be preempted."""
    victims = [s for s in self.running if s.finish_reason is None]
    if len(victims) <= 1:
      return False
    seq = victims[-1]
    self.running.remove(seq)
    self.pool.release(seq.table)
    self._free_slots.append(seq.slot)
    seq.slot, seq.computed = -1, 0
    self.waiting.appendleft(seq)
    self.stats["preemptions"] += 1
    return True

  # ------------------------------------------------------------- prefill --

  def _prefill(self, seqs: list[_Seq]):
    """Compute keys of tokens[:-1] of every sequence, chunk by chunk."""
    todo = [s for s in seqs if s.computed < len(s.tokens) - 1]
    while todo:
      rows = todo[:self.config.max_batch]
      B = _bucket(len(rows), self.config.max_batch)
      C = _bucket(max(len(s.tokens) - 1 - s.computed for s in rows),
                  self.config.prefill_chunk, _MIN_CHUNK)
      tokens = np.zeros((B, C), np.int32)
      valid = np.zeros((B, C), bool)
      kv_lens = np.zeros(B, np.int32)
      width = _bucket(max(len(s.table.pages) for s in rows), low=_MIN_PAGES)
      tables = np.zeros((B, width), np.int32)
      for r, s in enumerate(rows):
        end = min(s.computed + C, len(s.tokens) - 1)
        chunk = s.tokens[s.computed:end]
        tokens[r, C - len(chunk):] = chunk
        valid[r, C - len(chunk):] = True
        kv_lens[r] = end
        tables[r, :len(s.table.pages)] = s.table.pages
      hidden = self._run_prefill(tokens, tables, kv_lens, valid)
      if self.config.mtp_draft:
        self._mtp_prefill(rows, tokens, tables, kv_lens, valid, hidden)
      for r, s in enumerate(rows):
        s.computed = int(kv_lens[r])
      self.stats["prefill_tokens"] += int(valid.sum())
      self.stats["prefill_calls"] += 1
      todo = [s for s in todo if s.computed < len(s.tokens) - 1]

  def _run_prefill(self, tokens, tables, kv_lens, valid):
    hidden, self.pages = self._call(
        _prefill_fn(self.model_config), self.variables, self.pages, tokens,
        tables, kv_lens, valid)
    return hidden

  # -------------------------------------------------------------- decode --

  def _grow_or_preempt(self, seqs: list[_Seq], extra: int) -> list[_Seq]:
    """Pages for `extra` more tokens of every sequence; preempts the
    newest sequences while the pool is short. Returns those still running."""
    while True:
      try:
        for s in seqs:
          self.pool.grow(s.table, len(s.tokens) + extra)
        return seqs
      except OutOfPages:
        if not self._preempt():
          raise
        seqs = [s for s in seqs if s in self.running]

  def _batch(self, seqs: list[_Seq], extra: int):
    """(B, block tables, sampling arrays, budget_B, stops_BxS) of a decode
    batch, bucketed: a row's budget is the tokens it may still make, its
    stops its stop token ids (-1: none)."""
    B = _bucket(len(seqs), self.config.max_batch)
    width = _bucket(max(self.pool.pages_for(len(s.tokens) + extra)
                        for s in seqs), low=_MIN_PAGES)
    tables = np.zeros((B, width), np.int32)
    budget = np.zeros(B, np.int32)
    stops = np.full((B, _MAX_STOP_IDS), -1, np.int32)
    for r, s in enumerate(seqs):
      row = s.table.pages[:width]
      tables[r, :len(row)] = row
      budget[r] = min(s.params.max_tokens - len(s.generated),
                      self.max_seq_len - len(s.tokens))
      ids = s.params.stop_token_ids[:_MAX_STOP_IDS]
      stops[r, :len(ids)] = ids
    sa = sampling.arrays([s.params for s in seqs],
                         [s.request.seeds[s.index] for s in seqs],
                         [len(s.generated) for s in seqs], B)
    return B, tables, sa, budget, stops

  def _emit_rows(self, seqs: list[_Seq], out, logprob, count) -> None:
    """Emit each row's `count` tokens of a compiled decode call."""
    for r, s in enumerate(seqs):
      c = int(count[r])
      s.computed = len(s.tokens) + c - 1
      self._emit(s, [int(t) for t in out[r, :c]],
                 [float(x) for x in logprob[r, :c]])

  def _decode(self, seqs: list[_Seq]):
    """`decode_steps` tokens for every sequence in one compiled call; a row
    stops early at a stop token or its max_tokens (stop strings are cut on
    the host afterwards)."""
    n = self.config.decode_steps
    seqs = self._grow_or_preempt(seqs, n - 1)
    B, tables, sa, budget, stops = self._batch(seqs, n - 1)
    tokens = np.zeros(B, np.int32)
    kv_lens = np.zeros(B, np.int32)
    for r, s in enumerate(seqs):
      tokens[r] = s.tokens[-1]
      kv_lens[r] = len(s.tokens)
    out, logprob, count, self.pages = self._call(
        _decode_fn(self.model_config, n), self.variables, self.pages, tokens,
        tables, kv_lens, budget, stops, sa)
    out, logprob, count = (np.asarray(x) for x in (out, logprob, count))
    self._emit_rows(seqs, out, logprob, count)
    self.stats["decode_steps"] += n
    self.stats["decode_tokens"] += int(count[:len(seqs)].sum())

  def _emit(self, seq: _Seq, tokens: list[int], logprobs: list[float]):
    """Append tokens up to the first stop; finish the sample if it ends."""
    p = seq.params
    for tok, lp in zip(tokens, logprobs):
      seq.tokens.append(tok)
      seq.generated.append(tok)
      seq.logprobs.append(lp)
      if tok in p.stop_token_ids:
        return self._finish(seq, "stop")
      if p.stop and self.tokenizer is not None and self._hit_stop(seq):
        return self._finish(seq, "stop")
      if len(seq.generated) >= p.max_tokens or \
          len(seq.tokens) >= self.max_seq_len:
        return self._finish(seq, "length")
    return None

  def _hit_stop(self, seq: _Seq) -> bool:
    """Cut the sample before the first stop string, if one appeared (after
    it with `include_stop_str_in_output`)."""
    text = self.tokenizer.decode(np.asarray(seq.generated))
    found = [(i, s) for i, s in ((text.find(s), s) for s in seq.params.stop)
             if i >= 0]
    if not found:
      return False
    cut, stop = min(found)
    if seq.params.include_stop_str_in_output:
      cut += len(stop)
    # Keep the shortest token prefix whose text reaches the cut.
    for n in range(len(seq.generated) + 1):
      if len(self.tokenizer.decode(np.asarray(seq.generated[:n]))) >= cut:
        break
    drop = len(seq.generated) - n
    if drop:
      del seq.generated[n:], seq.logprobs[n:], seq.tokens[-drop:]
    return True

  # -------------------------------------------------------- speculative --

  def _mtp_prefill(self, rows, tokens, tables, kv_lens, valid, hidden):
    """Run the MTP modules over a prefill chunk (their caches must hold
    every position) and keep the last 2K main hidden states per row."""
    K = self.config.mtp_draft
    B, C = tokens.shape
    # Module k at position p reads the token at p + k: known for p + k
    # inside the sequence, else a placeholder (those positions lie in the
    # last 2K, which every speculative round recomputes).
    shifted = np.zeros((K, B, C), np.int32)
    for r, s in enumerate(rows):
      pos = int(kv_lens[r]) - C + np.arange(C)
      seq = np.asarray(s.tokens, np.int32)
      for k in range(1, K + 1):
        ok = valid[r] & (pos + k < len(seq))
        shifted[k - 1, r, ok] = seq[pos[ok] + k]
    self.mtp_pages = self._call(
        _mtp_prefill_fn(self.model_config, K), self.variables,
        self.mtp_pages, hidden, shifted, tables, kv_lens, valid)
    # Keep the last 2K main hidden states (positions computed-2K..-1).
    W = 2 * K
    for r, s in enumerate(rows):
      if s.ring is None:
        s.ring = jnp.zeros((W, self.model_config.hidden_size), hidden.dtype)
      n_new = int(valid[r].sum())
      s.ring = jnp.concatenate([s.ring, hidden[r, C - n_new:]], axis=0)[-W:]

  def _speculative_round(self, seqs: list[_Seq]):
    """`decode_steps` speculative rounds for every sequence in one compiled
    call; a row stops early at a stop token or its max_tokens (stop strings
    are cut on the host afterwards)."""
    K, R = self.config.mtp_draft, self.config.decode_steps
    seqs = self._grow_or_preempt(seqs, R * (K + 1))
    B, tables, sa, budget, stops = self._batch(seqs, R * (K + 1))
    W = 2 * K
    slots = np.zeros(B, np.int32)
    recent = np.zeros((B, W), np.int32)   # tokens at positions m-W+1..m
    m = np.zeros(B, np.int32)             # position of the token to feed
    live = np.arange(B) < len(seqs)
    for r, s in enumerate(seqs):
      slots[r] = s.slot
      m[r] = len(s.tokens) - 1
      tail = s.tokens[max(0, len(s.tokens) - W):]
      recent[r, W - len(tail):] = tail
    (out, logprob, count, accepted_BxK, self.pages, self.mtp_pages,
     self.ring) = self._call(
         _spec_fn(self.model_config, K, R), self.variables, self.pages,
         self.mtp_pages, self.ring, slots, recent, m, tables, live, budget,
         stops, sa)
    out, logprob, count, accepted_BxK = (
        np.asarray(x) for x in (out, logprob, count, accepted_BxK))
    n = len(seqs)
    self._emit_rows(seqs, out, logprob, count)
    # A round emits its accepted drafts and one token of the main model.
    accepted = int(accepted_BxK[:n].sum())
    self.stats["decode_steps"] += R
    self.stats["decode_tokens"] += int(count[:n].sum())
    self.stats["drafted"] += K * (int(count[:n].sum()) - accepted)
    self.stats["accepted"] += accepted
    for k in range(K):
      self.stats[f"accepted_at_{k + 1}"] += int(accepted_BxK[:n, k].sum())

  def _copy_pages(self, moves):
    src = np.asarray([a for a, _ in moves], np.int32)
    dst = np.asarray([b for _, b in moves], np.int32)
    self.pages = self._call(_copy_fn, self.pages, src, dst)
    self.mtp_pages = [self._call(_copy_fn, p, src, dst)
                      for p in self.mtp_pages]


# --------------------------------------------------- compiled functions --


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_row(ring, slot, rows):
  return ring.at[slot].set(rows.astype(ring.dtype))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_fn(pages: paged.PagedKV, src, dst) -> paged.PagedKV:
  copy = lambda a: a.at[dst].set(a[src])
  return paged.PagedKV(tuple(map(copy, pages.k)), tuple(map(copy, pages.v)))


@functools.lru_cache(maxsize=None)
def _prefill_fn(cfg: ModelConfig):
  @functools.partial(jax.jit, donate_argnums=(1,))
  def prefill(variables, pages, tokens, tables, kv_lens, valid):
    _, hidden, pages = model.decode(cfg, variables, tokens, pages, tables,
                                    kv_lens, valid)
    return hidden, pages
  return prefill


@functools.lru_cache(maxsize=None)
def _decode_fn(cfg: ModelConfig, steps: int):
  """`steps` decode steps on the device: each row feeds its last token,
  samples the next, and stops after a stop token or `budget` tokens (its
  later steps write to the trash page and change nothing)."""

  @functools.partial(jax.jit, donate_argnums=(1,))
  def decode(variables, pages, tokens_B, tables, kv_lens_B, budget_B,
             stops_BxS, sa: SamplingArrays):
    B = tokens_B.shape[0]

    def step(i, carry):
      pages, token, kv_lens, live, out, lps, count = carry
      logits, _, pages = model.decode(cfg, variables, token[:, None], pages,
                                      tables, kv_lens, live[:, None])
      new, lp = sampling.sample(logits[:, 0],
                                sa._replace(counter=sa.counter + i))
      out = out.at[:, i].set(jnp.where(live, new, 0))
      lps = lps.at[:, i].set(jnp.where(live, lp, 0.0))
      count = count + live
      stop = jnp.any(new[:, None] == stops_BxS, axis=1)
      live = live & ~stop & (count < budget_B)
      return (pages, jnp.where(live, new, token), kv_lens + live, live, out,
              lps, count)

    live = (kv_lens_B > 0) & (budget_B > 0)
    carry = (pages, tokens_B, kv_lens_B, live,
             jnp.zeros((B, steps), jnp.int32),
             jnp.zeros((B, steps), jnp.float32), jnp.zeros(B, jnp.int32))
    pages, _, _, _, out, lps, count = jax.lax.fori_loop(0, steps, step, carry)
    return out, lps, count, pages
  return decode


@functools.lru_cache(maxsize=None)
def _mtp_prefill_fn(cfg: ModelConfig, K: int):
  @functools.partial(jax.jit, donate_argnums=(1,))
  def mtp_prefill(variables, mtp_pages, hidden, shifted_KxBxC, tables,
                  kv_lens, valid):
    new = []
    h = hidden
    for k in range(1, K + 1):
      _, h, pk = model.mtp_decode(cfg, variables, k, h, shifted_KxBxC[k - 1],
                                  mtp_pages[k - 1], tables, kv_lens, valid)
      new.append(pk)
    return new
  return mtp_prefill


@functools.lru_cache(maxsize=None)
def _spec_fn(cfg: ModelConfig, K: int, rounds: int):
  """`rounds` speculative rounds for a batch on the device (module
  docstring): each row emits 1..K+1 tokens per round and stops after a stop
  token or `budget` tokens (its later rounds change nothing)."""
  W = 2 * K

  def one_round(variables, pages, mtp_pages, ring, slots, recent_BxW, m_B,
                tables, live_B, sa: SamplingArrays):
    B = m_B.shape[0]
    # Draft: module k over the window of positions m-W..m-1; position p
    # reads the token at p + k (committed, or a draft made this round).
    pos = m_B[:, None] - W + jnp.arange(W)[None]
    valid = (pos >= 0) & live_B[:, None]
    h = ring[slots]
    drafts, draft_logq, new_mtp = [], [], []
    for k in range(1, K + 1):
      window_tokens = jnp.concatenate(
          [recent_BxW[:, k - 1:]] + [d[:, None] for d in drafts], axis=1)
      logits, h, pk = model.mtp_decode(cfg, variables, k, h, window_tokens,
                                       mtp_pages[k - 1], tables, m_B, valid)
      new_mtp.append(pk)
      q_sa = sa._replace(counter=sa.counter * (K + 2) + k)
      lq = sampling.log_q(logits[:, -1], q_sa)
      drawn = jax.vmap(jax.random.categorical)(sampling.keys(q_sa), lq)
      d = jnp.where(sa.temperature > 0, drawn,
                    jnp.argmax(logits[:, -1], -1)).astype(jnp.int32)
      drafts.append(d)
      draft_logq.append(lq)
    drafts_BxK = jnp.stack(drafts, axis=1)
    # Verify: the main model on [x_m, d_1..d_K] at positions m..m+K.
    feed = jnp.concatenate([recent_BxW[:, -1:], drafts_BxK], axis=1)
    kv_lens = jnp.where(live_B, m_B + K + 1, 0)
    logits, h0, pages = model.decode(
        cfg, variables, feed, pages, tables, kv_lens,
        jnp.broadcast_to(live_B[:, None], (B, K + 1)))
    flat = lambda x: x.reshape(B * (K + 1), *x.shape[2:])
    rep = SamplingArrays(*(jnp.repeat(a, K + 1) for a in sa))
    target_logp = sampling.log_q(flat(logits), rep).reshape(logits.shape)
    v_sa = sa._replace(counter=sa.counter * (K + 2))
    accepted, tokens, logprobs = speculative.accept(
        drafts_BxK, jnp.stack(draft_logq, axis=1), logits, target_logp,
        sa.temperature <= 0, sampling.keys(v_sa))
    # The ring moves on by accepted + 1 positions: h0 of m'-W..m'-1.
    both = jnp.concatenate([ring[slots], h0.astype(ring.dtype)], axis=1)
    idx = accepted[:, None] + 1 + jnp.arange(W)[None]
    new_ring = jnp.take_along_axis(both, idx[..., None], axis=1)
    ring = ring.at[slots].set(jnp.where(live_B[:, None, None], new_ring,
                                        ring[slots]))
    return accepted, tokens, logprobs, pages, new_mtp, ring

  @functools.partial(jax.jit, donate_argnums=(1, 2, 3))
  def spec(variables, pages, mtp_pages, ring, slots, recent_BxW, m_B, tables,
           live_B, budget_B, stops_BxS, sa: SamplingArrays):
    B = m_B.shape[0]
    width = rounds * (K + 1)
    rows = jnp.arange(B)[:, None]

    def body(_, carry):
      (pages, mtp_pages, ring, recent, m, live, out, lps, count,
       accepted_BxK) = carry
      # Keys as a round started from the host would make them.
      accepted, tokens, logprobs, pages, mtp_pages, ring = one_round(
          variables, pages, mtp_pages, ring, slots, recent, m, tables, live,
          sa._replace(counter=sa.counter + count))
      n = jnp.where(live, accepted + 1, 0)             # tokens emitted
      kept = jnp.arange(K + 1)[None] < n[:, None]
      # Emitted tokens go to columns count..count+n-1; the rest to a spare.
      col = jnp.where(kept, count[:, None] + jnp.arange(K + 1)[None], width)
      out = out.at[rows, col].set(tokens)
      lps = lps.at[rows, col].set(logprobs)
      accepted_BxK += live[:, None] & (accepted[:, None]
                                       > jnp.arange(K)[None])
      # The window of the last W tokens and the position to feed move on.
      both = jnp.concatenate([recent, tokens], axis=1)
      recent = jnp.where(live[:, None], jnp.take_along_axis(
          both, n[:, None] + jnp.arange(W)[None], axis=1), recent)
      count = count + n
      stop = jnp.any(kept[..., None] & (tokens[..., None]
                                        == stops_BxS[:, None]), axis=(1, 2))
      live = live & ~stop & (count < budget_B)
      return (pages, mtp_pages, ring, recent, m + n, live, out, lps, count,
              accepted_BxK)

    live = live_B & (budget_B > 0)
    carry = (pages, mtp_pages, ring, recent_BxW, m_B, live,
             jnp.zeros((B, width + 1), jnp.int32),
             jnp.zeros((B, width + 1), jnp.float32), jnp.zeros(B, jnp.int32),
             jnp.zeros((B, K), jnp.int32))
    (pages, mtp_pages, ring, _, _, _, out, lps, count,
     accepted_BxK) = jax.lax.fori_loop(0, rounds, body, carry)
    return out[:, :width], lps[:, :width], count, accepted_BxK, pages, \
        mtp_pages, ring
  return spec
