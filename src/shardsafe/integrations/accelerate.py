"""Accelerate: ``save_state`` / ``load_state`` as one atomic shardsafe checkpoint written by all ranks.

``Accelerator.save_state`` has every rank ``makedirs`` the folder, rank 0 write the weights and each
rank a pickled RNG file, and retention ``rmtree`` old folders while other ranks may still write:
the all-ranks/one-writer problems the Trainer had. Here the same content goes through one
collective :func:`shardsafe.save`: models (plain, DDP, FSDP2, a DeepSpeed ZeRO-3 engine), optimizers
(the torch optimizer inside each ``AcceleratedOptimizer``; under DeepSpeed the engine holds it),
schedulers, the data position of each prepared dataloader (a :class:`~shardsafe.data.ReshardableSampler`
reshards; a stateful dataloader's state is kept per rank), the gradient scaler, the RNG of every
rank, ``accelerator.step`` and every object registered with ``register_for_checkpointing``.
No pickle is written or read.

With ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)`` checkpoints are
``<project_dir>/checkpoints/checkpoint_<iteration>``, as Accelerate names them; after a new one is
committed, the oldest beyond ``total_limit`` are retired (renamed hidden, then deleted), by the
coordinator only, and the run holds a lease on the checkpoints folder (one live run per project;
a second run waits for it to lapse, then fails with LeaseHeldError; a run whose lease was taken
over publishes and deletes nothing). The run is this process: ``load_state`` takes the lease before
it picks the newest checkpoint (so it loads what a previous run still saving there last committed),
and ``save_state`` does not replace a ``checkpoint_<n>`` another run committed (CheckpointExistsError
names the run; ``overwrite=True`` replaces it on purpose), while one this process saved or loaded it
may save again. Like the Accelerator's own methods, these read Accelerate's private registries
(``_models``, ``_optimizers``, ...), through :mod:`shardsafe.compat.accelerate`.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.checkpoint import describe_collectively, load, location, write_checkpoint
from shardsafe.compat.accelerate import is_deepspeed, registries
from shardsafe.core.comm import get_comm
from shardsafe.data.sampler import ReshardableSampler
from shardsafe.errors import CheckpointNotFoundError, SaveError, ShardsafeError
from shardsafe.manager.catalog import CheckpointInfo, committed_steps, refuse_other_runs_step
from shardsafe.manager.lease import RootLease
from shardsafe.manager.naming import StepNaming
from shardsafe.manager.retention import choose_kept, retire
from shardsafe.state.deepspeed_engine import is_deepspeed_engine
from shardsafe.state.rng import RNGState

__all__ = ["load_state", "save_state"]

log = logging.getLogger(__name__)

ACCELERATE_NAMING = StepNaming("checkpoint_")  # checkpoint_<iteration>, as Accelerate names them
STEP_KEY = "accelerator_step"
META_KEY = "shardsafe.accelerate"
_REPLACE_REMEDY = (
    "To continue that run, load_state(accelerator) first (it loads the newest checkpoint and continues its numbering); "
    "to replace it on purpose, save_state(accelerator, overwrite=True); or use another project_dir"
)


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _position_of(dataloader: Any) -> Any:
    """What holds a prepared dataloader's position: a ReshardableSampler, or the dataloader itself when stateful."""
    for holder in (
        dataloader,
        getattr(dataloader, "batch_sampler", None),
        getattr(dataloader, "base_dataloader", None),
    ):
        for attr in ("sampler", "batch_sampler"):
            candidate = getattr(holder, attr, None) if holder is not None else None
            inner = getattr(candidate, "sampler", None)
            for s in (candidate, inner):
                if isinstance(s, ReshardableSampler):
                    return s
    if getattr(dataloader, "use_stateful_dataloader", False):
        return dataloader
    return None


