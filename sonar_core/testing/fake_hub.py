"""A fake Hugging Face Hub on 127.0.0.1, for tests that exercise downloads with the real client.

Sonar resolves repository ids through ``huggingface_hub`` (:mod:`sonar_core.hub`). Mocking the
client's functions would test the mocks; this module serves instead the part of the Hub's HTTP
API that the installed client speaks, so that ``snapshot_download``, ``hf_hub_download``,
``HfApi().model_info / repo_info / list_repo_tree / get_safetensors_metadata`` run unchanged,
caches and all. What it serves:

* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{revision}``: the model info
  (``sha``, ``siblings``; sizes, blob ids and LFS data with ``?blobs=true``);
* ``GET /api/models/{repo}/tree/{revision}[/{path}]`` (``?recursive=true``): the file listing;
* ``HEAD`` and ``GET /{repo}/resolve/{revision}/{path}``: the file, served directly (no redirect)
  with the headers the client reads (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``,
  ``X-Linked-Size``, ``Content-Length``, ``Accept-Ranges``), single ``Range: bytes=...`` requests
  answered with 206 and ``Content-Range`` (resumed downloads, safetensors header reads);
* errors with the ``X-Error-Code`` the client maps to its exceptions: ``RepoNotFound`` (404),
  ``GatedRepo`` (401 without a token, 403 with a wrong one), ``RevisionNotFound`` and
  ``EntryNotFound`` (404).

No Xet headers are sent, so the client always takes its plain HTTP download path. Files whose
suffix is in :data:`LFS_SUFFIXES` (or larger than 10 MiB) are LFS entries, as on the real Hub:
their ETag is the sha256 of the content; other files are regular git blobs (ETag: git blob sha1).
Only model repositories exist; the content of each commit is kept in memory, so publish small
files.

Pointing the client at the fake hub. ``huggingface_hub.constants`` reads the environment at
import time, and ``hf_hub_url`` formats ``HUGGINGFACE_CO_URL_TEMPLATE``, which was built from
``HF_ENDPOINT`` then: in-process, patching ``ENDPOINT`` alone still sends file downloads to
huggingface.co. :func:`point_client_at` patches both, the cache, the token and offline mode, and
disables telemetry: otherwise the first request of a process (whatever it is for) is preceded by
a GET of ``/api/agent-harnesses`` (the client's agent detection, answered 404 here), which would
show in ``requests`` or, against the real endpoint, leave the machine. A subprocess (the
``aphrodite`` command) gets the same through its environment: :func:`client_environment`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_BRANCH = "main"
# Suffixes stored with Git LFS, as in the .gitattributes the Hub gives new repositories.
LFS_SUFFIXES = frozenset({
    ".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npy", ".npz",
    ".model", ".pkl", ".zip", ".gz", ".tar",
})
# The Hub refuses regular (non-LFS) files above this size.
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024

_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
# A repository id is one segment (legacy "gpt2") or two ("owner/name"); the regexes try two first.
_API_ROUTE = re.compile(
    r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<op>revision|tree)/(?P<revision>[^/]+)(?:/(?P<sub>.+))?)?"
)
_RESOLVE_ROUTE = re.compile(r"/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<revision>[^/]+)/(?P<path>.+)")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"


@dataclass(frozen=True)
class Exchange:
    """One request the hub received and what it answered, for tests that look past the path:
    the ``Range`` or ``Authorization`` a client sent, or how many body bytes a response carried
    (fewer than announced when :meth:`FakeHub.interrupt` cut it)."""

    method: str
    path: str  # with the query
    headers: dict[str, str]  # request headers, names in lower case
    status: int
    body_bytes: int


@dataclass(frozen=True)
class _File:
    """A file of a commit, with the identifiers the Hub gives it."""

    path: str
    content: bytes
    lfs: bool
    git_oid: str  # sha1 of the git blob: the content, or the LFS pointer for an LFS file
    sha256: str
    pointer_size: int  # size of the LFS pointer (0 for a regular file)

    @classmethod
    def of(cls, path: str, content: bytes) -> _File:
        lfs = Path(path).suffix.lower() in LFS_SUFFIXES or len(content) > LFS_SIZE_THRESHOLD
        sha256 = hashlib.sha256(content).hexdigest()
        blob = _LFS_POINTER.format(sha256=sha256, size=len(content)).encode() if lfs else content
        return cls(path, content, lfs, _git_blob_sha1(blob), sha256, len(blob) if lfs else 0)

    @property
    def etag(self) -> str:
        """What the client names the cached blob after: sha256 for LFS files, else the git oid."""
        return self.sha256 if self.lfs else self.git_oid


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: dict[str, _File]
    date: str  # ISO 8601, the format the client parses


@dataclass
class _Repo:
    repo_id: str
    gated: bool
    token: str | None
    created: str
    commits: dict[str, _Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha


@dataclass
class _Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    cut_after: int | None = None  # close the connection after this many body bytes


class _HubError(Exception):
    """An error answer of the Hub: the status and the ``X-Error-Code`` the client maps."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


