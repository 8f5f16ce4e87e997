"""Serving under load (experiments/bench_serve.py): `experiments.serve` in
a subprocess, many concurrent streaming clients, and what each got back.

Every request is a greedy /v1/completions stream of token-id prompts. A
request counts as lost when it fails or its stream breaks, and as corrupted
when its stream does not hold together: it must end with `data: [DONE]`,
give exactly one finish_reason, report as many token ids as
usage.completion_tokens, and stream text equal to the tokenizer's decoding
of those ids. Each prompt is sent by several clients; afterwards it is sent
once more alone (nothing else running), and every loaded answer is compared
with that one: batching must not change a greedy answer (on a GPU a
different batch shape may round differently, so these are counted apart).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(serve_args: list[str], log_path: str, *,
                 timeout: float = 900.0):
  """(process, base URL, API key, its banner line, model name) of
  `python -m experiments.serve` on a free loopback port. Its output goes
  to `log_path` (nothing can block on a full pipe), every JAX compilation
  logged there (`compiles_in`)."""
  port, key = free_port(), secrets.token_hex(16)
  cmd = [sys.executable, "-m", "experiments.serve", "--host=127.0.0.1",
         f"--port={port}", "--log_level=warning", *serve_args]
  env = {**os.environ, "M2JAX_API_KEY": key, "JAX_LOG_COMPILES": "1"}
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + timeout
  import requests  # pylint: disable=import-outside-toplevel
  while True:
    if proc.poll() is not None:
      with open(log_path) as f:
        tail = f.read()[-2000:]
      raise RuntimeError(f"experiments.serve exited ({proc.returncode}): "
                         f"{tail}")
    try:
      r = requests.get(url + "/v1/models", timeout=5,
                       headers={"Authorization": f"Bearer {key}"})
      if r.status_code == 200:
        return proc, url, key, _banner(log_path), r.json()["data"][0]["id"]
    except requests.ConnectionError:
      pass
    if time.time() > deadline:
      proc.kill()
      raise RuntimeError("experiments.serve did not answer in time")
    time.sleep(0.5)


def _banner(log_path: str) -> str:
  """The server's first "# ..." line (JAX's compile log and warnings come
  before it)."""
  with open(log_path) as f:
    return next((line.strip() for line in f if line.startswith("#")), "")


def compiles_in(log_path: str, after: int = 0) -> list[str]:
  """The JAX compilations a server logged (`start_server`'s log)
  past byte `after` of its log: one line each, the function and shapes."""
  with open(log_path, errors="replace") as f:
    f.seek(after)
    lines = [line.strip() for line in f if "Compiling " in line]
  # The variables' shapes come first; the batch's own arrays last.
  out = []
  for line in lines:
    shapes = line.split(". Argument mapping")[0]
    out.append(line[line.index("Compiling "):].split(" with ")[0] + " ... "
               + shapes[-240:])
  return out


def stop_server(proc) -> None:
  proc.terminate()
  try:
    proc.wait(30)
  except subprocess.TimeoutExpired:
    proc.kill()


async def _one(client, model: str, prompt: list[int], max_tokens: int,
               tokenizer) -> dict:
  """One streamed greedy completion: timings and the integrity checks."""
  start = time.perf_counter()
  first = None
  ids, text, reasons, usage, done, error = [], [], [], None, False, None
  try:
    async with client.completions.with_streaming_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}) as resp:
      async for line in resp.iter_lines():
        if not line.startswith("data: "):
          continue
        data = line[len("data: "):]
        if data == "[DONE]":
          done = True
          continue
        chunk = json.loads(data)
        if "error" in chunk:
          error = chunk["error"]["message"]
          continue
        if chunk.get("usage"):
          usage = chunk["usage"]
        for choice in chunk["choices"]:
          if choice["token_ids"] and first is None:
            first = time.perf_counter()
          ids += choice["token_ids"]
          text.append(choice["text"])
          if choice["finish_reason"] is not None:
            reasons.append(choice["finish_reason"])
  except Exception as e:  # pylint: disable=broad-except
    return {"lost": f"{type(e).__name__}: {e}"}
  end = time.perf_counter()
  problems = []
  if error:
    problems.append(f"error event: {error}")
  if not done:
    problems.append("no [DONE]")
  if len(reasons) != 1:
    problems.append(f"{len(reasons)} finish reasons")
  if usage is None or usage["completion_tokens"] != len(ids):
    problems.append("token count differs from usage")
  if tokenizer is not None and "".join(text) != tokenizer.decode(
      np.asarray(ids, np.int64)):
    problems.append("text differs from the decoded ids")
  return {"ids": ids, "ttft": (first or end) - start, "latency": end - start,
          "corrupted": problems}


async def _load(url, key, model, prompts, *, clients, requests_per_client,
                max_tokens, tokenizer, warmup):
  # pylint: disable=import-outside-toplevel
  import openai
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key,
                                max_retries=0, timeout=3600) as client:
    async def worker(c):
      out = []
      for r in range(requests_per_client):
        p = (c * requests_per_client + r) % len(prompts)
        out.append((p, await _one(client, model, prompts[p], max_tokens,
                                  tokenizer)))
      return out

    passes = []
    if warmup:
      # Every decode batch bucket (powers of two) at the lengths the load
      # reaches: the engine compiles one function per shape it meets.
      c = 1
      while c < clients:
        await asyncio.gather(*[
            _one(client, model, prompts[i % len(prompts)], max_tokens,
                 tokenizer) for i in range(c)])
        c *= 2
    # With warmup the same load runs twice: the first pass may still meet
    # (and compile) shapes; the second is the steady state.
    for _ in range(2 if warmup else 1):
      start = time.perf_counter()
      results = await asyncio.gather(*[worker(c) for c in range(clients)])
      passes.append(([x for w in results for x in w],
                     time.perf_counter() - start))
    alone = [await _one(client, model, p, max_tokens, tokenizer)
             for p in prompts]
  return passes, alone


def run_load(url: str, key: str, model: str, prompts: list[list[int]], *,
             clients: int, requests_per_client: int, max_tokens: int,
             tokenizer=None, warmup: bool = True) -> dict:
  """Throughput, time to first token and the lost / corrupted counts of
  `clients` concurrent streaming clients (module docstring); with
  `warmup`, first 1, 2, 4, ... concurrent requests (below `clients`: each
  decode batch bucket), then the whole load twice, the second pass reported
  (the first as `cold_pass`)."""
  passes, alone = asyncio.run(_load(
      url, key, model, prompts, clients=clients,
      requests_per_client=requests_per_client, max_tokens=max_tokens,
      tokenizer=tokenizer, warmup=warmup))
  summary = _summary(passes[-1], alone, clients=clients, prompts=prompts,
                     max_tokens=max_tokens)
  if warmup:  # the first pass: what a cold server (compiling) gives
    cold = _summary(passes[0], alone, clients=clients, prompts=prompts,
                    max_tokens=max_tokens)
    summary["cold_pass"] = {k: cold[k] for k in (
        "seconds", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "lost",
        "corrupted")}
  return summary


def _summary(timed, alone, *, clients, prompts, max_tokens) -> dict:
  """The numbers of one pass of the load (run_load)."""
  results, seconds = timed
  ok = [(p, r) for p, r in results if "lost" not in r]
  lost = [r["lost"] for _, r in results if "lost" in r]
  corrupted = [r["corrupted"] for _, r in ok if r["corrupted"]]
  differs = sum(r["ids"] != alone[p].get("ids") for p, r in ok)
  ttft = sorted(r["ttft"] for _, r in ok)
  tokens = sum(len(r["ids"]) for _, r in ok)

  def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None
  return {
      "clients": clients, "requests": len(results),
      "prompts": len(prompts), "prompt_tokens": len(prompts[0]),
      "max_tokens": max_tokens, "seconds": seconds,
      "completion_tokens": tokens, "tokens_per_s": tokens / seconds,
      "requests_per_s": len(ok) / seconds,
      "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
      "latency_p50_s": pct([r["latency"] for _, r in ok], 50),
      "lost": len(lost), "corrupted": len(corrupted),
      "differs_from_alone": differs,
      "alone_failed": sum("lost" in a or bool(a["corrupted"])
                          for a in alone),
      "problems": (lost + [" / ".join(c) for c in corrupted])[:10],
      "mean_tokens_per_request": (statistics.mean(
          len(r["ids"]) for _, r in ok) if ok else 0),
  }
