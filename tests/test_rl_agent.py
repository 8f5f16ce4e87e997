"""Tool tasks in Forge RL: the multiply env (m2jax.rl.envs.tool_tasks), the
agent rollout (m2jax.rl.agent_rollout) on the tiny model's engine, and a
short --agent=whitebox run of the loop that resumes.

A random tiny model never writes a tool call, so the engine here scripts
one: on a prompt without a tool turn yet, each finished sample's tokens are
replaced by a calculator call (the engine still does the work and the
batching); later calls are the model's own tokens and log-probs."""

import collections
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from m2jax import config as config_lib
from m2jax import model
from m2jax.agents import whitebox
from m2jax.data import ByteTokenizer, chat
from m2jax.data.chat_data import encode_conversation
from m2jax.errors import UserError
from m2jax.infer.engine import Engine, EngineConfig, Sample
from m2jax.rl import agent_rollout, envs, loop
from m2jax.rl import pool as pool_lib
from m2jax.rl import rollout as rollout_lib
from m2jax.rl import step as rl_step
from m2jax.rl import trainer as trainer_lib
from m2jax.rl.envs import tool_tasks
from m2jax.settings import Settings
from m2jax.train.config import TrainConfig

TOK = ByteTokenizer()
# One layer (and the MTP module): these tests (and test_rl_blackbox.py's)
# check the agents' rollouts and runs, not the model's depth; every program
# compiles in about two thirds of the time.
CFG = config_lib.TINY.replace(num_layers=1, settings=Settings(attention="xla"))
ENV = envs.make("multiply", levels=(3,))
AGENT_CONFIG = whitebox.AgentConfig(max_turns=3, max_context_tokens=800)
# Pages of 128 tokens and whole-prompt prefill: every call's block table
# has the smallest width, so the engine compiles few shapes.
ENGINE = EngineConfig(max_batch=4, num_pages=64, page_size=128,
                      prefill_chunk=1024, prefix_cache=False)
ROLLOUT = rollout_lib.RolloutConfig(group_size=2, max_new_tokens=160)
OWN_TOKENS = 6   # the model's own calls, at most (a short, fast test)
SCRIPTED_LOGPROB = -0.25


def _text(tokens):
  return TOK.decode(np.asarray(tokens, np.int32))


class ToolCallingEngine(Engine):
  """The engine, with the first call of every episode scripted: a
  calculator call of the task's expression (or, with `answers`, every
  call: then the answer from the tool turn); the model's own calls stop
  after OWN_TOKENS. Records what it was sent and what it returned, and
  the most sequences it ran at once."""
  answers = False

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.sent, self.returned, self.most_running = {}, {}, 0

  def add_request(self, prompt_ids, params=None):
    params = dataclasses.replace(
        params, max_tokens=min(params.max_tokens, OWN_TOKENS))
    rid = super().add_request(prompt_ids, params)
    self.sent[rid] = [int(t) for t in prompt_ids]
    return rid

  def admit(self):
    super().admit()
    self.most_running = max(self.most_running, len(self.running))

  def _script(self, prompt: str):
    if "<|tool|>" not in prompt:
      task = envs.Task("t", "multiply", 3, prompt.split("<|user|>\n")[1]
                       .split(chat.END_OF_TURN)[0], "")
      message = {"role": "assistant", "reasoning": "call", "content": "",
                 "tool_calls": [{"name": "calculator", "arguments": {
                     "expression": ENV.expression(task)}}]}
    elif self.answers:
      result = prompt.split("<|tool|>\n")[-1].split(chat.END_OF_TURN)[0]
      message = {"role": "assistant", "content": result}
    else:
      return None
    return list(TOK.encode(chat.assistant_text(message) + chat.END_OF_TURN))

  def result(self, rid):
    samples = super().result(rid)
    scripted = self._script(_text(self.sent[rid]))
    if scripted is not None:
      samples = [s if s.finish_reason is None else Sample(
          scripted, [SCRIPTED_LOGPROB] * len(scripted), "stop")
                 for s in samples]
    self.returned[rid] = samples
    return samples


