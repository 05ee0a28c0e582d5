"""``aphrodite bench``: the documented figures with speculation off and on, side by side with peers.

- ``aphrodite bench offline [MODEL]``: through the engine in-process (and peers in theirs);
- ``aphrodite bench serve [MODEL]``: over HTTP, against servers it starts per configuration or
  against ``--url``;
- ``aphrodite bench suite NAME|FILE``: a saved list of runs (``performance`` is the one behind
  docs/performance.md), written to one Markdown, JSON and PNG;
- ``aphrodite bench startup [MODEL]``: seconds to "engine ready" and to a configuration error.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from sonar_core.entrypoints.args import add_engine_args, add_model_arg

NAME = "bench"
DEFAULT_WORKLOAD = "code_edit"
DEFAULT_NUM_PROMPTS = 8
DEFAULT_MAX_TOKENS = 128


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="Measure latency, throughput, memory and acceptance with speculation off and on.",
        description="Measure the seven figures of the documentation (time to first token, inter-token "
        "latency, end-to-end latency, request throughput at a concurrency, memory, mean acceptance length, "
        "per-position acceptance rate) with speculation off and with each --speculative-config, side by "
        "side with peer engines. See docs/performance.md.",
    )
    modes = parser.add_subparsers(title="modes", dest="bench_mode", metavar="MODE", required=True)
    offline = modes.add_parser(
        "offline",
        conflict_handler="resolve",
        help="Run requests through the engine in-process (and through peer engines).",
        description="Run a workload through Sonar without speculation and with each --speculative-config, "
        "and through each --peer, every row in a process of its own; print one table per workload.",
    )
    _add_common(offline)
    offline.add_argument(
        "--peer",
        action="append",
        metavar="ENGINE[:MODE][=JSON]",
        help="A peer row: hf, hf:prompt_lookup, hf:assistant, vllm, vllm:ngram, llama_cpp, llama_cpp:prompt_lookup; "
        'options as JSON after =, e.g. \'hf:prompt_lookup={"num_speculative_tokens": 4}\'. Repeat for several.',
    )
    serve = modes.add_parser(
        "serve",
        conflict_handler="resolve",
        help="Send requests over HTTP to servers started per configuration, or to --url.",
        description="Start `aphrodite serve` without speculation and with each --speculative-config, and send "
        "the workload over HTTP at each --concurrency; or send it to a running server at --url.",
    )
    _add_common(serve)
    serve.add_argument("--url", help="A running OpenAI-compatible server (http://host:port) to benchmark as is.")
    serve.add_argument("--api-key", default=None, help="Bearer token for --url.")
    suite = modes.add_parser(
        "suite",
        help="Run a saved list of benchmark runs and write all their tables to one report.",
        description="Run every entry of a suite (a shipped name such as 'performance', or a JSON file) and write "
        "OUT/NAME.md, OUT/NAME.json and, with matplotlib, OUT/NAME.png.",
    )
    suite.add_argument("suite", metavar="NAME|FILE", help="Suite to run.")
    suite.add_argument("--out", type=Path, default=Path("bench-results"), help="Output folder (default: bench-results).")
    suite.add_argument("--no-progress", action="store_true", help="Do not show the progress bar.")
    suite.add_argument(
        "--only", type=int, nargs="+", default=None, metavar="N",
        help="Run only these entries of the suite (numbered from 1), e.g. to measure a noisy table again.",
    )
    startup = modes.add_parser(
        "startup",
        help="Time engine startup and a configuration error, in fresh processes.",
        description="Time `LLM(MODEL)` from process start to engine ready, and `aphrodite serve --check-config` "
        "with a misspelt method to its error, each in fresh processes (the model's converted folder cached).",
    )
    add_model_arg(startup)
    startup.add_argument("--repeats", type=int, default=3, help="Fresh processes per figure (default: 3).")
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        nargs="+",
        default=[DEFAULT_WORKLOAD],
        metavar="NAME|FILE",
        help="Shipped workloads (code_edit, chat, summarize, agent) or .jsonl files; one table each "
        f"(default: {DEFAULT_WORKLOAD}).",
    )
    group.add_argument(
        "--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
        help=f"Use the first N prompts of each workload (default: {DEFAULT_NUM_PROMPTS}).",
    )
    group.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
        help=f"Most new tokens per request; greedy, stopping at EOS (default: {DEFAULT_MAX_TOKENS}).",
    )
    group.add_argument(
        "--concurrency", type=int, nargs="+", default=[1],
        help="Requests in flight; several values give one row each (default: 1).",
    )
    group.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="Poisson arrivals at this many requests/s (default: inf, as fast as the concurrency allows).",
    )
    group.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for every engine (torch, OpenMP, llama.cpp); default: every core.",
    )
    group.add_argument(
        "--truncated-draft", type=int, nargs="+", default=None, metavar="N",
        help="Build a draft from the target's first N layers (built once, cached) for draft-model rows that name "
        "no model; several values run each such row once per draft.",
    )
    group.add_argument(
        "--random-heads", action="store_true",
        help="Give eagle, eagle3, medusa, mlp_speculator, dflash and dspark rows that name no model a random head for the target "
        "(built once, cached): its acceptance means nothing, its draft cost is real.",
    )
    group.add_argument(
        "--random-head-vocab", type=int, default=8192, metavar="N",
        help="Draft vocabulary of the random EAGLE-3 head (default: 8192 tokens).",
    )
    group.add_argument(
        "--max-other-cpu", type=float, default=None, metavar="CORES",
        help="On a shared machine: wait until other work keeps fewer than CORES cores busy before each row, and "
        "measure a row again (see --max-attempts) when other work went above it; default: measure once.",
    )
    group.add_argument(
        "--competing-load", type=int, default=0, metavar="CORES",
        help="Keep CORES cores busy with spinning processes while each offline row runs, to measure how "
        "the engines degrade on a shared machine (the other-CPU column shows them; default: 0).",
    )
    group.add_argument(
        "--max-attempts", type=int, default=3,
        help="Most measurements of one row under --max-other-cpu; the quietest is kept (default: 3).",
    )
    group.add_argument(
        "--passes", type=int, default=1,
        help="Measure every row this many times, each pass in the opposite row order of the one before, "
        "and keep each row's fastest pass: on a shared machine, slow spells then miss some pass of every row "
        "(default: 1).",
    )
    group.add_argument("--title", default=None, help="Heading of the table (default: workload, mode and dtype).")
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, default=None, metavar="PATH", help="Write every number as JSON.")
    out.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="Write the tables as Markdown.")
    out.add_argument(
        "--chart", type=Path, default=None, metavar="PATH",
        help="Write a PNG of per-position acceptance and of throughput against concurrency (needs matplotlib).",
    )
    out.add_argument("--log-dir", type=Path, default=None, help="Keep each worker's and server's output here.")
    out.add_argument("--no-progress", action="store_true", help="Do not show the progress bar.")
    add_engine_args(parser)
    parser.set_defaults(speculative_config=None)
    # Replaces the engine's single --speculative-config: a benchmark compares several.
    parser.add_argument(
        "--speculative-config",
        action=_AppendSpeculativeConfig,
        dest="speculative_configs",
        default=None,
        metavar="JSON",
        help='A speculative configuration to measure, in single quotes: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\'. Repeat for several; the row without speculation is always measured.',
    )


class _AppendSpeculativeConfig(argparse.Action):
    """Collects every ``--speculative-config`` in ``speculative_configs`` and keeps the latest in
    ``speculative_config``, where the command line looks when a value was split by the shell."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        collected = list(getattr(namespace, self.dest, None) or [])
        collected.append(values)
        setattr(namespace, self.dest, collected)
        namespace.speculative_config = values


def run(args: argparse.Namespace) -> int:
    from sonar_core.bench import session
    from sonar_core.bench.suite import run_suite

    if not getattr(args, "command_line", None):
        args.command_line = "aphrodite " + shlex.join(sys.argv[1:])
    if args.bench_mode == "suite":
        return run_suite(args.suite, args.out, show_progress=not args.no_progress, only=args.only)
    if args.bench_mode == "startup":
        from sonar_core.bench import startup

        print(startup.render(startup.measure(args.model, args.repeats), args.model))
        return 0
    bench = session.bench_offline if args.bench_mode == "offline" else session.bench_serve
    tables = bench(args, show_progress=not args.no_progress)
    session.emit(tables, args)
    return 0
