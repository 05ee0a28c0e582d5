"""Time one forward step of our model against transformers' forward with a ``DynamicCache``.

Same checkpoint, same input, same thread count: ``C`` cached tokens, then a step of ``q`` new
tokens (1 = a decode step, more = verifying drafts), logits included. Sonar runs three ways: on its
CPU kernels called directly (``sonar_core.layers.direct_layers``), on the same kernels through the
layers' modules, and on PyTorch's operators alone (a second copy of the model, loaded with the
kernels off: what machines without a compiler get, oneDNN's packed weights included); they
alternate step by step so that background load hits all alike; medians are reported.

With ``--compiled-transformers`` transformers also runs compiled: ``torch.compile`` (inductor's
CPU backend, weights frozen into the graph, one graph per step size) over a ``StaticCache``,
which is what compiling a decoder stack with PyTorch's own compiler gives on this machine. Each
step size compiles for about half a minute before it is timed.

    python -m sonar_core.models.step_benchmark --dtypes float32,bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from sonar_core import cpu_kernels
from sonar_core.config.engine import EngineConfig
from sonar_core.cpu_features import cpu_model, kernel_flags
from sonar_core.kv import allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.direct_layers import through_modules
from sonar_core.models.loader import load_model
from sonar_core.models.timing import alternated_medians_ms

# The engine's default KV block size, so that the benchmarks take the attention paths it takes.
ENGINE_BLOCK_SIZE: int = EngineConfig.model_fields["block_size"].default


class CachedSteps:
    """Our model with ``batch`` sequences of ``context`` cached tokens, ready to time steps of ``q``
    new tokens each (the KV written by a step is overwritten by the next, so every step sees the
    same cache)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, dtype: torch.dtype, context: int,
                 max_new_tokens: int, batch: int = 1) -> None:
        self.model, self.context, self.batch = model, context, batch
        longest = context + max_new_tokens
        self.ids = torch.randint(0, vocab_size, (longest,), generator=torch.Generator().manual_seed(0))
        self.block_size = ENGINE_BLOCK_SIZE
        width = -(-longest // self.block_size)
        self.tables = [list(range(row * width, (row + 1) * width)) for row in range(batch)]
        self.caches = allocate_kv_cache(model.kv_cache_specs(), width * batch, self.block_size, dtype, "cpu")
        with torch.inference_mode():
            for table in self.tables:  # every sequence caches the same context
                metadata = AttentionMetadata.build([context], [context], [table], self.block_size, torch.device("cpu"))
                model(self.ids[:context], metadata.positions, self.caches, metadata)

    @torch.inference_mode()
    def step(self, q: int, model: torch.nn.Module | None = None) -> torch.Tensor:
        """One step of ``q`` new tokens per sequence, logits included (``model``: another copy of
        the same weights, such as one loaded with the kernels off)."""
        model = model if model is not None else self.model
        meta = AttentionMetadata.build(
            [q] * self.batch, [self.context + q] * self.batch, self.tables, self.block_size, torch.device("cpu")
        )
        hidden = model(self.ids[self.context : self.context + q].repeat(self.batch), meta.positions, self.caches, meta)
        return model.compute_logits(hidden)


def compare(
    model: str | None, dtype: torch.dtype, context: int, new_tokens: list[int], iters: int, batch: int = 1,
    compiled_transformers: bool = False,
) -> list[tuple[float, ...]]:
    """``(q, ours_ms, ours_through_modules_ms, ours_on_pytorch_ops_ms, transformers_ms)`` medians for
    each step size ``q``, for ``batch`` sequences of ``context`` cached tokens each taking ``q`` new
    tokens; with ``compiled_transformers``, transformers compiled (:class:`CompiledSteps`) last."""
    from transformers import AutoModelForCausalLM, DynamicCache

    loaded = load_model(model, dtype, "cpu")
    ours = loaded.model
    with cpu_kernels.disabled():
        ours_without_kernels = load_model(model, dtype, "cpu").model
    theirs = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=dtype).eval()
    vocab_size = loaded.hf_config.get_text_config(decoder=True).vocab_size
    steps_of = CachedSteps(ours, vocab_size, dtype, context, max(new_tokens), batch)
    ids = steps_of.ids
    results = []
    compiled = CompiledSteps(theirs, ids, context, max(new_tokens), batch) if compiled_transformers else None
    with torch.inference_mode():
        cache = DynamicCache(config=theirs.config)
        theirs(ids[None, :context].expand(batch, -1), past_key_values=cache, use_cache=True)

        for q in new_tokens:

            def ours_step(q: int = q) -> torch.Tensor:
                return steps_of.step(q)

            def theirs_step(q: int = q) -> torch.Tensor:
                step_ids = ids[context : context + q]
                logits = theirs(step_ids[None].expand(batch, -1), past_key_values=cache, use_cache=True).logits
                cache.crop(-q)  # back to `context` cached tokens
                return logits

            def ours_through_modules(q: int = q) -> torch.Tensor:
                with through_modules():
                    return steps_of.step(q)

            def ours_on_pytorch_ops(q: int = q) -> torch.Tensor:
                with cpu_kernels.disabled():
                    return steps_of.step(q, ours_without_kernels)

            steps = [ours_step, ours_through_modules, ours_on_pytorch_ops, theirs_step]
            if compiled is not None:
                steps.append(partial(compiled.step, q))
            results.append((q, *alternated_medians_ms(steps, iters, warmup=3)))
    return results


