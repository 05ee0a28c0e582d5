"""Block-scaled FP8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 layout) load, dequantized by the readers.

Oracles: (a) an FP8 folder loads exactly as the float32 folder of its dequantized values (computed
tile by tile by the test kit's writer, independently of the loader); (b) transformers' own FP8
path, which on the CPU dequantizes at load, gives the same weights and logits; (c) the logits stay
within the quantization error of the unquantized model's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sonar_core.config import validate_config
from sonar_core.config.quantization import BlockFP8
from sonar_core.errors import ConfigError
from sonar_core.models.loader import load_model
from sonar_core.models.weights import (
    CheckpointError,
    checkpoint_shapes,
    claimed_by,
    dequantize_block_fp8,
    iter_checkpoint,
)
from sonar_core.plugins import get_plugin_manager
from sonar_core.testing.fp8_checkpoints import write_fp8_checkpoint

APHRODITE = Path(sys.executable).parent / "aphrodite"
PROMPT = [4, 8, 15, 16, 23, 42, 99, 7, 300, 12]
# qwen3: blocks of 32 rows by 24 columns over hidden size 64 and intermediate size 80 leave ragged
# edge tiles on both axes, and a block that is not square catches rows and columns swapped; llama:
# blocks of 16 tile every weight exactly (transformers needs that, see
# test_transformers_fp8_path_agrees) and layer 1's MLP is listed in modules_to_not_convert.
CASES = {
    "qwen3": dict(source={"intermediate_size": 80}, block_size=(32, 24), modules_to_not_convert=("lm_head",)),
    "llama": dict(source={}, block_size=(16, 16), modules_to_not_convert=("lm_head", "model.layers.1.mlp")),
}


@pytest.fixture(scope="module")
def folders(checkpoints, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per architecture: the unquantized source, its FP8 copy and the dequantized float32 folder."""
    root = tmp_path_factory.mktemp("fp8")
    built = {}
    for arch, case in CASES.items():
        source = checkpoints.get(arch, **case["source"])
        fp8 = write_fp8_checkpoint(
            source, root / f"{arch}-fp8", block_size=case["block_size"],
            modules_to_not_convert=case["modules_to_not_convert"], dequantized_dir=root / f"{arch}-dequantized",
        )
        built[arch] = {"source": source, "fp8": fp8, "dequantized": root / f"{arch}-dequantized"}
    return built


