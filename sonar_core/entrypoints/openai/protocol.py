"""Request and response bodies of the OpenAI-compatible API, with OpenAI's field names.

Two kinds of bad input get two answers, as OpenAI and vLLM give them: a body that does not match
these models (a string where a number belongs, a missing ``prompt``, malformed JSON) is rejected
by FastAPI with 422, while a well-typed value that cannot be served (a negative ``max_tokens``,
``n=3``, a penalty this engine does not implement) raises :class:`APIError` with 400. So the
request models check types only (strictly: ``"5"`` is not a number) and
:func:`completion_sampling_params` / :func:`chat_sampling_params` check values. Fields a client
sends that are not declared here are ignored, like OpenAI's own SDK extras; fields that would
change the output if honoured but are not implemented are declared and rejected, never dropped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sonar_core.sampling_params import SamplingParams

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# OpenAI's limits on the number of alternatives per token.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


# ------------------------------------------------------------------------------------------ errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body; ``type`` is the SDK's exception name for the status (vLLM does the same)."""

    error: ErrorInfo


ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON of an :class:`ErrorResponse` for ``status``."""
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


class APIError(Exception):
    """A request the server refuses; the handler answers ``status`` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


# ---------------------------------------------------------------------------------------- requests
class _Body(BaseModel):
    # Strict: a JSON string is not a number and a number is not a string (422); ints still pass
    # where floats are expected. Unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="A name from /v1/models; omitted means the served model.")
    max_tokens: int | None = Field(None, description="Maximum tokens to generate.")
    temperature: float | None = Field(None, description="0 selects greedy decoding; default 1.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="Extension: keep the k most likely tokens (0 or -1: off).")
    min_p: float | None = Field(None, description="Extension: drop tokens below min_p times the top probability.")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="Only 1 is supported.")
    user: str | None = None
    presence_penalty: float | None = Field(None, description="Not implemented; only 0 is accepted.")
    frequency_penalty: float | None = Field(None, description="Not implemented; only 0 is accepted.")
    logit_bias: dict[str, float] | None = Field(None, description="Not implemented; only empty is accepted.")
    # vLLM extensions that map directly onto SamplingParams.
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``; one prompt or a batch (each becomes one choice)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="Maximum tokens to generate (OpenAI's default is 16).")
    logprobs: int | None = Field(None, description="0 returns the logprob of each sampled token.")
    echo: bool = Field(False, description="Not implemented; only false is accepted.")
    suffix: str | None = Field(None, description="Not implemented; only null is accepted.")
    best_of: int | None = Field(None, description="Only 1 is supported.")


class ContentPart(_Body):
    """One part of a message's content; only ``text`` parts can be served by a text model."""

    type: str
    text: str | None = None


class ChatMessageParam(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the conversation goes through the tokenizer's chat template."""

    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = Field(None, description="Preferred over max_tokens when both are set.")
    logprobs: bool = Field(False, description="Return the logprob of each sampled token.")
    top_logprobs: int | None = Field(None, description="Alternatives per token; only 0 is supported.")


# --------------------------------------------------------------------------- requests -> params
def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    """Check a completion request's values and build its :class:`SamplingParams` (400 on bad values)."""
    _check_shared(request)
    if request.echo:
        raise APIError("echo is not supported; send echo=false", "echo")
    if request.suffix:
        raise APIError("suffix is not supported; send the prompt without a suffix", "suffix")
    if request.best_of not in (None, 1):
        raise APIError("best_of must be 1 (one completion per prompt)", "best_of")
    if request.logprobs is not None:
        if not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", "logprobs")
        if request.logprobs > 0:
            raise APIError(
                "logprobs > 0 asks for alternative tokens, which this server does not compute; "
                "send logprobs=0 for the logprob of each sampled token",
                "logprobs",
            )
    return _sampling_params(request, request.max_tokens, "max_tokens", request.logprobs is not None)


def chat_sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """Check a chat request's values and build its :class:`SamplingParams` (400 on bad values).

    ``max_tokens`` may be None here: the server then fills in what the context has room for.
    """
    _check_shared(request)
    if not request.messages:
        raise APIError("messages must hold at least one message", "messages")
    if request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}", "top_logprobs")
        if request.top_logprobs > 0:
            raise APIError(
                "top_logprobs > 0 asks for alternative tokens, which this server does not compute; "
                "send logprobs=true without top_logprobs",
                "top_logprobs",
            )
        if not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
    if request.max_completion_tokens is not None:
        max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = request.max_tokens, "max_tokens"
    return _sampling_params(request, max_tokens, param, request.logprobs)


def _check_shared(request: _SamplingRequest) -> None:
    if request.n != 1:
        raise APIError("n must be 1: this server returns one choice per prompt", "n")
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options is only allowed when stream is true", "stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0.0):
            raise APIError(f"{name} is not supported; send 0 or leave it out", name)
    if request.logit_bias:
        raise APIError("logit_bias is not supported; send an empty object or leave it out", "logit_bias")
    for name in ("seed", "top_k"):  # these reach torch as int64
        value = getattr(request, name)
        if value is not None and not INT64_MIN <= value <= INT64_MAX:
            raise APIError(f"{name} must fit in a signed 64-bit integer", name)


def _sampling_params(
    request: _SamplingRequest, max_tokens: int | None, max_tokens_param: str, logprobs: bool
) -> SamplingParams:
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "logprobs": 0 if logprobs else None,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids"):
        value = getattr(request, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else None
        param = max_tokens_param if name == "max_tokens" else name
        raise APIError(f"{param}: {error['msg']}" if param else error["msg"], param) from None


# --------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class CompletionLogProbs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProbToken(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbToken] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sonar"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str
