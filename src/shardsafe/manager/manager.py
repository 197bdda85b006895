"""CheckpointManager: when to save, which checkpoints to keep, where to resume from.

One object per training job, used identically on every rank::

    with shardsafe.CheckpointManager("ckpt", keep_last=3, keep_best=1, best_metric="loss",
                                     save_every=100, async_save=True) as manager:
        start = (manager.restore(state) or 0) + 1
        for step in range(start, total + 1):
            loss = train_step()
            manager.save(step, state, metrics={"loss": loss})
            if manager.stop_requested:      # SIGTERM/SIGUSR1 with handle_preemption=True
                break

Checkpoints are ``root/step-0000000100`` folders (lexical order = numeric order), each a normal
shardsafe checkpoint whose manifest metadata records the step and metrics, so retention and
``shardsafe list`` work from the folder alone after a restart.

Async saves block the training loop only while the local state is copied into host staging
buffers (reused across saves); writing, hashing, the commit and retention run in a background
thread that talks to the other ranks over its own gloo process group, never the training's.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardsafe.api.checkpoint import describe_collectively, load, location, write_checkpoint
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.faults import crash_point
from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, RETAINED_MANIFEST_NAME, Manifest, parse_manifest
from shardsafe.core.plan import LocalChunk
from shardsafe.errors import CheckpointNotFoundError, FormatError, IntegrityError, SaveError, ShardsafeError
from shardsafe.protocol.commit import is_committed
from shardsafe.protocol.temppath import DELETING_MARK, OLD_MARK, TMP_MARK
from shardsafe.protocol.transfer import ReuseMap, reuse_map
from shardsafe.state.registry import SaveView
from shardsafe.storage.local import fsync_dir, read_small_file, remove_tree
from shardsafe.storage.remote import RemoteDir

log = logging.getLogger("shardsafe")

STEP_DIGITS = 10
STEP_RE = re.compile(r"^step-(\d+)$")
META_KEY = "shardsafe.manager"


def step_name(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}"


@dataclass
class CheckpointInfo:
    step: int
    path: Path | RemoteDir
    size: int
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    best: bool = False
    latest: bool = False


Root = Path | RemoteDir


def _child(root: Root, name: str) -> Root:
    return root.child(name) if isinstance(root, RemoteDir) else root / name


def _has_manifest(folder: Root) -> bool:
    return folder.exists(MANIFEST_NAME) if isinstance(folder, RemoteDir) else is_committed(folder)


def _read_manifest(folder: Root) -> Manifest:
    if isinstance(folder, RemoteDir):
        return parse_manifest(folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES), f"{folder.url}/{MANIFEST_NAME}")
    return parse_manifest(read_small_file(folder / MANIFEST_NAME, MAX_JSON_BYTES), str(folder / MANIFEST_NAME))


def _step_folders(root: Root) -> list[str]:
    if isinstance(root, RemoteDir):
        return [name for name in root.list() if STEP_RE.match(name)]
    if not root.is_dir():
        return []
    return [e.name for e in os.scandir(root) if STEP_RE.match(e.name) and e.is_dir(follow_symlinks=False)]


def committed_steps(root: Root) -> list[int]:
    """Steps with a committed (manifest-bearing) folder, ascending."""
    return sorted(int(name[len("step-") :]) for name in _step_folders(root) if _has_manifest(_child(root, name)))


def read_info(root: Root, step: int, read: Callable[[Root], Manifest] = _read_manifest) -> CheckpointInfo:
    path = _child(root, step_name(step))
    manifest = read(path)
    meta = manifest.metadata.get(META_KEY)
    metrics = meta.get("metrics") if isinstance(meta, dict) else None
    return CheckpointInfo(step, path, manifest.total_bytes, dict(metrics) if isinstance(metrics, dict) else {}, manifest.created)


def _metric_value(info: CheckpointInfo, metric: str | None) -> float | None:
    if metric is None:
        return None
    value = info.metrics.get(metric)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return None


def choose_kept(
    infos: list[CheckpointInfo], keep_last: int | None, keep_best: int | None, best_metric: str | None, best_mode: str
) -> tuple[set[int], int | None]:
    """Steps to keep and the best step. The latest and the best are always kept."""
    steps = sorted(i.step for i in infos)
    if not steps:
        return set(), None
    scored = [(v, i.step) for i in infos if (v := _metric_value(i, best_metric)) is not None]
    ranked = sorted(scored, key=lambda vs: (vs[0] if best_mode == "min" else -vs[0], -vs[1]))
    best = ranked[0][1] if ranked else None
    if keep_last is None and keep_best is None:
        return set(steps), best
    keep = {steps[-1]}
    if best is not None:
        keep.add(best)
    if keep_last is not None:
        keep.update(steps[-keep_last:] if keep_last > 0 else [])
    if keep_best is not None:
        keep.update(step for _, step in ranked[:keep_best])
    return keep, best


def references(root: Root, steps: list[int] | None = None, read: Callable[[Root], Manifest] = _read_manifest) -> dict[str, set[str]]:
    """Folder name -> its files that the given committed checkpoints (default: all) point into."""
    out: dict[str, set[str]] = {}
    for step in committed_steps(root) if steps is None else steps:
        manifest = read(_child(root, step_name(step)))
        for entry in manifest.tensors.values():
            for chunk in entry.chunks:
                if chunk.checkpoint is not None:
                    out.setdefault(chunk.checkpoint, {RETAINED_MANIFEST_NAME}).add(chunk.file)
    return out


def retire(root: Root, step: int, keep_files: set[str] | None = None) -> None:
    """Make a checkpoint disappear atomically, then delete its data.

    Unreferenced: rename to a hidden name, then delete; a crash between the two leaves only a
    hidden folder for ``gc``. Referenced by a kept checkpoint (stored-once data): remove its
    manifest first (it is no longer a checkpoint), then every file nothing points into.
    """
    crash_point("retention:before-rename", 0)
    if isinstance(root, RemoteDir):
        _retire_remote(root.child(step_name(step)), keep_files or set())
        return
    folder = root / step_name(step)
    if keep_files:
        os.replace(folder / MANIFEST_NAME, folder / RETAINED_MANIFEST_NAME)  # kept: readers check references against it
        fsync_dir(folder)
        crash_point("retention:after-rename", 0)
        _remove_unreferenced(folder, keep_files)
        return
    hidden = root / f".{folder.name}{DELETING_MARK}{uuid.uuid4().hex[:12]}"
    os.rename(folder, hidden)
    fsync_dir(root)
    crash_point("retention:after-rename", 0)
    (hidden / MANIFEST_NAME).unlink(missing_ok=True)  # first, so no part of it can pass for a checkpoint again
    crash_point("retention:mid-delete", 0)
    remove_tree(hidden)


def _retire_remote(folder: RemoteDir, keep: set[str]) -> None:
    """No rename on object stores: deleting the manifest (the commit marker) retires it at once."""
    if keep:  # readers check references into the kept files against the retained manifest
        folder.write_bytes(RETAINED_MANIFEST_NAME, folder.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES))
    folder.remove([MANIFEST_NAME])
    crash_point("retention:after-rename", 0)
    folder.remove([name for name in folder.list() if name not in keep])


def _remove_unreferenced(folder: Path, keep: set[str]) -> list[Path]:
    removed = []
    for entry in os.scandir(folder):
        if entry.name not in keep:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                remove_tree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed


def list_checkpoints(root: str | os.PathLike[str], best_metric: str | None = None, best_mode: str | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` with sizes and metrics; marks the latest and the best.

    The best metric and mode default to what the manager recorded in the newest checkpoint.
    """
    where = location(root)
    infos = [read_info(where, s) for s in committed_steps(where)]
    if not infos:
        return infos
    if best_metric is None:
        meta = _manager_meta(infos[-1].path)
        best_metric = meta.get("best_metric")
        best_mode = best_mode or meta.get("best_mode")
    _, best = choose_kept(infos, None, None, best_metric, best_mode or "min")
    for info in infos:
        info.best = info.step == best
    infos[-1].latest = True
    return infos


