"""The OpenAI-compatible server (m2jax/serve/): a live uvicorn server on
127.0.0.1 driven by the official `openai` client and raw HTTP, its OpenAPI
schema fuzzed with schemathesis, and the streaming pieces alone."""

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import requests
import schemathesis
from schemathesis import checks as st_checks
from schemathesis.specs.openapi import checks as oa_checks

from benchmarks import serve_load
from m2jax import config as config_lib
from m2jax import model
from m2jax.data import ByteTokenizer, chat
from m2jax.infer.engine import Engine, EngineConfig, Sample
from m2jax.infer.sampling import SamplingParams
from m2jax.serve import app as app_lib
from m2jax.serve import streaming
from m2jax.serve.loop import EngineLoop
from m2jax.settings import Settings

CFG = config_lib.TINY.replace(num_layers=1, settings=Settings(attention="xla"))
ENGINE = EngineConfig(page_size=32, num_pages=64, max_batch=4,
                      prefill_chunk=32, max_seq_len=256)
TOK = ByteTokenizer()
KEY = "test-key"
NAME = "tiny-test"


@functools.lru_cache(maxsize=None)
def _variables():
  """Random weights whose greedy text is printable ASCII (readable stop
  strings): lm_head columns of other ids are zero, so their logit is 0,
  below the largest of ~95 random ones."""
  v = model.init(CFG, jax.random.key(0))
  keep = np.zeros(CFG.vocab_size, bool)
  keep[32:127] = True
  head = np.where(keep[None], np.asarray(v["params"]["lm_head"]), 0.0)
  return {**v, "params": {**v["params"], "lm_head": jnp.asarray(head)}}


class _Live:
  """A uvicorn server for `app` in a thread, on a free loopback port."""

  def __init__(self, app):
    import uvicorn  # pylint: disable=import-outside-toplevel
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    self.thread = threading.Thread(target=self.server.run,
                                   kwargs={"sockets": [sock]}, daemon=True)
    self.thread.start()
    deadline = time.time() + 20
    while not self.server.started:
      assert time.time() < deadline, "the server did not start"
      time.sleep(0.02)

  def close(self):
    self.server.should_exit = True
    self.thread.join(10)


@pytest.fixture(scope="module")
def server():
  loop = EngineLoop(CFG, _variables(), ENGINE, tokenizer=TOK).start()
  live = _Live(app_lib.create_app(loop, model_name=NAME, api_key=KEY))
  live.loop = loop
  # Compile the shapes most tests use once, up front.
  _client(live).completions.create(model=NAME, prompt="warm", max_tokens=2,
                                   temperature=0)
  yield live
  live.close()
  loop.stop()


def _client(live, key=KEY, **kw):
  return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0,
                       timeout=30, **kw)


def _post(live, path, body, key=KEY):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  if not isinstance(body, (str, bytes)):
    body = json.dumps(body)
  return requests.post(live.url + path, data=body, timeout=30,
                       headers={**headers,
                                "Content-Type": "application/json"})


def _reference(prompt, params):
  """The engine alone, on the same weights and engine config."""
  eng = Engine(CFG, _variables(), ENGINE, tokenizer=TOK)
  [samples] = eng.generate([prompt], params)
  return samples


def _text_prompt(text):
  return [TOK.bos_id] + [int(t) for t in TOK.encode(text)]


# -------------------------------------------------------- completions --

def test_models_list(server):
  [m] = _client(server).models.list().data
  assert m.id == NAME and m.max_model_len == ENGINE.max_seq_len
  assert m.policy_version == server.loop.policy_version