class CompiledSteps:
    """transformers' model compiled by ``torch.compile`` (inductor, frozen weights) over a
    ``StaticCache`` that holds ``context`` tokens of ``ids``; each step writes ``q`` tokens after
    them and is rewound, so every step sees the same cache, as :class:`CachedSteps` does."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, context: int, max_new_tokens: int, batch: int) -> None:
        from transformers import StaticCache

        self.ids, self.context, self.batch = ids, context, batch
        self.cache = StaticCache(config=model.config, max_cache_len=context + max_new_tokens)
        self.model = torch.compile(model, dynamic=False)
        with torch.inference_mode():
            model(ids[None, :context].expand(batch, -1), past_key_values=self.cache, use_cache=True,
                  cache_position=torch.arange(context))

    @torch.inference_mode()
    def step(self, q: int) -> torch.Tensor:
        import torch._inductor.config as inductor_config

        # transformers 5's static layers count what they hold; rewinding the count rewinds the cache
        # (earlier versions write where ``cache_position`` says).
        for layer in getattr(self.cache, "layers", ()):
            if getattr(layer, "cumulative_length", None) is not None:
                layer.cumulative_length.fill_(self.context)
        step_ids = self.ids[None, self.context : self.context + q].expand(self.batch, -1)
        with inductor_config.patch(freezing=True):
            return self.model(step_ids, past_key_values=self.cache, use_cache=True,
                              cache_position=torch.arange(self.context, self.context + q)).logits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the step")
    parser.add_argument("--new-tokens", default="1,4", help="step sizes, comma-separated")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step, each with --context cached tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compiled-transformers", action="store_true",
                        help="also time transformers compiled by torch.compile (inductor, frozen weights)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    new_tokens = [int(q) for q in args.new_tokens.split(",")]
    print(
        f"batch {args.batch}, context {args.context} tokens, {args.threads} threads, median of {args.iters} steps; "
        f"CPU: {cpu_model()} ({', '.join(kernel_flags()) or 'no listed flags'}); "
        f"Sonar's CPU kernels: {'built' if cpu_kernels.load() is not None else cpu_kernels.problem()}"
    )
    for name in args.dtypes.split(","):
        rows = compare(args.model, getattr(torch, name), args.context, new_tokens, args.iters, args.batch,
                       args.compiled_transformers)
        for q, ours_ms, modules_ms, pytorch_ops_ms, theirs_ms, *compiled_ms in rows:
            compiled = "".join(f"   transformers compiled {ms:8.2f} ms ({ms / ours_ms:.2f}x)" for ms in compiled_ms)
            print(
                f"{name:9s} q={int(q):<3d} sonar {ours_ms:8.2f} ms   through modules {modules_ms:8.2f} ms   "
                f"sonar on PyTorch ops {pytorch_ops_ms:8.2f} ms   transformers {theirs_ms:8.2f} ms   "
                f"direct calls {modules_ms / ours_ms:.2f}x   kernels {pytorch_ops_ms / ours_ms:.2f}x   "
                f"vs transformers {theirs_ms / ours_ms:.2f}x{compiled}"
            )


if __name__ == "__main__":
    main()
