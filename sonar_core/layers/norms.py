"""RMS normalisation as the Llama/Qwen families define it, and the zero-centred and gated variants
of Qwen3-Next."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are always computed in float32 and the result is cast back to the input dtype
    *before* the weight is applied, which is the order the reference checkpoints were trained with;
    doing the multiply in float32 instead shifts bf16 outputs by one ulp often enough to change
    greedy tokens.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.for_tensor(x, self.weight)
        if kernels is not None and x.is_contiguous() and x.dtype == self.weight.dtype:
            if x.dim() == 2:  # a step's rows: no views around the kernel (they cost as much as it)
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.rms_norm(x.view(-1, self._shape[0]), self.weight, self.eps).view(x.shape)
        if x.dtype == torch.float32:
            # One fused kernel: same arithmetic as the general branch when no cast is involved.
            return F.rms_norm(x, self._shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self._shape, None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: a decoder layer's residual add and the norm
        after it, in one pass where Sonar's CPU kernels run (the kernel computes this class's own
        norm; subclasses that scale differently take the two-step path)."""
        kernels = cpu_kernels.for_tensor(x, residual, self.weight) if type(self) is RMSNorm else None
        if (
            kernels is not None
            and x.dim() == 2
            and x.is_contiguous()
            and residual.is_contiguous()
            and x.dtype == residual.dtype == self.weight.dtype
        ):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        summed = residual + x
        return self(summed), summed

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"


def rms_norm_per_group(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` with ``weights[g]`` over each group ``g`` of ``x`` ``[..., G, H]`` (``weights``
    ``[G, H]``), in one call: the class's arithmetic (float32 statistics, cast to ``x``'s dtype
    before the weight), for norms over slices of a row that are not contiguous on their own
    (EAGLE-3's norm of each target layer's state). Where Sonar's CPU kernels run, one kernel call
    (row ``r`` of the flattened groups takes ``weights[r % G]``), as the class's norm of each
    slice would be; elsewhere the class's PyTorch path (six operators)."""
    kernels = cpu_kernels.for_tensor(x, weights)
    if (
        kernels is not None
        and x.is_contiguous()
        and weights.is_contiguous()
        and weights.shape == x.shape[-2:]
        and x.dtype == weights.dtype
    ):
        return kernels.rms_norm(x.view(-1, x.shape[-1]), weights, eps).view(x.shape)
    return weights * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` (Qwen3-Next): the weight is stored as an offset
    from 1 and starts at zero.

    Unlike :class:`RMSNorm`, the scale is applied in float32 and the result cast once, which is the
    order the reference computes it in.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self._shape, None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """:class:`RMSNorm` of ``x`` times ``silu(gate)`` (the output norm of Qwen3-Next's linear
    attention): the normed value is rounded to the input dtype and scaled, the gate multiplies in
    float32 and the product is cast once, as the reference does."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)
