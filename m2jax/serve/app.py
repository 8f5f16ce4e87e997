"""The OpenAI-compatible HTTP server: FastAPI routes over the engine loop.

  GET  /v1/models             the one model served
  POST /v1/completions        text or token-id prompts
  POST /v1/chat/completions   messages through the chat template
                              (m2jax/data/chat.py, the one SFT trains on)

Both POST routes stream by server-sent events with "stream": true (`data:
{chunk}` events, then `data: [DONE]`); the shapes and extensions (token ids,
log-probs, policy version) are in m2jax/serve/protocol.py.

Chat. The messages are rendered with `chat.render(...,
add_generation_prompt=True)` (tools, when given, are listed in the system
turn); generation stops at END_OF_TURN ("<|end|>") or EOS, and the text is
read back with `chat.parse_completion`: a leading <think> block becomes
`reasoning_content`, each <tool_call>{"name", "arguments"}</tool_call>
becomes an OpenAI tool call (finish_reason "tool_calls"), the rest is
`content`. An assistant message sent back with `reasoning_content` keeps its
think block in the prompt (interleaved thinking, SPEC §3).

Security. With an API key set every /v1 route needs `Authorization: Bearer
KEY` (401 otherwise); `check_host` refuses to listen beyond loopback without
a key. Every refusal is OpenAI's error shape; a client that goes away
(mid-stream or while waiting) has its request aborted and its KV pages
freed.

Limits: n <= the engine's max_batch (each sample is a row of the batch);
prompt + max_tokens <= the engine's max_seq_len; with `max_body_bytes`, a
larger request body gets a 413 before it is parsed; the rest in
protocol.py.

Recording. A `Recorder` (m2jax/rl/gateway.py) sees every generation call:
it may refuse one (an ApiError), and it is given each finished sample as
sampled, stop string included (the end-of-turn marker RL trains on), while
the client gets the sample cut before the stop string as without a
recorder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import time
import uuid
from typing import Any, AsyncIterator, Mapping, Protocol

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from m2jax.data import chat
from m2jax.errors import UserError
from m2jax.infer.engine import Sample
from m2jax.infer.sampling import SamplingParams
from m2jax.serve import protocol as proto
from m2jax.serve import streaming
from m2jax.serve.loop import EngineLoop, Ticket

_ERRORS = {status: {"model": proto.ErrorResponse}
           for status in (400, 401, 404, 500)}
ERROR_RESPONSES = _ERRORS   # for routes added to the app (the gateway's)
_DISCONNECT_POLL_S = 1.0   # how often a waiting non-streamed request checks


class ServeError(UserError, ValueError):
  """A server setting that is refused (e.g. an open host without a key)."""


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def check_host(host: str, api_key: str | None) -> None:
  """Refuse to listen beyond this machine without an API key."""
  if not is_loopback(host) and not api_key:
    raise ServeError(f"--host={host} is reachable from other machines; set "
                     "an API key (--api_key or M2JAX_API_KEY) or serve on "
                     "127.0.0.1")


# ------------------------------------------------------------ recording --

class Recording(Protocol):
  """One admitted generation call of a recorder."""

  def done(self, prompt: list[int], sample: Sample,
           policy_version: int) -> None:
    """A sample finished (its tokens as sampled, stop string included)."""

  def close(self) -> None:
    """The call is over, finished or not (called once or more)."""


class Recorder(Protocol):
  """What records the server's generation calls (m2jax/rl/gateway.py)."""

  async def begin(self, headers: Mapping[str, str], *, prompts: int,
                  n: int) -> Recording | None:
    """Admit a call of `prompts` prompts and n samples each: its Recording,
    None to serve it unrecorded, or raise proto.ApiError to refuse it."""


