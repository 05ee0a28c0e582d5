"""What a block drafter's checkpoint is (DFlash, DSpark): its backbone, block and anchor mode.

Published layouts (FORMATS.md sections 6-7, docs/hidden-states.md):

* z-lab DFlash (``DFlashDraftModel``): a Qwen3 config plus ``dflash_config`` (``target_layer_ids``
  as layer outputs, ``mask_token_id``, ``block_size``, ``causal``; older checkpoints keep some at
  the top level). No embedding or LM head: the target's serve. Bonus-anchored: the block is
  ``[newest token, MASK x (B-1)]`` and slots 1..B-1 are the drafts.
* DeepSpec DSpark (``Qwen3DSparkModel``): a Qwen3 config plus top-level ``target_layer_ids``,
  ``block_size``, ``mask_token_id`` and the Markov and confidence heads' fields; its own copies of
  the embedding and LM head. Anchored sampling: all B slots are drafts, slot k the token after
  slot k's position.
* speculators ``dflash`` / ``dspark``: ``transformer_layer_config``, ``aux_hidden_state_layer_ids``
  (capture ids), ``block_size``, ``mask_token_id``, ``sample_from_anchor`` (default False for
  dflash, True for dspark), ``draft_vocab_size`` with ``d2t``, its own embedding and LM head.

Shared by the dflash and dspark plugins: both run the same backbone over the same block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sonar_core.errors import ConfigError
from sonar_core.layers import DecoderLayerConfig, RopeConfig
from sonar_core.models.architectures import hf_config_from_dict, layer_config_for
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.layer_ids import check_layers, from_capture_ids, from_dflash_target_layer_ids
from sonar_core.spec_decode.layout_names import (
    DEEPSPEC_DSPARK,
    SPECULATORS_DFLASH,
    SPECULATORS_DSPARK,
    ZLAB_DFLASH,
)


@dataclass(frozen=True)
class BlockTarget:
    """The target's dimensions a block drafter must fit."""

    hidden_size: int
    num_layers: int
    vocab_size: int


@dataclass(frozen=True)
class BlockLayout:
    """Everything needed to build, check and load a block drafter's backbone."""

    layout: str
    layer: DecoderLayerConfig
    num_layers: int
    rope: RopeConfig
    target_hidden_layers: tuple[int, ...]  # Sonar's index
    target_hidden_size: int
    block_size: int
    mask_token_id: int
    causal: bool
    # True: every slot of the block is a draft (slot k predicts the token after its position);
    # False: the newest token anchors slot 0 and slots 1..B-1 are the drafts.
    sample_from_anchor: bool
    vocab_size: int
    draft_vocab_size: int
    own_embedding: bool
    own_lm_head: bool
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    trained_depth: int | None = None
    max_position_embeddings: int | None = None
    # The raw config the layout came from (method-specific fields: the Markov head's, ...).
    config: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_draft_slot

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


