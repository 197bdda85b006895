"""Lightning's checkpoint dict <-> one shardsafe checkpoint folder (what the strategies of this package share).

Lightning's ``Trainer.save_checkpoint`` builds a dict: ``state_dict`` (the model), ``optimizer_states``
(one per optimizer), and everything else (``epoch``, ``global_step``, ``loops``, ``callbacks``,
``lr_schedulers``, ``hyper_parameters``, the precision plugin's and the datamodule's state...).
Here the model and the optimizers are saved from the live objects (so shardsafe stores each rank's
shards and reshards them on load, under the LightningModule's parameter names), and the rest is
stored as one JSON value (tensors inside by reference): rank 0's copy, as Lightning keeps rank 0's
``meta.pt``. No pickle is written. What JSON cannot hold is refused before anything is written,
naming the key and the remedy.

Replacement and removal follow the manager's rule for other runs' checkpoints: a save replaces a
checkpoint at its path only if this run wrote it or resumed from it, and ``remove`` (ModelCheckpoint's
rotation) retires only checkpoints this run wrote (renamed hidden in one step, then deleted, by
one process), so a new run in the same ``dirpath`` never deletes what an earlier run left (Lightning
#21813), on local disks and object stores alike.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from shardsafe.api.checkpoint import load, location, save
from shardsafe.api.load import load_from
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.format import MANIFEST_NAME, Manifest
from shardsafe.core.jsonsafe import MAX_JSON_BYTES
from shardsafe.core.values import check_state_tree, encode_value
from shardsafe.errors import CheckpointExistsError, FormatError, ShardsafeError
from shardsafe.integrations.lightning.background import BackgroundSaves
from shardsafe.interop.dcp_convert import dcp_state_tree
from shardsafe.interop.dcp_metadata import METADATA_NAME, is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint, DcpChunkReader, dcp_manifest
from shardsafe.interop.unpickler import load_pt
from shardsafe.manager.catalog import read_manifest, where
from shardsafe.manager.retention import retire
from shardsafe.protocol.temppath import TemporaryPath
from shardsafe.storage.local import fsync_file, read_small_file
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = [
    "META_KEY",
    "MODEL_KEY",
    "REST_KEY",
    "LightningCheckpoints",
    "checked_rest",
    "optimizer_key",
]

log = logging.getLogger(__name__)

META_KEY = "shardsafe.lightning"  # in the manifest's metadata: the writing run, what the folder holds
MODEL_KEY = "state_dict"  # Lightning's own names, so its DCP folders and ours map alike
REST_KEY = "lightning"  # every other entry of Lightning's checkpoint dict, one JSON value
LIGHTNING_META = "meta.pt"  # what Lightning's own ModelParallelStrategy writes next to its DCP items
STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"

_DEFAULT_REMEDY = (
    "store it as tensors, numbers, strings, lists or dicts, or drop it from the checkpoint in "
    "LightningModule.on_save_checkpoint (checkpoint.pop(...))"
)
_REMEDIES = {
    "hyper_parameters": (
        "leave that argument out of the saved hyper-parameters (self.save_hyperparameters(ignore=[...])) or pass it "
        "as numbers, strings, lists or dicts"
    ),
    "callbacks": "make that callback's state_dict() return only tensors, numbers, strings, lists and dicts",
    "datamodule_hyper_parameters": "leave that argument out of the datamodule's save_hyperparameters(ignore=[...])",
}


def optimizer_key(i: int) -> str:
    return f"optimizer_{i}"


def _tensor_path(path: str, tensor: torch.Tensor) -> str:
    return path


def checked_rest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The entries of Lightning's checkpoint dict other than the model and optimizers, checked storable.

    Raises FormatError naming the first entry JSON (with tensors) cannot hold and the remedy: the
    format's own check (core/values.encode_value), run here so the message speaks Lightning."""
    rest = {k: v for k, v in checkpoint.items() if k not in (STATE_DICT, OPTIMIZER_STATES)}
    for key, value in rest.items():
        try:
            encode_value(value, f"{REST_KEY}/{key}", _tensor_path)
        except FormatError as exc:
            remedy = _REMEDIES.get(str(key), _DEFAULT_REMEDY)
            raise FormatError(
                f"Lightning checkpoint entry {key!r} cannot be saved without pickle: {exc}. Remedy: {remedy}"
            ) from None
    return rest


