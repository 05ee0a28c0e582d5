"""Which targets split over tensor-parallel ranks, and the configuration checks of a split.

Torch-free: configuration checks run these before anything loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sonar_core.errors import ConfigError

FIELD = "tensor_parallel_size"

_DENSE = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
# Architecture -> the config.json counts each rank takes an equal share of (attention heads, KV
# heads, MLP and expert columns, linear-attention heads). A missing key is not split.
SPLIT_COUNTS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "MiMoForCausalLM": _DENSE,
    "Qwen3ForCausalLM": _DENSE,
    "Qwen3NextForCausalLM": (
        *_DENSE,
        "linear_num_key_heads",
        "linear_num_value_heads",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ),
}


def split_counts(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """The counts of ``hf_config`` that tensor parallelism splits; KV heads default to the
    attention heads, as the families define them."""
    architectures = hf_config.get("architectures") or ["<none>"]
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), Mapping) else {}
    counts: dict[str, int] = {}
    for key in SPLIT_COUNTS.get(architectures[0], ()):
        value = hf_config.get(key, text.get(key))
        if value is None and key == "num_key_value_heads":
            value = hf_config.get("num_attention_heads", text.get("num_attention_heads"))
        if isinstance(value, int):
            counts[key] = value
    return counts


def check_tensor_parallel(hf_config: Mapping[str, Any], size: int, source: str, field: str = FIELD) -> None:
    """A ``size``-way split of this checkpoint must be implemented and even: a ConfigError on
    ``field`` otherwise."""
    if size == 1:
        return
    architecture = (hf_config.get("architectures") or ["<none>"])[0]
    if architecture not in SPLIT_COUNTS:
        raise ConfigError(
            field,
            f"{architecture} models cannot be split over tensor-parallel ranks yet; "
            f"{field}={size} needs one of {', '.join(sorted(SPLIT_COUNTS))}",
            f"set {field} to 1 for this model, or use data parallelism (--data-parallel-size) to serve "
            "more traffic",
        )
    for key, value in split_counts(hf_config).items():
        if value % size:
            raise ConfigError(
                field,
                f"{key}={value} in {source or 'the config'} does not split evenly over {size} ranks",
                f"choose a {field} that divides {key} ({_divisors(value)})",
            )


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_oversubscription_warning(size: int) -> str | None:
    """The warning for more CPU ranks than cores (a rank per core is the most that helps), or None."""
    cores = usable_cores()
    if size <= cores:
        return None
    return (
        f"tensor_parallel_size={size} runs more ranks than this machine has cores ({cores}); every "
        "collective then waits for a descheduled rank. Use at most one rank per core."
    )


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)
