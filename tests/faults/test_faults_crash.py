"""SIGKILL of a rank (the coordinator included) in the middle of CheckpointManager saves - async,
overlapped and sync - and of retention, locally, with dedup, and on S3; and a crash between the
two renames of an overwrite on a filesystem without RENAME_EXCHANGE.

test_crash.py already kills plain ``shardsafe.save`` at every save point; here a 2-rank FSDP2 job
runs a manager (keep_last=2) through steps 1-3 and the fault is armed for step 3, whose save
(and the retention after it, which retires step 1) runs in the background thread when async.
Afterwards, in the test process: exactly the expected steps are committed, each loads bit for bit,
nothing else passes for a checkpoint, ``collect_garbage`` cleans what the dead job left, and a
restarted job resumes and saves again.

The default run covers every manager crash point at least once, on the coordinator and on
another rank; ``-m stress`` runs the rest of the cross product (mode x dedup x point x rank).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_crash import assert_checkpoint_is

import shardsafe
from dist_utils import launch, make_model, seeded_values, set_model_values, shard
from fault_utils import check_root_after_fault, manager_job, resume_and_save
from reliability import record
from shardsafe.core.faults import POINTS
from shardsafe.errors import CheckpointNotFoundError

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

WORLD = 2
PER_RANK = ["async:before-write", "save:after-prepare", "save:mid-write", "save:before-fsync", "save:after-write"]
COORDINATOR = [
    "save:before-manifest",
    "save:before-publish",
    "save:after-publish",
    "retention:before-rename",
    "retention:after-rename",
    "retention:mid-delete",
]
# Points a manager save or retention never reaches: between-renames needs a filesystem without
# RENAME_EXCHANGE (tested below); the others are on the object-store path only where noted.
NOT_ON_S3 = {"save:mid-write", "save:before-fsync", "save:before-publish", "retention:mid-delete"}


def committed_after(point: str) -> list[int]:
    """Steps committed after a crash at ``point`` during step 3 (steps 1 and 2 committed before)."""
    if point in ("save:after-publish", "retention:before-rename"):
        return [1, 2, 3]  # step 3 is visible; retention had not started
    if point.startswith("retention:"):
        return [2, 3]  # step 1 is retired (hidden, or its manifest gone), not yet deleted
    return [1, 2]


def reachable(point: str, mode: Any, dedup: bool, s3: bool) -> bool:
    if point == "async:before-write" and not mode:
        return False
    if point == "retention:mid-delete" and dedup:
        return False  # a referenced checkpoint loses its manifest and keeps its data: no hidden folder
    return not (s3 and point in NOT_ON_S3)


def all_cases(s3: bool) -> list[tuple[Any, bool, str, int | None]]:
    """(async mode, dedup, point, rank) for every reachable combination; rank None arms every rank."""
    out = []
    for mode in [True] if s3 else [True, "overlap", False]:
        for dedup in [False] if s3 else [False, True]:
            for point in PER_RANK + COORDINATOR:
                if not reachable(point, mode, dedup, s3):
                    continue
                for rank in (0, 1, None) if point in PER_RANK else (0,):
                    out.append((mode, dedup, point, rank))
    return out


# Default run: every point on the coordinator, three per-rank points on rank 1 (async), all ranks
# at once for one point, the retention points in sync mode, dedup retention, overlap mode.
DEFAULT = (
    [(True, False, point, 0) for point in PER_RANK + COORDINATOR]
    + [(True, False, point, 1) for point in ("save:after-prepare", "save:mid-write", "save:after-write")]
    + [(True, False, "save:after-write", None)]
    + [(False, False, "retention:before-rename", 0), (False, False, "retention:mid-delete", 0)]
    + [(True, True, "retention:before-rename", 0), (True, True, "retention:after-rename", 0)]
    + [("overlap", False, "async:before-write", 1)]
)
STRESS = [case for case in all_cases(False) if case not in DEFAULT]
S3_DEFAULT = [(True, False, "retention:after-rename", 0)]  # a whole S3 save, then retirement by deleting the manifest
S3_STRESS = [case for case in all_cases(True) if case not in S3_DEFAULT]


def case_id(case: tuple[Any, bool, str, int | None]) -> str:
    mode, dedup, point, rank = case
    mode_name = {True: "async", "overlap": "overlap", False: "sync"}[mode]
    return f"{mode_name}{'-dedup' if dedup else ''}-{point}@{'all' if rank is None else rank}"


def test_cases_cover_every_manager_point() -> None:
    used = {point for _, _, point, _ in DEFAULT}
    assert used == set(PER_RANK + COORDINATOR)
    # save:between-renames is armed below (no RENAME_EXCHANGE), push:before-marker in tests/hf/test_push.py,
    # tier:before-copy in tests/manager/test_tier.py
    assert set(POINTS) - used - {"save:between-renames", "push:before-marker", "tier:before-copy"} == set(), (
        "a fault point no test arms"
    )
    assert {rank for _, _, _, rank in DEFAULT} == {0, 1, None}


def _run_crash(tmp_path: Path, root: str, case: tuple[Any, bool, str, int | None], env: dict[str, str]) -> None:
    mode, dedup, point, rank = case
    spec = point if rank is None else f"{point}@{rank}"
    options = {"async_save": mode, "dedup": dedup}
    result = launch(
        manager_job, WORLD, root, options, ("SHARDSAFE_CRASH_AT", spec), 3, dedup, env, work_dir=tmp_path, timeout=120
    )
    assert not result.timed_out, result.describe()
    killed = [r for r, code in enumerate(result.exitcodes) if code == -signal.SIGKILL]
    # (after a retention point, the other ranks may have finished: retention runs on the coordinator alone)
    assert killed and (rank is None or killed == [rank]), f"the crash point was not reached\n{result.describe()}"
    checked = check_root_after_fault(root, committed_after(point), dedup)
    resume_and_save(root, 4, dedup, dedup=dedup)
    record(f"SIGKILL during a {'S3 ' if '://' in root else ''}manager save or retention", faults=1, checked=checked)


@pytest.mark.parametrize("case", DEFAULT, ids=[case_id(c) for c in DEFAULT])
def test_sigkill_during_manager_save(tmp_path: Path, case: tuple[Any, bool, str, int | None]) -> None:
    _run_crash(tmp_path, str(tmp_path / "ckpt"), case, {})


@pytest.mark.stress
@pytest.mark.parametrize("case", STRESS, ids=[case_id(c) for c in STRESS])
def test_sigkill_during_manager_save_sweep(tmp_path: Path, case: tuple[Any, bool, str, int | None]) -> None:
    _run_crash(tmp_path, str(tmp_path / "ckpt"), case, {})


def _s3_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


@pytest.mark.parametrize("case", S3_DEFAULT, ids=[case_id(c) for c in S3_DEFAULT])
def test_sigkill_during_s3_manager_save(
    s3_bucket: str, tmp_path: Path, case: tuple[Any, bool, str, int | None]
) -> None:
    _run_crash(tmp_path, f"s3://{s3_bucket}/run", case, _s3_env())


@pytest.mark.stress
@pytest.mark.parametrize("case", S3_STRESS, ids=[case_id(c) for c in S3_STRESS])
def test_sigkill_during_s3_manager_save_sweep(
    s3_bucket: str, tmp_path: Path, case: tuple[Any, bool, str, int | None]
) -> None:
    _run_crash(tmp_path, f"s3://{s3_bucket}/run", case, _s3_env())


# ----------------------------------------------------------------------------- no RENAME_EXCHANGE


def _no_exchange() -> None:
    """Make this process behave as on a filesystem without renameat2(RENAME_EXCHANGE)."""
    import shardsafe.protocol.temppath

    shardsafe.protocol.temppath.exchange_paths = lambda a, b: False  # type: ignore[assignment]


def _ab_state(model: Any, version: str) -> dict[str, Any]:
    return {"model": model, "tag": torch.tensor([ord(c) for c in version]), "meta": {"version": version}}


def fallback_job(rank: int, world_size: int, root: str, spec: str) -> str:
    _no_exchange()
    model = shard(make_model(0), world_size)
    set_model_values(model, seeded_values(model, "A", 0))
    shardsafe.save(Path(root) / "ckpt", _ab_state(model, "A"))
    dist.barrier()
    set_model_values(model, seeded_values(model, "B", 0))
    os.environ["SHARDSAFE_CRASH_AT"] = spec
    shardsafe.save(Path(root) / "ckpt", _ab_state(model, "B"), overwrite=True)
    return "survived"


def test_sigkill_between_the_renames_of_an_overwrite(tmp_path: Path) -> None:
    """Without RENAME_EXCHANGE an overwrite moves the old checkpoint aside, then the new one in. Killed
    in between, no checkpoint is at the path; collect_garbage must put the old one back, not delete it."""
    root = tmp_path / "root"
    result = launch(fallback_job, WORLD, str(root), "save:between-renames@0", work_dir=tmp_path, timeout=120)
    assert "survived" not in result.results and result.exitcodes[0] == -signal.SIGKILL, result.describe()
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load(root / "ckpt", {"model": make_model(1)})
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    assert any(".shardsafe-old-" in name for name in hidden), hidden
    removed = shardsafe.collect_garbage(root)
    assert len(removed) == len(hidden)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt"]
    assert_checkpoint_is(root / "ckpt", "A")
    record("SIGKILL between the two renames of an overwrite (no RENAME_EXCHANGE)", faults=1, checked=1)


def test_failure_between_the_renames_puts_the_old_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_exchange_here(monkeypatch)
    model = make_model(0)
    set_model_values(model, seeded_values(model, "A", 0))
    shardsafe.save(tmp_path / "ckpt", _ab_state(model, "A"))
    set_model_values(model, seeded_values(model, "B", 0))
    monkeypatch.setenv("SHARDSAFE_FAIL_AT", "save:between-renames")
    with pytest.raises(shardsafe.SaveError, match="injected I/O error"):
        shardsafe.save(tmp_path / "ckpt", _ab_state(model, "B"), overwrite=True)
    monkeypatch.delenv("SHARDSAFE_FAIL_AT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_checkpoint_is(tmp_path / "ckpt", "A")
    shardsafe.save(tmp_path / "ckpt", _ab_state(model, "B"), overwrite=True)  # and the fallback itself works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert_checkpoint_is(tmp_path / "ckpt", "B")
    record("EIO between the two renames of an overwrite (no RENAME_EXCHANGE)", faults=1, checked=2)


def _no_exchange_here(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardsafe.protocol.temppath

    monkeypatch.setattr(shardsafe.protocol.temppath, "exchange_paths", lambda a, b: False)
