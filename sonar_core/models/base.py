"""The interface every target model implements, as the model runner and proposers see it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec, StateLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.direct_layers import DirectLayer, KeptArgsCheck, run_layers
from sonar_core.layers.linear import Linear
from sonar_core.models import hf_config_cache
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.models.meta_build import materialize, on_meta_device
from sonar_core.models.sharding import ShardRule


@dataclass(frozen=True)
class TargetModules:
    """The target's input embedding, final norm and LM head: the module objects themselves.

    A proposer that drafts through them (EAGLE without its own embedding or head, MTP, DFlash)
    shares the target's weights, including a prepacked copy of the LM head, instead of copying them.
    ``final_norm(h)`` of a residual-stream state is what the LM head reads.
    """

    embed_tokens: nn.Embedding
    final_norm: nn.Module
    lm_head: nn.Module
    hidden_size: int
    vocab_size: int
    num_layers: int
    # Attention kind ("sliding_attention", "full_attention") -> index into the target's KV caches of
    # the last layer of that kind that writes its own: what a proposer whose layers attend over the
    # target's KV reads (Gemma 4 assistants). Empty for models that offer none.
    kv_producers: Mapping[str, int] = field(default_factory=dict)


class CausalLM(nn.Module, ABC):
    """A causal language model over the paged KV cache.

    Subclasses are constructed from a Hugging Face config alone (``cls(hf_config)``) and receive
    their weights through :meth:`load_weights`; :meth:`create` does both steps without spending
    time on random initialisation.
    """

    hf_config: Any
    # The output projection; when the checkpoint ties embeddings its weight *is* the embedding's,
    # so a proposer sharing it shares one tensor.
    lm_head: Linear

    @classmethod
    def create(cls, hf_config: Any, dtype: torch.dtype, device: torch.device) -> CausalLM:
        """An instance with uninitialised parameters of ``dtype`` on ``device``, in eval mode and
        without gradients; call :meth:`load_weights` next.

        Construction happens on the meta device, so no memory is touched and no random init runs.
        """
        with on_meta_device():
            model = cls(hf_config)
        model = materialize(model, dtype, device)
        model.tie_weights()
        return model.eval().requires_grad_(False)

    @classmethod
    def read_hf_config(cls, model_dir: Path) -> Any:
        """The transformers config of a checkpoint folder of this class. Families whose model_type
        transformers does not know (their checkpoints name remote code) override it."""
        return hf_config_cache.read_hf_config(model_dir)

    def tie_weights(self) -> None:  # noqa: B027 - models without tied weights need nothing
        """Re-point tied parameters at each other (after a device move broke the sharing)."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        capture: HiddenStateCapture | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder over one flattened batch.

        ``input_ids`` ``[T]`` (or ``inputs_embeds`` ``[T, H]``), ``positions`` ``[T]``, one
        ``(k_cache, v_cache)`` per entry of :meth:`kv_cache_specs`, in that order. Returns the final
        normed hidden states ``[T, H]``. When ``capture`` is given, the residual-stream states it asks
        for (``capture.record(k, h)`` after ``k`` layers, ``k = 0`` for the embeddings) are written
        into its buffer on the way.
        """

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` final hidden states -> ``[N, vocab]`` float32 logits."""

    @abstractmethod
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, H]`` input embeddings (shared with proposers)."""

    @abstractmethod
    def shared_modules(self) -> TargetModules:
        """The embedding, final norm and LM head as module objects, for proposers that share them."""

    @abstractmethod
    def kv_cache_specs(self) -> list[KVLayerSpec]:
        """One spec per KV cache the model's layers write, in layer order (the order of
        ``kv_caches``): one per decoder layer, except in models whose layers share caches (Gemma 4's
        KV-sharing layers read an earlier layer's cache and have no entry). The engine allocates
        exactly these caches and passes them to :meth:`forward`."""

    def state_specs(self) -> list[StateLayerSpec]:
        """One spec per recurrent layer (linear attention) that keeps a state per request, in
        layer order; the engine allocates a :class:`~sonar_core.kv.RecurrentStateCache` of them
        and hands it to :meth:`forward` through ``attn_metadata.state``. None in most models."""
        return []

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the Hugging Face checkpoint; strict (see ``load_named_weights``)."""

    def shard_rules(self) -> tuple[ShardRule, ...] | None:
        """How the checkpoint's tensors split over tensor-parallel ranks, for a model built in a
        :func:`~sonar_core.layers.tensor_parallel.tensor_parallel_scope` (the loader slices each tensor
        before :meth:`load_weights` sees it); None for a family that cannot split. The torch-free
        configuration checks name the same families (:data:`sonar_core.config.parallel.SPLIT_COUNTS`;
        a test keeps the two in step) and refuse the others before anything loads."""
        return None


class LayerStackLM(CausalLM):
    """A causal LM made of ``model.embed_tokens``, ``model.layers`` (each called as ``layer(hidden,
    cos, sin, kv_cache, metadata)`` with one KV cache per layer), ``model.norm``, ``lm_head`` and a
    ``rotary`` table: the embedding, forward pass, sharing and tying every such family has alike
    (Llama/Qwen, DeepSeek-V3). Subclasses build those modules and set ``config.hidden_size``,
    ``num_layers`` and ``tie_word_embeddings``, and give :meth:`kv_cache_specs` and the loading."""

    model: nn.Module
    rotary: Any
    config: Any
    num_layers: int
    tie_word_embeddings: bool

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def shared_modules(self) -> TargetModules:
        return TargetModules(
            embed_tokens=self.model.embed_tokens,
            final_norm=self.model.norm,
            lm_head=self.lm_head,
            hidden_size=self.config.hidden_size,
            vocab_size=self.hf_config.vocab_size,
            num_layers=self.num_layers,
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
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len)
        if capture is not None:
            capture.record(0, hidden)
        direct, kept_args = self._direct_layers()
        hidden = run_layers(self.model.layers, direct, hidden, cos, sin, kv_caches, attn_metadata, capture, kept_args)
        return self.model.norm(hidden)

    def _direct_layers(self) -> tuple[list[DirectLayer | None], KeptArgsCheck]:
        """Each layer's :class:`DirectLayer` form (None where it has none) and the check of what
        they keep between steps, made on first use."""
        direct = self.__dict__.get("_direct")
        if direct is None or len(direct[0]) != len(self.model.layers):
            direct = [DirectLayer.of(layer) for layer in self.model.layers], KeptArgsCheck()
            self.__dict__["_direct"] = direct
        return direct

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward_float(hidden)
