"""What a root holds: its committed checkpoints, what each records, and which ones are damaged.

Every question about the checkpoints of a root is answered from the folders alone (no side
database), so it survives restarts and works on any copy of the root: a step folder with a
manifest is a checkpoint; its manifest records the size, the creation time, and the metrics and
best-metric settings the manager saved with it.

A damaged checkpoint (a manifest that is unreadable, truncated or fails validation) must not stop
the root from working: :func:`scan` passes over it, names it in a warning and returns it in
:attr:`Catalog.damaged`, and retention, dedup, ``list`` and ``gc`` each decide what that means for
them (in short: it is never counted, never deleted, never reused).

*Who wrote a checkpoint* is a catalog question too: every manager, ShardsafeTrainer and Accelerate
save records the ``run_id`` of the lease it held (:mod:`.lease`), and :func:`refuse_other_runs_step`
applies the one rule all three share before they write a step that is already committed.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardsafe.api.checkpoint import location
from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, RETAINED_MANIFEST_NAME, Manifest, parse_manifest
from shardsafe.errors import CheckpointExistsError, FormatError, ShardsafeError
from shardsafe.manager.naming import STEP_NAMING, StepNaming
from shardsafe.storage.local import FileStamp
from shardsafe.storage.location import as_location, public_path
from shardsafe.storage.remote import RemoteDir

__all__ = [
    "Catalog",
    "CheckpointInfo",
    "DamagedCheckpoint",
    "META_KEY",
    "ManifestCache",
    "child",
    "committed_steps",
    "describe_writer",
    "has_manifest",
    "list_checkpoints",
    "list_root",
    "metric_value",
    "ranked",
    "read_manifest",
    "references",
    "refuse_other_runs_step",
    "refuse_renamed_step",
    "scan",
    "step_folders",
    "warn_damaged",
    "where",
]

log = logging.getLogger("shardsafe")

META_KEY = "shardsafe.manager"  # manifest metadata the manager records: step, metrics, best-metric settings

Root = Path | RemoteDir
ReadManifest = Callable[[Root], Manifest]


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed, readable checkpoint of a root."""

    step: int
    path: Path | str  # a local folder, or the URL of an object-store prefix
    size: int
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    best: bool = False
    latest: bool = False
    run_id: str | None = None  # the run that wrote it (its lease), None for checkpoints written without one
    lease_epoch: int | None = None


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A committed checkpoint whose manifest cannot be read: skipped, never deleted."""

    step: int
    path: Path | RemoteDir
    reason: str


def where(path: Root) -> str:
    """A path or URL to print."""
    return as_location(path).url


def child(root: Root, name: str) -> Root:
    return as_location(root).child(name).native


def has_manifest(folder: Root) -> bool:
    return as_location(folder).exists(MANIFEST_NAME)


def read_manifest(folder: Root) -> Manifest:
    """Parse and validate ``folder``'s manifest (bounded read; raises FormatError/OSError on damage)."""
    # locally: never through a symlink out of the folder (its content could end up in an error)
    loc = as_location(folder)
    return parse_manifest(loc.read_bytes(MANIFEST_NAME, MAX_JSON_BYTES), f"{loc.url}/{MANIFEST_NAME}")


def step_folders(root: Root, naming: StepNaming = STEP_NAMING) -> dict[int, str]:
    """Step -> folder name of every entry of ``root`` named as a step folder (committed or not)."""
    return {step: name for name in as_location(root).folders() if (step := naming.parse(name)) is not None}


def committed_steps(root: Root, naming: StepNaming = STEP_NAMING) -> list[int]:
    """Steps with a committed (manifest-bearing) folder, ascending. Reads no manifest."""
    return sorted(step for step, name in step_folders(root, naming).items() if has_manifest(child(root, name)))


def info_of(step: int, path: Root, manifest: Manifest) -> CheckpointInfo:
    metrics = manager_meta(manifest).get("metrics")
    run_id, epoch = writer_of(manifest)
    return CheckpointInfo(
        step,
        public_path(path),
        manifest.total_bytes,
        dict(metrics) if isinstance(metrics, dict) else {},
        manifest.created,
        run_id=run_id,
        lease_epoch=epoch,
    )


def manager_meta(manifest: Manifest, key: str = META_KEY) -> dict[str, Any]:
    """What the writer recorded under ``key`` in the manifest metadata (the manager's by default; the Trainer and
    Accelerate use their own keys)."""
    meta = manifest.metadata.get(key)
    return meta if isinstance(meta, dict) else {}