def logits_of(folder: Path, runner, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    logits, _ = runner(load_model(folder, dtype, "cpu").model).step({"a": PROMPT})
    return logits["a"]


def stored(folder: Path) -> dict[str, torch.dtype]:
    """The dtype of every tensor as the files store it."""
    dtypes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return dtypes


@pytest.mark.parametrize("arch", list(CASES))
def test_fp8_checkpoint_loads_as_its_dequantized_weights(folders, arch, paged_runner):
    fp8, dequantized = folders[arch]["fp8"], folders[arch]["dequantized"]
    dtypes = stored(fp8)
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.mlp.down_proj.weight_scale_inv"] == "F32"
    a = load_model(fp8, torch.float32, "cpu").model.state_dict()
    b = load_model(dequantized, torch.float32, "cpu").model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (logits_of(fp8, paged_runner) - logits_of(dequantized, paged_runner)).abs().max().item() <= 1e-5


def test_ragged_edge_blocks_and_skipped_modules_are_covered(folders):
    qwen3 = checkpoint_shapes(folders["qwen3"]["fp8"])
    rows, cols = CASES["qwen3"]["block_size"]
    assert qwen3["model.layers.0.mlp.up_proj.weight"][0] % rows != 0
    assert qwen3["model.layers.0.mlp.down_proj.weight"][1] % cols != 0
    assert rows != cols
    llama = stored(folders["llama"]["fp8"])
    assert llama["model.layers.1.mlp.down_proj.weight"] == "F32"
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in llama
    assert llama["model.layers.1.self_attn.o_proj.weight"] == "F8_E4M3"
    assert llama["lm_head.weight"] == llama["model.embed_tokens.weight"] == "F32"


def test_bfloat16_load_rounds_the_dequantized_weights_once(folders):
    a = load_model(folders["qwen3"]["fp8"], torch.bfloat16, "cpu").model.state_dict()
    b = load_model(folders["qwen3"]["dequantized"], torch.bfloat16, "cpu").model.state_dict()
    assert all(a[name].dtype == torch.bfloat16 and torch.equal(a[name], b[name]) for name in a)


def test_every_weight_is_within_half_an_fp8_step_of_the_original(folders):
    # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, and a
    # subnormal one (below 2^-6 after scaling) by at most 2^-10 of its tile's scale (amax / 448).
    fp8, source = folders["qwen3"]["fp8"], folders["qwen3"]["source"]
    scaled = {name.removesuffix("_scale_inv") for name in stored(fp8) if name.endswith("_scale_inv")}
    original = dict(iter_checkpoint(source))
    checked = 0
    for name, loaded in iter_checkpoint(fp8):
        weight = original[name]
        if name not in scaled:
            assert torch.equal(loaded, weight), name
            continue
        bound = weight.abs() / 16 + weight.abs().max() / 448 / 1024 + 1e-6 * weight.abs()
        assert ((loaded - weight).abs() <= bound).all(), name
        assert not torch.equal(loaded, weight), name
        checked += 1
    assert checked == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers


@pytest.mark.parametrize("arch", list(CASES))
def test_logits_move_as_much_as_random_noise_of_the_same_size(folders, arch, paged_runner):
    # These tiny random models (weights of std 0.3) amplify any weight error several-fold, so the
    # logits' tolerance is calibrated on the model itself: multiplicative random noise with the
    # relative RMS of each tensor's FP8 error must move the logits about as much (measured ratio
    # 0.9-1.1). A wrong scale, a transposed tile grid or a misplaced edge tile moves them by far more.
    original_model = load_model(folders[arch]["source"], torch.float32, "cpu").model
    quantized = logits_of(folders[arch]["fp8"], paged_runner)
    original = paged_runner(original_model).step({"a": PROMPT})[0]["a"]
    generator = torch.Generator().manual_seed(0)
    fp8_weights = load_model(folders[arch]["fp8"], torch.float32, "cpu").model.state_dict()
    with torch.no_grad():
        for name, param in original_model.state_dict().items():
            nonzero = param != 0
            relative = ((fp8_weights[name] - param)[nonzero] / param[nonzero]).pow(2).mean().sqrt()
            param.mul_(1 + relative * torch.randn(param.shape, generator=generator))
    noisy = paged_runner(original_model).step({"a": PROMPT})[0]["a"]
    ratio = ((quantized - original).norm() / (noisy - original).norm()).item()
    assert 0.5 < ratio < 2, ratio
    assert 0 < ((quantized - original).norm() / original.norm()).item() < 0.25


def test_transformers_fp8_path_agrees(folders, hf_reference, paged_runner):
    # transformers 5.24 dequantizes FP8 checkpoints at load on a machine without a GPU (no kernel
    # package needed). It infers the block size from the scale grid, so it refuses ragged edge
    # tiles ("not divisible by scale grid"): this oracle uses the llama case, tiled exactly.
    fp8 = folders["llama"]["fp8"]
    with torch.no_grad():
        reference = hf_reference(fp8)(torch.tensor([PROMPT])).logits[0]
    assert (logits_of(fp8, paged_runner) - reference).abs().max().item() < 1e-4


def test_readers_see_the_unquantized_layout(folders):
    source, fp8 = folders["qwen3"]["source"], folders["qwen3"]["fp8"]
    assert checkpoint_shapes(fp8) == checkpoint_shapes(source)
    offered = []

    def include(name: str) -> bool:
        offered.append(name)
        return name.startswith("model.layers.1.")

    streamed = dict(iter_checkpoint(fp8, include=include))
    assert sorted(offered) == sorted(checkpoint_shapes(source))
    assert set(streamed) == {name for name in offered if name.startswith("model.layers.1.")}
    assert all(tensor.dtype == torch.float32 for tensor in streamed.values())


def test_sharded_fp8_checkpoint_with_weights_and_scales_in_different_shards(folders, tmp_path):
    source = folders["qwen3"]["source"]
    sharded = write_fp8_checkpoint(
        source, tmp_path / "sharded", block_size=CASES["qwen3"]["block_size"], num_shards=3
    )
    shard_of = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [name for name in shard_of if name.endswith("_scale_inv")]
    later = [s for s in scales if shard_of[s] > shard_of[s.removesuffix("_scale_inv")]]
    earlier = [s for s in scales if shard_of[s] < shard_of[s.removesuffix("_scale_inv")]]
    assert later and earlier and len(later) + len(earlier) == len(scales)
    a = load_model(sharded, torch.float32, "cpu").model.state_dict()
    b = load_model(folders["qwen3"]["fp8"], torch.float32, "cpu").model.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert checkpoint_shapes(sharded) == checkpoint_shapes(source)


def test_draft_weights_inside_an_fp8_target_inherit_its_quantization(folders, tmp_path):
    # MTP layers and embedded heads are read from the target's folder under a claimed prefix.
    source = folders["qwen3"]["source"]
    with_draft = tmp_path / "with-draft"
    shutil.copytree(source, with_draft)
    tensors = load_file(with_draft / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    tensors["mtp.eh_proj.weight"] = torch.randn(64, 128, generator=generator)
    tensors["mtp.norm.weight"] = torch.ones(64)
    save_file(tensors, str(with_draft / "model.safetensors"))
    fp8 = write_fp8_checkpoint(
        with_draft, tmp_path / "fp8", block_size=CASES["qwen3"]["block_size"], dequantized_dir=tmp_path / "dequantized"
    )
    assert stored(fp8)["mtp.eh_proj.weight"] == "F8_E4M3"
    claimed = claimed_by(("mtp.",))
    draft = dict(iter_checkpoint(fp8, include=claimed))
    expected = dict(iter_checkpoint(tmp_path / "dequantized", include=claimed))
    assert draft.keys() == expected.keys() == {"mtp.eh_proj.weight", "mtp.norm.weight"}
    assert all(torch.equal(draft[name], expected[name]) for name in draft)
    assert checkpoint_shapes(fp8)["mtp.eh_proj.weight"] == (64, 128)
    target = load_model(fp8, torch.float32, "cpu", claimed_prefixes=("mtp.",)).model.state_dict()
    reference = load_model(folders["qwen3"]["dequantized"], torch.float32, "cpu").model.state_dict()
    assert all(torch.equal(target[name], reference[name]) for name in reference)


def test_dequantization_of_ragged_tiles_by_hand():
    weight = torch.tensor([[1, -2, 0.5, 4, -8], [0.25, 3, -1, 2, 6], [-4, 1.5, 0.75, -3, 1]]).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0, 4.0], [0.5, 8.0, 0.25]])
    out = dequantize_block_fp8("w", weight, scales, BlockFP8((2, 2)))
    for row in range(3):
        for col in range(5):
            assert out[row, col] == weight[row, col].float() * scales[row // 2, col // 2]
    # Power-of-two scales stored as float8_e8m0fnu (scale_fmt "ue8m0") dequantize alike.
    assert torch.equal(dequantize_block_fp8("w", weight, scales.to(torch.float8_e8m0fnu), BlockFP8((2, 2))), out)


def test_inconsistent_fp8_checkpoints_are_refused_by_name(folders, tmp_path):
    fp8 = folders["qwen3"]["fp8"]
    tensors = load_file(fp8 / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    for broken, expected in (
        ({name + "_scale_inv": tensors[name + "_scale_inv"][:1]}, f"{name}_scale_inv: shape"),
        ({name + "_scale_inv": None}, f"{name} is stored as torch.float8_e4m3fn but the checkpoint has no"),
        ({name: None}, f"scales without the tensor they scale (1): {name}_scale_inv"),
    ):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text((fp8 / "config.json").read_text())
        changed = {k: v for k, v in {**tensors, **broken}.items() if v is not None}
        save_file(changed, str(folder / "model.safetensors"))
        with pytest.raises(CheckpointError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            list(iter_checkpoint(folder))


UNSUPPORTED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quantization_config.quant_method is 'awq'"),
    "per-tensor fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization_config.weight_block_size is not set"),
    "static activations": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        "quantization_config.activation_scheme is 'static'",
    ),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "quantization_config.fmt is 'e5m2'"),
    "bad block": ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size is [128]"),
}