def test_greedy_completion_equals_the_engine(server):
  """Text and token-id prompts: the ids, log-probs, text and usage are the
  engine's own greedy output for the same prompt."""
  c = _client(server)
  want = _reference(_text_prompt("def f(x):"), SamplingParams(
      temperature=0, max_tokens=12, stop_token_ids=(TOK.eos_id,)))[0]
  r = c.completions.create(model=NAME, prompt="def f(x):", max_tokens=12,
                           temperature=0)
  [choice] = r.choices
  assert choice.token_ids == want.tokens
  np.testing.assert_allclose(choice.token_logprobs, want.logprobs, atol=1e-5)
  assert choice.text == TOK.decode(np.asarray(want.tokens))
  assert choice.finish_reason == want.finish_reason
  assert choice.prompt_token_ids == _text_prompt("def f(x):")
  assert r.usage.prompt_tokens == 10
  assert r.usage.completion_tokens == len(want.tokens)
  assert r.policy_version == server.loop.policy_version
  ids = c.completions.create(model=NAME, prompt=_text_prompt("def f(x):"),
                             max_tokens=12, temperature=0)
  assert ids.choices[0].token_ids == want.tokens


def test_n_samples_seed_and_logprobs(server):
  """n seeded samples are the engine's (seeds seed..seed+n-1), repeat
  exactly, and carry OpenAI's logprobs shape next to the extension."""
  c = _client(server)
  prompt = [5, 17, 99, 3]
  params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seed=11,
                          n=3, stop_token_ids=(TOK.eos_id,))
  want = _reference(prompt, params)
  kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, n=3,
            seed=11, logprobs=0, extra_body={"top_k": 50})
  a, b = c.completions.create(**kw), c.completions.create(**kw)
  assert [ch.index for ch in a.choices] == [0, 1, 2]
  assert [ch.token_ids for ch in a.choices] == [s.tokens for s in want]
  assert [ch.token_ids for ch in b.choices] == [s.tokens for s in want]
  assert len({tuple(ch.token_ids) for ch in a.choices}) > 1
  for ch, s in zip(a.choices, want):
    np.testing.assert_allclose(ch.logprobs.token_logprobs, s.logprobs,
                               atol=1e-5)
    assert ch.logprobs.tokens == [TOK.decode([t]) for t in s.tokens]
  other = c.completions.create(**{**kw, "seed": 12})
  assert [ch.token_ids for ch in other.choices] != [s.tokens for s in want]


def test_several_prompts_in_one_request(server):
  r = _client(server).completions.create(
      model=NAME, prompt=[[7, 8, 9], [10, 11]], n=2, max_tokens=3,
      temperature=0)
  assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
  assert [ch.prompt_token_ids for ch in r.choices] == [[7, 8, 9]] * 2 + [
      [10, 11]] * 2
  assert r.usage.prompt_tokens == 5


def _stream_completion(live, **kw):
  chunks = list(_client(live).completions.create(
      model=NAME, stream=True, stream_options={"include_usage": True}, **kw))
  *body, last = chunks
  assert last.choices == [] and last.usage is not None
  text = "".join(ch.choices[0].text for ch in body)
  ids = [t for ch in body for t in ch.choices[0].token_ids]
  assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
  return text, ids, body[-1].choices[0].finish_reason, last.usage