def _meta_pt(path: Path) -> dict[str, Any]:
    """Lightning's ``meta.pt`` (everything but the model and optimizers), read without running code from it."""
    value = load_pt(path, mmap=False)
    if not isinstance(value, dict):
        raise FormatError(f"{path}: not a dict (a Lightning meta.pt holds the checkpoint's other entries)")
    return cast(dict[str, Any], _cloned(value))


def _cloned(value: Any) -> Any:
    """``value`` with its tensors copied out of the file's bytes."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _target(path: str | os.PathLike[str]) -> Path | RemoteDir:
    return location(path)


def _same_manifest(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` hold the same committed checkpoint (their manifests name and hash every file)."""
    try:
        return read_small_file(a / MANIFEST_NAME, MAX_JSON_BYTES) == read_small_file(b / MANIFEST_NAME, MAX_JSON_BYTES)
    except OSError:
        return False


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """A copy of the committed checkpoint folder ``src`` at ``dst``, visible only once complete and durable."""
    with TemporaryPath.create(dst) as tmp:
        shutil.copytree(src, tmp.path, dirs_exist_ok=True)
        for folder, _, files in os.walk(tmp.path):
            for name in files:
                fsync_file(Path(folder) / name)
        tmp.publish()  # atomically in place of an earlier copy


