"""The skinny matmul kernel (few rows, packed weights) against ``F.linear``: its results, its
batch invariance, when :class:`Linear` takes it, and its other instruction-set paths."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_flags
from sonar_core.layers.linear import WHOLE_BF16_PATHS, Linear, pack_skinny, prepack_linears, skinny_rows_limit

ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.problem()}")

DTYPES = [torch.float32, torch.bfloat16]


def _random(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference(x, weight, bias):
    """float64 product of the same (rounded) inputs."""
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 33])
@pytest.mark.parametrize("shape", [(96, 64), (50, 38), (300, 130)], ids=["even", "ragged-out", "wide"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_exact_product(dtype, rows, shape, with_bias):
    """Output counts that are not a multiple of the 16-wide blocks, row counts on and off the
    register tiles, with and without a bias: within the rounding of the output dtype."""
    out_features, in_features = shape
    weight = _random(out_features, in_features, dtype=dtype, seed=1) * 0.1
    bias = _random(out_features, dtype=dtype, seed=2) if with_bias else None
    x = _random(rows, in_features, dtype=dtype, seed=3)
    got = ops.skinny_linear(x, ops.pack_linear_weight(weight), bias, out_features)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), _reference(x, weight, bias), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 11])
def test_each_row_gets_the_same_bits_whatever_else_is_in_the_call(dtype, rows):
    """Verification of k drafts then equals decoding them one at a time, bit for bit (two to six
    rows each take a register tile of their own on some paths)."""
    weight = _random(200, 96, dtype=dtype, seed=4)
    packed = ops.pack_linear_weight(weight)
    x = _random(rows, 96, dtype=dtype, seed=5)
    together = ops.skinny_linear(x, packed, None, 200)
    one_by_one = torch.cat([ops.skinny_linear(x[i : i + 1], packed, None, 200) for i in range(rows)])
    assert torch.equal(together, one_by_one)
    reversed_rows = ops.skinny_linear(x.flip(0), packed, None, 200).flip(0)
    assert torch.equal(together, reversed_rows)


@pytest.mark.parametrize("rows", [1, 6, 33])
@pytest.mark.parametrize("out_features", [48, 50], ids=["whole-blocks", "ragged-out"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bfloat16_outputs_round_as_pytorch_rounds_their_float32_sums(rows, out_features, with_bias):
    """Each output is its float32 sum rounded to nearest even (ties both ways), NaN kept NaN and
    infinities kept, in whole 16-wide blocks (vector stores) and at the ragged edge: output
    n sums the two weights a[n] and b[n] (inputs of ones), so PyTorch's rounding of the float32
    a[n] + b[n] is the answer."""
    in_features = 32
    generator = torch.Generator().manual_seed(9)
    a, b = torch.randn(out_features, generator=generator), torch.randn(out_features, generator=generator)
    a[:8] = torch.tensor([1.0, 1.0078125, -1.0078125, float("nan"), float("inf"), 3.0, -float("inf"), 0.5])
    b[:8] = torch.tensor([2.0**-8, 2.0**-8, -(2.0**-8), 1.0, 1.0, 2.0**-9, 2.0, 2.0**-10])
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    weight = torch.zeros(out_features, in_features, dtype=torch.bfloat16)
    outputs = torch.arange(out_features)
    weight[outputs, outputs % 16], weight[outputs, 16 + outputs % 16] = a, b
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.ones(rows, in_features, dtype=torch.bfloat16)
    got = ops.skinny_linear(x, ops.pack_linear_weight(weight), bias, out_features)
    sums = a.float() + b.float() if bias is None else a.float() + b.float() + bias.float()
    expected = sums.to(torch.bfloat16).expand(rows, -1)
    assert torch.equal(got.isnan(), expected.isnan())  # NaN's bits differ between PyTorch's own paths
    numbers = ~expected.isnan()
    assert torch.equal(got[numbers].view(torch.int16), expected[numbers].view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 4, 6, 9])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_float_output_is_the_cast_of_the_rounded_output(dtype, rows, with_bias):
    """An LM head's logits in float32 straight from the kernel: the same values as casting its
    output in the input's dtype, bit for bit, through the kernel and through ``Linear``."""
    weight = _random(300, 96, dtype=dtype, seed=6)
    bias = _random(300, dtype=dtype, seed=7) if with_bias else None
    packed = ops.pack_linear_weight(weight)
    x = _random(rows, 96, dtype=dtype, seed=8)
    direct = ops.skinny_linear(x, packed, bias, 300, True)
    assert direct.dtype == torch.float32
    assert torch.equal(direct, ops.skinny_linear(x, packed, bias, 300).float())
    linear = Linear(96, 300, bias=with_bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    prepack_linears(linear)
    with torch.inference_mode():
        assert torch.equal(linear.forward_float(x), linear(x).float())


def test_float32_takes_odd_input_widths_and_bfloat16_does_not():
    """bfloat16 pairs neighbouring inputs; an odd width stays on the library's matmul."""
    assert pack_skinny(torch.randn(32, 7))[0] is not None
    assert pack_skinny(torch.randn(32, 7).to(torch.bfloat16)) == (None, 0)
    assert pack_skinny(torch.randn(32, 8).to(torch.float16)) == (None, 0)
    with pytest.raises(RuntimeError, match="even input width"):
        ops.pack_linear_weight(torch.randn(32, 7).to(torch.bfloat16))


def test_mismatched_inputs_are_refused():
    packed = ops.pack_linear_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="width does not match"):
        ops.skinny_linear(torch.randn(2, 6), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        ops.skinny_linear(torch.randn(2, 8), packed, None, 48)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.skinny_linear(torch.randn(2, 8).to(torch.bfloat16), packed, None, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_takes_the_kernel_up_to_its_row_limit_and_the_library_above(dtype, monkeypatch):
    layer = Linear(64, 48, bias=True).to(dtype)
    prepack_linears(layer)
    limit = skinny_rows_limit(dtype)
    assert layer.skinny_weight is not None and layer.skinny_rows == limit > 0
    whole = dtype == torch.bfloat16 and ops.skinny_linear_path(dtype) in WHOLE_BF16_PATHS
    assert whole == (limit == sys.maxsize)
    # Where the kernel takes every size, a prefill-sized call stands in for "above the limit".
    sizes = (1, 600, 601) if whole else (1, limit, limit + 1)
    calls = []
    kernel = ops.skinny_linear
    monkeypatch.setattr(ops, "skinny_linear", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    with torch.inference_mode():
        for rows in sizes:
            x = _random(rows, 64, dtype=dtype, seed=rows)
            expected = F.linear(x, layer.weight, layer.bias)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(layer(x), expected, rtol=tolerance, atol=tolerance)
        # a [batch, tokens, features] input is flattened to rows
        assert layer(_random(1, 3, 64, dtype=dtype)).shape == (1, 3, 48)
    assert calls == ([1, 600, 601, 3] if whole else [1, limit, 3])


def test_training_keeps_the_library_path_and_moving_drops_the_pack():
    layer = Linear(16, 8)
    prepack_linears(layer)
    assert layer.skinny_weight is not None
    x = torch.randn(2, 16)
    layer(x).sum().backward()  # the kernel has no backward; autograd takes F.linear
    assert layer.weight.grad is not None
    layer.to(torch.bfloat16)
    assert layer.skinny_weight is None and layer.packed_weight is None


def test_switching_the_kernels_off_takes_the_library_path():
    layer = Linear(16, 8)
    prepack_linears(layer)
    x = torch.randn(2, 16)
    with torch.inference_mode(), cpu_kernels.disabled():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


PATH_PROBE = textwrap.dedent(
    """
    import torch
    from sonar_core import cpu_kernels
    ops = cpu_kernels.load()
    assert ops is not None, cpu_kernels.problem()
    print("path:", ops.skinny_linear_path(torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        weight = (torch.randn(70, 40, generator=g) * 0.1).to(dtype)
        bias = torch.randn(70, generator=g).to(dtype)
        x = torch.randn(9, 40, generator=g).to(dtype)
        packed = ops.pack_linear_weight(weight)
        got = ops.skinny_linear(x, packed, bias, 70)
        rows = torch.cat([ops.skinny_linear(x[i : i + 1], packed, bias, 70) for i in range(9)])
        exact = x.double() @ weight.double().t() + bias.double()
        error = (got.double() - exact).abs().max().item()
        print(str(dtype), "error", error, "invariant", torch.equal(got, rows))
    """
)


@pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags(), reason="needs a CPU that runs AVX2 code"
)
def test_the_avx2_and_generic_builds_compute_the_same_products(tmp_path):
    """CPUs without AVX-512 (AVX2 only, or older) take other code paths; build them here for
    older instruction sets (side by side, in a temporary cache) and check their arithmetic."""
    builds = {"avx2": "haswell", "generic": "x86-64"}
    running = {
        path: subprocess.Popen(
            [sys.executable, "-c", PATH_PROBE],
            env={**os.environ, "SONAR_CACHE_DIR": str(tmp_path / path), cpu_kernels.ARCH_ENV: arch},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path, arch in builds.items()
    }
    for path, process in running.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-2000:]
        assert f"path: {path}" in out
        for line in out.splitlines()[1:]:
            dtype, _, error, _, invariant = line.split()
            assert invariant == "True", line
            assert float(error) < (1e-5 if dtype == "torch.float32" else 1e-2), line


def test_a_weight_changed_in_place_is_packed_again():
    layer = Linear(16, 8)
    prepack_linears(layer)
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        made_here = Linear(16, 8)  # a weight without a version counter
    made_here.pack()
    made_here.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
    with torch.inference_mode():
        torch.testing.assert_close(made_here(x), F.linear(x, made_here.weight, made_here.bias))
