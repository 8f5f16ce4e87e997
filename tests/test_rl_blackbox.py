"""The black-box agent in Forge RL: the agent program (agents/
blackbox_agent.py, which imports nothing of m2jax), BlackBoxRollout
(m2jax/rl/blackbox_rollout.py) against the white-box rollout on the same
scripted policy, its failed groups, resume and close, and a short
--agent=blackbox run of the loop on the tiny model that trains and
resumes.

Most tests drive the rollouts with a scripted engine (no model: the policy
is a function of the prompt and the seed), so both agents see the same
completions and their trajectories can be compared exactly; the loop's
run uses the tiny model's engine with its first call scripted
(tests/test_rl_agent.py)."""

import ast
import dataclasses
import importlib.util
import json
import os
import sys
import time

import numpy as np
import pytest

from m2jax.agents import whitebox
from m2jax.data import ByteTokenizer, chat
from m2jax.errors import UserError
from m2jax.infer.engine import EngineError, Event, Sample
from m2jax.infer.sampling import SamplingParams
from m2jax.rl import agent_rollout, blackbox_rollout, loop
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import step as rl_step
from m2jax.serve.loop import EngineLoop
from test_rl_agent import (AGENT_CONFIG, CFG, ENGINE, ENV, ROLLOUT, TRAIN,
                           TRAINER, ToolCallingEngine)

TOK = ByteTokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "agents", "blackbox_agent.py")
SEED = 3


def _load_agent_module():
  spec = importlib.util.spec_from_file_location("blackbox_agent", PROGRAM)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # its dataclasses look themselves up
  spec.loader.exec_module(module)
  return module


# ------------------------------------------------------------ the program --


def test_the_agent_program_imports_only_the_standard_library_and_openai():
  tree = ast.parse(open(PROGRAM, encoding="utf-8").read())
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, "a relative import"
      imported.add(node.module.split(".")[0])
  assert "openai" in imported
  assert imported - {"openai", "__future__"} <= sys.stdlib_module_names, (
      imported - sys.stdlib_module_names)
  assert not any(m.startswith("m2jax") for m in imported)


def test_the_agent_program_runs_its_own_tools():
  agent = _load_agent_module()
  box = agent.Toolbox(ENV.registry().specs())
  assert box.run("calculator", '{"expression": "48213*90571"}') == (
      str(48213 * 90571), False)
  assert box.run("calculator", '{"expression": "7 // 2 + 2**10"}') == (
      "1027", False)
  for name, args, error in (
      ("search", '{"q": 1}', "error: no tool named 'search' (tools: "
       "calculator)"),
      ("calculator", "{not json", "error: arguments are not JSON"),
      ("calculator", "[1]", "error: arguments must be an object"),
      ("calculator", "{}", "error: calculator needs argument(s) expression"),
      ("calculator", '{"expression": "__import__(\'os\')"}',
       "error: unsupported expression"),
      ("calculator", '{"expression": "9**9**9"}', "error: result too large"),
      ("calculator", '{"expression": "1/0"}', "error: division by zero"),
      ("calculator", '{"expression": "2*"}', "error: cannot parse")):
    content, failed = box.run(name, args)
    assert failed and content.startswith(error), (name, args, content)
  with pytest.raises(agent.TaskError, match="no implementation of 'python'"):
    agent.Toolbox([{"type": "function", "function": {"name": "python"}}])
  with pytest.raises(agent.TaskError, match="sampling.seeds: one seed"):
    agent.parse_task({"session_id": "s", "max_turns": 3,
                      "messages": [{"role": "user", "content": "hi"}],
                      "sampling": {"seeds": [1]}})


# ----------------------------------------------------- a scripted policy --


