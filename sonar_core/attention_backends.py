"""The attention backends a draft can run on (``speculative_config.attention_backend``).

Sonar's attention over the paged cache calls PyTorch's ``scaled_dot_product_attention``; a backend
is the choice of kernel behind it:

* ``TORCH_SDPA`` (the default): PyTorch picks its kernel; causal and non-causal masks, CPU and CUDA.
* ``FLASH_ATTN``: on CUDA, the FlashAttention kernel first (PyTorch's own, used where the batch's
  shapes allow it: no padding mask), then the memory-efficient one; it handles the non-causal
  blocks of DFlash and DSpark. There is no FlashAttention kernel on the CPU, where it runs as
  ``TORCH_SDPA`` (the engine says so when it starts).

Each backend states whether it can attend non-causally; block drafters refuse one that cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # configuration checks import this module; they must not wait for torch
    import torch

DEFAULT_BACKEND = "TORCH_SDPA"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    non_causal: bool
    description: str
    # PyTorch SDPA kernels to prefer, in order, on CUDA (None: PyTorch's own choice).
    cuda_kernels: tuple[str, ...] | None = None
    # Whether the backend has a kernel of its own on the CPU (else it runs as TORCH_SDPA there).
    on_cpu: bool = True

    def runs_as(self, device: torch.device) -> str:
        """The backend that actually runs on ``device``."""
        return self.name if device.type == "cuda" or self.on_cpu else DEFAULT_BACKEND

    @contextlib.contextmanager
    def active(self, device: torch.device) -> Iterator[None]:
        """Restrict PyTorch's SDPA to this backend's kernels while the block runs."""
        if device.type != "cuda" or self.cuda_kernels is None:
            yield
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, kernel) for kernel in self.cuda_kernels], set_priority=True):
            yield


BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        AttentionBackend(DEFAULT_BACKEND, non_causal=True, description="PyTorch's scaled_dot_product_attention"),
        AttentionBackend(
            "FLASH_ATTN",
            non_causal=True,
            description="PyTorch's FlashAttention kernel (CUDA; TORCH_SDPA on the CPU)",
            cuda_kernels=("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
            on_cpu=False,
        ),
    )
}


def get_backend(name: str | None) -> AttentionBackend | None:
    """The backend of ``name`` (case-insensitive; None: the default); None when Sonar has none."""
    return BACKENDS.get((name or DEFAULT_BACKEND).strip().upper())
