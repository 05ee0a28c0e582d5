"""From the parsed ``aphrodite bench`` arguments to measured tables, and from tables to output.

Everything that can be wrong with the arguments (an unknown workload, peer or option, a
speculative configuration the rules reject) is reported before the first model loads.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sonar_core.bench.chart import matplotlib_available, write_chart
from sonar_core.bench.cpu_load import QuietPolicy
from sonar_core.bench.drafts import random_head, truncated_draft
from sonar_core.bench.http_runner import ServePlan, run_serve
from sonar_core.bench.offline import OfflinePlan, run_offline
from sonar_core.bench.peers.peer_protocol import BenchRequest
from sonar_core.bench.progress import Progress
from sonar_core.bench.report import TableMeta, render, to_json, write_json
from sonar_core.bench.results import RowResult
from sonar_core.bench.rows import HEAD_METHODS, SONAR, RowSpec, peer_rows, sonar_rows, with_draft, with_heads
from sonar_core.bench.target import BenchTarget, load_target
from sonar_core.bench.workloads import Workload, load_workload, tokenize_workload, warmup_prompt
from sonar_core.config import EngineConfig, validate_config
from sonar_core.entrypoints.args import engine_config_from_args
from sonar_core.errors import ConfigError
from sonar_core.model_files import DEFAULT_MODEL_NAME
from sonar_core.plugins import SONAR_METHOD_PACKAGES, get_plugin_manager, install_command

# Settings the benchmark sets per row itself; the rest of the engine flags pass through.
_PER_ROW_FIELDS = {"model", "speculative_config", "dtype", "device"}


@dataclass
class Table:
    meta: TableMeta
    results: list[RowResult]


@dataclass
class Setup:
    """What every table of one ``aphrodite bench`` invocation shares."""

    target: BenchTarget
    rows: list[RowSpec]
    workloads: list[Workload]
    dtype: str
    device: str
    engine_args: dict[str, Any]
    threads: int
    quiet: QuietPolicy | None


def prepare(args: argparse.Namespace, peers: list[str]) -> Setup:
    """Check every argument and resolve the target, rows and workloads (no weights load here)."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError("num_prompts", f"must be at least 1, got {args.num_prompts}", "pass --num-prompts 1 or more")
    if any(c < 1 for c in args.concurrency):
        raise ConfigError("concurrency", "every concurrency must be at least 1", "pass --concurrency 1 4")
    if args.request_rate <= 0:
        raise ConfigError("request_rate", f"must be positive, got {args.request_rate}", "pass a rate in requests/s, or inf")
    if args.max_tokens < 1:
        raise ConfigError("max_tokens", f"must be at least 1, got {args.max_tokens}", "pass --max-tokens 1 or more")
    if getattr(args, "competing_load", 0) < 0:
        raise ConfigError("competing_load", f"must be 0 or more cores, got {args.competing_load}", "pass e.g. --competing-load 1")
    if args.max_other_cpu is not None and args.max_other_cpu < 0:
        raise ConfigError("max_other_cpu", f"must be 0 or more cores, got {args.max_other_cpu}", "pass e.g. --max-other-cpu 0.3")
    if args.passes < 1:
        raise ConfigError("passes", f"must be at least 1, got {args.passes}", "pass --passes 1 or more")
    if args.max_attempts < 1:
        raise ConfigError("max_attempts", f"must be at least 1, got {args.max_attempts}", "pass --max-attempts 1 or more")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("threads", f"must be at least 1, got {args.threads}", "pass --threads 1 or more, or leave it out")
    workloads = [load_workload(name).head(args.num_prompts) for name in args.workload]
    base = _engine_config(args)
    target = load_target(args.model)
    rows = sonar_rows(args.speculative_configs or []) + peer_rows(peers)
    drafts = [_draft(target, layers) for layers in args.truncated_draft or []]
    rows = with_heads(with_draft(rows, drafts), _head_builder(target, args))
    rows = [_check_sonar_row(row, base) for row in rows]
    engine_args = {k: v for k, v in base.model_dump(exclude_unset=True).items() if k not in _PER_ROW_FIELDS}
    return Setup(
        target=target,
        rows=rows,
        workloads=workloads,
        dtype=str(base.torch_dtype()).removeprefix("torch."),
        device=base.resolved_device(),
        engine_args=engine_args,
        threads=args.threads or os.cpu_count() or 1,
        quiet=QuietPolicy(args.max_other_cpu, args.max_attempts) if args.max_other_cpu is not None else None,
    )


