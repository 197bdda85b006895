"""Lightning Fabric strategies whose ``fabric.save`` / ``fabric.load`` write and read shardsafe checkpoints.

``fabric.save(path, state)`` hands the strategy ``state`` with Fabric's wrappers removed: modules
(FSDP2, tensor parallel, DDP, plain), optimizers, objects with ``state_dict()`` and plain values.
Each key becomes one shardsafe state entry under its own name: modules and optimizers from every
rank (its shards), stateful objects as shardsafe stores them, plain values from rank 0 (as Fabric
keeps rank 0's ``meta.pt``), checked storable first (checkpoints.checked_rest). ``fabric.load(path,
state)`` loads in place on any world size and layout, replaces the plain values in ``state``, and
returns what the checkpoint holds that ``state`` did not ask for, as Fabric documents.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

from shardsafe.api.checkpoint import load, location
from shardsafe.core.comm import get_comm
from shardsafe.errors import FormatError
from shardsafe.integrations.lightning.background import background_saves
from shardsafe.integrations.lightning.checkpoints import META_KEY, LightningCheckpoints, checked_rest
from shardsafe.manager.catalog import read_manifest, where

__all__ = ["ShardsafeFabricDDPStrategy", "ShardsafeFabricModelParallelStrategy"]


def _is_object(value: Any) -> bool:
    """Saved from every rank by its shardsafe adapter (not as rank 0's plain value)."""
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or hasattr(value, "state_dict")


class _FabricShardsafe:
    """save_checkpoint / load_checkpoint of both Fabric strategies (a mixin before Fabric's class)."""

    _shardsafe: LightningCheckpoints

    if TYPE_CHECKING:

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Collective: ``state`` as one atomic shardsafe checkpoint folder at ``path`` (rank 0's choice)."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint: storage_options and filter are not supported (shardsafe saves "
                "whole entries; for s3:// and other fsspec URLs pass the URL as the path)"
            )
        comm = get_comm()
        self._shardsafe.settle(comm)
        target = location(self.broadcast(os.fspath(path)))
        values = {k: v for k, v in state.items() if not _is_object(v)}
        values = comm.on_coordinator(lambda: checked_rest(values), default=FormatError)
        full = {k: (values[k] if k in values else v) for k, v in state.items()}
        meta = {"fabric_values": sorted(values), "fabric_objects": sorted(set(state) - set(values))}
        self._shardsafe.write(target, full, meta, comm)

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save (``async_save=True``) is still being written and committed."""
        return self._shardsafe.background is not None and self._shardsafe.background.in_flight

    def wait_for_save(self) -> None:
        """Block until the async save in flight (if any) is committed; raise its error (``SaveError``). The
        next ``fabric.save`` / ``fabric.load`` waits by itself, and a save in flight at exit is finished."""
        if self._shardsafe.background is not None:
            self._shardsafe.background.wait()

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Collective: load ``state``'s objects in place, replace its plain values; return the stored values
        ``state`` did not name. A module alone as ``state`` loads that module (saved under any one key)."""
        if not state:
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs a state: {{'model': model, ...}}")
        comm = get_comm()
        self._shardsafe.settle(comm)  # reads what the last save committed
        target = location(self.broadcast(os.fspath(path)))

        def stored() -> dict[str, Any]:
            meta = read_manifest(target).metadata.get(META_KEY)
            if not isinstance(meta, dict) or not isinstance(meta.get("fabric_values"), list):
                raise FormatError(
                    f"{where(target)}: not a checkpoint of a shardsafe Fabric strategy (no {META_KEY!r} metadata); "
                    "load it with shardsafe.load"
                )
            return meta

        meta = comm.on_coordinator(stored, default=FormatError)
        values, objects = list(meta["fabric_values"]), list(meta["fabric_objects"])
        if isinstance(state, torch.nn.Module):
            modules = [k for k in objects if k not in values]
            state = {modules[0] if len(modules) == 1 else "model": state}
        wanted: dict[str, Any] = dict(state)
        for key in values:
            wanted.setdefault(key, None)
        complete = all(k in state for k in objects)
        load(target, wanted, strict=strict and complete, process_group=comm.group)
        self._shardsafe.loaded.add(where(target))
        for key in state:
            if key in values:
                state[key] = wanted[key]
        return {k: wanted[k] for k in values if k not in state}


class ShardsafeFabricModelParallelStrategy(_FabricShardsafe, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 / TP), saving and loading shardsafe checkpoints. Same arguments,
    and ``async_save=True``: ``fabric.save`` returns once the state is copied; it commits in the background."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shardsafe = LightningCheckpoints(background=background_saves(async_save))


class ShardsafeFabricDDPStrategy(_FabricShardsafe, DDPStrategy):
    """Fabric's ``DDPStrategy``, saving and loading shardsafe checkpoints. Same arguments, and ``async_save``."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shardsafe = LightningCheckpoints(background=background_saves(async_save))