def _policy(prompt: str, seed: int) -> str:
  """The scripted policy. A first call thinks, then calls the calculator
  with the task's expression (an odd seed: at length, and a tool the task
  lacks as well, a turn that overflows the context); a later call calls
  the missing tool again (a seed of 1 or 2 mod 4) or answers the first
  tool result (a seed that is a multiple of 3: a wrong "0")."""
  tool_turns = prompt.split("<|tool|>\n")
  if len(tool_turns) == 1:
    task = prompt.split("<|user|>\n")[1].split(chat.END_OF_TURN)[0]
    expression = task.split("Compute ")[1].split(".")[0]
    calls = [{"name": "calculator", "arguments": {"expression": expression}}]
    if seed % 2:
      calls.insert(0, {"name": "search", "arguments": {"q": expression}})
    message = {"role": "assistant", "reasoning": f"call {seed % 5}" + (
        ", then search" * 10 if seed % 2 else ""),
               "content": "", "tool_calls": calls}
  elif seed % 4 in (1, 2):
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"name": "search", "arguments": {}}]}
  else:
    result = tool_turns[1].split(chat.END_OF_TURN)[0]
    message = {"role": "assistant", "reasoning": "done",
               "content": "0" if seed % 3 == 0 else result}
  return chat.assistant_text(message) + chat.END_OF_TURN


class ScriptedEngine:
  """The Engine's interface (what the rollouts and the engine loop use)
  over `_policy`: sample k of a request with seed s writes
  _policy(prompt, s + k), three tokens a step, log-probs a function of the
  seed. Records each request's prompt, seed and returned tokens; a request
  whose seed is in `refuse` raises the exception class given there."""

  def __init__(self):
    self.model_config, self.config, self.tokenizer = CFG, ENGINE, TOK
    self.mesh, self.variables, self.max_seq_len = None, {"v": 0}, 4096
    self.requests, self.returned, self.refuse = {}, [], {}
    self._next = 0

  def add_request(self, prompt_ids, params):
    if params.seed in self.refuse:
      raise self.refuse[params.seed](f"seed {params.seed} is refused")
    prompt = [int(t) for t in prompt_ids]
    text = TOK.decode(np.asarray(prompt, np.int32))
    samples = []
    seed = params.seed or 0
    for k in range(params.n):
      tokens = [int(t) for t in TOK.encode(_policy(text, seed + k))]
      reason = "stop"
      if len(tokens) > params.max_tokens:
        tokens, reason = tokens[:params.max_tokens], "length"
      logprobs = [-0.01 * ((seed + k) % 7 + 1)] * len(tokens)
      samples.append([tokens, logprobs, reason, 0])
    rid, self._next = self._next, self._next + 1
    self.requests[rid] = (prompt, seed, samples)
    return rid

  def has_work(self):
    return any(s[3] < len(s[0]) for _, _, ss in self.requests.values()
               for s in ss)

  def step(self):
    time.sleep(0.002)   # calls overlap, as a model's would
    events = []
    for rid, (prompt, seed, samples) in self.requests.items():
      for k, s in enumerate(samples):
        if s[3] >= len(s[0]):
          continue
        a, s[3] = s[3], min(s[3] + 3, len(s[0]))
        finished = s[3] == len(s[0])
        events.append(Event(rid, k, s[0][a:s[3]], s[1][a:s[3]],
                            s[2] if finished else None))
        if finished:
          self.returned.append((tuple(prompt), seed + k, tuple(s[0])))
    return events

  def result(self, rid):
    return [Sample(s[0][:s[3]], s[1][:s[3]],
                   s[2] if s[3] == len(s[0]) else None)
            for s in self.requests[rid][2]]

  def done(self, rid):
    return all(s[3] == len(s[0]) for s in self.requests[rid][2])

  def release(self, rid):
    self.requests.pop(rid, None)

  def abort(self, rid):
    for s in self.requests[rid][2]:
      s[0], s[1], s[2] = s[0][:s[3]], s[1][:s[3]], "abort"

  def update_variables(self, variables):
    self.variables = variables


SCRIPTED = dataclasses.replace(ROLLOUT, group_size=4, max_new_tokens=400)
SCRIPTED_AGENT = whitebox.AgentConfig(max_turns=3, max_context_tokens=880)


def _blackbox(engine, pool, **kw):
  return blackbox_rollout.BlackBoxRollout(
      engine, ENV, SCRIPTED_AGENT, pool, kw.pop("config", SCRIPTED), seed=SEED,
      **kw)


def _drain(rollout, *, timeout=60):
  done, failed = [], []
  deadline = time.time() + timeout
  while rollout.in_flight:
    assert time.time() < deadline, "the rollout did not finish"
    done += rollout.poll()
    failed += rollout.take_failed()
  return done, failed