def _check_zero3(model: Any, i: int) -> None:
    """Only ZeRO-3 engines are state values (docs/DEEPSPEED.md); say so in Accelerate's terms, before any
    collective (the stage is the same on every rank, so every rank raises alike)."""
    if not is_deepspeed_engine(model):
        return
    stage = int(model.zero_optimization_stage())
    if stage != 3:
        raise ShardsafeError(
            f"model {i} is a DeepSpeed ZeRO stage {stage} engine; shardsafe's save_state/load_state handle ZeRO stage "
            "3 only. "
            "Use accelerator.save_state for stages 0-2 (`shardsafe convert <its folder> OUT` converts that checkpoint)"
        )


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The state dict shardsafe saves for ``accelerator``: the same on every rank, in registration order.

    Under DeepSpeed each prepared model is the engine, whose value also holds its optimizer (ZeRO-3
    partitions, moments, step counts; state/deepspeed_engine.py), so the ``DeepSpeedOptimizerWrapper``
    entries are not saved again; schedulers are saved as their own values (a DeepSpeed scheduler the
    engine steps as well as a torch one Accelerate steps), as the engine value does not cover them.
    """
    deepspeed = is_deepspeed(accelerator)
    found = registries(accelerator)
    state: dict[str, Any] = {}
    for i, model in enumerate(found.models):
        if deepspeed:
            _check_zero3(model, i)
        state[_name("model", i)] = model
    if not deepspeed:
        for i, optimizer in enumerate(found.optimizers):
            inner = getattr(optimizer, "optimizer", optimizer)
            if not isinstance(inner, torch.optim.Optimizer):
                raise ShardsafeError(
                    f"optimizer {i} is a {type(inner).__name__}, not a torch.optim.Optimizer; shardsafe cannot save it"
                )
            state[_name("optimizer", i)] = inner
    for i, scheduler in enumerate(found.schedulers):
        state[_name("scheduler", i)] = getattr(scheduler, "scheduler", scheduler)
    for i, dataloader in enumerate(found.dataloaders):
        position = _position_of(dataloader)
        if position is not None:
            state[_name("dataloader", i)] = position
        else:
            log.info("dataloader %d has no saveable position (use shardsafe.data.ReshardableSampler as its sampler)", i)
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    for i, obj in enumerate(found.custom_objects):
        state[f"custom_{i}"] = obj
    state["rng"] = RNGState()
    state[STEP_KEY] = int(accelerator.step)
    return state


def _checkpoints_dir(accelerator: Any) -> Path:
    return Path(accelerator.project_dir) / "checkpoints"


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    """Committed ``checkpoint_<n>`` folders, oldest first (the manager's catalog, with Accelerate's naming)."""
    return [(n, folder / ACCELERATE_NAMING.name(n)) for n in committed_steps(folder, ACCELERATE_NAMING)]


def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = None, *, overwrite: bool = False) -> str:
    """What ``accelerator.save_state(output_dir)`` saves, as one atomic shardsafe checkpoint; returns its path.

    Collective: every rank calls it. With automatic checkpoint naming, ``output_dir`` is ignored
    (as by Accelerate), ``total_limit`` is applied after the commit (on every rank, the save
    returns once it is done), and a ``checkpoint_<n>`` committed by another run is not replaced
    unless ``overwrite=True``. An explicit ``output_dir`` holding a checkpoint is replaced only
    with ``overwrite=True``.
    """
    config = accelerator.project_configuration
    auto = bool(config.automatic_checkpoint_naming)
    if auto:
        target = _checkpoints_dir(accelerator) / ACCELERATE_NAMING.name(config.iteration)
    elif output_dir is None:
        raise ShardsafeError(
            "save_state: pass output_dir, or use ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    else:
        target = Path(output_dir)
    comm = get_comm()
    lease = _lease(_checkpoints_dir(accelerator), comm) if auto else None
    if lease is not None and not overwrite:
        _refuse_other_runs_checkpoint(_checkpoints_dir(accelerator), int(config.iteration), lease, comm)
    meta = {"iteration": int(config.iteration), "step": int(accelerator.step), **(lease.metadata() if lease else {})}
    view = describe_collectively(accelerator_state(accelerator), comm)
    fence = (lambda: lease.fence(f"publish {target}")) if lease is not None else None
    replace = overwrite or lease is not None  # automatic naming: the run rule above decided
    write_checkpoint(location(target), view, comm, overwrite=replace, metadata={META_KEY: meta}, before_publish=fence)
    if lease is not None and config.total_limit is not None:
        limit = int(config.total_limit)
        comm.on_coordinator(lambda: _retire_beyond(_checkpoints_dir(accelerator), limit, lease.fence))
    config.iteration += 1
    return str(target)


_LEASES: dict[str, RootLease] = {}
_LOADED: dict[str, set[int]] = {}  # checkpoints folder -> the checkpoint numbers this process's run loaded there


def _refuse_other_runs_checkpoint(folder: Path, number: int, lease: RootLease, comm: Any) -> None:
    """Collective: every rank raises the same CheckpointExistsError if ``checkpoint_<number>`` is another run's (the
    manager's rule)."""
    loaded = _LOADED.get(str(folder.absolute()), set())

    def check() -> None:
        refuse_other_runs_step(
            folder, number, lease.run_id, loaded, _REPLACE_REMEDY, naming=ACCELERATE_NAMING, key=META_KEY
        )

    comm.on_coordinator(check, default=SaveError)


def _lease(root: Path, comm: Any) -> RootLease:
    """This process's lease on a managed checkpoints folder (one live run per project), taken before its first save."""
    key = str(root.absolute())
    if key not in _LEASES:
        _LEASES[key] = RootLease(Path(key), comm)
        atexit.register(_LEASES[key].release)
    lease = _LEASES[key]
    lease.ensure()
    return lease


def _retire_beyond(folder: Path, limit: int, fence: Callable[[str], None]) -> list[int]:
    """Retire the oldest committed checkpoints beyond ``limit`` with the manager's retention rule and
    deleter (the newest are kept; gone in one rename first), each after the lease check."""
    numbered = _numbered(folder)
    kept = choose_kept([CheckpointInfo(n, path, 0) for n, path in numbered], limit)
    retired = []
    for number, path in numbered:
        if number not in kept.steps:
            fence(f"delete {path.name}")
            retire(path)
            retired.append(number)
    return retired


def load_state(accelerator: Any, input_dir: str | os.PathLike[str] | None = None, *, strict: bool = True) -> str:
    """Restore what :func:`save_state` saved (at any world size); returns the checkpoint loaded.

    Without ``input_dir``, automatic checkpoint naming picks the newest *committed* checkpoint (a
    folder an interrupted save left is never picked), and the next save continues its numbering.
    It takes the run's lease on the checkpoints folder first (waiting for a run still saving
    there), so the newest is what that run last committed.
    """
    config = accelerator.project_configuration
    if input_dir is not None:
        path = Path(input_dir)
    elif config.automatic_checkpoint_naming:
        folder = _checkpoints_dir(accelerator)
        _lease(folder, get_comm())
        numbered = get_comm().broadcast(_numbered(folder))
        if not numbered:
            raise CheckpointNotFoundError(f"{folder}: no committed checkpoint_<n> folder")
        path = numbered[-1][1]
        config.iteration = numbered[-1][0] + 1
        _LOADED.setdefault(str(folder.absolute()), set()).add(numbered[-1][0])
    else:
        raise ShardsafeError(
            "load_state: pass input_dir, or use ProjectConfiguration(automatic_checkpoint_naming=True)"
        )
    state = accelerator_state(accelerator)
    load(path, state, strict=strict)
    accelerator.step = int(state[STEP_KEY])
    return str(path)
