"""Repository ids resolve like every peer engine's: the local Hugging Face cache, else a download.

Every test talks to a fake hub on 127.0.0.1 (sonar_core.testing.fake_hub) through the real
``huggingface_hub`` client, with a cache of its own: downloads of a target, a draft and an EAGLE
head by id, revisions, offline mode, unknown and gated repositories, dropped and failing
transfers, and the configuration check that fetches configs only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants, file_download
from safetensors.torch import load_file, save_file

from sonar_core import hub as sonar_hub
from sonar_core.config import target_info_for, validate_config
from sonar_core.errors import ConfigError
from sonar_core.hub import CHECKPOINT, CONFIG, FileSet, HubError, cached_snapshot, is_repo_id, select_files
from sonar_core.model_files import resolve_model_path
from sonar_core.models.loader import load_model
from sonar_core.plugins import get_plugin_manager
from sonar_core.testing.checkpoints import CheckpointFactory
from sonar_core.testing.eagle_heads import build_eagle_head
from sonar_core.testing.fake_hub import FakeHub, client_environment, point_client_at
from sonar_core.testing.losslessness import greedy_outputs, random_prompts

TARGET = "sonar-tests/tiny-llama"
DRAFT = "sonar-tests/tiny-llama-draft"
HEAD = "sonar-tests/tiny-llama-eagle3"
TOKEN = "hf_test_token_4f1c2a"
APHRODITE = Path(sys.executable).parent / "aphrodite"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A fake hub that this process's client talks to, with a cache of this test; Sonar's retries
    and the client's waits between attempts take no time."""
    with FakeHub() as hub:
        point_client_at(hub, monkeypatch, tmp_path / "hf-cache")
        monkeypatch.setattr(sonar_hub, "RETRY_DELAY_S", 0.0)
        monkeypatch.setattr(file_download.time, "sleep", lambda seconds: None)
        yield hub


@pytest.fixture(scope="module")
def target_dir(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("llama", num_layers=4)


@pytest.fixture
def published(tmp_path: Path, target_dir: Path) -> Path:
    """The target as a repository publishes it: its files plus what Sonar must not fetch (Python
    code, a sub-folder, a training file)."""
    folder = tmp_path / "published"
    shutil.copytree(target_dir, folder)
    (folder / "modeling_tiny.py").write_text("raise SystemExit('repository code ran')\n")
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.pth").write_bytes(b"\0" * 64)
    (folder / "training_args.bin").write_bytes(b"\0" * 16)
    return folder


def _snapshot_files(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def _full_weight_gets(hub: FakeHub) -> list[str]:
    """Paths of GETs that transferred a whole weight file (a header read asks for a range)."""
    return [e.path for e in hub.exchanges if e.method == "GET" and e.path.endswith(".safetensors")
            and "range" not in e.headers]


def test_repository_ids_are_told_from_paths():
    assert is_repo_id("Qwen/Qwen3-8B") and is_repo_id("gpt2")
    assert not any(map(is_repo_id, ["/tmp/model", "./model", "~/model", "a/b/c", "bad name/x"]))


def test_only_the_files_sonar_loads_are_selected():
    listing = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "consolidated.safetensors",
               "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "modeling_x.py",
               "original/params.json", "README.md"]
    assert select_files(listing, CONFIG, "o/r") == ["config.json", "generation_config.json",
                                                    "model.safetensors.index.json"]
    checkpoint = select_files(listing, CHECKPOINT, "o/r")
    assert "consolidated.safetensors" not in checkpoint and "pytorch_model.bin" not in checkpoint
    assert {"model-00001-of-00002.safetensors", "tokenizer.json"} <= set(checkpoint)
    assert not any(name.endswith(".py") or "/" in name for name in checkpoint)
    assert "modeling_x.py" in select_files(listing, FileSet(tokenizer=True, code=True), "o/r")
    bins = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "training.bin"]
    assert select_files(bins, CHECKPOINT, "o/r")[1:] == bins[1:3]
    assert select_files(["model-Q4.gguf", "README.md"], CONFIG, "o/r") == ["model-Q4.gguf"]


