"""Publish a model folder or checkpoint: ``push`` to the Hugging Face Hub or an fsspec object store.

``push(src, dest)`` first runs the model-folder guard (:func:`shardsafe.guard.check_model_folder`),
so an empty, dummy or incomplete model is refused before a single byte leaves the machine. Then:

* **Hub** (``hf://owner/name`` or ``owner/name``): the repo (and branch) is created if needed and
  every file goes up in **one commit** (``HfApi.create_commit``), which the Hub applies atomically.
* **Object stores** (``s3://bucket/prefix``, ``file:///path``, any fsspec URL): there is no
  commit, so order is the protocol. The destination's old commit markers are deleted first, then
  every data file is uploaded, then the **commit marker** last: ``manifest.json`` for a shardsafe
  checkpoint, ``model.safetensors.index.json`` for a sharded Hugging Face folder,
  ``model.safetensors`` for a single-file one (``checkpoint/manifest.json`` for a config next to a
  checkpoint subfolder). A reader that finds the marker finds a complete model; an interrupted
  push leaves no marker, so it is never taken for a model.

Collective: with a process group, only the coordinator (group rank 0) reads ``src`` and uploads;
the other ranks wait for its result and return the same URL or raise the same error. Transient
errors (HTTP 408/429/5xx, connection resets, timeouts) are retried with exponential backoff, a
bounded number of times; anything else fails at once with a :class:`~shardsafe.errors.PushError`
naming the destination and the file. See docs/PUSH.md.

``huggingface_hub`` (Hub) and ``fsspec`` plus its backend (``s3fs`` for ``s3://``) are imported
only when a push needs them.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shardsafe.core.comm import get_comm
from shardsafe.core.faults import crash_point
from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import PushError, ShardsafeError
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE, check_model_folder

log = logging.getLogger(__name__)

T = TypeVar("T")

# The file whose presence makes a folder a model, by the kind the guard recognised. Uploaded last.
COMMIT_MARKERS = {
    "shardsafe-checkpoint": MANIFEST_NAME,
    "sharded-safetensors": INDEX_FILE,
    "safetensors": SINGLE_FILE,
}
DEFAULT_MESSAGE = "Upload model with shardsafe"

# Retries of transient errors: attempts in all (first try included), first wait, longest wait.
MAX_ATTEMPTS = 5
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_NAMES = frozenset(
    {
        # httpx / httpx2 (huggingface_hub), aiohttp and botocore (s3fs) transport errors
        "TimeoutException",
        "NetworkError",
        "RemoteProtocolError",
        "ConnectError",
        "ReadError",
        "WriteError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
    }
)
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# ----------------------------------------------------------------------------- what goes up, in which order


@dataclass(frozen=True)
class UploadFile:
    name: str  # path inside the destination, "/"-separated
    path: Path  # local file
    size: int


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    kind: str  # the guard's kind: "safetensors", "sharded-safetensors" or "shardsafe-checkpoint"
    marker: str  # the commit marker (a path inside the folder), always the last of ``files``
    files: tuple[UploadFile, ...]  # upload order: data files, then other marker-named files, then the marker

    @property
    def marker_names(self) -> list[str]:
        """Paths that make a folder a model: the top-level marker names and every marker-named file in the plan."""
        names = set(COMMIT_MARKERS.values()) | {f.name for f in self.files if _is_marker_name(f.name)}
        return sorted(names)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan_upload(src: str | os.PathLike[str]) -> UploadPlan:
    """Check ``src`` with the model-folder guard and list its files in upload order (marker last).

    Every regular file below ``src`` is included, except names starting with ``.`` (hidden files
    and folders such as shardsafe's temporaries or a ``.cache``). Raises
    :class:`~shardsafe.errors.ModelFolderError` for an empty, dummy or incomplete model.
    """
    folder = Path(src).absolute()
    summary = check_model_folder(folder)
    files: list[UploadFile] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or not path.is_file():
                continue
            files.append(UploadFile(path.relative_to(folder).as_posix(), path, path.stat().st_size))
    # The marker is at the top, or (a checkpoint saved next to its config, as save_pretrained does
    # without gathering) in the one subfolder that holds the checkpoint.
    name = COMMIT_MARKERS[summary.kind]
    found = sorted((f.name.count("/"), f.name) for f in files if f.name == name or f.name.endswith("/" + name))
    if not found:
        raise PushError(f"{folder}: the commit marker {name} is not a regular file in the folder")
    marker = found[0][1]
    # Data first; then marker-named files of nested folders (so each nested model also comes
    # complete before its marker); the commit marker last.
    files.sort(key=lambda f: (f.name == marker, _is_marker_name(f.name), f.name))
    return UploadPlan(folder, summary.kind, marker, tuple(files))


def _is_marker_name(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in COMMIT_MARKERS.values()


@dataclass(frozen=True)
class Destination:
    kind: str  # "hub" or "fsspec"
    url: str  # canonical form: hf://owner/name, or the fsspec URL without a trailing "/"
    repo_id: str = ""


def parse_destination(dest: str) -> Destination:
    """``hf://owner/name`` or ``owner/name`` (a Hub model repo), or any ``protocol://`` fsspec URL."""
    text = str(dest).strip()
    if text.startswith("hf://"):
        repo_id = text[len("hf://") :].strip("/")
        if repo_id.startswith("models/"):
            repo_id = repo_id[len("models/") :]
        elif repo_id.startswith(("datasets/", "spaces/")):
            raise PushError(f"{dest}: only model repos can be pushed to, not datasets or Spaces")
        if not _HUB_REPO_ID.fullmatch(repo_id):
            raise PushError(f"{dest}: not a Hub model repo; expected hf://owner/name")
        return Destination("hub", f"hf://{repo_id}", repo_id)
    if "://" in text:
        protocol, _, path = text.partition("://")
        if not protocol or not path.strip("/"):
            raise PushError(f"{dest}: the URL names no bucket or folder")
        return Destination("fsspec", f"{protocol}://{path.rstrip('/')}")
    if _HUB_REPO_ID.fullmatch(text):
        return Destination("hub", f"hf://{text}", text)
    raise PushError(f"{dest!r}: DEST must be a Hub repo (hf://owner/name or owner/name) or an fsspec URL (s3://bucket/prefix, file:///path)")


# ----------------------------------------------------------------------------- the collective entry point


def push(
    src: str | os.PathLike[str],
    dest: str,
    *,
    revision: str | None = None,
    private: bool = False,
    message: str | None = None,
    process_group: Any = None,
    progress: bool = True,
) -> str:
    """Upload the model folder or checkpoint ``src`` to ``dest``; returns the commit URL (Hub) or ``dest``'s URL.

    Collective when a process group is initialised: every rank calls it, only the coordinator
    reads ``src`` and uploads, and all ranks return the same value or raise the same error
    (:class:`~shardsafe.errors.ModelFolderError` for a folder the guard refuses,
    :class:`~shardsafe.errors.PushError` for anything else). ``revision`` (a branch, created if
    missing), ``private`` (applies when the repo is created) and ``message`` (the commit summary)
    are for Hub destinations. ``progress`` shows a bytes progress bar on the coordinator.
    """
    comm = get_comm(process_group)
    if not comm.distributed:
        return _push_here(src, dest, revision=revision, private=private, message=message, progress=progress)
    return comm.on_coordinator(
        lambda: _push_here(src, dest, revision=revision, private=private, message=message, progress=progress), default=PushError
    )


def _push_here(src: str | os.PathLike[str], dest: str, *, revision: str | None, private: bool, message: str | None, progress: bool) -> str:
    """The coordinator's part (or the whole push without a process group)."""
    target = parse_destination(dest)
    if target.kind != "hub" and (revision is not None or private):
        option = "revision" if revision is not None else "private"
        raise PushError(f"{target.url}: `{option}` only applies to Hub destinations (hf://owner/name)")
    plan = plan_upload(src)
    log.info("pushing %s (%s, %d files, %d bytes) to %s", plan.folder, plan.kind, len(plan.files), plan.total_bytes, target.url)
    try:
        if target.kind == "hub":
            return _push_hub(plan, target, revision=revision, private=private, message=message, progress=progress)
        if message is not None:
            log.debug("%s: no commits on an object store; the message is not used", target.url)
        return _push_fsspec(plan, target, progress=progress)
    except ShardsafeError:
        raise
    except Exception as exc:
        raise PushError(f"{_where(plan, target)}: {_describe(exc)}") from exc


# ----------------------------------------------------------------------------- object stores (fsspec)


def _push_fsspec(plan: UploadPlan, target: Destination, *, progress: bool) -> str:
    try:
        import fsspec
    except ImportError:
        raise PushError(f"{target.url}: pushing to an object store needs fsspec (pip install fsspec s3fs)") from None
    where = _where(plan, target)
    try:
        fs, root = fsspec.core.url_to_fs(target.url, skip_instance_cache=True)
    except ImportError as exc:
        raise PushError(f"{target.url}: no fsspec backend for this protocol: {exc}") from None
    except ValueError as exc:
        raise PushError(f"{target.url}: not a usable fsspec URL: {exc}") from None
    root = str(root).rstrip("/")
    local = "file" in _protocols(fs)

    # An older model at the destination becomes invisible before any of its files is replaced.
    for marker in _with_retries(lambda: _markers_at(fs, root, plan.marker_names), "listing the destination", where, _fsspec_transient):
        _with_retries(functools.partial(fs.rm_file, f"{root}/{marker}"), f"removing the old {marker}", where, _fsspec_transient)
        log.info("%s: removed the commit marker %s of an earlier upload", target.url, marker)

    with _Progress(plan.total_bytes, f"push {target.url}", progress) as bar:
        for f in plan.files:
            if f.name == plan.marker:
                crash_point("push:before-marker", 0)
            _with_retries(functools.partial(_put_one, fs, root, f, local, bar), f"uploading {f.name}", where, _fsspec_transient)
            log.debug("uploaded %s (%d bytes) to %s/%s", f.name, f.size, target.url, f.name)
    return target.url


def _put_one(fs: Any, root: str, f: UploadFile, local: bool, bar: _Progress) -> None:
    """Upload one file so that it appears whole or not at all, then check the stored size."""
    remote = f"{root}/{f.name}"
    callback = bar.fsspec_callback(f)
    if local:
        # A local copy is not atomic: copy to a hidden name, then rename.
        parent, _, base = remote.rpartition("/")
        fs.makedirs(parent or "/", exist_ok=True)
        tmp = f"{parent}/.{base}.shardsafe-push-{uuid.uuid4().hex[:12]}"
        try:
            fs.put_file(str(f.path), tmp, callback=callback)
            fs.mv(tmp, remote)
        except BaseException:
            try:
                if fs.exists(tmp):
                    fs.rm_file(tmp)
            except Exception:
                pass
            raise
    else:
        # An object-store PUT (or multipart upload) is atomic: the object appears only once complete.
        fs.put_file(str(f.path), remote, callback=callback)
    stored = fs.info(remote).get("size")
    if stored != f.size:
        raise PushError(f"{remote}: the store holds {stored} bytes after the upload, the local file {f.path} had {f.size} (changed while pushing?)")
    bar.finished(f)


def _markers_at(fs: Any, root: str, candidates: list[str]) -> list[str]:
    """Which of ``candidates`` (paths below ``root``) exist: one listing for the top level, a look-up for each deeper one."""
    try:
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    except FileNotFoundError:  # nothing there yet (or no bucket: the first upload says so)
        return []
    return [m for m in candidates if (m in names if "/" not in m else fs.exists(f"{root}/{m}"))]


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _fsspec_transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if _transport_error(exc):
        return True
    return isinstance(exc, OSError)  # s3fs turns throttling and 5xx answers into a plain OSError/IOError


# ----------------------------------------------------------------------------- Hugging Face Hub


def _push_hub(plan: UploadPlan, target: Destination, *, revision: str | None, private: bool, message: str | None, progress: bool) -> str:
    try:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:
        raise PushError(f"{target.url}: pushing to the Hub needs huggingface_hub (pip install huggingface_hub)") from None
    where = _where(plan, target)
    api = HfApi()
    repo_id = target.repo_id
    # private=None (not False) when not asked for: a new repo then follows the namespace's default visibility
    _with_retries(lambda: api.create_repo(repo_id, private=private or None, exist_ok=True), "creating the repo", where, _hub_transient)
    if revision is not None and revision != "main":
        _with_retries(lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), f"creating the branch {revision}", where, _hub_transient)

    # A commit marker of another kind left by an earlier push would shadow this model (transformers
    # prefers model.safetensors to an index): delete it in the same commit.
    existing = set(_with_retries(lambda: api.list_repo_files(repo_id, revision=revision), "listing the repo", where, _hub_transient))
    names = {f.name for f in plan.files}
    stale = sorted(m for m in COMMIT_MARKERS.values() if m in existing and m not in names)

    tracked_add = _tracked_add_class(CommitOperationAdd)
    # Our bar counts the bytes of LFS uploads; huggingface_hub's own bars (files done) would only
    # clutter it. Xet uploads bypass our counting, so there its byte bars stay on when progress is.
    hide_hf_bars = not (progress and _xet_enabled())
    hf_bars_were_off = are_progress_bars_disabled()
    with _Progress(plan.total_bytes, f"push {target.url}", progress) as bar:
        operations: list[Any] = []
        for f in plan.files:
            try:
                op = tracked_add(path_in_repo=f.name, path_or_fileobj=str(f.path))
            except (OSError, ValueError) as exc:
                raise PushError(f"{where}: cannot read {f.name}: {_describe(exc)}") from exc
            op.shardsafe_progress = (bar, f)
            operations.append(op)
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        if hide_hf_bars:
            disable_progress_bars()
        try:
            info = _with_retries(
                lambda: api.create_commit(repo_id, operations, commit_message=message or DEFAULT_MESSAGE, revision=revision),
                f"committing {len(plan.files)} files ({', '.join(f.name for f in plan.files[:3])}{', ...' if len(plan.files) > 3 else ''})",
                where,
                _hub_transient,
            )
        finally:
            if hide_hf_bars and not hf_bars_were_off:
                enable_progress_bars()
        for f in plan.files:
            bar.finished(f)
    url = str(getattr(info, "commit_url", None) or info)
    log.info("pushed %s to %s in one commit: %s", plan.folder, target.url, url)
    return url


