"""The OpenAI request and response shapes the server speaks, and its errors.

Requests are pydantic models, so FastAPI validates them and writes them into
the OpenAPI schema (which the fuzz test reads). Unknown fields are refused
(a 400 naming the field) rather than silently ignored: an OpenAI parameter
m2jax does not implement (penalties, logit_bias, best_of, echo, suffix, ...)
is an error, not a different answer. Extensions to OpenAI's shapes:

  request   top_k (int, 0 or -1: all)
  choice    token_ids, token_logprobs: the generated ids and their log q
            (the sampling distribution's log-prob, m2jax/infer/sampling.py);
            prompt_token_ids: the prompt as the engine saw it (the chat
            template rendered, BOS included)
  response  policy_version: the version of the weights that answered
            (m2jax/serve/loop.py)

Log-probs are those of the sampled tokens only: OpenAI's `top_logprobs`
come back null (completions) or empty (chat), as the engine computes no
alternatives.

Every error is OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, with a 4xx status for what the client sent and 500 for a failure
of the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

# Most samples of one prompt (OpenAI allows 128; here every sample is a row
# of the engine's batch, so the server says max_batch: `limits`).
MAX_STOP = 4             # stop strings per request (OpenAI's limit)
MAX_PROMPTS = 16         # prompts of one /v1/completions request
# Seeds in [0, MAX_SEED): sample i of n draws with seed + i, which must fit
# the engine's uint32 key.
MAX_SEED = 2**31


class ApiError(Exception):
  """A request the server refuses; becomes OpenAI's error shape."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, type_: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = (status, message,
                                                        param, code)
    self.type = type_ or ("server_error" if status >= 500
                          else "invalid_request_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type,
                      "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
  message: str
  type: str
  param: str | None = None
  code: str | None = None


class ErrorResponse(BaseModel):
  error: ErrorDetail


# ------------------------------------------------------------- requests --

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]   # below the vocabulary: app.py
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Texts = Annotated[list[str], Field(min_length=1)]


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: bool = False


class _Request(BaseModel):
  model_config = ConfigDict(extra="forbid")

  model: str
  n: int = Field(1, ge=1)
  max_tokens: int | None = Field(None, ge=1)
  temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
  top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
  top_k: int = Field(0, ge=-1)
  seed: int | None = Field(None, ge=0, lt=MAX_SEED)
  stop: NonEmptyStr | list[NonEmptyStr] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None

  def stops(self) -> tuple[str, ...]:
    stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
    if len(stop) > MAX_STOP:
      raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got "
                     f"{len(stop)}", "stop")
    if any(not s for s in stop):
      raise ApiError(400, "stop: stop strings must be non-empty", "stop")
    return tuple(stop)


class CompletionRequest(_Request):
  """POST /v1/completions. prompt: text, token ids, or a list of either
  (each its own prompt; choice i*n + j is sample j of prompt i)."""
  prompt: str | Texts | TokenIds | Annotated[list[TokenIds],
                                             Field(min_length=1)]
  logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
  """One message; checked again (and rendered) by m2jax/data/chat.py."""
  model_config = ConfigDict(extra="forbid")

  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[dict[str, Any]] | None = None
  reasoning_content: str | None = None
  reasoning: str | None = None
  tool_calls: list[dict[str, Any]] | None = None
  tool_call_id: str | None = None
  name: str | None = None

  def as_chat(self) -> dict:
    """The dict m2jax.data.chat reads ("developer" is OpenAI's newer name
    for "system")."""
    out = self.model_dump(exclude_none=True)
    if out["role"] == "developer":
      out["role"] = "system"
    return out


class ChatRequest(_Request):
  """POST /v1/chat/completions."""
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=20)
  tools: list[dict[str, Any]] | None = None
  tool_choice: Literal["auto", "none"] | None = None
  parallel_tool_calls: bool | None = None


# ------------------------------------------------------------ responses --

class _Open(BaseModel):
  model_config = ConfigDict(extra="allow")


class Usage(_Open):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class ModelCard(_Open):
  id: str
  object: Literal["model"] = "model"
  created: int
  owned_by: str
  max_model_len: int
  policy_version: int


class ModelList(_Open):
  object: Literal["list"] = "list"
  data: list[ModelCard]


class CompletionChoice(_Open):
  index: int
  text: str
  finish_reason: str | None
  logprobs: dict[str, Any] | None = None
  token_ids: list[int]
  token_logprobs: list[float]
  prompt_token_ids: list[int]


class CompletionResponse(_Open):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage
  policy_version: int


class ChatChoice(_Open):
  index: int
  message: dict[str, Any]
  finish_reason: str | None
  logprobs: dict[str, Any] | None = None
  token_ids: list[int]
  token_logprobs: list[float]
  prompt_token_ids: list[int]


class ChatResponse(_Open):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  policy_version: int


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


def validation_error(exc: pydantic.ValidationError | Any) -> ApiError:
  """A 400 from FastAPI's / pydantic's validation errors (the first one)."""
  errors = exc.errors()
  if not errors:
    return ApiError(400, "invalid request")
  first = errors[0]
  # The location without "body" and the names pydantic gives the branches
  # of a union ("str", "list[int]").
  loc = [str(p) for p in first.get("loc", ())
         if p != "body" and p not in _TYPE_NAMES
         and not set(str(p)) & set("[-")]
  if first.get("type") == "json_invalid":
    return ApiError(400, "the request body is not valid JSON: "
                    f"{first.get('msg', '')}", None, "invalid_json")
  if first.get("type") == "extra_forbidden":
    return ApiError(400, f"unsupported parameter {'.'.join(loc)!r}",
                    ".".join(loc) or None, "unsupported_parameter")
  where = ".".join(loc) or "body"
  return ApiError(400, f"{where}: {first.get('msg', 'invalid value')}",
                  ".".join(loc) or None, "invalid_value")
