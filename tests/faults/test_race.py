"""Many ranks saving many times into one root, on one node and on two "nodes" at once.

Every rank of a job calls ``shardsafe.save`` 50 times into distinct step folders of one root and
50 times into one path with ``overwrite=True``. No rank may ever hit ``FileExistsError`` (or any
other error), no temporary folder may be left behind, and every final checkpoint must verify and
load to exactly the values that were saved (recomputed here from their seeds).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch

import shardsafe
from dist_utils import (
    assert_tensors_equal,
    free_port,
    full_model_state,
    kill_leftover_workers,
    load_results,
    make_model,
    run_ranks,
    seeded_values,
    set_model_values,
    shard,
    torchrun_command,
    torchrun_env,
    visible_entries,
)
from shardsafe.manager.lease import LEASE_DIR

SAVES = 50
LATEST = "latest"


def step_name(i: int) -> str:
    return f"step-{i:03d}"


def race_worker(rank: int, world_size: int, root: str, saves: int, tag: str) -> dict[str, Any]:
    """Each iteration: a new step folder, then the same ``latest`` folder overwritten."""
    model = shard(make_model(0), world_size)
    counter = torch.zeros((), dtype=torch.int64)
    for i in range(saves):
        set_model_values(model, seeded_values(model, tag, i))
        counter.fill_(i)
        state = {"model": model, "counter": counter, "meta": {"step": i, "tag": tag}}
        shardsafe.save(Path(root) / step_name(i), state)
        shardsafe.save(Path(root) / LATEST, state, overwrite=True)
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "pid": os.getpid(),
    }


def check_root(root: Path, saves: int, tag: str, world_size: int) -> None:
    expected = sorted([step_name(i) for i in range(saves)] + [LATEST])
    assert visible_entries(root) == expected
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name != LEASE_DIR)
    assert leftovers == [], f"successful saves left temporary folders behind: {leftovers}"
    model = make_model(0)  # plain module, no process group: loads what 2+ ranks wrote
    for name in expected:
        i = saves - 1 if name == LATEST else int(name.split("-")[1])
        summary = shardsafe.verify(root / name)
        assert summary["world_size"] == world_size
        counter = torch.full((), -1, dtype=torch.int64)
        state: dict[str, Any] = {"model": model, "counter": counter, "meta": None}
        shardsafe.load(root / name, state)
        assert_tensors_equal(full_model_state(model), seeded_values(model, tag, i), f"{name} model")
        assert counter.item() == i
        assert state["meta"] == {"step": i, "tag": tag}


def test_every_rank_saving_repeatedly_into_one_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = run_ranks(race_worker, 3, str(root), SAVES, "one-node", work_dir=tmp_path, timeout=400)
    assert [r["rank"] for r in results] == [0, 1, 2]
    check_root(root, SAVES, "one-node", world_size=3)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """End launchers (SIGTERM lets torchrun end its workers) that are still running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def _run_two_nodes(base: Path) -> tuple[list[int | None], str]:
    """Start both launchers at once, wait for both (bounded); returns their exit codes and output."""
    port = free_port()
    procs, logs = [], []
    for node in range(2):
        cmd = torchrun_command(
            race_worker,
            base / "out",
            (str(base / "root"), SAVES, "two-nodes"),
            [
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
            ],
        )
        log = open(base / f"node{node}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(cmd, env=torchrun_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    codes: list[int | None] = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=400))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        _stop(procs)
        kill_leftover_workers(base / "out")
        for log in logs:
            log.close()
    return codes, "\n".join(
        f"--- node {n} ---\n" + (base / f"node{n}.log").read_text(errors="replace")[-5000:] for n in range(2)
    )


def test_two_nodes_sharing_one_root(tmp_path: Path) -> None:
    """Two torch.distributed.run launchers (--nnodes 2, one rank each, so both ranks are local rank 0)."""
    for attempt in range(2):  # a second try only if another process grabbed the free port first
        base = tmp_path / f"attempt{attempt}"
        base.mkdir()
        codes, text = _run_two_nodes(base)
        if codes == [0, 0] or "Address already in use" not in text:
            break
    assert codes == [0, 0], f"launchers exited with {codes}\n{text}"
    results = load_results(base / "out", 2)
    assert [r["rank"] for r in results] == [0, 1] and [r["local_rank"] for r in results] == [0, 0]
    assert "FileExistsError" not in text
    check_root(base / "root", SAVES, "two-nodes", world_size=2)
