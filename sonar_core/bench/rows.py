"""What each row of a benchmark table runs: Sonar with one speculative configuration (or none), or
a peer engine in one mode.

Peers are named on the command line as ``ENGINE[:MODE][=JSON]``: ``hf``, ``hf:prompt_lookup``,
``'hf:assistant={"num_speculative_tokens": 4}'``, ``vllm:ngram``, ``llama_cpp:prompt_lookup``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sonar_core.bench.peers import PEERS
from sonar_core.config import parse_json_object
from sonar_core.errors import ConfigError

SONAR = "sonar"
# Draft length a peer mode uses when its options do not say; the same as Sonar's examples.
DEFAULT_PEER_DRAFT_TOKENS = 4
# Methods (Sonar's and peers') whose draft is a separate checkpoint; ``--truncated-draft`` fills in
# their ``model`` when it is not given.
DRAFT_CHECKPOINT_METHODS = frozenset({"draft_model", "assistant"})
# Sonar's methods whose draft is a trained head; ``--random-heads`` fills in their ``model``.
HEAD_METHODS = frozenset({"eagle", "eagle3", "medusa", "mlp_speculator", "dflash", "dspark"})
# Sonar's methods whose weights sit in the target checkpoint; ``--random-heads`` runs their rows on
# a copy of the target with random ones (the same model otherwise, so plain rows stay comparable).
TARGET_HEAD_METHODS = frozenset({"mtp"})


@dataclass(frozen=True)
class RowSpec:
    """One row: an engine, its speculation method (None: none) and that method's options."""

    engine: str  # "sonar", a key of PEERS, or "server" (a running server benchmarked over HTTP)
    method: str | None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    name: str | None = None  # shown instead of the engine's name
    unavailable: str | None = field(default=None, compare=False)  # why it cannot run here (kept in the table)
    # A Sonar row's own target folder (None: the benchmark's target), for methods whose weights the
    # target carries.
    target_dir: str | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        name = self.name or ("llama.cpp" if self.engine == "llama_cpp" else self.engine)
        if self.method is None:
            return name
        parts = [name, self.method]
        depth = self.options.get("num_speculative_tokens")
        if depth is not None:
            parts.append(f"k={depth}")
        branches = self.options.get("num_draft_branches")
        if branches is not None:  # unset, the engine decides: a set 1 differs from it
            parts.append(f"x{branches}")
        lookup = _lookup_bounds(self.options)
        if lookup:
            parts.append(lookup)
        policy = self.options.get("depth_policy")
        if policy not in (None, "fixed"):  # rows that differ only in it must not share a label
            parts.append(f"depth={policy}")
        stop = self.options.get("draft_stop_confidence")
        if stop is not None:
            parts.append(f"stop={stop:g}")
        model = self.options.get("model")
        if model and self.method in DRAFT_CHECKPOINT_METHODS | HEAD_METHODS:
            parts.append(f"({Path(str(model)).name})")
        if self.target_dir:
            parts.append(f"({Path(self.target_dir).name})")
        return " ".join(parts)

    @property
    def is_plain(self) -> bool:
        return self.method is None


def _lookup_bounds(options: dict[str, Any]) -> str | None:
    """``n=MIN..MAX`` for n-gram rows that set their match lengths (either bound alone stands for
    both, as Sonar and vLLM read it); None when neither is set."""
    low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    if low is None and high is None:
        return None
    return f"n={low if low is not None else high}..{high if high is not None else low}"


def sonar_rows(speculative_configs: list[str | dict[str, Any]], include_plain: bool = True) -> list[RowSpec]:
    """Sonar's rows: without speculation (first, the reference of the ratios) and one per config."""
    rows = [RowSpec(SONAR, None)] if include_plain else []
    for index, value in enumerate(speculative_configs):
        config = (
            parse_json_object(value, f"--speculative-config (number {index + 1})") if isinstance(value, str) else dict(value)
        )
        method = config.get("method")
        if not isinstance(method, str) or not method:
            raise ConfigError(
                "speculative_config.method",
                f"speculative config number {index + 1} names no method",
                'give each --speculative-config a "method", e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
            )
        rows.append(RowSpec(SONAR, method, config))
    return rows


