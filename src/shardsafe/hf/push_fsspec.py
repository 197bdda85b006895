"""Push to an object store or any fsspec filesystem (``s3://bucket/prefix``, ``file:///path``).

There is no commit on an object store, so order is the protocol: the destination's old commit
markers are deleted first (an older model becomes invisible before any of its files is
replaced), then every data file is uploaded, then the commit marker last. A reader that finds the
marker finds a complete model; an interrupted push leaves no marker. Each file appears whole or
not at all: an object-store PUT (or multipart upload) only creates the object once complete, and
on a local filesystem each file is copied to a hidden ``PUSH_MARK`` name and renamed. ``fsspec``
and its backend (``s3fs`` for ``s3://``) are imported only here, when a push needs them.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from shardsafe.core.faults import crash_point
from shardsafe.errors import PushError
from shardsafe.hf.push_plan import Destination, UploadFile, UploadPlan, where
from shardsafe.hf.push_retry import Progress, transport_error, with_retries
from shardsafe.protocol.temppath import PUSH_MARK, hidden_name
from shardsafe.storage.local import fsync_dir, fsync_file, make_dirs

__all__ = ["push_fsspec"]

log = logging.getLogger("shardsafe.hf.push")

_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def push_fsspec(plan: UploadPlan, target: Destination, *, progress: bool) -> str:
    """Upload ``plan`` to the fsspec URL ``target``, commit marker last; returns the URL."""
    try:
        import fsspec
    except ImportError:
        raise PushError(f"{target.url}: pushing to an object store needs fsspec (pip install fsspec s3fs)") from None
    at = where(plan, target)
    try:
        fs, root = fsspec.core.url_to_fs(target.url, skip_instance_cache=True)
    except ImportError as exc:
        raise PushError(f"{target.url}: no fsspec backend for this protocol: {exc}") from None
    except ValueError as exc:
        raise PushError(f"{target.url}: not a usable fsspec URL: {exc}") from None
    root = str(root).rstrip("/")
    local = "file" in _protocols(fs)

    # An older model at the destination becomes invisible before any of its files is replaced.
    for marker in with_retries(
        lambda: _markers_at(fs, root, plan.marker_names), "listing the destination", at, fsspec_transient
    ):
        with_retries(
            functools.partial(fs.rm_file, f"{root}/{marker}"), f"removing the old {marker}", at, fsspec_transient
        )
        if local:  # durably: after a power cut the old marker must not come back over half-replaced files
            fsync_dir(Path(f"{root}/{marker}").parent)
        log.info("%s: removed the commit marker %s of an earlier upload", target.url, marker)

    with Progress(plan.total_bytes, f"push {target.url}", progress) as bar:
        for f in plan.files:
            if f.name == plan.marker:
                crash_point("push:before-marker", 0)
            # looked up at each call, so tests can wrap the upload of one file
            with_retries(
                functools.partial(_put_one, fs, root, f, local, bar), f"uploading {f.name}", at, fsspec_transient
            )
            log.debug("uploaded %s (%d bytes) to %s/%s", f.name, f.size, target.url, f.name)
    return target.url


def _put_one(fs: Any, root: str, f: UploadFile, local: bool, bar: Progress) -> None:
    """Upload one file so that it appears whole or not at all, then check the stored size."""
    remote = f"{root}/{f.name}"
    callback = bar.fsspec_callback(f)
    if local:
        # A local copy is not atomic: copy to a hidden name, then rename.
        # Durable before the next file (and so before the marker): its data, then its name (new folders: as they are
        # made).
        parent, _, base = remote.rpartition("/")
        make_dirs(Path(parent or "/"))
        tmp = f"{parent}/{hidden_name(base, PUSH_MARK)}"
        try:
            fs.put_file(str(f.path), tmp, callback=callback)
            fsync_file(tmp)
            fs.mv(tmp, remote)
            fsync_dir(Path(parent or "/"))
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
        raise PushError(
            f"{remote}: the store holds {stored} bytes after the upload, the local file {f.path} had {f.size} (changed "
            "while pushing?)"
        )
    bar.finished(f)


def _markers_at(fs: Any, root: str, candidates: list[str]) -> list[str]:
    """Which of ``candidates`` (paths below ``root``) exist: one listing for the top level, a look-up for each deeper
    one."""
    try:
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    except FileNotFoundError:  # nothing there yet (or no bucket: the first upload says so)
        return []
    return [m for m in candidates if (m in names if "/" not in m else fs.exists(f"{root}/{m}"))]


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def fsspec_transient(exc: BaseException) -> bool:
    """Worth retrying on an object store: transport errors, and the plain OSError s3fs makes of throttling and 5xx."""
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if transport_error(exc):
        return True
    return isinstance(exc, OSError)
