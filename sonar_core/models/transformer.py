"""One decoder-only transformer for every supported family; families differ only by configuration.

Parameter names follow the Hugging Face layout (``model.embed_tokens``, ``model.layers.{i}.*``,
``model.norm``, ``lm_head``) except for the fused projections, which the loader fills from the
checkpoint's separate tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from sonar_core.kv import KVLayerSpec
from sonar_core.layers.decoder import DecoderLayer, DecoderLayerConfig, fused_projections
from sonar_core.layers.linear import Linear, drop_prepacked, prepack_linears
from sonar_core.layers.norms import RMSNorm
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding
from sonar_core.layers.tensor_parallel import current as current_tensor_parallel
from sonar_core.models.base import LayerStackLM
from sonar_core.models.sharding import DECODER_LAYER_RULES, ShardRule, shard_layer_config
from sonar_core.models.weights import load_named_weights


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of the checkpoint).

    ``sliding_windows``: one entry per layer, the layer's window or None for full attention.
    """

    def __init__(
        self,
        vocab_size: int,
        num_layers: int,
        layer_config: DecoderLayerConfig,
        sliding_windows: list[int | None] | None = None,
    ) -> None:
        super().__init__()
        windows = sliding_windows or [None] * num_layers
        self.embed_tokens = nn.Embedding(vocab_size, layer_config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(replace(layer_config, sliding_window=w)) for w in windows)
        self.norm = RMSNorm(layer_config.hidden_size, layer_config.rms_norm_eps)


class DecoderOnlyLM(LayerStackLM):
    """A pre-norm decoder-only language model; subclasses implement :meth:`layer_config`."""

    # Whether the family's sliding-window layers (``layer_types`` with ``sliding_window``, as Qwen2
    # and Qwen3 configs state them) are implemented; other families refuse such configs.
    honours_sliding_window: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        """Translate the Hugging Face config of this family into the layer's switches."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if not self.honours_sliding_window:
            _reject_sliding_window(hf_config)
        self.hf_config = hf_config
        # Inside a tensor-parallel scope each rank builds its share of the heads and MLP columns.
        self.config = shard_layer_config(self.layer_config(hf_config), current_tensor_parallel())
        self.num_layers = hf_config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        windows = layer_sliding_windows(hf_config) if self.honours_sliding_window else None
        self.model = DecoderStack(hf_config.vocab_size, self.num_layers, self.config, windows)
        self.lm_head = Linear(self.config.hidden_size, hf_config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(RopeConfig.from_hf_config(hf_config, self.config.head_dim))
        self.tie_weights()

    def kv_cache_specs(self) -> list[KVLayerSpec]:
        spec = KVLayerSpec(num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim)
        return [spec] * self.num_layers

    def shard_rules(self) -> tuple[ShardRule, ...]:
        return DECODER_LAYER_RULES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def ignore(name: str) -> bool:
            # Older checkpoints store the rotary table; tied ones may still carry a copy of the
            # embedding as lm_head.weight.
            return name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and name == "lm_head.weight")

        drop_prepacked(self)
        load_named_weights(self, weights, fused_projections(self.config), ignore)
        prepack_linears(self)


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' Qwen2/Qwen3 apply it:
    ``sliding_window`` on the layers ``layer_types`` marks ``sliding_attention``. Configs without
    ``layer_types`` derive them from ``use_sliding_window`` and ``max_window_layers``."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        use = bool(getattr(hf_config, "use_sliding_window", False))
        first = getattr(hf_config, "max_window_layers", 0) or 0
        layer_types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: sliding_attention, full_attention)")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _reject_sliding_window(hf_config: Any) -> None:
    """Sliding-window layers would silently attend too far; refuse them instead."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError(
            f"{hf_config.model_type}: sliding-window attention is not supported; "
            "use a checkpoint with use_sliding_window=false"
        )