def _xet_enabled() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


_TRACKED_ADD: Any = None


def _tracked_add_class(base: Any) -> Any:
    """``CommitOperationAdd`` whose uploads (the LFS PUT of the file) advance our bytes progress bar."""
    global _TRACKED_ADD
    if _TRACKED_ADD is not None and _TRACKED_ADD.__mro__[1] is base:
        return _TRACKED_ADD

    class TrackedAdd(base):  # type: ignore[misc, valid-type]
        shardsafe_progress: tuple[_Progress, UploadFile] | None = None

        @contextmanager
        def as_file(self, with_tqdm: bool = False) -> Iterator[Any]:
            tracked = self.shardsafe_progress
            if not with_tqdm or tracked is None or not isinstance(self.path_or_fileobj, str):
                with super().as_file(with_tqdm=with_tqdm) as file:
                    yield file
                return
            bar, f = tracked
            with open(self.path_or_fileobj, "rb") as file:
                read = file.read

                def tracked_read(size: int | None = -1) -> bytes:
                    data = read(size)
                    bar.reached(f, file.tell())
                    return data

                file.read = tracked_read  # type: ignore[method-assign]
                yield file

    _TRACKED_ADD = TrackedAdd
    return TrackedAdd


def _hub_transient(exc: BaseException) -> bool:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status in _RETRY_STATUS
        if _transport_error(e):
            return True
    return False


