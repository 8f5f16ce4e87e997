"""The white-box agent loop (m2jax.agents.whitebox) with a scripted policy:
tool calls run, reasoning kept across turns, the exact prompts recorded,
keep-last-N and summarise rewriting the context, max_turns and the context
limit. No model: `generate` replays assistant messages."""

import numpy as np
import pytest

from m2jax.agents import tools, whitebox
from m2jax.data import ByteTokenizer, chat
from m2jax.errors import UserError

TOK = ByteTokenizer()
REGISTRY = tools.ToolRegistry([tools.Calculator()])
TASK = [{"role": "user", "content": "Compute 123456789*987654321."}]


def call(expression, reasoning="use the tool", **extra):
  return {"role": "assistant", "reasoning": reasoning, "content": "",
          "tool_calls": [{"name": "calculator",
                          "arguments": {"expression": expression}}], **extra}


def answer(text, reasoning="done"):
  return {"role": "assistant", "reasoning": reasoning, "content": text}


class Script:
  """A policy that writes the given assistant messages in order, with
  log-prob -(k + 1) / 10 for its k-th token and version = its call
  number; records the prompts it was sent."""

  def __init__(self, messages):
    self.messages, self.prompts = list(messages), []

  def __call__(self, prompt):
    self.prompts.append(list(prompt))
    text = chat.assistant_text(self.messages.pop(0)) + chat.END_OF_TURN
    tokens = list(TOK.encode(text))
    return whitebox.Completion(tokens, [-(k + 1) / 10 for k in
                                        range(len(tokens))],
                               version=len(self.prompts))


def _agent(**fields):
  return whitebox.Agent(whitebox.AgentConfig(**fields), REGISTRY, TOK)


def _render(messages, agent):
  return chat.render(messages, TOK, tools=agent.tool_specs(),
                     add_generation_prompt=True)[0].tolist()


def test_tools_run_and_reasoning_stays_in_the_history():
  """Each call's tool runs and its output is the next prompt's tool turn;
  every think block stays; while nothing is dropped each state is the
  previous state + action + tool turn; the calls record exactly what was
  sent and received."""
  agent = _agent()
  script = Script([call("123456789*987654321", "first thought"),
                   call("121932631112635269+1", "second thought"),
                   answer("121932631112635270", "final thought")])
  episode = agent.run(TASK, script)
  assert (episode.end, episode.answer) == ("answer", "121932631112635270")
  assert [r.content for c in episode.calls for r in c.results] == [
      "121932631112635269", "121932631112635270"]
  last = TOK.decode(np.asarray(script.prompts[-1], np.int32))
  for text in ("first thought", "second thought", "121932631112635269",
               "<|tool|>", '"expression": "123456789*987654321"'):
    assert text in last
  assert script.prompts[0] == _render(TASK, agent)
  for c, sent in zip(episode.calls, script.prompts):
    assert c.state == sent
  for k, (a, b) in enumerate(zip(episode.calls, episode.calls[1:])):
    tool_turn = list(TOK.encode(f"\n<|tool|>\n{a.results[0].content}"
                                f"<|end|>\n<|assistant|>\n"))
    assert b.state == a.state + a.action + tool_turn, k
    assert a.version == k + 1
    assert a.logprobs == [-(j + 1) / 10 for j in range(len(a.action))]
  assert [m["role"] for m in episode.history] == [
      "user", "assistant", "tool", "assistant", "tool", "assistant"]
  assert episode.history[-1]["reasoning"] == "final thought"


def test_tool_errors_reach_the_model_and_the_episode_goes_on():
  agent = _agent()
  bad = {"role": "assistant", "content": "",
         "tool_calls": [{"name": "search", "arguments": {"q": "x"}}]}
  script = Script([call("1/0"), bad, answer("7")])
  episode = agent.run(TASK, script)
  results = [c.results[0] for c in episode.calls[:2]]
  assert all(r.error for r in results)
  assert "division by zero" in results[0].content
  assert "no tool named 'search'" in results[1].content
  assert episode.answer == "7"


