"""The recording gateway (m2jax/rl/gateway.py): sessions of OpenAI-client
agents recorded on a live loopback server and committed to the data pool,
its refusals, concurrent sessions and timeouts, and a SIGKILLed gateway
process (the tiny model) whose committed trajectories survive."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest
import requests

from m2jax.data import chat
from m2jax.infer.engine import Sample
from m2jax.rl import gateway as gw_lib
from m2jax.rl import prefix_tree
from m2jax.rl import trainer as trainer_lib
from m2jax.rl.envs import base as envs_base
from m2jax.rl.pool import Pool
from m2jax.serve import app as app_lib
from test_serve import CFG, ENGINE, KEY, NAME, TOK, _Live

HEADER = gw_lib.SESSION_HEADER
END_IDS = [int(t) for t in TOK.encode(chat.END_OF_TURN)]


class _ScriptedLoop:
  """An engine loop stand-in: the answer to a prompt of L tokens is the text
  "okL", then the end-of-turn marker and more text, cut at the request's
  stop strings by the engine's rule (after the stop string with
  include_stop_str_in_output, before it without), else at max_tokens.
  Log-probs are -0.25, -0.26, ...; tokens come a few at a time."""

  def __init__(self):
    self.tokenizer, self.policy_version, self.max_seq_len = TOK, 5, 4096
    self.engine = type("E", (), {"model_config": CFG, "config": ENGINE})

  def add(self, ticket):
    p = ticket.params
    text = f"ok{len(ticket.prompt)}{chat.END_OF_TURN}and more"
    found = [text.find(s) for s in p.stop if s in text]
    if found:
      cut = min(found)
      if p.include_stop_str_in_output:
        cut += len(next(s for s in p.stop if text.find(s) == cut))
      tokens, reason = [int(t) for t in TOK.encode(text[:cut])], "stop"
    else:
      tokens, reason = [int(t) for t in TOK.encode(text)][:p.max_tokens], \
          "length"
    logprobs = [-0.25 - 0.01 * i for i in range(len(tokens))]
    ticket.post("added", self.policy_version)
    for i in range(0, len(tokens) - 3, 3):
      ticket.post("tokens", 0, tokens[i:i + 3], logprobs[i:i + 3])
    ticket.post("done", 0, Sample(tokens, logprobs, reason))

  def abort(self, ticket):
    pass


@contextlib.contextmanager
def _gateway(tmp_path, config=gw_lib.GatewayConfig(), verifier=None):
  """(live server, gateway, pool, loop) of a scripted gateway."""
  pool = Pool(tmp_path / "pool.sqlite")
  gateway = gw_lib.Gateway(pool, config, verifier=verifier)
  loop = _ScriptedLoop()
  live = _Live(gateway.create_app(loop, model_name=NAME, api_key=KEY))
  gateway.start()
  try:
    yield live, gateway, pool, loop
  finally:
    live.close()
    gateway.close()
    pool.close()


def _client(live, session=None, key=KEY):
  headers = {HEADER: session} if session else None
  return openai.OpenAI(base_url=live.url + "/v1", api_key=key,
                       max_retries=0, timeout=30, default_headers=headers)


def _post(live, path, body, session=None, key=KEY):
  headers = {"Content-Type": "application/json"}
  if key:
    headers["Authorization"] = f"Bearer {key}"
  if session:
    headers[HEADER] = session
  if not isinstance(body, (str, bytes)) and not callable(
      getattr(body, "__next__", None)):
    body = json.dumps(body)
  return requests.post(live.url + path, data=body, headers=headers,
                       timeout=30)


def _error(r, status):
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert set(error) == {"message", "type", "param", "code"}
  return error


def test_branch_point_continues_and_forks():
  def call(prompt, completion):
    return gw_lib.Call(np.asarray(prompt), np.asarray(completion),
                       np.zeros(len(completion), np.float32), 0, "stop",
                       -1, 0, False)
  calls = [call([1, 2, 3], [4, 5])]
  assert gw_lib.branch_point(np.asarray([1, 2, 3, 4, 5, 6]), calls) == (
      0, 5, True)
  calls.append(call([1, 2, 3, 4, 5, 6], [7]))
  assert gw_lib.branch_point(np.asarray([1, 2, 3, 4, 5, 6, 7, 0]),
                             calls) == (1, 7, True)
  # Rewritten context: forks from the longest shared prefix (a tie goes
  # to the later call, or to a call whose whole history is extended: a
  # step retried from an earlier state).
  assert gw_lib.branch_point(np.asarray([1, 2, 3, 4, 9]), calls) == (
      1, 4, False)
  assert gw_lib.branch_point(np.asarray([1, 2, 3, 4, 5, 8]), calls) == (
      0, 5, True)
  assert gw_lib.branch_point(np.asarray([1, 2, 3, 4, 5, 6, 0]), calls) == (
      1, 6, False)
  assert gw_lib.branch_point(np.asarray([9, 9]), calls) == (-1, 0, False)
  assert gw_lib.branch_point(np.asarray([1]), []) == (-1, 0, False)


SYSTEM = {"role": "system", "content": "Solve it."}
USER = {"role": "user", "content": "What is 6*7?"}


def test_a_session_is_recorded_as_branches_and_committed(tmp_path):
  """Four calls of one agent: a chat turn, the next turn after a tool result
  (continues it; streamed), a rewritten context (forks), and a raw
  completion extending that (continues). The client sees the plain
  server's answers; the pool gets one trajectory whose steps are the
  prompts, the sampled tokens with the end-of-turn marker, their log-probs
  and policy versions, and the branch structure; its steps pack into fewer
  tokens than they hold."""
  with _gateway(tmp_path) as (live, gateway, pool, loop):
    c = _client(live, "agent-1")
    r1 = c.chat.completions.create(model=NAME, messages=[SYSTEM, USER])
    [ch1] = r1.choices
    assert ch1.message.content == f"ok{len(ch1.prompt_token_ids)}"
    assert ch1.token_ids == [int(t) for t in TOK.encode(
        ch1.message.content)]           # the marker is not the client's
    history = [SYSTEM, USER, {"role": "assistant",
                              "content": ch1.message.content},
               {"role": "tool", "content": "42"}]
    chunks = list(c.chat.completions.create(model=NAME, messages=history,
                                            stream=True))
    prompt2 = chunks[0].choices[0].prompt_token_ids
    ids2 = [t for ch in chunks for t in ch.choices[0].token_ids]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
        f"ok{len(prompt2)}"
    assert ids2 == [int(t) for t in TOK.encode(f"ok{len(prompt2)}")]
    loop.policy_version = 6
    summary = [SYSTEM, {"role": "user", "content": "6*7 is asked; tool: 42"}]
    r3 = c.chat.completions.create(model=NAME, messages=summary)
    [ch3] = r3.choices
    prompt4 = ch3.prompt_token_ids + ch3.token_ids + END_IDS + [10]
    r4 = c.completions.create(model=NAME, prompt=prompt4, max_tokens=3)
    assert r4.choices[0].finish_reason == "length"
    assert pool.counts()["finished"] == 0     # nothing before the end

    status = requests.get(f"{live.url}/v1/sessions/agent-1", timeout=10,
                          headers={"Authorization": f"Bearer {KEY}"}).json()
    assert status == {"session_id": "agent-1", "status": "open",
                      "num_calls": 4, "in_flight": 0}
    r = _post(live, "/v1/sessions/agent-1/end",
              {"reward": 1.0, "verification": {"answer": "42"},
               "step_rewards": [0, 0.5, 0, 0]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["status"], out["trajectory_id"], out["num_calls"],
            out["ended_by"]) == ("committed", "agent-1", 4, "end")
    assert gateway.wait("agent-1", timeout=1).status == "committed"

    [t] = pool.untrained()
    assert (t.trajectory_id, t.group_id, t.task_id, t.env, t.reward) == (
        "agent-1", "agent-1", "agent-1", "agent", 1.0)
    prompts = [ch1.prompt_token_ids, prompt2, ch3.prompt_token_ids, prompt4]
    actions = [ch1.token_ids + END_IDS, ids2 + END_IDS,
               ch3.token_ids + END_IDS, r4.choices[0].token_ids]
    for step, prompt, action, version, reward in zip(
        t.steps, prompts, actions, [5, 5, 6, 6], [0, 0.5, 0, 0]):
      assert step.state.tolist() == prompt
      assert step.action.tolist() == action
      assert step.logprobs.dtype == np.float32
      np.testing.assert_array_equal(
          step.logprobs, np.float32(-0.25 - 0.01 * np.arange(len(action))))
      assert (step.policy_version, step.reward) == (version, reward)
    np.testing.assert_allclose(ch1.token_logprobs, t.steps[0].logprobs[
        :len(ch1.token_ids)], atol=1e-7)
    meta = t.verification["gateway"]
    assert t.verification["answer"] == "42"
    assert meta["parents"] == [-1, 0, 1, 2]
    assert meta["continues"] == [False, True, False, True]
    # The rewritten context shares the system turn and the user header.
    head = len(chat.render([SYSTEM], TOK)[0]) + len("<|user|>\n")
    assert meta["shared"][2] == head

    # Steps 2 and 4 hold steps 1 and 3 whole, and all share the head.
    seqs = trainer_lib.samples_of([t])[0]
    packed = prefix_tree.pack(seqs, row_len=512)
    assert packed.num_tokens == len(seqs[1]) + len(seqs[3]) - head
    assert packed.num_tokens < sum(len(s) for s in seqs) / 2

    # Ended once: another end, a call or a new session with its id (its
    # trajectory is in the pool) are refused.
    _error(_post(live, "/v1/sessions/agent-1/end", {"reward": 0}), 409)
    with pytest.raises(openai.ConflictError):
      c.chat.completions.create(model=NAME, messages=[USER])
    with pytest.raises(gw_lib.SessionError, match="already in the pool"):
      gateway.open_session("agent-1")

    # In process: a verifier without an outcome stores and discards; a
    # session without calls writes nothing.
    sid = gateway.open_session(verifier=lambda session: None)
    _client(live, sid).chat.completions.create(model=NAME, messages=[USER])
    out = gateway.end_session(sid)
    assert (out.status, out.trajectory_id, out.num_calls) == (
        "discarded", sid, 1)
    assert gateway.end_session(gateway.open_session()).status == "empty"
    assert pool.counts() == {"finished": 2, "trained": 0, "discarded": 1,
                             "untrained": 1}


def test_refusals_leave_a_concurrent_session_untouched(tmp_path):
  """No key, no or a bad session header, malformed or oversized bodies,
  several samples in one recorded call, an unknown session's end and bad
  outcomes get a 4xx in OpenAI's shape, while a session in progress goes
  on and commits; a public host without a key is refused."""
  config = gw_lib.GatewayConfig(max_body_bytes=20_000)
  with _gateway(tmp_path, config) as (live, gateway, pool, _):
    c = _client(live, "steady")
    first = c.chat.completions.create(model=NAME, messages=[USER])
    body = {"model": NAME, "messages": [USER]}
    assert _error(_post(live, "/v1/chat/completions", body, "steady",
                        key=None), 401)["code"] == "invalid_api_key"
    _error(_post(live, "/v1/sessions/steady/end", {"reward": 1}, key=None),
           401)
    assert _error(_post(live, "/v1/chat/completions", body), 400)[
        "code"] == "missing_session_id"
    assert _error(_post(live, "/v1/chat/completions", body, "bad id!"),
                  400)["code"] == "invalid_session_id"
    assert _error(_post(live, "/v1/chat/completions", '{"model": ',
                        "steady"), 400)["code"] == "invalid_json"
    big = {**body, "messages": [{"role": "user", "content": "x" * 30_000}]}
    assert _error(_post(live, "/v1/chat/completions", big, "steady"), 413)[
        "code"] == "request_too_large"
    chunked = (b"x" * 5000 for _ in range(5))   # no Content-Length
    _error(_post(live, "/v1/chat/completions", chunked, "steady"), 413)
    _error(_post(live, "/v1/chat/completions", {**body, "n": 2}, "steady"),
           400)
    assert _error(_post(live, "/v1/sessions/nobody/end", {"reward": 1}),
                  404)["code"] == "session_not_found"
    for bad in ({"reward": "high"}, {"reward": 1, "discard": "x"},
                {"reward": 1, "color": "red"}, {"reward": 1,
                                                "step_rewards": [1, 2]},
                {}):   # {}: the session has no verifier to judge it
      _error(_post(live, "/v1/sessions/steady/end", bad), 400)
    assert gateway.session("steady") is not None   # still open

    history = [USER, {"role": "assistant",
                      "content": first.choices[0].message.content},
               {"role": "user", "content": "and 7*6?"}]
    c.chat.completions.create(model=NAME, messages=history)
    r = _post(live, "/v1/sessions/steady/end", {"reward": 0.5})
    assert r.json()["status"] == "committed", r.text
    [t] = pool.untrained()
    assert t.trajectory_id == "steady" and t.reward == 0.5
    assert t.verification["gateway"]["parents"] == [-1, 0]
    assert gateway.stats["calls_recorded"] == 2
  with pytest.raises(app_lib.ServeError, match="--host=0.0.0.0"):
    gw_lib.serve(None, gateway, model_name=NAME, host="0.0.0.0")


def test_concurrent_sessions_are_committed_exactly_once(tmp_path):
  """Seven agents at once, three calls each: three end themselves, three
  opened by the RL loop (group, queue positions, a verifier) and one
  implicit without a verifier end by the idle timeout. Each is in the pool
  once: committed with its outcome, or stored and discarded with a
  reason."""
  def judge(session):
    return envs_base.Verification(len(session.calls) / 3, True,
                                  {"calls": len(session.calls)})
  config = gw_lib.GatewayConfig(session_timeout_s=1.5,
                                require_session=False)
  with _gateway(tmp_path, config) as (live, gateway, pool, _):
    # Without the header (allowed here): served as by the plain server,
    # not recorded.
    r = _client(live).chat.completions.create(model=NAME, messages=[USER])
    assert r.choices[0].token_ids == [int(t) for t in TOK.encode(
        r.choices[0].message.content)]
    assert gateway.stats["unrecorded_calls"] == 1
    loop_ids = [gateway.open_session(f"rl-{i}", group_id="g0",
                                     task_id="t0", queue_seq=100 + i,
                                     verifier=judge) for i in range(3)]
    with pytest.raises(gw_lib.SessionError):
      gateway.open_session("rl-0")
    agents = [f"agent-{i}" for i in range(3)] + loop_ids + ["idle"]

    async def agent(sid):
      async with openai.AsyncOpenAI(
          base_url=live.url + "/v1", api_key=KEY, max_retries=0,
          default_headers={HEADER: sid}) as client:
        messages = [{"role": "user", "content": f"task of {sid}"}]
        for turn in range(3):
          r = await client.chat.completions.create(model=NAME,
                                                   messages=messages)
          messages += [{"role": "assistant",
                        "content": r.choices[0].message.content},
                       {"role": "tool", "content": str(turn)}]
      if sid.startswith("agent"):
        r = await asyncio.to_thread(_post, live, f"/v1/sessions/{sid}/end",
                                    {"reward": 1.0})
        assert r.status_code == 200, r.text

    async def everyone():
      await asyncio.gather(*[agent(sid) for sid in agents])
    asyncio.run(everyone())
    outcomes = {sid: gateway.wait(sid, timeout=10) for sid in agents}

  assert {sid: (o.status, o.num_calls, o.ended_by)
          for sid, o in outcomes.items()} == {
              **{f"agent-{i}": ("committed", 3, "end") for i in range(3)},
              **{f"rl-{i}": ("committed", 3, "timeout") for i in range(3)},
              "idle": ("discarded", 3, "timeout")}
  assert "no verifier" in outcomes["idle"].reason
  with Pool(tmp_path / "pool.sqlite") as reopened:
    assert reopened.counts() == {"finished": 7, "trained": 0,
                                 "discarded": 1, "untrained": 6}
    stored = reopened.get(agents)
    assert [len(t.steps) for t in stored] == [3] * 7
    assert [t.verification["gateway"]["parents"] for t in stored] == [
        [-1, 0, 1]] * 7
    by_id = {t.trajectory_id: t for t in stored}
    assert [by_id[f"rl-{i}"].queue_seq for i in range(3)] == [100, 101, 102]
    assert by_id["rl-0"].group_id == "g0" and by_id["rl-0"].reward == 1.0
    assert by_id["rl-0"].verification["correct"] is True
    assert len({t.queue_seq for t in stored}) == 7
    assert reopened.history("idle")[0].reason == outcomes["idle"].reason


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_a_killed_gateway_keeps_every_committed_trajectory(tmp_path):
  """python -m experiments.serve --record on the tiny model, SIGKILLed
  the moment a session's end is acknowledged, with another session open and
  generating: every acknowledged session is in the pool, whole and exactly
  as generated (prompts, the engine's tokens, log-probs and policy
  version); the open one is not."""
  path = tmp_path / "pool.sqlite"
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.serve", "--preset=tiny",
       "--record", f"--pool={path}", f"--port={port}", f"--api_key={KEY}",
       "--max_batch=4", "--max_seq_len=128", "--page_size=32",
       "--num_pages=32", "--policy_version=3", "--log_level=warning"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      # Its small programs from the test session's compilation cache too.
      env={**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  try:
    deadline = time.time() + 60
    while True:
      assert proc.poll() is None, proc.stdout.read()
      assert time.time() < deadline, "the gateway did not start"
      try:
        requests.get(url + "/v1/models", timeout=1,
                     headers={"Authorization": f"Bearer {KEY}"})
        break
      except requests.ConnectionError:
        time.sleep(0.1)
    sent: dict[str, list] = {}   # session -> [(prompt, choice)]

    def run_session(sid, end):
      c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                        timeout=60, default_headers={HEADER: sid})
      prompt = [TOK.bos_id, 40 + len(sent), 41]
      sent[sid] = []
      for _ in range(2):
        ch = c.completions.create(model="tiny", prompt=prompt,
                                  max_tokens=4).choices[0]
        sent[sid].append((prompt, ch))
        prompt = prompt + ch.token_ids + [10, 50]
      if end:
        r = requests.post(f"{url}/v1/sessions/{sid}/end", timeout=60,
                          json={"reward": 1.0}, headers={
                              "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text

    acknowledged = []
    for sid in ("a", "b"):
      run_session(sid, end=True)
      acknowledged.append(sid)
    run_session("open", end=False)

    def generate_on():   # a call in flight when the gateway dies
      try:
        openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                      default_headers={HEADER: "open"}).completions.create(
                          model="tiny", prompt=[TOK.bos_id, 7],
                          max_tokens=100)
      except openai.APIConnectionError:
        pass
    busy = threading.Thread(target=generate_on)
    busy.start()
    # Killed the moment its end is acknowledged: a gateway that answered
    # before the commit was durable would lose it.
    run_session("c", end=True)
    os.kill(proc.pid, signal.SIGKILL)
    acknowledged.append("c")
    busy.join(60)
  finally:
    proc.kill()
    proc.wait(30)

  with Pool(path) as pool:
    stored = {t.trajectory_id: t for t in pool.untrained()}
  assert sorted(stored) == acknowledged == ["a", "b", "c"]
  for sid, t in stored.items():
    assert t.reward == 1.0 and len(t.steps) == 2
    for step, (prompt, ch) in zip(t.steps, sent[sid]):
      assert step.state.tolist() == prompt
      assert step.action.tolist() == ch.token_ids
      np.testing.assert_array_equal(step.logprobs,
                                    np.float32(ch.token_logprobs))
      assert step.policy_version == 3
    assert t.verification["gateway"]["continues"] == [False, True]