def read_block_layout(
    config: Mapping[str, Any], names: set[str], target: BlockTarget, source: str
) -> BlockLayout:
    """The layout of a block drafter's config and tensor names, checked against the target."""
    speculators = config.get("speculators_model_type")
    if speculators in ("dflash", "dspark"):
        layer_dict = dict(config.get("transformer_layer_config") or {})
        layout = SPECULATORS_DFLASH if speculators == "dflash" else SPECULATORS_DSPARK
        aux = config.get("aux_hidden_state_layer_ids")
        layers = from_capture_ids(aux) if aux else _default_layers(target.num_layers, layer_dict)
        anchor = bool(config.get("sample_from_anchor", speculators == "dspark"))
        block_size = int(config.get("block_size") or 8)
        mask = config.get("mask_token_id")
        draft_vocab = int(config.get("draft_vocab_size") or target.vocab_size)
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        trained = methods[0].get("speculative_tokens") if isinstance(methods[0], Mapping) else None
        flags = config
    else:
        layer_dict = dict(config)
        dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), Mapping) else {}
        is_dspark = "Qwen3DSparkModel" in (config.get("architectures") or ()) or "markov_rank" in config
        layout = DEEPSPEC_DSPARK if is_dspark else ZLAB_DFLASH
        ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
        layers = from_dflash_target_layer_ids(ids) if ids is not None else _default_layers(target.num_layers, layer_dict)
        anchor = is_dspark
        block_size = int(dflash.get("block_size") or config.get("block_size") or 16)
        mask = dflash.get("mask_token_id", config.get("mask_token_id"))
        draft_vocab = target.vocab_size
        trained = None
        flags = {**config, **dflash}
    layer_dict.setdefault("model_type", "qwen3")
    _check_full_attention(layer_dict, source)
    # Every layer is full attention: the list says nothing more (and an embedded drafter inherits
    # the target's, of the target's length).
    layer_dict.pop("layer_types", None)
    try:
        hf_config = hf_config_from_dict(layer_dict)
        layer = layer_config_for(hf_config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(FIELD, f"{source} describes its layers in a config that cannot be read: {exc}",
                          "repair the draft's config.json") from None
    if mask is None:
        raise ConfigError(FIELD, f"{source} names no mask_token_id", "use a block drafter config that names its mask token")
    if not 0 <= int(mask) < target.vocab_size:
        raise ConfigError(
            FIELD, f"{source}: mask_token_id {mask} is outside the target vocabulary of {target.vocab_size}",
            "use a block drafter trained for this target",
        )
    if block_size < 2:
        raise ConfigError(FIELD, f"{source}: block_size {block_size} leaves nothing to draft", "repair config.json")
    target_hidden = int(config.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size or layer.hidden_size != target.hidden_size:
        raise ConfigError(
            FIELD,
            f"{source} reads target hidden states of size {target_hidden} with layers of size {layer.hidden_size}, "
            f"but the target's hidden size is {target.hidden_size}",
            "use a block drafter trained for this target",
        )
    vocab = int(layer_dict.get("vocab_size") or target.vocab_size)
    if vocab != target.vocab_size:
        raise ConfigError(FIELD, f"{source} has vocab_size {vocab}, the target {target.vocab_size}",
                          "use a block drafter trained for this target")
    softcap = flags.get("final_logit_softcapping")
    return BlockLayout(
        layout=layout,
        layer=layer,
        num_layers=int(hf_config.num_hidden_layers),
        rope=RopeConfig.from_hf_config(hf_config, layer.head_dim),
        target_hidden_layers=check_layers(layers, target.num_layers, FIELD, source),
        target_hidden_size=target_hidden,
        block_size=block_size,
        mask_token_id=int(mask),
        causal=bool(flags.get("causal", flags.get("is_causal", False))),
        sample_from_anchor=anchor,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab,
        own_embedding="embed_tokens.weight" in names,
        own_lm_head="lm_head.weight" in names,
        input_embedding_scale=float(flags.get("input_embedding_scale", 1.0)),
        output_multiplier=float(flags.get("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        trained_depth=trained if isinstance(trained, int) and trained > 0 else None,
        max_position_embeddings=layer_dict.get("max_position_embeddings"),
        config=dict(config),
    )


def _default_layers(num_target_layers: int, layer_dict: Mapping[str, Any]) -> tuple[int, ...]:
    """z-lab's default when a checkpoint names no layers: the middle one for a single draft layer,
    else evenly spaced from 1 to L-3 (as layer outputs, converted to Sonar's index)."""
    draft_layers = int(layer_dict.get("num_hidden_layers") or 1)
    if draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]
    return from_dflash_target_layer_ids(ids)


def _check_full_attention(layer_dict: Mapping[str, Any], source: str) -> None:
    """Sliding-window draft layers would need a windowed block mask, which Sonar's attention does
    not apply: refuse them rather than let them see more than they were trained on."""
    kinds = layer_dict.get("layer_types") or ()
    if any(kind != "full_attention" for kind in kinds):
        raise ConfigError(
            FIELD,
            f"{source} has layers of types {sorted(set(kinds))}; only full-attention draft layers are supported",
            "use a block drafter with full-attention layers",
        )


def block_layout_of(checkpoint: DraftCheckpoint, target: BlockTarget) -> BlockLayout:
    """A block drafter checkpoint's layout (from its config and headers; no weights are read)."""
    return read_block_layout(checkpoint.config, set(checkpoint.shapes), target, checkpoint.describe())


def block_target(target: Any) -> BlockTarget:
    """The target's dimensions from a TargetInfo (configuration checks) or TargetModules (loading)."""
    return BlockTarget(
        hidden_size=int(target.hidden_size or 0),
        num_layers=int(getattr(target, "num_layers", 0) or 0),
        vocab_size=int(target.vocab_size or 0),
    )