def _manager_meta(path: Root) -> dict[str, Any]:
    manifest = _read_manifest(path)
    meta = manifest.metadata.get(META_KEY)
    return meta if isinstance(meta, dict) else {}


def collect_garbage(root: str | os.PathLike[str], *, dry_run: bool = False, min_age: float = 0.0) -> list[Path | str]:
    """Remove what interrupted saves and deletions left: hidden temporary, old and deleting folders,
    and step folders without a manifest. Only entries older than ``min_age`` seconds are touched,
    so a save in progress in another job is not disturbed. Returns what was (or would be) removed.
    """
    where = location(root)
    if isinstance(where, RemoteDir):
        return _collect_remote_garbage(where, dry_run, min_age)
    root = where
    now = time.time()
    referenced = references(root)
    garbage: list[Path | str] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name) if root.is_dir() else []:
        if not entry.is_dir(follow_symlinks=False) or now - entry.stat(follow_symlinks=False).st_mtime < min_age:
            continue
        path = Path(entry.path)
        hidden = entry.name.startswith(".") and any(mark in entry.name for mark in (TMP_MARK, OLD_MARK, DELETING_MARK))
        abandoned = STEP_RE.match(entry.name) is not None and not is_committed(path)
        original = _moved_aside_from(root, entry.name)
        if original is not None:
            # An overwrite without RENAME_EXCHANGE died between its two renames: this is the only
            # copy of the checkpoint. Put it back rather than delete it.
            garbage.append(path)
            if not dry_run:
                if original.exists():
                    original.rmdir()  # an empty folder left in its place
                os.rename(path, original)
                fsync_dir(root)
                log.warning("shardsafe: restored %s from %s (an overwrite was interrupted between its two renames)", original, path)
            continue
        if abandoned and entry.name in referenced:
            keep = referenced[entry.name]
            extra = [Path(e.path) for e in os.scandir(path) if e.name not in keep]
            garbage += extra
            if not dry_run:
                _remove_unreferenced(path, keep)
        elif hidden or abandoned:
            garbage.append(path)
            if not dry_run:
                remove_tree(path)
    return garbage


