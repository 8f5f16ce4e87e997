"""Streaming a sample as it grows: which tokens and text may be sent now.

The engine reports new tokens every step, but not every token can be sent
at once: a stop string may be forming across tokens (the engine then cuts
the sample back to before it, m2jax/infer/engine.py), a byte-level token may
end inside a UTF-8 character, and a chat completion's text is split into
reasoning, content and tool calls only once their markers are complete.
`Release` holds back exactly the tail that could still change, so that the
streamed pieces concatenate to the final (non-streamed) answer.

  release = Release(tokenizer, hold=completion_hold(stops))
  ids, text = release.update(tokens, final=False)   # new ids, new text
  ...
  ids, text = release.update(final_tokens, final=True)

`ChatDeltas` turns the released text of an assistant turn into OpenAI's
delta fields (`reasoning_content`, `content`) and, at the end, tool calls.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from m2jax.data import chat

_REPLACEMENT = "\ufffd"  # what a token ending mid-character decodes to


def held_tail(text: str, markers: Sequence[str]) -> int:
  """Length of the longest tail of `text` that is a proper prefix of one
  of `markers` (the part a later token could turn into a marker)."""
  best = 0
  for m in markers:
    for k in range(min(len(m) - 1, len(text)), best, -1):
      if text.endswith(m[:k]):
        best = k
        break
  return best


def completion_hold(stops: Sequence[str]) -> Callable[[str], int]:
  """How much text of a plain completion may be sent: all but a tail that
  could still become a stop string."""
  return lambda text: len(text) - held_tail(text, stops)


# Markers of the chat template whose completion changes how text before
# them is read (m2jax/data/chat.py): the think block's ends, a tool call
# and the newline before it, the end of the turn.
_CHAT_MARKERS = (chat.THINK_OPEN, chat.THINK_CLOSE, chat.THINK_END,
                 "\n" + chat.TOOL_CALL_OPEN, chat.TOOL_CALL_OPEN,
                 chat.END_OF_TURN)


def chat_hold(stops: Sequence[str]) -> Callable[[str], int]:
  """How much of an assistant turn may be sent: text before the first tool
  call (the calls are sent whole at the end) and before a tail that could
  still become a marker or a stop string."""
  markers = _CHAT_MARKERS + tuple(stops)

  def hold(text: str) -> int:
    safe = len(text) - held_tail(text, markers)
    call = text.find(chat.TOOL_CALL_OPEN)
    if call >= 0:
      safe = min(safe, call - (text[:call].endswith("\n")))
    return safe
  return hold


class Release:
  """What of one sample has been sent, and what may be sent next."""

  def __init__(self, tokenizer, hold: Callable[[str], int]):
    self.tokenizer, self.hold = tokenizer, hold
    self.ids: list[int] = []    # sent token ids
    self.text = ""              # sent text: decode(ids)

  def _decode(self, ids) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode(np.asarray(ids, np.int64))

  def update(self, tokens: Sequence[int], final: bool
             ) -> tuple[list[int], str]:
    """(new ids, new text) to send, given the sample's tokens so far (with
    `final`, its finished tokens: everything left is sent)."""
    tokens = list(tokens)
    m = len(tokens)
    if not final:
      text = self._decode(tokens)
      safe = self.hold(text)
      if text.endswith(_REPLACEMENT):
        # Bytes of a character still incomplete: the next token may finish
        # it (an invalid byte earlier in the text is final).
        safe = min(safe, len(text) - 1)
      # The longest token prefix whose text is a prefix of the safe part
      # (a prefix that splits a character decodes to something else).
      while m > len(self.ids):
        head = text if m == len(tokens) else self._decode(tokens[:m])
        if len(head) <= safe and text.startswith(head):
          break
        m -= 1
    if m <= len(self.ids):
      return [], ""
    text = self._decode(tokens[:m])
    new_ids = tokens[len(self.ids):m]
    # The sent text is a prefix of what follows (that is what holding back
    # is for); were it not (a tokenizer whose decode is not monotone), the
    # rest is sent from where the texts part.
    start = len(self.text) if text.startswith(self.text) else len(
        _common_prefix(text, self.text))
    new_text = text[start:]
    self.ids, self.text = tokens[:m], text
    return new_ids, new_text


def _common_prefix(a: str, b: str) -> str:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return a[:n]


class ChatDeltas:
  """OpenAI chat deltas from the released text of an assistant turn."""

  def __init__(self):
    self.reasoning = ""    # reasoning sent so far
    self.content = ""      # content sent so far

  def update(self, text: str) -> dict:
    """The delta fields ({"reasoning_content"?, "content"?}) for the text
    released so far (a prefix of the turn, cut by `chat_hold`)."""
    return self._delta(chat.parse_completion(text))

  def finish(self, text: str) -> tuple[dict, dict]:
    """(last delta, parsed message) of the whole turn's text."""
    message = chat.parse_completion(text)
    return self._delta(message), message

  def _delta(self, message: dict) -> dict:
    delta = {}
    for field, key, sent in (("reasoning", "reasoning_content",
                              self.reasoning),
                             ("content", "content", self.content)):
      now = message.get(field) or ""
      if len(now) > len(sent) and now.startswith(sent):
        delta[key] = now[len(sent):]
        setattr(self, field, now)
    return delta
