"""HTTP behaviour that needs a controllable engine: auth, engine failures, graceful shutdown."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from server_fakes import FakeEngine
from server_live import serve_in_thread


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_api_key_guards_v1_routes_only(tokenizer: Any) -> None:
    with serve_in_thread(FakeEngine(tokenizer), api_key="sekret") as server:
        with pytest.raises(openai.AuthenticationError) as caught:
            server.client(api_key="wrong").models.list()
        assert caught.value.status_code == 401
        assert caught.value.body["type"] == "AuthenticationError"
        with server.http() as http:
            missing = http.post("/v1/completions", json={"prompt": "hi"})
            assert missing.status_code == 401
            assert missing.headers["www-authenticate"] == "Bearer"
            assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
            for path in ("/health", "/metrics", "/version"):
                assert http.get(path).status_code == 200
        models = server.client().models.list()
        assert [m.id for m in models.data] == ["fake-model"]
        completion = server.client().completions.create(model="fake-model", prompt="abc", max_tokens=2)
        assert completion.usage.completion_tokens == 2


def test_served_model_name_is_listed_and_both_names_are_accepted(tokenizer: Any) -> None:
    with serve_in_thread(FakeEngine(tokenizer), served_model_name=["alias-a", "alias-b"]) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["alias-a", "alias-b"]
        for name in ("alias-a", "alias-b", "fake-model"):
            response = client.completions.create(model=name, prompt="xy", max_tokens=1)
            assert response.model == name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="xy", max_tokens=1)


def test_engine_failure_fails_requests_in_flight_then_serving_resumes(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.01)
    with serve_in_thread(engine) as server, server.http() as http:
        body = {"model": "fake-model", "prompt": "abcdef", "max_tokens": 40, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
            engine.fail_next_step = True
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == 500 and "injected step failure" in error["message"]

        # A non-streaming request caught in a failing step gets a 500 with OpenAI's body.
        result: dict[str, httpx.Response] = {}
        thread = threading.Thread(
            target=lambda: result.setdefault(
                "r", http.post("/v1/completions", json={"model": "fake-model", "prompt": "xyz", "max_tokens": 40})
            )
        )
        thread.start()
        assert _wait_until(lambda: engine.num_running == 1)
        engine.fail_next_step = True
        thread.join(30)
        assert result["r"].status_code == 500
        assert result["r"].json()["error"]["type"] == "InternalServerError"

        completion = server.client().completions.create(model="fake-model", prompt="abc", max_tokens=4)
        assert completion.choices[0].finish_reason == "length"
        server.wait_idle()


def test_shutdown_lets_streams_in_flight_finish(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.01)
    payloads: list[str] = []
    with serve_in_thread(engine) as server:
        started = threading.Event()

        def stream() -> None:
            with httpx.Client(base_url=server.base_url, timeout=60) as http:
                body = {"prompt": "abcdef", "max_tokens": 30, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        started.set()
                        if line.startswith("data: "):
                            payloads.append(line.removeprefix("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
    # Leaving the block shut the server down; the stream still ran to its end.
    reader.join(30)
    assert payloads[-1] == "[DONE]"
    finish = [json.loads(p)["choices"][0]["finish_reason"] for p in payloads[:-1]]
    assert finish[-1] == "length"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_client_gone_before_its_non_streamed_answer_is_aborted(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.01)
    with serve_in_thread(engine) as server:
        body = {"prompt": "abcdef", "max_tokens": 50}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.base_url, timeout=0.15) as http:
            http.post("/v1/completions", json=body)
        server.wait_idle(timeout=5)
        steps = engine.num_steps
        assert steps < 40  # aborted soon after the hang-up, long before its 50 tokens
        abort = server.metrics()[("aphrodite:request_success_total", (("finished_reason", "abort"),))]
        assert abort == 1


def _wait_until(condition: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False