def test_stop_strings_and_streaming_equal_the_whole_answer(server):
  """A stop string cuts the text before it; streamed pieces concatenate to
  the non-streamed answer, with and without a stop string (the stream holds
  back text that may become a stop string)."""
  c = _client(server)
  prompt = "The cat"
  full = c.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                              temperature=0).choices[0]
  text, ids, reason, usage = _stream_completion(
      server, prompt=prompt, max_tokens=40, temperature=0)
  assert (text, ids, reason) == (full.text, full.token_ids,
                                 full.finish_reason)
  assert usage.completion_tokens == len(ids)
  # A stop string from the middle of the greedy text (two characters that
  # are not a replacement for a byte outside UTF-8).
  at = next(i for i in range(6, len(full.text) - 1)
            if "\ufffd" not in full.text[i:i + 2])
  stop = full.text[at:at + 2]
  cut = c.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                             temperature=0, stop=[stop]).choices[0]
  assert cut.finish_reason == "stop"
  assert cut.text == full.text[:full.text.find(stop)]
  assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
  text, ids, reason, _ = _stream_completion(
      server, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
  assert (text, ids, reason) == (cut.text, cut.token_ids, "stop")


# --------------------------------------------------------------- chat --

CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use it.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "w", "arguments": "{\"c\": \"P\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_chat_uses_the_template_and_equals_the_engine(server):
  """The prompt is chat.render of the conversation (the think block of the
  earlier assistant turn kept); greedy output is the engine's, stopped at
  END_OF_TURN; streamed deltas concatenate to the whole message."""
  c = _client(server)
  prompt, _ = chat.render(CONVERSATION, TOK, add_generation_prompt=True)
  assert "<think>\nUse it.\n</think>" in TOK.decode(prompt)
  r = c.chat.completions.create(model=NAME, messages=CONVERSATION,
                                max_tokens=30, temperature=0, logprobs=True)
  [choice] = r.choices
  assert choice.prompt_token_ids == [int(t) for t in prompt]
  want = _reference(prompt, SamplingParams(
      temperature=0, max_tokens=30, stop_token_ids=(TOK.eos_id,),
      stop=(chat.END_OF_TURN,)))[0]
  assert choice.token_ids == want.tokens
  parsed = chat.parse_completion(TOK.decode(np.asarray(want.tokens)))
  assert choice.message.content == parsed["content"]
  assert [x.logprob for x in choice.logprobs.content] == pytest.approx(
      want.logprobs, abs=1e-5)
  assert r.usage.prompt_tokens == len(prompt)
  chunks = list(c.chat.completions.create(
      model=NAME, messages=CONVERSATION, max_tokens=30, temperature=0,
      stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
      choice.message.content
  assert [t for ch in chunks for t in ch.choices[0].token_ids] == \
      choice.token_ids
  assert chunks[-1].choices[0].finish_reason == choice.finish_reason


# The text a model would write for a turn that thinks, says something and
# calls two tools (the documented format, m2jax/data/chat.py).
TURN = {"role": "assistant", "reasoning": "Two cities.\nCheck both.",
        "content": "Checking.",
        "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}},
                       {"name": "weather", "arguments": {"city": "Köln"}}]}


class _ScriptedLoop:
  """An engine loop stand-in that answers every request with the tokens of
  a fixed text, a few at a time (the app sees only this interface)."""

  def __init__(self, text):
    self.tokens = [int(t) for t in TOK.encode(text)]
    self.tokenizer, self.policy_version, self.max_seq_len = TOK, 3, 4096
    self.engine = type("E", (), {"model_config": CFG, "config": ENGINE})

  def add(self, ticket):
    ticket.post("added", self.policy_version)
    for i in range(0, len(self.tokens), 3):
      part = self.tokens[i:i + 3]
      ticket.post("tokens", 0, part, [-0.5] * len(part))
    ticket.post("done", 0, Sample(self.tokens, [-0.5] * len(self.tokens),
                                  "stop"))

  def abort(self, ticket):
    pass


def test_tool_calls_and_reasoning_reach_the_client():
  """A turn with a think block and tool calls comes back as
  reasoning_content, content and OpenAI tool_calls (finish_reason
  "tool_calls"), whole and streamed."""
  loop = _ScriptedLoop(chat.assistant_text(TURN))
  live = _Live(app_lib.create_app(loop, model_name=NAME))
  try:
    c = _client(live, key="unused")
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hi"}],
              tools=[{"type": "function", "function": {"name": "weather"}}])
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.policy_version == 3
    assert m.content == "Checking."
    assert m.reasoning_content == "Two cities.\nCheck both."
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in m.tool_calls] == [(t["name"], t["arguments"])
                                       for t in TURN["tool_calls"]]
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert "".join(getattr(d, "reasoning_content", None) or ""
                   for d in deltas) == TURN["reasoning"]
    # Reasoning streams before the content does, in several pieces.
    assert sum(bool(getattr(d, "reasoning_content", None))
               for d in deltas) > 1
    [last] = [d for d in deltas if d.tool_calls]
    assert [json.loads(t.function.arguments) for t in last.tool_calls] == [
        t["arguments"] for t in TURN["tool_calls"]]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
  finally:
    live.close()