def parse_peer(text: str) -> RowSpec:
    """``ENGINE[:MODE][=JSON]`` as a row; a ConfigError names the engines, modes or options allowed."""
    head, _, options_text = text.partition("=")
    engine, _, mode_text = head.strip().partition(":")
    peer = PEERS.get(engine)
    if peer is None:
        raise ConfigError("peer", f"unknown peer engine {engine!r} in {text!r}", f"use one of {', '.join(PEERS)}")
    mode = mode_text or None
    if mode not in peer.modes:
        modes = ", ".join(f"{engine}:{m}" if m else engine for m in peer.modes)
        raise ConfigError("peer", f"{engine} has no mode {mode_text!r}", f"use one of {modes}")
    options = parse_json_object(options_text, f"--peer {head}") if options_text else {}
    unknown = sorted(set(options) - peer.modes[mode])
    if unknown:
        allowed = ", ".join(sorted(peer.modes[mode])) or "none"
        raise ConfigError("peer", f"{head} does not take {', '.join(unknown)}", f"options it takes: {allowed}")
    if mode is not None and "num_speculative_tokens" in peer.modes[mode]:
        options.setdefault("num_speculative_tokens", DEFAULT_PEER_DRAFT_TOKENS)
    return RowSpec(engine, mode, options)


def peer_rows(texts: list[str]) -> list[RowSpec]:
    """The peers' rows, each engine's plain row first (the reference of its ratios) even when
    only its speculative modes were asked for."""
    rows: list[RowSpec] = []
    for text in texts:
        row = parse_peer(text)
        if not row.is_plain and not any(r.engine == row.engine and r.is_plain for r in rows):
            rows.append(RowSpec(row.engine, None))
        if row.is_plain and any(r.engine == row.engine and r.is_plain for r in rows):
            continue
        rows.append(row)
    ordered: list[RowSpec] = []
    for engine in dict.fromkeys(row.engine for row in rows):
        ordered += [row for row in rows if row.engine == engine]
    return ordered


def with_heads(rows: list[RowSpec], head_for: Callable[[str], Path] | None) -> list[RowSpec]:
    """Give head rows (EAGLE, Medusa, MLP speculator, DFlash, DSpark) that name no head the folder
    ``head_for(method)`` returns; without it such a row keeps no ``model`` and runs on a head the
    target ships (the embedded target's EAGLE-3 head), or fails its configuration check with the
    plugin's own fix. With it, MTP rows run on the target copy ``head_for("mtp")`` (without it, on
    the target itself)."""
    filled = []
    for row in rows:
        if row.engine == SONAR and row.method in TARGET_HEAD_METHODS and head_for is not None:
            row = replace(row, target_dir=str(head_for(row.method)))
        if row.engine == SONAR and row.method in HEAD_METHODS and not row.options.get("model") and head_for:
            row = RowSpec(row.engine, row.method, {**row.options, "model": str(head_for(row.method))})
        filled.append(row)
    return filled


def with_draft(rows: list[RowSpec], draft_dirs: list[Path]) -> list[RowSpec]:
    """Give draft-model rows that name no draft checkpoint one row per folder of ``draft_dirs``
    (in order: a depth sweep); without folders such a row is an error that says how to get one."""
    filled = []
    for row in rows:
        if row.method in DRAFT_CHECKPOINT_METHODS and not row.options.get("model"):
            if not draft_dirs:
                raise ConfigError(
                    "model",
                    f"the {row.engine} {row.method} row names no draft checkpoint",
                    'add "model": PATH to its options, or pass --truncated-draft N to use the target\'s first N layers',
                )
            filled += [RowSpec(row.engine, row.method, {**row.options, "model": str(folder)}) for folder in draft_dirs]
        else:
            filled.append(row)
    return filled