def refuse_renamed_step(manifest: Manifest, step: int, where: str, key: str = META_KEY) -> None:
    """Raise :class:`FormatError` when ``manifest`` records another step than ``step``, the one its folder's
    name says: a folder renamed by hand (or crafted) would restore as a step it is not, and the run
    would then continue, and save, under another run's step names."""
    recorded = manager_meta(manifest, key).get("step")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded != step:
        raise FormatError(
            f"{where}: the folder's name says step {step} but its manifest records step {recorded} "
            "(renamed or copied by hand?); give it back its name, or remove it"
        )


def writer_of(manifest: Manifest, key: str = META_KEY) -> tuple[str | None, int | None]:
    """The run id and lease epoch recorded in ``manifest`` (None for what was saved without a lease)."""
    meta = manager_meta(manifest, key)
    run_id, epoch = meta.get("run_id"), meta.get("lease_epoch")
    return (
        run_id if isinstance(run_id, str) else None,
        epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
    )


def describe_writer(folder: Root, read: ReadManifest = read_manifest, key: str = META_KEY) -> tuple[str | None, str]:
    """The run id that wrote the checkpoint ``folder`` (or None) and how to name the writer in a message."""
    try:
        run_id, epoch = writer_of(read(folder), key)
    except (ShardsafeError, OSError) as exc:
        return None, f"an unknown run (its manifest cannot be read: {type(exc).__name__})"
    if run_id is None:
        return None, "no recorded run (saved without a lease, e.g. by shardsafe.save)"
    return run_id, f"run {run_id} (lease epoch {epoch if epoch is not None else 'unknown'})"


def refuse_other_runs_step(
    root: Root,
    step: int,
    run_id: str | None,
    restored: Collection[int],
    remedy: str,
    *,
    naming: StepNaming = STEP_NAMING,
    key: str = META_KEY,
    read: ReadManifest = read_manifest,
) -> None:
    """Raise :class:`CheckpointExistsError` if saving ``step`` would replace another run's committed checkpoint.

    The run-identity rule (docs/MANAGER.md, "Which run wrote a step"): a *run* is one holder of the
    root's lease, named by the lease's ``run_id``, which every checkpoint it writes records. A run
    may replace a committed step only if that step's manifest records this run's id (a retry, a
    re-save) or this run restored exactly that step (it continues that history). Anything else, a
    step of another run, one saved without a lease, one whose manifest cannot be read, needs the
    caller's explicit ``overwrite``. Called by the coordinator while it holds the lease, so no
    other writer can change the answer before the save commits.
    """
    path = child(root, naming.name(step))
    if step in restored or not has_manifest(path):
        return
    writer, who = describe_writer(path, read, key)
    if writer is not None and writer == run_id:
        return
    raise CheckpointExistsError(
        f"{where(path)}: step {step} is a committed checkpoint written by {who}, not by this run ({run_id}); "
        f"a run never silently replaces another run's checkpoint. {remedy}"
    )


def warn_damaged(damaged: DamagedCheckpoint) -> None:
    log.warning("shardsafe: skipping damaged checkpoint %s: %s", where(damaged.path), damaged.reason)


@dataclass(frozen=True)
class Catalog:
    """The readable committed checkpoints of a root (step -> manifest) and the damaged ones."""

    root: Root
    naming: StepNaming
    manifests: dict[int, Manifest]
    damaged: list[DamagedCheckpoint]

    @property
    def steps(self) -> list[int]:
        return sorted(self.manifests)

    def path(self, step: int) -> Root:
        return child(self.root, self.naming.name(step))

    def infos(self) -> list[CheckpointInfo]:
        return [info_of(step, self.path(step), self.manifests[step]) for step in self.steps]

    def references(self, steps: Iterable[int] | None = None) -> dict[str, set[str]]:
        """Folder name -> its files that the given readable checkpoints (default: all) point into (dedup)."""
        out: dict[str, set[str]] = {}
        for step in self.steps if steps is None else steps:
            manifest = self.manifests.get(step)
            for entry in manifest.tensors.values() if manifest is not None else ():
                for chunk in entry.chunks:
                    if chunk.checkpoint is not None:
                        out.setdefault(chunk.checkpoint, {RETAINED_MANIFEST_NAME}).add(chunk.file)
        return out