def test_a_repository_without_loadable_weights_names_what_it_holds():
    with pytest.raises(HubError, match="has no weights Sonar can load .*README.md"):
        select_files(["config.json", "README.md", "flax_model.msgpack"], CHECKPOINT, "o/r")
    with pytest.raises(HubError, match="holds 2 GGUF files .*`hf download o/r FILE.gguf`"):
        select_files(["a-Q4.gguf", "a-Q8.gguf"], CHECKPOINT, "o/r")


def test_a_target_and_its_draft_download_by_id_and_decode_as_from_their_folders(
    hub: FakeHub, published: Path, checkpoints: CheckpointFactory, target_dir: Path
):
    hub.add_repo(TARGET, published)
    hub.add_repo(DRAFT, checkpoints.truncated_draft(target_dir, num_layers=1))
    prompts = random_prompts(3, seed=1, vocab=500)
    plain, _ = greedy_outputs(target_dir, prompts, max_tokens=12)
    speculative = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}
    from_hub, llm = greedy_outputs(TARGET, prompts, speculative, max_tokens=12)
    assert from_hub == plain
    assert llm.engine.model_name == TARGET
    snapshot = resolve_model_path(TARGET)
    assert _snapshot_files(snapshot) == {path.name for path in target_dir.iterdir()}
    assert not (snapshot / "modeling_tiny.py").exists() and not (snapshot / "original").exists()


def test_a_cached_repository_starts_without_a_request_even_offline(
    hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch
):
    hub.add_repo(TARGET, published)
    first = resolve_model_path(TARGET)
    hub.clear_requests()
    assert resolve_model_path(TARGET) == first
    validate_config({"model": TARGET}, get_plugin_manager(load_entry_points=False))
    assert hub.requests == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    load_model(TARGET, dtype=torch.float32, device="cpu")
    assert hub.requests == []


