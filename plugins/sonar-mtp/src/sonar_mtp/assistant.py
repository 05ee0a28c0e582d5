"""Gemma 4 MTP assistants (``Gemma4AssistantForCausalLM``, FORMATS.md 5.4): a separate checkpoint
of query-only Gemma 4 layers that attend over the *target's* KV cache.

Every draft of a step sits at one position, the newest token's (``T``): the assistant reads
``pre_projection([target_embedding(token), hidden])``, its layers query the target's keys and
values of positions ``0..T-1`` (a sliding layer the last ``sliding_window + 1`` of them, a full layer
all; each layer the cache of the target's last KV-writing layer of its own kind), ``norm`` gives the
state the LM head scores, and ``post_projection`` of it is the next draft's ``hidden``. The first
``hidden`` is the target's final (post-norm) state at ``T-1``. The assistant writes no KV and keeps
no state, so preemption, rejection and chunked prefill need nothing from it. This is transformers'
``SinglePositionMultiTokenCandidateGenerator`` over the committed context.

With ``use_ordered_embeddings`` the LM head scores only the tokens of the ``centroid_intermediate_top_k``
best of ``num_centroids`` token clusters; the others get the row's lowest score minus one (per row,
where transformers takes the batch's minimum: a request's drafts never depend on its neighbours).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.kv import KVCache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.gemma4 import Gemma4DecoderLayer, Gemma4LayerConfig, Gemma4RMSNorm
from sonar_core.layers.linear import Linear
from sonar_core.models.base import TargetModules
from sonar_core.models.gemma4 import gemma4_layer_config, rotary_embeddings
from sonar_core.spec_decode.chain_proposer import ChainDepths
from sonar_core.spec_decode.draft_attention import DraftChain
from sonar_core.spec_decode.draft_checkpoint import FIELD
from sonar_core.spec_decode.draft_sampling import DraftSampler
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer, ProposerCapabilities
from sonar_mtp.families import ASSISTANT_ARCHITECTURE

if TYPE_CHECKING:
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import HeadSpec

ARCHITECTURE = ASSISTANT_ARCHITECTURE


def _assistant_layer_config(text_config: Any, index: int) -> Gemma4LayerConfig:
    """Assistant layer ``index``. Its sliding window reaches one key further back than the target's:
    the query at ``T`` attends the committed keys at distance 1..``sliding_window`` *and*
    ``sliding_window + 1`` (transformers' assistant mask is ``|q - kv| <= sliding_window`` over the
    flipped context), which in Sonar's convention (key position > query position - window, from the
    query's row at ``T - 1``) is a window of ``sliding_window + 1``."""
    layer = gemma4_layer_config(text_config, index, kv_shared=True)
    if layer.sliding_window is None:
        return layer
    return replace(layer, sliding_window=layer.sliding_window + 1)


