"""Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``): a hybrid of linear-attention
layers (gated DeltaNet, :mod:`sonar_core.layers.gated_delta_net`) and full-attention layers
(``layer_types``; by default every ``full_attention_interval``-th layer), each followed by a
mixture of experts (softmax routing, a sigmoid-gated shared expert) or, in ``mlp_only_layers``, a
dense MLP. Every norm is zero-centred (``norm(x) * (1 + w)``); full attention has per-head q/k
norms, a per-head sigmoid gate on its output (``q_proj`` yields query and gate, interleaved per
head) and partial rotary embeddings (the first ``partial_rotary_factor`` of each head).

Caches: one KV cache per full-attention layer (:meth:`Qwen3NextForCausalLM.kv_cache_specs`, in
layer order) and one recurrent state per linear-attention layer
(:meth:`Qwen3NextForCausalLM.state_specs`), which the forward reads from ``attn_metadata.state``.

Built in a tensor-parallel scope, each rank holds its share of every layer
(:meth:`Qwen3NextLayerConfig.shard`) and reports its share of the caches: full attention's heads and
KV heads, linear attention's key heads with their value heads (and their recurrent state), and the
columns of every expert, shared expert and dense MLP. Each token mixer and each MLP or MoE ends in
one all-reduce; embedding, norms, routers, the shared-expert gate and the LM head are whole.
:meth:`Qwen3NextLayerConfig.shard_rules` cuts the checkpoint to match. The MTP layers below are
built from the whole config outside any such scope and run whole on the driver.

Building blocks for an MTP proposer (the checkpoint's ``mtp.layers.{i}.*`` are full-attention layers
with the MoE, next to ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and
``mtp.norm``, all zero-centred norms; the target loads none of them: a proposer claims ``mtp.``)::

    config = Qwen3NextLayerConfig.from_hf_config(hf_config)
    layer = Qwen3NextAttentionLayer(config, moe=True)      # mtp.layers.{i}
    layer.kv_spec()                                        # == config.kv_spec(): its KV cache
    rotary = RotaryEmbedding(config.rope)                  # its cos/sin tables (partial rotary)
    load_named_weights(layer, tensors, config.fused_projections())  # names relative to the layer
    norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

``layer(hidden, cos, sin, kv_cache, metadata)`` is called like any decoder layer. The name map is
matched on the names' tails, so it serves under any prefix; pass the tensors through
:func:`~sonar_core.layers.moe.split_stacked_experts` first if they may hold stacked experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec, StateLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.decoder import DecoderLayerConfig, SelfAttention, fused_projections
from sonar_core.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig
from sonar_core.layers.linear import Linear, drop_prepacked, prepack_linears
from sonar_core.layers.moe import MoE, MoEConfig, gated_mlp, moe_fused_projections, split_stacked_experts
from sonar_core.layers.norms import ZeroCentredRMSNorm
from sonar_core.layers.recurrent_batch import RecurrentBatch
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding
from sonar_core.layers.tensor_parallel import TensorParallel
from sonar_core.layers.tensor_parallel import current as current_tensor_parallel
from sonar_core.models.base import LayerStackLM
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.models.registry import register_architecture
from sonar_core.models.sharding import ShardRule, projection_rules, shard_layer_config
from sonar_core.models.weights import load_named_weights

LINEAR, FULL = "linear_attention", "full_attention"
# Tensor-name prefix of the checkpoint's MTP module (FORMATS.md 5.3).
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class Qwen3NextLayerConfig:
    """What every Qwen3-Next decoder layer is made of; ``layer_types`` and the MoE placement say
    which token mixer and MLP layer ``i`` has."""

    hidden_size: int
    intermediate_size: int  # the dense MLP of mlp_only_layers
    rms_norm_eps: float
    hidden_act: str
    attention: DecoderLayerConfig  # full-attention layers
    linear: GatedDeltaNetConfig
    moe: MoEConfig | None  # None without experts (num_experts 0)
    rope: RopeConfig
    layer_types: tuple[str, ...]
    mlp_only_layers: tuple[int, ...]
    decoder_sparse_step: int

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Qwen3NextLayerConfig:
        """Read a ``qwen3_next`` config; ValueError for layer types it does not define."""
        layer_types = tuple(hf_config.layer_types)
        if len(layer_types) != hf_config.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(layer_types)} layers but num_hidden_layers is "
                f"{hf_config.num_hidden_layers}"
            )
        unknown = sorted(set(layer_types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (supported: {LINEAR}, {FULL})")
        bias = bool(getattr(hf_config, "attention_bias", False))
        head_dim = int(
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        attention = DecoderLayerConfig(
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_heads=int(hf_config.num_attention_heads),
            num_kv_heads=int(hf_config.num_key_value_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            hidden_act=hf_config.hidden_act,
            attn_output_gate=True,
            zero_centred_qk_norm=True,
        )
        return cls(
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            hidden_act=hf_config.hidden_act,
            attention=attention,
            linear=GatedDeltaNetConfig.from_hf_config(hf_config),
            moe=MoEConfig.from_qwen_config(hf_config) if int(hf_config.num_experts or 0) > 0 else None,
            rope=RopeConfig.from_hf_config(hf_config, head_dim),
            layer_types=layer_types,
            mlp_only_layers=tuple(getattr(hf_config, "mlp_only_layers", None) or ()),
            decoder_sparse_step=int(getattr(hf_config, "decoder_sparse_step", None) or 1),
        )

    def uses_moe(self, layer_index: int) -> bool:
        """Whether decoder layer ``layer_index`` has the MoE (as transformers places it)."""
        return (
            self.moe is not None
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    def shard(self, parallel: TensorParallel) -> Qwen3NextLayerConfig:
        """The layers one rank builds (see the module docstring); the routers' expert count and
        the hidden size stay whole."""
        if parallel.size == 1:
            return self
        return replace(
            self,
            intermediate_size=parallel.split(self.intermediate_size),
            attention=shard_layer_config(self.attention, parallel),
            linear=self.linear.shard(parallel),
            moe=None if self.moe is None else self.moe.shard(parallel),
        )

    def shard_rules(self) -> tuple[ShardRule, ...]:
        """How the checkpoint's layer tensors split, for this (whole) config.

        The contiguous cuts keep whole heads: ``q_proj`` interleaves each head's query and gate
        rows, and ``in_proj_qkvz``/``in_proj_ba`` group their rows by key head (``[q, k, v..., z...]``
        and ``[b..., a...]`` per key head). The convolution's channels are q, k and v side by side,
        each cut on its own. Experts match by their projections' names (``experts.{e}.gate_proj``),
        or as the stacked tensors of :func:`~sonar_core.layers.moe.split_stacked_experts`. Tensors
        no rule names (norms, routers, the shared-expert gate) stay whole.
        """
        linear = self.linear
        rules = (
            *projection_rules(
                column=(
                    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "gate_proj", "up_proj",
                ),
                row=("self_attn.o_proj", "linear_attn.out_proj", "down_proj"),
            ),
            ShardRule("linear_attn.conv1d.weight", 0, (linear.key_dim, linear.key_dim, linear.value_dim)),
            ShardRule("linear_attn.A_log", 0),
            ShardRule("linear_attn.dt_bias", 0),
        )
        if self.moe is None:
            return rules
        inter = self.moe.moe_intermediate_size
        # Stacked: [experts, 2 * inter (gate rows, then up), hidden] and [experts, hidden, inter].
        stacked = (ShardRule("experts.gate_up_proj", 1, (inter, inter)), ShardRule("experts.down_proj", 2))
        return (*rules, *stacked)

    def kv_spec(self) -> KVLayerSpec:
        """The KV cache of one full-attention layer."""
        return KVLayerSpec(num_kv_heads=self.attention.num_kv_heads, head_dim=self.attention.head_dim)

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint module -> (fused module, rows) for every layer kind: q (with its gate)/k/v,
        linear attention's input projections, dense MLP, experts and shared expert."""
        fused = {**fused_projections(self.attention), **self.linear.fused_projections()}
        if self.moe is not None:
            fused.update(moe_fused_projections(self.moe))
        return fused


