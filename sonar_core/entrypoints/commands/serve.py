"""``aphrodite serve [MODEL]``: the OpenAI-compatible HTTP server.

Every configuration rule is checked before the server module is imported or any weight is loaded,
so a mistake fails in about a second with a message; ``--check-config`` stops right there.
"""

from __future__ import annotations

import argparse
from typing import Any

from sonar_core.config import ValidatedConfig, validate_config
from sonar_core.entrypoints.args import (
    add_engine_args,
    add_model_arg,
    add_server_args,
    engine_config_from_args,
    server_args_from_args,
)
from sonar_core.plugins import get_plugin_manager

NAME = "serve"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics).",
    )
    add_model_arg(parser)
    add_server_args(parser)
    add_engine_args(parser)
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="Check the configuration (flags, speculative config, the model's config.json) and exit 0 "
        "without loading weights or starting the server.",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    engine_config = engine_config_from_args(args)
    # The engine validates again when it starts and logs the warnings then; log them here only
    # when the check is all there is.
    validated = validate_config(engine_config, get_plugin_manager(), log_warnings=args.check_config)
    if args.check_config:
        print(describe(validated))
        return 0
    from sonar_core.entrypoints.openai.server import run_server

    return run_server(engine_config, server_args_from_args(args))


def describe(validated: ValidatedConfig) -> str:
    """A short account of a valid configuration, for ``--check-config``."""
    target = validated.target
    engine = validated.engine
    lines = [
        "Configuration is valid.",
        f"  model: {target.source} ({', '.join(target.architectures) or target.model_type or 'unknown architecture'})",
        f"  max_model_len: {engine.max_model_len}, max_num_seqs: {engine.max_num_seqs}, "
        f"device: {engine.device}, dtype: {engine.dtype}",
    ]
    if engine.tensor_parallel_size > 1 or engine.data_parallel_size > 1:
        lines.append(
            f"  tensor_parallel_size: {engine.tensor_parallel_size}, data_parallel_size: {engine.data_parallel_size}"
        )
    speculative = validated.speculative
    if speculative is None:
        lines.append("  speculative decoding: off")
    else:
        provider = f"{speculative.spec.distribution} {speculative.spec.version}".strip() or "unknown distribution"
        branches = speculative.config.num_draft_branches
        stop = speculative.config.draft_stop_confidence
        lines.append(
            f"  speculative decoding: {speculative.method} ({provider}), "
            f"num_speculative_tokens: {speculative.num_speculative_tokens}"
            + (f", num_draft_branches: {branches}" if branches is not None else "")
            + (f", draft_stop_confidence: {stop:g}" if stop is not None else "")
        )
    if validated.warnings:
        lines.append(f"  warnings: {len(validated.warnings)} (logged above)")
    return "\n".join(lines)
