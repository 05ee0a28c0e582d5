"""MTP layers over the paged KV cache, driven by core's chain proposer.

:class:`MtpHead` is a :class:`~sonar_core.spec_decode.chain_proposer.ChainDraftHead`: the first
pass pairs the target's final hidden state at each new position with the token after it (writing
every MTP layer's KV there), and chained step ``s`` runs MTP layer ``s mod n`` one position further
on the previous step's carry. With one layer (every published MiMo-7B and DeepSeek-V3 checkpoint)
that layer is reused at every step, as vLLM does. The embedding and the LM head are the target's
own modules, held outside the module tree so they are neither loaded nor copied.
"""

from __future__ import annotations

import torch
from torch import nn

from sonar_core.kv import KVCache
from sonar_core.layers import AttentionMetadata
from sonar_core.layers.linear import Linear
from sonar_core.models.base import TargetModules
from sonar_core.spec_decode.chain_proposer import ChainDraftHead
from sonar_mtp.families import MtpFamily


class MtpLayer(nn.Module):
    """One MTP layer: fuse embedding and hidden state, run the decoder block, norm the output."""

    def __init__(self, family: MtpFamily, hf_config, index: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        eps = hf_config.rms_norm_eps
        self.hidden_first = family.hidden_first
        self.carry_normed = family.carry_normed
        self.embed_norm = family.build_norm(hidden, eps)
        self.hidden_norm = family.build_norm(hidden, eps)
        self.proj = Linear(2 * hidden, hidden, bias=False)
        self.block = family.build_block(hf_config, index)
        self.output_norm = family.build_norm(hidden, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, carry)``: the state the LM head scores and the one the next step reads."""
        pair = (self.hidden_norm(hidden), self.embed_norm(embeds))
        fused = self.proj(torch.cat(pair if self.hidden_first else pair[::-1], dim=-1))
        y = self.block(fused, cos, sin, kv_cache, metadata)
        out = self.output_norm(y)
        return out, (out if self.carry_normed else y)


class MtpHead(ChainDraftHead):
    """The target's MTP layers as one chain head (see the module docstring)."""

    target_final_hidden = True

    def __init__(self, family: MtpFamily, hf_config, num_layers: int, target: TargetModules | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MtpLayer(family, hf_config, index) for index in range(num_layers))
        self.kv_layers = (family.kv_spec(hf_config),) * num_layers
        self.rotary = family.build_rotary(hf_config)
        self._target = target

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self._target.embed_tokens(token_ids)
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype, metadata.max_seq_len)
        if step == 0:
            # Every layer sees the target's states at the new positions, so each keeps a KV cache
            # without holes whichever step reuses it; the first draft comes from layer 0.
            results = [
                layer(embeds, hidden, cos, sin, kv_cache, metadata)
                for layer, kv_cache in zip(self.layers, kv_caches, strict=True)
            ]
            return results[0]
        index = step % len(self.layers)
        return self.layers[index](embeds, hidden, cos, sin, kv_caches[index], metadata)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._target.lm_head.forward_float(out)
