"""The files ``extract_hidden_states`` writes: one safetensors file per request, and their reader.

A file holds one finished request:

============================  ==============================================================
tensor                        contents
============================  ==============================================================
``token_ids``                 ``[N]`` int64: the prompt, then every output token
``hidden_states``             ``[N-1, len(layer_ids), H]``: row ``t`` holds the target's states
                              at position ``t`` (Sonar's index: after ``k`` layers, raw)
``final_hidden_states``       ``[N-1, H]``: the final, post-norm state (the LM head's input),
                              when it was asked for
============================  ==============================================================

Row ``t`` is the state the target computed while reading ``token_ids[t]``; the state at position
``t`` predicts ``token_ids[t + 1]`` (the last token was sampled, never read, hence ``N - 1`` rows).
The metadata (strings) names the format and version, the request id, the prompt length, the
``layer_ids`` (JSON) and the model. Files appear whole or not at all: each is written under a
temporary name in the same folder and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "sonar-hidden-states"
VERSION = "1"
SUFFIX = ".safetensors"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class HiddenStateRecord:
    """One request's tokens and target hidden states."""

    request_id: str
    token_ids: torch.Tensor  # [N] int64
    prompt_length: int
    layer_ids: tuple[int, ...]  # Sonar's index (= vLLM capture ids)
    hidden_states: torch.Tensor | None  # [N-1, len(layer_ids), H]
    final_hidden_states: torch.Tensor | None  # [N-1, H]
    model: str = ""

    def layer(self, layer_id: int) -> torch.Tensor:
        """``[N-1, H]`` states of one layer id."""
        if self.hidden_states is None or layer_id not in self.layer_ids:
            raise KeyError(f"layer {layer_id} was not exported (exported: {self.layer_ids})")
        return self.hidden_states[:, self.layer_ids.index(layer_id)]


def file_name(request_id: str) -> str:
    """The file of a request: its id when that is a safe file name, else a safe form plus a hash."""
    safe = _SAFE_NAME.sub("_", request_id)[:120]
    if safe != request_id or safe.startswith("."):
        safe = f"{safe.lstrip('.')}-{hashlib.sha256(request_id.encode()).hexdigest()[:12]}"
    return safe + SUFFIX


def write_hidden_states(directory: Path, record: HiddenStateRecord) -> Path:
    """Write ``record`` to ``directory`` atomically; returns the file. Raises OSError (disk full,
    permissions) with no file of that name left behind, complete or partial."""
    directory = Path(directory)
    target = directory / file_name(record.request_id)
    partial = directory / f".{target.name}.{os.getpid()}.partial"
    tensors = {"token_ids": record.token_ids.to(torch.int64).contiguous()}
    if record.hidden_states is not None:
        tensors["hidden_states"] = record.hidden_states.contiguous()
    if record.final_hidden_states is not None:
        tensors["final_hidden_states"] = record.final_hidden_states.contiguous()
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "request_id": record.request_id,
        "prompt_length": str(record.prompt_length),
        "layer_ids": json.dumps(list(record.layer_ids)),
        "model": record.model,
    }
    try:
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return target


def checked_metadata(path: Path, f: Any) -> dict[str, str]:
    """The metadata of the open file ``f`` (``safe_open``), checked to be this format and version;
    ValueError otherwise. For readers that take only part of a file (the trainer's headers)."""
    metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file (format {metadata.get('format')!r})")
    if metadata.get("version") != VERSION:
        raise ValueError(f"{path} has {FORMAT} version {metadata.get('version')!r}; this reader reads {VERSION}")
    return metadata


def read_hidden_states(path: Path) -> HiddenStateRecord:
    """Read one exported file; ValueError when it is not one."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = checked_metadata(path, f)
        names = set(f.keys())
        return HiddenStateRecord(
            request_id=metadata["request_id"],
            token_ids=f.get_tensor("token_ids"),
            prompt_length=int(metadata["prompt_length"]),
            layer_ids=tuple(json.loads(metadata["layer_ids"])),
            hidden_states=f.get_tensor("hidden_states") if "hidden_states" in names else None,
            final_hidden_states=f.get_tensor("final_hidden_states") if "final_hidden_states" in names else None,
            model=metadata.get("model", ""),
        )


def iter_hidden_state_files(directory: Path) -> Iterator[HiddenStateRecord]:
    """Every exported file of ``directory``, in file-name order (temporary files are skipped)."""
    for path in sorted(Path(directory).glob(f"*{SUFFIX}")):
        if not path.name.startswith("."):
            yield read_hidden_states(path)
