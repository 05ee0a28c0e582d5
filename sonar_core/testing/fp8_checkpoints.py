"""Block-scaled FP8 copies of checkpoints, in the layout DeepSeek-V3 and Qwen3-FP8 are published in.

Tests of FP8 loading need FP8 checkpoints, and the hub has none offline. :func:`write_fp8_checkpoint`
quantizes an unquantized folder the way those releases were made: each linear weight ``X.weight``
(``[out, in]``) is cut into ``weight_block_size`` tiles, each tile scaled so that its largest
magnitude becomes 448 (the largest ``float8_e4m3fn`` value) and rounded to ``float8_e4m3fn``, and
the tile's ``amax / 448`` is stored in ``X.weight_scale_inv`` (float32, one per tile, edge tiles
cut short). Embedding tables and the modules of ``modules_to_not_convert`` (``lm_head`` by
default) stay unquantized, as do 1-D tensors (norms, biases). A checkpoint with MTP or other draft
layers inside is quantized the same way, name by name.

``dequantized_dir`` also writes the float32 folder holding exactly the values the FP8 copy
represents, computed here tile by tile independently of Sonar's loader: loading either folder must
give the same model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from sonar_core.config.quantization import SCALE_SUFFIX
from sonar_core.models.weights import BIN_INDEX, BIN_SINGLE, SAFETENSORS_INDEX, iter_checkpoint, weight_files

FP8_E4M3_MAX = 448.0
# Modules whose weights are looked up rather than multiplied: never quantized (unless listed in a
# checkpoint's modules_to_convert, which this writer does not produce).
_EMBEDDINGS = ("embed_tokens",)
_WEIGHT_FILES = {SAFETENSORS_INDEX, BIN_INDEX, BIN_SINGLE, "config.json"}


def _tiles(matrix: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """``matrix`` zero-padded to whole blocks, viewed as ``[grid_rows, rows, grid_cols, cols]``."""
    rows, cols = block_size
    out, inp = matrix.shape
    grid = (-(-out // rows), -(-inp // cols))
    padded = matrix.new_zeros(grid[0] * rows, grid[1] * cols)
    padded[:out, :inp] = matrix
    return padded.view(grid[0], rows, grid[1], cols)


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale_inv)`` of a 2-D weight, one scale per block."""
    out, inp = weight.shape
    tiles = _tiles(weight.to(torch.float32), block_size)
    amax = tiles.abs().amax(dim=(1, 3))
    # An all-zero tile keeps a tiny positive scale, so that dividing by it gives zeros, not NaN.
    scale_inv = (amax / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    quantized = scaled.to(torch.float8_e4m3fn).reshape(tiles.shape[0] * tiles.shape[1], -1)[:out, :inp]
    return quantized.contiguous(), scale_inv


def dequantize_reference(quantized: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """The float32 values a quantized weight stands for: each tile times its scale."""
    out, inp = quantized.shape
    tiles = _tiles(quantized.to(torch.float32), block_size) * scale_inv[:, None, :, None]
    return tiles.reshape(tiles.shape[0] * tiles.shape[1], -1)[:out, :inp].contiguous()


def _matches(module: str, patterns: Sequence[str]) -> bool:
    """transformers' rule for modules_to_not_convert: the module itself, one under it, or a suffix."""
    return any(module == p or module.startswith(p + ".") or module.endswith("." + p) for p in patterns)


def is_quantized(name: str, tensor: torch.Tensor, modules_to_not_convert: Sequence[str]) -> bool:
    """Whether the writer quantizes checkpoint tensor ``name``: 2-D linear weights not skipped."""
    module, _, leaf = name.rpartition(".")
    return (
        leaf == "weight"
        and tensor.ndim == 2
        and not module.endswith(_EMBEDDINGS)
        and not _matches(module, modules_to_not_convert)
    )


def _save(tensors: dict[str, torch.Tensor], folder: Path, num_shards: int) -> None:
    """Save as one file or as ``num_shards`` shards with an index. Shards take the sorted names in
    turn, so a weight and its scale (adjacent names) always land in different shards."""
    names = sorted(tensors)
    if num_shards == 1:
        save_file({n: tensors[n] for n in names}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {name: files[i % num_shards] for i, name in enumerate(names)}
    for file in files:
        shard = {n: tensors[n] for n in names if weight_map[n] == file}
        save_file(shard, str(folder / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _copy_folder(source_dir: Path, out_dir: Path, config: dict) -> None:
    """``out_dir`` with the source's files other than weights and config, and ``config``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = _WEIGHT_FILES | {p.name for p in weight_files(source_dir)}
    for item in source_dir.iterdir():
        if item.is_file() and item.name not in skip:
            shutil.copy2(item, out_dir / item.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_fp8_checkpoint(
    source_dir: Path,
    out_dir: Path,
    *,
    block_size: tuple[int, int] = (128, 128),
    modules_to_not_convert: Sequence[str] = ("lm_head",),
    num_shards: int = 1,
    dequantized_dir: Path | None = None,
) -> Path:
    """Write the block-scaled FP8 copy of the unquantized checkpoint ``source_dir`` to ``out_dir``.

    Tokenizer and other files are copied; config.json gains the ``quantization_config`` of the
    published releases. ``num_shards`` above 1 writes a sharded checkpoint whose weights and scales
    sit in different shards. ``dequantized_dir``, when given, receives the float32 checkpoint of the
    dequantized values (see the module docstring). Returns ``out_dir``.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = json.loads((source_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{source_dir} is already quantized ({config['quantization_config']})")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint(source_dir):
        tensor = tensor.contiguous()
        if is_quantized(name, tensor, modules_to_not_convert):
            weight, scale_inv = quantize_block_fp8(tensor, block_size)
            quantized[name], quantized[name + SCALE_SUFFIX] = weight, scale_inv
            dequantized[name] = dequantize_reference(weight, scale_inv, block_size)
        else:
            quantized[name] = dequantized[name] = tensor
    fp8_config = {
        **config,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block_size),
            "modules_to_not_convert": list(modules_to_not_convert),
        },
    }
    _copy_folder(source_dir, out_dir, fp8_config)
    _save(quantized, out_dir, num_shards)
    if dequantized_dir is not None:
        dequantized_dir = Path(dequantized_dir)
        _copy_folder(source_dir, dequantized_dir, config)
        _save(dequantized, dequantized_dir, 1)
    return out_dir