def test_multiply_tasks_and_verifier():
  rng = np.random.default_rng(0)
  env = envs.make("multiply", levels=(1, 4, 30))
  for d in env.levels:
    task = env.sample(rng, d)
    a, b = env.expression(task).split("*")
    assert len(a) == len(b) == d and task.difficulty == d
    assert task.answer == str(int(a) * int(b))
    assert task.prompt == tool_tasks.PROMPT.format(a=a, b=b)
    assert env.verify(task, env.demonstration(task)).reward == 1.0
    assert env.verify(task, f" {task.answer}\n").correct
    for wrong in ("0" + task.answer, task.answer + "0", "", "-" + task.answer,
                  f"{task.answer}.", "The answer is " + task.answer):
      assert env.verify(task, wrong).reward == 0.0, wrong
  again = envs.make("multiply", levels=(1, 4, 30)).sample(
      np.random.default_rng(0), 1)
  assert again == env.sample(np.random.default_rng(0), 1)
  with pytest.raises(ValueError, match="cannot verify a task of env"):
    env.verify(envs.make("arithmetic").sample(rng), "1")
  ok, failed = ENV.registry().call("calculator", {"expression": "2*3"}), (
      ENV.registry().call("calculator", {"expression": "2*"}))
  assert ENV.process_reward(task, {}, [ok]) == ENV.valid_call_reward
  assert ENV.process_reward(task, {}, [ok, failed]) == 0.0
  assert ENV.process_reward(task, {}, []) == 0.0
  assert envs.multi_step("multiply") and not envs.multi_step("arithmetic")
  with pytest.raises(config_lib.ConfigError, match="Multiply.levels"):
    envs.make("multiply", levels=(0,))
  # The demonstration's think blocks are fields (shorter ones for a tiny
  # model); the defaults are the module's.
  short = envs.make("multiply", levels=(1,), call_reasoning="Go.",
                    answer_reasoning="")
  turns = [m for m in short.demonstration_messages(task)
           if m["role"] == "assistant"]
  assert [m["reasoning"] for m in turns] == ["Go.", ""]
  assert [m["reasoning"] for m in ENV.demonstration_messages(task)
          if m["role"] == "assistant"] == [tool_tasks.CALL_REASONING,
                                           tool_tasks.ANSWER_REASONING]
  with pytest.raises(config_lib.ConfigError,
                     match="Multiply.call_reasoning: must be a string"):
    envs.make("multiply", call_reasoning=None)


def test_demonstrations_answer_wrong_at_the_asked_fraction():
  """demo_correct_fraction: that share of demonstrations answer with the
  tool's result, the rest another product of the same level (fixed per
  prompt); the tool call itself is always the right one."""
  rng = np.random.default_rng(1)
  half = envs.make("multiply", levels=(2,), demo_correct_fraction=0.5)
  tasks = [half.sample(rng) for _ in range(400)]
  right = [half.verify(t, half.demonstration(t)).correct for t in tasks]
  assert 0.4 < np.mean(right) < 0.6
  for t in tasks[:50]:
    answer = half.demonstration(t)
    assert answer == half.demonstration(t) and answer.isdigit()
    assert len(answer) <= 4   # a product of two 2-digit numbers
    call = half.demonstration_messages(t)[1]["tool_calls"][0]
    assert call["arguments"]["expression"] == half.expression(t)
  never = envs.make("multiply", levels=(2,), demo_correct_fraction=0.0)
  assert sum(never.verify(t, never.demonstration(t)).correct
             for t in tasks) < 20   # only chance collisions
  assert all(ENV.verify(t, ENV.demonstration(t)).correct for t in tasks)
  with pytest.raises(config_lib.ConfigError,
                     match="Multiply.demo_correct_fraction: must be in"):
    envs.make("multiply", demo_correct_fraction=1.5)


