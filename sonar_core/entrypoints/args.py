"""Command-line arguments shared by the subcommands that run an engine (serve, generate, bench).

Engine flags are derived from :class:`~sonar_core.config.EngineConfig`: each field is one flag in
kebab-case (``max_num_seqs`` -> ``--max-num-seqs``) with the field's docstring as its help. A flag
that is not given does not reach the configuration, so the model's defaults apply.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sonar_core.config import EngineConfig, parse_json_object
from sonar_core.errors import ConfigError

# Fields that are not plain flags: the model is a positional argument of each subcommand, and the
# speculative configuration is JSON text.
_NOT_FLAGS = frozenset({"model", "speculative_config"})
# Short spellings vLLM users type.
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp"}
API_KEY_ENV = "APHRODITE_API_KEY"


@dataclass(frozen=True)
class ServerArgs:
    """What the HTTP server needs besides the engine configuration."""

    host: str | None = None  # None: every interface
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    # Names /v1/models lists and requests may use; None: the model's own name.
    served_model_name: tuple[str, ...] | None = None


def engine_flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Target model: a folder with config.json, a .gguf file, or a Hugging Face repository id (from "
        "the local Hugging Face cache, else downloaded; --revision picks a branch, tag or commit). Omitted: the "
        "embedded default model (SmolLM2-135M-Instruct).",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field, and ``--speculative-config``."""
    group = parser.add_argument_group("engine")
    for name, info in EngineConfig.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        flags = [engine_flag(name), *([_SHORT_FLAGS[name]] if name in _SHORT_FLAGS else [])]
        help_text = " ".join((info.description or "").split())
        kind = _scalar_type(info.annotation)
        if kind is bool and info.default is None:  # on, off or decided by the engine: --X / --no-X
            group.add_argument(
                *flags, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif kind is bool:
            group.add_argument(*flags, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            default = f" (default: {info.default})" if info.default is not None else ""
            group.add_argument(
                *flags, dest=name, type=kind, default=argparse.SUPPRESS, help=help_text + default,
                metavar=name.upper(),
            )
    group.add_argument(
        "--speculative-config",
        dest="speculative_config",
        default=None,
        metavar="JSON",
        help='Speculative decoding as one JSON object, in single quotes in the shell: '
        '\'{"method": "ngram", "num_speculative_tokens": 4}\'. See docs/configuration.md.',
    )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None, help="Address to listen on (default: every interface).")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000).")
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"Require this key as a Bearer token on every request (default: ${API_KEY_ENV}, else none).",
    )
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="Model names in the API (/v1/models and the requests' model field); default: the model's name.",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags that were given (:func:`add_engine_args`, and the model of
    :func:`add_model_arg` when the subcommand has one); every problem is a ConfigError."""
    kwargs: dict[str, Any] = {
        name: getattr(args, name)
        for name in EngineConfig.model_fields
        if name not in _NOT_FLAGS and hasattr(args, name)
    }
    kwargs["model"] = getattr(args, "model", None)
    if args.speculative_config is not None:
        kwargs["speculative_config"] = parse_json_object(args.speculative_config, "--speculative-config")
    return EngineConfig.build(**kwargs)


def server_args_from_args(args: argparse.Namespace) -> ServerArgs:
    names = tuple(args.served_model_name) if args.served_model_name else None
    return ServerArgs(host=args.host, port=args.port, api_key=args.api_key, served_model_name=names)


def check_leftover_args(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: Sequence[str]) -> None:
    """Reject arguments no flag took. When ``--speculative-config`` does not parse either, the shell
    most likely split an unquoted JSON object at its spaces: report that, with the quoting advice."""
    if not extras:
        return
    text = getattr(args, "speculative_config", None)
    if text is not None and _is_unparsable(text):
        pieces = [text, *extras]
        parse_json_object(
            " ".join(pieces),
            "--speculative-config",
            note=f"the shell split the value into {len(pieces)} arguments, so it was not quoted",
        )
    parser.error(f"unrecognized arguments: {' '.join(extras)}")


def _is_unparsable(text: str) -> bool:
    try:
        parse_json_object(text)
    except ConfigError:
        return True
    return False


def _scalar_type(annotation: Any) -> type:
    """``int`` for ``int | None`` and the like: the type a flag's text converts to."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return annotation
