"""Time a model's projections at decode-sized row counts: Sonar's skinny kernel against the library's
matmul (oneDNN's packed weights for bfloat16, MKL's ``F.linear`` for float32), side by side.

One pass multiplies ``rows`` input rows by every :class:`Linear` of the model in turn, as a step
does, so the weights stream from memory rather than sit in cache; the table gives each path's
milliseconds per pass and the read bandwidth it reached, beside the machine's own (a ``sum`` over
1 GiB). The row limits in :mod:`sonar_core.layers.linear` come from this table.

    python -m sonar_core.models.linear_benchmark --dtypes bfloat16,float32 --rows 1,2,4,8,12,16,32
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_model, kernel_flags
from sonar_core.layers.linear import Linear, cpu_prepack_available, pack_skinny
from sonar_core.models.loader import load_model
from sonar_core.models.timing import alternated_medians_ms, timed


def read_bandwidth(gib: float = 1.0, iters: int = 5) -> float:
    """Bytes per second that ``torch.sum`` reads from a float32 tensor of ``gib`` GiB (best of
    ``iters``)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    return x.numel() * 4 / min(timed(x.sum) for _ in range(iters))


def _passes(layers: list[Linear], dtype: torch.dtype, rows: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """One pass over ``layers`` by the skinny kernel, and one by the library's matmul."""
    ops = cpu_kernels.load()
    inputs = {layer.in_features: torch.randn(rows, layer.in_features).to(dtype) for layer in layers}
    skinny = [(inputs[layer.in_features], pack_skinny(layer.weight)[0], layer.out_features) for layer in layers]
    if dtype != torch.float32 and cpu_prepack_available(dtype):
        library = [
            (inputs[layer.in_features], torch.ops.mkldnn._reorder_linear_weight(layer.weight, 1)) for layer in layers
        ]

        def library_pass() -> None:
            for x, packed in library:
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    else:

        def library_pass() -> None:
            for layer in layers:
                F.linear(inputs[layer.in_features], layer.weight)

    def skinny_pass() -> None:
        for x, packed, out_features in skinny:
            ops.skinny_linear(x, packed, None, out_features)

    return skinny_pass, library_pass


def projections(model: str | None, dtype: torch.dtype) -> list[Linear]:
    """Every :class:`Linear` of the model, in the order a step runs them."""
    return [m for m in load_model(model, dtype, "cpu").model.modules() if isinstance(m, Linear)]


def compare(layers: list[Linear], dtype: torch.dtype, row_counts: list[int], iters: int) -> list[tuple[int, float, float]]:
    """``(rows, skinny_ms, library_ms)`` medians per pass over ``layers``."""
    results = []
    with torch.inference_mode():
        for rows in row_counts:
            results.append((rows, *alternated_medians_ms(_passes(layers, dtype, rows), iters, warmup=2)))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,2,4,8,12,16,32", help="row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None:
        raise SystemExit(f"Sonar's CPU kernels are not available: {cpu_kernels.problem()}")
    bandwidth = read_bandwidth()
    print(
        f"{args.threads} threads, median of {args.iters} passes; CPU: {cpu_model()} "
        f"({', '.join(kernel_flags()) or 'no listed flags'}); read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print("| dtype | skinny path | rows | skinny ms | library ms | skinny vs library | skinny GB/s | library GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        path = cpu_kernels.load().skinny_linear_path(dtype)
        layers = projections(args.model, dtype)
        weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
        for rows, skinny_ms, library_ms in compare(layers, dtype, [int(r) for r in args.rows.split(",")], args.iters):
            print(
                f"| {name} | {path} | {rows} | {skinny_ms:.2f} | {library_ms:.2f} | {library_ms / skinny_ms:.2f}x | "
                f"{weight_bytes / skinny_ms / 1e6:.1f} | {weight_bytes / library_ms / 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