class Qwen3NextDecoderLayer(nn.Module):
    """What both layer kinds share: zero-centred norms before the token mixer and before the MLP
    (the MoE when ``moe``, else the dense MLP), each with a residual connection."""

    def __init__(self, config: Qwen3NextLayerConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if not moe:
            self.mlp = gated_mlp(config.hidden_size, config.intermediate_size, config.hidden_act)
        elif config.moe is None:
            raise ValueError("a Qwen3-Next layer with the MoE needs a config with num_experts > 0")
        else:
            self.mlp = MoE(config.moe)

    def _feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextAttentionLayer(Qwen3NextDecoderLayer):
    """A full-attention decoder layer (also the MTP layer's block)."""

    def __init__(self, config: Qwen3NextLayerConfig, moe: bool) -> None:
        super().__init__(config, moe)
        self.config = config
        self.self_attn = SelfAttention(config.attention)

    def kv_spec(self) -> KVLayerSpec:
        return self.config.kv_spec()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> the layer's output; ``cos``/``sin`` from
        ``RotaryEmbedding(config.rope)``."""
        mixed = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return self._feed_forward(hidden + mixed)


class Qwen3NextLinearAttentionLayer(Qwen3NextDecoderLayer):
    """A linear-attention decoder layer; ``state_index`` is its place among the model's
    recurrent layers."""

    def __init__(self, config: Qwen3NextLayerConfig, moe: bool, state_index: int) -> None:
        super().__init__(config, moe)
        self.linear_attn = GatedDeltaNet(config.linear, state_index)

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        return self._feed_forward(hidden + self.linear_attn(self.input_layernorm(hidden), batch))


class Qwen3NextStack(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, vocab_size: int, config: Qwen3NextLayerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size)
        layers: list[nn.Module] = []
        for index, kind in enumerate(config.layer_types):
            moe = config.uses_moe(index)
            if kind == FULL:
                layers.append(Qwen3NextAttentionLayer(config, moe))
            else:
                state_index = config.layer_types[:index].count(LINEAR)
                layers.append(Qwen3NextLinearAttentionLayer(config, moe, state_index))
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(LayerStackLM):
    """Qwen3-Next over the paged KV cache (full-attention layers) and the recurrent-state cache
    (linear-attention layers). The checkpoint's ``mtp.*`` tensors are the MTP proposer's: they load
    only when the caller claims them (``claimed_prefixes=("mtp.",)``), else they are unexpected."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        # Inside a tensor-parallel scope each rank builds its share of every layer.
        self.config = Qwen3NextLayerConfig.from_hf_config(hf_config).shard(current_tensor_parallel())
        self.num_layers = int(hf_config.num_hidden_layers)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = Qwen3NextStack(hf_config.vocab_size, self.config)
        self.lm_head = Linear(self.config.hidden_size, hf_config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(self.config.rope)
        # Layer index -> its entry of kv_caches (full-attention layers only).
        full_layers = [index for index, kind in enumerate(self.config.layer_types) if kind == FULL]
        self.kv_index = {layer: cache for cache, layer in enumerate(full_layers)}
        self.tie_weights()

    def kv_cache_specs(self) -> list[KVLayerSpec]:
        return [self.config.kv_spec()] * len(self.kv_index)

    def state_specs(self) -> list[StateLayerSpec]:
        return [self.config.linear.state_spec()] * self.config.layer_types.count(LINEAR)

    def shard_rules(self) -> tuple[ShardRule, ...]:
        return Qwen3NextLayerConfig.from_hf_config(self.hf_config).shard_rules()

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        capture: HiddenStateCapture | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = RecurrentBatch.build(attn_metadata, self.config.linear.conv_kernel)
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len)
        if capture is not None:
            capture.record(0, hidden)
        for index, layer in enumerate(self.model.layers):
            if index in self.kv_index:
                hidden = layer(hidden, cos, sin, kv_caches[self.kv_index[index]], attn_metadata)
            else:
                hidden = layer(hidden, batch)
            if capture is not None:
                capture.record(index + 1, hidden)
        return self.model.norm(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def ignore(name: str) -> bool:
            # The MTP module (mtp.*) is the MTP proposer's, whether or not it runs, as DeepSeek-V3's
            # MTP layers are; the target never loads it.
            tied_copy = self.tie_word_embeddings and name == "lm_head.weight"
            return name.startswith(MTP_PREFIX) or name.endswith("rotary_emb.inv_freq") or tied_copy

        drop_prepacked(self)
        load_named_weights(self, split_stacked_experts(weights), self.config.fused_projections(), ignore)
        prepack_linears(self)


register_architecture(Qwen3NextForCausalLM.__name__, Qwen3NextForCausalLM)