def test_demonstration_is_a_solved_conversation_the_agent_reproduces():
  """The demonstration verifies to 1, renders through the chat template and
  the SFT data with every assistant turn (tool call, answer) trained and
  the tool result not; replaying its assistant turns through the agent
  sends prompts that are prefixes of that rendering (the warm start trains
  on what the agent will show the model)."""
  task = ENV.sample(np.random.default_rng(1))
  agent = agent_rollout.agent_for(ENV, AGENT_CONFIG, TOK)
  conv = agent_rollout.demonstration(ENV, agent, task)
  roles = [m["role"] for m in conv["messages"]]
  assert roles == ["user", "assistant", "tool", "assistant"]
  assert conv["messages"][2]["content"] == task.answer
  assert ENV.verify(task, conv["messages"][-1]["content"]).reward == 1.0
  encoded = encode_conversation(conv, TOK, seq_len=2048)
  ids, mask = encoded["tokens"], encoded["loss_mask"].astype(bool)
  trained = _text(ids[mask])
  assert '"expression": "' + ENV.expression(task) in trained
  assert trained.endswith(task.answer + chat.END_OF_TURN)
  assert "calculator" in _text(ids[~mask])   # the tool list, not trained
  assert trained.count(task.answer) == 1     # the tool result is not
  replay = iter([m for m in conv["messages"] if m["role"] == "assistant"])

  def generate(prompt):
    assert ids[:len(prompt)].tolist() == prompt
    tokens = list(TOK.encode(chat.assistant_text(next(replay))
                             + chat.END_OF_TURN))
    return whitebox.Completion(tokens, [0.0] * len(tokens), 0)

  episode = agent.run(ENV.messages(task), generate)
  assert episode.end == "answer" and ENV.verify(task, episode.answer).correct
  assert episode.calls[-1].state + episode.calls[-1].action == ids.tolist()[
      :len(episode.calls[-1].state) + len(episode.calls[-1].action)]
  # The RL warm start's data: conversations with the agent's tools; a
  # sequence length that would cut them is refused.
  run = loop.RLRunConfig(env="multiply", agent="whitebox", demonstrations=4,
                         warm_start_seq_len=1024)
  data = loop.demonstration_data(ENV, TOK, run, agent)
  assert all(c["tools"] == agent.tool_specs()
             for c in data.conversations["train"])
  with pytest.raises(UserError, match="warm_start_seq_len: multiply's"):
    loop.demonstration_data(ENV, TOK, run.__class__(
        env="multiply", agent="whitebox", demonstrations=4), agent)


@pytest.fixture(scope="module")
def variables():
  return model.init(CFG, jax.random.key(0))


def test_agent_rollout_commits_multi_step_trajectories(tmp_path, variables):
  """Two groups of two episodes in the engine at once: each trajectory has
  one step per model call, holding exactly the prompt the engine was sent
  and the tokens and log-probs it returned; process and outcome rewards,
  ids, queue positions and times as documented."""
  engine = ToolCallingEngine(CFG, variables, ENGINE, tokenizer=TOK)
  agent = agent_rollout.agent_for(ENV, AGENT_CONFIG, TOK)
  pool = pool_lib.Pool(tmp_path / "pool.sqlite")
  rollout = agent_rollout.AgentRollout(
      engine, ENV, agent, pool,
      dataclasses.replace(ROLLOUT, latency_scale=1e-3), seed=3)
  assert [rollout.submit(seq, version=4) for seq in (5, 6)] == [
      "g00000005", "g00000006"]
  done = []
  while rollout.in_flight:
    done += rollout.poll()
    assert rollout.next_ready_in() is None or rollout.next_ready_in() < 1
  assert sorted(done) == ["g00000005", "g00000006"]
  assert engine.most_running >= 3   # episodes of both groups batched
  trajs = pool.untrained()
  assert [t.queue_seq for t in trajs] == [10, 11, 12, 13]
  # Every call the engine answered is one step, as sent and received.
  calls = collections.Counter(
      (tuple(engine.sent[rid]), tuple(s.tokens), tuple(s.logprobs))
      for rid, samples in engine.returned.items() for s in samples)
  steps = collections.Counter(
      (tuple(s.state.tolist()), tuple(s.action.tolist()),
       tuple(s.logprobs.astype(np.float64).tolist()))
      for t in trajs for s in t.steps)
  assert steps == calls and sum(calls.values()) > 4
  for t in trajs:
    seq = int(t.group_id[1:])
    task = ENV.sample(rollout_lib.task_rng(3, seq))
    assert t.task_id == task.task_id and t.env == "multiply"
    assert len(t.steps) >= 2
    assert {s.policy_version for s in t.steps} == {4}
    first, second = t.steps[:2]
    assert set(first.logprobs.tolist()) == {SCRIPTED_LOGPROB}
    assert first.reward == ENV.valid_call_reward
    assert set(second.logprobs.tolist()) != {SCRIPTED_LOGPROB}  # the model's
    assert second.state[:len(first.state)].tolist() == first.state.tolist()
    assert f"<|tool|>\n{task.answer}<|end|>" in _text(second.state)
    v = t.verification
    assert v["tool_calls"] >= 1 and v["turns"] == len(t.steps)
    assert v["end"] in whitebox.ENDS
    assert t.reward == ENV.verify(task, "" if v["end"] != "answer" else
                                  chat.parse_completion(_text(
                                      t.steps[-1].action))["content"]).reward
    assert v["completion_s"] >= len(t.steps) * ENV.call_s
    assert v["baseline_s"] == ENV.baseline_s(task) == 3.0
  # Greedy evaluation: the same episodes with every call scripted solve
  # their tasks; answers left to the random model do not.
  tasks = [ENV.sample(np.random.default_rng(k)) for k in range(3)]
  engine.answers = True
  assert agent_rollout.evaluate(engine, ENV, agent, tasks, 160) == 1.0
  engine.answers = False
  assert agent_rollout.evaluate(engine, ENV, agent, tasks, 160) == 0.0


