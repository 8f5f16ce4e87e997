"""Load and SIGKILL of the recording gateway as a separate process (issue
16's load target), run by experiments/bench_gateway.py.

A gateway is `python -m experiments.serve --record` started here on a free
loopback port with a random key. A session is what a black-box agent does
through it, with the official `openai` client and nothing else: `calls`
completions, each prompt the previous prompt plus the completion plus a
few "tool output" tokens (so the gateway continues one branch), then
POST /v1/sessions/{id}/end with a reward (an outcome its harness
verified). All `sessions` run at once, one thread each.

Rounds:
  load   every session ends; then the pool must hold each session once,
         whole and exactly as served: each call's prompt, the tokens and
         log-probs the client received, in order.
  kill   the same, but the gateway is SIGKILLed the moment `kill_after`
         sessions have had their end acknowledged; the calls in flight
         fail. Then every acknowledged session must be in the pool, whole
         (a commit acknowledged before it was durable would be lost), and
         the load round's sessions untouched; a session whose end was in
         flight may or may not be there, and if there it is whole.
  refuse while the load round runs, requests without the key, with a
         malformed body and with a body over the server's limit each get
         their 4xx, and the sessions are untouched (their checks above).

Everything is measured on the client's clock: wall seconds, sessions and
generated tokens per second.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import requests

from benchmarks import serve_load
from m2jax.rl import gateway as gw_lib
from m2jax.rl.pool import Pool

HEADER = gw_lib.SESSION_HEADER
TOOL_TOKENS = [10, 62, 32]   # "\n> ": the tool output every call appends


@dataclasses.dataclass
class Sent:
  """What one session's client sent and received."""
  calls: list = dataclasses.field(default_factory=list)  # (prompt, ids, lps)
  acknowledged: bool = False
  error: str | None = None