def test_a_revision_pins_a_branch_or_a_commit(hub: FakeHub, published: Path, tmp_path: Path):
    main_sha = hub.add_repo(TARGET, published)
    older = tmp_path / "older"
    shutil.copytree(published, older)
    config = json.loads((older / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (older / "config.json").write_text(json.dumps(config))
    v1_sha = hub.add_repo(TARGET, older, revision="v1")
    manager = get_plugin_manager(load_entry_points=False)
    assert target_info_for(TARGET).max_position_embeddings == 2048
    assert target_info_for(TARGET, revision="v1").max_position_embeddings == 512
    assert target_info_for(TARGET, revision=v1_sha).max_position_embeddings == 512
    assert target_info_for(TARGET, revision=main_sha).max_position_embeddings == 2048
    assert validate_config({"model": TARGET, "revision": "v1"}, manager).engine.max_model_len == 512
    with pytest.raises(ConfigError) as info:
        validate_config({"model": TARGET, "revision": "v9"}, manager)
    assert info.value.field == "revision" and "'v9' does not exist" in info.value.message


def test_a_draft_revision_is_its_own(hub: FakeHub, published: Path):
    hub.add_repo(TARGET, published)
    hub.add_repo(DRAFT, published, revision="v1")
    manager = get_plugin_manager()
    speculative = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError) as info:  # the draft has no default branch: only v1
        validate_config({"model": TARGET, "speculative_config": speculative}, manager)
    assert info.value.field == "speculative_config.revision"
    resolved = validate_config({"model": TARGET, "speculative_config": {**speculative, "revision": "v1"}}, manager)
    assert Path(resolved.speculative.config.model).parent.parent.name == "models--sonar-tests--tiny-llama-draft"


def test_offline_and_not_cached_names_the_variable_and_the_download_command(
    hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch
):
    hub.add_repo(TARGET, published)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as info:
        validate_config({"model": TARGET, "revision": "v1"}, get_plugin_manager(load_entry_points=False))
    assert info.value.field == "model"
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in info.value.message
    assert f"hf download {TARGET} --revision v1" in info.value.fix
    assert hub.requests == []


def test_an_unknown_repository_is_a_config_error_on_its_field(hub: FakeHub, published: Path):
    hub.add_repo(TARGET, published)
    manager = get_plugin_manager()
    with pytest.raises(ConfigError) as info:
        validate_config({"model": "sonar-tests/missing"}, manager)
    assert info.value.field == "model" and "was not found on http://127.0.0.1" in info.value.message
    speculative = {"method": "draft_model", "model": "sonar-tests/missing-draft", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError) as info:
        validate_config({"model": TARGET, "speculative_config": speculative}, manager)
    assert info.value.field == "speculative_config.model"


def test_a_gated_repository_needs_a_token_and_never_prints_it(
    hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch
):
    hub.add_repo(TARGET, published, gated=True, token=TOKEN)
    manager = get_plugin_manager(load_entry_points=False)
    with pytest.raises(ConfigError, match="is gated and no token is set") as info:
        validate_config({"model": TARGET}, manager)
    assert "HF_TOKEN" in info.value.fix
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_9d8e")
    with pytest.raises(ConfigError, match="but it has no access") as info:
        validate_config({"model": TARGET}, manager)
    assert "hf_wrong_token_9d8e" not in str(info.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert validate_config({"model": TARGET}, manager).target.vocab_size == 512
    assert (resolve_model_path(TARGET) / "model.safetensors").is_file()


def test_a_dropped_transfer_resumes_where_it_stopped(
    hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch
):
    hub.add_repo(TARGET, published)
    # The client writes in chunks of DOWNLOAD_CHUNK_SIZE; smaller chunks keep what arrived.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.interrupt(TARGET, "model.safetensors", after_bytes=4096)
    snapshot = resolve_model_path(TARGET)
    assert load_file(snapshot / "model.safetensors").keys() == load_file(published / "model.safetensors").keys()
    resumed = [e for e in hub.exchanges if e.path.endswith("/model.safetensors") and e.status == 206]
    assert resumed and resumed[0].headers["range"] == "bytes=4096-"


def test_a_network_that_keeps_failing_leaves_no_snapshot_taken_for_complete(
    hub: FakeHub, published: Path, monkeypatch: pytest.MonkeyPatch
):
    hub.add_repo(TARGET, published)
    hub.interrupt(TARGET, "model.safetensors", after_bytes=100, times=1000)
    with pytest.raises(HubError, match="failed .*start again") as info:
        resolve_model_path(TARGET)
    assert "RemoteProtocolError" in info.value.problem or "ReadError" in info.value.problem
    assert cached_snapshot(TARGET, None, CHECKPOINT) is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="forbids downloading"):
        resolve_model_path(TARGET)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.interrupt(TARGET, "model.safetensors", after_bytes=100, times=0)
    hub.clear_requests()
    snapshot = resolve_model_path(TARGET)
    assert (snapshot / "model.safetensors").is_file()
    assert not [e for e in hub.exchanges if e.method == "GET" and e.path.endswith("/config.json")]


def test_the_config_check_fetches_configs_and_tensor_headers_only(
    hub: FakeHub, published: Path, target_dir: Path, tmp_path: Path
):
    hub.add_repo(TARGET, published)
    good = build_eagle_head(target_dir, tmp_path / "head", method="eagle3", aux_layers=[0, 1, 2])
    hub.add_repo(HEAD, good)
    bad = tmp_path / "bad-head"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    hub.add_repo(HEAD, bad, revision="broken")
    manager = get_plugin_manager()
    speculative = {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="fc.weight") as info:
        validate_config({"model": TARGET, "speculative_config": {**speculative, "revision": "broken"}}, manager)
    assert info.value.field == "speculative_config.model"
    validate_config({"model": TARGET, "speculative_config": speculative}, manager)
    assert _full_weight_gets(hub) == []
    prompts = random_prompts(2, seed=2, vocab=500)
    plain, _ = greedy_outputs(target_dir, prompts, max_tokens=10)
    drafted, _ = greedy_outputs(TARGET, prompts, speculative, max_tokens=10)
    assert drafted == plain
    assert len(_full_weight_gets(hub)) == 2  # the target's and the head's, once each


def test_aphrodite_check_config_resolves_ids_without_weights(
    hub: FakeHub, published: Path, checkpoints: CheckpointFactory, target_dir: Path, tmp_path: Path
):
    hub.add_repo(TARGET, published)
    hub.add_repo(DRAFT, checkpoints.truncated_draft(target_dir, num_layers=1))
    speculative = json.dumps({"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3})
    environ = client_environment(hub, tmp_path / "unused")
    del environ["HF_HUB_CACHE"]  # the cache follows HF_HOME, as in every huggingface_hub tool
    environ["HF_HOME"] = str(tmp_path / "hf-home")
    result = subprocess.run(
        [str(APHRODITE), "serve", TARGET, "--speculative-config", speculative, "--check-config"],
        env=environ, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Configuration is valid." in result.stdout
    snapshots = list((tmp_path / "hf-home" / "hub").glob("models--*/snapshots/*"))
    assert len(snapshots) == 2
    assert [path.name for folder in snapshots for path in folder.iterdir() if path.suffix == ".safetensors"] == []
    assert _full_weight_gets(hub) == []


def test_a_repository_without_weights_fails_at_load_with_its_listing(hub: FakeHub, published: Path, tmp_path: Path):
    configs_only = tmp_path / "configs-only"
    configs_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(published / name, configs_only / name)
    hub.add_repo(TARGET, configs_only)
    with pytest.raises(ConfigError, match="has no weights Sonar can load") as info:
        load_model(TARGET, dtype=torch.float32, device="cpu")
    assert info.value.field == "model"


def test_a_tokenizer_with_repository_code_needs_trust_remote_code(hub: FakeHub, published: Path, tmp_path: Path):
    custom = tmp_path / "custom-tokenizer"
    shutil.copytree(published, custom)
    tokenizer_config = json.loads((custom / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "TinyTokenizer"  # a class transformers does not have
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyTokenizer"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (custom / "tokenization_tiny.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\nclass TinyTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    hub.add_repo(TARGET, custom)
    from aphrodite import LLM

    with pytest.raises(ConfigError) as info:
        LLM(model=TARGET, dtype="float32", device="cpu")
    assert info.value.field == "trust_remote_code" and "--trust-remote-code" in info.value.fix
    assert not (resolve_model_path(TARGET) / "tokenization_tiny.py").exists()
    assert (resolve_model_path(TARGET, files=FileSet(tokenizer=True, code=True)) / "tokenization_tiny.py").is_file()


def test_a_tokenizer_named_by_id_replaces_the_models_own(hub: FakeHub, published: Path, target_dir: Path):
    hub.add_repo("sonar-tests/tokenizer", published, revision="v2")
    from aphrodite import LLM

    llm = LLM(model=str(target_dir), tokenizer="sonar-tests/tokenizer", tokenizer_revision="v2",
              dtype="float32", device="cpu")
    assert llm.get_tokenizer().get_vocab() == LLM(model=str(target_dir), dtype="float32", device="cpu") \
        .get_tokenizer().get_vocab()
    assert not list(Path(constants.HF_HUB_CACHE).glob("models--*/snapshots/*/*.safetensors"))
    manager = get_plugin_manager(load_entry_points=False)
    for fields, field in (({"tokenizer": "sonar-tests/missing"}, "tokenizer"),
                          ({"tokenizer": "sonar-tests/tokenizer", "tokenizer_revision": "v9"}, "tokenizer_revision")):
        with pytest.raises(ConfigError) as info:
            validate_config({"model": str(target_dir), **fields}, manager)
        assert info.value.field == field