def _head_builder(target: BenchTarget, args: argparse.Namespace) -> Callable[[str], Path] | None:
    if not getattr(args, "random_heads", False):
        return None
    vocab = args.random_head_vocab
    if not 0 < vocab <= target.vocab_size:
        raise ConfigError(
            "random_head_vocab",
            f"a draft vocabulary of {vocab} tokens does not fit the target's {target.vocab_size}",
            f"pass --random-head-vocab between 1 and {target.vocab_size}",
        )
    verifier = target.model or DEFAULT_MODEL_NAME
    return lambda method: random_head(target.model_dir, method, vocab, verifier)


def _draft(target: BenchTarget, num_layers: int) -> Path:
    if not 0 < num_layers < target.num_layers:
        raise ConfigError(
            "truncated_draft",
            f"the target has {target.num_layers} layers; a draft of {num_layers} is not a smaller model",
            f"pass --truncated-draft between 1 and {target.num_layers - 1}",
        )
    return truncated_draft(target.model_dir, num_layers)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    plain = copy.copy(args)
    plain.speculative_config = None
    return engine_config_from_args(plain)


def _check_sonar_row(row: RowSpec, base: EngineConfig) -> RowSpec:
    """A Sonar row whose method is not installed stays in the table, marked; any other problem
    with its configuration is an error now rather than a failed row later."""
    if row.engine != SONAR or row.method is None:
        return row
    manager = get_plugin_manager()
    registry = manager.method_registry
    if row.method not in registry and row.method in SONAR_METHOD_PACKAGES:
        package = SONAR_METHOD_PACKAGES[row.method]
        return RowSpec(row.engine, row.method, row.options, unavailable=f"method not installed ({install_command(package)})")
    model = {"model": row.target_dir} if row.target_dir else {}
    config = EngineConfig.build(**{**base.model_dump(exclude_unset=True), **model, "speculative_config": row.options})
    try:
        validate_config(config, manager, log_warnings=False)
    except ConfigError as error:
        if row.method in HEAD_METHODS and error.field.endswith("model") and not row.options.get("model"):
            raise ConfigError(error.field, error.message, f"{error.fix}; in the bench, --random-heads measures a "
                              "random head's cost") from None
        raise
    return row


def bench_offline(args: argparse.Namespace, show_progress: bool = True) -> list[Table]:
    setup = prepare(args, args.peer or [])
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    def plan(workload: Workload, requests: list[BenchRequest], warmup: list[int]) -> OfflinePlan:
        return OfflinePlan(
            target=setup.target,
            requests=requests,
            warmup_prompt_token_ids=warmup,
            rows=setup.rows,
            dtype=setup.dtype,
            device=setup.device,
            threads=setup.threads,
            max_tokens=args.max_tokens,
            concurrencies=list(args.concurrency),
            request_rate=args.request_rate,
            seed=_seed(args),
            engine_args=setup.engine_args,
            log_dir=args.log_dir,
            quiet=setup.quiet,
            passes=args.passes,
            competing_load=args.competing_load,
        )

    return _measure(args, setup, "offline", plan, run_offline, show_progress)


