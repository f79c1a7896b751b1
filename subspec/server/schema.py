"""The OpenAI request bodies we accept, and OpenAI-shaped errors.

Requests are validated strictly, as OpenAI does: a field of the wrong type is a 400 (never coerced) and so is an
unknown field. OpenAI fields that change nothing here (``user``, ``metadata``, ``store``, ...) are accepted;
fields whose non-default values we cannot honour (``n`` > 1, penalties, logprobs, tools, logit_bias, ...) are
rejected with a message naming them instead of being silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered as OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class GenerationRequest(_Strict):
    """What chat and text completions share: sampling, limits, stop strings, streaming."""

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=0, description="extension: keep the k most likely tokens (0 = all)")
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logprobs: Union[StrictBool, StrictInt, None] = None
    # accepted, and change nothing here
    user: Optional[StrictStr] = None
    metadata: Optional[dict] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    # known, but only their empty or default values can be honoured
    logit_bias: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Any = None
    functions: Optional[list] = None
    function_call: Any = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[dict] = None
    top_logprobs: Optional[StrictInt] = None

    @model_validator(mode="after")
    def _supported(self):
        unsupported = [("n", self.n != 1, "only n = 1 is supported"),
                       ("presence_penalty", bool(self.presence_penalty), "penalties are not supported"),
                       ("frequency_penalty", bool(self.frequency_penalty), "penalties are not supported"),
                       ("logprobs", bool(self.logprobs) or bool(self.top_logprobs), "logprobs are not supported"),
                       ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
                       ("tools", bool(self.tools or self.functions), "tool calls are not supported"),
                       ("response_format", (self.response_format or {}).get("type", "text") != "text",
                        "only text responses are supported")]
        for name, bad, why in unsupported:
            if bad:
                raise ValueError(f"{name}: {why}")
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        return self

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)


class CompletionRequest(GenerationRequest):
    prompt: Union[StrictStr, list[StrictStr]]
    echo: StrictBool = False
    best_of: StrictInt = 1
    suffix: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo or self.best_of != 1 or self.suffix:
            raise ValueError("echo, best_of > 1 and suffix are not supported")
        return self

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "prompt: give one prompt (a string or a list of one string)", param="prompt")
        return self.prompt[0]


def _request_fields() -> set[str]:
    return set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)


def validation_error(errors: list[dict]) -> ApiError:
    """An :class:`ApiError` (400) from pydantic/FastAPI validation errors: the first problem, with its field."""
    if not errors:
        return ApiError(400, "invalid request")
    e = max(errors, key=lambda x: len(x.get("loc", ())))  # of a union's alternatives, the most specific problem
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _type_tag(x)]
    if e.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})",
                        code="invalid_json")
    if e.get("type") == "missing":
        return ApiError(400, f"missing required field '{'.'.join(loc)}'", param=".".join(loc) or None)
    if e.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field '{'.'.join(loc)}': this server accepts OpenAI's fields (and top_k)",
                        param=".".join(loc) or None, code="unknown_field")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(loc)
    named = msg.split(": ", 1)[0] if ": " in msg else ""
    if not where and named in _request_fields():  # a check across fields (the request model's own) names its field
        where = named
    return ApiError(400, f"{where}: {msg}" if where and not msg.startswith(where) else msg, param=where or None)


def _type_tag(part) -> bool:
    """Whether a pydantic error location part names a union alternative ('str', 'list[TextPart]', 'TextPart')."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")
                                      or part[:1].isupper())
