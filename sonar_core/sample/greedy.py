"""Greedy picks: each row's argmax, through Sonar's CPU kernel where it applies."""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_core import cpu_kernels


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of a ``[R, V]`` tensor: the first maximum on ties, a NaN counting as the
    largest. Contiguous float32 rows on the CPU go through the kernel, since PyTorch's CPU argmax
    walks a row one element at a time (about 0.1 ms a row of a 49k vocabulary, 3 ms for the rows of
    a verification step at batch 8)."""
    kernels = cpu_kernels.for_tensor(x)
    if kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] > 0:
        return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def argmax_and_top_probability(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`argmax_rows` of ``[R, V]`` logits and each row's softmax probability (temperature 1)
    of that pick, float32: how sure a draft head is of its greedy draft. One kernel call where
    :func:`argmax_rows` takes one (a draft pass asks for both after every head step, and the
    softmax, its max and their tensors cost more than the pick)."""
    kernels = cpu_kernels.for_tensor(x)
    if kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] > 0:
        return kernels.argmax_rows_top(x)
    return x.argmax(dim=-1), torch.softmax(x.float(), dim=-1).amax(dim=-1)
