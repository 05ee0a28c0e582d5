"""The ``speculators`` checkpoint format (vllm-project/speculators): its config, read once for all methods.

A speculators config is recognised by its top-level ``speculators_model_type`` (``eagle3``,
``dflash``, ``dspark``, ``mtp``, ...). Its draft layers are described by ``transformer_layer_config``
(a full Llama / Qwen3 config whose ``vocab_size`` is the target's), its training setup by
``speculators_config`` (``proposal_methods[0].speculative_tokens``: the depth it was trained for;
``verifier``: the target it was trained against).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from sonar_core.config import TargetInfo

# The quantization tag GGUF file names end with (Q4_1, Q4_K_M, IQ3_XS, F16, BF16, ...).
_GGUF_QUANT = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class SpeculatorsConfig:
    """The fields of a speculators config that every method reads."""

    model_type: str
    architectures: tuple[str, ...]
    transformer_layer_config: Mapping[str, Any]
    draft_vocab_size: int | None
    # proposal_methods[0].speculative_tokens: the draft depth the checkpoint was trained for.
    speculative_tokens: int | None
    verifier_name: str | None
    verifier_architectures: tuple[str, ...]
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SpeculatorsConfig | None:
        """The speculators view of a config.json dict, or None when it is not in that format."""
        model_type = config.get("speculators_model_type")
        if not isinstance(model_type, str) or not model_type:
            return None
        spec = config.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        depth = methods[0].get("speculative_tokens") if isinstance(methods[0], Mapping) else None
        return cls(
            model_type=model_type,
            architectures=tuple(config.get("architectures") or ()),
            transformer_layer_config=dict(config.get("transformer_layer_config") or {}),
            draft_vocab_size=config.get("draft_vocab_size"),
            speculative_tokens=depth if isinstance(depth, int) and depth > 0 else None,
            verifier_name=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            raw=dict(config),
        )

    def verifier_mismatch(self, target: TargetInfo) -> str | None:
        """Why the target may not be the verifier this draft was trained for (None when nothing
        says so). Matching names are not proof either: a pair must have been trained together."""
        reasons = []
        if self.verifier_architectures and target.architectures and not (
            set(self.verifier_architectures) & set(target.architectures)
        ):
            reasons.append(
                f"its verifier's architectures are {list(self.verifier_architectures)}, the target's "
                f"{list(target.architectures)}"
            )
        target_name = checkpoint_name(target.source)
        if self.verifier_name and target_name and _short(self.verifier_name) != _short(target_name):
            reasons.append(f"it names the verifier {self.verifier_name!r}, the target is {target_name!r}")
        return "; ".join(reasons) or None


def checkpoint_name(source: str) -> str:
    """A checkpoint's name from the path of its config: the folder, or ``org/name`` for a folder of
    the Hugging Face cache (``models--org--name/snapshots/<hash>``)."""
    if not source:
        return ""
    path = PurePath(source)
    if path.suffix == ".gguf":  # "SmolLM2-135M-Instruct.Q4_1.gguf" is SmolLM2-135M-Instruct
        return _GGUF_QUANT.sub("", path.stem)
    folder = path.parent if path.name == "config.json" else path
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return folder.name


def _short(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()