def bench_serve(args: argparse.Namespace, show_progress: bool = True) -> list[Table]:
    if args.url and args.speculative_configs:
        raise ConfigError(
            "speculative_config",
            "--url benchmarks a server that is already running, with its own configuration",
            "drop --url to let the benchmark start one server per --speculative-config, or drop --speculative-config",
        )
    if args.url and args.passes > 1:
        raise ConfigError(
            "passes",
            "--url benchmarks a running server once: a second pass would meet what it learnt from the first",
            "drop --passes, or drop --url to let the benchmark start a fresh server for every pass",
        )
    setup = prepare(args, [])
    log_dir = args.log_dir or Path(tempfile.gettempdir()) / "sonar-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def plan(workload: Workload, requests: list[BenchRequest], warmup: list[int]) -> ServePlan:
        return ServePlan(
            target=setup.target,
            requests=requests,
            warmup_prompt_token_ids=warmup,
            rows=setup.rows,
            concurrencies=list(args.concurrency),
            max_tokens=args.max_tokens,
            threads=setup.threads,
            log_dir=log_dir,
            request_rate=args.request_rate,
            seed=_seed(args),
            engine_args={**setup.engine_args, "dtype": setup.dtype, "device": setup.device},
            url=args.url,
            api_key=args.api_key,
            quiet=setup.quiet,
            passes=args.passes,
        )

    return _measure(args, setup, "HTTP", plan, run_serve, show_progress)


def _seed(args: argparse.Namespace) -> int:
    """The engine's ``--seed`` also seeds the arrival times (0 when not given)."""
    return int(getattr(args, "seed", 0))


def _measure(
    args: argparse.Namespace,
    setup: Setup,
    mode: str,
    make_plan: Callable[[Workload, list[BenchRequest], list[int]], Any],
    run: Callable[[Any, Progress], list[RowResult]],
    show_progress: bool,
) -> list[Table]:
    """One table per workload: plan every run first (so the progress bar knows the total), then run."""
    warmup = warmup_prompt(setup.target.tokenizer)
    plans = [
        (workload, make_plan(workload, tokenize_workload(setup.target.tokenizer, workload), warmup))
        for workload in setup.workloads
    ]
    progress = Progress(sum(plan.num_runs * len(plan.requests) for _, plan in plans), show_progress)
    tables = []
    try:
        for workload, plan in plans:
            meta = _meta(args, workload, setup, mode)
            results = run(plan, progress)
            meta.load_after = os.getloadavg()
            tables.append(Table(meta, results))
    finally:
        progress.close()
    return tables


def _meta(args: argparse.Namespace, workload: Workload, setup: Setup, mode: str) -> TableMeta:
    title = getattr(args, "title", None)
    if title is None:
        title = f"{workload.name}, {mode}, {setup.dtype}"
    elif len(setup.workloads) > 1:
        title = f"{title} ({workload.name})"
    return TableMeta(
        title=title,
        workload=workload.name,
        num_prompts=len(workload.records),
        max_tokens=args.max_tokens,
        threads=setup.threads,
        request_rate=args.request_rate,
        command=args.command_line,
        load_before=os.getloadavg(),
    )


def emit(tables: list[Table], args: argparse.Namespace) -> None:
    """Print every table; write the JSON, Markdown and PNG files that were asked for."""
    rendered = [render(table.meta, table.results) for table in tables]
    print("\n\n".join(rendered))
    if args.json:
        write_json(args.json, [to_json(table.meta, table.results) for table in tables])
        print(f"\nJSON: {args.json}")
    if getattr(args, "markdown", None):
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n\n".join(rendered) + "\n", encoding="utf-8")
        print(f"Markdown: {args.markdown}")
    if args.chart:
        if not matplotlib_available():
            print("Chart skipped: matplotlib is not installed (pip install 'sonar-core[bench]').")
        elif write_chart(args.chart, [(table.meta.title, table.results) for table in tables]):
            print(f"Chart: {args.chart}")
        else:
            print("Chart skipped: no speculative row and no row at more than one concurrency.")
