"""What a start keeps from earlier ones so as not to import transformers' model registry: the
resolved model config (``hf_config_cache``) and the tokenizer class (``tokenizer_class_cache``)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from sonar_core import cpu_kernels
from sonar_core.models import hf_config_cache, tokenizer_class_cache
from sonar_core.models.architectures import hf_config_from_dict, layer_config_for
from sonar_core.models.hf_config_cache import is_rebuilt, read_hf_config
from sonar_core.models.loader import load_model, load_tokenizer
from sonar_core.models.tokenizer_snapshot import SnapshotTokenizer
from sonar_core.testing.checkpoints import ARCHITECTURES

# Families whose transformers config class adds nothing a rebuild from its values loses; the others
# add attribute aliases (DeepSeek-V3), class-level settings (Qwen3-Next), derived properties
# (Gemma 4's text config) or sub-configs (Gemma 4), and keep being read by AutoConfig.
REBUILT_FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture
def fresh_copy(checkpoints, tmp_path: Path):
    """A copy of a tiny checkpoint at a path of this test, so that no earlier read of it has left
    cache entries (they are keyed by the files' paths)."""

    def copy(arch: str = "llama", **kwargs: object) -> Path:
        folder = tmp_path / arch
        shutil.copytree(checkpoints.get(arch, **kwargs), folder)
        return folder

    return copy


def _data_attributes(config: object) -> dict[str, object]:
    return {name: value for name, value in vars(config).items() if not callable(value)}


def _reads_like(cached: object, real: object) -> bool:
    """Whether every data attribute of ``real`` reads the same on ``cached``."""
    return all(getattr(cached, name) == value for name, value in _data_attributes(real).items())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_config_read_again_has_every_value_transformers_gives(fresh_copy, arch):
    folder = fresh_copy(arch)
    first, second = read_hf_config(folder), read_hf_config(folder)
    real = AutoConfig.from_pretrained(folder)
    assert not is_rebuilt(first)
    assert is_rebuilt(second) == (arch in REBUILT_FAMILIES)
    if is_rebuilt(second):
        assert _reads_like(second, real)
        assert second.get_text_config(decoder=True) is second
        assert _data_attributes(second.transformers_config) == _data_attributes(real)
    else:
        assert type(second) is type(real)
    assert hf_config_cache.entry_path(folder).is_file() == (arch in REBUILT_FAMILIES)


def test_a_rebuilt_config_builds_the_same_model(fresh_copy, paged_runner):
    folder = fresh_copy("qwen3", num_layers=2)
    real = load_model(folder, torch.float32, "cpu")
    cached = load_model(folder, torch.float32, "cpu")
    assert not is_rebuilt(real.hf_config) and is_rebuilt(cached.hf_config)
    assert (cached.max_model_len, cached.eos_token_ids) == (real.max_model_len, real.eos_token_ids)
    tokens = [3, 17, 5, 99, 42, 7]
    ours, _ = paged_runner(cached.model).step({"a": tokens})
    theirs, _ = paged_runner(real.model).step({"a": tokens})
    assert torch.equal(ours["a"], theirs["a"])


def test_an_edited_config_is_read_again(fresh_copy):
    folder = fresh_copy()
    read_hf_config(folder)
    assert read_hf_config(folder).rms_norm_eps == 1e-6
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}, indent=1))
    edited = read_hf_config(folder)
    assert not is_rebuilt(edited) and edited.rms_norm_eps == 1e-5
    assert read_hf_config(folder).rms_norm_eps == 1e-5


def test_a_config_class_that_overrides_a_method_is_not_cached(checkpoints):
    from transformers import LlamaConfig

    class Overriding(LlamaConfig):
        def get_text_config(self, *args, **kwargs):
            return self

    config = Overriding.from_pretrained(checkpoints.get("llama"))
    assert hf_config_cache.cache_entry(config) is None
    assert hf_config_cache.cache_entry(LlamaConfig.from_pretrained(checkpoints.get("llama"))) is not None