class _RangeNotSatisfiable(Exception):
    pass


class FakeHub:
    """Context manager; ``with FakeHub() as hub:`` starts the server, exit stops it.

    ``url`` (what tests put in ``HF_ENDPOINT``) exists once the server runs. ``requests`` lists
    ``(method, path with query)`` of every request received, in order; ``exchanges`` the same
    requests with their headers and answers (:class:`Exchange`). Both are appended to before
    the answer is sent, so a test that has its response sees its record.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._interrupts: dict[tuple[str, str], tuple[int, int]] = {}  # -> (after_bytes, times left)
        self._server: _HubServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        if self._server is not None:
            raise RuntimeError("this FakeHub is already running")
        self._server = _HubServer(self)
        # A short poll interval: stopping waits for the serving loop to notice, once per test.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        server.close_connections()  # keep-alive connections of the client would outlive the server
        server.server_close()
        thread.join()
        self._server = self._thread = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, the endpoint to give the client."""
        if self._server is None:
            raise RuntimeError("FakeHub has no url before it is started (use `with FakeHub() as hub:`)")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url_template(self) -> str:
        """The value for ``huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE``: the client
        builds file URLs from it, not from ``ENDPOINT`` (see the module docstring)."""
        return self.url + "/{repo_id}/resolve/{revision}/{filename}"

    # -- content -------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        folder: Path | str,
        *,
        revision: str = DEFAULT_BRANCH,
        gated: bool = False,
        token: str | None = None,
    ) -> str:
        """Publish the files of ``folder`` (recursively, relative paths) as a new commit of
        ``repo_id`` on branch/tag ``revision``; returns the 40-hex commit sha.

        The commit holds exactly the files of ``folder``, read now (later changes to the folder
        do not show); its sha is derived from the repository id and the content, so publishing
        the same files twice gives the same commit. Several calls with different revisions give
        the repository several commits; the default branch is ``main``, and a commit sha is a
        revision too. ``gated=True``: every request on the repository without ``Authorization:
        Bearer <token>`` gets 401 with ``X-Error-Code: GatedRepo`` (as the real Hub answers
        for a gated repository), one with another token 403 with the same code. ``gated`` and
        ``token`` are settings of the repository: later calls must repeat them.
        """
        if not 1 <= len(parts := repo_id.split("/")) <= 2 or not all(parts):
            raise ValueError(f"repo_id must be 'name' or 'owner/name', got {repo_id!r}")
        if not revision or "/" in revision or _COMMIT_SHA.fullmatch(revision):
            raise ValueError(f"revision must be a branch or tag name without '/', not a commit sha: {revision!r}")
        if token is not None and not gated:
            raise ValueError("token is the token that opens a gated repository: pass gated=True with it")
        root = Path(folder)
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is not a folder")
        files: dict[str, _File] = {}
        for path in sorted(root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(root).as_posix()
                files[rel] = _File.of(rel, path.read_bytes())
        digest = hashlib.sha1(f"{repo_id}\n".encode())
        for rel, file in files.items():
            digest.update(f"{rel}\0{file.git_oid}\n".encode())
        now = _iso_now()
        commit = _Commit(digest.hexdigest(), files, now)
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(repo_id, gated, token, created=now))
            if (repo.gated, repo.token) != (gated, token):
                raise ValueError(
                    f"{repo_id!r} was added with gated={repo.gated}, token={repo.token!r}: repeat those settings"
                )
            repo.commits.setdefault(commit.sha, commit)
            repo.refs[revision] = commit.sha
        return commit.sha

    def interrupt(self, repo_id: str, path: str, *, after_bytes: int, times: int = 1) -> None:
        """The next ``times`` GETs of that file's content (whole or ranged, any revision) send
        the headers for the whole length (or the requested range) but close the connection
        after ``after_bytes`` bytes of body: a dropped transfer (``times`` large: the network
        keeps failing). A response shorter than ``after_bytes`` is sent whole (and counts).
        A new call replaces the pending one; ``times=0`` cancels it. HEAD requests are not cut.
        """
        if after_bytes < 0 or times < 0:
            raise ValueError("after_bytes and times must not be negative")
        with self._lock:
            if times:
                self._interrupts[(repo_id, path)] = (after_bytes, times)
            else:
                self._interrupts.pop((repo_id, path), None)

    def clear_requests(self) -> None:
        """Forget the requests received so far (``requests`` and ``exchanges``)."""
        with self._lock:
            self.requests.clear()
            self.exchanges.clear()

    # -- answering (called by the request handler, on the server's threads) ---------------------

    def _serve(self, method: str, target: str, headers: dict[str, str]) -> _Response:
        """The answer to one request, recorded before it is sent."""
        split = urlsplit(target)
        with self._lock:
            try:
                response = self._answer(method, split.path, parse_qs(split.query), headers)
            except _HubError as error:
                # Header values travel as latin-1: a file name outside ASCII is escaped there.
                error_headers = {"X-Error-Message": error.message.encode("ascii", "backslashreplace").decode()}
                if error.code is not None:
                    error_headers["X-Error-Code"] = error.code
                response = _Response(error.status, {**error_headers, **error.headers}, _json({"error": error.message}))
            except Exception:  # noqa: BLE001 - a bug of the fake hub: the test shows the traceback
                response = _Response(500, {"Content-Type": "text/plain"}, traceback.format_exc().encode())
            sent = 0 if method == "HEAD" else len(response.body)
            if response.cut_after is not None:
                sent = min(sent, response.cut_after)
            self.requests.append((method, target))
            self.exchanges.append(Exchange(method, target, headers, response.status, sent))
        return response

    def _answer(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> _Response:
        if method not in ("GET", "HEAD"):
            raise _HubError(405, None, f"{method} is not served by the fake hub")
        if match := _API_ROUTE.fullmatch(path):
            repo = self._repo(unquote(match["repo"]), headers)
            if match["op"] is None:
                return self._model_info(repo, self._commit(repo, DEFAULT_BRANCH), query)
            revision = unquote(match["revision"])
            if match["op"] == "revision" and match["sub"] is None:
                return self._model_info(repo, self._commit(repo, revision), query)
            if match["op"] == "tree":
                sub = unquote(match["sub"] or "").strip("/")
                return self._tree(self._commit(repo, revision), sub, query)
        elif match := _RESOLVE_ROUTE.fullmatch(path):
            repo = self._repo(unquote(match["repo"]), headers)
            commit = self._commit(repo, unquote(match["revision"]))
            return self._file(repo, commit, unquote(match["path"]), method, headers.get("range"))
        raise _HubError(404, None, f"no route for {path} on the fake hub")

    def _repo(self, repo_id: str, headers: dict[str, str]) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            # The real Hub answers 401 without a token; the client maps the code either way.
            raise _HubError(404, "RepoNotFound", "Repository not found")
        if repo.gated:
            authorization = headers.get("authorization")
            if authorization is None:
                raise _HubError(
                    401, "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be authenticated "
                    "to access it. Please log in.",
                )
            if repo.token is None or authorization != f"Bearer {repo.token}":
                raise _HubError(
                    403, "GatedRepo",
                    f"Access to model {repo_id} is restricted and you are not in the authorized list.",
                )
        return repo

    @staticmethod
    def _commit(repo: _Repo, revision: str) -> _Commit:
        sha = repo.refs.get(revision, revision)
        commit = repo.commits.get(sha)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    @staticmethod
    def _model_info(repo: _Repo, commit: _Commit, query: dict[str, list[str]]) -> _Response:
        blobs = _flag(query, "blobs")
        siblings = []
        for file in commit.files.values():
            sibling: dict[str, object] = {"rfilename": file.path}
            if blobs:
                sibling.update(size=len(file.content), blobId=file.git_oid)
                if file.lfs:
                    sibling["lfs"] = {"size": len(file.content), "sha256": file.sha256,
                                      "pointerSize": file.pointer_size}
            siblings.append(sibling)
        owner, _, _ = repo.repo_id.rpartition("/")
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": owner or None,
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": repo.created,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        return _Response(200, {"Content-Type": "application/json"}, _json(info))

    @staticmethod
    def _tree(commit: _Commit, sub: str, query: dict[str, list[str]]) -> _Response:
        """The entries under folder ``sub`` ("" = the root): its children, or with
        ``recursive=true`` everything below, folders included, as the Hub lists them."""
        prefix = f"{sub}/" if sub else ""
        folders = {"/".join(parts[:i]) for path in commit.files for parts in [path.split("/")]
                   for i in range(1, len(parts))}
        if sub and sub not in folders:
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on {commit.sha}",
                            {"X-Repo-Commit": commit.sha})
        recursive, expand = _flag(query, "recursive"), _flag(query, "expand")

        def listed(path: str) -> bool:
            return path.startswith(prefix) and (recursive or "/" not in path[len(prefix):])

        last_commit = {"id": commit.sha, "title": "Publish with FakeHub.add_repo", "date": commit.date}
        entries: list[dict[str, object]] = []
        for folder in sorted(filter(listed, folders)):
            entry: dict[str, object] = {"type": "directory", "oid": _tree_oid(commit, folder), "size": 0,
                                        "path": folder}
            if expand:
                entry["lastCommit"] = last_commit
            entries.append(entry)
        for file in (file for path, file in commit.files.items() if listed(path)):
            entry = {"type": "file", "oid": file.git_oid, "size": len(file.content), "path": file.path}
            if file.lfs:
                entry["lfs"] = {"oid": file.sha256, "size": len(file.content), "pointerSize": file.pointer_size}
            if expand:
                entry["lastCommit"] = last_commit
            entries.append(entry)
        return _Response(200, {"Content-Type": "application/json"}, _json(entries))

    def _file(self, repo: _Repo, commit: _Commit, path: str, method: str, range_header: str | None) -> _Response:
        file = commit.files.get(path)
        if file is None:
            # X-Repo-Commit lets the client cache the file's absence for that commit (.no_exist).
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {commit.sha}",
                            {"X-Repo-Commit": commit.sha})
        size = len(file.content)
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{file.etag}"',
            "X-Repo-Commit": commit.sha,
        }
        if file.lfs:
            headers.update({"X-Linked-Etag": f'"{file.sha256}"', "X-Linked-Size": str(size)})
        if method == "HEAD":
            return _Response(200, {**headers, "Content-Length": str(size)})
        try:
            byte_range = _requested_range(range_header, size)
        except _RangeNotSatisfiable:
            raise _HubError(416, None, f"Range {range_header} not satisfiable for {size} bytes",
                            {"Content-Range": f"bytes */{size}"}) from None
        if byte_range is None:
            response = _Response(200, headers, file.content)
        else:
            first, last = byte_range
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
            response = _Response(206, headers, file.content[first:last + 1])
        response.cut_after = self._take_interrupt(repo.repo_id, path)
        return response

    def _take_interrupt(self, repo_id: str, path: str) -> int | None:
        pending = self._interrupts.get((repo_id, path))
        if pending is None:
            return None
        after_bytes, times = pending
        if times > 1:
            self._interrupts[(repo_id, path)] = (after_bytes, times - 1)
        else:
            del self._interrupts[(repo_id, path)]
        return after_bytes


