"""The test kit's tiny checkpoints: real layout, offline tokenizer, varied greedy text, caching."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from sonar_core.testing.checkpoints import (
    CHAT_TEMPLATE,
    CheckpointFactory,
    build_tiny_checkpoint,
    build_truncated_draft,
)


def test_tokenizer_loads_offline_with_specials_and_chat_template(checkpoints):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints.get("llama"), local_files_only=True)
    assert len(tokenizer) == 512
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = "The quick brown fox counts 12345 tokens!"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_every_model_id_decodes(checkpoints):
    from transformers import AutoTokenizer

    path = checkpoints.get("llama", vocab_size=2000)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(tokenizer) == 2000 == json.loads((path / "config.json").read_text())["vocab_size"]
    assert all(tokenizer.decode([i]) for i in range(3, 2000, 97))


def test_config_matches_the_request(checkpoints):
    path = checkpoints.get("qwen3", hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, head_dim=24)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    expected = {
        "hidden_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 24,
        "eos_token_id": 2,
    }
    assert expected.items() <= config.items()


def test_greedy_text_varies_between_prompts(checkpoints, hf_reference):
    model = hf_reference(checkpoints.get("qwen2"))
    outputs = set()
    for prompt in ([5, 6, 7], [100, 200, 300, 7], [42] * 5, [9, 300, 12, 400, 401]):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None)
        outputs.add(tuple(out[0, len(prompt) :].tolist()))
    assert len(outputs) == 4


def test_tokenizer_can_come_from_another_checkpoint(checkpoints):
    from transformers import AutoTokenizer

    donor = checkpoints.get("llama", vocab_size=300)
    path = checkpoints.get("qwen3", vocab_size=320, tokenizer=str(donor))
    assert AutoTokenizer.from_pretrained(path).get_vocab() == AutoTokenizer.from_pretrained(donor).get_vocab()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_checkpoint(path.parent / "too-small", "llama", vocab_size=299, tokenizer=str(donor))


def test_factory_builds_each_configuration_once(tmp_path):
    factory = CheckpointFactory(tmp_path)
    first = factory.get("llama", num_layers=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert factory.get("llama", num_layers=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert factory.get("llama", num_layers=1, seed=1) != first
    assert not list(tmp_path.glob("*.partial"))


def test_truncated_draft_holds_only_the_first_layers(checkpoints, tmp_path):
    target = checkpoints.get("qwen3", num_layers=3, sharded=True)
    draft = build_truncated_draft(target, tmp_path / "draft", 2)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 2
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        layers = {int(name.split(".")[2]) for name in f.keys() if name.startswith("model.layers.")}
    assert layers == {0, 1}
    assert (draft / "tokenizer.json").is_file() and not (draft / "model.safetensors.index.json").exists()
    with pytest.raises(ValueError, match="num_layers must be in 1..2"):
        build_truncated_draft(target, tmp_path / "bad", 3)


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        build_tiny_checkpoint(tmp_path, "gpt2")
