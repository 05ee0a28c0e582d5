"""The HTTP runner against a real server in a background thread (``--url`` mode), and against
servers the benchmark starts itself (slow)."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from sonar_core.bench.http_client import Endpoint, stream_completion
from sonar_core.bench.server_process import engine_flags
from sonar_core.entrypoints.cli import main

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SMALL = ["--num-prompts", "3", "--max-tokens", "8", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def server_url(tiny_model: Path) -> Iterator[str]:
    from sonar_core.config import EngineConfig
    from sonar_core.engine.llm_engine import LLMEngine
    from sonar_core.entrypoints.openai.server import build_app

    engine = LLMEngine(EngineConfig(
        model=str(tiny_model), dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory_gb=0.01,
        speculative_config=NGRAM,
    ))
    args = argparse.Namespace(host="127.0.0.1", port=0, api_key=None, served_model_name=["tiny"], disable_log_stats=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, args), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_a_stream_is_timed_token_by_token(server_url: str) -> None:
    endpoint = Endpoint(server_url)
    assert endpoint.model_id() == "tiny"
    record = stream_completion(endpoint, "tiny", "r", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=8)
    assert sum(count for _, count in record.events) == 8  # logprobs=0 tells each chunk's size
    assert record.text
    assert all(later >= earlier for (earlier, _), (later, _) in zip(record.events, record.events[1:], strict=False))


def test_bench_serve_against_a_running_server(server_url: str, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", str(tiny_model), "--url", server_url, "--concurrency", "1", "2", *SMALL,
                 "--json", str(out)])
    assert code == 0
    (table,) = json.loads(out.read_text())["tables"]
    rows = table["rows"]
    assert [row["concurrency"] for row in rows] == [1, 2]
    for row in rows:
        figures = row["figures"]
        assert figures["num_requests"] == 3 and figures["ttft"]["count"] == 3
        # Sonar's /metrics has no process_resident_memory_bytes: memory is unknown, and says so.
        assert figures["peak_rss_bytes"] is None
        assert any("memory: unknown" in note for note in figures["notes"])
    # The same greedy requests give the same text at both concurrencies.
    assert rows[1]["figures"]["match_plain"] == 1.0


def test_engine_settings_become_serve_flags() -> None:
    flags = engine_flags({"max_num_seqs": 4, "dtype": "bfloat16", "enforce_eager": True, "trust_remote_code": False})
    assert flags == ["--max-num-seqs", "4", "--dtype", "bfloat16", "--enforce-eager"]


@pytest.mark.slow
def test_bench_serve_starts_a_server_per_configuration(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", str(tiny_model), "--concurrency", "1", "2", *SMALL, "--dtype", "float32",
                 "--kv-cache-memory-gb", "0.01", "--speculative-config", json.dumps(NGRAM), "--json", str(out),
                 "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    (table,) = json.loads(out.read_text())["tables"]
    assert [(row["label"], row["concurrency"]) for row in table["rows"]] == [
        ("sonar", 1), ("sonar", 2), ("sonar ngram k=3 n=1..3", 1), ("sonar ngram k=3 n=1..3", 2),
    ]
    for row in table["rows"]:
        assert row["figures"]["num_requests"] == 3
    assert table["rows"][2]["figures"]["match_plain"] == 1.0  # lossless over HTTP too
