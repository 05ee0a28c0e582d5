"""Gemma 4's text decoder as a target: ``Gemma4ForCausalLM`` (text-only checkpoints, model_type
``gemma4_text``) and ``Gemma4ForConditionalGeneration`` (the released multimodal checkpoints, whose
``text_config`` describes the decoder).

Sonar generates text only. A multimodal checkpoint loads its language model
(``model.language_model.*`` and the LM head) and skips every other tensor (the vision and audio
towers and their embedders): images and audio are not supported.

What the decoder computes, as transformers' ``gemma4`` does (the layers are in
:mod:`sonar_core.layers.gemma4`):

- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model's dtype);
- sliding and full attention layers (``layer_types``), each type with its own rotary embedding
  (``rope_parameters[type]``; full layers use the ``proportional`` rule with a
  ``partial_rotary_factor``), head size and KV heads (``per_layer_config``: ``global_head_dim``,
  ``num_global_key_value_heads``);
- per-layer inputs (PLE, ``hidden_size_per_layer_input``): a second token embedding plus a
  projection of the main one, one slice per layer;
- KV sharing (``num_kv_shared_layers``): the last layers write no cache and read the cache of the
  last earlier layer of their type; their MLP is twice as wide with ``use_double_wide_mlp``;
- the routed MoE block (``enable_moe_block``), ``final_logit_softcapping``.

KV caches: one cache per layer that writes one (:meth:`Gemma4ForCausalLM.kv_cache_specs`), so a
model with KV sharing has fewer caches than layers. ``kv_cache_index[i]`` is the cache layer ``i``
reads (its own, or its producer's); :meth:`Gemma4ForCausalLM.kv_producer_cache_indices` names, for
each layer type, the cache of the last layer of that type that writes one, which a Gemma 4
assistant's query-only layers read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.gemma4 import (
    Gemma4DecoderLayer,
    Gemma4LayerConfig,
    Gemma4MoEConfig,
    Gemma4RMSNorm,
    ScaledEmbedding,
    gemma4_fused_projections,
)
from sonar_core.layers.linear import Linear, drop_prepacked, prepack_linears
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding
from sonar_core.models.base import CausalLM, TargetModules
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.models.registry import register_architecture
from sonar_core.models.weights import load_named_weights

SLIDING, FULL = "sliding_attention", "full_attention"
# Tensors a KV-sharing layer may still carry in a checkpoint; transformers ignores them too.
_UNUSED_IN_SHARED_LAYERS = ("k_proj", "v_proj", "k_norm", "v_norm")
_ATTENTION_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.[^.]+$")


def _check_supported(text_config: Any) -> None:
    """Refuse the Gemma 4 settings Sonar does not implement, naming the config key."""
    if getattr(text_config, "use_bidirectional_attention", None) == "all":
        raise ValueError(
            "Gemma 4 config use_bidirectional_attention='all' makes text attention non-causal, which "
            "generation does not support; use a checkpoint with use_bidirectional_attention null or 'vision'"
        )
    unknown = sorted(set(text_config.layer_types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"Gemma 4 layer_types {unknown} are not supported (supported: {SLIDING}, {FULL})")
    if len(text_config.layer_types) != text_config.num_hidden_layers:
        raise ValueError(
            f"Gemma 4 layer_types lists {len(text_config.layer_types)} layers but num_hidden_layers is "
            f"{text_config.num_hidden_layers}"
        )


def kv_source_layers(text_config: Any) -> list[int]:
    """For each layer, the layer whose KV cache it reads: itself, or for the last
    ``num_kv_shared_layers`` layers the last earlier layer of the same type that writes its own."""
    layer_types = list(text_config.layer_types)
    first_shared = len(layer_types) - (getattr(text_config, "num_kv_shared_layers", 0) or 0)
    if first_shared <= 0:
        raise ValueError(
            f"Gemma 4 num_kv_shared_layers ({text_config.num_kv_shared_layers}) leaves no layer that writes "
            f"its own KV cache; a target needs it below num_hidden_layers ({len(layer_types)})"
        )
    sources = list(range(first_shared))
    for index in range(first_shared, len(layer_types)):
        producers = [j for j in range(first_shared) if layer_types[j] == layer_types[index]]
        if not producers:
            raise ValueError(
                f"Gemma 4 layer {index} ({layer_types[index]}) shares the KV cache of an earlier layer of its "
                f"type, but none of the first {first_shared} layers is one (num_kv_shared_layers too large)"
            )
        sources.append(producers[-1])
    return sources


def gemma4_layer_config(text_config: Any, index: int, kv_shared: bool) -> Gemma4LayerConfig:
    """Layer ``index`` of a ``gemma4_text`` config, resolved through ``per_layer_config`` (head
    size and KV heads differ by layer type). ``kv_shared``: a query-only layer reading another
    layer's cache (a target's last ``num_kv_shared_layers`` layers, every layer of an assistant)."""
    layer = text_config.per_layer_config[index]
    sliding = text_config.layer_types[index] == SLIDING
    moe = None
    if getattr(layer, "enable_moe_block", False):
        moe = Gemma4MoEConfig(
            num_experts=int(layer.num_experts or 0),
            top_k=int(layer.top_k_experts or 0),
            intermediate_size=int(layer.moe_intermediate_size or 0),
        )
    wide = bool(getattr(layer, "use_double_wide_mlp", False)) and kv_shared
    return Gemma4LayerConfig(
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size * (2 if wide else 1),
        num_heads=layer.num_attention_heads,
        num_kv_heads=layer.num_key_value_heads,
        head_dim=layer.head_dim,
        rms_norm_eps=layer.rms_norm_eps,
        hidden_act=layer.hidden_activation,
        attention_bias=bool(getattr(layer, "attention_bias", False)),
        sliding_window=layer.sliding_window if sliding else None,
        k_eq_v=bool(getattr(layer, "attention_k_eq_v", False)) and not sliding,
        kv_shared=kv_shared,
        per_layer_input_size=int(getattr(layer, "hidden_size_per_layer_input", 0) or 0),
        moe=moe,
    )


def gemma4_layer_configs(text_config: Any) -> list[Gemma4LayerConfig]:
    """One :class:`Gemma4LayerConfig` per layer of a target's ``gemma4_text`` config. Raises
    ValueError for settings Sonar does not implement."""
    _check_supported(text_config)
    sources = kv_source_layers(text_config)
    return [gemma4_layer_config(text_config, index, sources[index] != index) for index in range(len(sources))]


def rotary_embeddings(text_config: Any, layers: list[Gemma4LayerConfig]) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per layer type, from ``rope_parameters[type]`` and that type's head size."""
    params = getattr(text_config, "rope_parameters", None) or {}
    rotaries = {}
    for layer_type in dict.fromkeys(text_config.layer_types):
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(
                f"Gemma 4 rope_parameters must hold one dict per layer type; {layer_type!r} has none"
            )
        head_dim = layers[list(text_config.layer_types).index(layer_type)].head_dim
        rope = RopeConfig.from_parameters(params[layer_type], head_dim, text_config.max_position_embeddings)
        rotaries[layer_type] = RotaryEmbedding(rope)
    return rotaries