def _same_steps(a, b):
  assert len(a.steps) == len(b.steps)
  for x, y in zip(a.steps, b.steps):
    np.testing.assert_array_equal(x.state, y.state)
    np.testing.assert_array_equal(x.action, y.action)
    np.testing.assert_array_equal(x.logprobs, y.logprobs)
    assert (x.policy_version, x.reward) == (y.policy_version, y.reward)


def test_blackbox_rollout_matches_the_whitebox_rollout(tmp_path):
  """Two groups of four on the same scripted policy: the black-box agent's
  sessions, recorded by the gateway, are the white-box rollout's
  trajectories exactly (ids, queue positions, every step's tokens,
  log-probs, version and process reward, the outcome and every
  verification key), each once; the steps are the tokens the engine
  returned; the reasoning and tool results (an unknown tool refused) are
  in the next call's prompt. A weight sync is served to the next group."""
  agent = agent_rollout.agent_for(ENV, SCRIPTED_AGENT, TOK)
  white_pool = pool_lib.Pool(tmp_path / "white.sqlite")
  white = agent_rollout.AgentRollout(ScriptedEngine(), ENV, agent,
                                     white_pool, SCRIPTED, seed=SEED)
  for seq in (5, 6):
    white.submit(seq, version=4)
  assert sorted(_drain(white)[0]) == ["g00000005", "g00000006"]

  engine = ScriptedEngine()
  pool = pool_lib.Pool(tmp_path / "black.sqlite")
  rollout = _blackbox(engine, pool, policy_version=4)
  try:
    assert [rollout.submit(seq, version=4) for seq in (5, 6)] == [
        "g00000005", "g00000006"]
    done, failed = _drain(rollout)
    assert sorted(done) == ["g00000005", "g00000006"] and not failed
    assert rollout.engine_loop.stats["max_rows"] >= 2   # sessions batched
    new = {"v": 1}
    rollout.update_variables(new, 7)
    assert engine.variables is new   # in place: the loop's engine
    rollout.submit(7, version=7)
    assert _drain(rollout)[0] == ["g00000007"]
    gateway_stats = rollout.gateway.stats.copy()
  finally:
    rollout.close()
  assert gateway_stats["committed"] == 12 and not gateway_stats["late_calls"]

  whites = white_pool.untrained()
  blacks = pool.untrained()
  assert [t.queue_seq for t in blacks] == list(range(20, 32))
  assert pool.counts() == {"finished": 12, "trained": 0, "discarded": 0,
                           "untrained": 12}
  by_id = {t.trajectory_id: t for t in blacks}
  # The script reaches each outcome and each end.
  assert {t.reward for t in whites} == {0.0, 1.0}
  assert {t.verification["end"] for t in whites} == {"answer", "context",
                                                     "max_turns"}
  for w in whites:
    b = by_id[w.trajectory_id]
    assert (b.group_id, b.env, b.task_id, b.difficulty, b.queue_seq,
            b.reward) == (w.group_id, w.env, w.task_id, w.difficulty,
                          w.queue_seq, w.reward)
    gateway = b.verification.pop("gateway")
    assert b.verification == w.verification
    assert gateway["continues"] == [False] + [True] * (len(b.steps) - 1)
    _same_steps(w, b)
    assert b.steps[0].reward == ENV.valid_call_reward * (
        "search" not in TOK.decode(b.steps[0].action))
    if b.verification["end"] == "context":
      assert len(b.steps) == 1
      continue
    second = TOK.decode(b.steps[1].state)
    seed = rollout_lib.group_seed(SEED, int(b.group_id[1:])) + int(
        b.trajectory_id[-1])
    assert f"<think>\ncall {seed % 5}\n</think>" in second  # reasoning kept
    task = ENV.sample(rollout_lib.task_rng(SEED, int(b.group_id[1:])))
    assert f"<|tool|>\n{task.answer}<|end|>" in second
    if len(b.steps) == 3:   # the missing tool, refused
      assert TOK.decode(b.steps[2].state).endswith(
          "<|tool|>\nerror: no tool named 'search' (tools: calculator)"
          "<|end|>\n<|assistant|>\n")
  # Every step is a call the engine answered, once.
  returned = sorted((p, tuple(a)) for p, _, a in engine.returned)
  assert returned == sorted(
      (tuple(s.state.tolist()), tuple(s.action.tolist()))
      for t in pool.untrained() for s in t.steps)
  assert {t.steps[0].policy_version for t in blacks} == {4, 7}
  assert all(s.policy_version == 7 for t in blacks
             if t.group_id == "g00000007" for s in t.steps)


