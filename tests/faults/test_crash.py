"""SIGKILL in the middle of a save, at every named crash point, on the coordinator and elsewhere.

A 2-rank FSDP2 job saves checkpoint A (committed), then saves B with ``SHARDSAFE_CRASH_AT`` set,
either over A (``overwrite=True``) or into a new path. The rank named in the crash spec SIGKILLs
itself at that point; the launcher then ends the others (as torch.distributed.run does). Here, in
the test process, the previous checkpoint must still verify and load bit-exactly, and the partial
new one must be invisible (no manifest at a new path, A's content at the overwritten one). Once
``save:after-publish`` is passed, B is the visible checkpoint and must be complete. After every
crash a new save into the same paths must work despite what the dead job left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsafe
from dist_utils import (
    assert_tensors_equal,
    full_model_state,
    kill_leftover_workers,
    launch,
    make_model,
    seeded_values,
    set_model_values,
    shard,
    torchrun_command,
    torchrun_env,
    visible_entries,
    worker_pids,
)
from reliability import record
from shardsafe.core.faults import POINTS
from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import CheckpointNotFoundError
from shardsafe.manager.lease import LEASE_DIR

WORLD = 2
COORDINATOR_ONLY = {"save:before-manifest", "save:before-publish", "save:after-publish"}

# The others belong to the manager; save:between-renames is reached only on filesystems without
# RENAME_EXCHANGE (test_faults_crash.py simulates one).
SAVE_POINTS = [point for point in POINTS if point.startswith("save:") and point != "save:between-renames"]
# (point, rank) - rank None: the spec names no rank, so every rank dies there.
CASES = (
    [(point, 0) for point in SAVE_POINTS]
    + [(point, 1) for point in SAVE_POINTS if point not in COORDINATOR_ONLY]
    + [("save:mid-write", None)]
)


def crash_spec(point: str, rank: int | None) -> str:
    return point if rank is None else f"{point}@{rank}"


def _state(model: Any, version: str) -> dict[str, Any]:
    return {"model": model, "tag": torch.tensor([ord(c) for c in version]), "meta": {"version": version}}


def crash_worker(rank: int, world_size: int, root: str, target: str, spec: str) -> str:
    model = shard(make_model(0), world_size)
    set_model_values(model, seeded_values(model, "A", 0))
    shardsafe.save(Path(root) / "ckpt", _state(model, "A"))
    dist.barrier()
    set_model_values(model, seeded_values(model, "B", 0))
    os.environ["SHARDSAFE_CRASH_AT"] = spec
    if target == "overwrite":
        shardsafe.save(Path(root) / "ckpt", _state(model, "B"), overwrite=True)
    else:
        shardsafe.save(Path(root) / "new", _state(model, "B"))
    del os.environ["SHARDSAFE_CRASH_AT"]
    return "survived"  # the crash point was not reached


def assert_checkpoint_is(path: Path, version: str) -> None:
    """``path`` verifies and loads (into a plain module, no process group) exactly to ``version``."""
    shardsafe.verify(path)
    model = make_model(7)
    state: dict[str, Any] = {"model": model, "tag": torch.zeros(len(version), dtype=torch.int64), "meta": None}
    shardsafe.load(path, state)
    assert state["meta"] == {"version": version}
    assert state["tag"].tolist() == [ord(c) for c in version]
    assert_tensors_equal(full_model_state(model), seeded_values(model, version, 0), f"{path.name} ({version})")


def assert_not_a_checkpoint(path: Path) -> None:
    assert not (path / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.verify(path)
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load(path, {"model": make_model(7)})


def check_after_crash(root: Path, point: str, target: str) -> None:
    published = point == "save:after-publish" and target == "overwrite"
    assert_checkpoint_is(root / "ckpt", "B" if published else "A")
    if target == "new":
        assert_not_a_checkpoint(root / "new")
    assert visible_entries(root) == ["ckpt"], "an interrupted save must not show up next to the checkpoints"
    for leftover in (p.name for p in root.iterdir() if p.name.startswith(".") and p.name != LEASE_DIR):
        assert ".shardsafe-tmp-" in leftover, f"unexpected leftover {leftover}"

    # The next save (no process group here) goes through despite whatever the dead job left.
    assert not dist.is_initialized()
    model = make_model(0)
    set_model_values(model, seeded_values(model, "C", 0))
    shardsafe.save(root / "ckpt", _state(model, "C"), overwrite=True)
    shardsafe.save(root / "new", _state(model, "C"), overwrite=True)
    assert_checkpoint_is(root / "ckpt", "C")
    assert_checkpoint_is(root / "new", "C")
    record("SIGKILL during a sync save (test_crash.py)", faults=1, checked=1)


def test_cases_cover_every_save_crash_point() -> None:
    assert {point for point, _ in CASES} == set(SAVE_POINTS) >= set(COORDINATOR_ONLY)
    assert len(SAVE_POINTS) >= 6


# Each case into both destinations, except after-publish into a new path (the new checkpoint is then
# visible and complete; test_faults_crash.py covers it, as manager saves go into new step folders).
RUNS = [(p, r, t) for p, r in CASES for t in ("overwrite", "new") if not (p == "save:after-publish" and t == "new")]


@pytest.mark.parametrize(("point", "rank", "target"), RUNS, ids=[f"{crash_spec(p, r)}-{t}" for p, r, t in RUNS])
def test_sigkill_during_save(tmp_path: Path, point: str, rank: int | None, target: str) -> None:
    root = tmp_path / "root"
    result = launch(crash_worker, WORLD, str(root), target, crash_spec(point, rank), work_dir=tmp_path, timeout=120)
    assert not result.timed_out, result.describe()
    assert "survived" not in result.results, f"the crash point was not reached\n{result.describe()}"
    killed = [r for r, code in enumerate(result.exitcodes) if code == -signal.SIGKILL]
    if rank is None:
        assert killed, result.describe()
    else:
        assert killed == [rank], f"expected only rank {rank} to SIGKILL itself\n{result.describe()}"
    check_after_crash(root, point, target)


def test_sigkill_under_torchrun_does_not_hang(tmp_path: Path) -> None:
    """The same, with the real launcher: torchrun ends the surviving rank and exits with an error."""
    root, out = tmp_path / "root", tmp_path / "out"
    cmd = torchrun_command(
        crash_worker,
        out,
        (str(root), "overwrite", "save:mid-write@1"),
        ["--standalone", "--nproc_per_node", str(WORLD)],
    )
    try:
        proc = subprocess.run(
            cmd,
            env=torchrun_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=300,
            start_new_session=True,
        )
    finally:
        leftovers = kill_leftover_workers(out)  # never leave a rank behind, whatever happened
    log = proc.stdout.decode(errors="replace")
    assert proc.returncode != 0, log[-5000:]
    assert "SIGKILL" in log or "exitcode  : -9" in log, log[-5000:]
    assert len(worker_pids(out)) == WORLD and leftovers == [], "torchrun left a rank running"
    check_after_crash(root, "save:mid-write", "overwrite")