class _HubServer(ThreadingHTTPServer):
    """The HTTP server of one :class:`FakeHub`, on a free port of 127.0.0.1."""

    daemon_threads = True

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open_ else self._connections.discard)(connection)

    def close_connections(self) -> None:
        """End the handler threads that wait on idle keep-alive connections."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    """HTTP plumbing only: what to answer is :meth:`FakeHub._serve`'s business."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server: _HubServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle()

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        headers = {name.lower(): value for name, value in self.headers.items()}
        response = self.server.hub._serve(self.command, self.path, headers)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        if "Content-Length" not in response.headers:
            self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        body = response.body
        if response.cut_after is not None and response.cut_after < len(body):
            body = body[: response.cut_after]
            self.close_connection = True  # the client gets fewer bytes than Content-Length announced
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        """Silent: tests read ``FakeHub.requests`` instead of the server's stderr."""


def _requested_range(header: str | None, size: int) -> tuple[int, int] | None:
    """First and last byte (inclusive) asked for by a ``Range: bytes=...`` header; None for the
    whole file: no header, or one this hub ignores as RFC 9110 allows (several ranges, bad
    syntax). Raises :class:`_RangeNotSatisfiable` for a range outside the file."""
    match = _RANGE.fullmatch(header.strip()) if header else None
    if match is None:
        return None
    first, last = match.groups()
    if not first:
        if not last:
            return None
        suffix = int(last)  # bytes=-N: the last N bytes
        if suffix == 0 or size == 0:
            raise _RangeNotSatisfiable
        return max(size - suffix, 0), size - 1
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise _RangeNotSatisfiable
    return start, min(int(last), size - 1) if last else size - 1