def start_gateway(serve_args: list[str], pool_path: str, port: int,
                  key: str, timeout_s: float) -> subprocess.Popen:
  """experiments.serve --record on `port`, once it answers /v1/models."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.serve", "--record",
       f"--pool={pool_path}", f"--port={port}", f"--api_key={key}",
       "--log_level=warning", *serve_args],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + timeout_s
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"the gateway exited: {proc.stdout.read()[-2000:]}")
    if time.time() > deadline:
      proc.kill()
      raise RuntimeError(f"the gateway did not answer in {timeout_s} s")
    try:
      requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=1,
                   headers={"Authorization": f"Bearer {key}"})
      return proc
    except requests.ConnectionError:
      time.sleep(0.2)


def session(url: str, key: str, sid: str, model: str, calls: int,
            max_tokens: int, sent: Sent, ended: threading.Event | None,
            on_ack) -> None:
  """One black-box session; records into `sent`; on_ack() after its end
  is acknowledged."""
  client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                         timeout=300, default_headers={HEADER: sid})
  rng = np.random.default_rng(abs(hash(sid)) % 2**32)
  prompt = [1] + [int(x) for x in rng.integers(40, 120, size=16)]
  try:
    for _ in range(calls):
      choice = client.completions.create(
          model=model, prompt=prompt, max_tokens=max_tokens,
          temperature=1.0, seed=int(rng.integers(2**31))).choices[0]
      ids, lps = list(choice.token_ids), list(choice.token_logprobs)
      sent.calls.append((prompt, ids, lps))
      prompt = prompt + ids + TOOL_TOKENS
    if ended is not None and ended.is_set():
      raise RuntimeError("the gateway is gone")
    r = requests.post(f"{url}/v1/sessions/{sid}/end", timeout=300,
                      json={"reward": float(len(sent.calls))},
                      headers={"Authorization": f"Bearer {key}"})
    if r.status_code != 200:
      raise RuntimeError(f"end: {r.status_code} {r.text[:200]}")
    sent.acknowledged = True
    on_ack()
  except Exception as e:  # pylint: disable=broad-except
    sent.error = f"{type(e).__name__}: {e}"[:300]


def run_round(url: str, key: str, model: str, ids: list[str], calls: int,
              max_tokens: int, *, kill: tuple[int, subprocess.Popen] | None
              = None, during=None) -> tuple[dict[str, Sent], dict]:
  """All sessions `ids` at once. kill = (after, process): SIGKILL it once
  `after` ends are acknowledged. during(): run while they generate."""
  sent = {sid: Sent() for sid in ids}
  lock, acks, gone = threading.Lock(), [0], threading.Event()
  killed_at = {}

  def on_ack():
    with lock:
      acks[0] += 1
      if kill and acks[0] == kill[0] and not gone.is_set():
        os.kill(kill[1].pid, signal.SIGKILL)
        gone.set()
        killed_at["acknowledged"] = acks[0]
        killed_at["seconds"] = time.perf_counter() - start

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(ids)) as ex:
    futures = [ex.submit(session, url, key, sid, model, calls, max_tokens,
                         sent[sid], gone if kill else None, on_ack)
               for sid in ids]
    extra = during() if during else None
    for f in futures:
      f.result()
  wall = time.perf_counter() - start
  tokens = sum(len(c[1]) for s in sent.values() for c in s.calls)
  stats = {"sessions": len(ids), "wall_s": wall,
           "acknowledged": sum(s.acknowledged for s in sent.values()),
           "errors": sum(s.error is not None for s in sent.values()),
           "generated_tokens": tokens,
           "sessions_per_s": len(ids) / wall, "tokens_per_s": tokens / wall,
           **({"killed_after": killed_at} if kill else {}),
           **({"refusals": extra} if extra is not None else {})}
  first_errors = [s.error for s in sent.values() if s.error][:3]
  if first_errors:
    stats["first_errors"] = first_errors
  return sent, stats


def refusals(url: str, key: str, max_body_bytes: int) -> dict:
  """Status codes of bad requests (no key, malformed, oversized)."""
  body = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
  auth = {"Authorization": f"Bearer {key}", HEADER: "refused"}
  return {
      "no_key": requests.post(url + "/v1/completions", json=body,
                              timeout=60).status_code,
      "wrong_key": requests.post(
          url + "/v1/completions", json=body, timeout=60,
          headers={"Authorization": "Bearer nope"}).status_code,
      "malformed_json": requests.post(
          url + "/v1/completions", data=b"{not json", timeout=60,
          headers={**auth, "Content-Type": "application/json"}).status_code,
      "bad_field": requests.post(
          url + "/v1/completions", timeout=60, headers=auth,
          json={**body, "max_tokens": -3}).status_code,
      "oversized": requests.post(
          url + "/v1/completions", timeout=60,
          headers={**auth, "Content-Type": "application/json"},
          data=json.dumps({**body, "pad": "x" * (max_body_bytes + 1)})
      ).status_code}


def check_pool(pool_path: str, sent: dict[str, Sent],
               must_have: set[str]) -> dict:
  """Which sessions the pool holds, and whether each is exactly as sent.

  Returns counts: stored, missing (of must_have: must be 0), mismatched
  (stored but not as served: must be 0), extra (stored, not acknowledged:
  ends in flight at the kill)."""
  with Pool(pool_path) as pool:
    stored = {t.trajectory_id: t for t in pool.untrained()
              if t.trajectory_id in sent}
  mismatched = []
  for sid, t in stored.items():
    calls = sent[sid].calls
    same = (len(t.steps) == len(calls) and t.reward == float(len(calls))
            and all(step.state.tolist() == p and step.action.tolist() == ids
                    and np.allclose(step.logprobs, np.float32(lps), atol=0)
                    for step, (p, ids, lps) in zip(t.steps, calls)))
    if not same:
      mismatched.append(sid)
  return {"stored": len(stored),
          "missing": sorted(must_have - set(stored)),
          "mismatched": mismatched,
          "extra": len(set(stored) - must_have)}


def run(serve_args: list[str], workdir: str, *, sessions: int, calls: int,
        max_tokens: int, kill_after: int, model: str,
        start_timeout_s: float, max_body_bytes: int) -> dict:
  """The load, refuse and kill rounds (module docstring)."""
  os.makedirs(workdir, exist_ok=True)
  pool_path = os.path.join(workdir, "gateway_pool.sqlite")
  for suffix in ("", "-wal", "-shm"):
    if os.path.exists(pool_path + suffix):
      os.remove(pool_path + suffix)
  key = secrets.token_hex(8)
  args = [*serve_args, f"--max_body_bytes={max_body_bytes}"]
  out = {"sessions": sessions, "calls_per_session": calls,
         "max_tokens": max_tokens}

  port = serve_load.free_port()
  url = f"http://127.0.0.1:{port}"
  start = time.perf_counter()
  proc = start_gateway(args, pool_path, port, key, start_timeout_s)
  out["start_s"] = time.perf_counter() - start
  try:
    # A first round of the same size compiles what the load round uses.
    _, out["warm"] = run_round(url, key, model,
                               [f"warm-{i}" for i in range(sessions)],
                               calls, max_tokens)
    load_ids = [f"load-{i}" for i in range(sessions)]
    load_sent, out["load"] = run_round(
        url, key, model, load_ids, calls, max_tokens,
        during=lambda: refusals(url, key, max_body_bytes))
    kill_ids = [f"kill-{i}" for i in range(sessions)]
    kill_sent, out["kill"] = run_round(url, key, model, kill_ids, calls,
                                       max_tokens, kill=(kill_after, proc))
  finally:
    proc.kill()
    proc.wait(60)
  out["load"]["pool"] = check_pool(
      pool_path, load_sent, {s for s in load_ids if load_sent[s].acknowledged})
  acknowledged = {s for s in kill_ids if kill_sent[s].acknowledged}
  out["kill"]["pool"] = check_pool(pool_path, kill_sent, acknowledged)
  load_pool, kill_pool = out["load"]["pool"], out["kill"]["pool"]
  out["ok"] = {
      "load_every_session_once": (out["load"]["acknowledged"] == sessions
                                  and load_pool["stored"] == sessions
                                  and not load_pool["missing"]
                                  and not load_pool["mismatched"]),
      "refusals_are_4xx": all(400 <= c < 500 for c in
                              out["load"]["refusals"].values()),
      "kill_lost_nothing_acknowledged": (not kill_pool["missing"]
                                         and not kill_pool["mismatched"]
                                         and "killed_after" in out["kill"])}
  return out