def scan(
    root: Root,
    steps: Iterable[int] | None = None,
    *,
    read: ReadManifest = read_manifest,
    naming: StepNaming = STEP_NAMING,
    warn: Callable[[DamagedCheckpoint], None] = warn_damaged,
) -> Catalog:
    """Read the manifests of the committed checkpoints ``steps`` (default: all) of ``root``.

    One whose manifest cannot be read or fails validation goes to :attr:`Catalog.damaged` (and to
    ``warn``) instead of stopping the scan: one bad old checkpoint must not stop a root for good.
    """
    manifests: dict[int, Manifest] = {}
    damaged: list[DamagedCheckpoint] = []
    for step in committed_steps(root, naming) if steps is None else steps:
        path = child(root, naming.name(step))
        try:
            manifests[step] = read(path)
        except (ShardsafeError, OSError) as exc:
            damaged.append(DamagedCheckpoint(step, path, f"{type(exc).__name__}: {exc}"))
            warn(damaged[-1])
    return Catalog(root, naming, manifests, damaged)


def references(root: Root, steps: list[int] | None = None, read: ReadManifest = read_manifest) -> dict[str, set[str]]:
    """Folder name -> its files that the given readable committed checkpoints (default: all) point into."""
    return scan(root, steps, read=read).references()


def metric_value(metrics: dict[str, Any], metric: str | None) -> float | None:
    """The number under ``metric`` in ``metrics``, or None (absent, not a number, NaN)."""
    if metric is None:
        return None
    value = metrics.get(metric)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return None


def ranked(infos: Iterable[CheckpointInfo], metric: str | None, mode: str) -> list[int]:
    """Steps that have a value of ``metric``, best first (``mode`` "min" or "max"; ties: the newer first)."""
    scored = [(v, i.step) for i in infos if (v := metric_value(i.metrics, metric)) is not None]
    return [step for _, step in sorted(scored, key=lambda vs: (vs[0] if mode == "min" else -vs[0], -vs[1]))]


@dataclass(frozen=True)
class RootListing:
    """What ``shardsafe list`` shows: readable checkpoints (latest and best marked) and damaged ones."""

    checkpoints: list[CheckpointInfo]
    damaged: list[DamagedCheckpoint]


def list_root(
    root: str | os.PathLike[str], best_metric: str | None = None, best_mode: str | None = None
) -> RootListing:
    """The checkpoints of ``root``; the best metric and mode default to what the newest readable one recorded."""
    catalog = scan(location(root))
    infos = catalog.infos()
    if infos:
        if best_metric is None:
            meta = manager_meta(catalog.manifests[infos[-1].step])
            best_metric = meta.get("best_metric") if isinstance(meta.get("best_metric"), str) else None
            best_mode = best_mode or (meta.get("best_mode") if meta.get("best_mode") in ("min", "max") else None)
        best = ranked(infos, best_metric, best_mode or "min")
        last = infos[-1].step
        infos = [replace(info, best=bool(best) and info.step == best[0], latest=info.step == last) for info in infos]
    return RootListing(infos, catalog.damaged)


def list_checkpoints(
    root: str | os.PathLike[str], best_metric: str | None = None, best_mode: str | None = None
) -> list[CheckpointInfo]:
    """Readable committed checkpoints under ``root`` with sizes and metrics; marks the latest and the best.

    The best metric and mode default to what the manager recorded in the newest checkpoint. A
    damaged checkpoint is left out (with a logged warning); :func:`list_root` returns those too.
    """
    return list_root(root, best_metric, best_mode).checkpoints


class ManifestCache:
    """Parsed manifests of local checkpoints, reused while the manifest file is the same file.

    Retention reads every committed manifest after each save (and a dedup save checks references
    first); parsing and validating them all again each time is pure Python that, during an async
    save, holds the GIL the training loop needs. A re-saved or replaced checkpoint has a new
    manifest file (new inode), so it is read again; object-store roots are not cached.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[FileStamp, Manifest]] = {}

    def __call__(self, folder: Root) -> Manifest:
        key = as_location(folder).stamp(MANIFEST_NAME)
        if key is None:  # an object store (never cached), or no manifest (read_manifest raises the usual error)
            return read_manifest(folder)
        entry = self._entries.get(str(folder))
        if entry is None or entry[0] != key:
            entry = (key, read_manifest(folder))
            self._entries[str(folder)] = entry
        return entry[1]

    def forget(self, folder: Root) -> None:
        self._entries.pop(str(folder), None)
