"""EAGLE-1 and EAGLE-3 draft heads over the paged KV cache, built from core's layers.

Both are :class:`~sonar_core.spec_decode.chain_proposer.ChainDraftHead`: a pass reads ``[R]``
tokens (the token *after* each position) and ``[R, H]`` hidden states and returns the state the
logits come from and the state the next chained step reads. Modules the head shares with the
target (embedding, LM head) are held outside the module tree, so they are neither loaded nor
copied: the target's objects, prepacked weights included, serve both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers import (
    AttentionMetadata,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
)
from sonar_core.layers.direct_layers import DirectLayer, run_with_attention_input
from sonar_core.layers.linear import Linear
from sonar_core.layers.norms import rms_norm_per_group
from sonar_core.models.base import TargetModules
from sonar_core.spec_decode.chain_proposer import ChainDraftHead
from sonar_core.spec_decode.proposer import TargetHiddenStates
from sonar_eagle.layout import EagleLayout


@dataclass(frozen=True)
class _Shared:
    """The target modules a head uses without owning them (a plain container: not registered)."""

    embed_tokens: nn.Module | None
    lm_head: nn.Module | None


class _EagleHead(ChainDraftHead):
    """What both generations share: layout, rotary table, KV specs, shared or own embedding."""

    def __init__(self, layout: EagleLayout, target: TargetModules | None) -> None:
        super().__init__()
        self.layout = layout
        self.rotary = RotaryEmbedding(layout.rope)
        spec = KVLayerSpec(num_kv_heads=layout.layer.num_kv_heads, head_dim=layout.layer.head_dim)
        self.kv_layers = (spec,) * layout.num_layers
        if layout.own_embedding:
            self.embed_tokens = nn.Embedding(layout.target_vocab_size, layout.layer.hidden_size)
        self._shared = _Shared(
            embed_tokens=None if layout.own_embedding or target is None else target.embed_tokens,
            lm_head=None if layout.own_lm_head or target is None else target.lm_head,
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.layout.own_embedding else self._shared.embed_tokens
        return embedding(token_ids)


class Eagle1Head(_EagleHead):
    """EAGLE-1/2: ``fc(concat[embed(x), h])`` through Llama layers (the first without an input
    norm); no final norm; the target's LM head reads the output, which is also fed back."""

    target_final_hidden = True

    def __init__(self, layout: EagleLayout, target: TargetModules | None = None) -> None:
        super().__init__(layout, target)
        hidden = layout.layer.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=layout.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(layout.layer) for _ in range(layout.num_layers))
        self.layers[0].input_layernorm = nn.Identity()

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((self.embed(token_ids), hidden), dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype, metadata.max_seq_len)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, metadata)
        return x, x

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._shared.lm_head.forward_float(out)


class Eagle3FirstLayer(DecoderLayer):
    """EAGLE-3's first layer: a decoder layer whose attention reads
    ``[input_layernorm(embedding), hidden_norm(hidden)]`` (twice the hidden width)."""

    def __init__(self, layout: EagleLayout) -> None:
        super().__init__(layout.layer)
        config = layout.layer
        self.norm_before_residual = layout.norm_before_residual
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, input_size=2 * config.hidden_size)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        z = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        # A draft pass is a handful of small matmuls: one kernel call runs the rest of the layer.
        plan = self._direct_form()
        if plan is not None:
            out = run_with_attention_input(plan, z, residual, cos, sin, kv_cache, metadata)
            if out is not None:
                return out
        y = residual + self.self_attn(z, cos, sin, kv_cache, metadata)
        return y + self.mlp(self.post_attention_layernorm(y))

    def _direct_form(self) -> DirectLayer | None:
        """This layer's modules as the kernels run them (made on first use; None where they cannot)."""
        if "_direct" not in self.__dict__:
            self.__dict__["_direct"] = DirectLayer.of_modules(self)
        return self.__dict__["_direct"]


class Eagle3Head(_EagleHead):
    """EAGLE-3: ``fc`` fuses the target states once, the first layer reads embedding and hidden state
    side by side, further layers are standard; ``lm_head(norm(y))`` scores the draft vocabulary
    and ``y`` (or ``norm(y)`` with ``norm_output``) is fed back."""

    def __init__(self, layout: EagleLayout, target: TargetModules | None = None) -> None:
        super().__init__(layout, target)
        config = layout.layer
        self.target_hidden_layers = layout.target_hidden_layers
        fused_width = len(layout.target_hidden_layers) * layout.target_hidden_size
        if layout.norm_before_fc:
            self.input_norm = RMSNorm(fused_width, config.rms_norm_eps)
        if layout.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(layout.target_hidden_size, config.rms_norm_eps) for _ in layout.target_hidden_layers
            )
        self.fc = Linear(fused_width, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3FirstLayer(layout)] + [DecoderLayer(config) for _ in range(layout.num_layers - 1)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layout.own_lm_head:
            self.lm_head = Linear(config.hidden_size, layout.draft_vocab_size, bias=False)

    def target_input(self, target: TargetHiddenStates, rows: torch.Tensor) -> torch.Tensor:
        fused = target.aux.index_select(0, rows)
        if self.layout.norm_before_fc:
            fused = self.input_norm(fused)
        if self.layout.fc_norm:
            rows, groups = fused.shape[0], len(self.fc_norm)
            weights = torch.stack([norm.weight for norm in self.fc_norm])
            grouped = fused.view(rows, groups, self.layout.target_hidden_size)
            fused = rms_norm_per_group(grouped, weights, self.fc_norm[0].eps).view(rows, -1)
        return self.fc(fused)

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(token_ids)
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype, metadata.max_seq_len)
        first, *rest = self.layers  # (slicing a ModuleList builds a new module on every pass)
        y = first(embeds, hidden, cos, sin, kv_caches[0], metadata)
        for layer, kv_cache in zip(rest, kv_caches[1:], strict=True):
            y = layer(y, cos, sin, kv_cache, metadata)
        normed = self.norm(y)
        return normed, (normed if self.layout.norm_output else y)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        lm_head = self.lm_head if self.layout.own_lm_head else self._shared.lm_head
        return lm_head.forward_float(out)


def head_class(layout: EagleLayout) -> type[_EagleHead]:
    return Eagle3Head if layout.method == "eagle3" else Eagle1Head
