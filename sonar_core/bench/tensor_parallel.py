"""Decode speed split over tensor-parallel ranks against one rank, and what the split costs per step.

Every row decodes the same greedy batch on the same machine's cores (one rank gets them all, two
ranks half each); the table reports tokens/s, milliseconds per engine step, and the driver's time
in collectives per step (all-reduces of the forward pass, the broadcast of each step's inputs),
which is what a split costs wherever devices are faster than the link between them. Outputs are
checked to be identical across sizes.

    python -m sonar_core.bench.tensor_parallel --sizes 1,3 --batch 1,8       # SmolLM2: 9 heads, 3 KV heads
    python -m sonar_core.bench.tensor_parallel --synthetic-heads 8 --sizes 1,2  # its shape with 8 heads

SmolLM2-135M splits only over 3 or 9 ranks; ``--synthetic-heads`` builds a random Llama checkpoint of
its layer sizes (30 layers, hidden 576, MLP 1536, 49,152 tokens) with that many query heads (a
quarter as many KV heads), which splits over 2 and 4: the speed depends on the shapes, not the
weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from sonar_core.bench.report import machine_description


@dataclass
class SplitRow:
    size: int
    batch: int
    speculative: str
    tokens_per_s: float
    ms_per_step: float
    all_reduces_per_step: float
    all_reduce_ms_per_step: float
    broadcast_ms_per_step: float


def _prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    texts = [
        "Explain how a hash map handles collisions, with an example in Python.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "List the steps to make bread at home, and say why each one matters.",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ]
    return [tokenizer.encode(texts[i % len(texts)]) for i in range(batch)]


def measure(model: str | None, size: int, batch: int, dtype: str, max_tokens: int,
            speculative: dict[str, Any] | None) -> tuple[SplitRow, list[list[int]]]:
    """One row: a warm-up pass, then the timed greedy batch."""
    from sonar_core.entrypoints.llm import LLM
    from sonar_core.sampling_params import SamplingParams

    llm = LLM(model=model, dtype=dtype, device="cpu", tensor_parallel_size=size, speculative_config=speculative,
              disable_log_stats=True)
    try:
        engine = llm.engine
        prompts = _prompts(engine.tokenizer, batch)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        clock = engine.workers.parallel.clock if engine.workers else None
        before = asdict(clock) if clock else None
        steps = engine.timing.steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = engine.timing.steps - steps
        after = asdict(clock) if clock else None
    finally:
        llm.engine.close()

    def per_step(key: str, scale: float = 1.0) -> float:
        return 0.0 if before is None else (after[key] - before[key]) * scale / steps

    row = SplitRow(
        size=size,
        batch=batch,
        speculative=(speculative or {}).get("method", "-"),
        tokens_per_s=batch * max_tokens / elapsed,
        ms_per_step=elapsed * 1e3 / steps,
        all_reduces_per_step=per_step("all_reduces"),
        all_reduce_ms_per_step=per_step("all_reduce_s", 1e3),
        broadcast_ms_per_step=per_step("broadcast_s", 1e3),
    )
    return row, [o.outputs[0].token_ids for o in outputs]


def synthetic_smollm2_shape(heads: int) -> str:
    """A random checkpoint of SmolLM2-135M's sizes with ``heads`` query heads, in a temporary folder."""
    import tempfile
    from pathlib import Path

    from sonar_core.model_files import DEFAULT_MODEL_NAME, resolve_model_path
    from sonar_core.models.loader import prepare_model_dir
    from sonar_core.testing.checkpoints import build_tiny_checkpoint

    smollm2 = prepare_model_dir(resolve_model_path(DEFAULT_MODEL_NAME))
    folder = Path(tempfile.mkdtemp(prefix="sonar-tp-bench-")) / f"smollm2-shape-{heads}-heads"
    return str(build_tiny_checkpoint(
        folder, "llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=heads,
        num_kv_heads=max(1, heads // 4), head_dim=576 // heads, intermediate_size=1536, tokenizer=smollm2,
        init_std=0.02, tie_word_embeddings=True,
    ))


def render(rows: list[SplitRow], dtype: str, load: tuple[float, float]) -> str:
    lines = [
        f"Machine: {machine_description()}; dtype {dtype}; load average {load[0]:.2f} before, {load[1]:.2f} after",
        "",
        "| ranks | batch | speculation | tokens/s | vs 1 rank | ms/step | all-reduces/step | all-reduce ms/step "
        "| broadcast ms/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r.batch, r.speculative): r.tokens_per_s for r in rows if r.size == 1}
    for r in rows:
        ratio = r.tokens_per_s / base[(r.batch, r.speculative)] if (r.batch, r.speculative) in base else float("nan")
        lines.append(
            f"| {r.size} | {r.batch} | {r.speculative} | {r.tokens_per_s:.1f} | {ratio:.2f}x | {r.ms_per_step:.2f} "
            f"| {r.all_reduces_per_step:.0f} | {r.all_reduce_ms_per_step:.2f} | {r.broadcast_ms_per_step:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--batch", default="1,8", help="requests decoded together, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative-config", action="append", default=[], type=json.loads,
                        help="also measure with this speculative configuration (JSON); repeatable")
    parser.add_argument("--synthetic-heads", type=int, help="measure a random checkpoint of SmolLM2's sizes "
                        "with this many query heads instead of MODEL")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    if args.synthetic_heads:
        args.model = synthetic_smollm2_shape(args.synthetic_heads)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    load_before = os.getloadavg()[0]
    rows: list[SplitRow] = []
    for speculative in [None, *args.speculative_config]:
        for batch in batches:
            reference = None
            for size in sizes:
                row, tokens = measure(args.model, size, batch, args.dtype, args.max_tokens, speculative)
                if reference is not None and tokens != reference:
                    raise SystemExit(f"outputs differ between 1 and {size} ranks (batch {batch}, {row.speculative})")
                reference = reference or tokens
                rows.append(row)
    print(render(rows, args.dtype, (load_before, os.getloadavg()[0])))
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))


if __name__ == "__main__":
    main()
