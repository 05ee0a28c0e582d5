"""How many KV blocks the paged cache gets, and whether the rest of a step's memory fits beside it.

Besides the KV cache and the weights, a step at full batch holds memory that grows with
``max_num_seqs``: the float32 logits of every verified position (``max_num_seqs`` requests times
``num_speculative_tokens + 1`` positions times the vocabulary) and, with probabilistic drafting, the
draft probabilities kept for rejection sampling (``max_num_seqs x num_speculative_tokens x
vocabulary``) and, in models with linear-attention layers, every request's recurrent state with its
per-draft-position copies (:mod:`sonar_core.kv.state`). The plan takes that working memory off the device budget on CUDA and checks it
against the memory the machine has free on the CPU, so that lowering ``--max-num-seqs`` is the
first fix, as the user guide says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.config import EngineConfig
from sonar_core.errors import ConfigError
from sonar_core.kv import KVLayerSpec

# Default KV budget on CPU, where there is no device memory to measure.
DEFAULT_CPU_KV_CACHE_GB = 2.0
# Device memory kept free for activations and the sampler on CUDA, beyond what is allocated now.
CUDA_ACTIVATION_RESERVE_BYTES = 1 << 30
GIB = 1 << 30
# The fix of every out-of-memory error, in the order the user guide gives.
OUT_OF_MEMORY_FIX = (
    "reduce --max-num-seqs first; then reduce the context length (--max-model-len) or "
    "--gpu-memory-utilization (on the CPU: kv_cache_memory_gb). Probabilistic draft sampling retains draft "
    "probabilities and uses additional memory: greedy drafting (no draft_sample_method) needs none"
)


@dataclass(frozen=True)
class WorkingMemory:
    """Memory a full step needs beside the weights and the KV cache (see the module docstring)."""

    logits_bytes: int
    draft_probs_bytes: int
    recurrent_state_bytes: int = 0

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        vocab_size: int,
        num_speculative_tokens: int,
        draft_probs: bool,
        recurrent_state_bytes: int = 0,
    ) -> WorkingMemory:
        rows = config.max_num_seqs * (num_speculative_tokens + 1)
        probs = config.max_num_seqs * num_speculative_tokens * vocab_size * 4 if draft_probs else 0
        return cls(rows * vocab_size * 4, probs, recurrent_state_bytes)

    @property
    def total(self) -> int:
        return self.logits_bytes + self.draft_probs_bytes + self.recurrent_state_bytes

    def describe(self, config: EngineConfig) -> str:
        parts = []
        if self.draft_probs_bytes:
            parts.append(f"{self.draft_probs_bytes / GIB:.2f} GiB keeps draft probabilities (probabilistic drafting)")
        if self.recurrent_state_bytes:
            parts.append(f"{self.recurrent_state_bytes / GIB:.2f} GiB holds the linear-attention states")
        of_which = f", of which {' and '.join(parts)}" if parts else ""
        return f"{self.total / GIB:.2f} GiB of working memory for max_num_seqs={config.max_num_seqs}{of_which}"


def bytes_per_block(specs: list[KVLayerSpec], block_size: int, dtype: torch.dtype) -> int:
    """Key + value bytes of one block across every layer that shares the block tables."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(block_size * s.elements_per_token * element for s in specs)


def plan_kv_blocks(
    config: EngineConfig,
    specs: list[KVLayerSpec],
    dtype: torch.dtype,
    max_model_len: int,
    working: WorkingMemory | None = None,
) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length requests need.

    The budget is ``kv_cache_memory_gb`` when set; otherwise on CUDA the part of
    ``gpu_memory_utilization`` of device memory not used yet, less ``working``; on CPU a fixed
    default, which with ``working`` must fit in the memory the machine has available.

    ``specs`` are one rank's (split KV heads under tensor parallelism). On CUDA the budget is each
    device's; on CPU the ranks share the machine's memory, so the budget is the engine's, split
    evenly over them.
    """
    working = working or WorkingMemory(0, 0)
    per_block = bytes_per_block(specs, config.block_size, dtype)
    device = config.torch_device()
    sharing = config.tensor_parallel_size if device.type == "cpu" else 1
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * GIB) // sharing
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device) + CUDA_ACTIVATION_RESERVE_BYTES
        budget = int(total * config.gpu_memory_utilization) - used - working.total
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GB * GIB) // sharing
    blocks_per_seq = -(-max_model_len // config.block_size) + 1
    num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
    field = "kv_cache_memory_gb" if device.type != "cuda" else "gpu_memory_utilization"
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            field=field,
            message=(
                f"startup runs out of memory: the KV cache holds {max(num_blocks, 0) * config.block_size} tokens, "
                f"fewer than one request of max_model_len={max_model_len} needs, after {working.describe(config)}"
            ),
            fix=OUT_OF_MEMORY_FIX,
        )
    if device.type == "cpu":
        _check_cpu_memory(config, num_blocks * per_block * sharing, working, field)
    return num_blocks


def available_cpu_memory() -> int | None:
    """Bytes the machine can still give this process (``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_cpu_memory(config: EngineConfig, kv_bytes: int, working: WorkingMemory, field: str) -> None:
    """The KV cache (allocated lazily, but used as requests grow) and the working memory must fit
    in what the machine has free once the weights are loaded."""
    available = available_cpu_memory()
    if available is None or kv_bytes + working.total <= available:
        return
    raise ConfigError(
        field=field,
        message=(
            f"startup runs out of memory: the KV cache ({kv_bytes / GIB:.2f} GiB) and {working.describe(config)} "
            f"do not fit in the {available / GIB:.2f} GiB this machine has available"
        ),
        fix=OUT_OF_MEMORY_FIX,
    )
