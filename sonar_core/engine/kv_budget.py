"""How many KV blocks the paged cache gets."""

from __future__ import annotations

import torch

from sonar_core.config import EngineConfig
from sonar_core.errors import ConfigError
from sonar_core.kv import KVLayerSpec

# Default KV budget on CPU, where there is no device memory to measure.
DEFAULT_CPU_KV_CACHE_GB = 2.0
# Device memory kept free for activations and the sampler on CUDA, beyond what is allocated now.
CUDA_ACTIVATION_RESERVE_BYTES = 1 << 30


def bytes_per_block(specs: list[KVLayerSpec], block_size: int, dtype: torch.dtype) -> int:
    """Key + value bytes of one block across every layer that shares the block tables."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(block_size * s.elements_per_token * element for s in specs)


def plan_kv_blocks(
    config: EngineConfig, specs: list[KVLayerSpec], dtype: torch.dtype, max_model_len: int
) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length requests need.

    The budget is ``kv_cache_memory_gb`` when set; otherwise on CUDA the part of
    ``gpu_memory_utilization`` of device memory not used yet, and on CPU a fixed default.
    """
    per_block = bytes_per_block(specs, config.block_size, dtype)
    device = config.torch_device()
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * (1 << 30))
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device) + CUDA_ACTIVATION_RESERVE_BYTES
        budget = int(total * config.gpu_memory_utilization) - used
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GB * (1 << 30))
    blocks_per_seq = -(-max_model_len // config.block_size) + 1
    num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            field="kv_cache_memory_gb" if device.type != "cuda" else "gpu_memory_utilization",
            message=(
                f"the KV cache holds {max(num_blocks, 0) * config.block_size} tokens, fewer than one "
                f"request of max_model_len={max_model_len} needs"
            ),
            fix="raise the KV cache budget or lower --max-model-len",
        )
    return num_blocks
