"""Shared pieces of the fault-injection tests: a manager job whose every checkpoint is predictable,
and the checks run on a checkpoint root after a fault.

Each step's model values are a function of the step (``step_values``), so the test process can
recompute what every committed checkpoint must hold and compare bit for bit. With ``frozen`` the
first layer keeps the same values at every step, so a manager with ``dedup=True`` stores it once
and later checkpoints point into the first one's files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardsafe
from dist_utils import assert_tensors_equal, full_model_state, make_model, seeded_values, set_model_values, shard
from shardsafe.errors import CheckpointNotFoundError
from shardsafe.manager.catalog import committed_steps, references
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.manager.naming import STEP_RE, step_name
from shardsafe.storage.remote import RemoteDir

FROZEN_PREFIX = "layers.0."
HIDDEN_MARKS = (".shardsafe-tmp-", ".shardsafe-deleting-", ".shardsafe-old-")


def step_values(model: nn.Module, step: int, frozen: bool) -> dict[str, torch.Tensor]:
    values = seeded_values(model, "step", step)
    if frozen:
        base = seeded_values(model, "step", 0)
        values.update({k: v for k, v in base.items() if k.startswith(FROZEN_PREFIX)})
    return values


def step_state(model: nn.Module, step: int) -> dict[str, Any]:
    return {"model": model, "tag": torch.tensor([step, 7 * step]), "meta": {"step": step}}


def manager_job(
    rank: int,
    world_size: int,
    root: str,
    options: dict[str, Any],
    fault: tuple[str, str] | None,
    fault_step: int,
    frozen: bool,
    env: dict[str, str],
) -> str:
    """Save steps 1..fault_step with a CheckpointManager (keep_last=2), arming ``fault`` =
    (variable, spec) just before the last save. Returns "survived" when the fault never fired."""
    os.environ.update(env)
    model = shard(make_model(0), world_size)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=2, **options) as manager:
        for step in range(1, fault_step + 1):
            if step == fault_step and fault is not None:
                manager.wait()  # the earlier saves are committed before the fault is armed
                os.environ[fault[0]] = fault[1]
            set_model_values(model, step_values(model, step, frozen))
            manager.save(step, step_state(model, step))
        manager.wait()
    return "survived"


def assert_step(root: Path | str, step: int, frozen: bool) -> None:
    """Checkpoint ``step`` under ``root`` verifies and loads (one process, plain model) to exactly its values."""
    path = f"{root}/{step_name(step)}"
    shardsafe.verify(path)
    model = make_model(11)
    state: dict[str, Any] = {"model": model, "tag": torch.zeros(2, dtype=torch.int64), "meta": None}
    shardsafe.load(path, state)
    assert state["meta"] == {"step": step}, path
    assert state["tag"].tolist() == [step, 7 * step], path
    assert_tensors_equal(full_model_state(model), step_values(model, step, frozen), path)


def where(root: Path | str) -> Path | RemoteDir:
    return RemoteDir(str(root)) if isinstance(root, str) and "://" in root else Path(root)


def check_root_after_fault(root: Path | str, expected: list[int], frozen: bool) -> int:
    """After a fault: exactly ``expected`` steps are committed and each loads bit-exactly; nothing
    else can pass for a checkpoint; collect_garbage then leaves only checkpoints (and data they
    reference). Returns how many checkpoints were checked."""
    location = where(root)
    assert committed_steps(location) == expected, f"committed {committed_steps(location)}, expected {expected}"
    for step in expected:
        assert_step(root, step, frozen)
    referenced = references(location)
    for name in _visible(location):
        assert STEP_RE.match(name), f"unexpected entry {name} in {root}"
        step = int(name[len("step-") :])
        if step not in expected:  # an interrupted save or retirement: not a checkpoint
            try:
                shardsafe.load(f"{root}/{name}", {"model": make_model(1)})
            except CheckpointNotFoundError:
                pass
            else:
                raise AssertionError(f"{root}/{name} loads although it is not a committed checkpoint")
    for name in _hidden(location):
        assert any(mark in name for mark in HIDDEN_MARKS), f"unexpected hidden entry {name}"
    shardsafe.collect_garbage(str(root))
    assert not _hidden(location), f"collect_garbage left {_hidden(location)}"
    assert committed_steps(location) == expected
    for name in _visible(location):
        step = int(name[len("step-") :])
        if step not in expected:
            assert name in referenced, f"collect_garbage left {name}, which no checkpoint references"
            assert _names(location, name) <= referenced[name], f"collect_garbage left unreferenced files in {name}"
    for step in expected:  # what collect_garbage removed was not theirs
        shardsafe.verify(f"{root}/{step_name(step)}")
    return len(expected)


def resume_and_save(root: Path | str, step: int, frozen: bool, **options: Any) -> None:
    """What a restarted job does: restore the newest checkpoint (one process), then save the next step."""
    model = make_model(3)
    state = step_state(model, 0)
    state["meta"] = None
    with shardsafe.CheckpointManager(str(root), save_every=1, keep_last=2, **options) as manager:
        latest = manager.restore(state)
        assert latest is not None and state["meta"] == {"step": latest}
        set_model_values(model, step_values(model, step, frozen))
        manager.save(step, step_state(model, step))
    assert_step(root, step, frozen)


def _names(location: Path | RemoteDir, name: str) -> set[str]:
    if isinstance(location, RemoteDir):
        return set(location.child(name).list())
    return {p.name for p in (location / name).iterdir()}


def _visible(location: Path | RemoteDir) -> list[str]:
    names = (
        location.list()
        if isinstance(location, RemoteDir)
        else [p.name for p in location.iterdir()]
        if location.is_dir()
        else []
    )
    return sorted(n for n in names if not n.startswith("."))


def _hidden(location: Path | RemoteDir) -> list[str]:
    names = (
        location.list()
        if isinstance(location, RemoteDir)
        else [p.name for p in location.iterdir()]
        if location.is_dir()
        else []
    )
    return sorted(n for n in names if n.startswith(".") and n != LEASE_DIR)  # the run's lease record is not a leftover
