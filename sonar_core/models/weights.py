"""Reading checkpoint tensors (safetensors, or ``.bin`` without pickle code) and loading them by name.

:func:`iter_checkpoint` streams ``(name, tensor)`` pairs from a Hugging Face model folder.
:func:`load_named_weights` copies such pairs into a module strictly, mapping checkpoint names onto
fused parameters; models and draft heads use it so that every loader reports missing and
unexpected tensors the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# name of a checkpoint module -> (fused module, first row, end row), matched on the name's tail.
FusedMap = dict[str, tuple[str, int, int]]


class CheckpointError(ValueError):
    """A checkpoint folder has no weights, or its tensors do not fit the model."""


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model folder, safetensors preferred over ``.bin``.

    Sharded checkpoints are read through their index file so that stray files in the folder (an
    old shard, a draft head) are not mixed in.
    """
    model_dir = Path(model_dir)
    for index_name, single_name, pattern in (
        (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "*.safetensors"),
        (BIN_INDEX, BIN_SINGLE, "*.bin"),
    ):
        index = model_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (model_dir / s).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shards that are not in the folder: {', '.join(missing)}")
            return [model_dir / s for s in shards]
        if (model_dir / single_name).is_file():
            return [model_dir / single_name]
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    # A lone state dict saved with torch.save (FasterDecoding's medusa_lm_head.pt).
    state_dicts = sorted(model_dir.glob("*.pt"))
    if len(state_dicts) == 1:
        return state_dicts
    raise CheckpointError(
        f"no weights in {model_dir}: expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX} with its shards, "
        f"{BIN_SINGLE}, or one .pt state dict"
    )


def iter_checkpoint(
    model_dir: Path, include: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the ``(name, tensor)`` pairs of a model folder, one file at a time (CPU tensors).

    ``include`` selects names; safetensors files never read the tensors it leaves out.
    """
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if include is None or include(name):
                        yield name, f.get_tensor(name)
        else:
            # weights_only=True refuses pickled code: a .bin can then only hold tensors.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from ((name, t) for name, t in state.items() if include is None or include(name))


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a model folder with its shape, read from the file headers only for
    safetensors (configuration checks use it to find missing or misshapen tensors before loading)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({name: tuple(t.shape) for name, t in state.items()})
    return shapes


def claimed_by(prefixes: tuple[str, ...]) -> Callable[[str], bool]:
    """A predicate for tensor names under any of ``prefixes`` (``"mtp."`` claims ``mtp.fc.weight``)."""
    return lambda name: name.startswith(prefixes)


def _resolve(name: str, fused: FusedMap) -> tuple[str, tuple[int, int] | None]:
    """Parameter name and row range that the checkpoint tensor ``name`` fills."""
    module, _, leaf = name.rpartition(".")
    for source, (target, start, end) in fused.items():
        if module == source or module.endswith("." + source):
            return f"{module[: len(module) - len(source)]}{target}.{leaf}", (start, end)
    return name, None


def expected_checkpoint_names(module: nn.Module, fused: FusedMap) -> set[str]:
    """The checkpoint names that fill every parameter of ``module`` (fused ones split back)."""
    return set(expected_checkpoint_shapes(module, fused))


def expected_checkpoint_shapes(module: nn.Module, fused: FusedMap | None = None) -> dict[str, tuple[int, ...]]:
    """The checkpoint names that fill ``module``'s parameters, with the shape each must have.

    Works on a module built on the meta device, so a configuration check learns a head's exact
    layout without allocating it.
    """
    fused = fused or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in module.named_parameters():
        param_module, _, leaf = name.rpartition(".")
        pieces = [
            (source, start, end)
            for source, (target, start, end) in fused.items()
            if param_module == target or param_module.endswith("." + target)
        ]
        if not pieces:
            shapes[name] = tuple(param.shape)
            continue
        prefix = param_module[: len(param_module) - len(fused[pieces[0][0]][0])]
        for source, start, end in pieces:
            shapes[f"{prefix}{source}.{leaf}"] = (end - start, *param.shape[1:])
    return shapes


def _listing(names: Iterable[str], limit: int = 20) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


@torch.no_grad()
def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    fused: FusedMap | None = None,
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy checkpoint tensors into ``module``'s parameters (converting dtype and device), strictly.

    ``fused`` maps a checkpoint module (``"self_attn.q_proj"``) to the rows it fills in a fused
    parameter (``("self_attn.qkv_proj", 0, 576)``). ``ignore`` names tensors a checkpoint may carry
    that the module does not need (a tied ``lm_head.weight``, rotary buffers). Raises
    :class:`CheckpointError` listing every missing and unexpected name, or on a shape mismatch.
    """
    fused = fused or {}
    params = dict(module.named_parameters())
    expected = expected_checkpoint_names(module, fused)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name not in expected and ignore(name):
            continue
        target, rows = _resolve(name, fused)
        param = params.get(target)
        if param is None or name not in expected:
            unexpected.append(name)
            continue
        dest = param if rows is None else param.narrow(0, rows[0], rows[1] - rows[0])
        if dest.shape != tensor.shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add(name)
    missing = expected - loaded
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint ({len(missing)}): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected in the checkpoint ({len(unexpected)}): {_listing(unexpected)}")
        raise CheckpointError(f"weights do not match {type(module).__name__}: " + "; ".join(parts))