def without_stop(sample: Sample, stops, tokenizer) -> Sample:
  """`sample`, generated with include_stop_str_in_output, as it would be
  without: cut before the first stop string, by the engine's own rule (the
  shortest token prefix whose text reaches the cut, m2jax/infer/engine.py),
  so a client sees the same tokens whether or not the call is recorded."""
  if sample.finish_reason != "stop" or not stops or tokenizer is None:
    return sample

  def text(ids) -> str:
    return tokenizer.decode(np.asarray(ids, np.int64))

  found = [i for i in (text(sample.tokens).find(s) for s in stops) if i >= 0]
  if not found:                 # stopped by a stop token
    return sample
  cut = min(found)
  n = next(n for n in range(len(sample.tokens) + 1)
           if len(text(sample.tokens[:n])) >= cut)
  return sample._replace(tokens=list(sample.tokens[:n]),
                         logprobs=list(sample.logprobs[:n]))


class _BodyLimit:
  """ASGI middleware: a body over `limit` bytes gets a 413 (OpenAI's error
  shape) before anything parses it. The body is read here, so a chunked
  request without Content-Length is bounded too, then handed on whole."""

  def __init__(self, app, limit: int):
    self.app, self.limit = app, limit

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None:
      if not declared.isdigit():
        return await self._refuse(scope, receive, send, 400,
                                  "Content-Length is not a number")
      if int(declared) > self.limit:
        return await self._refuse(scope, receive, send, 413, None)
    chunks, size, more = [], 0, True
    while more:
      message = await receive()
      if message["type"] != "http.request":  # the client went away
        return None
      chunks.append(message.get("body", b""))
      size += len(chunks[-1])
      if size > self.limit:
        return await self._refuse(scope, receive, send, 413, None)
      more = message.get("more_body", False)
    body = [{"type": "http.request", "body": b"".join(chunks),
             "more_body": False}]

    async def replay():
      # The body once, then the connection's own messages (a disconnect).
      return body.pop() if body else await receive()
    return await self.app(scope, replay, send)

  async def _refuse(self, scope, receive, send, status, message):
    err = proto.ApiError(status, message or f"the request body exceeds "
                         f"{self.limit} bytes", None,
                         "request_too_large" if status == 413 else None)
    await JSONResponse(err.body(), status_code=status)(scope, receive, send)


# ------------------------------------------------------------ one run --

class _Run:
  """The engine requests of one HTTP request (one per prompt) and their
  results as they arrive."""

  def __init__(self, loop: EngineLoop, prompts: list[list[int]],
               params: SamplingParams, recording: Recording | None = None):
    if recording is not None:   # it gets the stop string; the client not
      params = dataclasses.replace(params, include_stop_str_in_output=True)
    self.loop, self.prompts, self.params = loop, prompts, params
    self.recording = recording
    self.queue: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()
    self.tickets = [Ticket(p, params, aio, self.queue, tag=i)
                    for i, p in enumerate(prompts)]
    self.left = len(prompts) * params.n   # samples not finished
    self.version = loop.policy_version
    self._early: list[tuple] = []
    self.closed = False

  async def start(self) -> None:
    """Add the prompts; raise ApiError if the engine refuses one."""
    for t in self.tickets:
      self.loop.add(t)
    added = 0
    while added < len(self.tickets):
      item = await self.queue.get()
      if item[1] == "added":
        added += 1
        self.version = item[2]
      elif item[1] == "error":
        self.abort()
        raise proto.ApiError(item[2], item[3], item[4])
      else:
        self._early.append(item)

  async def items(self, request: Request | None = None) -> AsyncIterator:
    """("tokens", tag, index, ids, logprobs) and ("done", tag, index,
    Sample) until every sample is done; with `request` (not streamed),
    stops quietly when the client has gone."""
    while self.left:
      if self._early:
        item = self._early.pop(0)
      elif request is None:
        item = await self.queue.get()
      else:
        try:
          item = await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            self.abort()
            return
          continue
      tag, kind = item[0], item[1]
      if kind == "error":
        self.closed = True
        self._release()
        raise proto.ApiError(item[2], item[3], item[4])
      if kind == "done":
        self.left -= 1
        if self.recording is not None:
          self.recording.done(self.prompts[tag], item[3], self.version)
          item = item[:3] + (without_stop(item[3], self.params.stop,
                                          self.loop.tokenizer),)
      yield (kind, tag) + item[2:]
    self.closed = True
    self._release()

  def abort(self) -> None:
    """Stop every unfinished engine request (idempotent)."""
    if not self.closed:
      self.closed = True
      for t in self.tickets:
        self.loop.abort(t)
    self._release()

  def _release(self) -> None:
    if self.recording is not None:
      self.recording.close()