def quantized_config_folder(source: Path, folder: Path, quantization: dict) -> Path:
    """config.json of ``source`` with ``quantization`` and no weights: the check must not need them."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return folder


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_quantization_fails_the_configuration_check(folders, tmp_path, case):
    quantization, expected = UNSUPPORTED[case]
    folder = quantized_config_folder(folders["qwen3"]["source"], tmp_path / "model", quantization)
    with pytest.raises(ConfigError) as error:
        validate_config({"model": str(folder)}, get_plugin_manager(load_entry_points=False))
    assert error.value.field == "model"
    assert expected in error.value.message
    assert "block-scaled FP8" in error.value.message and "unquantized release" in error.value.fix
    with pytest.raises(CheckpointError, match="Fix: use the model's unquantized release"):
        checkpoint_shapes(folder)


def aphrodite(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", "SONAR_PLUGINS": "custom_class"}
    return subprocess.run([str(APHRODITE), *args], capture_output=True, text=True, env=environ, timeout=300)


def test_check_config_passes_fp8_and_refuses_other_quantizations(folders, tmp_path):
    assert aphrodite("serve", str(folders["llama"]["fp8"]), "--check-config").returncode == 0
    folder = quantized_config_folder(folders["llama"]["source"], tmp_path / "awq", UNSUPPORTED["awq"][0])
    result = aphrodite("serve", str(folder), "--check-config")
    assert result.returncode == 2, result.stderr
    assert "quantization_config.quant_method is 'awq'" in result.stderr and "Traceback" not in result.stderr


def test_llm_generates_from_an_fp8_checkpoint(folders):
    from aphrodite import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for kind in ("fp8", "dequantized"):
        llm = LLM(model=str(folders["qwen3"][kind]), dtype="float32", device="cpu", kv_cache_memory_gb=0.05)
        outputs[kind] = [o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "def add"], params)]
    assert all(len(ids) == 8 for ids in outputs["fp8"])
    assert outputs["fp8"] == outputs["dequantized"]
