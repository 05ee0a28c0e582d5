"""A draft checkpoint (EAGLE head, MTP assistant, DFlash block model, ...) as plugins read it.

:meth:`DraftCheckpoint.open` resolves the name the way the target's is resolved (a folder, or a
Hugging Face repository id with its config files only) and reads its config and its tensors' names
and shapes from the file headers (on the Hub when the weights are not downloaded yet), without
loading weights; :meth:`DraftCheckpoint.tensors` fetches the weights when it first needs them. Configuration checks
compare that layout with what the method's head expects (:meth:`check_layout`), so a missing,
unexpected or misshapen tensor fails at ``--check-config`` with every problem listed, and a
checkpoint that passed loads whole or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sonar_core.errors import ConfigError
from sonar_core.hub import CONFIG, HubError
from sonar_core.model_files import resolve_model_path
from sonar_core.models.weights import CheckpointError, checkpoint_shapes, iter_checkpoint
from sonar_core.spec_decode.speculators_format import SpeculatorsConfig

FIELD = "speculative_config.model"
_LISTED = 12


@dataclass
class DraftCheckpoint:
    """A draft checkpoint's folder, config and tensor layout."""

    name: str
    path: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    speculators: SpeculatorsConfig | None = field(default=None)
    # Draft weights stored inside another checkpoint (the target's) under this name prefix; names
    # in ``shapes`` and from :meth:`tensors` are given without it.
    prefix: str = ""

    @classmethod
    def open(cls, model: str) -> DraftCheckpoint:
        """Read ``model``'s config.json and tensor headers; a ConfigError on ``speculative_config.model``
        when the folder, its config or its weights cannot be read."""
        try:
            path = Path(resolve_model_path(model, files=CONFIG))
        except HubError as exc:
            raise ConfigError(FIELD, exc.problem, exc.fix) from None
        except (OSError, ValueError) as exc:
            raise ConfigError(FIELD, str(exc), "pass the draft checkpoint's local folder") from None
        if path.is_file() or not (path / "config.json").is_file():
            raise ConfigError(
                FIELD, f"{str(path)!r} is not a folder with config.json", "pass the draft checkpoint's folder"
            )
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(FIELD, f"{path / 'config.json'} cannot be read ({exc})", "repair the file") from None
        try:
            shapes = checkpoint_shapes(path)
        except (CheckpointError, OSError, RuntimeError) as exc:
            raise ConfigError(FIELD, f"the weights of {path} cannot be read: {exc}", "repair or re-export the checkpoint") from None
        return cls(model, path, config, shapes, SpeculatorsConfig.from_config(config))

    @classmethod
    def embedded(cls, folder: Path, config_key: str | None, prefix: str) -> DraftCheckpoint | None:
        """The draft a target checkpoint embeds: its config is the target's ``config_key`` entry
        over the target's own fields (``None``: the target's config itself, as for MTP layers),
        its tensors those under ``prefix``; None when it embeds none."""
        folder = Path(folder)
        try:
            target_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        draft_config = {} if config_key is None else target_config.get(config_key)
        if not isinstance(draft_config, dict):
            return None
        base = {key: value for key, value in target_config.items() if key not in (config_key, "architectures", "auto_map")}
        shapes = {name[len(prefix):]: shape for name, shape in checkpoint_shapes(folder).items() if name.startswith(prefix)}
        return cls(str(folder), folder, {**base, **draft_config}, shapes, None, prefix)

    def describe(self) -> str:
        if self.prefix:
            return f"the draft weights under {self.prefix!r} in {str(self.path)!r}"
        return f"the draft checkpoint {str(self.path)!r}"

    def check_layout(
        self,
        expected: Mapping[str, tuple[int, ...]],
        rename: Callable[[str], str] = lambda name: name,
        optional: frozenset[str] = frozenset(),
        ignored: Callable[[str], bool] = lambda name: False,
    ) -> None:
        """Compare the checkpoint's tensors (names after ``rename``) with ``expected`` shapes.

        ``optional`` names may be absent; ``ignored`` names may be present and are not loaded
        (training-only tensors). Raises one ConfigError listing every missing, unexpected and
        misshapen tensor.
        """
        found = {rename(name): shape for name, shape in self.shapes.items() if not ignored(name)}
        missing = sorted(set(expected) - set(found) - optional)
        unexpected = sorted(set(found) - set(expected))
        misshapen = [
            f"{name} {list(found[name])} (expected {list(expected[name])})"
            for name in sorted(set(found) & set(expected))
            if tuple(found[name]) != tuple(expected[name])
        ]
        problems = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", misshapen)):
            if names:
                shown = ", ".join(names[:_LISTED]) + (f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")
                problems.append(f"{label} ({len(names)}): {shown}")
        if problems:
            raise ConfigError(
                FIELD,
                f"{self.describe()} does not match the layout its config describes: " + "; ".join(problems),
                "use a checkpoint written in a published layout for this method (see docs/hidden-states.md), "
                "or re-export it; a config that does not belong to its weights is the usual cause",
            )

    def tensors(self, rename: Callable[[str], str] = lambda name: name, include: Callable[[str], bool] | None = None,
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(renamed name, tensor)`` pairs (CPU tensors)."""
        prefix = self.prefix

        def selected(name: str) -> bool:
            return name.startswith(prefix) and (include is None or include(name[len(prefix):]))

        for name, tensor in iter_checkpoint(self.path, include=selected):
            yield rename(name[len(prefix):]), tensor