def test_a_recorded_tokenizer_class_loads_the_same_tokenizer(fresh_copy):
    """The second load is a snapshot (no transformers); what it does not answer itself, its
    transformers tokenizer does, loaded through the recorded class."""
    folder = fresh_copy()
    first, second = load_tokenizer(folder), load_tokenizer(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    entry = json.loads(tokenizer_class_cache.entry_path(folder).read_text())
    assert entry["direct"] == {"module": type(reference).__module__, "name": type(reference).__name__}
    assert entry["snapshot"] is not None
    assert type(first) is type(reference) and isinstance(second, SnapshotTokenizer)
    text = "the quick brown fox <|im_end|> jumps"
    for tokenizer in (first, second):
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer(text).input_ids == reference(text).input_ids
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.eos_token_id == reference.eos_token_id
    assert type(second.full_tokenizer) is type(reference)


def test_a_tokenizer_without_a_class_of_its_own_is_loaded_by_auto_tokenizer(fresh_copy):
    """Without tokenizer_class, AutoTokenizer picks by the config's class: the family's config is
    read for it, and nothing is recorded when the class is a model family's own."""
    folder = fresh_copy()
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    read_hf_config(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    loads = [load_tokenizer(folder) for _ in range(2)]
    assert type(loads[0]) is type(reference) and isinstance(loads[1], SnapshotTokenizer)
    for tokenizer in loads:
        assert tokenizer("a b c").input_ids == reference("a b c").input_ids
    assert type(loads[1].full_tokenizer) is type(reference)
    in_registry = type(reference).__module__.startswith("transformers.models.")
    entry = json.loads(tokenizer_class_cache.entry_path(folder).read_text())
    assert (entry["direct"] is None) == in_registry


def test_a_warm_start_does_not_import_transformers(checkpoints, tmp_path):
    """The point of both caches: the second engine start on a model, and what it does with the
    tokenizer while serving (encode, decode, render a chat), imports neither transformers nor
    torch.distributed.tensor (nor sympy, which allocating a model from the meta device through
    ``to_empty`` would)."""
    folder = checkpoints.get("llama")
    probe = (
        "import sys; from sonar_core.models.loader import load_model, load_tokenizer; import torch; "
        f"loaded = load_model({str(folder)!r}, torch.float32, 'cpu'); tokenizer = load_tokenizer(loaded); "
        "ids = tokenizer.encode(tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)); "
        "tokenizer.decode(ids, skip_special_tokens=True); "
        "print(sorted(m for m in ('transformers', 'torch.distributed.tensor', 'sympy') if m in sys.modules))"
    )
    env = {**os.environ, "SONAR_CACHE_DIR": str(tmp_path / "cache"), cpu_kernels.ENV_SWITCH: "0"}
    runs = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
        for _ in range(2)
    ]
    assert runs[0].stdout.strip() != "[]", runs[0].stderr  # the first start reads through AutoConfig
    assert runs[1].stdout.strip() == "[]", runs[1].stderr


def test_entries_are_keyed_by_transformers_version(fresh_copy, monkeypatch):
    folder = fresh_copy()
    read_hf_config(folder)
    load_tokenizer(folder)
    written = hf_config_cache.entry_path(folder), tokenizer_class_cache.entry_path(folder)
    for module in (hf_config_cache, tokenizer_class_cache):
        monkeypatch.setattr(module, "version", lambda package: "0.0-other")
    assert hf_config_cache.entry_path(folder) != written[0]
    assert tokenizer_class_cache.entry_path(folder) != written[1]
    assert not is_rebuilt(read_hf_config(folder))


def test_a_cached_config_answers_without_transformers_until_asked_for_more(fresh_copy):
    """Data reads come from the entry; a name the config lacks fails at once (``getattr`` with a
    default is how model code probes options); a base-class property or method is the rebuild's."""
    folder = fresh_copy("qwen3")
    real = read_hf_config(folder)
    cached = read_hf_config(folder)
    assert type(cached) is hf_config_cache.CachedConfig
    assert (cached.hidden_size, cached.rope_parameters) == (real.hidden_size, real.rope_parameters)
    assert getattr(cached, "no_such_option", "default") == "default"
    assert cached._sonar_rebuilt is None  # nothing so far needed transformers
    assert cached.num_labels == real.num_labels  # a base-class property
    assert cached._sonar_rebuilt is not None
    copy = pickle.loads(pickle.dumps(read_hf_config(folder)))
    assert copy.hidden_size == real.hidden_size and copy.get_text_config() is copy


def test_a_layer_config_made_from_a_dictionary_is_kept_too(tmp_path, monkeypatch):
    """Draft heads describe their layers in a dictionary (speculators' ``transformer_layer_config``):
    the config transformers makes of it is kept like a checkpoint's, keyed by the values."""
    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path))
    values = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 300,
    }
    first, second = hf_config_from_dict(values), hf_config_from_dict(values)
    assert not is_rebuilt(first) and is_rebuilt(second)
    assert layer_config_for(second) == layer_config_for(first)
    assert not is_rebuilt(hf_config_from_dict({**values, "vocab_size": 301}))