@pytest.mark.parametrize("stops", [(), ("Chec",)])
def test_release_token_by_token_equals_the_parse(stops):
  """Fed one token at a time, the chat release and deltas reproduce
  parse_completion of the whole text, and never send text that a later
  token turns into a marker."""
  text = chat.assistant_text(TURN) + chat.END_OF_TURN
  tokens = [int(t) for t in TOK.encode(text)]
  cut = min([text.find(s) for s in stops if s in text] +
            [text.find(chat.END_OF_TURN)])
  final = [int(t) for t in TOK.encode(text[:cut])]
  rel = streaming.Release(TOK, streaming.chat_hold(stops))
  deltas = streaming.ChatDeltas()
  got = {"reasoning_content": "", "content": ""}
  for i in range(1, len(final) + 1):
    ids, _ = rel.update(tokens[:i], final=False)
    if ids:
      for k, v in deltas.update(rel.text).items():
        got[k] += v
    assert not any(m in rel.text for m in (chat.END_OF_TURN,) + stops)
  rel.update(final, final=True)
  delta, message = deltas.finish(rel.text)
  for k, v in delta.items():
    got[k] += v
  assert message == chat.parse_completion(text[:cut])
  assert got["content"] == message["content"]
  assert got["reasoning_content"] == message["reasoning"]


def test_release_holds_back_a_split_character():
  """A character split over byte tokens is sent whole, once complete."""
  rel = streaming.Release(TOK, streaming.completion_hold(()))
  ids = [int(t) for t in TOK.encode("aé")]   # 'a', then two bytes
  assert rel.update(ids[:2], final=False) == ([ids[0]], "a")
  assert rel.update(ids, final=False) == (ids[1:], "é")


# ---------------------------------------------------- security, errors --

def test_the_key_is_required(server):
  with pytest.raises(openai.AuthenticationError) as e:
    _client(server, key="wrong").models.list()
  assert e.value.status_code == 401
  assert e.value.body["code"] == "invalid_api_key"
  r = _post(server, "/v1/completions", {"model": NAME, "prompt": "x"},
            key=None)
  assert r.status_code == 401 and set(r.json()["error"]) == {
      "message", "type", "param", "code"}


def test_a_public_host_needs_a_key():
  app_lib.check_host("127.0.0.1", None)
  app_lib.check_host("::1", None)
  app_lib.check_host("0.0.0.0", "k")
  with pytest.raises(app_lib.ServeError, match="--host=0.0.0.0"):
    app_lib.check_host("0.0.0.0", None)
  with pytest.raises(app_lib.ServeError):
    app_lib.check_host("example.org", "")