def _moved_aside_from(root: Path, name: str) -> Path | None:
    """For ``.NAME.shardsafe-old-ID`` holding a committed checkpoint while NAME holds none: NAME."""
    if not name.startswith(".") or OLD_MARK not in name:
        return None
    original = root / name[1:].rsplit(OLD_MARK, 1)[0]
    if not original.name or is_committed(original) or not is_committed(root / name):
        return None
    if original.exists() and (not original.is_dir() or any(original.iterdir())):
        return None
    return original


def _collect_remote_garbage(root: RemoteDir, dry_run: bool, min_age: float) -> list[Path | str]:
    """Step prefixes without a manifest (interrupted saves or retirements), minus referenced data.

    A prefix holding any object younger than ``min_age`` (or of unknown age) is left alone: it may
    be a save in progress in another job, whose manifest is simply not written yet.
    """
    referenced = references(root)
    garbage: list[Path | str] = []
    now = time.time()
    for name in _step_folders(root):
        folder = root.child(name)
        if folder.exists(MANIFEST_NAME):
            continue
        present = folder.list()
        if min_age > 0 and any((stamp := folder.modified(n)) is None or now - stamp < min_age for n in present):
            log.info("shardsafe gc: %s has objects younger than %.0f s (a save in progress?); left alone", folder.url, min_age)
            continue
        doomed = [n for n in present if n not in referenced.get(name, set())]
        garbage += [f"{folder.url}/{n}" for n in doomed]
        if not dry_run:
            folder.remove(doomed)
    return garbage


class _ManifestCache:
    """Parsed manifests of local checkpoints, reused while the manifest file is the same file.

    Retention reads every committed manifest after each save (and a dedup save checks references
    first); parsing and validating them all again each time is pure Python that, during an async
    save, holds the GIL the training loop needs. A re-saved or replaced checkpoint has a new
    manifest file (new inode), so it is read again; object-store roots are not cached.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[int, int, int], Manifest]] = {}

    def __call__(self, folder: Root) -> Manifest:
        if isinstance(folder, RemoteDir):
            return _read_manifest(folder)
        try:
            st = os.stat(folder / MANIFEST_NAME)
        except OSError:
            return _read_manifest(folder)  # raises the usual error
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        entry = self._entries.get(str(folder))
        if entry is None or entry[0] != key:
            entry = (key, _read_manifest(folder))
            self._entries[str(folder)] = entry
        return entry[1]

    def forget(self, folder: Root) -> None:
        self._entries.pop(str(folder), None)


class _Staging:
    """Host buffers the state is copied into for an async save, reused from one save to the next."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def prepare(self, view: SaveView) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Point the view's chunks at staging buffers; returns the (buffer, source) copies to make."""
        copies = []
        used = set()
        for i, chunk in enumerate(view.chunks):
            ident = (chunk.key, chunk.offsets)
            source = chunk.tensor.detach()
            buffer = self.buffers.get(ident)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[ident] = buffer
            used.add(ident)
            copies.append((buffer, source))
            view.chunks[i] = LocalChunk(chunk.key, buffer, chunk.global_shape, chunk.offsets)
        for ident in set(self.buffers) - used:
            del self.buffers[ident]
        return copies


def copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, source in copies:
            buffer.copy_(source, non_blocking=source.is_cuda)
        if any(source.is_cuda for _, source in copies):
            torch.cuda.synchronize()


class CheckpointManager:
    """Saves every ``save_every`` steps, keeps the last/best checkpoints, resumes, handles preemption.

    ``async_save``: False (write in the call), True (copy to staging buffers in the call, write in
    the background), or ``"overlap"`` (the copy itself runs in the background during the next
    forward/backward; every optimizer in the saved state waits for it before its ``step()``, so the
    saved state is exactly the state at the save call; do not modify saved tensors in place
    other than through those optimizers until the next ``step()``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        save_every: int | None = None,
        async_save: bool | str = False,
        process_group: Any = None,
        handle_preemption: bool = False,
        preemption_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
        fsync: bool = True,
        dedup: bool = False,
    ) -> None:
        """``dedup``: a chunk whose bytes equal its counterpart in the newest earlier checkpoint is
        referenced rather than written (frozen weights of a fine-tune are stored once); costs one
        extra hash pass over chunks that have a counterpart."""
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metrics key to rank checkpoints by)")
        if async_save not in (False, True, "overlap"):
            raise ValueError(f"async_save must be False, True or 'overlap', not {async_save!r}")
        self.root = location(root)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.save_every = save_every
        self.async_save = async_save
        self.fsync = fsync
        self.dedup = dedup
        self.comm = get_comm(process_group)
        self._background_comm = self._make_background_comm() if async_save else self.comm
        self._staging = _Staging()
        self._manifests = _ManifestCache()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: BaseException | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._preempt_signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.stop_requested = False
        self.skipped: list[tuple[int, str]] = []  # (step, reason) of damaged checkpoints restore passed over
        self.retention_errors: list[str] = []  # retention failures (coordinator; logged, not raised)
        if handle_preemption:
            self._install_signal_handlers(preemption_signals)

    # ------------------------------------------------------------------ queries

    def step_path(self, step: int) -> Path | RemoteDir:
        return _child(self.root, step_name(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.root)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return self.save_every is not None and step % self.save_every == 0

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Save ``state`` as ``step`` if it is due (or ``force``). Collective. Returns True if it saved.

        Raises the error of a previous background save, if one failed.
        """
        self._raise_background_error()
        preempted = self._agree_on_preemption()
        if not (force or preempted or self.should_save(step)):
            return False
        self.wait()
        if self.dedup:
            self._check_not_referenced(step)
        metadata = {META_KEY: {"step": step, "metrics": dict(metrics or {}), "best_metric": self.best_metric, "best_mode": self.best_mode}}
        view = describe_collectively(state, self.comm)
        if not self.async_save or preempted:
            self._write(step, view, metadata)
        else:
            copies = self._staging.prepare(view)
            if self.async_save == "overlap":
                self._copied.clear()
                self._hook_optimizers(state)
            else:
                copy_all(copies)
            self._thread = threading.Thread(target=self._background, args=(step, view, metadata, copies), name="shardsafe-save", daemon=True)
            self._thread.start()
        if preempted:
            self.stop_requested = True
            log.warning("shardsafe: signal %s received; saved step %d, stop training now", self._preempt_signal, step)
        return True

    def _write(self, step: int, view: SaveView, metadata: dict[str, Any], comm: Comm | None = None) -> None:
        reuse = self._reuse_map(step) if self.dedup else None
        write_checkpoint(self.step_path(step), view, comm or self.comm, overwrite=True, metadata=metadata, fsync=self.fsync, reuse=reuse)
        if (comm or self.comm).is_coordinator:
            try:
                self.apply_retention()
            except Exception as exc:  # the save is committed; raising here, on the coordinator alone, would split the ranks
                log.warning("shardsafe: retention after saving step %d failed (retried after the next save): %s", step, exc)
                self.retention_errors.append(f"step {step}: {type(exc).__name__}: {exc}")

    def _background(self, step: int, view: SaveView, metadata: dict[str, Any], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            if not self._copied.is_set():
                try:
                    copy_all(copies)
                finally:
                    self._copied.set()
            crash_point("async:before-write", self.comm.rank)
            self._write(step, view, metadata, self._background_comm)
        except BaseException as exc:  # surfaced by the next call
            self._error = exc

    def _reuse_map(self, step: int) -> ReuseMap | None:
        """Chunks of the newest other checkpoint, for storing unchanged tensors once."""
        earlier = [s for s in self.steps() if s != step]
        if not earlier:
            return None
        name = step_name(earlier[-1])
        return reuse_map(self._manifests(_child(self.root, name)), name)

    def _check_not_referenced(self, step: int) -> None:
        name = step_name(step)
        if name in references(self.root, [s for s in self.steps() if s != step], self._manifests):
            raise SaveError(
                f"{self.step_path(step)}: other checkpoints store tensors in this folder (dedup); "
                "it cannot be overwritten - delete the later checkpoints first or save under another step"
            )

    def apply_retention(self) -> list[int]:
        """Delete checkpoints outside keep_last/keep_best (coordinator only). Returns deleted steps."""
        if not self.comm.is_coordinator or (self.keep_last is None and self.keep_best is None):
            return []
        infos = [read_info(self.root, s, self._manifests) for s in committed_steps(self.root)]
        keep, _ = choose_kept(infos, self.keep_last, self.keep_best, self.best_metric, self.best_mode)
        doomed = [i.step for i in infos if i.step not in keep]
        if doomed:
            still_needed = references(self.root, sorted(keep), self._manifests)
            for step in doomed:
                self._manifests.forget(self.step_path(step))
                retire(self.root, step, still_needed.get(step_name(step)))
        return doomed

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, ShardsafeError):
                raise SaveError(f"background save failed: {exc}") from exc
            raise SaveError(f"background save failed: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ overlap mode

    def _hook_optimizers(self, state: dict[str, Any]) -> None:
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked.add(id(value))
                self._hooks.append(value.register_step_pre_hook(self._wait_for_copy))

    def _wait_for_copy(self, *args: Any, **kwargs: Any) -> None:
        self._copied.wait()

    # ------------------------------------------------------------------ restore

    def restore(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load the newest committed checkpoint that loads cleanly (or ``step``). Collective.

        A damaged checkpoint (missing file, hash mismatch, bad manifest) is reported and skipped
        in favour of the next older one. Returns the step loaded, or None if there is none.
        """
        self.wait()
        candidates = [step] if step is not None else list(reversed(self.comm.broadcast(self.steps())))
        for candidate in candidates:
            try:
                load(self.step_path(candidate), state, process_group=self.comm.group, strict=strict)
                return candidate
            except (IntegrityError, FormatError, CheckpointNotFoundError) as exc:
                if step is not None:
                    raise
                log.warning("shardsafe: skipping damaged checkpoint %s: %s", self.step_path(candidate), exc)
                self.skipped.append((candidate, str(exc)))
        return None

    # ------------------------------------------------------------------ preemption

    def _install_signal_handlers(self, signals: tuple[int, ...]) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            self._preempt_signal = signum

        for sig in signals:
            self._previous_handlers[sig] = signal.signal(sig, on_signal)

    def _agree_on_preemption(self) -> bool:
        if not self._previous_handlers:
            return False
        return any(self.comm.all_gather(self._preempt_signal is not None))

    # ------------------------------------------------------------------ lifecycle

    def _make_background_comm(self) -> Comm:
        if not self.comm.distributed:
            return self.comm
        group = dist.new_group(ranks=self._group_ranks(), backend="gloo")
        return Comm(group, self.comm.rank, self.comm.world_size)

    def _group_ranks(self) -> list[int]:
        if self.comm.group is dist.GroupMember.WORLD:
            return list(range(self.comm.world_size))
        return [dist.get_global_rank(self.comm.group, r) for r in range(self.comm.world_size)]

    def close(self) -> None:
        """Finish the save in flight, restore signal handlers, raise any background error."""
        try:
            self.wait()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._hooked.clear()
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except SaveError as close_error:
                log.error("shardsafe: %s", close_error)


__all__ = ["CheckpointInfo", "CheckpointManager", "collect_garbage", "list_checkpoints", "step_name"]
