"""What an EAGLE checkpoint is: its layout, shapes and switches, read from config.json and the
tensor headers (no weights), and checked against the target.

Three published layouts (docs/hidden-states.md and FORMATS.md sections 1-2):

* SafeAILab EAGLE-1 (``eagle``): a LlamaConfig; ``fc`` ``[H, 2H]`` (bias unless ``"bias": false``),
  Llama layers whose first has no input norm, no final norm and no LM head (the target's serve).
* SafeAILab EAGLE-3 (``eagle3``): a LlamaConfig plus ``draft_vocab_size``; ``midlayer.*`` reads
  ``[embedding, hidden]`` side by side, ``fc`` ``[H, n*H]`` fuses n target states, own ``norm`` and
  ``lm_head`` over the draft vocabulary, ``d2t``/``t2d`` vocabulary maps.
* speculators eagle3: ``speculators_model_type: "eagle3"`` with ``transformer_layer_config``; the
  same tensors with ``layers.0.*`` for ``midlayer.*`` and optional ``input_norm`` / ``fc_norm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sonar_core.config import TargetInfo
from sonar_core.errors import ConfigError
from sonar_core.layers import DecoderLayerConfig, RopeConfig
from sonar_core.models.architectures import LAYER_FAMILIES, hf_config_from_dict, layer_config_for
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.layer_ids import check_layers, eagle3_default_layers, from_capture_ids
from sonar_eagle.layout_names import SAFEAILAB_EAGLE1, SAFEAILAB_EAGLE3, SPECULATORS_EAGLE3

# Tensors a checkpoint may carry that the head does not load (training-only, rotary tables).
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")


@dataclass(frozen=True)
class TargetShape:
    """The target's dimensions an EAGLE head must fit."""

    hidden_size: int
    num_layers: int
    vocab_size: int

    @classmethod
    def of(cls, target: TargetInfo) -> TargetShape:
        return cls(target.hidden_size or 0, target.num_layers or 0, target.vocab_size or 0)


@dataclass(frozen=True)
class EagleLayout:
    """Everything needed to build, check and load one EAGLE head."""

    method: str
    layout: str
    layer: DecoderLayerConfig
    num_layers: int
    rope: RopeConfig
    # Target states the head reads (Sonar's index); empty for EAGLE-1, which reads the final state.
    target_hidden_layers: tuple[int, ...]
    target_vocab_size: int
    draft_vocab_size: int
    # Width of each target state fc reads (target_hidden_size).
    target_hidden_size: int
    fc_bias: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    own_embedding: bool = False
    own_lm_head: bool = True
    # The depth the checkpoint was trained for (speculators), None when unknown.
    trained_depth: int | None = None

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.target_vocab_size

    def rename(self, name: str) -> str:
        """Checkpoint name -> the head's parameter name."""
        if name.startswith("midlayer."):
            return "layers.0." + name.removeprefix("midlayer.")
        if name.startswith("fusion_fc."):  # speculators' EAGLE-1 spelling
            return "fc." + name.removeprefix("fusion_fc.")
        return name

    @staticmethod
    def skipped(name: str) -> bool:
        """Tensors a checkpoint may carry that the head does not load (training-only ones, rotary
        tables)."""
        return name in TRAINING_ONLY or name.endswith("rotary_emb.inv_freq")