def test_keep_last_turns_drops_the_oldest_turns_from_the_context():
  agent = _agent(keep_last_turns=1)
  script = Script([call("1+1", "r one"), call("2+2", "r two"),
                   call("3+3", "r three"), answer("6")])
  episode = agent.run(TASK, script)
  third = TOK.decode(np.asarray(episode.calls[2].state, np.int32))
  assert "r two" in third and "r one" not in third and "2+2" in third
  # The state is the task and the last turn, as the template renders them.
  assert episode.calls[2].state == _render(
      TASK + [episode.history[3], episode.history[4]], agent)
  assert episode.dropped_turns == 2
  assert len(episode.history) == 1 + 3 * 2 + 1  # the log keeps everything
  # Dropping breaks the prefix: call 2's state does not extend call 1's.
  a, b = episode.calls[1], episode.calls[2]
  assert b.state[:len(a.state)] != a.state


def test_summarise_replaces_the_older_turns_with_the_summary():
  agent = _agent(summarise=True, keep_last_turns=1, max_context_tokens=4096)
  assert [s["function"]["name"] for s in agent.tool_specs()] == [
      "calculator", "summarise"]
  summarise = {"role": "assistant", "reasoning": "too long", "content": "",
               "tool_calls": [{"name": "summarise",
                               "arguments": {"summary": "1+1 is 2"}}]}
  empty = {"role": "assistant", "content": "",
           "tool_calls": [{"name": "summarise", "arguments": {"summary": ""}}]}
  script = Script([call("1+1", "r one"), summarise, empty, call("5+5"),
                   answer("10")])
  episode = agent.run(TASK, script)
  s_call, e_call, c_call, final = episode.calls[1:]
  assert s_call.results[0] == (agent.config.summarised_note, False)
  assert e_call.results[0].error   # an empty summary rewrites nothing
  # After the summary: the task, the pinned summary turn, the last turn.
  after = TOK.decode(np.asarray(e_call.state, np.int32))
  assert "1+1 is 2" in after and "r one" not in after
  assert e_call.state == _render(TASK + episode.history[3:5], agent)
  # keep_last_turns=1 keeps the summary turn and one turn after it.
  assert final.state == _render(
      TASK + episode.history[3:5] + episode.history[7:9], agent)
  assert episode.dropped_turns == 2
  # Without summarise offered, a call of that name is an unknown tool.
  off = _agent(keep_last_turns=0).run(TASK, Script([summarise, answer("x")]))
  assert off.calls[0].results[0].error and off.dropped_turns == 0
  assert "summarise" not in str(_agent().tool_specs())


def test_max_turns_and_the_context_limit_end_an_episode():
  episode = _agent(max_turns=3).run(TASK, Script([call("1+1")] * 5))
  assert (episode.end, episode.answer, len(episode.calls)) == (
      "max_turns", None, 3)
  assert episode.prompt is None
  with pytest.raises(UserError, match="has ended"):
    episode.advance(whitebox.Completion([1], [0.0], 0))
  first = len(_render(TASK, _agent()))
  episode = _agent(max_context_tokens=first + 10).run(
      TASK, Script([call("1+1"), answer("2")]))
  assert (episode.end, len(episode.calls)) == ("context", 1)
  assert _agent(max_context_tokens=first - 1).start(TASK).end == "context"
  assert _agent(max_context_tokens=first).start(TASK).prompt is not None


@pytest.mark.parametrize("fields, field", [
    ({"max_turns": 0}, "AgentConfig.max_turns"),
    ({"keep_last_turns": -1}, "AgentConfig.keep_last_turns"),
    ({"summarise_name": ""}, "AgentConfig.summarise_name"),
    ({"max_context_tokens": 1}, "AgentConfig.max_context_tokens"),
])
def test_config_errors_name_the_field(fields, field):
  with pytest.raises(UserError, match=field) as err:
    whitebox.AgentConfig(**fields)
  assert "\n" not in str(err.value)


def test_summarise_may_not_shadow_a_tool():
  registry = tools.ToolRegistry([tools.Calculator(name="summarise")])
  with pytest.raises(UserError, match="summarise_name"):
    whitebox.Agent(whitebox.AgentConfig(summarise=True), registry, TOK)