# ----------------------------------------------------------------------------- retries, errors, progress


def _with_retries(action: Callable[[], T], what: str, where: str, transient: Callable[[BaseException], bool]) -> T:
    """``action()``, retried with exponential backoff while it fails transiently, at most MAX_ATTEMPTS times."""
    delay = BACKOFF_S
    attempt = 1
    while True:
        try:
            return action()
        except ShardsafeError as exc:
            if isinstance(exc, PushError) and not str(exc).startswith(where):
                raise PushError(f"{where}: {what} failed: {exc}") from exc
            raise
        except Exception as exc:
            if attempt >= MAX_ATTEMPTS or not transient(exc):
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise PushError(f"{where}: {what} failed{tries}: {_describe(exc)}") from exc
            log.warning("%s: %s failed (attempt %d of %d), retrying in %.1fs: %s", where, what, attempt, MAX_ATTEMPTS, delay, _describe(exc))
        time.sleep(delay)
        delay = min(MAX_BACKOFF_S, delay * 2)
        attempt += 1


def _where(plan: UploadPlan, target: Destination) -> str:
    return f"push {plan.folder} -> {target.url}"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _transport_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)


def _describe(exc: BaseException) -> str:
    """One line: the error and what caused it (HTTP errors span several lines)."""
    parts = []
    for e in list(_chain(exc))[:3]:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        if len(text) > 400:
            text = text[:397] + "..."
        parts.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)
    return " <- ".join(parts)


class _Progress:
    """A bytes progress bar over all files, fed from several threads; each file counts up to its size once."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, leave=True)
        self._lock = threading.Lock()
        self._done: dict[str, int] = {}

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def reached(self, f: UploadFile, position: int) -> None:
        with self._lock:
            before = self._done.get(f.name, 0)
            now = max(before, min(int(position), f.size))
            if now > before:
                self._done[f.name] = now
                self._bar.update(now - before)

    def finished(self, f: UploadFile) -> None:
        self.reached(f, f.size)

    def fsspec_callback(self, f: UploadFile) -> Any:
        from fsspec.callbacks import Callback

        progress = self

        class _FileCallback(Callback):  # type: ignore[misc]
            def call(self, *args: Any, **kwargs: Any) -> None:
                progress.reached(f, self.value)

        return _FileCallback()


# ----------------------------------------------------------------------------- CLI
