"""Two runs on one root (issue 19): restore is part of the run (it waits for the root's lease and loads
what the previous run last committed), a run never silently replaces another run's step, a read-only
manager reads next to a writing run without reporting retired steps as damage, and a save returns
only after the retention it triggered. The other run is a real process."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import run_ranks
from shardsafe.errors import CheckpointExistsError, NoLoadableCheckpointError, ReadOnlyError, ShardsafeError
from shardsafe.manager.catalog import committed_steps, list_checkpoints
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.manager.naming import step_name

SRC = str(Path(__file__).resolve().parents[2] / "src")

WRITER = textwrap.dedent(
    """
    import sys, time, torch, shardsafe
    root, steps, delay, keep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    with shardsafe.CheckpointManager(root, lease_timeout=5, keep_last=keep or None) as manager:
        start = (manager.restore({"w": torch.zeros(4), "who": None}) or 0) + 1
        for step in range(start, steps + 1):
            manager.save(step, {"w": torch.full((4,), float(step)), "who": "A"})
            print("saved", step, flush=True)
            time.sleep(delay)
    print("done", flush=True)
    """
)


def _writer(root: Path, steps: int, delay: float, keep: int) -> subprocess.Popen[str]:
    """Job A: a real process saving steps 1..``steps`` through its own manager, ``delay`` seconds apart."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", WRITER, str(root), str(steps), str(delay), str(keep)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def _wait_for(job: subprocess.Popen[str], line: str) -> None:
    assert job.stdout is not None
    for got in job.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"job A ended (exit {job.wait()}) before printing {line!r}")


def _state(step: int = 0, who: str | None = None) -> dict[str, Any]:
    return {"w": torch.full((4,), float(step)), "who": who}


def _who(root: Path, step: int) -> str:
    state = _state()
    shardsafe.load(root / step_name(step), state)
    return f"{state['who']}:{int(state['w'][0])}"


def test_second_run_restores_the_first_runs_last_step_and_continues_after_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    a = _writer(root, steps=8, delay=0.25, keep=2)
    try:
        _wait_for(a, "saved 3")  # A is mid-way: B starts now
        with shardsafe.CheckpointManager(root, lease_timeout=30) as b:
            state = _state()
            assert b.restore(state) == 8, (
                "restore waits for A's lease, then loads A's last step, not the one it saw first"
            )
            assert state["who"] == "A" and torch.equal(state["w"], torch.full((4,), 8.0))
            assert a.wait(timeout=30) == 0
            a_run = list_checkpoints(root)[-1].run_id
            assert a_run is not None and a_run != b.lease.run_id
            with pytest.raises(CheckpointExistsError) as info:
                b.save(7, _state(7, "B"))  # what B would have saved after restoring step 4 without the lease
            assert f"step 7 is a committed checkpoint written by run {a_run}" in str(info.value)
            b.save(9, _state(9, "B"))
            b.save(10, _state(10, "B"))
        assert [_who(root, s) for s in committed_steps(root)] == ["A:7", "A:8", "B:9", "B:10"]
    finally:
        a.kill()
        a.wait(timeout=10)


def test_read_only_manager_reads_next_to_a_writer_whose_retention_retires_what_it_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardsafe.api.load as load_module
    import shardsafe.manager.manager as manager_module

    # widens the windows A's retention hits: after listing, and between the manifest and the shards
    def pause() -> None:
        time.sleep(random.uniform(0, 0.04))

    load, open_checkpoint = manager_module.load, load_module.open_checkpoint
    monkeypatch.setattr(manager_module, "load", lambda *args, **kwargs: (pause(), load(*args, **kwargs))[1])
    monkeypatch.setattr(
        load_module, "open_checkpoint", lambda *args, **kwargs: (open_checkpoint(*args, **kwargs), pause())[0]
    )
    root = tmp_path / "run"
    a = _writer(root, steps=60, delay=0.0, keep=1)  # keep_last=1: the step a reader lists is retired at A's next save
    try:
        _wait_for(a, "saved 1")
        loaded = []
        with (
            caplog.at_level(logging.DEBUG, logger="shardsafe"),
            shardsafe.CheckpointManager(root, read_only=True) as reader,
        ):
            while a.poll() is None:
                state = _state()
                step = reader.restore(state)  # never waits for A's lease
                assert (
                    step is not None and state["who"] == "A" and torch.equal(state["w"], torch.full((4,), float(step)))
                )
                loaded.append(step)
            assert reader.skipped == []
        assert a.wait(timeout=30) == 0
        assert len(loaded) > 1 and loaded == sorted(loaded)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
        assert any("retired while it was read" in r.getMessage() for r in caplog.records), "the race was not exercised"
        assert [p.name for p in (root / LEASE_DIR).iterdir()] == ["epoch-0000000001.json"], "the reader took no lease"
    finally:
        a.kill()
        a.wait(timeout=10)