class MaskedEmbedding(nn.Module):
    """Cluster-restricted scoring: ``centroids`` pick the best clusters of ``token_ordering`` (the
    vocabulary grouped into ``num_centroids`` equal clusters) and only their tokens are scored."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(f"num_centroids ({num_centroids}) must divide the vocabulary ({vocab_size} tokens)")
        self.top_k = top_k
        self.num_centroids = num_centroids
        self.centroids = Linear(hidden_size, num_centroids, bias=False)
        # An integer table loaded with the weights (a parameter so that the strict loader checks it).
        self.token_ordering = nn.Parameter(torch.zeros(vocab_size, dtype=torch.int64), requires_grad=False)

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """``[R, Hd]`` -> ``[R, V]`` logits."""
        rows = hidden.shape[0]
        clusters = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [R, top_k]
        per_cluster = self.token_ordering.view(self.num_centroids, -1)
        tokens = per_cluster[clusters].reshape(rows, -1)  # [R, top_k * V / C]
        scores = torch.einsum("rh,rth->rt", hidden, lm_head_weight[tokens])
        floor = scores.min(dim=-1, keepdim=True).values - 1.0
        return floor.expand(rows, self.token_ordering.shape[0]).clone().scatter_(1, tokens, scores)


class Gemma4AssistantHead(nn.Module):
    """The assistant's modules, named as its checkpoint names them (``model.layers``, ``model.norm``,
    ``pre_projection``, ``post_projection``, ``lm_head``, ``masked_embedding``)."""

    def __init__(self, config: Any, target: TargetModules | None = None) -> None:
        super().__init__()
        text = config.text_config
        hidden, backbone, vocab = text.hidden_size, config.backbone_hidden_size, text.vocab_size
        self.layer_types = tuple(text.layer_types)
        layer_configs = [_assistant_layer_config(text, index) for index in range(len(self.layer_types))]
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Gemma4DecoderLayer(layer) for layer in layer_configs)
        self.model.norm = Gemma4RMSNorm(hidden, text.rms_norm_eps)
        self.pre_projection = Linear(2 * backbone, hidden, bias=False)
        self.post_projection = Linear(hidden, backbone, bias=False)
        self.lm_head = Linear(hidden, vocab, bias=False)
        self.masked_embedding = (
            MaskedEmbedding(hidden, vocab, config.num_centroids, config.centroid_intermediate_top_k)
            if config.use_ordered_embeddings
            else None
        )
        self.rotary = rotary_embeddings(text, layer_configs)
        self._target = target

    def step(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
        target_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft for ``[R]`` tokens and ``[R, backbone]`` states: ``(logits [R, V], next hidden)``."""
        x = self.pre_projection(torch.cat((self._target.embed_tokens(token_ids), hidden), dim=-1))
        producers = self._target.kv_producers
        for layer, kind in zip(self.model.layers, self.layer_types, strict=True):
            cos, sin = tables[kind]
            x = layer(x, cos, sin, target_caches[producers[kind]], metadata)
        out = self.model.norm(x)
        logits = self.lm_head(out) if self.masked_embedding is None else self.masked_embedding(out, self.lm_head.weight)
        return logits.float(), self.post_projection(out)


class Gemma4AssistantProposer(Proposer):
    """Drives :class:`Gemma4AssistantHead` (see the module docstring)."""

    def __init__(self, head: Gemma4AssistantHead, sampler: DraftSampler, stop_confidence: float) -> None:
        self.head = head
        self.sampler = sampler
        self.stop_confidence = stop_confidence
        self.capabilities = ProposerCapabilities(
            target_final_hidden=True, reads_target_kv=True, returns_draft_probs=sampler.probabilistic
        )

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafting = [r for r in batch.requests if r.max_draft_tokens > 0 and not r.is_finished and r.num_hidden_rows]
        if not drafting or batch.target_hidden is None or batch.target_kv_caches is None:
            return DraftProposal([[] for _ in batch.requests])
        # The target's KV covers positions 0..T-1; the drafts' queries sit at T.
        last_committed = [len(r.token_ids) - 2 for r in drafting]
        chain = DraftChain(last_committed, last_committed, [r.block_table for r in drafting], batch.block_size, batch.device)
        metadata = chain.metadata()
        positions = chain.positions + 1
        tables = {kind: rotary.cos_sin(positions, batch.target_hidden.final.dtype) for kind, rotary in self.head.rotary.items()}
        hidden = batch.target_hidden.final.index_select(0, batch.last_row_index(drafting))
        tokens = torch.tensor([r.token_ids[-1] for r in drafting], dtype=torch.int64, device=batch.device)
        sampling = self.sampler.batch_for(drafting)
        steps_ids, steps_probs = [], []
        depths = ChainDepths.of_chains(drafting, self.stop_confidence)
        while depths.wanted(len(steps_ids)):
            logits, hidden = self.head.step(tokens, hidden, tables, batch.target_kv_caches, metadata)
            sample = self.sampler.sample(logits, sampling, confidence=depths.tracking)
            tokens = sample.token_ids
            steps_ids.append(tokens)
            steps_probs.append(sample.probs)
            depths.observe(sample.top_probabilities, len(steps_ids))
        token_rows = depths.cut(torch.stack(steps_ids, dim=1).tolist())
        probs = torch.stack(steps_probs, dim=1) if steps_probs[0] is not None else None
        return DraftProposal.from_rows(batch.requests, drafting, token_rows, probs)