class _Stream(StreamingResponse):
  """Server-sent events that abort their run however the stream ends."""

  def __init__(self, body, run: _Run):
    super().__init__(body, media_type="text/event-stream",
                     headers={"Cache-Control": "no-cache"})
    self._run = run

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._run.abort()


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------- the app --

def create_app(loop: EngineLoop, *, model_name: str,
               api_key: str | None = None, recorder: Recorder | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
  """The FastAPI app serving `loop`'s engine as `model_name` (recording
  through `recorder`, bodies at most `max_body_bytes`: module docstring)."""
  app = FastAPI(title="m2jax", version="0.1.0", docs_url=None,
                redoc_url=None)
  if max_body_bytes is not None:
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
  tokenizer = loop.tokenizer
  vocab = loop.engine.model_config.vocab_size
  created = int(time.time())

  # --- errors --------------------------------------------------------
  @app.exception_handler(proto.ApiError)
  async def _api_error(_, exc: proto.ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_, exc: RequestValidationError):
    err = proto.validation_error(exc)
    return JSONResponse(err.body(), status_code=err.status)

  @app.exception_handler(StarletteHTTPException)
  async def _http(_, exc: StarletteHTTPException):
    err = proto.ApiError(exc.status_code, str(exc.detail),
                         code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)

  @app.exception_handler(Exception)
  async def _crash(_, exc: Exception):
    err = proto.ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=500)

  # --- the key -------------------------------------------------------
  @app.middleware("http")
  async def _auth(request: Request, call_next):
    if api_key and request.url.path.startswith("/v1"):
      given = request.headers.get("authorization", "")
      scheme, _, token = given.partition(" ")
      if scheme.lower() != "bearer" or not hmac.compare_digest(
          token.strip().encode(), api_key.encode()):
        err = proto.ApiError(401, "a valid API key is required "
                             "(Authorization: Bearer KEY)",
                             code="invalid_api_key")
        return JSONResponse(err.body(), status_code=401)
    return await call_next(request)

  # --- shared checks -------------------------------------------------
  def check_model(name: str) -> None:
    if name != model_name:
      raise proto.ApiError(404, f"the model {name!r} does not exist; this "
                           f"server serves {model_name!r}", "model",
                           "model_not_found")

  def encode(text: str) -> list[int]:
    if tokenizer is None:
      raise proto.ApiError(400, "this model has no tokenizer: send token "
                           "ids as the prompt", "prompt")
    return [tokenizer.bos_id] + [int(t) for t in tokenizer.encode(text)]

  def sampling(req, prompts: list[list[int]], max_tokens: int | None,
               extra_stops: tuple[str, ...] = ()) -> SamplingParams:
    limit = loop.max_seq_len
    longest = max(len(p) for p in prompts)
    where = "messages" if isinstance(req, proto.ChatRequest) else "prompt"
    if longest >= limit:
      raise proto.ApiError(400, f"the prompt has {longest} tokens; the "
                           f"context holds {limit}", where,
                           "context_length_exceeded")
    if max_tokens is None:
      max_tokens = 16 if where == "prompt" else limit - longest
    if longest + max_tokens > limit:
      raise proto.ApiError(400, f"the prompt ({longest} tokens) and "
                           f"max_tokens ({max_tokens}) exceed the context of "
                           f"{limit} tokens", "max_tokens",
                           "context_length_exceeded")
    max_n = loop.engine.config.max_batch
    if req.n > max_n:
      raise proto.ApiError(400, f"n={req.n} exceeds this server's most "
                           f"samples per prompt, {max_n}", "n")
    stops = req.stops()
    if stops and tokenizer is None:
      raise proto.ApiError(400, "stop strings need a tokenizer; this model "
                           "has none", "stop")
    try:
      return SamplingParams(
          temperature=req.temperature,
          # 0 keeps every token, as does any k >= the vocabulary.
          top_k=req.top_k if 0 < req.top_k < vocab else 0,
          top_p=req.top_p, seed=req.seed, max_tokens=max_tokens,
          stop_token_ids=(tokenizer.eos_id,) if tokenizer else (),
          stop=stops + extra_stops, n=req.n)
    except UserError as e:
      raise proto.ApiError(400, str(e)) from None

  async def begin(request: Request, prompts, params) -> Recording | None:
    if recorder is None:
      return None
    return await recorder.begin(request.headers, prompts=len(prompts),
                                n=params.n)

  def decode(ids) -> str:
    if tokenizer is None:
      return ""
    return tokenizer.decode(np.asarray(ids, np.int64))

  def token_texts(ids) -> list[str]:
    return [decode([t]) for t in ids]

  def usage(prompts, completion_tokens: int) -> dict:
    p = sum(len(x) for x in prompts)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens}

  # --- the schema: what this server accepts -------------------------
  def openapi() -> dict:
    """FastAPI's schema, with this server's model name and limits."""
    if app.openapi_schema is None:
      schema = get_openapi(title=app.title, version=app.version,
                           routes=app.routes)
      for name in ("CompletionRequest", "ChatRequest"):
        props = schema["components"]["schemas"][name]["properties"]
        props["model"]["enum"] = [model_name]
        props["n"]["maximum"] = loop.engine.config.max_batch
      _set_integer_maximum(schema["components"]["schemas"][
          "CompletionRequest"]["properties"]["prompt"], vocab - 1)
      app.openapi_schema = schema
    return app.openapi_schema
  app.openapi = openapi

  # --- routes --------------------------------------------------------
  @app.get("/v1/models", response_model=proto.ModelList, responses=_ERRORS)
  async def models():
    return {"object": "list", "data": [{
        "id": model_name, "object": "model", "created": created,
        "owned_by": "m2jax", "max_model_len": loop.max_seq_len,
        "policy_version": loop.policy_version}]}

  @app.post("/v1/completions", response_model=proto.CompletionResponse,
            responses={**_ERRORS, 200: {"content": {
                "text/event-stream": {}}}})
  async def completions(req: proto.CompletionRequest, request: Request):
    check_model(req.model)
    prompts = _prompt_ids(req.prompt, encode, vocab)
    params = sampling(req, prompts, req.max_tokens)
    run = _Run(loop, prompts, params, await begin(request, prompts, params))
    await run.start()
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}
    n = params.n

    def logprobs_of(ids, lps, offset_text: str) -> dict | None:
      if req.logprobs is None:
        return None
      texts = token_texts(ids)
      offsets, at = [], len(offset_text)
      for t in texts:
        offsets.append(at)
        at += len(t)
      return {"tokens": texts, "token_logprobs": list(lps),
              "top_logprobs": None, "text_offset": offsets}

    if not req.stream:
      samples = {}
      async for kind, tag, index, *rest in run.items(request):
        if kind == "done":
          samples[tag * n + index] = rest[0]
      if run.left:   # the client went away
        return JSONResponse({}, status_code=499)
      choices = []
      for i in range(len(prompts) * n):
        s = samples[i]
        choices.append({
            "index": i, "text": decode(s.tokens),
            "finish_reason": s.finish_reason,
            "logprobs": logprobs_of(s.tokens, s.logprobs, ""),
            "token_ids": s.tokens, "token_logprobs": s.logprobs,
            "prompt_token_ids": prompts[i // n]})
      return {**head, "object": "text_completion", "choices": choices,
              "usage": usage(prompts, sum(len(s.tokens)
                                          for s in samples.values())),
              "policy_version": run.version}

    hold = streaming.completion_hold(params.stop)
    releases = [streaming.Release(tokenizer, hold)
                for _ in range(len(prompts) * n)]
    raw: list[list] = [[[], []] for _ in releases]

    async def events():
      total = 0
      try:
        async for kind, tag, index, *rest in run.items():
          i = tag * n + index
          rel, (toks, lps) = releases[i], raw[i]
          before, text_before = len(rel.ids), rel.text
          if kind == "tokens":
            toks += rest[0]
            lps += rest[1]
            ids, text = rel.update(toks, final=False)
            reason = None
            if not ids:
              continue
          else:
            s = rest[0]
            toks[:], lps[:] = s.tokens, s.logprobs
            ids, text = rel.update(s.tokens, final=True)
            reason = s.finish_reason
            total += len(s.tokens)
          new_lps = lps[before:before + len(ids)]
          choice = {"index": i, "text": text, "finish_reason": reason,
                    "logprobs": logprobs_of(ids, new_lps, text_before),
                    "token_ids": ids, "token_logprobs": new_lps}
          if before == 0:
            choice["prompt_token_ids"] = prompts[tag]
          yield _sse({**head, "object": "text_completion",
                      "choices": [choice], "policy_version": run.version})
        if req.stream_options and req.stream_options.include_usage:
          yield _sse({**head, "object": "text_completion", "choices": [],
                      "usage": usage(prompts, total),
                      "policy_version": run.version})
      except proto.ApiError as e:
        yield _sse(e.body())
      yield "data: [DONE]\n\n"

    return _Stream(events(), run)

  @app.post("/v1/chat/completions", response_model=proto.ChatResponse,
            responses={**_ERRORS, 200: {"content": {
                "text/event-stream": {}}}})
  async def chat_completions(req: proto.ChatRequest, request: Request):
    check_model(req.model)
    if tokenizer is None:
      raise proto.ApiError(400, "this model has no tokenizer, so no chat "
                           "template: use /v1/completions with token ids",
                           "messages")
    messages = [m.as_chat() for m in req.messages]
    tools = req.tools if req.tool_choice != "none" else None
    try:
      ids, _ = chat.render(messages, tokenizer, tools=tools,
                           add_generation_prompt=True)
    except chat.ChatFormatError as e:
      raise proto.ApiError(400, str(e), "messages") from None
    prompt = [int(t) for t in ids]
    max_tokens = (req.max_completion_tokens if req.max_completion_tokens
                  is not None else req.max_tokens)
    params = sampling(req, [prompt], max_tokens, (chat.END_OF_TURN,))
    run = _Run(loop, [prompt], params, await begin(request, [prompt],
                                                   params))
    await run.start()
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": model_name}

    def logprobs_of(ids, lps) -> dict | None:
      if not req.logprobs:
        return None
      return {"content": [
          {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
          for t, lp in zip(token_texts(ids), lps)]}

    def tool_calls(message) -> list[dict]:
      return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": c["name"],
                            "arguments": json.dumps(c["arguments"],
                                                    ensure_ascii=False)}}
              for c in message.get("tool_calls", [])]

    def finish_reason(sample, message) -> str:
      if sample.finish_reason == "stop" and message.get("tool_calls"):
        return "tool_calls"
      return sample.finish_reason

    if not req.stream:
      samples = {}
      async for kind, _, index, *rest in run.items(request):
        if kind == "done":
          samples[index] = rest[0]
      if run.left:
        return JSONResponse({}, status_code=499)
      choices = []
      for i in range(params.n):
        s = samples[i]
        parsed = chat.parse_completion(decode(s.tokens))
        calls = tool_calls(parsed)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed["content"] if parsed["content"] or not calls
            else None}
        if "reasoning" in parsed:
          message["reasoning_content"] = parsed["reasoning"]
        if calls:
          message["tool_calls"] = calls
        choices.append({
            "index": i, "message": message,
            "finish_reason": finish_reason(s, parsed),
            "logprobs": logprobs_of(s.tokens, s.logprobs),
            "token_ids": s.tokens, "token_logprobs": s.logprobs,
            "prompt_token_ids": prompt})
      return {**head, "object": "chat.completion", "choices": choices,
              "usage": usage([prompt], sum(len(s.tokens)
                                           for s in samples.values())),
              "policy_version": run.version}

    hold = streaming.chat_hold(params.stop)
    releases = [streaming.Release(tokenizer, hold) for _ in range(params.n)]
    deltas = [streaming.ChatDeltas() for _ in range(params.n)]
    raw: list[list] = [[[], []] for _ in releases]

    async def events():
      total = 0
      try:
        async for kind, _, i, *rest in run.items():
          rel, (toks, lps) = releases[i], raw[i]
          before = len(rel.ids)
          if kind == "tokens":
            toks += rest[0]
            lps += rest[1]
            ids, _ = rel.update(toks, final=False)
            if not ids:
              continue
            delta, reason = deltas[i].update(rel.text), None
          else:
            s = rest[0]
            toks[:], lps[:] = s.tokens, s.logprobs
            ids, _ = rel.update(s.tokens, final=True)
            delta, parsed = deltas[i].finish(rel.text)
            calls = tool_calls(parsed)
            if calls:
              delta["tool_calls"] = [{"index": k, **c}
                                     for k, c in enumerate(calls)]
            reason = finish_reason(s, parsed)
            total += len(s.tokens)
          choice = {"index": i, "delta": delta, "finish_reason": reason,
                    "logprobs": logprobs_of(ids, lps[before:before +
                                                     len(ids)]),
                    "token_ids": ids,
                    "token_logprobs": lps[before:before + len(ids)]}
          if before == 0:
            delta["role"] = "assistant"
            choice["prompt_token_ids"] = prompt
          yield _sse({**head, "object": "chat.completion.chunk",
                      "choices": [choice], "policy_version": run.version})
        if req.stream_options and req.stream_options.include_usage:
          yield _sse({**head, "object": "chat.completion.chunk",
                      "choices": [], "usage": usage([prompt], total),
                      "policy_version": run.version})
      except proto.ApiError as e:
        yield _sse(e.body())
      yield "data: [DONE]\n\n"

    return _Stream(events(), run)

  return app


