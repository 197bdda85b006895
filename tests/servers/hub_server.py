"""A small local Hugging Face Hub, enough for ``huggingface_hub`` 2.x uploads and ``from_pretrained`` downloads.

Standard library only: a ``ThreadingHTTPServer`` on 127.0.0.1 that keeps repos in memory and file
contents in a folder (content-addressed by sha256). It speaks the endpoints the client calls:

* ``POST /api/repos/create``; ``POST /api/{type}s/{repo}/branch/{branch}``
* ``POST /api/{type}s/{repo}/preupload/{rev}`` (``uploadMode`` ``lfs`` for weights and files of
  10 MB or more, ``regular`` otherwise; ``oid`` of the file already there, so unchanged files are
  skipped)
* ``POST /{repo}.git/info/lfs/objects/batch`` (basic transfer: an upload action pointing at
  ``PUT /lfs-upload/{oid}``, which checks size and sha256, plus a verify action), ``POST
  /{repo}.git/info/lfs/objects/verify``
* ``POST /api/{type}s/{repo}/commit/{rev}`` (NDJSON: ``header``, ``file`` with base64 content,
  ``lfsFile`` for uploaded objects, ``deletedFile`` / ``deletedFolder``), applied atomically
* ``GET /api/{type}s/{repo}[/revision/{rev}]`` (repo info with ``sha`` and ``siblings``), ``GET
  /api/{type}s/{repo}/tree/{rev}[/{path}]``, ``GET /api/whoami-v2``, ``POST /api/validate-yaml`` (README
  metadata, checked before a README is committed)
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` (git blob sha1,
  or the sha256 for LFS files, with ``X-Linked-Etag`` / ``X-Linked-Size``), ``Content-Length`` and
  ``Range`` support; errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
  ``EntryNotFound``) as the real Hub does, so the client raises the right exceptions.

Writes need an ``Authorization`` header (any token); private repos need one to be read. Tests can
inspect what was stored (:meth:`HubServer.files`, :meth:`HubServer.commits`), see every request
(:attr:`HubServer.requests`) and make the next matching requests fail (:meth:`HubServer.fail_next`).

Run it by hand with ``python tests/servers/hub_server.py --port 8080``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files of 10 MB or more with LFS
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npz", ".model")
REPO_TYPES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_PLURAL = {"models": "model", "datasets": "dataset", "spaces": "space"}
_COMMIT_OID = re.compile(r"[0-9a-f]{40}")
_PIECE = 1 << 20
DUMMY_TOKEN = "hf_local_test_token"  # any token is accepted


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class StoredFile:
    size: int
    sha256: str
    git_oid: str  # sha1 of the git blob (regular files) or of the LFS pointer (LFS files)
    lfs: bool


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    description: str
    date: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    created: str
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)


@dataclass
class Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    remaining: int


class HubError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers, self.extra = status, message, code, headers or {}, extra


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubServer:
    """The server and its state. ``start()`` serves on a free port of 127.0.0.1 from a thread."""

    def __init__(self, root: str | os.PathLike[str] | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="hub-server-"))
        self.blobs = self.root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.faults: list[Fault] = []
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client_env(self, hf_home: str | os.PathLike[str]) -> dict[str, str]:
        """Environment variables that point ``huggingface_hub`` (and transformers) in a new process at this server."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_DISABLE_XET": "1",  # this server speaks LFS, not Xet
            "HF_TOKEN": DUMMY_TOKEN,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
        }

    # ------------------------------------------------------------------ for tests

    def fail_next(self, method: str, path_regex: str, status: int = 503, times: int = 1) -> None:
        """Answer the next ``times`` requests matching ``method`` and ``path_regex`` (searched) with ``status``."""
        with self.lock:
            self.faults.append(Fault(method.upper(), re.compile(path_regex), status, times))

    def reset(self) -> None:
        with self.lock:
            self.repos.clear()
            self.requests.clear()
            self.faults.clear()

    def repo_ids(self, repo_type: str = "model") -> list[str]:
        with self.lock:
            return sorted(rid for (rtype, rid) in self.repos if rtype == repo_type)

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        with self.lock:
            return self.repos[(repo_type, repo_id)]

    def commits(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> list[Commit]:
        """The commits of ``revision``, newest first."""
        with self.lock:
            repo = self.repos[(repo_type, repo_id)]
            out, oid = [], repo.branches.get(revision, revision)
            while oid is not None:
                commit = repo.commits[oid]
                out.append(commit)
                oid = commit.parent
            return out

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """Every file of ``revision`` and its content."""
        with self.lock:
            repo = self.repos[(repo_type, repo_id)]
            commit = repo.commits[repo.branches.get(revision, revision)]
            return {path: self.blob_path(f.sha256).read_bytes() for path, f in sorted(commit.files.items())}

    # ------------------------------------------------------------------ storage

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / sha256

    def store_bytes(self, data: bytes, lfs: bool) -> StoredFile:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha)
        if not path.exists():
            tmp = path.with_name(f".{sha}.{uuid.uuid4().hex}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        git_oid = git_blob_oid(_lfs_pointer(sha, len(data))) if lfs else git_blob_oid(data)
        return StoredFile(len(data), sha, git_oid, lfs)

    def lfs_object(self, sha256: str) -> int | None:
        path = self.blob_path(sha256)
        return path.stat().st_size if path.is_file() else None

    def create_repo(self, repo_id: str, repo_type: str, private: bool) -> Repo:
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}")
            repo = Repo(repo_id, repo_type, private, _now())
            attributes = self.store_bytes(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", lfs=False)
            first = self._new_commit(None, "initial commit", "", {".gitattributes": attributes})
            repo.commits[first.oid] = first
            repo.branches["main"] = first.oid
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def _new_commit(self, parent: str | None, title: str, description: str, files: dict[str, StoredFile]) -> Commit:
        tree = json.dumps({p: f.git_oid for p, f in sorted(files.items())})
        oid = hashlib.sha1(f"{parent}\n{tree}\n{title}\n{time.time_ns()}\n{uuid.uuid4()}".encode()).hexdigest()
        return Commit(oid, parent, title, description, _now(), dict(files))

    def find_repo(self, repo_type: str, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authorized):
            raise HubError(404 if repo is None else 401, f"Repository not found: {repo_id}", "RepoNotFound")
        return repo

    def resolve(self, repo: Repo, revision: str) -> Commit:
        revision = unquote(revision)
        oid = repo.branches.get(revision)
        if oid is None and _COMMIT_OID.fullmatch(revision) and revision in repo.commits:
            oid = revision
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[oid]


def _handler_for(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        hub = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    server_version = "LocalHub/1.0"

    # ------------------------------------------------------------------ plumbing

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        path = split.path
        try:
            fault = self._fault(method, path)
            if fault is not None:
                self._read_body()
                raise HubError(fault, f"injected failure {fault} for {method} {path}")
            self._route(method, path)
        except HubError as exc:
            headers = dict(exc.headers)
            if exc.code:
                headers["X-Error-Code"] = exc.code
            headers["X-Error-Message"] = " ".join(exc.message.split()).encode("ascii", "replace").decode()
            headers["Connection"] = "close"  # the request body may be unread: do not reuse the connection
            self.close_connection = True
            self._send_json(exc.status, {"error": exc.message, **exc.extra}, headers)
        except Exception as exc:  # a bug in the server: answer 500 and show it in the test output
            import traceback

            traceback.print_exc()
            self.close_connection = True
            self._send_json(500, {"error": f"server error: {type(exc).__name__}: {exc}"}, {"Connection": "close"})

    def send_response(self, code: int, message: str | None = None) -> None:
        # Recorded before the client can see the answer, so a test reading ``requests`` after a call finds it.
        with self.hub.lock:
            self.hub.requests.append((self.command, urlsplit(self.path).path, code))
        super().send_response(code, message)

    def _fault(self, method: str, path: str) -> int | None:
        with self.hub.lock:
            for fault in self.hub.faults:
                if fault.remaining > 0 and fault.method == method and fault.pattern.search(path):
                    fault.remaining -= 1
                    return fault.status
        return None

    def _authorized(self) -> bool:
        return bool(self.headers.get("Authorization", "").strip())

    def _require_auth(self) -> None:
        if not self._authorized():
            raise HubError(401, "Invalid credentials in Authorization header")

    def _body_chunks(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                data = self.rfile.read(size)
                self.rfile.readline()
                yield data
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            data = self.rfile.read(min(_PIECE, remaining))
            if not data:
                raise HubError(400, "request body ends early")
            remaining -= len(data)
            yield data

    def _read_body(self) -> bytes:
        return b"".join(self._body_chunks())

    def _json_body(self) -> Any:
        body = self._read_body()
        try:
            return json.loads(body or b"{}")
        except ValueError:
            raise HubError(400, "body is not JSON") from None

    def _send(self, status: int, body: bytes, headers: dict[str, str], content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers or {})

    # ------------------------------------------------------------------ routing

    def _route(self, method: str, path: str) -> int:
        parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
        if parts[:1] == ["api"]:
            return self._route_api(method, parts[1:])
        if parts[:1] == ["lfs-upload"] and method == "PUT" and len(parts) == 2:
            return self._lfs_put(parts[1])
        repo_type = "model"
        if parts and parts[0] in _PLURAL and parts[0] != "models":
            repo_type, parts = _PLURAL[parts[0]], parts[1:]
        if (
            len(parts) >= 2
            and parts[1].endswith(".git")
            and parts[2:5] == ["info", "lfs", "objects"]
            and method == "POST"
        ):
            repo_id = f"{parts[0]}/{parts[1][: -len('.git')]}"
            if parts[5:] == ["batch"]:
                return self._lfs_batch(repo_type, repo_id)
            if parts[5:] == ["verify"]:
                return self._lfs_verify()
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(repo_type, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        raise HubError(404, f"no route for {method} {path}")

    def _route_api(self, method: str, parts: list[str]) -> int:
        if parts == ["repos", "create"] and method == "POST":
            return self._create_repo()
        if parts == ["whoami-v2"] and method == "GET":
            self._require_auth()
            self._send_json(
                200,
                {
                    "type": "user",
                    "name": "tester",
                    "fullname": "Test User",
                    "orgs": [],
                    "auth": {"type": "access_token"},
                },
            )
            return 200
        if parts == ["validate-yaml"] and method == "POST":
            return self._validate_yaml()
        if len(parts) >= 3 and parts[0] in _PLURAL:
            repo_type, repo_id, rest = _PLURAL[parts[0]], f"{parts[1]}/{parts[2]}", parts[3:]
            if not rest and method == "GET":
                return self._info(repo_type, repo_id, "main")
            if rest[:1] == ["revision"] and len(rest) >= 2 and method == "GET":
                return self._info(repo_type, repo_id, "/".join(rest[1:]))
            if rest[:1] == ["preupload"] and len(rest) >= 2 and method == "POST":
                return self._preupload(repo_type, repo_id, "/".join(rest[1:]))
            if rest[:1] == ["commit"] and len(rest) >= 2 and method == "POST":
                return self._commit(repo_type, repo_id, "/".join(rest[1:]))
            if rest[:1] == ["branch"] and len(rest) >= 2 and method == "POST":
                return self._branch(repo_type, repo_id, "/".join(rest[1:]))
            if rest[:1] == ["tree"] and len(rest) >= 2 and method == "GET":
                return self._tree(repo_type, repo_id, rest[1], "/".join(rest[2:]))
        raise HubError(404, f"no API route for {method} /api/{'/'.join(parts)}")

    def _validate_yaml(self) -> int:
        """A README's metadata block (between ``---`` lines) must be a YAML mapping, as the Hub checks
        before huggingface_hub commits a README."""
        import yaml

        content = self._json_body().get("content")
        if not isinstance(content, str):
            raise HubError(400, "validate-yaml: 'content' must be a string")
        errors = []
        lines = content.splitlines()
        if lines[:1] == ["---"] and "---" in lines[1:]:
            block = "\n".join(lines[1 : lines.index("---", 1)])
            try:
                meta = yaml.safe_load(block)
                if meta is not None and not isinstance(meta, dict):
                    errors.append({"message": "metadata must be a YAML mapping"})
            except yaml.YAMLError as exc:
                errors.append({"message": f"invalid YAML: {exc}"})
        self._send_json(400 if errors else 200, {"errors": errors, "warnings": []})
        return 400 if errors else 200

    # ------------------------------------------------------------------ repos

    def _create_repo(self) -> int:
        self._require_auth()
        body = self._json_body()
        name, organization = body.get("name"), body.get("organization") or "tester"
        repo_type = body.get("type") or "model"
        if not isinstance(name, str) or not name or repo_type not in REPO_TYPES:
            raise HubError(400, f"invalid repo create request: {body}")
        repo_id = f"{organization}/{name}"
        private = body.get("visibility") == "private" or bool(body.get("private"))
        url = f"{self.hub.url}/{REPO_TYPES[repo_type]}{repo_id}"
        try:
            self.hub.create_repo(repo_id, repo_type, private)
        except HubError as exc:
            exc.extra["url"] = url  # the Hub names the existing repo; the client reads it
            raise
        self._send_json(200, {"url": url, "name": repo_id, "id": uuid.uuid4().hex[:24]})
        return 200

    def _branch(self, repo_type: str, repo_id: str, branch: str) -> int:
        self._require_auth()
        body = self._json_body()
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, True)
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: {branch}")
            start = self.hub.resolve(repo, body.get("startingPoint") or "main")
            repo.branches[branch] = start.oid
        self._send_json(200, {})
        return 200

    def _info(self, repo_type: str, repo_id: str, revision: str) -> int:
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, self._authorized())
            commit = self.hub.resolve(repo, revision)
            siblings = [{"rfilename": p, "size": f.size, "blobId": f.git_oid} for p, f in sorted(commit.files.items())]
        value = {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        self._send_json(200, value)
        return 200

    def _tree(self, repo_type: str, repo_id: str, revision: str, prefix: str) -> int:
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, self._authorized())
            commit = self.hub.resolve(repo, revision)
            files = dict(commit.files)
        base = prefix.strip("/")
        entries: dict[str, dict[str, Any]] = {}
        for path, f in sorted(files.items()):
            if base and not path.startswith(base + "/"):
                continue
            rest = path[len(base) + 1 :] if base else path
            head, sep, _ = rest.partition("/")
            if sep and not recursive:
                folder = f"{base}/{head}" if base else head
                entries.setdefault(
                    folder,
                    {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "size": 0, "path": folder},
                )
                continue
            if recursive and sep:
                parts = rest.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    folder = "/".join(([base] if base else []) + parts[:i])
                    entries.setdefault(
                        folder,
                        {
                            "type": "directory",
                            "oid": hashlib.sha1(folder.encode()).hexdigest(),
                            "size": 0,
                            "path": folder,
                        },
                    )
            entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(_lfs_pointer(f.sha256, f.size))}
            entries[path] = entry
        if base and not entries and base not in files:
            raise HubError(404, f"{base} does not exist on {revision}", "EntryNotFound")
        self._send_json(200, list(entries.values()))
        return 200

    # ------------------------------------------------------------------ uploads

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> int:
        self._require_auth()
        body = self._json_body()
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, True)
            commit = self.hub.resolve(repo, revision)
            current = dict(commit.files)
        out = []
        for item in body.get("files") or []:
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample") or "")
            lfs = path.endswith(LFS_SUFFIXES) or size >= LFS_THRESHOLD or b"\0" in sample
            old = current.get(path)
            oid = None if old is None else (old.sha256 if old.lfs else old.git_oid)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._send_json(200, {"files": out, "commitOid": commit.oid})
        return 200

    def _lfs_batch(self, repo_type: str, repo_id: str) -> int:
        self._require_auth()
        body = self._json_body()
        with self.hub.lock:
            self.hub.find_repo(repo_type, repo_id, True)
        if body.get("operation") != "upload":
            raise HubError(400, "only uploads are supported by this server")
        objects = []
        for obj in body.get("objects") or []:
            oid, size = str(obj["oid"]), int(obj["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if self.hub.lfs_object(oid) != size:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{oid}?size={size}", "expires_in": 3600},
                    "verify": {"href": f"{self.hub.url}/{REPO_TYPES[repo_type]}{repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(entry)
        self._send(
            200,
            json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
            {},
            "application/vnd.git-lfs+json",
        )
        return 200

    def _lfs_put(self, oid: str) -> int:
        if not re.fullmatch(r"[0-9a-f]{64}", oid):
            raise HubError(400, f"bad oid {oid}")
        expected = int(self.query.get("size", "-1"))
        hasher, size = hashlib.sha256(), 0
        tmp = self.hub.blobs / f".{oid}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as out:
                for data in self._body_chunks():
                    hasher.update(data)
                    out.write(data)
                    size += len(data)
            if hasher.hexdigest() != oid or (expected >= 0 and size != expected):
                raise HubError(
                    400,
                    f"uploaded content does not match: sha256 {hasher.hexdigest()} size {size}, expected {oid} size "
                    f"{expected}",
                )
            os.replace(tmp, self.hub.blob_path(oid))
        finally:
            tmp.unlink(missing_ok=True)
        self._send_json(200, {}, {"ETag": f'"{oid}"'})
        return 200

    def _lfs_verify(self) -> int:
        body = self._json_body()
        oid, size = str(body.get("oid")), int(body.get("size", -1))
        if self.hub.lfs_object(oid) != size:
            raise HubError(404, f"object {oid} of size {size} was not uploaded")
        self._send_json(200, {})
        return 200

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> int:
        self._require_auth()
        if self.query.get("create_pr"):
            raise HubError(400, "pull requests are not supported by this server")
        lines = [json.loads(line) for line in self._read_body().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the commit payload must start with a header line")
        header = lines[0]["value"]
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, True)
            branch = unquote(revision)
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = repo.commits[repo.branches[branch]]
            parent = header.get("parentCommit")
            if parent and not head.oid.startswith(parent):
                raise HubError(412, f"A commit has happened since {parent}; the head of {branch} is {head.oid}")
            files = dict(head.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = value.get("path", "")
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, f"{path}: unsupported encoding {value.get('encoding')}")
                    data = base64.b64decode(value["content"])
                    if len(data) >= LFS_THRESHOLD:
                        raise HubError(400, f"{path}: files of {LFS_THRESHOLD} bytes or more must be uploaded with LFS")
                    files[path] = self.hub.store_bytes(data, lfs=False)
                elif key == "lfsFile":
                    oid, size = value["oid"], self.hub.lfs_object(value["oid"])
                    if size is None or ("size" in value and int(value["size"]) != size):
                        raise HubError(422, f"{path}: LFS object {oid} was not uploaded")
                    files[path] = StoredFile(size, oid, git_blob_oid(_lfs_pointer(oid, size)), True)
                elif key == "deletedFile":
                    if path not in files:
                        raise HubError(404, f"{path}: A file with this name doesn't exist", "EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    files = {p: f for p, f in files.items() if not p.startswith(prefix)}
                else:
                    raise HubError(400, f"unsupported commit operation {key!r}")
            commit = self.hub._new_commit(head.oid, header.get("summary") or "", header.get("description") or "", files)
            repo.commits[commit.oid] = commit
            repo.branches[branch] = commit.oid
        url = f"{self.hub.url}/{REPO_TYPES[repo_type]}{repo_id}/commit/{commit.oid}"
        self._send_json(200, {"success": True, "commitOid": commit.oid, "commitUrl": url, "pullRequestUrl": None})
        return 200

    # ------------------------------------------------------------------ downloads

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> int:
        with self.hub.lock:
            repo = self.hub.find_repo(repo_type, repo_id, self._authorized())
            commit = self.hub.resolve(repo, revision)
            stored = commit.files.get(path)
        if stored is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        etag = f'"{stored.sha256 if stored.lfs else stored.git_oid}"'
        headers = {"X-Repo-Commit": commit.oid, "ETag": etag, "Accept-Ranges": "bytes"}
        if stored.lfs:
            headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(stored.size)})
        start, end, status = 0, stored.size, 200
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if match and stored.size and (match.group(1) or match.group(2)):
            if match.group(1):
                start = int(match.group(1))
                end = min(stored.size, int(match.group(2)) + 1) if match.group(2) else stored.size
            else:
                start = max(0, stored.size - int(match.group(2)))
            if start >= stored.size:
                raise HubError(
                    416,
                    f"range {self.headers['Range']} outside a {stored.size}-byte file",
                    headers={"Content-Range": f"bytes */{stored.size}"},
                )
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{stored.size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Disposition", f"inline; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command == "GET":
            with open(self.hub.blob_path(stored.sha256), "rb") as f:
                f.seek(start)
                left = end - start
                while left > 0:
                    data = f.read(min(_PIECE, left))
                    if not data:
                        break
                    self.wfile.write(data)
                    left -= len(data)
        return status


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a local Hugging Face Hub (for tests and demos).")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", default=None, help="folder for file contents (default: a temporary folder)")
    args = parser.parse_args(argv)
    server = HubServer(args.root, port=args.port).start()
    print(
        f"serving a local Hub at {server.url}; set HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1 HF_TOKEN=anything",
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