_OK = {"model": NAME, "prompt": "hi", "max_tokens": 2}
_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", '{"model": "tiny-test", "prompt": ', 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {**_OK, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {**_OK, "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {**_OK, "max_tokens": 260}, 400, "max_tokens"),
    ("/v1/completions", {**_OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**_OK, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**_OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**_OK, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**_OK, "n": 5}, 400, "n"),
    ("/v1/completions", {**_OK, "seed": -1}, 400, "seed"),
    ("/v1/completions", {**_OK, "seed": 2**31, "n": 2}, 400, "seed"),
    ("/v1/completions", {**_OK, "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ("/v1/completions", {**_OK, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**_OK, "prompt": [1, 999]}, 400, "prompt"),
    ("/v1/completions", {**_OK, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**_OK, "frequency_penalty": 1.0}, 400,
     "frequency_penalty"),
    ("/v1/chat/completions", {**_CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**_CHAT, "messages": [
        {"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {**_CHAT, "messages": [
        {"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]},
     400, "messages"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/nowhere", {}, 404, None),
])
def test_bad_input_gets_a_4xx_in_openai_shape(server, path, body, status,
                                              param):
  r = _post(server, path, body)
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert set(error) == {"message", "type", "param", "code"}
  assert error["type"] == "invalid_request_error" and error["message"]
  assert error["param"] == param


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(server):
  """(Found by the fuzz test: a top_k over int32 crashed the engine step.)"""
  r = _post(server, "/v1/completions", {**_OK, "top_k": 2982085688,
                                        "seed": 2**31 - 1, "n": 2})
  assert r.status_code == 200, r.text
  assert server.loop.stats["engine_failures"] == 0


# ----------------------------------------------------- the engine loop --

def _wait_idle(loop, timeout=20.0):
  deadline = time.time() + timeout
  while loop.engine.has_work():
    assert time.time() < deadline, "the engine did not go idle"
    time.sleep(0.02)


def test_a_closed_stream_frees_its_pages(server):
  loop = server.loop
  _wait_idle(loop)
  free, aborted = loop.engine.pool.free_pages, loop.stats["aborted"]
  body = {**_OK, "prompt": "go", "max_tokens": 120, "temperature": 0,
          "stream": True}
  with requests.post(server.url + "/v1/completions", json=body, stream=True,
                     headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30) as r:
    lines = (line for line in r.iter_lines() if line)
    assert next(lines).decode().startswith("data: {")
    # The first event may come before the engine admits the request: read
    # on until it holds pages (its tokens are streaming).
    deadline = time.time() + 10
    while loop.engine.pool.free_pages >= free:
      assert time.time() < deadline, "the request never held pages"
      assert next(lines, None) is not None, "the stream ended first"
    # It holds pages now; closing the stream must give them back.
  _wait_idle(loop)
  deadline = time.time() + 5
  while loop.stats["aborted"] == aborted:
    assert time.time() < deadline, "the request was not aborted"
    time.sleep(0.02)
  assert loop.engine.pool.free_pages == free


def test_concurrent_requests_share_decode_steps(server):
  """Requests join a running batch: while one long stream is decoding,
  three more requests arrive and are decoded in the same steps (and get
  the answers they get alone)."""
  loop = server.loop
  _wait_idle(loop)
  loop.stats["max_rows"] = 0
  c = _client(server)
  stream = c.completions.create(model=NAME, prompt=[3, 4], max_tokens=120,
                                temperature=0, stream=True)
  next(iter(stream))            # the long request is decoding now

  async def more():
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                  max_retries=0) as client:
      return await asyncio.gather(*[
          client.completions.create(model=NAME, prompt=[5 + i, 4],
                                    max_tokens=8, temperature=0)
          for i in range(3)])
  out = asyncio.run(more())
  assert loop.engine.has_work()  # the long one is still going
  stream.close()
  assert loop.stats["max_rows"] > 1
  for i, r in enumerate(out):    # batching changes no answer
    assert r.choices[0].token_ids == _reference(
        [5 + i, 4], SamplingParams(temperature=0, max_tokens=8,
                                   stop_token_ids=(TOK.eos_id,)))[0].tokens


def test_an_engine_failure_fails_only_its_requests(server, monkeypatch):
  """A step that raises answers 500 in OpenAI's shape; the next request is
  served by a fresh engine."""
  loop = server.loop
  _wait_idle(loop)

  def broken():
    raise RuntimeError("injected")
  monkeypatch.setattr(loop.engine, "step", broken)
  with pytest.raises(openai.InternalServerError) as e:
    _client(server).completions.create(model=NAME, prompt="x", max_tokens=2)
  assert "injected" in e.value.body["message"]
  r = _client(server).completions.create(model=NAME, prompt="x",
                                         max_tokens=2, temperature=0)
  assert len(r.choices[0].token_ids) == 2


def test_swapped_weights_carry_a_new_policy_version(server):
  loop = server.loop
  old = loop.policy_version
  assert loop.swap_weights(_variables(), old + 7).result(20) == old + 7
  r = _client(server).completions.create(model=NAME, prompt="x",
                                         max_tokens=1, temperature=0)
  assert r.policy_version == old + 7
  assert _client(server).models.list().data[0].policy_version == old + 7


# ---------------------------------------------------------------- fuzz --

def test_fuzz_the_openapi_schema(server):
  """Generated requests (valid and invalid by the schema) never get a 5xx,
  and every answer conforms to the documented statuses and shapes."""
  raw = requests.get(server.url + "/openapi.json", timeout=30).json()
  # Bounds on the work of one generated request (the test's time budget):
  # few tokens and prompts; the rest of the schema is the server's own.
  for name in ("CompletionRequest", "ChatRequest"):
    props = raw["components"]["schemas"][name]["properties"]
    assert props["model"]["enum"] == [NAME]
    assert props["n"]["maximum"] == ENGINE.max_batch
    props["max_tokens"]["anyOf"][0]["maximum"] = 4
    raw["components"]["schemas"][name]["required"].append("max_tokens")
  for variant in raw["components"]["schemas"]["CompletionRequest"][
      "properties"]["prompt"]["anyOf"][1:]:
    variant["maxItems"] = 3
  chat_props = raw["components"]["schemas"]["ChatRequest"]["properties"]
  chat_props["max_completion_tokens"]["anyOf"][0]["maximum"] = 4
  schema = schemathesis.openapi.from_dict(raw)
  checks = [st_checks.not_a_server_error, oa_checks.status_code_conformance,
            oa_checks.content_type_conformance,
            oa_checks.response_schema_conformance]
  headers = {"Authorization": f"Bearer {KEY}"}
  for result in schema.get_all_operations():
    op = result.ok()
    modes = [schemathesis.GenerationMode.POSITIVE]
    if op.method.upper() == "POST":   # a GET has no input to get wrong
      modes.append(schemathesis.GenerationMode.NEGATIVE)
    for mode in modes:

      @hypothesis.settings(max_examples=20, derandomize=True, deadline=None,
                           database=None,
                           suppress_health_check=list(hypothesis.HealthCheck))
      @hypothesis.given(case=op.as_strategy(generation_mode=mode))
      def check(case):
        response = case.call(base_url=server.url, headers=headers,
                             timeout=30)
        case.validate_response(response, checks=checks)
      check()


# ------------------------------------------------ the load benchmark --

def test_load_benchmark_counts_nothing_lost_or_corrupted(server):
  """benchmarks/serve_load.py against the live server: every stream checks
  out, and batched greedy answers equal the ones sent alone."""
  prompts = [[TOK.bos_id, 40 + i, 41, 42] for i in range(3)]
  r = serve_load.run_load(server.url, KEY, NAME, prompts, clients=4,
                          requests_per_client=2, max_tokens=6,
                          tokenizer=TOK, warmup=False)
  assert (r["requests"], r["lost"], r["corrupted"], r["differs_from_alone"],
          r["alone_failed"]) == (8, 0, 0, 0, 0), r["problems"]
  assert r["completion_tokens"] == 8 * 6
  assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]


def test_serve_refuses_a_public_host_without_a_key():
  """experiments.serve stops with one line before loading anything."""
  env = {k: v for k, v in os.environ.items() if k != "M2JAX_API_KEY"}
  p = subprocess.run([sys.executable, "-m", "experiments.serve",
                      "--preset=tiny", "--host=0.0.0.0"], env=env,
                     capture_output=True, text=True, timeout=120,
                     check=False)
  [line] = p.stderr.strip().splitlines()
  assert p.returncode == 2 and line.startswith("error: --host=0.0.0.0")
