"""Hook implementations of ``sonar-extract-hidden-states``: the ``extract_hidden_states`` method.

It is its own distribution, not part of sonar-eagle: it drafts nothing and loads no head, and it is
the data source of every learned method's training (EAGLE, Medusa, MLP speculator, DFlash), so it
installs without any of their code. The file format and its reader live in core
(:mod:`sonar_core.spec_decode.hidden_state_files`), so a trainer needs only sonar-core.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from sonar_core.errors import ConfigError
from sonar_core.plugins import MethodSpec, checkpoint_refused, hookimpl, one_hot_drafts_warning

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "extract_hidden_states"


class ExtractOptions(BaseModel):
    """The keys of ``extract_hidden_states`` beyond the core fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    output_dir: str = Field(min_length=1)
    """Folder the per-request files go to (created when missing)."""

    layer_ids: list[int] | None = None
    """Target states to export, as vLLM capture ids (Sonar's index: the state after k layers; 0 is
    the embeddings, the number of layers the last layer's raw output). Unset: EAGLE-3's (2, L/2, L-3)."""

    include_final: bool = True
    """Also export the final, post-norm state (the LM head's input; EAGLE-1, Medusa and MLP
    speculators train on it)."""


def _layers(options: ExtractOptions, num_layers: int) -> tuple[int, ...]:
    from sonar_core.spec_decode.layer_ids import check_layers, eagle3_default_layers, from_capture_ids

    if options.layer_ids is not None:
        layers = from_capture_ids(options.layer_ids)
    else:  # EAGLE-3's choice, once each (shallow targets repeat a layer in it)
        layers = tuple(dict.fromkeys(eagle3_default_layers(num_layers)))
    return check_layers(layers, num_layers, "layer_ids", "extract_hidden_states")


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    from sonar_extract_hidden_states.exporter import HiddenStateExporter

    options: ExtractOptions = context.method_options
    directory = Path(options.output_dir).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("speculative_config.output_dir", f"{str(directory)!r} cannot be created: {exc}",
                          "choose a folder you can write to") from None
    modules = context.target_modules
    return HiddenStateExporter(
        directory, _layers(options, modules.num_layers), options.include_final, str(context.target_model_dir or "")
    )


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="Export the target's hidden states per request (drafts nothing)",
            options_model=ExtractOptions,
        )
    )


@hookimpl
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """1, the value vLLM's configurations of this method carry; nothing is drafted either way."""
    return 1 if config.method == METHOD else None


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None, options: ExtractOptions | None
) -> list[str] | None:
    """The folder must be writable (or creatable) and the layers inside the target; the method loads
    no checkpoint and drafts nothing."""
    if config.method != METHOD:
        return None
    refused = checkpoint_refused(config, "no checkpoint (it exports the target's own hidden states)")
    if refused is not None:
        raise refused
    _check_writable(Path(options.output_dir).expanduser())
    if target is not None:
        _layers(options, target.num_layers or 0)
    warnings = []
    warning = one_hot_drafts_warning(config)
    if warning:
        warnings.append(warning)
    if (config.num_speculative_tokens or 1) > 1:
        warnings.append(
            f"speculative_config.num_speculative_tokens={config.num_speculative_tokens} has no effect: "
            "extract_hidden_states drafts nothing"
        )
    return warnings


def _check_writable(directory: Path) -> None:
    """Without creating anything: the folder is writable, or its nearest existing parent is."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = "set output_dir to a folder you can write to (it is created when missing)"
    if not existing.is_dir():
        raise ConfigError("output_dir", f"{str(existing)!r} exists and is not a folder", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == directory else f" (to create {str(directory)!r} in it)"
        raise ConfigError("output_dir", f"{str(existing)!r} is not writable{where}", fix)