# Tensors a query-only layer may still carry in a checkpoint; neither transformers nor Sonar loads them.
_UNUSED_ATTENTION = ("k_proj", "v_proj", "k_norm", "v_norm")


def assistant_config(checkpoint: DraftCheckpoint) -> Any:
    """The assistant's transformers config; a ConfigError on ``model`` when transformers refuses it."""
    from sonar_core.models.architectures import hf_config_from_dict

    try:
        config = hf_config_from_dict(checkpoint.config)
        config.validate_architecture()
    except ValueError as exc:
        raise ConfigError(FIELD, f"{checkpoint.describe()}: {exc}", "use a published Gemma 4 assistant checkpoint") from None
    return config


def check_fits_target(checkpoint: DraftCheckpoint, config: Any, target_folder: Path) -> None:
    """The assistant must read the target's KV as the target wrote it: its backbone width and
    vocabulary are the target's, and each of its layers has the head size, KV heads and window of
    the target's last KV-writing layer of the same kind."""
    from sonar_core.models.gemma4 import gemma4_layer_configs, kv_source_layers
    from sonar_core.models.loader import read_hf_config

    text = read_hf_config(target_folder)[1].get_text_config(decoder=True)
    problems = []
    if config.backbone_hidden_size != text.hidden_size:
        problems.append(f"backbone_hidden_size {config.backbone_hidden_size} (the target's hidden size is {text.hidden_size})")
    if config.text_config.vocab_size != text.vocab_size:
        problems.append(f"vocab_size {config.text_config.vocab_size} (the target's is {text.vocab_size})")
    target_layers = gemma4_layer_configs(text)
    sources = kv_source_layers(text)
    producers = {kind: target_layers[max(i for i, s in enumerate(sources) if s == i and text.layer_types[i] == kind)]
                 for kind in dict.fromkeys(text.layer_types)}
    for index, kind in enumerate(config.text_config.layer_types):
        producer = producers.get(kind)
        layer = gemma4_layer_config(config.text_config, index, kv_shared=True)
        if producer is None:
            problems.append(f"layer {index} is {kind}, which the target has none of")
        elif (layer.head_dim, layer.num_kv_heads, layer.sliding_window) != (
            producer.head_dim, producer.num_kv_heads, producer.sliding_window
        ):
            problems.append(
                f"layer {index} ({kind}) has head_dim {layer.head_dim}, {layer.num_kv_heads} KV heads, window "
                f"{layer.sliding_window}; the target's KV of that kind has {producer.head_dim}, "
                f"{producer.num_kv_heads}, {producer.sliding_window}"
            )
    if problems:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} is not an assistant of this target: " + "; ".join(problems),
            "use the assistant checkpoint published with this target (for example google/gemma-4-E4B-it-assistant "
            "for google/gemma-4-E4B-it)",
        )


def assistant_spec(config: Any) -> HeadSpec:
    """How the assistant's checkpoint becomes a :class:`Gemma4AssistantHead`."""
    from sonar_core.layers.gemma4 import gemma4_fused_projections
    from sonar_core.spec_decode.head_loading import HeadSpec

    text = config.text_config
    fused: dict[str, tuple[str, int, int]] = {}
    for index in range(len(text.layer_types)):
        layer = gemma4_layer_config(text, index, kv_shared=True)
        fused.update(gemma4_fused_projections(layer, f"model.layers.{index}."))
    tied = bool(config.tie_word_embeddings)

    def rename(name: str) -> str:
        return "lm_head.weight" if tied and name == "model.embed_tokens.weight" else name

    def skipped(name: str) -> bool:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        return (tied and name == "lm_head.weight") or (".self_attn." in name and module in _UNUSED_ATTENTION)

    return HeadSpec(
        build=lambda modules: Gemma4AssistantHead(config, modules),
        fused=fused,
        vocab_size=text.vocab_size,
        draft_vocab_size=text.vocab_size,
        rename=rename,
        skipped=skipped,
    )
