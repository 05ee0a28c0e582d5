"""Hook implementations of ``sonar-mtp``: the ``mtp`` method and its old model-family names.

MTP layers ship inside the target checkpoint (MiMo's ``model.mtp_layers.*``, DeepSeek-V3's
``model.layers.{L}.*``): with ``model`` unset, Sonar reads them from the target's own folder, through
the same readers as the target's weights (so they inherit its quantization), and shares the target's
embedding and LM head. Gemma 4 publishes them as a separate assistant checkpoint, which ``model``
names (:mod:`sonar_mtp.assistant`). Startup checks, each its own error: a target architecture without a
registered MTP implementation, a checkpoint without the expected MTP weights (the tensor prefix
looked for is named), a depth the checkpoint's layers cannot serve, and a ``model`` that is not an
MTP assistant (``model`` names an assistant; it never makes ``mtp`` a generic draft-model method).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sonar_core.errors import ConfigError
from sonar_core.plugins import MTP_LEGACY_METHOD_NAMES, DraftArchitecture, MethodSpec, hookimpl
from sonar_mtp.families import ASSISTANT_ARCHITECTURE, FAMILIES, MtpFamily, family_of

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import HeadSpec
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "mtp"
# Target architectures whose MTP layers come as a separate assistant checkpoint.
ASSISTANT_TARGETS = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")


class MtpOptions(BaseModel):
    """``mtp`` takes only core fields (``num_speculative_tokens``, ``draft_sample_method``,
    ``model`` for an assistant checkpoint); any other key is rejected."""

    model_config = ConfigDict(extra="forbid")


def _architecture(target: TargetInfo) -> str:
    return target.architectures[0] if target.architectures else "<none>"


def _checked_assistant(config: SpeculativeConfig, target: TargetInfo) -> tuple[DraftCheckpoint, HeadSpec]:
    """The assistant checkpoint ``model`` names, checked against the target without reading weights."""
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.spec_decode.head_loading import check_head_checkpoint
    from sonar_mtp.assistant import assistant_config, assistant_spec, check_fits_target

    if config.model is None:
        raise ConfigError(
            "model",
            f"the target ({_architecture(target)}) publishes its MTP layers as a separate assistant checkpoint, "
            "and none was given",
            'set "model" to the assistant checkpoint of this target (for example google/gemma-4-E4B-it-assistant '
            "for google/gemma-4-E4B-it)",
        )
    if target.checkpoint_folder is None:
        raise ConfigError("model", f"the target {target.source!r} is not a Hugging Face checkpoint folder",
                          "serve the target's Hugging Face checkpoint folder")
    checkpoint = DraftCheckpoint.open(config.model)
    assistant = assistant_config(checkpoint)
    check_fits_target(checkpoint, assistant, target.checkpoint_folder)
    spec = assistant_spec(assistant)
    check_head_checkpoint(checkpoint, spec)
    return checkpoint, spec


def _family(target: TargetInfo) -> MtpFamily:
    """The target's MTP family; a ConfigError when its architecture has none."""
    architecture = _architecture(target)
    family = family_of(architecture)
    if family is None:
        raise ConfigError(
            "speculative_config.method",
            f"the target architecture {architecture!r} has no registered MTP implementation "
            f"(supported: {', '.join(sorted(FAMILIES))}; {' and '.join(ASSISTANT_TARGETS)} with their assistant "
            "checkpoint in model)",
            "use a target whose checkpoint has MTP layers of a supported family, or another method "
            "(eagle3, draft_model, ngram)",
        )
    return family


def _refuse_model(config: SpeculativeConfig, family: MtpFamily) -> None:
    """``model`` names an MTP assistant; these families keep their layers in the target."""
    if config.model is None:
        return
    raise ConfigError(
        "model",
        f"the target ({family.architecture}) carries its MTP layers in its own checkpoint; for method "
        f"{config.method!r}, model names a separate MTP assistant checkpoint, which this family does not use. "
        "A separate draft language model is method 'draft_model', not 'mtp'",
        "remove model to use the target's MTP layers (or set method to draft_model for a draft language model)",
    )


def _mtp_checkpoint(folder: Path, family: MtpFamily, config: dict[str, Any]) -> tuple[DraftCheckpoint, int]:
    """The target's MTP tensors as a draft checkpoint, and the number of MTP layers; a ConfigError
    naming the tensor prefix looked for when the checkpoint lacks them."""
    from sonar_core.models.weights import checkpoint_shapes
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint

    declared = family.layer_count(config)
    if family.max_layers is not None and declared > family.max_layers:
        raise ConfigError(
            "model",
            f"the target checkpoint {str(folder)!r} declares num_nextn_predict_layers={declared}, and Sonar runs "
            f"{family.layout} with at most {family.max_layers} layer (every published checkpoint has one)",
            "use a checkpoint with one MTP layer, or another speculation method",
        )
    prefixes = family.prefixes(config)
    shapes = checkpoint_shapes(folder)
    missing = [prefix for prefix in prefixes if not any(name.startswith(prefix) for name in shapes)]
    if not prefixes or missing:
        looked_for = missing[0] if missing else family.layer_prefix(config, 0)
        raise ConfigError(
            "model",
            f"the target checkpoint {str(folder)!r} has no MTP weights under {looked_for!r} "
            f"(its config declares num_nextn_predict_layers={declared})",
            f"use the checkpoint that ships its MTP layers (tensors under {family.layer_prefix(config, 0)!r}), "
            "or another speculation method",
        )
    owned = {name: shape for name, shape in shapes.items() if family.module_name(name, prefixes) is not None}
    return DraftCheckpoint(str(folder), folder, config, owned), len(prefixes)