@dataclass
class LightningCheckpoints:
    """What one Lightning run (one strategy object) saved and loaded, and the rules that use it.

    ``run`` is the run's id (rank 0's, shared at the first save or load): it is written into every
    checkpoint's metadata, and a removal checks it there before anything is deleted."""

    run: str | None = None
    background: BackgroundSaves | None = None  # async saves (the strategies' ``async_save=True``)
    written: set[str] = field(default_factory=set)  # where(...) of every checkpoint this run committed
    loaded: set[str] = field(default_factory=set)  # ... and of those it resumed from

    def run_id(self, comm: Comm) -> str:
        if self.run is None:
            self.run = comm.broadcast(uuid.uuid4().hex)
        return self.run

    def save(
        self,
        path: str | os.PathLike[str],
        checkpoint: dict[str, Any],
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        comm: Comm | None = None,
    ) -> None:
        """Collective: ``checkpoint`` (Lightning's dict) as one shardsafe checkpoint folder at ``path``.

        The model and optimizers are saved from ``model`` and ``optimizers`` (each rank its shards);
        ``checkpoint``'s other entries from rank 0. With no ``optimizer_states`` in ``checkpoint``
        (``save_weights_only``), the optimizers are left out."""
        comm = comm or get_comm()
        self.settle(comm)
        rest = comm.on_coordinator(lambda: checked_rest(checkpoint), default=FormatError)
        state: dict[str, Any] = {MODEL_KEY: model}
        n_optimizers = len(optimizers) if OPTIMIZER_STATES in checkpoint else 0
        for i in range(n_optimizers):
            state[optimizer_key(i)] = optimizers[i]
        state[REST_KEY] = rest
        meta = {"optimizers": n_optimizers, "global_step": rest.get("global_step"), "epoch": rest.get("epoch")}
        self.write(_target(path), state, meta, comm)

    def settle(self, comm: Comm) -> None:
        """Collective, before a save or load: with async saves, the one in flight is committed (``written``
        complete), or its failure raised on every rank (background.BackgroundSaves.settle)."""
        if self.background is not None:
            self.background.settle(comm)

    def write(self, target: Path | RemoteDir, state: dict[str, Any], meta: dict[str, Any], comm: Comm) -> None:
        """Collective: ``state`` as the checkpoint at ``target``, its metadata ``meta`` and this run's id,
        replacing only what this run wrote or resumed from; async (``background``): returns once the
        state is copied, the commit happens on the background thread. Call :meth:`settle` first."""
        run = self.run_id(comm)
        overwrite = comm.on_coordinator(lambda: self.may_replace(target), default=CheckpointExistsError)
        metadata = {META_KEY: {"run": run, **meta}}
        key = where(target)
        if self.background is None:
            save(target, state, overwrite=overwrite, metadata=metadata, process_group=comm.group)
            self.written.add(key)
            return
        self.background.save(
            target, state, comm, overwrite=overwrite, metadata=metadata, committed=lambda: self.written.add(key)
        )

    def may_replace(self, target: Path | RemoteDir) -> bool:
        """Whether a save at ``target`` replaces what is there (False: nothing is); raises if another run's."""
        loc = as_location(target)
        if isinstance(target, Path):
            if not target.exists() and not target.is_symlink():
                return False
        elif not loc.exists(MANIFEST_NAME):
            return False
        key = where(target)
        if key in self.written or key in self.loaded:
            return True
        try:
            writer = read_manifest(target).metadata.get(META_KEY, {}).get("run")
        except (OSError, ShardsafeError):
            writer = None
        raise CheckpointExistsError(
            f"{key}: a checkpoint this run did not write or resume from is there (run {writer or 'unknown'}); "
            "shardsafe's Lightning strategies never replace another run's checkpoint. Resume from it "
            "(trainer.fit(ckpt_path=...)), remove it yourself, or save elsewhere (another dirpath or filename)"
        )

    def saved_optimizers(self, path: str | os.PathLike[str], comm: Comm | None = None) -> int:
        """How many optimizers the checkpoint at ``path`` holds (its metadata, read by rank 0)."""
        comm = comm or get_comm()
        target = _target(path)

        def count() -> int:
            meta = read_manifest(target).metadata.get(META_KEY)
            if not isinstance(meta, dict) or not isinstance(meta.get("optimizers"), int):
                raise FormatError(
                    f"{where(target)}: not a checkpoint of shardsafe's Lightning strategies (no {META_KEY!r} in its "
                    "metadata); load it with shardsafe.load"
                )
            return int(meta["optimizers"])

        return comm.on_coordinator(count, default=FormatError)

    def load(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        strict: bool = True,
        comm: Comm | None = None,
    ) -> dict[str, Any]:
        """Collective: load the model and optimizers in place; return the rest of Lightning's checkpoint dict.

        Loads on any number of ranks and any layout. Optimizers the checkpoint holds but ``optimizers``
        lacks (``trainer.validate``/``test``) are not read; optimizers it lacks are reported
        as missing (``StateMismatchError``), before anything is modified."""
        comm = comm or get_comm()
        self.settle(comm)  # resuming reads what the last save committed
        self.run_id(comm)
        target = _target(path)
        if isinstance(target, Path) and is_dcp_folder(target) and (target / LIGHTNING_META).is_file():
            return self._load_lightning_dcp(target, model, optimizers, strict, comm)
        stored = self.saved_optimizers(path, comm)
        state: dict[str, Any] = {MODEL_KEY: model}
        for i, optimizer in enumerate(optimizers):
            state[optimizer_key(i)] = optimizer
        state[REST_KEY] = None
        load(target, state, strict=strict and len(optimizers) >= stored, process_group=comm.group)
        self.loaded.add(where(target))
        rest = state[REST_KEY]
        if not isinstance(rest, dict):
            raise FormatError(f"{where(target)}: its {REST_KEY!r} entry is not an object")
        return rest

    def _load_lightning_dcp(
        self, folder: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool, comm: Comm
    ) -> dict[str, Any]:
        """A checkpoint Lightning's own ModelParallelStrategy wrote (DCP items + ``meta.pt``), so a run can switch
        strategies mid-way: the model and optimizers through shardsafe's DCP reader (resharded, in place; it
        maps ``state_dict.*`` / ``optimizer_<i>.*`` as Lightning names them), ``meta.pt`` through the restricted
        unpickler (interop/unpickler.py: no code from the file runs; anything off its allow-list is refused)."""
        rest = comm.on_coordinator(lambda: _meta_pt(folder / LIGHTNING_META), default=FormatError)
        state: dict[str, Any] = {MODEL_KEY: model}
        for i, optimizer in enumerate(optimizers):
            state[optimizer_key(i)] = optimizer

        def opened() -> tuple[Manifest, dict[str, Any]]:
            with DcpCheckpoint(folder, key="") as ckpt:
                keys, tree = dcp_state_tree(ckpt)
                manifest = dcp_manifest(ckpt.meta, keys)
            for name, entry in tree.items():  # Lightning's names for what DCP's "model" / "optim" would be
                if name == MODEL_KEY:
                    entry["kind"] = "module"
                elif name.startswith("optimizer_"):
                    entry["kind"] = "optimizer"
            check_state_tree(tree, f"{folder / METADATA_NAME}", manifest)
            return manifest, tree

        load_from(
            state, opened, lambda manifest: DcpChunkReader(folder, manifest, True), comm.group, strict, True, True
        )
        self.loaded.add(where(folder))
        return rest

    def link(self, source: str | os.PathLike[str], link: str | os.PathLike[str]) -> None:
        """ModelCheckpoint's ``save_last="link"`` for folders (call on one process, once ``source`` is committed).

        ``link`` becomes a relative symlink to ``source``, as Lightning makes it. Where no symlink can be
        made (a filesystem without them) it becomes a copy of the checkpoint, published as a save is (a
        hidden folder renamed into place), so a half copy never looks loadable; Lightning's own fallback,
        ``shutil.copy``, cannot copy a folder. What is at ``link`` goes first: a symlink is unlinked; a
        checkpoint folder (an earlier copy) is replaced atomically, only if this run wrote it or resumed
        from it (:meth:`may_replace`). Lightning allows ``"link"`` on local paths only."""
        src, dst = Path(source), Path(link)
        replace = False
        if dst.is_symlink():
            dst.unlink()
        else:
            replace = self.may_replace(dst)  # a copy made earlier (raises if it is another run's)
        if not replace:  # a copy there means symlinks failed before
            try:
                os.symlink(os.path.relpath(src, dst.parent), dst)
                return
            except OSError as exc:
                log.info("no symlink %s -> %s (%s): copying the checkpoint", dst, src, exc)
        if replace and _same_manifest(src, dst):
            return  # ModelCheckpoint links again at each save of last; the copy there is already of ``source``
        _copy_checkpoint(src, dst)
        self.written.add(where(dst))

    def release_other_runs_last(self, rest: dict[str, Any], comm: Comm | None = None) -> list[str]:
        """In ``rest`` (Lightning's restored checkpoint dict), forget each ModelCheckpoint's ``last_model_path``
        that names a checkpoint of another run (not the one resumed from); returns those paths.

        Resumed from ``epoch=1-step=4.ckpt`` in the dirpath of the run that wrote it, ModelCheckpoint
        would save its ``last.ckpt`` over that run's (the restored path is "its own"), which the save
        refuses (:meth:`may_replace`) only after the first epoch has trained. Without the path, it does
        what it does for any ``last.ckpt`` it did not write: it saves ``last-v1.ckpt`` beside it. Decided
        by rank 0, the same on every rank."""
        comm = comm or get_comm()
        states = rest.get("callbacks")
        if not isinstance(states, dict):
            return []
        paths = sorted(
            {st["last_model_path"] for st in states.values() if isinstance(st, dict) and st.get("last_model_path")}
        )

        def others() -> list[str]:
            found = []
            for path in paths:
                try:
                    self.may_replace(_target(path))
                except CheckpointExistsError:
                    found.append(path)
            return found

        released: list[str] = comm.on_coordinator(others, default=FormatError)
        for st in states.values():
            if isinstance(st, dict) and st.get("last_model_path") in released:
                st["last_model_path"] = ""
        if released and comm.is_coordinator:
            log.warning(
                "%s: written by another run; this run saves its last checkpoint beside it (last-v1.ckpt, ...) "
                "rather than replace it",
                ", ".join(released),
            )
        return released

    def remove(self, path: str | os.PathLike[str]) -> bool:
        """Retire the checkpoint at ``path`` if this run wrote it (call on one process); returns whether it did.

        A symlink (ModelCheckpoint's ``save_last="link"``) is removed as a link. A checkpoint this run did
        not write, or whose manifest names another run, is left in place with a warning."""
        target = _target(path)
        if isinstance(target, Path) and target.is_symlink():
            target.unlink()
            return True
        key = where(target)
        if key not in self.written:
            log.warning("not removing %s: this run did not write it (shardsafe never deletes another run's)", key)
            return False
        try:
            writer = read_manifest(target).metadata.get(META_KEY, {}).get("run")
        except (OSError, ShardsafeError) as exc:
            log.warning("not removing %s: its manifest cannot be read (%s)", key, exc)
            return False
        if writer != self.run:
            log.warning("not removing %s: written by run %s, not this one (%s)", key, writer, self.run)
            return False
        retire(target)
        self.written.discard(key)
        return True
