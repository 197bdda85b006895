"""A load that fails on damaged data leaves the model, the optimizer and everything else untouched.

``shardsafe.load`` (``atomic=True``, the default) checks every byte range a rank will read before
it writes into any destination, and the ranks agree first. The checkpoint here is saved by a
2-rank FSDP2 job; one block of a tensor in the middle of the load order is corrupted; loading it
on 1 rank and on 2 ranks must raise IntegrityError and leave every parameter, optimizer state
tensor, param group, scheduler state and plain value exactly as it was. ``atomic=False`` is the
control: the same load overwrites the tensors read before the damaged one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    shard,
    train,
)
from reliability import record
from shardsafe.errors import IntegrityError, ShardsafeError
from stored_chunks import stored_chunks

WORLD = 2
# Load order is model parameters, then optimizer state: one key in the middle of each.
CORRUPT_KEYS = ["model/layers.2.weight", "optim/state/layers.1.weight/exp_avg"]


def _state(model: Any, optimizer: Any, note: str) -> dict[str, Any]:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"model": model, "optim": optimizer, "sched": scheduler, "extra": {"note": note}}


def save_trained(rank: int, world_size: int, path: str) -> None:
    model = shard(make_model(3), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer, "saved")
    train(model, optimizer, steps=2, rank=rank, seed=3)
    state["sched"].step()
    shardsafe.save(path, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("atomic")
    path = work / "ckpt"
    run_ranks(save_trained, WORLD, str(path), work_dir=work)
    return path


def _corrupt(source: Path, dest: Path, key: str) -> None:
    """A copy of ``source`` with one byte flipped in the middle of ``key``'s last chunk."""
    shutil.copytree(source, dest)
    chunk = stored_chunks(dest, key)[-1]
    target = dest / chunk["file"]
    data = bytearray(target.read_bytes())
    data[(chunk["begin"] + chunk["end"]) // 2] ^= 0x10
    target.write_bytes(bytes(data))


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": full_model_state(state["model"]),
        "optim": full_optimizer_state(state["model"], state["optim"]),
        "sched": dict(state["sched"].state_dict()),
        "extra": state["extra"],
    }


def _assert_unchanged(after: dict[str, Any], before: dict[str, Any], what: str) -> None:
    assert_tensors_equal(after["model"], before["model"], f"{what}: model")
    assert_optimizer_equal(after["optim"], before["optim"], f"{what}: optimizer")
    assert after["sched"] == before["sched"], f"{what}: scheduler changed"
    assert after["extra"] == before["extra"], f"{what}: plain value changed"


def load_into_trained(rank: int, world_size: int, path: str, atomic: bool, stepped: bool = True) -> dict[str, Any]:
    model = make_model(11)
    if world_size > 1:
        model = shard(model, world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer, "mine")
    if stepped:
        train(model, optimizer, steps=1, rank=rank, seed=11)
        state["sched"].step()
    before = _snapshot(state)
    error = None
    try:
        shardsafe.load(path, state, atomic=atomic)
    except ShardsafeError as exc:
        error = (type(exc).__name__, str(exc))
    return {"error": error, "before": before, "after": _snapshot(state), "fresh": not optimizer.state}


@pytest.mark.parametrize("key", CORRUPT_KEYS)
def test_failed_load_changes_nothing_on_one_rank(saved: Path, tmp_path: Path, key: str) -> None:
    damaged = tmp_path / "damaged"
    _corrupt(saved, damaged, key)
    report = load_into_trained(0, 1, str(damaged), atomic=True)
    assert report["error"] is not None and report["error"][0] == "IntegrityError", report["error"]
    assert key in report["error"][1] and "hash mismatch" in report["error"][1]
    _assert_unchanged(report["after"], report["before"], "1 rank")

    # The control: without the first pass, the tensors read before the damaged one are overwritten.
    control = load_into_trained(0, 1, str(damaged), atomic=False)
    assert control["error"] is not None and control["error"][0] == "IntegrityError"
    changed = [k for k, v in control["after"]["model"].items() if not torch.equal(v, control["before"]["model"][k])]
    assert changed, "the control load modified nothing: the test would not notice a non-atomic load"
    record("atomic load: corrupted block mid-order (model and optimizer bit-identical after)", faults=1, checked=1)


def test_failed_load_leaves_a_fresh_optimizer_fresh(saved: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    _corrupt(saved, damaged, CORRUPT_KEYS[1])
    report = load_into_trained(0, 1, str(damaged), atomic=True, stepped=False)
    assert report["error"] is not None and report["error"][0] == "IntegrityError"
    assert report["fresh"], "a failed load left state in an optimizer that never stepped"
    _assert_unchanged(report["after"], report["before"], "fresh optimizer")


@pytest.mark.parametrize("key", CORRUPT_KEYS)
def test_failed_load_changes_nothing_on_two_ranks(saved: Path, tmp_path: Path, key: str) -> None:
    """Only the rank that owns the damaged rows reads them; every rank must raise and change nothing."""
    damaged = tmp_path / "damaged"
    _corrupt(saved, damaged, key)
    reports = run_ranks(load_into_trained, WORLD, str(damaged), True, work_dir=tmp_path)
    for rank, report in enumerate(reports):
        assert report["error"] is not None and report["error"][0] == "IntegrityError", f"rank {rank}: {report['error']}"
        assert key in report["error"][1]
        _assert_unchanged(report["after"], report["before"], f"rank {rank} of {WORLD}")
    record("atomic load: corrupted block mid-order (model and optimizer bit-identical after)", faults=1, checked=WORLD)


def test_missing_file_without_hash_checks_changes_nothing(saved: Path, tmp_path: Path) -> None:
    """``verify=False`` skips hashes, but the first pass still opens and sizes every file first."""
    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    (damaged / "shard-00001.safetensors").unlink()
    model = make_model(11)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer, "mine")
    train(model, optimizer, steps=1, seed=11)
    before = _snapshot(state)
    with pytest.raises(IntegrityError, match="shard-00001.safetensors"):
        shardsafe.load(damaged, state, verify=False)
    _assert_unchanged(_snapshot(state), before, "verify=False")
    record("atomic load: missing shard file, verify=False", faults=1, checked=1)


def test_intact_checkpoint_loads_the_same_atomic_or_not(saved: Path) -> None:
    one, two = load_into_trained(0, 1, str(saved), atomic=True), load_into_trained(0, 1, str(saved), atomic=False)
    assert one["error"] is None and two["error"] is None
    assert_tensors_equal(one["after"]["model"], two["after"]["model"], "model")
    assert_optimizer_equal(one["after"]["optim"], two["after"]["optim"], "optimizer")
    assert one["after"]["sched"] == two["after"]["sched"] and one["after"]["extra"] == {"note": "saved"}
