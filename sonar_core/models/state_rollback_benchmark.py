"""What keeping per-draft-position recurrent states costs in a verification step (hybrid models).

A verification step of a model with linear-attention layers (Qwen3-Next) writes the state after
each of a row's ``len(drafts) + 1`` tokens into per-position copies, and the accepted copy then
replaces the committed state (:mod:`sonar_core.kv.state`). This times the same step, ``B`` rows of
``q`` tokens after ``C`` cached ones, with those copies kept and committed against the step that
commits its final state directly (what a step without drafts does), alternating the two so that
background load hits both alike; medians are reported.

    python -m sonar_core.models.state_rollback_benchmark --model PATH/TO/QWEN3-NEXT --batch 1,8 --tokens 2,4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sonar_core.kv import RecurrentStateCache, StateBatch, allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.models.loader import load_model

BLOCK_SIZE = 16


def measure(model: str, dtype: torch.dtype, batch: int, context: int, tokens: int, iters: int) -> tuple[float, float]:
    """``(direct_ms, kept_ms)``: median step times committing directly and keeping per-position
    states (forward plus the commit of the last position)."""
    loaded = load_model(model, dtype, "cpu")
    net = loaded.model
    if not net.state_specs():
        raise SystemExit(f"{model}: the model has no linear-attention layers, so there is no state to keep")
    vocab_size = loaded.hf_config.vocab_size
    blocks_per_row = -(-(context + tokens) // BLOCK_SIZE)
    tables = [list(range(row * blocks_per_row, (row + 1) * blocks_per_row)) for row in range(batch)]
    caches = allocate_kv_cache(net.kv_cache_specs(), batch * blocks_per_row, BLOCK_SIZE, dtype, "cpu")
    states = RecurrentStateCache(net.state_specs(), batch, tokens, dtype, "cpu")
    slots = list(range(batch))
    ids = torch.randint(0, vocab_size, (batch, context + tokens), generator=torch.Generator().manual_seed(0))

    def forward(start: int, length: int, keep: int) -> None:
        meta = AttentionMetadata.build([length] * batch, [start + length] * batch, tables, BLOCK_SIZE,
                                       torch.device("cpu"))
        meta.state = StateBatch(states, slots, [start > 0] * batch, [keep] * batch)
        net.compute_logits(net(ids[:, start : start + length].reshape(-1), meta.positions, caches, meta))

    with torch.inference_mode():
        forward(0, context, 0)
        saved = [(layer.conv.clone(), layer.recurrent.clone()) for layer in states.layers]

        def restore() -> None:
            for layer, (conv, recurrent) in zip(states.layers, saved, strict=True):
                layer.conv.copy_(conv)
                layer.recurrent.copy_(recurrent)

        def direct() -> float:
            restore()
            begin = time.perf_counter()
            forward(context, tokens, 0)
            return time.perf_counter() - begin

        def kept() -> float:
            restore()
            begin = time.perf_counter()
            forward(context, tokens, tokens)
            states.commit(slots, [tokens - 1] * batch)
            return time.perf_counter() - begin

        for _ in range(3):
            direct()
            kept()
        direct_times, kept_times = [], []
        for _ in range(iters):
            direct_times.append(direct())
            kept_times.append(kept())
    return statistics.median(direct_times) * 1e3, statistics.median(kept_times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint with linear-attention layers (Qwen3-Next)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,8", help="rows per step, comma-separated")
    parser.add_argument("--tokens", default="2,4", help="tokens per row (drafts + 1), comma-separated")
    parser.add_argument("--context", type=int, default=128, help="cached tokens per row before the step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"context {args.context} tokens, {args.dtype}, {args.threads} threads, median of {args.iters} steps")
    print("| rows | tokens/row | commit directly ms | keep per-position states ms | cost of keeping |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        for tokens in (int(q) for q in args.tokens.split(",")):
            direct_ms, kept_ms = measure(args.model, getattr(torch, args.dtype), batch, args.context, tokens, args.iters)
            print(f"| {batch} | {tokens} | {direct_ms:.2f} | {kept_ms:.2f} | {(kept_ms - direct_ms) / kept_ms:+.1%} |")


if __name__ == "__main__":
    main()
