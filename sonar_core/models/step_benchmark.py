"""Time one forward step of our model against transformers' forward with a ``DynamicCache``.

Same checkpoint, same input, same thread count: ``C`` cached tokens, then a step of ``q`` new
tokens (1 = a decode step, more = verifying drafts), logits included. Sonar runs three ways: on its
CPU kernels called directly (``sonar_core.layers.direct_layers``), on the same kernels through the
layers' modules, and on PyTorch's operators alone (a second copy of the model, loaded with the
kernels off: what machines without a compiler get, oneDNN's packed weights included); the four
alternate step by step so that background load hits all alike; medians are reported.

    python -m sonar_core.models.step_benchmark --dtypes float32,bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_model, kernel_flags
from sonar_core.kv import allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.direct_layers import through_modules
from sonar_core.models.loader import load_model


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(
    model: str | None, dtype: torch.dtype, context: int, new_tokens: list[int], iters: int, batch: int = 1
) -> list[tuple[int, float, float, float, float]]:
    """``(q, ours_ms, ours_through_modules_ms, ours_on_pytorch_ops_ms, transformers_ms)`` medians for
    each step size ``q``, for ``batch`` sequences of ``context`` cached tokens each taking ``q`` new
    tokens."""
    from transformers import AutoModelForCausalLM, DynamicCache

    loaded = load_model(model, dtype, "cpu")
    ours = loaded.model
    with cpu_kernels.disabled():
        ours_without_kernels = load_model(model, dtype, "cpu").model
    theirs = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=dtype).eval()
    longest = context + max(new_tokens)
    vocab_size = loaded.hf_config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab_size, (longest,), generator=torch.Generator().manual_seed(0))
    block_size = 16
    width = -(-longest // block_size)
    tables = [list(range(row * width, (row + 1) * width)) for row in range(batch)]
    caches = allocate_kv_cache(ours.kv_cache_specs(), width * batch, block_size, dtype, "cpu")
    results = []
    with torch.inference_mode():
        for table in tables:  # every sequence caches the same context
            metadata = AttentionMetadata.build([context], [context], [table], block_size, torch.device("cpu"))
            ours(ids[:context], metadata.positions, caches, metadata)
        cache = DynamicCache(config=theirs.config)
        theirs(ids[None, :context].expand(batch, -1), past_key_values=cache, use_cache=True)

        for q in new_tokens:
            step_ids = ids[context : context + q]

            def ours_step(
                q: int = q, step_ids: torch.Tensor = step_ids, model: torch.nn.Module = ours
            ) -> torch.Tensor:
                meta = AttentionMetadata.build(
                    [q] * batch, [context + q] * batch, tables, block_size, torch.device("cpu")
                )
                hidden = model(step_ids.repeat(batch), meta.positions, caches, meta)
                return model.compute_logits(hidden)

            def theirs_step(q: int = q, step_ids: torch.Tensor = step_ids) -> torch.Tensor:
                logits = theirs(step_ids[None].expand(batch, -1), past_key_values=cache, use_cache=True).logits
                cache.crop(-q)  # back to `context` cached tokens
                return logits

            def ours_through_modules() -> torch.Tensor:
                with through_modules():
                    return ours_step()

            def ours_on_pytorch_ops() -> torch.Tensor:
                with cpu_kernels.disabled():
                    return ours_step(model=ours_without_kernels)

            steps = (ours_step, ours_through_modules, ours_on_pytorch_ops, theirs_step)
            for _ in range(3):
                for step in steps:
                    step()
            times: list[list[float]] = [[] for _ in steps]
            for _ in range(iters):
                for samples, step in zip(times, steps, strict=True):
                    samples.append(_timed(step))
            results.append((q, *(_median_ms(samples) for samples in times)))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the step")
    parser.add_argument("--new-tokens", default="1,4", help="step sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step, each with --context cached tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    new_tokens = [int(q) for q in args.new_tokens.split(",")]
    print(
        f"batch {args.batch}, context {args.context} tokens, {args.threads} threads, median of {args.iters} steps; "
        f"CPU: {cpu_model()} ({', '.join(kernel_flags()) or 'no listed flags'}); "
        f"Sonar's CPU kernels: {'built' if cpu_kernels.load() is not None else cpu_kernels.problem()}"
    )
    for name in args.dtypes.split(","):
        rows = compare(args.model, getattr(torch, name), args.context, new_tokens, args.iters, args.batch)
        for q, ours_ms, modules_ms, pytorch_ops_ms, theirs_ms in rows:
            print(
                f"{name:9s} q={q:<3d} sonar {ours_ms:8.2f} ms   through modules {modules_ms:8.2f} ms   "
                f"sonar on PyTorch ops {pytorch_ops_ms:8.2f} ms   transformers {theirs_ms:8.2f} ms   "
                f"direct calls {modules_ms / ours_ms:.2f}x   kernels {pytorch_ops_ms / ours_ms:.2f}x   "
                f"vs transformers {theirs_ms / ours_ms:.2f}x"
            )


if __name__ == "__main__":
    main()
