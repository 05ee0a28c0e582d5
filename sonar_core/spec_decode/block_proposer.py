"""Parallel block drafting from the target's hidden states (DFlash, DSpark).

A block drafter's backbone (:class:`BlockDraftHead`) keeps a *context* in its own KV cache: for
every position the target read, the fused target states ``hidden_norm(fc(states))`` projected by
each draft layer's own keys and values (no queries, no layer norm). To draft, it runs one pass over
a block of ``B`` query slots, ``[newest token, MASK x (B-1)]`` at positions ``p .. p+B-1`` (``p`` the
newest token's position), whose attention sees the whole context and the whole block (non-causal,
unless the checkpoint says otherwise). The block's own K/V land in provisional slots that the next
step's context overwrites.

:class:`BlockProposer` drives a head through an engine step: context for every new target
position (prefill chunks included), then one block pass for the requests that draft, then the
head's sampling of the block's slots (independent for DFlash, a Markov chain for DSpark).

The context of a position comes from the target's states there alone and is written in the step
where the target computes it, the step that ends a request included; the block's provisional
slots lie at and after the newest token, which no cached block holds. So a prefix-cached block
holds the context a request that hits it would write (``prefix_cache_lookahead=0``).
"""

from __future__ import annotations

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers import AttentionMetadata, DecoderLayer, RMSNorm, RotaryEmbedding
from sonar_core.layers.linear import Linear
from sonar_core.models.base import TargetModules
from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.block_layout import BlockLayout
from sonar_core.spec_decode.draft_attention import block_metadata, first_pass_metadata
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    TargetHiddenStates,
)


class BlockDraftHead(nn.Module):
    """The DFlash backbone: ``fc`` and ``hidden_norm`` fuse the target states into context, Qwen3
    layers run the block over it, ``norm`` and an LM head (its own or the target's) score the slots.

    Parameter names are the published ones (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``,
    ``embed_tokens``, ``lm_head``). Subclasses may replace :meth:`draft` (DSpark's Markov head).
    """

    def __init__(self, layout: BlockLayout, target: TargetModules | None = None) -> None:
        super().__init__()
        self.layout = layout
        config = layout.layer
        hidden = config.hidden_size
        self.target_hidden_layers = layout.target_hidden_layers
        self.kv_layers = (KVLayerSpec(config.num_kv_heads, config.head_dim),) * layout.num_layers
        self.fc = Linear(len(layout.target_hidden_layers) * layout.target_hidden_size, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(layout.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        if layout.own_embedding:
            self.embed_tokens = nn.Embedding(layout.vocab_size, hidden)
        if layout.own_lm_head:
            self.lm_head = Linear(hidden, layout.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(layout.rope)
        # The target's modules, held outside the module tree: neither loaded nor copied.
        self._shared = (None if target is None else target.embed_tokens, None if target is None else target.lm_head)

    def write_context(
        self, target: TargetHiddenStates, rows: torch.Tensor, metadata: AttentionMetadata, kv_caches: list[KVCache]
    ) -> None:
        """Store every draft layer's keys and values of the context at ``rows``' positions."""
        context = self.hidden_norm(self.fc(target.aux.index_select(0, rows)))
        cos, sin = self.rotary.cos_sin(metadata.positions, context.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.store_context(context, cos, sin, kv_cache, metadata.slot_mapping)

    def block(
        self, token_ids: torch.Tensor, kv_caches: list[KVCache], metadata: AttentionMetadata
    ) -> torch.Tensor:
        """``[R*B]`` block tokens at ``metadata.positions`` -> ``[R*B, H]`` normed slot states."""
        embedding = self.embed_tokens if self.layout.own_embedding else self._shared[0]
        x = embedding(token_ids)
        if self.layout.input_embedding_scale != 1.0:
            x = x * self.layout.input_embedding_scale
        cos, sin = self.rotary.cos_sin(metadata.positions, x.dtype, metadata.max_seq_len)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, metadata)
        return self.norm(x)

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` slot states -> float32 logits over the draft vocabulary."""
        lm_head = self.lm_head if self.layout.own_lm_head else self._shared[1]
        logits = lm_head.forward_float(states)
        if self.layout.output_multiplier != 1.0:
            logits = logits * self.layout.output_multiplier
        softcap = self.layout.final_logit_softcapping
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def draft(
        self,
        slots: torch.Tensor,
        anchors: torch.Tensor,
        depth: int,
        sampler: DraftSampler,
        sampling: SamplingBatch | None,
    ) -> tuple[list[DraftSample], list[int] | None]:
        """``depth`` drafts from ``[R, drafts_per_block, H]`` draft-slot states (``anchors``: the
        newest token of each request). Returns one sample per position, and per request how many
        drafts to keep (None: all). DFlash samples every slot on its own."""
        samples = [sampler.sample(self.compute_logits(slots[:, index]), sampling) for index in range(depth)]
        return samples, None


class BlockProposer(Proposer):
    """Drives a :class:`BlockDraftHead` over the engine's steps (see the module docstring)."""

    def __init__(self, head: BlockDraftHead, sampler: DraftSampler, max_depth: int | None = None) -> None:
        self.head = head
        self.sampler = sampler
        layout = head.layout
        self.capabilities = ProposerCapabilities(
            target_hidden_layers=head.target_hidden_layers,
            kv_layers=head.kv_layers,
            returns_draft_probs=sampler.probabilistic,
            draft_block_len=layout.block_size,
            max_depth=min(layout.drafts_per_block, max_depth or layout.drafts_per_block),
            prefix_cache_lookahead=0,
        )

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        # A request that ended this step still gets the context of its last positions: the
        # blocks they fill may be in the prefix cache for later requests.
        requests = [r for r in batch.requests if r.num_hidden_rows]
        if not requests or batch.target_hidden is None:
            return DraftProposal([[] for _ in batch.requests])
        context = first_pass_metadata(requests, batch.block_size, batch.device)
        self.head.write_context(batch.target_hidden, batch.hidden_row_index(requests), context, batch.kv_caches)
        drafting = [r for r in requests if r.max_draft_tokens > 0]
        if not drafting:
            return DraftProposal([[] for _ in batch.requests])
        layout = self.head.layout
        size = layout.block_size
        metadata = block_metadata(
            [len(r.token_ids) - 1 for r in drafting],
            size,
            [r.block_table for r in drafting],
            batch.block_size,
            batch.device,
            causal=layout.causal,
        )
        anchors = torch.tensor([r.token_ids[-1] for r in drafting], dtype=torch.int64, device=batch.device)
        tokens = torch.full((len(drafting), size), layout.mask_token_id, dtype=torch.int64, device=batch.device)
        tokens[:, 0] = anchors
        states = self.head.block(tokens.view(-1), batch.kv_caches, metadata).view(len(drafting), size, -1)
        depth = max(r.max_draft_tokens for r in drafting)
        samples, keep = self.head.draft(
            states[:, layout.first_draft_slot :], anchors, depth, self.sampler, self.sampler.batch_for(drafting)
        )
        token_rows = torch.stack([s.token_ids for s in samples], dim=1).tolist()
        if keep is not None:
            token_rows = [row[:count] for row, count in zip(token_rows, keep, strict=True)]
        probs = torch.stack([s.probs for s in samples], dim=1) if samples[0].probs is not None else None
        return DraftProposal.from_rows(batch.requests, drafting, token_rows, probs)