def test_a_run_refuses_another_runs_step_and_resaves_its_own(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root) as a:
        a.save(1, _state(1, "A"))
        a.save(2, _state(2, "A"))
        a.save(2, _state(2, "A again"))  # a retry of its own step
        a_run = a.lease.run_id
    assert _who(root, 2) == "A again:2"
    with shardsafe.CheckpointManager(root) as b:
        with pytest.raises(CheckpointExistsError) as info:
            b.save(2, _state(2, "B"))
        assert isinstance(info.value, ShardsafeError)
        message = str(info.value)
        assert (
            f"step 2 is a committed checkpoint written by run {a_run} (lease epoch 1), not by this run "
            f"({b.lease.run_id})" in message
        )
        assert "overwrite=True" in message and "restore()" in message
        assert _who(root, 2) == "A again:2"
        b.save(2, _state(2, "B"), overwrite=True)
        b.save(3, _state(3, "B"))
        b.save(3, _state(3, "B again"))
    assert [_who(root, s) for s in (1, 2, 3)] == ["A:1", "B:2", "B again:3"]
    shardsafe.save(root / step_name(4), _state(4, "plain"))  # no manager, no run id
    with shardsafe.CheckpointManager(root) as c:
        assert c.restore(_state(), step=1) == 1
        c.save(1, _state(1, "C"))  # the step it restored: it continues that history
        with pytest.raises(CheckpointExistsError, match="written by run .* not by this run"):
            c.save(2, _state(2, "C"))
        with pytest.raises(CheckpointExistsError, match="written by no recorded run"):
            c.save(4, _state(4, "C"))
    assert [_who(root, s) for s in (1, 2, 3, 4)] == ["C:1", "B:2", "B again:3", "plain:4"]


def test_read_only_manager_takes_no_lease_and_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (1, 2):
        shardsafe.save(root / step_name(step), _state(step, "plain"))
    with shardsafe.CheckpointManager(root, read_only=True, keep_last=1, async_save=True) as reader:
        state = _state()
        assert reader.restore(state) == 2 and state["who"] == "plain"
        with pytest.raises(ReadOnlyError, match="read-only .* does not save step 3"):
            reader.save(3, _state(3))
        with pytest.raises(ReadOnlyError, match="does not delete"):
            reader.apply_retention()
    assert committed_steps(root) == [1, 2] and not (root / LEASE_DIR).exists()
    with pytest.raises(ValueError, match="read_only"):
        shardsafe.CheckpointManager(root, read_only=True, handle_preemption=True)
    (root / step_name(2) / "manifest.json").write_bytes(b"{")
    (root / step_name(1) / "manifest.json").write_bytes(b"[]")
    with pytest.raises(NoLoadableCheckpointError, match="none of the 2 committed checkpoints"):
        shardsafe.CheckpointManager(root, read_only=True).restore(_state())


def _retention_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank records what the root holds right after each save returns; rank 0's deleter is slowed down."""
    import shardsafe.manager.manager as manager_module

    if rank == 0:
        retire = manager_module.retire

        def slow_retire(*args: Any, **kwargs: Any) -> None:
            time.sleep(0.4)
            retire(*args, **kwargs)

        manager_module.retire = slow_retire  # type: ignore[assignment]
    seen: dict[str, list[list[int]]] = {}
    for mode in (False, True):
        folder = Path(root) / f"async-{mode}"
        seen[str(mode)] = []
        with shardsafe.CheckpointManager(folder, keep_last=1, async_save=mode, lease_timeout=10) as manager:
            for step in (1, 2, 3):
                manager.save(step, {"w": torch.full((4,), float(step + rank))})
                manager.wait()  # an async save is committed, and its retention done, when this returns
                seen[str(mode)].append(committed_steps(folder))
    with shardsafe.CheckpointManager(Path(root) / "async-False") as other:
        try:
            other.save(3, {"w": torch.zeros(4)})
            refused = ""
        except CheckpointExistsError as exc:
            refused = str(exc)
    return {"seen": seen, "refused": refused}


def test_save_returns_on_every_rank_after_its_retention(tmp_path: Path) -> None:
    results = run_ranks(_retention_job, 2, str(tmp_path / "root"), work_dir=tmp_path / "w")
    assert [r["seen"] for r in results] == [{"False": [[1], [2], [3]], "True": [[1], [2], [3]]}] * 2
    for rank, result in enumerate(results):
        assert "step 3 is a committed checkpoint written by run" in result["refused"], f"rank {rank}: every rank raises"
