"""One live run per CheckpointManager root: a second job is refused, a zombie publishes and deletes
nothing after its lease was taken over, a killed holder is replaced at once, ranks share one lease,
and S3 roots (moto) behave the same. The other job is a real process."""

from __future__ import annotations

import os
import signal
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
from shardsafe.errors import LeaseHeldError
from shardsafe.manager.catalog import committed_steps, list_checkpoints
from shardsafe.manager.naming import step_name

pytest_plugins = ["servers.fixtures"]  # s3_bucket

SRC = str(Path(__file__).resolve().parents[2] / "src")

JOB = textwrap.dedent(
    """
    import sys, torch, shardsafe
    root, timeout, keep = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    manager = shardsafe.CheckpointManager(root, lease_timeout=timeout, keep_last=keep or None)
    print("ready", flush=True)
    for line in sys.stdin:  # "save N": save a state tagged "A" at step N
        step = int(line.split()[1])
        try:
            manager.save(step, {"w": torch.full((4,), float(step)), "who": "A"})
            print("saved", step, flush=True)
        except shardsafe.ShardsafeError as exc:
            print("error", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    """
)


class Job:
    """A single-process training job saving through its own CheckpointManager."""

    def __init__(self, root: str, timeout: float, keep: int = 0, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-c", JOB, root, str(timeout), str(keep)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full_env)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def save(self, step: int) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"save {step}\n")
        self.proc.stdin.flush()
        return self._line()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def end(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def _who(root: Path, step: int) -> str:
    state: dict[str, Any] = {"w": torch.zeros(4), "who": None}
    shardsafe.load(root / step_name(step), state)
    return f"{state['who']}:{int(state['w'][0])}"


def test_second_job_on_a_live_root_is_refused_and_the_first_is_untouched(tmp_path: Path) -> None:
    root = tmp_path / "run"
    a = Job(str(root), timeout=2)
    try:
        assert a.save(1) == "saved 1"
        second = shardsafe.CheckpointManager(root, lease_timeout=1, keep_last=1)
        with pytest.raises(LeaseHeldError) as info:
            second.save(7, {"w": torch.full((4,), 7.0), "who": "B"})
        message = str(info.value)
        assert (
            f"pid {a.proc.pid}" in message
            and "host " in message
            and "heartbeat" in message
            and "another root" in message
        )
        assert committed_steps(root) == [1]  # B published nothing and deleted nothing
        assert a.save(2) == "saved 2"
        assert [_who(root, s) for s in committed_steps(root)] == ["A:1", "A:2"]
    finally:
        a.end()


def test_zombie_job_publishes_and_deletes_nothing_after_takeover(tmp_path: Path) -> None:
    root = tmp_path / "run"
    a = Job(str(root), timeout=1.5, keep=1)
    try:
        assert a.save(1) == "saved 1"
        a.signal(signal.SIGSTOP)  # paused: its heartbeat stops
        with shardsafe.CheckpointManager(root, lease_timeout=1.5) as b:
            b.save(5, {"w": torch.full((4,), 5.0), "who": "B"})  # waits for A's lease to lapse, then takes over
            a.signal(signal.SIGCONT)
            answer = a.save(2)
            assert answer.startswith("error LeaseLostError") and "taken over" in answer, answer
            b.save(6, {"w": torch.full((4,), 6.0), "who": "B"})
        assert committed_steps(root) == [1, 5, 6]  # A's step 2 is invisible; A's keep_last=1 deleted nothing
        assert [_who(root, s) for s in (1, 5, 6)] == ["A:1", "B:5", "B:6"]
        assert not [p for p in root.iterdir() if p.name.startswith(".") and "shardsafe-tmp" in p.name]
        infos = list_checkpoints(root)
        assert infos[0].lease_epoch == 1 and infos[1].lease_epoch == 2 and infos[0].run_id != infos[1].run_id
    finally:
        a.end()


def test_killed_holder_on_this_host_is_replaced_at_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    a = Job(str(root), timeout=600)
    assert a.save(1) == "saved 1"
    a.signal(signal.SIGKILL)
    a.end()
    start = time.monotonic()
    with shardsafe.CheckpointManager(root, lease_timeout=600) as b:
        b.save(2, {"w": torch.full((4,), 2.0), "who": "B"})
    assert time.monotonic() - start < 20  # not the 600 s lease timeout: the holder's pid is gone
    assert committed_steps(root) == [1, 2]


def _ranks_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    with shardsafe.CheckpointManager(root, keep_last=2, lease_timeout=5) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((4,), float(step + rank)), "step": step})
        return {"run_id": manager.lease.run_id, "epoch": manager.lease.epoch}


def test_two_ranks_hold_one_lease(tmp_path: Path) -> None:
    root = tmp_path / "run"
    results = run_ranks(_ranks_job, 2, str(root), work_dir=tmp_path / "w")
    assert results[0] == results[1] and results[0]["epoch"] == 1  # one lease, known on both ranks
    assert committed_steps(root) == [2, 3]
    assert [i.run_id for i in list_checkpoints(root)] == [results[0]["run_id"]] * 2
    assert len(list((root / ".shardsafe-lease").glob("epoch-*.json"))) == 1


def test_s3_root_second_job_is_refused(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    a = Job(root, timeout=3, env=env)
    try:
        assert a.save(1) == "saved 1"
        with pytest.raises(LeaseHeldError):
            shardsafe.CheckpointManager(root, lease_timeout=0.5).save(2, {"w": torch.zeros(4)})
        assert a.save(2) == "saved 2"
    finally:
        a.end()
