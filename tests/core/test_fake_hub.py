"""The fake Hub of the test kit (sonar_core.testing.fake_hub) works with the installed
huggingface_hub client: downloads, revisions, gated and missing repositories, dropped transfers
and safetensors header reads all go through the real client code, against 127.0.0.1 only."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import torch
from huggingface_hub import HfApi, constants, file_download, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder
from safetensors.torch import save_file

from sonar_core.testing.fake_hub import Exchange, FakeHub, point_client_at

REPO = "sonar-tests/tiny"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A running fake hub that the client in this process talks to (see ``point_client_at``),
    with a cache of this test, so that ``hub.requests`` holds only what a test caused."""
    with FakeHub() as hub:
        point_client_at(hub, monkeypatch, tmp_path / "hub-cache")
        yield hub


def _folder(root: Path, files: dict[str, bytes | str]) -> Path:
    root.mkdir(parents=True)
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
    return root


def _model_folder(root: Path) -> Path:
    return _folder(root, {
        "config.json": json.dumps({"model_type": "llama", "vocab_size": 256}),
        "tokenizer.json": "{}",
        "model.safetensors": bytes(range(256)) * 40,
        "README.md": "# tiny\n",
        "extra/notes.txt": "not a weight",
    })


def _file_gets(hub: FakeHub, name: str) -> list[Exchange]:
    return [exchange for exchange in hub.exchanges if exchange.method == "GET" and exchange.path.endswith(f"/{name}")]


def test_snapshot_download_fetches_exactly_the_allowed_files(hub: FakeHub, tmp_path: Path) -> None:
    source = _model_folder(tmp_path / "source")
    sha = hub.add_repo(REPO, source)

    folder = Path(snapshot_download(REPO, allow_patterns=["*.json", "*.safetensors"]))

    assert folder.name == sha
    downloaded = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}
    assert downloaded == {"config.json", "tokenizer.json", "model.safetensors"}
    for name in downloaded:
        assert (folder / name).read_bytes() == (source / name).read_bytes()
    assert ("GET", f"/api/models/{REPO}/revision/main") in hub.requests
    assert not _file_gets(hub, "README.md")


def test_model_info_and_tree_describe_the_commit(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, _model_folder(tmp_path / "source"))
    api = HfApi()

    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == sha
    assert sorted(sibling.rfilename for sibling in info.siblings) == [
        "README.md", "config.json", "extra/notes.txt", "model.safetensors", "tokenizer.json"]
    weights = next(sibling for sibling in info.siblings if sibling.rfilename == "model.safetensors")
    assert weights.size == 256 * 40 and weights.lfs is not None and weights.lfs.size == 256 * 40

    tree = {entry.path: entry for entry in api.list_repo_tree(REPO, recursive=True)}
    assert isinstance(tree["extra"], RepoFolder)
    assert isinstance(tree["extra/notes.txt"], RepoFile) and tree["extra/notes.txt"].lfs is None
    assert tree["model.safetensors"].lfs is not None and len(tree["model.safetensors"].lfs.sha256) == 64
    assert [entry.path for entry in api.list_repo_tree(REPO)] == [
        "extra", "README.md", "config.json", "model.safetensors", "tokenizer.json"]


def test_revisions_pin_the_content(hub: FakeHub, tmp_path: Path) -> None:
    main_sha = hub.add_repo(REPO, _folder(tmp_path / "main", {"config.json": '{"v": "main"}'}))
    v1_sha = hub.add_repo(REPO, _folder(tmp_path / "v1", {"config.json": '{"v": "v1"}'}), revision="v1")
    assert main_sha != v1_sha

    def config_at(revision: str | None) -> str:
        return Path(hf_hub_download(REPO, "config.json", revision=revision)).read_text()

    assert config_at(None) == '{"v": "main"}'
    assert config_at("v1") == '{"v": "v1"}'
    assert config_at(main_sha) == '{"v": "main"}'
    assert HfApi().model_info(REPO, revision="v1").sha == v1_sha
    assert Path(snapshot_download(REPO, revision=v1_sha)).name == v1_sha


def test_gated_repo_needs_the_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, _model_folder(tmp_path / "source"), gated=True, token="hf_secret")

    with pytest.raises(GatedRepoError):
        snapshot_download(REPO)
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO, "config.json")
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO, "config.json", token="hf_wrong")
    assert [exchange.status for exchange in hub.exchanges] == [401, 401, 403]

    folder = Path(snapshot_download(REPO, token="hf_secret", allow_patterns=["config.json"]))
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert hub.exchanges[-1].headers["authorization"] == "Bearer hf_secret"


def test_unknown_repo_revision_and_file_raise_the_client_errors(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, _model_folder(tmp_path / "source"))

    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("sonar-tests/missing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("sonar-tests/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("legacy-name")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="0" * 40)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "no-such-file.json")


def test_dropped_transfer_is_resumed_with_a_range_request(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MB): with the
    # default, a cut inside a small file leaves nothing to resume from.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    content = bytes(range(256)) * 80  # 20480 bytes
    hub.add_repo(REPO, _folder(tmp_path / "source", {"weights.bin": content}))
    hub.interrupt(REPO, "weights.bin", after_bytes=5000)

    path = hf_hub_download(REPO, "weights.bin")

    assert Path(path).read_bytes() == content
    first, second = _file_gets(hub, "weights.bin")
    assert (first.status, first.body_bytes, first.headers.get("range")) == (200, 5000, None)
    assert (second.status, second.headers["range"]) == (206, "bytes=4096-")
    assert second.body_bytes == len(content) - 4096


