"""Time one forward step of our model against transformers' forward with a ``DynamicCache``.

Same checkpoint, same input, same thread count: ``C`` cached tokens, then a step of ``q`` new
tokens (1 = a decode step, more = verifying drafts), logits included. The two implementations
alternate step by step so that background load hits both alike; medians are reported.

    python -m sonar_core.models.step_benchmark --dtypes float32,bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sonar_core.kv import allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.models.loader import load_model


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(
    model: str | None, dtype: torch.dtype, context: int, new_tokens: list[int], iters: int
) -> list[tuple[int, float, float]]:
    """``(q, ours_ms, transformers_ms)`` medians for each step size ``q``."""
    from transformers import AutoModelForCausalLM, DynamicCache

    loaded = load_model(model, dtype, "cpu")
    ours = loaded.model
    theirs = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=dtype).eval()
    longest = context + max(new_tokens)
    vocab_size = loaded.hf_config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab_size, (longest,), generator=torch.Generator().manual_seed(0))
    block_size = 16
    table = list(range(-(-longest // block_size)))
    caches = allocate_kv_cache(ours.kv_cache_specs(), len(table), block_size, dtype, "cpu")
    results = []
    with torch.inference_mode():
        metadata = AttentionMetadata.build([context], [context], [table], block_size, torch.device("cpu"))
        ours(ids[:context], metadata.positions, caches, metadata)
        cache = DynamicCache(config=theirs.config)
        theirs(ids[None, :context], past_key_values=cache, use_cache=True)

        for q in new_tokens:
            step_ids = ids[context : context + q]

            def ours_step(q: int = q, step_ids: torch.Tensor = step_ids) -> torch.Tensor:
                meta = AttentionMetadata.build([q], [context + q], [table], block_size, torch.device("cpu"))
                hidden = ours(step_ids, meta.positions, caches, meta)
                return ours.compute_logits(hidden)

            def theirs_step(q: int = q, step_ids: torch.Tensor = step_ids) -> torch.Tensor:
                logits = theirs(step_ids[None], past_key_values=cache, use_cache=True).logits
                cache.crop(-q)  # back to `context` cached tokens
                return logits

            for _ in range(3):
                ours_step()
                theirs_step()
            ours_times, theirs_times = [], []
            for _ in range(iters):
                ours_times.append(_timed(ours_step))
                theirs_times.append(_timed(theirs_step))
            results.append((q, _median_ms(ours_times), _median_ms(theirs_times)))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the step")
    parser.add_argument("--new-tokens", default="1,4", help="step sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    new_tokens = [int(q) for q in args.new_tokens.split(",")]
    print(f"context {args.context} tokens, {args.threads} threads, median of {args.iters} steps")
    for name in args.dtypes.split(","):
        for q, ours_ms, theirs_ms in compare(args.model, getattr(torch, name), args.context, new_tokens, args.iters):
            print(
                f"{name:9s} q={q:<3d} sonar {ours_ms:8.2f} ms   transformers {theirs_ms:8.2f} ms   "
                f"speed-up {theirs_ms / ours_ms:.2f}x"
            )


if __name__ == "__main__":
    main()
