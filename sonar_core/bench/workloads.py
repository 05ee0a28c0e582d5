"""The benchmark's prompt sets: JSON-lines files, one request per line, chat messages each.

Shipped sets live next to this module (``workloads/*.jsonl``, written by
``scripts/make_workloads.py``); a path to another file in the same format works too. A file may
start with a ``{"meta": {...}}`` line describing the set. Prompts are rendered once with the
target's chat template and tokenizer, so every engine receives the same token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sonar_core.bench.peers.peer_protocol import BenchRequest
from sonar_core.errors import ConfigError

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
# The warm-up prompt belongs to no workload, so that methods which learn from earlier responses
# (suffix) learn nothing about the measured prompts from it.
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass
class Workload:
    name: str
    description: str
    records: list[dict[str, Any]] = field(default_factory=list)  # {"id", "messages"}

    def head(self, count: int | None) -> Workload:
        """The first ``count`` requests (all when None): a short run uses a fixed prefix, so two
        runs of the same length measure the same prompts."""
        records = self.records if count is None else self.records[:count]
        return Workload(self.name, self.description, list(records))


def available_workloads() -> dict[str, Path]:
    """The shipped workloads by name."""
    return {path.stem: path for path in sorted(WORKLOAD_DIR.glob("*.jsonl"))}


def load_workload(name_or_path: str) -> Workload:
    """A shipped workload by name, or a JSON-lines file by path; a ConfigError names the choices."""
    shipped = available_workloads()
    path = shipped.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            "workload",
            f"no workload named {name_or_path!r}",
            f"use one of {', '.join(shipped)} or the path of a .jsonl file of chat requests",
        )
    name, description, records = path.stem, "", []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("workload", f"{path}:{number}: not JSON ({exc.msg})", "write one JSON object per line") from None
        if "meta" in item:
            name = item["meta"].get("workload", name)
            description = item["meta"].get("description", "")
            continue
        if not isinstance(item.get("messages"), list) or not item["messages"]:
            raise ConfigError("workload", f"{path}:{number}: no 'messages' list", 'give each line {"messages": [...]}')
        records.append({"id": str(item.get("id", f"{path.stem}-{len(records):03d}")), "messages": item["messages"]})
    if not records:
        raise ConfigError("workload", f"{path} holds no requests", "add one JSON object with 'messages' per line")
    return Workload(name, description, records)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended, as ``LLM.chat`` renders it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize_workload(tokenizer: Any, workload: Workload) -> list[BenchRequest]:
    return [BenchRequest(record["id"], render_prompt(tokenizer, record["messages"])) for record in workload.records]


def warmup_prompt(tokenizer: Any) -> list[int]:
    return render_prompt(tokenizer, WARMUP_MESSAGES)