def test_a_transfer_that_keeps_failing_fails_the_call_and_the_next_call_succeeds(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_download.time, "sleep", lambda seconds: None)  # 1 s between the client's attempts
    content = b"x" * 3000
    hub.add_repo(REPO, _folder(tmp_path / "source", {"weights.bin": content}))
    hub.interrupt(REPO, "weights.bin", after_bytes=100, times=1000)

    with pytest.raises(httpx2.RemoteProtocolError):
        hf_hub_download(REPO, "weights.bin")
    assert len(_file_gets(hub, "weights.bin")) > 1  # the client retried by itself before giving up

    hub.interrupt(REPO, "weights.bin", after_bytes=0, times=0)  # the network is back
    hub.clear_requests()
    assert Path(hf_hub_download(REPO, "weights.bin")).read_bytes() == content
    assert [exchange.status for exchange in _file_gets(hub, "weights.bin")] == [200]


def test_safetensors_metadata_is_read_from_the_headers(hub: FakeHub, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    # A header above the 100 kB the client reads first, so that it asks for the rest.
    save_file({"embed.weight": torch.zeros(16, 8), "lm_head.weight": torch.zeros(3, 8, dtype=torch.float16)},
              source / "model.safetensors", metadata={"format": "pt", "padding": "p" * 150_000})
    hub.add_repo(REPO, source)

    metadata = HfApi().get_safetensors_metadata(REPO)

    tensors = metadata.files_metadata["model.safetensors"].tensors
    assert {name: info.shape for name, info in tensors.items()} == {"embed.weight": [16, 8], "lm_head.weight": [3, 8]}
    assert tensors["lm_head.weight"].dtype == "F16"
    ranges = [exchange.headers.get("range") for exchange in _file_gets(hub, "model.safetensors")]
    assert ranges[0] == "bytes=0-100000" and len(ranges) == 2
    assert all(exchange.status == 206 for exchange in _file_gets(hub, "model.safetensors"))


def test_sharded_safetensors_metadata(hub: FakeHub, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    save_file({"a": torch.zeros(2, 3)}, source / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(5)}, source / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 44},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    sha = hub.add_repo(REPO, source)

    metadata = HfApi().get_safetensors_metadata(REPO, revision=sha)

    assert metadata.sharded
    shapes = {name: info.shape for file in metadata.files_metadata.values() for name, info in file.tensors.items()}
    assert shapes == {"a": [2, 3], "b": [5]}


def test_cached_files_are_not_requested_again(hub: FakeHub, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, _model_folder(tmp_path / "source"))
    snapshot_download(REPO, allow_patterns=["*.json"])
    hub.clear_requests()

    # A branch is resolved again (one request); the listing and files of the commit are cached.
    snapshot_download(REPO, allow_patterns=["*.json"])
    assert hub.requests == [("GET", f"/api/models/{REPO}/revision/main")]
    hub.clear_requests()
    # hf_hub_download checks a branch with a HEAD, and trusts the cache for a commit sha.
    hf_hub_download(REPO, "config.json")
    hf_hub_download(REPO, "config.json", revision=sha)
    assert hub.requests == [("HEAD", f"/{REPO}/resolve/main/config.json")]


def test_http_answers_of_the_resolve_route(hub: FakeHub, tmp_path: Path) -> None:
    content = bytes(range(100))
    sha = hub.add_repo(REPO, _folder(tmp_path / "source", {"model.safetensors": content, "a b.txt": "spaces"}))
    url = f"{hub.url}/{REPO}/resolve/main/model.safetensors"

    def fetch(method: str = "GET", **headers: str) -> http.client.HTTPResponse:
        return urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers))

    with fetch("HEAD") as head:
        assert head.status == 200 and head.read() == b""
        assert head.headers["X-Repo-Commit"] == sha
        assert head.headers["Content-Length"] == "100" and head.headers["X-Linked-Size"] == "100"
        assert head.headers["X-Linked-Etag"] == head.headers["ETag"] and len(head.headers["ETag"]) == 66
        assert head.headers["Accept-Ranges"] == "bytes"
    with fetch(Range="bytes=90-") as tail:
        assert (tail.status, tail.headers["Content-Range"], tail.read()) == (206, "bytes 90-99/100", content[90:])
    with fetch(Range="bytes=-5") as suffix:
        assert suffix.read() == content[-5:]
    with pytest.raises(urllib.error.HTTPError) as unsatisfiable:
        fetch(Range="bytes=100-")
    assert unsatisfiable.value.code == 416 and unsatisfiable.value.headers["Content-Range"] == "bytes */100"
    with urllib.request.urlopen(f"{hub.url}/{REPO}/resolve/{sha}/a%20b.txt") as quoted:
        assert quoted.read() == b"spaces"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{hub.url}/{REPO}/resolve/main/missing.txt")
    assert (missing.value.code, missing.value.headers["X-Error-Code"]) == (404, "EntryNotFound")
