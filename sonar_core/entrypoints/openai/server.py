"""The OpenAI-compatible HTTP server: the FastAPI application and ``aphrodite serve``'s entry point.

``build_app(engine, server_args)`` wraps one engine; every request shares it through
:class:`AsyncEngine`. ``run_server(engine_config, server_args)`` binds the socket, loads the model
and serves with uvicorn until SIGINT/SIGTERM, returning the process exit status.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version``.
With ``--api-key`` every ``/v1`` route needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sonar_core import __version__
from sonar_core.engine.request_errors import RequestError
from sonar_core.entrypoints.openai.async_engine import (
    AsyncEngine,
    EngineShutdownError,
    EngineStepError,
    RequestStream,
)
from sonar_core.entrypoints.openai.metrics import EngineState, ServerMetrics, StatsRecorder
from sonar_core.entrypoints.openai.protocol import (
    APIError,
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogProbToken,
    ChatMessage,
    ChatMessageParam,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    UsageInfo,
    VersionInfo,
    chat_sampling_params,
    completion_sampling_params,
    error_body,
    new_id,
    now,
)
from sonar_core.errors import ConfigError, SonarError
from sonar_core.outputs import RequestOutput
from sonar_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sonar_core.config import EngineConfig

logger = logging.getLogger("sonar.server")

ALL_INTERFACES = "0.0.0.0"
# After SIGINT/SIGTERM, in-flight requests get this long to finish before they are aborted.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 30
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 422, 500, 503)
}
T = TypeVar("T")


# ------------------------------------------------------------------------------------ app factory
def build_app(engine: Any, server_args: argparse.Namespace) -> FastAPI:
    """The FastAPI application around ``engine`` (an :class:`LLMEngine`, or anything with its API).

    The engine thread starts with the application (lifespan startup) and stops with it, aborting
    what is still in flight. ``server_args`` supplies ``api_key``, ``served_model_name`` and
    ``disable_log_stats``.
    """
    names = _served_names(server_args.served_model_name, engine.model_name)
    # A data-parallel engine (sonar_core.parallel.data) has replicas, each with series of its own.
    replica_states = getattr(engine, "replica_states", None)
    metrics = ServerMetrics(
        names[0], engine.spec_stats.num_speculative_tokens, num_engines=getattr(engine, "num_replicas", 1)
    )
    recorder = StatsRecorder(
        metrics, engine.spec_stats, log_stats=not server_args.disable_log_stats,
        replica_states=_as_engine_states(replica_states) if replica_states is not None else None,
    )
    async_engine = AsyncEngine(engine, recorder)
    serving = _Serving(engine, async_engine, names)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(
        title="Sonar OpenAI-compatible API",
        version=__version__,
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.served_names = names
    if server_args.api_key:
        app.add_middleware(_BearerAuth, api_key=server_args.api_key)
    _add_error_handlers(app)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine thread runs (and, data-parallel, every replica serves), else 503."""
        if not async_engine.is_running:
            return _error(503, "the engine is not running")
        problem = getattr(engine, "health_problem", lambda: None)()
        if problem is not None:
            return _error(503, problem)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionInfo:
        return VersionInfo(version=__version__)

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition (request, latency, engine and speculative-decoding series)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return serving.model_list()

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_stream_response_doc())
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await serving.completion(body, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_stream_response_doc())
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving.chat(body, raw_request)

    return app


def _as_engine_states(replica_states: Callable[[], Sequence[Any]]) -> Callable[[], list[EngineState]]:
    """The replicas' states (:class:`~sonar_core.parallel.data_messages.ReplicaState`) as the
    metrics take them."""
    return lambda: [
        EngineState(s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits)
        for s in replica_states()
    ]


def _served_names(served_model_name: str | list[str] | None, model_name: str) -> list[str]:
    if isinstance(served_model_name, str):
        return [served_model_name]
    return list(served_model_name or []) or [model_name]


