"""A real uvicorn server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from sonar_core.entrypoints.openai.server import build_app

MAX_MODEL_LEN = 128
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@dataclass
class LiveServer:
    base_url: str
    engine: Any
    app: FastAPI
    api_key: str | None

    def client(self, **kwargs: Any) -> openai.OpenAI:
        # No retries: a 5xx must be seen, not retried away.
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=f"{self.base_url}/v1", max_retries=0, timeout=60, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", max_retries=0, timeout=60, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                samples[(sample.name, labels)] = sample.value
        return samples

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and every KV block is free again (or fail)."""
        engine = self.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                not engine.has_unfinished_requests()
                and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            ):
                return
            time.sleep(0.02)
        raise AssertionError(
            f"engine not idle after {timeout} s: running={engine.num_running} waiting={engine.num_waiting} "
            f"free blocks={engine.block_manager.num_free_blocks}/{engine.block_manager.num_blocks}"
        )


def server_args(**overrides: Any) -> argparse.Namespace:
    values = {
        "host": "127.0.0.1",
        "port": 0,
        "api_key": None,
        "served_model_name": None,
        "disable_log_stats": True,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


@contextlib.contextmanager
def serve_in_thread(engine: Any, **overrides: Any) -> Iterator[LiveServer]:
    """Serve ``engine`` on 127.0.0.1 (a free port) until the block exits, then shut down cleanly."""
    args = server_args(**overrides)
    app = build_app(engine, args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app, args.api_key)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def engine_kwargs(checkpoint: Path) -> dict[str, Any]:
    # A small KV cache (a few hundred blocks) keeps allocation instant; 16 sequences per step
    # make 32 concurrent clients queue as well as batch.
    return {
        "model": str(checkpoint),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        "kv_cache_memory_gb": 0.004,
        "dtype": "float32",
        "device": "cpu",
    }


def make_engine(checkpoint: Path, **overrides: Any) -> Any:
    from sonar_core.config import EngineConfig
    from sonar_core.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**{**engine_kwargs(checkpoint), **overrides}))