def read_layout(checkpoint: DraftCheckpoint, method: str, target: TargetShape) -> EagleLayout:
    """The layout of ``checkpoint`` for ``method`` (``eagle`` or ``eagle3``), checked against the
    target; a ConfigError on ``speculative_config.model`` naming the checkpoint and the fix."""
    speculators = checkpoint.speculators
    if speculators is not None:
        if method != "eagle3" or speculators.model_type != "eagle3":
            raise ConfigError(
                FIELD,
                f"{checkpoint.describe()} is a speculators {speculators.model_type!r} checkpoint, not one for "
                f"method {method!r}",
                f'use "method": "{speculators.model_type}" for it, or a draft trained for {method}',
            )
        layer_dict = dict(speculators.transformer_layer_config)
        options = speculators.raw
        layout = SPECULATORS_EAGLE3
    else:
        layer_dict = dict(checkpoint.config)
        options = checkpoint.config
        layout = SAFEAILAB_EAGLE3 if method == "eagle3" else SAFEAILAB_EAGLE1
        _check_generation(checkpoint, method)
    layer_dict.setdefault("model_type", "llama")
    if layer_dict["model_type"] not in LAYER_FAMILIES:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} describes draft layers of model_type {layer_dict['model_type']!r}",
            f"EAGLE heads here have {', '.join(LAYER_FAMILIES)} layers; check the supported-model table "
            "(`aphrodite plugins --models`)",
        )
    try:
        hf_config = hf_config_from_dict(layer_dict)
        layer = layer_config_for(hf_config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            FIELD, f"{checkpoint.describe()} describes its draft layers in a config that cannot be read: {exc}",
            "repair the draft's config.json (or transformer_layer_config)",
        ) from None
    vocab_size = int(layer_dict.get("vocab_size") or target.vocab_size)
    _check_against_target(checkpoint, layer, vocab_size, options, target)
    common = dict(
        method=method,
        layout=layout,
        layer=layer,
        num_layers=int(hf_config.num_hidden_layers),
        rope=RopeConfig.from_hf_config(hf_config, layer.head_dim),
        target_vocab_size=vocab_size,
        own_embedding="embed_tokens.weight" in checkpoint.shapes,
    )
    if method == "eagle":
        return EagleLayout(
            **common,
            target_hidden_layers=(),
            draft_vocab_size=vocab_size,
            target_hidden_size=target.hidden_size,
            # SafeAILab's loader: a missing "bias" key means fc has a bias.
            fc_bias=bool(options.get("bias", True)),
            own_lm_head=False,
        )
    draft_vocab_size = int(options.get("draft_vocab_size") or vocab_size)
    target_hidden_size = int(options.get("target_hidden_size") or layer.hidden_size)
    return EagleLayout(
        **common,
        target_hidden_layers=_aux_layers(checkpoint, options, target, target_hidden_size),
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_hidden_size,
        # speculators always writes the key; vLLM reads a missing one as True.
        norm_before_residual=bool(options.get("norm_before_residual", layout == SPECULATORS_EAGLE3)),
        norm_output=bool(options.get("norm_output", False)),
        norm_before_fc=bool(options.get("norm_before_fc", False)),
        fc_norm=bool(options.get("fc_norm", False)),
        own_lm_head="lm_head.weight" in checkpoint.shapes or draft_vocab_size != vocab_size,
        trained_depth=speculators.speculative_tokens if speculators is not None else None,
    )


def _check_generation(checkpoint: DraftCheckpoint, method: str) -> None:
    """An EAGLE-1 head given as eagle3, or the reverse, is named as such."""
    names = checkpoint.shapes
    eagle3_marks = any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in names) or "d2t" in names
    if method == "eagle" and eagle3_marks:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} is an EAGLE-3 head (midlayer / hidden_norm / d2t tensors)",
            'use "method": "eagle3" for it',
        )
    if method == "eagle3" and not eagle3_marks and "fc.weight" in names:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} is an EAGLE-1 head (no midlayer, hidden_norm or d2t tensors)",
            'use "method": "eagle" for it',
        )


def _check_against_target(
    checkpoint: DraftCheckpoint,
    layer: DecoderLayerConfig,
    vocab_size: int,
    options: Mapping[str, Any],
    target: TargetShape,
) -> None:
    """The draft must speak the target's vocabulary and read states of the target's width."""
    if vocab_size != target.vocab_size:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} has vocab_size {vocab_size}, the target {target.vocab_size}",
            "use an EAGLE head trained for this target (its vocab_size is the target's, even with a reduced "
            "draft vocabulary)",
        )
    width = int(options.get("target_hidden_size") or layer.hidden_size)
    if width != target.hidden_size:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} reads target hidden states of size {width}, but the target's hidden size "
            f"is {target.hidden_size}",
            "use an EAGLE head trained for this target; a head of another model size cannot read its states",
        )
    if layer.hidden_size != target.hidden_size and "embed_tokens.weight" not in checkpoint.shapes:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} has hidden size {layer.hidden_size}, the target {target.hidden_size}, and no "
            "embed_tokens of its own, so it cannot share the target's embedding",
            "use a head of the target's hidden size, or one that ships its own embed_tokens",
        )


def _aux_layers(
    checkpoint: DraftCheckpoint, options: Mapping[str, Any], target: TargetShape, target_hidden_size: int
) -> tuple[int, ...]:
    """The target states an EAGLE-3 head fuses: from the config, else EAGLE-3's default."""
    field = "eagle_aux_hidden_state_layer_ids"
    ids = options.get(field) or options.get("aux_hidden_state_layer_ids")
    layers = from_capture_ids(ids) if ids else eagle3_default_layers(target.num_layers)
    fc = checkpoint.shapes.get("fc.weight")
    if fc is not None and len(fc) == 2 and fc[1] != len(layers) * target_hidden_size:
        if ids or fc[1] % target_hidden_size:
            raise ConfigError(
                FIELD,
                f"{checkpoint.describe()}: fc.weight reads {fc[1]} values, not {len(layers)} target states of "
                f"{target_hidden_size} ({field} = {list(layers)})",
                f"list as many target layers in {field} as fc was trained on",
            )
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()}: fc.weight fuses {fc[1] // target_hidden_size} target states but the config "
            f"names none, and EAGLE-3's default is 3",
            f"add {field} (vLLM capture ids) to the draft's config.json",
        )
    return check_layers(layers, target.num_layers, FIELD, checkpoint.describe())
