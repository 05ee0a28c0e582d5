"""Time the attention that decides how a step attends: the in-place kernel alone, and whole steps
gathered for PyTorch's SDPA against in place.

``kernel``: one layer's ``sonar::paged_attention`` call of the model's shape (heads, KV heads,
head size) for steps of ``q`` new tokens over ``C`` cached ones, in microseconds: what a decode
(``q`` = 1) and a verification step (``q`` = k + 1) pay per layer. ``steps``: whole steps of the
model, logits included, with ``C + q`` tokens, attended in place and gathered past eight queries
(the rule for kernels without tiles), the two alternating step by step so that background load
hits both alike; the numbers behind :data:`sonar_core.layers.attention.AMX_BF16_IN_PLACE_MAX_SCORES`
and the AMX tile rule. Medians of ``--iters``.

    python -m sonar_core.models.attention_benchmark --dtype bfloat16 --threads 2 \\
        --contexts 300,1200 --queries 1,4,6 --steps 1+400,144+363,1024+512
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_model, kernel_flags
from sonar_core.layers import attention
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.models.loader import load_model
from sonar_core.models.step_benchmark import ENGINE_BLOCK_SIZE, CachedSteps
from sonar_core.models.timing import alternated_medians_ms

GATHERED_PAST_EIGHT = attention.InPlacePolicy(attention.BATCHED_MAX_QUERIES, attention.AMX_BF16_IN_PLACE_MAX_SCORES)
IN_PLACE = attention.InPlacePolicy(sys.maxsize)


def kernel_microseconds(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, context: int, queries: int, iters: int
) -> float:
    """Median time of one in-place attention call: ``queries`` new tokens over ``context`` cached
    ones of one sequence, its blocks scattered over the cache as the engine's are."""
    ops = cpu_kernels.load()
    if ops is None:
        raise RuntimeError(f"Sonar's CPU kernels are not available: {cpu_kernels.problem()}")
    generator = torch.Generator().manual_seed(0)
    seq_len = context + queries
    blocks = -(-seq_len // ENGINE_BLOCK_SIZE)
    k_cache = torch.randn(2 * blocks, ENGINE_BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(2 * blocks, ENGINE_BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(queries, heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(2 * blocks, generator=generator)[:blocks].tolist()
    metadata = AttentionMetadata.build([queries], [seq_len], [table], ENGINE_BLOCK_SIZE, torch.device("cpu"))
    scale = head_dim**-0.5

    calls_per_sample = 50

    def calls() -> None:
        for _ in range(calls_per_sample):
            ops.paged_attention(
                q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, scale, True, 0
            )

    (milliseconds,) = alternated_medians_ms([calls], iters)
    return milliseconds * 1e3 / calls_per_sample


@contextlib.contextmanager
def attending(policy: attention.InPlacePolicy) -> Iterator[None]:
    """Every step in this block attends as ``policy`` says, whatever this machine's rule is."""
    own = attention.in_place_policy
    attention.in_place_policy = lambda dtype: policy
    try:
        yield
    finally:
        attention.in_place_policy = own


def step_milliseconds(steps: CachedSteps, queries: int, iters: int) -> list[float]:
    """Medians of a whole step of ``queries`` new tokens: gathered past eight queries, in place."""

    def step_as(policy: attention.InPlacePolicy) -> Callable[[], None]:
        def step() -> None:
            with attending(policy):
                steps.step(queries)

        return step

    return alternated_medians_ms([step_as(GATHERED_PAST_EIGHT), step_as(IN_PLACE)], iters)


def _pairs(text: str) -> list[tuple[int, int]]:
    """``"1+400,144+363"`` -> ``[(1, 400), (144, 363)]`` (cached + new tokens)."""
    return [(int(cached), int(new)) for cached, new in (item.split("+") for item in text.split(",") if item)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="300,600,1200", help="cached tokens of the kernel table")
    parser.add_argument("--queries", default="1,2,4,6", help="new tokens of the kernel table")
    parser.add_argument("--steps", default="", help="whole steps as cached+new tokens, e.g. 1+400,144+363")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype, "cpu")
    text_config = loaded.hf_config.get_text_config(decoder=True)
    heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    print(
        f"{args.dtype}, {args.threads} threads, median of {args.iters}; CPU: {cpu_model()} "
        f"({', '.join(kernel_flags()) or 'no listed flags'}); {heads} heads, {kv_heads} KV heads of "
        f"{head_dim}; AMX tile keys: {cpu_kernels.attention_tile_keys()}"
    )
    queries = [int(q) for q in args.queries.split(",") if q]
    print("\n| cached | " + " | ".join(f"{q} new, us" for q in queries) + " |")
    print("|---" * (len(queries) + 1) + "|")
    for context in (int(c) for c in args.contexts.split(",") if c):
        cells = [kernel_microseconds(heads, kv_heads, head_dim, dtype, context, q, args.iters) for q in queries]
        print(f"| {context} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    pairs = _pairs(args.steps)
    if pairs:
        vocab_size = text_config.vocab_size
        print("\n| cached + new | gathered past 8 queries, ms | in place, ms |\n|---|---|---|")
        for cached, new in pairs:
            steps = CachedSteps(loaded.model, vocab_size, dtype, cached, new)
            gathered, in_place = step_milliseconds(steps, new, args.iters)
            print(f"| {cached} + {new} | {gathered:.1f} | {in_place:.1f} |")


if __name__ == "__main__":
    main()
