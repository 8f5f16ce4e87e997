"""The chat template (m2jax/data/chat.py): the exact text, the assistant
mask token by token, and completions parsed back into messages."""

import json

import numpy as np
import pytest

from m2jax.data import ByteTokenizer
from m2jax.data import bpe
from m2jax.data import chat
from m2jax.data.chat import ChatFormatError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning": "Need the tool.",
     "content": "Let me look.",
     "tool_calls": [
         {"name": "weather", "arguments": {"city": "Paris"}},
         {"type": "function", "id": "c1",  # OpenAI's shape
          "function": {"name": "clock", "arguments": "{\"tz\": \"CET\"}"}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "18C"},
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "reasoning": "Both known.", "content": "18C, noon."},
]
# The two assistant turns as the model writes them (mask: exactly these).
ASSISTANT_1 = ('<think>\nNeed the tool.\n</think>\n\nLet me look.\n'
               '<tool_call>\n{"name": "weather", "arguments": {"city": '
               '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "clock", '
               '"arguments": {"tz": "CET"}}\n</tool_call><|end|>')
ASSISTANT_2 = "<think>\nBoth known.\n</think>\n\n18C, noon.<|end|>"
EXPECTED = ("<|system|>\nBe brief.<|end|>\n"
            "<|user|>\nWeather in Paris?<|end|>\n"
            "<|assistant|>\n" + ASSISTANT_1 + "\n"
            "<|tool|>\n18C<|end|>\n"
            "<|tool|>\n12:00<|end|>\n"
            "<|assistant|>\n" + ASSISTANT_2 + "\n")


def test_the_template_is_the_documented_text():
  assert chat.render_text(CONVERSATION) == EXPECTED
  assert chat.render_text(CONVERSATION, add_generation_prompt=True) == (
      EXPECTED + "<|assistant|>\n")


def test_assistant_mask_token_by_token_byte_tokenizer():
  tok = ByteTokenizer()
  ids, mask = chat.render(CONVERSATION, tok)
  assert ids[0] == tok.bos_id and not mask[0]
  assert bytes(ids[1:].astype(np.uint8)).decode() == EXPECTED
  # One byte id per character (the text is ASCII): position t + 1 holds
  # EXPECTED[t]. The mask is True exactly on the two assistant turns.
  want = np.zeros(len(EXPECTED), bool)
  for turn in (ASSISTANT_1, ASSISTANT_2):
    start = EXPECTED.index("<|assistant|>\n" + turn) + len("<|assistant|>\n")
    want[start:start + len(turn)] = True
  for t, char in enumerate(EXPECTED):
    assert mask[t + 1] == want[t], (t, char, EXPECTED[max(0, t - 10):t + 10])
  masked = bytes(ids[mask].astype(np.uint8)).decode()
  assert masked == ASSISTANT_1 + ASSISTANT_2
  # The role headers, the tool results and the user text are never masked.
  unmasked = bytes(ids[1:][~mask[1:]].astype(np.uint8)).decode()
  for text in ("<|assistant|>\n", "Weather in Paris?", "18C<|end|>", "12:00"):
    assert text in unmasked


def test_generation_prompt_is_unmasked_and_ends_in_the_header():
  tok = ByteTokenizer()
  ids, mask = chat.render(CONVERSATION[:2], tok, add_generation_prompt=True)
  assert not mask.any()
  assert tok.decode(ids).endswith("Weather in Paris?<|end|>\n<|assistant|>\n")


def test_mask_is_exact_with_bpe():
  # Merges learnt on the template itself, so markers are few ids: the mask
  # still covers exactly the assistant text, and each masked run decodes to
  # one whole assistant turn.
  tok = bpe.train_bpe([EXPECTED * 20], 320, 1 << 20)
  ids, mask = chat.render(CONVERSATION, tok)
  assert tok.decode(ids) == EXPECTED
  assert tok.decode(ids[mask]) == ASSISTANT_1 + ASSISTANT_2
  starts = np.flatnonzero(np.diff(mask.astype(int)) == 1) + 1
  ends = np.flatnonzero(np.diff(mask.astype(int)) == -1) + 1
  assert [tok.decode(ids[s:e]) for s, e in zip(starts, ends)] == [
      ASSISTANT_1, ASSISTANT_2]