def test_a_shared_engine_loop_steps_only_its_own_requests():
  """EngineLoop.around(engine) (the RL loop's engine): the holder's own
  requests are left to the holder, a swap updates the holder's engine in
  place, and the served length is capped."""
  engine = ScriptedEngine()
  served = EngineLoop.around(engine, policy_version=2, max_seq_len=900)
  served.start()
  try:
    assert served.max_seq_len == 900 and served.engine is engine
    task = ENV.sample(np.random.default_rng(0))
    prompt, _ = chat.render(ENV.messages(task), TOK, add_generation_prompt=True,
                            tools=ENV.registry().specs())
    rid = engine.add_request(prompt, SamplingParams(max_tokens=400, seed=2))
    new = {"v": 9}
    swapped = served.swap_weights(new, 5)   # waits for the engine to idle
    time.sleep(0.2)
    assert not swapped.done() and served.stats["steps"] == 0
    assert engine.result(rid)[0].tokens == []
    while engine.has_work():
      engine.step()
    engine.release(rid)
    assert swapped.result(10) == 5
    assert served.engine is engine and engine.variables is new
  finally:
    served.stop()


def test_failed_groups_partial_groups_and_close(tmp_path):
  """A session whose call is refused fails its group: the agent discards
  it, the group's other sessions are discarded in the pool, take_failed
  (not poll) reports it, and failures in a row stop the rollout. On a pool
  holding part of a group (a run killed mid-group), the group is completed
  with the missing sessions only, exactly as an uninterrupted rollout
  makes them; a group with a discarded member fails at once. close()
  discards a group in flight and stops the agent and the server."""
  G = SCRIPTED.group_size
  ids = {seq: rollout_lib.trajectory_ids(rollout_lib.group_id(seq), G)
         for seq in range(5, 9)}
  engine = ScriptedEngine()
  ref = pool_lib.Pool(tmp_path / "ref.sqlite")
  rollout = _blackbox(engine, ref, blackbox=blackbox_rollout.BlackBoxConfig(
      max_failed_in_a_row=2))
  try:
    rollout.submit(5, version=0)
    assert _drain(rollout) == (["g00000005"], [])
    engine.refuse = {rollout_lib.group_seed(SEED, 6) + 1: EngineError}
    rollout.submit(6, version=0)
    assert _drain(rollout) == ([], ["g00000006"])
    assert rollout.stats["agent_errors"] == 1
    [event] = ref.history(ids[6][0])
    assert event.kind == "discarded" and event.reason.startswith(
        "group failed: g00000006-1 empty (agent error: HTTP 400")
    assert ref.counts()["untrained"] == G
    # An engine bug in one request (a 500) fails that session alone.
    engine.refuse = {rollout_lib.group_seed(SEED, 7): TypeError}
    rollout.submit(7, version=0)
    with pytest.raises(RuntimeError, match="2 black-box groups failed in a "
                       r"row; the last: g00000007-0 empty \(agent error: "
                       "HTTP 500"):
      _drain(rollout)
  finally:
    rollout.close()
  with pytest.raises(RuntimeError, match="closed"):
    rollout.poll()

  part = pool_lib.Pool(tmp_path / "part.sqlite")
  whole = {t.trajectory_id: t for t in ref.get(ids[5])}
  for tid in (ids[5][0], ids[5][2]):
    part.add(whole[tid])
  part.add(ref.get([ids[6][0]])[0], discard_reason="gone")
  rollout = _blackbox(ScriptedEngine(), part)
  try:
    rollout.submit(5, version=0)
    rollout.submit(6, version=0)
    assert _drain(rollout) == (["g00000005"], ["g00000006"])
    assert rollout.gateway.stats["sessions_opened"] == 2
    for t in part.get(ids[5]):
      _same_steps(t, whole[t.trajectory_id])
      assert (t.queue_seq, t.reward, t.verification) == (
          whole[t.trajectory_id].queue_seq, whole[t.trajectory_id].reward,
          whole[t.trajectory_id].verification)
    recorded = rollout.gateway.stats["calls_recorded"]
    rollout.submit(8, version=0)
    deadline = time.time() + 30
    while rollout.gateway.stats["calls_recorded"] == recorded:
      assert time.time() < deadline
      time.sleep(0.01)
  finally:
    rollout.close()
  assert rollout._proc.returncode == 0   # pylint: disable=protected-access
  # pylint: disable-next=protected-access
  states = [rollout._stored(t) for t in ids[8]]
  assert "discarded" in states and set(states) <= {None, "discarded"}
  with pytest.raises(OSError):
    import urllib.request  # pylint: disable=import-outside-toplevel
    urllib.request.urlopen(rollout.url + "/v1/models", timeout=5)
  with pytest.raises(RuntimeError, match="did not start: gone"):
    _blackbox(ScriptedEngine(), part, command=[
        sys.executable, "-c", "import sys; sys.exit('gone')"])