class Gemma4TextModel(nn.Module):
    """Embeddings, layers, final norm and the per-layer-input tables: what the checkpoint keeps
    under ``model.`` (text-only) or ``model.language_model.`` (multimodal)."""

    def __init__(self, text_config: Any, layers: list[Gemma4LayerConfig]) -> None:
        super().__init__()
        hidden = text_config.hidden_size
        self.num_layers = len(layers)
        self.embed_tokens = ScaledEmbedding(text_config.vocab_size, hidden, hidden**0.5)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config) for config in layers)
        self.norm = Gemma4RMSNorm(hidden, text_config.rms_norm_eps)
        self.per_layer_input_size = int(getattr(text_config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_input_size:
            width = self.num_layers * self.per_layer_input_size
            self.embed_tokens_per_layer = ScaledEmbedding(
                text_config.vocab_size_per_layer_input, width, self.per_layer_input_size**0.5
            )
            self.per_layer_model_projection = Linear(hidden, width, bias=False)
            self.projection_scale = hidden**-0.5
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_input_size, text_config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, num_layers, per_layer_input_size]``: the per-layer token embedding plus the normed
        projection of the main embedding, times ``1/sqrt(2)``."""
        shape = (embeds.shape[0], self.num_layers, self.per_layer_input_size)
        projected = self.per_layer_model_projection(embeds) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + self.embed_tokens_per_layer(input_ids).view(shape)) * 2.0**-0.5


class Gemma4ForCausalLM(CausalLM):
    """A text-only Gemma 4 checkpoint (``model.*``, ``lm_head``); see the module docstring."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        text = hf_config.get_text_config(decoder=True)
        self.text_config = text
        self.layer_configs = gemma4_layer_configs(text)
        self.rotary = rotary_embeddings(text, self.layer_configs)
        self.layer_types = tuple(text.layer_types)
        self.num_layers = len(self.layer_configs)
        sources = kv_source_layers(text)
        self._producers = [index for index, source in enumerate(sources) if source == index]
        # Layer i reads kv_caches[kv_cache_index[i]].
        self.kv_cache_index = tuple(self._producers.index(source) for source in sources)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self._hold(Gemma4TextModel(text, self.layer_configs))
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_weights()

    def _hold(self, text_model: Gemma4TextModel) -> None:
        """Place the text model where the checkpoint names it."""
        self.model = text_model

    @property
    def language_model(self) -> Gemma4TextModel:
        return self.model

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled by ``sqrt(hidden_size)``, as the decoder's first layer reads them."""
        return self.language_model.embed_tokens(input_ids)

    def shared_modules(self) -> TargetModules:
        text = self.language_model
        return TargetModules(
            embed_tokens=text.embed_tokens,  # its forward applies the scale
            final_norm=text.norm,
            lm_head=self.lm_head,  # without final_logit_softcapping (compute_logits applies it)
            hidden_size=self.text_config.hidden_size,
            vocab_size=self.text_config.vocab_size,
            num_layers=self.num_layers,
            kv_producers=self.kv_producer_cache_indices(),
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        capture: HiddenStateCapture | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`CausalLM.forward`, with one cache per entry of :meth:`kv_cache_specs`. With
        per-layer inputs, ``input_ids`` is needed even when ``inputs_embeds`` is given: the
        per-layer table is looked up by token id."""
        text = self.language_model
        hidden = text.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = None
        if text.per_layer_input_size:
            if input_ids is None:
                raise ValueError(
                    "Gemma 4 per-layer input embeddings are looked up by token id: pass input_ids with inputs_embeds"
                )
            per_layer = text.per_layer_inputs(input_ids, hidden)
        tables = {
            kind: rotary.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len) for kind, rotary in self.rotary.items()
        }
        if capture is not None:
            capture.record(0, hidden)
        for index, layer in enumerate(text.layers):
            cos, sin = tables[self.layer_types[index]]
            layer_input = None if per_layer is None else per_layer[:, index]
            hidden = layer(hidden, cos, sin, kv_caches[self.kv_cache_index[index]], attn_metadata, layer_input)
            if capture is not None:
                capture.record(index + 1, hidden)
        return text.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            # In the model's dtype, as transformers caps them.
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def kv_cache_specs(self) -> list[KVLayerSpec]:
        """One spec per layer that writes its own cache, in layer order; KV-sharing layers have none
        (they read ``kv_caches[kv_cache_index[i]]``)."""
        return [
            KVLayerSpec(num_kv_heads=self.layer_configs[i].num_kv_heads, head_dim=self.layer_configs[i].head_dim)
            for i in self._producers
        ]

    def kv_producer_cache_indices(self) -> dict[str, int]:
        """Layer type -> index (into ``kv_caches``) of the cache written by the last layer of that
        type that writes one: the KV a Gemma 4 assistant's layers of that type attend to."""
        return {
            layer_type: self.kv_cache_index[max(i for i in self._producers if self.layer_types[i] == layer_type)]
            for layer_type in dict.fromkeys(self.layer_types)
        }

    def _fused_projections(self) -> dict[str, tuple[str, int, int]]:
        fused: dict[str, tuple[str, int, int]] = {}
        for index, config in enumerate(self.layer_configs):
            fused.update(gemma4_fused_projections(config, f"layers.{index}."))
        return fused

    def _ignored(self, name: str) -> bool:
        """Checkpoint tensors the model does not need: a tied ``lm_head.weight`` and the k/v
        projections and norms a KV-sharing layer may still carry."""
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True
        match = _ATTENTION_MODULE.search(name)
        return (
            match is not None
            and match.group(2) in _UNUSED_IN_SHARED_LAYERS
            and self.layer_configs[int(match.group(1))].kv_shared
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        drop_prepacked(self)
        load_named_weights(self, weights, self._fused_projections(), self._ignored)
        prepack_linears(self)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A multimodal Gemma 4 checkpoint served as text only: its language model sits under
    ``model.language_model.``; the vision and audio towers (every other ``model.*`` tensor) are
    skipped without being kept."""

    def _hold(self, text_model: Gemma4TextModel) -> None:
        self.model = nn.Module()
        self.model.language_model = text_model

    @property
    def language_model(self) -> Gemma4TextModel:
        return self.model.language_model

    def _ignored(self, name: str) -> bool:
        outside_text = name.startswith("model.") and not name.startswith("model.language_model.")
        return outside_text or super()._ignored(name)


for _cls in (Gemma4ForCausalLM, Gemma4ForConditionalGeneration):
    register_architecture(_cls.__name__, _cls)
