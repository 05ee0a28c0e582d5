"""RMSNorm over groups of a row in one call (EAGLE-3's norm of each target layer's state)."""

from __future__ import annotations

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.layers.norms import RMSNorm, rms_norm_per_group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_per_group_equals_a_norm_of_each_slice(dtype):
    torch.manual_seed(0)
    norms = [RMSNorm(48, eps=1e-5).to(dtype) for _ in range(3)]
    for norm in norms:
        torch.nn.init.normal_(norm.weight)
    rows = torch.randn(5, 3 * 48, dtype=dtype) * 4
    weights = torch.stack([norm.weight for norm in norms])
    slices = rows.split(48, dim=-1)
    with torch.inference_mode(), cpu_kernels.disabled():
        grouped = rms_norm_per_group(rows.view(5, 3, 48), weights, 1e-5).view(5, -1)
        expected = torch.cat([norm(part.contiguous()) for norm, part in zip(norms, slices, strict=True)], dim=-1)
    assert torch.equal(grouped, expected)
    with torch.inference_mode():  # one kernel call: each slice as the kernels norm it alone
        grouped = rms_norm_per_group(rows.view(5, 3, 48), weights, 1e-5).view(5, -1)
        kernel = torch.cat([norm(part.contiguous()) for norm, part in zip(norms, slices, strict=True)], dim=-1)
    assert torch.equal(grouped, kernel)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # the two paths: the same up to rounding
    torch.testing.assert_close(kernel, expected, rtol=tolerance, atol=tolerance)