def test_blackbox_run_trains_and_resumes(tmp_path, monkeypatch):
  """--agent=blackbox through the loop (sync) on the tiny model: two steps,
  stopped, and resumed with part of group 2 already in the pool (as a run
  killed mid-group leaves it). Each step trains one whole group of
  multi-step trajectories recorded by the gateway, each once, its calls
  served by the step's policy version (the weight sync goes through the
  engine loop); the resumed run generates only the missing session."""
  monkeypatch.setattr(loop, "Engine", ToolCallingEngine)
  run = loop.RLRunConfig(env="multiply", env_fields=(("levels", (3,)),),
                         agent="blackbox", steps=3, groups_per_step=1,
                         warm_start_steps=0, eval_tasks=0,
                         checkpoint_every=2)

  def go(**kw):
    return loop.run(CFG, TRAIN, run, str(tmp_path), rollout_config=ROLLOUT,
                    rl_config=rl_step.RLConfig(mtp_depth=1),
                    trainer_config=TRAINER, engine_config=ENGINE,
                    agent_config=AGENT_CONFIG, progress=False, **kw)

  assert go(stop_after=2)["step"] == 2
  with pool_lib.Pool(tmp_path / loop.POOL_FILE) as pool:
    # Group 2's first session, committed before the "crash".
    planted = dataclasses.replace(pool.trained_in(1)[0],
                                  trajectory_id="g00000002-0",
                                  group_id="g00000002", queue_seq=4)
    pool.add(planted)
  summary = go(resume=True)
  assert summary["step"] == 3
  assert summary["pool"] == {"finished": 6, "trained": 6, "discarded": 0,
                             "untrained": 0}
  with pool_lib.Pool(tmp_path / loop.POOL_FILE) as pool:
    for step in (1, 2, 3):
      seq = step - 1
      trajs = sorted(pool.trained_in(step), key=lambda t: t.trajectory_id)
      assert [t.trajectory_id for t in trajs] == rollout_lib.trajectory_ids(
          rollout_lib.group_id(seq), 2)
      generated = trajs if step < 3 else trajs[1:]
      task = ENV.sample(rollout_lib.task_rng(run.seed, seq))
      for t in generated:
        assert t.task_id == task.task_id and len(t.steps) >= 2
        assert t.verification["gateway"]["session_id"] == t.trajectory_id
        assert f"<|tool|>\n{task.answer}" in TOK.decode(t.steps[1].state)
        assert {s.policy_version for s in t.steps} == {seq}
    assert trajs[0].task_id == planted.task_id
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == [1, 2, 3]
  assert [l["groups_failed"] for l in lines] == [0, 0, 0]
  saved = json.load(open(tmp_path / loop.CONFIG_FILE))
  assert saved["run"]["agent"] == "blackbox"
  # The white-box agent's context management is refused, before a run
  # directory is made.
  with pytest.raises(UserError, match="AgentConfig.summarise / keep_last"):
    loop.run(CFG, TRAIN, run, str(tmp_path / "other"), trainer_config=TRAINER,
             rollout_config=ROLLOUT, agent_config=dataclasses.replace(
                 AGENT_CONFIG, keep_last_turns=2), progress=False)
  assert not os.path.exists(tmp_path / "other")
  with pytest.raises(UserError, match="single-turn; the blackbox agent"):
    loop.RLRunConfig(env="arithmetic", agent="blackbox")
