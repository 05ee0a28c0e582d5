"""Building modules on the meta device, where weights are loaded afterwards.

Every model, draft head and speculator is constructed this way (shapes only, no memory), then
given uninitialised memory on its device by :func:`materialize` and filled from its checkpoint.
Layers still run their random initialisation in ``reset_parameters()``: on the meta device it sets
nothing, yet the first ``normal_`` on a meta tensor imports ``torch._dynamo`` (1.36 s measured on a
2-core Xeon, the largest single cost of the engine's startup, for an embedding's init). So the init
functions are no-ops while the module is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# The torch.nn.init functions that layers call from reset_parameters().
_INIT_FUNCTIONS = (
    "normal_",
    "uniform_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules created inside are on the meta device, without running their random init; the
    init functions are restored on exit."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """``module`` (built on the meta device) cast to ``dtype`` and given uninitialised storage on
    ``device``: what ``.to(dtype).to_empty(device)`` gives, in the same two steps (a module that
    keeps some tensors out of dtype casts, such as an MoE router, sees the same calls). Not through
    ``to_empty``: it allocates with ``empty_like``, which for a meta tensor runs torch's Python
    reference implementation, and its first call imports sympy (about 0.7 s of the engine's start);
    ``empty_strided`` allocates on the device directly. Tied parameters come back untied, as with
    ``to_empty``."""
    module = module.to(dtype=dtype)
    return module._apply(
        lambda tensor: torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device)
    )
