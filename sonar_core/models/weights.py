"""Reading checkpoint tensors (safetensors, or ``.bin`` without pickle code) and loading them by name.

:func:`iter_checkpoint` streams ``(name, tensor)`` pairs from a Hugging Face model folder.
:func:`load_named_weights` copies such pairs into a module strictly, mapping checkpoint names onto
fused parameters; models and draft heads use it so that every loader reports missing and
unexpected tensors the same way.

Block-scaled FP8 checkpoints (see :mod:`sonar_core.config.quantization`) are dequantized here, in
the readers: :func:`iter_checkpoint` yields each ``X.weight`` already dequantized and never a
``*_scale_inv`` tensor, and :func:`checkpoint_shapes` reports the unquantized layout. Everything
that reads a checkpoint folder (the target model, proposers whose weights sit inside the target's
checkpoint, draft checkpoints) therefore sees one layout whatever the folder's quantization.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sonar_core.config.quantization import SCALE_SUFFIX, BlockFP8, checkpoint_quantization
from sonar_core.errors import ConfigError
from sonar_core.hub import CHECKPOINT, complete_snapshot, lacks_files, remote_tensor_shapes

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
    old shard, a draft head) are not mixed in. A Hugging Face cache snapshot that a configuration
    check fetched without its weights gets them here, from the same commit.
    """
    model_dir = complete_snapshot(Path(model_dir), CHECKPOINT)
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


def checkpoint_scheme(model_dir: Path) -> BlockFP8 | None:
    """The quantization the folder's config.json declares for its weights (None when unquantized
    or when the folder has no config.json); :class:`CheckpointError` for one Sonar cannot read
    (configuration checks refuse those earlier, naming the key)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        return None
    try:
        return checkpoint_quantization(config, source=str(config_file))
    except ConfigError as exc:
        raise CheckpointError(f"{exc.message.rstrip('.')}. Fix: {exc.fix}") from None


def _open(path: Path, stack: ExitStack) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """The tensor names of a weight file and a reader of one tensor by name, open until ``stack``
    closes (safetensors reads each tensor only when asked; ``.bin`` files are memory-mapped)."""
    if path.suffix == ".safetensors":
        handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return list(handle.keys()), handle.get_tensor
    # weights_only=True refuses pickled code: a .bin can then only hold tensors.
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return list(state), state.__getitem__


def iter_checkpoint(
    model_dir: Path, include: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the ``(name, tensor)`` pairs of a model folder, one file at a time (CPU tensors).

    ``include`` selects names; safetensors files never read the tensors it leaves out. In a
    block-scaled FP8 checkpoint each quantized ``X.weight`` is yielded dequantized, in float32
    (the model's copy rounds it once to its own dtype), and its ``X.weight_scale_inv`` is not
    yielded nor offered to ``include``.
    """
    model_dir = Path(model_dir)
    scheme = checkpoint_scheme(model_dir)
    files = weight_files(model_dir)
    if scheme is not None:
        yield from _iter_block_fp8(files, scheme, include)
        return
    for path in files:
        with ExitStack() as stack:
            names, read = _open(path, stack)
            yield from ((name, read(name)) for name in names if include is None or include(name))


def _iter_block_fp8(
    files: list[Path], scheme: BlockFP8, include: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_checkpoint` of a block-scaled FP8 checkpoint.

    Every file stays open for the whole pass (headers and memory maps only), so a weight's scale
    is read from whichever shard holds it, before or after the weight's own: one weight is held
    and dequantized at a time, never the checkpoint.
    """
    with ExitStack() as stack:
        shards = {path: _open(path, stack) for path in files}
        names = {name: path for path, (in_file, _) in shards.items() for name in in_file}
        _check_scales_have_weights(names)
        for in_file, read in shards.values():
            for name in in_file:
                if name.endswith(SCALE_SUFFIX) or (include is not None and not include(name)):
                    continue
                tensor = read(name)
                scale_name = name + SCALE_SUFFIX
                if scale_name in names:
                    tensor = dequantize_block_fp8(name, tensor, shards[names[scale_name]][1](scale_name), scheme)
                elif tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:  # a float8 format
                    raise CheckpointError(
                        f"{name} is stored as {tensor.dtype} but the checkpoint has no {scale_name} to "
                        "dequantize it; re-export the checkpoint with its scales"
                    )
                yield name, tensor


def _check_scales_have_weights(names: Iterable[str]) -> None:
    names = set(names)
    orphans = [n for n in names if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in names]
    if orphans:
        raise CheckpointError(f"scales without the tensor they scale ({len(orphans)}): {_listing(orphans)}")


def _scale_grid(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], scheme: BlockFP8) -> None:
    """``name`` (``[out, in]``) and its scale must agree: one scale per block, the last block of a
    row or column cut short when the dimension is not a multiple of the block (ragged edges)."""
    rows, cols = scheme.block_size
    if len(shape) != 2:
        raise CheckpointError(f"{name}: a block-scaled weight must be 2-D, not of shape {list(shape)}")
    grid = (-(-shape[0] // rows), -(-shape[1] // cols))
    if tuple(scale_shape) != grid:
        raise CheckpointError(
            f"{name}{SCALE_SUFFIX}: shape {list(scale_shape)} does not tile {name} {list(shape)} in blocks of "
            f"{[rows, cols]} (weight_block_size); expected {list(grid)}"
        )


def dequantize_block_fp8(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, scheme: BlockFP8) -> torch.Tensor:
    """``weight`` (float8_e4m3fn ``[out, in]``) times its block's scale, computed in float32.

    Each scale multiplies a ``block_size`` tile; expanding the grid and cutting it to the weight's
    shape handles ragged edge tiles. Peak memory is two float32 copies of this one weight.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(
            f"{name} has a {name}{SCALE_SUFFIX} but is stored as {weight.dtype}; block-scaled FP8 weights "
            "are float8_e4m3fn (fmt e4m3)"
        )
    if not scale_inv.dtype.is_floating_point:
        raise CheckpointError(f"{name}{SCALE_SUFFIX} is stored as {scale_inv.dtype}; scales are floating point")
    _scale_grid(name, tuple(weight.shape), tuple(scale_inv.shape), scheme)
    rows, cols = scheme.block_size
    out, inp = weight.shape
    scale = scale_inv.to(torch.float32).repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return weight.to(torch.float32).mul_(scale)


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a model folder with its shape, read from the file headers only for
    safetensors (configuration checks use it to find missing or misshapen tensors before loading).
    For a Hub snapshot whose weights are not downloaded yet, the headers are read on the Hub.

    A block-scaled FP8 checkpoint is described as :func:`iter_checkpoint` yields it: without its
    scale tensors, each of which must tile its weight.
    """
    scheme = checkpoint_scheme(model_dir)
    remote = remote_tensor_shapes(model_dir) if lacks_files(model_dir, CHECKPOINT) else None
    shapes = remote if remote is not None else _stored_shapes(model_dir)
    if scheme is None:
        return shapes
    _check_scales_have_weights(shapes)
    for name in [n for n in shapes if n.endswith(SCALE_SUFFIX)]:
        weight = name[: -len(SCALE_SUFFIX)]
        _scale_grid(weight, shapes[weight], shapes.pop(name), scheme)
    return shapes


def _stored_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
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
