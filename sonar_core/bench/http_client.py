"""A minimal OpenAI-compatible streaming client on the standard library, for load generation.

One request per call, on its own connection, timed like the offline rows: the clock starts when
the request is sent, and each server-sent chunk that carries tokens is an event. Completions are
asked with ``logprobs=0`` so that each chunk says how many tokens it holds (a speculative step
streams several at once), and with token-id prompts so that every engine sees the same tokens.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from sonar_core.bench.peers.peer_protocol import RequestRecord
from sonar_core.errors import SonarError


class HTTPBenchError(SonarError):
    """The server refused a request or broke off its stream."""


class Endpoint:
    """A server's base URL (``http://host:port``, optionally with a path prefix) and API key."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme not in ("http", "https"):
            raise HTTPBenchError(f"{base_url}: only http:// and https:// URLs are supported")
        self.scheme = parts.scheme
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"

    def connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def get(self, path: str) -> tuple[int, bytes]:
        connection = self.connection()
        try:
            connection.request("GET", self.prefix + path, headers=self.headers())
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def model_id(self) -> str:
        """The first model ``/v1/models`` lists: what requests name."""
        status, body = self.get("/v1/models")
        if status != 200:
            raise HTTPBenchError(f"GET {self.url}/v1/models answered {status}: {body[:200]!r}")
        models = json.loads(body).get("data") or []
        if not models:
            raise HTTPBenchError(f"{self.url}/v1/models lists no model")
        return str(models[0]["id"])


def stream_completion(
    endpoint: Endpoint,
    model: str,
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send one greedy streaming completion and record when its tokens arrived."""
    body = {
        "model": model,
        "prompt": prompt_token_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "logprobs": 0,
    }
    connection = endpoint.connection()
    record = RequestRecord(id=request_id, submitted=clock(), text="")
    try:
        connection.request("POST", endpoint.prefix + "/v1/completions", json.dumps(body), endpoint.headers())
        response = connection.getresponse()
        if response.status != 200:
            raise HTTPBenchError(f"POST /v1/completions answered {response.status}: {response.read()[:300]!r}")
        for event in _server_sent_events(response):
            now = clock()
            for choice in event.get("choices") or []:
                count = _token_count(choice)
                if count:
                    record.events.append((now, count))
                    record.text = (record.text or "") + (choice.get("text") or "")
    except (OSError, http.client.HTTPException) as exc:
        raise HTTPBenchError(f"request {request_id} to {endpoint.url} failed: {exc}") from exc
    finally:
        connection.close()
    return record


def _server_sent_events(response: http.client.HTTPResponse) -> Any:
    """The JSON payloads of ``data:`` lines, up to ``[DONE]``."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def _token_count(choice: dict[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    if logprobs and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0  # a server that ignores logprobs: one event per chunk
