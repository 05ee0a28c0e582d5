"""The ``aphrodite`` command: ``serve``, ``generate``, ``plugins`` and any other module of
:mod:`sonar_core.entrypoints.commands`.

Configuration and plugin errors are printed as one message without a traceback: exit status 2 for
a configuration error (as for a bad flag), 1 for a broken plugin installation.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from sonar_core import __version__
from sonar_core.entrypoints import commands
from sonar_core.entrypoints.args import check_leftover_args
from sonar_core.entrypoints.logging_format import LOG_DATE_FORMAT, LOG_FORMAT, LOG_LEVEL_ENV
from sonar_core.errors import ConfigError, PluginError
from sonar_core.hub import HubError

EXIT_CONFIG_ERROR = 2
EXIT_PLUGIN_ERROR = 1
# A repository that could not be fetched (network, access) while the engine started.
EXIT_HUB_ERROR = 1


def command_modules() -> list[ModuleType]:
    """Every subcommand module (see :mod:`sonar_core.entrypoints.commands`), by name."""
    modules = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if callable(getattr(module, "add_parser", None)) and callable(getattr(module, "run", None)):
            modules.append(module)
    return modules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aphrodite",
        description="Sonar, a speculative-decoding inference engine.",
    )
    parser.add_argument("--version", action="version", version=f"aphrodite (sonar-core) {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for module in command_modules():
        module.add_parser(subparsers).set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    configure_logging()
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    try:
        check_leftover_args(parser, args, extras)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_CONFIG_ERROR
        return int(args.run(args) or 0)
    except ConfigError as exc:
        print(f"aphrodite {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except PluginError as exc:
        print(f"aphrodite {args.command}: plugin error: {exc}", file=sys.stderr)
        return EXIT_PLUGIN_ERROR
    except HubError as exc:
        print(f"aphrodite {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_HUB_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (``aphrodite plugins | head``): stop quietly, and keep the
        # interpreter from failing again while it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def configure_logging() -> None:
    """Log to stderr at ``SONAR_LOGGING_LEVEL`` (default INFO), unless logging is set up already."""
    name = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper()
    level = logging.getLevelName(name)
    logging.basicConfig(
        level=level if isinstance(level, int) else logging.INFO,
        format=LOG_FORMAT,
        datefmt=LOG_DATE_FORMAT,
    )