def _head_spec(folder: Path, family: MtpFamily, checkpoint: DraftCheckpoint, num_layers: int) -> HeadSpec:
    from sonar_core.models.loader import read_hf_config
    from sonar_core.spec_decode.head_loading import HeadSpec
    from sonar_mtp.heads import MtpHead

    _, hf_config = read_hf_config(folder)
    prefixes = family.prefixes(checkpoint.config)
    vocab_size = hf_config.vocab_size
    return HeadSpec(
        build=lambda modules: MtpHead(family, hf_config, num_layers, modules),
        fused=family.fused(hf_config),
        vocab_size=vocab_size,
        draft_vocab_size=vocab_size,
        rename=lambda name: family.module_name(name, prefixes) or name,
        skipped=lambda name: family.module_name(name, prefixes) is None,
    )


def _checked(target: TargetInfo) -> tuple[MtpFamily, DraftCheckpoint, HeadSpec, int]:
    """Everything the target's MTP layers need, checked without reading weights."""
    from sonar_core.spec_decode.head_loading import check_head_checkpoint

    family = _family(target)
    folder = target.checkpoint_folder
    if folder is None:
        raise ConfigError(
            "model",
            f"the target {target.source!r} is not a Hugging Face checkpoint folder; MTP layers load from the "
            "folder that ships them (GGUF files do not carry them)",
            "serve the target's Hugging Face checkpoint folder",
        )
    checkpoint, num_layers = _mtp_checkpoint(folder, family, dict(target.hf_config))
    spec = _head_spec(folder, family, checkpoint, num_layers)
    check_head_checkpoint(checkpoint, spec)
    return family, checkpoint, spec, num_layers


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    from sonar_core.config import TargetInfo
    from sonar_core.spec_decode.chain_proposer import ChainProposer, ChainStops
    from sonar_core.spec_decode.draft_sampling import DraftSampler
    from sonar_core.spec_decode.head_loading import load_head_checkpoint

    target = TargetInfo.from_model_dir(context.target_model_dir)
    stops = ChainStops.for_context(context)
    if _architecture(target) in ASSISTANT_TARGETS:
        from sonar_mtp.assistant import Gemma4AssistantProposer

        checkpoint, spec = _checked_assistant(context.speculative_config, target)
        head, vocab_map = load_head_checkpoint(checkpoint, spec, context.target_modules, context.dtype, context.device)
        return Gemma4AssistantProposer(head, DraftSampler.for_context(vocab_map, context), stops.alone)
    _, checkpoint, spec, _ = _checked(target)
    head, vocab_map = load_head_checkpoint(checkpoint, spec, context.target_modules, context.dtype, context.device)
    return ChainProposer(head, DraftSampler.for_context(vocab_map, context), stops)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            core_fields=frozenset({"attention_backend", "draft_tensor_parallel_size", "num_draft_branches", "draft_stop_confidence"}),
            create_proposer=create_proposer,
            description="Multi-token prediction layers shipped with the target checkpoint",
            options_model=MtpOptions,
            draft_architectures=(
                DraftArchitecture(
                    ASSISTANT_ARCHITECTURE, "Gemma 4 assistant",
                    "query-only Gemma 4 layers over the target's KV cache; for Gemma 4 targets only",
                    for_targets=ASSISTANT_TARGETS,
                ),
            ),
            target_architectures=tuple(
                DraftArchitecture(family.architecture, family.layout, family.notes) for family in FAMILIES.values()
            ),
        ),
        old_names=MTP_LEGACY_METHOD_NAMES,
    )


@hookimpl
def sonar_claim_target_tensors(config: SpeculativeConfig | None, target: TargetInfo) -> list[str] | None:
    """MTP layers are the proposer's, not the target's, whether or not mtp is asked for."""
    family = family_of(target.architectures[0]) if target.architectures else None
    return family.claims(dict(target.hf_config)) if family is not None else None


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """The checkpoint's prediction depth: its number of MTP layers (an assistant has none: it drafts
    any number from one position, so the configuration sets it)."""
    if config.method != METHOD or target is None or _architecture(target) in ASSISTANT_TARGETS:
        return None
    return _checked(target)[3]


@hookimpl
def sonar_validate_speculative_config(config: SpeculativeConfig, target: TargetInfo | None) -> list[str] | None:
    """A supported target family, its MTP weights present and of their shapes, no ``model`` for
    families that carry their layers, and a depth the layers can serve (reuse warns)."""
    if config.method != METHOD or target is None:
        return None
    if _architecture(target) in ASSISTANT_TARGETS:
        _checked_assistant(config, target)
        return None
    family = _family(target)
    _refuse_model(config, family)
    _, _, _, num_layers = _checked(target)
    depth = config.num_speculative_tokens
    if num_layers > 1 and depth > num_layers and depth % num_layers:
        raise ConfigError(
            "num_speculative_tokens",
            f"the target has {num_layers} MTP layers, used in turn; num_speculative_tokens={depth} is above that "
            "prediction depth and not a multiple of it",
            f"reduce num_speculative_tokens to the checkpoint prediction depth ({num_layers}), or use a multiple of it",
        )
    if depth > num_layers:
        layers = "its one MTP layer" if num_layers == 1 else f"its {num_layers} MTP layers"
        return [
            f"speculative_config.num_speculative_tokens={depth}: the target has {layers}, reused for "
            f"deeper positions; repeated use can lower acceptance at later positions"
        ]
    return None