def _git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _tree_oid(commit: _Commit, folder: str) -> str:
    return hashlib.sha1(f"tree {commit.sha} {folder}".encode()).hexdigest()


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[-1].lower() in ("1", "true")


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


def _iso_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def point_client_at(hub: FakeHub, monkeypatch: Any, cache_dir: Path) -> None:
    """Make ``huggingface_hub`` in this process talk to ``hub`` only, with the cache ``cache_dir``,
    no token from the caller's environment, downloads allowed and no telemetry (``monkeypatch``
    is pytest's, so everything is restored after the test)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url_template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(Path(cache_dir).parent / "no-token"))
    for name in (*_TOKEN_VARIABLES, *_OFFLINE_VARIABLES):
        monkeypatch.delenv(name, raising=False)


def client_environment(hub: FakeHub, cache_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess whose ``huggingface_hub`` talks to ``hub`` only, as
    :func:`point_client_at` arranges in-process (``base``: the environment to start from)."""
    environ = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        if key not in (*_TOKEN_VARIABLES, *_OFFLINE_VARIABLES)
    }
    environ.update(
        HF_ENDPOINT=hub.url,
        HF_HUB_CACHE=str(cache_dir),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_TOKEN_PATH=str(Path(cache_dir).parent / "no-token"),
    )
    return environ


_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE")
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