TRAIN = TrainConfig(steps=2, learning_rate=1e-3, warmup_steps=0,
                    decay_fraction=0.0, weight_decay=0.0, mtp_depth=1,
                    mtp_weight=0.1, mtp_weight_final=0.1)
TRAINER = trainer_lib.TrainerConfig(row_len=1024, rows_per_micro_batch=1)


def test_whitebox_run_trains_multi_step_trajectories_and_resumes(
    tmp_path, monkeypatch):
  """--agent=whitebox through the loop (sync), stopped after step 1 and
  resumed: each step trains one group of multi-step trajectories, each
  once, the resumed step the next task in the queue."""
  monkeypatch.setattr(loop, "Engine", ToolCallingEngine)
  run = loop.RLRunConfig(env="multiply", env_fields=(("levels", (3,)),),
                         agent="whitebox", steps=2, groups_per_step=1,
                         warm_start_steps=0, eval_tasks=0,
                         checkpoint_every=1)

  def go(**kw):
    return loop.run(CFG, TRAIN, run, str(tmp_path), rollout_config=ROLLOUT,
                    rl_config=rl_step.RLConfig(mtp_depth=1),
                    trainer_config=TRAINER, engine_config=ENGINE,
                    agent_config=AGENT_CONFIG, progress=False, **kw)

  assert go(stop_after=1)["step"] == 1
  summary = go(resume=True)
  assert summary["step"] == 2
  assert summary["pool"] == {"finished": 4, "trained": 4, "discarded": 0,
                             "untrained": 0}
  with pool_lib.Pool(tmp_path / loop.POOL_FILE) as pool:
    for step, seq in ((1, 0), (2, 1)):
      trajs = pool.trained_in(step)
      task = ENV.sample(rollout_lib.task_rng(run.seed, seq))
      assert {t.task_id for t in trajs} == {task.task_id}
      assert all(len(t.steps) >= 2 for t in trajs)
      assert f"<|tool|>\n{task.answer}" in _text(trajs[0].steps[1].state)
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == [1, 2]
  saved = json.load(open(tmp_path / loop.CONFIG_FILE))
  assert saved["run"]["agent"] == "whitebox"
  assert saved["agent"]["max_context_tokens"] == 800


def test_agent_and_env_kinds_must_match(tmp_path):
  with pytest.raises(UserError, match="env 'multiply' is solved with tool"):
    loop.RLRunConfig(env="multiply")
  with pytest.raises(UserError, match="RLRunConfig.agent: must be one of"):
    loop.RLRunConfig(env="multiply", agent="greybox")
  run = loop.RLRunConfig(env="multiply", agent="whitebox")
  with pytest.raises(UserError, match="TrainerConfig.row_len: 512"):
    loop.run(CFG, TRAIN, run, str(tmp_path / "run"),
             agent_config=AGENT_CONFIG, progress=False)
  assert not os.path.exists(tmp_path / "run")
  # A task the agent could not finish, or turns it could not write, in
  # the context and tokens it is given.
  for agent, new_tokens, message in (
      (whitebox.AgentConfig(max_context_tokens=600), 160,
       "AgentConfig.max_context_tokens: 600 cuts multiply's demonstrated "
       "episode at level 6 after 1 of its 2 calls"),
      (AGENT_CONFIG, 100, "RolloutConfig.max_new_tokens: 100 cuts")):
    with pytest.raises(UserError, match=message):
      loop.run(CFG, TRAIN, run, str(tmp_path / message[:5]),
               agent_config=agent, trainer_config=TRAINER,
               rollout_config=rollout_lib.RolloutConfig(
                   max_new_tokens=new_tokens), progress=False)


def test_cli_refuses_an_agent_on_a_single_turn_env(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.rl", f"--workdir={tmp_path}",
       "--env=arithmetic", "--agent=whitebox"], capture_output=True,
      text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode != 0
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  assert "RLRunConfig.agent: env 'arithmetic' is single-turn" in lines[-1]
  assert not os.listdir(tmp_path)