def test_tools_are_listed_in_the_system_turn():
  tools = [{"type": "function", "function": {"name": "weather"}}]
  listing = (chat.TOOLS_HEADER + "<tools>\n" + json.dumps(tools[0]) +
             "\n</tools>")
  with_system = chat.render_text(CONVERSATION[:2], tools=tools)
  assert with_system.startswith(
      f"<|system|>\nBe brief.\n\n{listing}<|end|>\n<|user|>\n")
  alone = chat.render_text(CONVERSATION[1:2], tools=tools)
  assert alone.startswith(f"<|system|>\n{listing}<|end|>\n<|user|>\n")


ASSISTANT_MESSAGES = [
    CONVERSATION[2],
    CONVERSATION[5],
    {"role": "assistant", "content": "plain answer"},
    {"role": "assistant", "content": "ends in a newline\n",
     "tool_calls": [{"name": "f", "arguments": {}}]},
    {"role": "assistant", "content": None, "reasoning": "",
     "tool_calls": [{"name": "g", "arguments": {"x": [1, "é"]}}]},
    {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                      {"type": "text", "text": "b"}]},
]


@pytest.mark.parametrize("message", ASSISTANT_MESSAGES)
def test_render_then_parse_round_trips(message):
  text = chat.assistant_text(message)
  parsed = chat.parse_completion(text + chat.END_OF_TURN + "\n<|user|>\nx")
  assert parsed == chat.normalize_message(message)
  assert chat.assistant_text(parsed) == text
  assert parsed["content"] == chat.normalize_message(message)["content"]


def test_parse_reads_the_rendered_turns_of_a_conversation():
  for turn, message in ((ASSISTANT_1, CONVERSATION[2]),
                        (ASSISTANT_2, CONVERSATION[5])):
    parsed = chat.parse_completion(turn)
    assert parsed["reasoning"] == message["reasoning"]
    assert parsed == chat.normalize_message(message)
  assert chat.parse_completion(ASSISTANT_1)["tool_calls"] == [
      {"name": "weather", "arguments": {"city": "Paris"}},
      {"name": "clock", "arguments": {"tz": "CET"}}]


def test_parse_never_fails_on_what_a_model_may_write():
  # Cut by max_tokens inside the reasoning: all of it is reasoning.
  assert chat.parse_completion("<think>\nstill thinking") == {
      "role": "assistant", "reasoning": "still thinking", "content": ""}
  # A block that is not a call stays text; the valid one is a call.
  parsed = chat.parse_completion(
      "hi\n<tool_call>\nnot json\n</tool_call>\n<tool_call>\n"
      '{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
  assert parsed["tool_calls"] == [{"name": "f", "arguments": {"a": 1}}]
  assert parsed["content"] == "hi\n<tool_call>\nnot json\n</tool_call>"
  rng = np.random.default_rng(0)
  atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "{",
           '"name"', ":", "}", "x", "<|end|>"]
  for _ in range(200):
    text = "".join(rng.choice(atoms, size=int(rng.integers(0, 12))))
    parsed = chat.parse_completion(text)
    assert isinstance(parsed["content"], str)


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "robot", "content": "x"}], "role must be one of"),
    ([{"role": "user", "content": "x", "mood": 1}], "unknown keys ['mood']"),
    ([{"role": "user", "content": "x", "reasoning": "r"}],
     "only assistant messages"),
    ([{"role": "assistant", "tool_calls": [{"name": "f",
                                            "arguments": "{oops"}]}],
     "'arguments' is not JSON"),
    ([{"role": "assistant", "tool_calls": [{"arguments": {}}]}],
     "'name' must be a non-empty string"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    ({"role": "user", "content": "x"}, "a list of messages"),
])
def test_bad_conversations_name_what_is_wrong(messages, needle):
  with pytest.raises(ChatFormatError) as e:
    chat.render(messages, ByteTokenizer())
  assert needle in str(e.value)