def _stream_response_doc() -> dict[int | str, dict[str, Any]]:
    return {200: {"content": {"text/event-stream": {"description": "With stream=true: server-sent events."}}}}


# -------------------------------------------------------------------------------- errors and auth
def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body, with the status the SDK expects."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
        if first.get("type") == "json_invalid":
            # loc holds the character offset of the problem, not a field.
            offset = next((part for part in first.get("loc", ()) if isinstance(part, int)), None)
            where = f" at character {offset}" if offset is not None else ""
            reason = (first.get("ctx") or {}).get("error", first["msg"])
            return _error(400, f"the request body is not valid JSON{where}: {reason}", None)
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return _error(422, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(_ClientDisconnected)
    async def client_disconnected(request: Request, exc: _ClientDisconnected) -> Response:
        # Nobody reads this response; 499 (nginx's "client closed request") keeps access logs honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal server error; the server log has the details")


class _BearerAuth:
    """Requires ``Authorization: Bearer <api_key>`` on every ``/v1`` route (401 otherwise).

    A plain ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``, which would sit
    between streaming responses and the client's disconnect notice.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            response = _error(401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False


# ---------------------------------------------------------------------------------------- serving
@dataclass
class _Cursor:
    """How much of one choice's cumulative output a stream has sent."""

    index: int
    num_chars: int = 0
    num_tokens: int = 0
    usage_prompt: int = 0
    usage_completion: int = 0
    finish_reason: FinishReason | None = None


class _Serving:
    """Request handling shared by the completion and chat routes."""

    def __init__(self, engine: Any, async_engine: AsyncEngine, served_names: list[str]) -> None:
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.model_root: str = engine.model_name
        self.async_engine = async_engine
        self.served_names = served_names
        self.valid_names = {*served_names, engine.model_name}

    # -------------------------------------------------------------------------------- routes
    def model_list(self) -> ModelList:
        created = now()
        return ModelList(
            data=[
                ModelCard(id=name, created=created, root=self.model_root, max_model_len=self.max_model_len)
                for name in self.served_names
            ]
        )

    async def completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        model = self._model(body.model)
        params = completion_sampling_params(body)
        prompts = self._completion_prompts(body.prompt)
        request_id = new_id("cmpl")
        streams = await self._start(request_id, prompts, params)
        responder = _CompletionResponder(self, request_id, model, params, body.logprobs is not None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(responder.events(streams, include_usage))
        finals = await self._finals(streams, raw_request)
        return JSONResponse(responder.response(finals).model_dump())

    async def chat(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self._model(body.model)
        params = chat_sampling_params(body)
        prompt_ids = self._encode(self._render_chat(body.messages), "messages")
        request_id = new_id("chatcmpl")
        streams = await self._start(request_id, [prompt_ids], params)
        responder = _ChatResponder(self, request_id, model, params, body.logprobs)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(responder.events(streams, include_usage))
        finals = await self._finals(streams, raw_request)
        return JSONResponse(responder.response(finals).model_dump())

    # ------------------------------------------------------------------------------- helpers
    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.served_names[0]
        if requested not in self.valid_names:
            raise APIError(
                f"the model {requested!r} does not exist; GET /v1/models lists the served models: "
                + ", ".join(self.served_names),
                "model",
                status=404,
            )
        return requested

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if not prompt:
            raise APIError("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return [self._encode(item, "prompt") if isinstance(item, str) else list(item) for item in prompt]

    def _encode(self, text: str, param: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        if not ids:
            raise APIError(f"the {param} is empty; send at least one token", param)
        return ids

    def _render_chat(self, messages: list[ChatMessageParam]) -> str:
        """The prompt text of a conversation, through the tokenizer's chat template."""
        conversation = [{"role": m.role, "content": _message_text(m, index)} for index, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors, a missing template: the input cannot be rendered
            raise APIError(f"the model's chat template cannot render these messages: {exc}", "messages") from None

    async def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[RequestStream]:
        """Add one engine request per prompt; on any refusal, withdraw the ones already added."""
        streams: list[RequestStream] = []
        try:
            for index, prompt_ids in enumerate(prompts):
                request_params = params
                if params.max_tokens is None:  # fill the context, as OpenAI does without max_tokens
                    room = max(1, self.max_model_len - len(prompt_ids))
                    request_params = params.model_copy(update={"max_tokens": room})
                stream = await self.async_engine.add_request(f"{request_id}-{index}", prompt_ids, request_params)
                streams.append(stream)
        except BaseException as exc:
            for stream in streams:
                stream.abort()
            if isinstance(exc, RequestError):
                raise APIError(str(exc)) from None
            if isinstance(exc, EngineShutdownError):
                raise APIError(str(exc), status=503) from None
            raise
        return streams

    async def _finals(self, streams: list[RequestStream], raw_request: Request) -> list[RequestOutput]:
        """The final output of every stream; aborts them all if the client disconnects first."""
        try:
            return await _unless_disconnected(raw_request, _collect(streams))
        except EngineStepError as exc:
            raise APIError(str(exc), status=500) from None
        except EngineShutdownError as exc:
            raise APIError(str(exc), status=503) from None
        finally:
            for stream in streams:
                stream.abort()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _message_text(message: ChatMessageParam, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                f"messages[{index}]: content parts of type {part.type!r} are not supported; "
                "this server serves text models (send parts of type 'text')",
                f"messages.{index}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


# ------------------------------------------------------------------------------ stream plumbing
class _ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it and raise)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise _ClientDisconnected
    return task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with contextlib.aclosing(_merge(streams)) as outputs:
        async for index, output in outputs:
            finals[index] = output
    return [final for final in finals if final is not None]


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as exc:
            merged.put_nowait((index, exc))
        merged.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _finish_reason(output: RequestOutput) -> FinishReason | None:
    reason = output.outputs[0].finish_reason
    return reason if reason in ("stop", "length") else None  # type: ignore[return-value]


class _Responder(abc.ABC):
    """Builds one route's answer from the engine's cumulative outputs: the server-sent events of a
    stream, or the whole response at once (the same cursors serve both, so they agree).

    Streamed text lags the engine's text by up to the longest stop string minus one character
    while the request runs: a stop string that completes later is cut from the final text, and
    text already sent cannot be taken back.
    """

    def __init__(
        self, serving: _Serving, request_id: str, model: str, params: SamplingParams, logprobs: bool
    ) -> None:
        self.serving = serving
        self.request_id = request_id
        self.model = model
        self.logprobs = logprobs
        self.created = now()
        self._hold_back = max((len(stop) for stop in params.stop), default=1) - 1

    def advance(self, cursor: _Cursor, output: RequestOutput) -> tuple[str, list[tuple[int, float]]]:
        """The text and (token id, logprob) pairs of ``output`` that the stream has not sent yet."""
        completion = output.outputs[0]
        text = completion.text
        end = len(text) if output.finished else max(cursor.num_chars, len(text) - self._hold_back)
        delta_text = text[cursor.num_chars : end]
        cursor.num_chars = end
        new_ids = completion.token_ids[cursor.num_tokens :]
        logprobs = (completion.logprobs or [])[cursor.num_tokens :] if self.logprobs else []
        cursor.num_tokens = len(completion.token_ids)
        cursor.usage_prompt = len(output.prompt_token_ids)
        cursor.usage_completion = len(completion.token_ids)
        if output.finished:
            cursor.finish_reason = _finish_reason(output)
        return delta_text, list(zip(new_ids, logprobs, strict=False))

    @staticmethod
    def usage(cursors: list[_Cursor]) -> UsageInfo:
        prompt = sum(c.usage_prompt for c in cursors)
        completion = sum(c.usage_completion for c in cursors)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def events(self, streams: list[RequestStream], include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of the whole response, ``data: [DONE]`` last.

        An engine failure mid-stream becomes an ``error`` event (the status line is already
        sent). Leaving early (client gone, cancellation) aborts the requests in a ``finally``.
        """
        cursors = [_Cursor(index) for index in range(len(streams))]
        try:
            for event in self.opening_events(len(streams)):
                yield event
            async with contextlib.aclosing(_merge(streams)) as outputs:
                async for index, output in outputs:
                    for event in self.output_events(cursors[index], output):
                        yield event
                    # Outputs queued while the client was slow arrive without a pause; yielding to
                    # the loop between them lets it notice a disconnect and serve other requests.
                    await asyncio.sleep(0)
            if include_usage:
                yield self.usage_event(self.usage(cursors))
        except (EngineStepError, EngineShutdownError) as exc:
            status = 503 if isinstance(exc, EngineShutdownError) else 500
            yield f"data: {ErrorResponse.model_validate(error_body(status, str(exc))).model_dump_json()}\n\n"
        finally:
            for stream in streams:
                stream.abort()
        yield "data: [DONE]\n\n"

    def opening_events(self, num_choices: int) -> Iterator[str]:
        """Events before any output (chat announces the assistant role)."""
        return iter(())

    @abc.abstractmethod
    def output_events(self, cursor: _Cursor, output: RequestOutput) -> Iterator[str]:
        """The events for one new output of the choice ``cursor`` follows."""

    @abc.abstractmethod
    def chunk(self, choices: list[Any], usage: UsageInfo | None = None) -> str:
        """One server-sent event: a chunk object of the route's kind around ``choices``."""

    def usage_event(self, usage: UsageInfo) -> str:
        """The closing event that carries the usage (stream_options.include_usage)."""
        return self.chunk([], usage)


class _CompletionResponder(_Responder):
    def output_events(self, cursor: _Cursor, output: RequestOutput) -> Iterator[str]:
        text, token_logprobs = self.advance(cursor, output)
        if text or token_logprobs:
            logprobs = self._logprobs(token_logprobs, cursor.num_chars - len(text))
            yield self.chunk([CompletionChoice(index=cursor.index, text=text, logprobs=logprobs)])
        if output.finished:
            yield self.chunk([CompletionChoice(index=cursor.index, text="", finish_reason=cursor.finish_reason)])

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return _event(
            CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)
        )

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        cursors = [_Cursor(index) for index in range(len(finals))]
        choices = []
        for cursor, output in zip(cursors, finals, strict=True):
            text, token_logprobs = self.advance(cursor, output)
            choices.append(
                CompletionChoice(
                    index=cursor.index,
                    text=text,
                    logprobs=self._logprobs(token_logprobs, 0),
                    finish_reason=cursor.finish_reason,
                )
            )
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage(cursors)
        )

    def _logprobs(self, token_logprobs: list[tuple[int, float]], offset: int) -> CompletionLogProbs | None:
        if not self.logprobs:
            return None
        tokens = [self.serving.token_text(token_id) for token_id, _ in token_logprobs]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogProbs(
            tokens=tokens,
            token_logprobs=[logprob for _, logprob in token_logprobs],
            text_offset=offsets,
        )


class _ChatResponder(_Responder):
    def opening_events(self, num_choices: int) -> Iterator[str]:
        for index in range(num_choices):
            yield self.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])

    def output_events(self, cursor: _Cursor, output: RequestOutput) -> Iterator[str]:
        text, token_logprobs = self.advance(cursor, output)
        if text or token_logprobs:
            yield self.chunk(
                [
                    ChatCompletionStreamChoice(
                        index=cursor.index, delta=DeltaMessage(content=text), logprobs=self._logprobs(token_logprobs)
                    )
                ]
            )
        if output.finished:
            yield self.chunk(
                [ChatCompletionStreamChoice(index=cursor.index, delta=DeltaMessage(), finish_reason=cursor.finish_reason)]
            )

    def chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        return _event(
            ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage)
        )

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        cursors = [_Cursor(index) for index in range(len(finals))]
        choices = []
        for cursor, output in zip(cursors, finals, strict=True):
            text, token_logprobs = self.advance(cursor, output)
            choices.append(
                ChatCompletionChoice(
                    index=cursor.index,
                    message=ChatMessage(content=text),
                    logprobs=self._logprobs(token_logprobs),
                    finish_reason=cursor.finish_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage(cursors)
        )

    def _logprobs(self, token_logprobs: list[tuple[int, float]]) -> ChatChoiceLogProbs | None:
        if not self.logprobs:
            return None
        content = []
        for token_id, logprob in token_logprobs:
            token = self.serving.token_text(token_id)
            content.append(ChatLogProbToken(token=token, logprob=logprob, bytes=list(token.encode("utf-8"))))
        return ChatChoiceLogProbs(content=content)


# ----------------------------------------------------------------------------------- run_server
# How the command line prefixes its errors (argparse's "prog: error: "), for startup failures too.
ERROR_PREFIX = "aphrodite serve: error: "


def run_server(engine_config: EngineConfig, server_args: Any) -> int:
    """Serve until SIGINT/SIGTERM; return the exit status (0 after a clean shutdown).

    ``server_args`` is any object with ``host`` (None: every interface), ``port``, ``api_key``
    and ``served_model_name``, optionally ``disable_log_stats`` (an argparse namespace, or the
    command line's ``ServerArgs``). The socket is bound before the model loads, so a busy port fails in a second rather than
    after the load. Startup failures (a configuration the model contradicts, a model that cannot
    be loaded, a port in use) print one message to stderr and return non-zero, without a
    traceback.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    settings = _settings(engine_config, server_args)
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as exc:
        print(
            f"{ERROR_PREFIX}cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}. "
            "Fix: choose a free port with --port (or stop the process that holds this one)",
            file=sys.stderr,
        )
        return 1
    with sock:
        try:
            engine = _load_engine(engine_config)
        except ConfigError as exc:
            print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
            return 2
        except (SonarError, ValueError, OSError) as exc:
            print(f"{ERROR_PREFIX}cannot load the model: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        try:
            _serve(engine, settings, sock)
        finally:
            engine.close()  # the engine's processes (replicas, tensor-parallel ranks) end with the server
    return 0


def _serve(engine: Any, settings: argparse.Namespace, sock: socket.socket) -> None:
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        log_level="info",
    )
    port = sock.getsockname()[1]
    logger.info("serving %s on http://%s:%d (Ctrl+C to stop)", ", ".join(app.state.served_names),
                settings.host, port)
    with _exit_quietly_after_signals():
        uvicorn.Server(config).run(sockets=[sock])


def _settings(engine_config: EngineConfig, server_args: Any) -> argparse.Namespace:
    """The server settings ``build_app`` reads, from the command line's server arguments.

    ``host`` None means every interface; ``--disable-log-stats`` may arrive with the server
    arguments or as the engine configuration field of the same name.
    """
    return argparse.Namespace(
        host=server_args.host or ALL_INTERFACES,
        port=server_args.port,
        api_key=server_args.api_key,
        served_model_name=server_args.served_model_name,
        disable_log_stats=bool(
            getattr(server_args, "disable_log_stats", False) or engine_config.disable_log_stats
        ),
    )


def _load_engine(engine_config: EngineConfig) -> Any:
    # Imported here: the engine pulls in torch and the model code, which the app factory (and its
    # tests with a stand-in engine) do not need.
    if engine_config.data_parallel_size > 1:
        from sonar_core.parallel.data import DataParallelEngine

        return DataParallelEngine(engine_config)
    from sonar_core.engine.llm_engine import LLMEngine

    return LLMEngine(engine_config)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _exit_quietly_after_signals() -> Iterator[None]:
    """Uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; let that end run_server normally.

    Without this, SIGTERM's default action would kill the process after a clean shutdown and
    SIGINT would surface as a KeyboardInterrupt traceback.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
