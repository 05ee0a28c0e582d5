"""A counter that moves whenever a module's parameter is registered or replaced, or a projection's
packed copy is made or dropped.

Why: decoder layers keep the kernel arguments they read from their modules between steps
(:mod:`sonar_core.layers.direct_layers`), and asking every module of a model each step whether
its parameters are still the ones read cost about a third of a millisecond a SmolLM2 decode step.
One comparison of this counter tells that no parameter object or packed copy was swapped since;
what was changed in place, the tensors' own stamps tell (``same_stamps`` of the CPU kernels).
Setting a parameter to None goes through no hook and is not seen here.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

_count = [0]


def current() -> int:
    """The counter's value now; a later value that differs means something was swapped since."""
    return _count[0]


def advance() -> None:
    """Move the counter: a parameter or a packed copy is being replaced."""
    _count[0] += 1


def _on_registration(module: nn.Module, name: str, parameter: nn.Parameter) -> None:
    advance()


register_module_parameter_registration_hook(_on_registration)