def _set_integer_maximum(schema, maximum: int) -> None:
  """Every integer in a JSON schema (token ids) at most `maximum`."""
  if isinstance(schema, dict):
    if schema.get("type") == "integer":
      schema["maximum"] = maximum
    for v in schema.values():
      _set_integer_maximum(v, maximum)
  elif isinstance(schema, list):
    for v in schema:
      _set_integer_maximum(v, maximum)


def _prompt_ids(prompt, encode, vocab: int) -> list[list[int]]:
  """The prompts of a /v1/completions request as token-id lists."""
  if isinstance(prompt, str):
    prompts = [encode(prompt)]
  elif prompt and all(isinstance(p, int) for p in prompt):
    prompts = [list(prompt)]
  elif prompt and all(isinstance(p, str) for p in prompt):
    prompts = [encode(p) for p in prompt]
  else:
    prompts = [list(p) for p in prompt]
  if not prompts:
    raise proto.ApiError(400, "prompt: give at least one prompt", "prompt")
  if len(prompts) > proto.MAX_PROMPTS:
    raise proto.ApiError(400, f"prompt: at most {proto.MAX_PROMPTS} prompts "
                         f"per request, got {len(prompts)}", "prompt")
  for p in prompts:
    if not p:
      raise proto.ApiError(400, "prompt: a prompt must hold at least one "
                           "token", "prompt")
    if min(p) < 0 or max(p) >= vocab:
      raise proto.ApiError(400, f"prompt: token ids must be in [0, {vocab})",
                           "prompt")
  return prompts


def serve(loop: EngineLoop, *, model_name: str, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None,
          log_level: str = "info", max_body_bytes: int | None = None) -> None:
  """Serve until interrupted (the engine loop must be started)."""
  # pylint: disable=import-outside-toplevel
  import uvicorn
  check_host(host, api_key)
  app = create_app(loop, model_name=model_name, api_key=api_key,
                   max_body_bytes=max_body_bytes)
  uvicorn.run(app, host=host, port=port, log_level=log_level)
