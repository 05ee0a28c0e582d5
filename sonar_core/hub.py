"""Repository ids on the Hugging Face Hub: found in the local cache, or downloaded into it.

A repository id resolves to a snapshot folder of the Hugging Face cache (``HF_HOME`` /
``HF_HUB_CACHE``), the one ``hf download`` and transformers use, holding only what Sonar loads:
configs, tokenizer files and one set of weights (safetensors shards, else ``pytorch_model*.bin``,
else a single ``.gguf``); never a repository's Python code unless ``trust_remote_code`` asks for
it. A snapshot that already holds those files is used without any request to the Hub, so a
second start is offline. ``HF_HUB_OFFLINE`` forbids downloads, ``HF_TOKEN`` (or ``hf auth
login``) authorises gated and private repositories, and ``HF_ENDPOINT`` names another Hub.

Configuration checks ask for config files only (:data:`CONFIG`), so that a mistake in a draft's
config fails before gigabytes move; the loaders ask again for what they read, and
:func:`complete_snapshot` fetches the rest into the same commit's folder. A snapshot folder names
its repository and commit (``models--owner--name/snapshots/<commit>``), which is how a folder the
checks resolved is completed later, and how tensor shapes of its weights are read from the
Hub (:func:`remote_tensor_shapes`) before the weights are downloaded.

This module imports neither torch nor transformers; ``huggingface_hub`` is imported on use.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sonar_core.errors import SonarError

logger = logging.getLogger("sonar.hub")

CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
TOKENIZER_FILES = frozenset({
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
})
# Download attempts before a network failure is reported. Within one attempt huggingface_hub resumes a
# dropped transfer itself (Range requests); a new attempt keeps the files that were completed.
DOWNLOAD_ATTEMPTS = 3
RETRY_DELAY_S = 1.0
_SNAPSHOTS = "snapshots"
_REPO_FOLDER_PREFIX = "models--"


class HubError(SonarError, OSError):
    """A repository id that cannot be resolved: ``problem`` says why, ``fix`` what to do.
    ``about_revision`` marks errors of the revision rather than of the repository id. Callers
    that know the field turn it into a :class:`~sonar_core.errors.ConfigError`; elsewhere (a
    draft's weights fetched while the engine starts) it reaches the user as it is."""

    def __init__(self, problem: str, fix: str, *, about_revision: bool = False) -> None:
        self.problem = problem
        self.fix = fix
        self.about_revision = about_revision
        super().__init__(f"{problem}. Fix: {fix}.")


@dataclass(frozen=True)
class FileSet:
    """What a caller reads from a repository; config files always come along."""

    tokenizer: bool = False
    weights: bool = False
    # The repository's own Python files, only under trust_remote_code (tokenizers with custom code).
    code: bool = False


CONFIG = FileSet()
TOKENIZER = FileSet(tokenizer=True)
CHECKPOINT = FileSet(tokenizer=True, weights=True)


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is spelt like a Hub repository id (``owner/name`` or a legacy ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not name.startswith((".", "~")) and name.count("/") <= 1


def hub_snapshot(repo_id: str, revision: str | None, files: FileSet, cache_dir: Path | None = None) -> Path:
    """The local snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit; None:
    the default branch) holding ``files``: the cached one when it is complete, else downloaded.

    Raises :class:`HubError` when offline and not cached, for an unknown repository or revision,
    a gated repository without access, a repository without loadable weights, or a download that
    keeps failing (completed files stay in the cache, so the next start fetches only the rest).
    ``cache_dir``: the Hugging Face cache to use (default: ``HF_HUB_CACHE``)."""
    cached = cached_snapshot(repo_id, revision, files, cache_dir)
    if cached is not None:
        return cached
    offline_variable = _offline_variable()
    if offline_variable is not None:
        raise HubError(
            f"{_named(repo_id, revision)} is not in the local Hugging Face cache ({cache_dir or _cache_dir()}) with the "
            f"files Sonar loads, and {offline_variable}=1 forbids downloading it",
            f"download it where the Hub is reachable with `{_download_command(repo_id, revision)}`, "
            f"or unset {offline_variable}",
        )
    return _download(repo_id, revision, files, cache_dir)


def cached_snapshot(
    repo_id: str, revision: str | None, files: FileSet, cache_dir: Path | None = None
) -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` when it holds ``files``, else None.

    Completeness is judged against the file listing the Hub gave when the snapshot was
    downloaded (kept by ``huggingface_hub`` beside the snapshot), so an interrupted download is
    never taken for a checkpoint; a snapshot written without that listing (by an older client)
    must at least hold a config and, when asked for, its weights."""
    folder = _cached_snapshot_folder(repo_id, revision, cache_dir)
    if folder is None:
        return None
    listing = _cached_listing(repo_id, folder.name, cache_dir)
    if listing is None:
        return folder if _looks_complete(folder, files) else None
    try:
        wanted = select_files(listing, files, repo_id)
    except HubError:
        return None
    return folder if all((folder / name).is_file() for name in wanted) else None


@dataclass(frozen=True)
class SnapshotOrigin:
    """Where a cache snapshot folder comes from: ``<cache_dir>/models--owner--name/snapshots/<commit>``."""

    repo_id: str
    commit: str
    cache_dir: Path


def snapshot_origin(folder: Path) -> SnapshotOrigin | None:
    """The origin of a Hugging Face cache snapshot folder; None for any other folder."""
    folder = Path(folder).expanduser().absolute()
    repo_folder = folder.parent.parent
    if folder.parent.name != _SNAPSHOTS or not repo_folder.name.startswith(_REPO_FOLDER_PREFIX):
        return None
    repo_id = repo_folder.name[len(_REPO_FOLDER_PREFIX):].replace("--", "/")
    return SnapshotOrigin(repo_id, folder.name, repo_folder.parent)


def complete_snapshot(folder: Path, files: FileSet) -> Path:
    """``folder`` with ``files`` present: a cache snapshot that a configuration check resolved
    with its configs only gets the rest of the same commit; any other folder is returned as is."""
    origin = snapshot_origin(folder)
    if origin is None:
        return Path(folder)
    return hub_snapshot(origin.repo_id, origin.commit, files, origin.cache_dir)


def lacks_files(folder: Path, files: FileSet) -> bool:
    """Whether ``folder`` is a cache snapshot that does not hold ``files`` yet."""
    origin = snapshot_origin(folder)
    return origin is not None and cached_snapshot(origin.repo_id, origin.commit, files, origin.cache_dir) is None


def remote_tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of the safetensors weights of a cache snapshot whose weights are
    not downloaded, read from the file headers on the Hub (a few kB per file); None when
    ``folder`` is not a snapshot or its repository has no safetensors weights."""
    origin = snapshot_origin(folder)
    if origin is None or _offline_variable() is not None:
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        metadata = HfApi().get_safetensors_metadata(origin.repo_id, revision=origin.commit)
    except NotASafetensorsRepoError:
        return None
    except Exception as exc:  # noqa: BLE001 - every failure of the Hub is reported the same way
        raise _hub_failure(exc, origin.repo_id, origin.commit) from None
    return {
        name: tuple(info.shape)
        for file in metadata.files_metadata.values()
        for name, info in file.tensors.items()
    }


def select_files(listing: Iterable[str], files: FileSet, repo_id: str) -> list[str]:
    """The files of a repository listing that Sonar reads for ``files``: top-level configs,
    weight indexes, tokenizer files when asked, and one kind of weights (safetensors, else
    ``pytorch_model*.bin``, else a single ``.gguf``, else a lone ``.pt``) when asked for or when
    there is no config.json (a GGUF repository keeps its config inside the weights)."""
    top = sorted(name for name in listing if "/" not in name)
    wanted = [name for name in top if name in CONFIG_FILES or name.endswith(INDEX_SUFFIXES)]
    if files.tokenizer:
        wanted += [name for name in top if name in TOKENIZER_FILES or name.endswith(".tiktoken")]
    if files.code:
        wanted += [name for name in top if name.endswith(".py")]
    if files.weights or "config.json" not in top:
        wanted += _weight_files(top, repo_id)
    return wanted


def _weight_files(top: list[str], repo_id: str) -> list[str]:
    safetensors = [name for name in top if name.endswith(".safetensors")]
    if len(safetensors) > 1:
        # Mistral-style repositories add a consolidated copy of the sharded weights.
        safetensors = [name for name in safetensors if not name.startswith("consolidated")] or safetensors
    if safetensors:
        return safetensors
    bins = [name for name in top if fnmatch.fnmatch(name, "pytorch_model*.bin")]
    if bins:
        return bins
    ggufs = [name for name in top if name.endswith(".gguf")]
    state_dicts = [name for name in top if name.endswith(".pt")]  # FasterDecoding's medusa_lm_head.pt
    for single in (ggufs, state_dicts):
        if len(single) == 1:
            return single
    if ggufs:
        raise HubError(
            f"repository {repo_id!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:6])}) and Sonar loads one",
            f"download the one you want with `hf download {repo_id} FILE.gguf` and pass its path",
        )
    raise HubError(
        f"repository {repo_id!r} has no weights Sonar can load (no .safetensors, pytorch_model*.bin, "
        f"single .gguf or .pt file at its top level; it holds {', '.join(top[:8]) or 'no files'})",
        "pass a repository or folder with safetensors weights, or convert the checkpoint",
    )


def _looks_complete(folder: Path, files: FileSet) -> bool:
    names = {path.name for path in folder.iterdir() if path.is_file()}
    if not files.weights:
        return "config.json" in names or any(name.endswith(".gguf") for name in names)
    if "config.json" not in names:
        return any(name.endswith(".gguf") for name in names)
    indexes = sorted(name for name in names if name.endswith(INDEX_SUFFIXES))
    if indexes:
        return set(json.loads((folder / indexes[0]).read_text())["weight_map"].values()) <= names
    return any(name.endswith((".safetensors", ".bin", ".pt")) for name in names)


def _download(repo_id: str, revision: str | None, files: FileSet, cache_dir: Path | None) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi()
    try:
        resolved = api.resolve_revision(repo_id, revision=revision)
        listing = api.list_repo_files(repo_id, revision=resolved.resolved)
    except Exception as exc:  # noqa: BLE001 - mapped to a message that names the cause
        raise _hub_failure(exc, repo_id, revision) from None
    wanted = select_files(listing, files, repo_id)
    logger.info(
        "Downloading %d files of %s from %s into %s", len(wanted), _named(repo_id, revision), _endpoint(),
        cache_dir or _cache_dir(),
    )
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        try:
            folder = Path(snapshot_download(repo_id, revision=resolved, allow_patterns=wanted, cache_dir=cache_dir))
            break
        except Exception as exc:  # noqa: BLE001 - transient failures retry, the rest are mapped
            failure = _hub_failure(exc, repo_id, revision)
            if not _is_transient(exc) or attempt == DOWNLOAD_ATTEMPTS:
                raise failure from None
            logger.warning("Download of %s failed (%s); retrying (%d/%d)", repo_id, failure.problem, attempt,
                           DOWNLOAD_ATTEMPTS - 1)
            time.sleep(RETRY_DELAY_S * attempt)
    missing = [name for name in wanted if not (folder / name).is_file()]
    if missing:
        raise HubError(
            f"the download of {_named(repo_id, revision)} ended without {', '.join(missing)}",
            "start again: the files already downloaded are kept",
        )
    return folder


def _hub_failure(exc: Exception, repo_id: str, revision: str | None) -> HubError:
    """A :class:`HubError` naming the cause of a failed Hub request (never the token itself)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_state = "a token is set (HF_TOKEN or `hf auth login`)" if _has_token() else "no token is set"
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, GatedRepoError):
        return HubError(
            f"repository {repo_id!r} is gated and {token_state}"
            + (" but it has no access" if _has_token() else ""),
            "accept the repository's terms on its Hub page with your account, then set HF_TOKEN to a token of "
            "that account (or run `hf auth login`)",
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(
            f"revision {revision!r} does not exist in repository {repo_id!r}",
            "pass a branch, tag or commit of the repository (the Hub page lists them), or omit the revision "
            "for the default branch",
            about_revision=True,
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"repository {repo_id!r} was not found on {_endpoint()} (or it is private and {token_state})",
            "check the spelling (owner/name), pass a local folder, or set HF_TOKEN for a private repository",
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return HubError(
            f"{_endpoint()} refused access to {repo_id!r} (HTTP {exc.response.status_code}) and {token_state}",
            "set HF_TOKEN to a token with read access to the repository",
        )
    if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)) or _is_transient(exc):
        return HubError(
            f"downloading {_named(repo_id, revision)} from {_endpoint()} failed ({type(exc).__name__}: "
            f"{_first_line(exc)})",
            "check the network connection and start again (files already downloaded are kept), or download "
            f"it with `{_download_command(repo_id, revision)}`",
        )
    return HubError(
        f"resolving {_named(repo_id, revision)} on {_endpoint()} failed ({type(exc).__name__}: {_first_line(exc)})",
        f"download it with `{_download_command(repo_id, revision)}` and pass the folder",
    )


def _is_transient(exc: Exception) -> bool:
    """Failures that a new attempt may not meet: the connection, a timeout, the server's 5xx."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code >= 500
    if isinstance(exc, LocalEntryNotFoundError):  # the client fell back to the cache after a connection error
        return isinstance(exc.__cause__, (httpx2.TransportError, ConnectionError))
    return isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError))


def _cached_snapshot_folder(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path | None:
    from huggingface_hub import constants
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    storage = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or constants.DEFAULT_REVISION
    commit: str | None = revision if REGEX_COMMIT_HASH.fullmatch(revision) else None
    ref = storage / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    folder = storage / _SNAPSHOTS / commit if commit else None
    return folder if folder is not None and folder.is_dir() else None


def _cached_listing(repo_id: str, commit: str, cache_dir: Path | None) -> list[str] | None:
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [entry.path for entry in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        return None


def _offline_variable() -> str | None:
    """The variable that forbids downloads (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), if one does."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return None
    return next((name for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(name)), "HF_HUB_OFFLINE")


def _has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _named(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")


def _download_command(repo_id: str, revision: str | None) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]
