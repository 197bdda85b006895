"""The local tier of CheckpointManager: node ids, per-node folders, restore from the fastest complete tier.

Four gloo ranks play two "nodes" (``SHARDSAFE_NODE`` = a for ranks 0-1, b for ranks 2-3), each
node with its own folder (``local_dir`` holds ``{node}``), all on this machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
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
    launch,
    make_model,
    make_optimizer,
    rank_batch,
    run_ranks,
    shard,
    train_step,
)
from shardsafe.core.comm import get_comm
from shardsafe.manager.catalog import committed_steps
from shardsafe.manager.naming import step_name
from shardsafe.manager.nodes import (
    DEFAULT_LOCAL_DIR,
    NODE_ENV,
    NodeMap,
    gather_nodes,
    node_dir,
    node_id,
    user_name,
)
from shardsafe.manager.tier import SPARE_NAME


def _node_of(rank: int) -> str:
    return "a" if rank < 2 else "b"


def _nodes_job(rank: int, world_size: int) -> dict[str, Any]:
    os.environ[NODE_ENV] = _node_of(rank)
    nodes = gather_nodes(get_comm())
    return {
        "node_of": nodes.node_of,
        "ranks_of": dict(nodes.ranks_of),
        "node": nodes.node,
        "leader": nodes.leader(),
        "is_leader": nodes.is_leader,
        "leaders": nodes.leaders,
    }


def test_node_map_of_four_ranks_as_two_simulated_nodes(tmp_path: Path) -> None:
    results = run_ranks(_nodes_job, 4, work_dir=tmp_path)
    for rank, got in enumerate(results):
        assert got["node_of"] == ("a", "a", "b", "b")
        assert got["ranks_of"] == {"a": (0, 1), "b": (2, 3)}
        assert got["node"] == _node_of(rank)
        assert got["leader"] == (0 if rank < 2 else 2)
        assert got["is_leader"] == (rank in (0, 2))
        assert got["leaders"] == (0, 2)


def _bad_node_job(rank: int, world_size: int) -> str:
    os.environ[NODE_ENV] = "../escape" if rank == 1 else "ok"
    try:
        gather_nodes(get_comm())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_unusable_node_id_fails_every_rank_alike(tmp_path: Path) -> None:
    results = run_ranks(_bad_node_job, 2, work_dir=tmp_path)
    assert results[0] == results[1] and results[0].startswith("rank 1: SHARDSAFE_NODE='../escape'")


def test_node_id_and_folder_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_ENV, "node-7")
    assert node_id() == "node-7"
    import pwd

    user = pwd.getpwuid(os.geteuid()).pw_name  # this machine's runner has a plain name
    assert node_dir(DEFAULT_LOCAL_DIR, node_id()) == Path(f"/dev/shm/shardsafe-{user}-node-7")
    assert node_dir("/tmp/fixed", "x") == Path("/tmp/fixed")
    assert node_dir("/tmp/{user}/{node}", "x") == Path(f"/tmp/{user}/x")
    # no password entry (a container), or a name that is not a plain file name: the user id
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    assert user_name() == str(os.geteuid())
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: type("Entry", (), {"pw_name": "../x"})())
    assert user_name() == str(os.geteuid())
    monkeypatch.delenv(NODE_ENV)
    assert node_id() and "/" not in node_id()
    single = NodeMap.from_ids(["h"], 0)
    assert single.is_leader and single.leaders == (0,) and single.nodes == ("h",)


# ----------------------------------------------------------------------------- the local tier

SHARDS = {
    node: [f"shard-{r:05d}.{kind}" for r in ranks for kind in ("index.json", "safetensors")]
    for node, ranks in (("a", (0, 1)), ("b", (2, 3)))
}
SHARED = ["manifest.json", "state.json"]


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optim": optimizer, "rng": shardsafe.RNGState(), "step": 0}


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """Collective: the whole model and optimizer state, the step and this rank's RNG draw."""
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer), "step": state["step"]}


def _train_job(
    rank: int,
    world_size: int,
    root: str,
    local: str,
    steps: int,
    options: dict[str, Any],
    record: list[int],
    short_on: str | None,
    crash: tuple[int, str] | None = None,
    inodes: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` steps under a manager with a local tier, then stop without close() (a crash:
    the tier is left as it was). Returns the state at each step of ``record`` (also written to
    ``rank<r>-step<s>.pt`` next to ``root``, for a job that is killed). ``crash``: (step, point):
    arm ``SHARDSAFE_CRASH_AT`` before saving that step. ``inodes``: after each save, wait for the
    tier and record the inode of every shard file of this node's folder of that step."""
    os.environ[NODE_ENV] = _node_of(rank)
    if short_on == _node_of(rank):  # this node's local folder reports (almost) no free space
        shardsafe.manager.tier.shutil.disk_usage = lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000)  # type: ignore[attr-defined]
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    torch.manual_seed(100 + rank)
    manager = shardsafe.CheckpointManager(root, local_dir=local, **options)
    recorded = {}
    seen: dict[int, dict[str, int]] = {}
    for step in range(1, steps + 1):
        train_step(model, optimizer, *rank_batch(rank, step))
        state["step"] = step
        if crash is not None and crash[0] == step:
            os.environ["SHARDSAFE_CRASH_AT"] = crash[1]
        manager.save(step, state)
        if inodes:
            manager._tier_worker.join()
            if manager._tier is not None and manager._tier.saved == step:
                folder = manager._tier.step_folder(step)
                seen[step] = {p.name: p.stat().st_ino for p in folder.glob("*.safetensors")}
        if step in record:
            recorded[step] = _snapshot(model, optimizer, state)
            torch.save(recorded[step], Path(root).parent / f"rank{rank}-step{step}.pt")
    manager.wait()
    assert manager._tier is not None
    return {
        "recorded": recorded,
        "errors": list(manager._tier.errors),
        "saved": manager._tier.saved,
        "tier_buffers": len(manager._tier_staging.buffers),
        "inodes": seen,
        "rng": torch.rand(3),
    }


def _restore_job(
    rank: int,
    world_size: int,
    root: str,
    local: str,
    options: dict[str, Any],
    close: bool,
    nodes: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Restore a fresh state; ``nodes``: each rank's node (default: a for ranks 0-1, b for 2-3)."""
    os.environ[NODE_ENV] = _node_of(rank) if nodes is None else nodes[rank]
    model = shard(make_model(7), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    manager = shardsafe.CheckpointManager(root, local_dir=local, **options)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardsafe").addHandler(handler)
    step = manager.restore(state)
    logging.getLogger("shardsafe").removeHandler(handler)
    out = {
        "step": step,
        "from": manager.restored_from,
        "state": _snapshot(model, optimizer, state),
        "rng": torch.rand(3),
        "log": messages,
        "received": dict(manager._tier.received) if manager._tier is not None else {},
    }
    if close:
        manager.close()
    return out


def _tier_folder(local: Path, node: str) -> Path:
    (folder,) = (local / node).iterdir()  # one root's tier folder per node
    return folder


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _assert_same_state(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert got["step"] == expected["step"], what
    assert_tensors_equal(got["model"], expected["model"], f"{what} model")
    assert_optimizer_equal(got["optim"], expected["optim"], f"{what} optim")


def test_local_steps_are_written_per_node_and_restored_after_a_crash(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1, "async_save": True}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 6, options, [6], None, work_dir=tmp_path)
    assert committed_steps(root) == [4]
    assert all(r["errors"] == [] and r["saved"] == 6 for r in first)
    for node in ("a", "b"):  # the newest step only; each node its own ranks' shards and its copy of the shared files
        folder = _tier_folder(local, node)
        assert _files(folder) == [SPARE_NAME, step_name(6)]  # and step 5, retired, as the next save's spare
        assert _files(folder / step_name(6)) == sorted(SHARDS[node] + SHARED)
    manifest_a = (_tier_folder(local, "a") / step_name(6) / "manifest.json").read_bytes()
    assert manifest_a == (_tier_folder(local, "b") / step_name(6) / "manifest.json").read_bytes()
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, True, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "local")
        _assert_same_state(got["state"], first[rank]["recorded"][6], f"rank {rank}")
        assert torch.equal(got["rng"], first[rank]["rng"]), f"rank {rank}: RNG not restored"
    assert not (local / "a").exists() and not (local / "b").exists()  # close() removed the tier


def test_a_step_due_in_both_tiers_is_copied_once_and_both_hold_it(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 2, "local_every": 2, "async_save": True}
    first = run_ranks(_train_job, 2, str(root), str(local / "{node}"), 4, options, [4], None, work_dir=tmp_path)
    assert committed_steps(root) == [2, 4] and _files(_tier_folder(local, "a")) == [SPARE_NAME, step_name(4)]
    assert [(r["errors"], r["saved"]) for r in first] == [([], 4)] * 2  # the newest local step
    assert all(r["tier_buffers"] == 0 for r in first)  # the tier wrote from the root's staged copy
    shutil.rmtree(root / step_name(4))  # now only the local tier holds step 4
    second = run_ranks(_restore_job, 2, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (4, "local")
        _assert_same_state(got["state"], first[rank]["recorded"][4], f"rank {rank}")


def test_overlap_mode_copies_a_local_step_in_the_background_and_saves_the_state_at_the_call(tmp_path: Path) -> None:
    # async_save="overlap": the local save returns at once; step 7 trains while the tier's thread writes
    # step 6 from the live tensors, its optimizer step waiting for those files: the tier holds step 6 as it
    # was at the call
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 100, "local_every": 2, "async_save": "overlap"}
    first = run_ranks(_train_job, 2, str(root), str(local / "{node}"), 7, options, [6], None, work_dir=tmp_path)
    assert committed_steps(root) == [] and _files(_tier_folder(local, "a")) == [SPARE_NAME, step_name(6)]
    assert [(r["errors"], r["saved"]) for r in first] == [([], 6)] * 2
    assert all(r["tier_buffers"] == 0 for r in first)  # a host state is written from the live tensors, not staged
    second = run_ranks(_restore_job, 2, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "local")
        _assert_same_state(got["state"], first[rank]["recorded"][6], f"rank {rank}")


def test_root_newer_than_every_local_step_is_restored_from_the_root(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 3, "local_every": 4}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 6, options, [6], None, work_dir=tmp_path)
    assert committed_steps(root) == [3, 6] and _files(_tier_folder(local, "a")) == [step_name(4)]
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "root")
        _assert_same_state(got["state"], first[rank]["recorded"][6], f"rank {rank}")


@pytest.mark.parametrize(
    "replicas, lost", [(0, ("b",)), (1, ("a", "b"))], ids=["one node, no replicas", "both nodes, replicas=1"]
)
def test_a_lost_node_without_a_copy_falls_back_to_the_root(
    tmp_path: Path, replicas: int, lost: tuple[str, ...]
) -> None:
    """Node b lost without replicas, or both nodes lost at once with replicas=1: no node holds
    b's files, so the step is incomplete and the root's newest is restored (said in the log)."""
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1, "replicas": replicas}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 5, options, [4], None, work_dir=tmp_path)
    for node in lost:
        shutil.rmtree(local / node)
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (4, "root")
        _assert_same_state(got["state"], first[rank]["recorded"][4], f"rank {rank}")
    if len(lost) == 1:
        reason = "passed over step 5: no node holds shard-00002.index.json, shard-00002.safetensors"
        assert any(reason in m for m in second[0]["log"]), second[0]["log"]
        # what the jobs left in node a's host memory (neither closed), removed by `shardsafe gc --local` on node a
        gc = [
            sys.executable,
            "-m",
            "shardsafe.cli",
            "gc",
            str(root),
            "--local",
            "--local-dir",
            str(local / "{node}"),
            "--min-age",
            "0",
        ]
        env = {**os.environ, NODE_ENV: "a"}
        dry = subprocess.run([*gc, "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
        assert dry.returncode == 0 and f"would remove {_tier_folder(local, 'a') / step_name(5)}" in dry.stdout, (
            dry.stdout + dry.stderr
        )
        done = subprocess.run(gc, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0 and not (local / "a").exists(), done.stdout + done.stderr
        bad = subprocess.run(gc, capture_output=True, text=True, env={**os.environ, NODE_ENV: "../b"}, timeout=60)
        assert (
            bad.returncode == 1
            and "SHARDSAFE_NODE='../b' is not a usable node id" in bad.stderr
            and "internal" not in bad.stderr
        ), bad.stderr


def test_a_node_short_of_space_skips_the_local_save_on_every_rank(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 2, "local_every": 1}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 2, options, [], "b", work_dir=tmp_path)
    for got in first:
        assert got["saved"] is None and len(got["errors"]) == 2
        assert "too little space" in got["errors"][0] and "node b: 1000 bytes free" in got["errors"][0]
    assert committed_steps(root) == [2]
    assert not (local / "a").exists() or not any((local / "a").rglob("manifest.json"))


def test_replicas_restore_a_wiped_node_from_its_peer(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1, "replicas": 1}
    first = run_ranks(
        _train_job, 4, str(root), str(local / "{node}"), 6, options, [6], None, None, True, work_dir=tmp_path
    )
    for node in ("a", "b"):  # its own files and its peer's: each node's folder holds the whole step
        assert _files(_tier_folder(local, node) / step_name(6)) == sorted(SHARDS["a"] + SHARDS["b"] + SHARED)
        # step 5, retired when step 6 was complete, is the spare the next save writes over
        assert _files(_tier_folder(local, node)) == [SPARE_NAME, step_name(6)]
        assert _files(_tier_folder(local, node) / SPARE_NAME) == sorted(SHARDS["a"] + SHARDS["b"] + SHARED)
    for rank in (0, 2):  # each save wrote its shards and received its replicas over the files of two steps before
        inodes = first[rank]["inodes"]
        assert sorted(inodes) == [1, 2, 3, 4, 5, 6] and len(inodes[6]) == 4
        assert [inodes[s] for s in (3, 4, 5, 6)] == [inodes[1], inodes[2], inodes[3], inodes[4]]
        assert set(inodes[1].values()).isdisjoint(inodes[2].values())
    shutil.rmtree(local / "b")  # node b lost, its folder with it
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "local")
        _assert_same_state(got["state"], first[rank]["recorded"][6], f"rank {rank}")
        assert torch.equal(got["rng"], first[rank]["rng"]), f"rank {rank}: RNG not restored"
    # b's folder got back only the small files; its ranks' tensors came straight from node a's replicas
    # (the load's exchange), with the values decoded whole (the replicated scalars node a's shards hold)
    folder_b = _tier_folder(local, "b") / step_name(6)
    manifest = _manifest(_tier_folder(local, "a") / step_name(6))
    indexes = [n for n in SHARDS["a"] + SHARDS["b"] if n.endswith(".index.json")]
    assert _files(folder_b) == sorted(indexes + SHARED)
    sent = second[0]["received"]["b"]
    assert second[0]["received"]["a"] < 4096  # a scalar several ranks read, read once and shared (two nodes)
    tensors_sent = sent - _small(manifest, folder_b)
    payload_b = _payload(_tier_folder(local, "a") / step_name(6), (2, 3))  # b's shards' tensor bytes
    assert payload_b <= tensors_sent <= payload_b + _payload(_tier_folder(local, "a") / step_name(6), (0, 1)) // 4
    # restored again: b still lacks its shards (only its ranks' loads receive them), not the small files
    again = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(again):
        assert (got["step"], got["from"]) == (6, "local"), got["log"]
        _assert_same_state(got["state"], first[rank]["recorded"][6], f"rank {rank} again")
    assert again[0]["received"]["b"] == tensors_sent and again[0]["received"]["a"] < 4096
    # b now holds a part of step 6: with node a lost as well, no node holds a's shards, so the step is
    # not offered as complete and the root's newest (step 4) is restored
    shutil.rmtree(local / "a")
    third = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    assert all((got["step"], got["from"]) == (4, "root") for got in third)
    reason = "passed over step 6: no node holds shard-00000.safetensors, shard-00001.safetensors"
    assert any(reason in m for m in third[0]["log"]), third[0]["log"]


def _manifest(folder: Path) -> Any:
    from shardsafe.core.format import parse_manifest

    return parse_manifest((folder / "manifest.json").read_bytes(), str(folder))


def _share(manifest: Any, ranks: tuple[int, ...]) -> int:
    """The bytes of the shard files the saving ranks ``ranks`` wrote."""
    return sum(entry.size for entry in manifest.files.values() if entry.rank in ranks)


def _payload(folder: Path, ranks: tuple[int, ...]) -> int:
    """The tensor bytes of the shard files the saving ranks ``ranks`` wrote (each file less its header)."""
    total = 0
    for rank in ranks:
        data = (folder / f"shard-{rank:05d}.safetensors").read_bytes()
        total += len(data) - 8 - int.from_bytes(data[:8], "little")
    return total


def _small(manifest: Any, folder: Path) -> int:
    """The bytes of the files every node gets: manifest, state file, every index."""
    indexes = sum(e.index.size for e in manifest.files.values() if e.index is not None)
    return indexes + manifest.state_size + (folder / "manifest.json").stat().st_size


def _small_of(manifest: Any, ranks: tuple[int, ...]) -> int:
    """The bytes of the indexes the saving ranks ``ranks`` wrote."""
    return sum(e.index.size for e in manifest.files.values() if e.index is not None and e.rank in ranks)


def test_a_reshard_from_the_tier_sends_each_node_only_what_its_ranks_read(tmp_path: Path) -> None:
    """4 ranks saved (a: 0-1, b: 2-3, no replicas); 2 ranks restore with rank 0 on node b and rank 1
    on node a, so each needs the rows the other node's ranks saved: each node is sent those shards
    (and the small files), never the whole step, and the state is restored exactly."""
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 6, options, [6], None, work_dir=tmp_path)
    manifest = _manifest(_tier_folder(local, "a") / step_name(6))
    second = run_ranks(_restore_job, 2, str(root), str(local / "{node}"), options, False, ("b", "a"), work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "local"), got["log"]
        _assert_same_state(got["state"], first[0]["recorded"][6], f"rank {rank}")
    received = second[0]["received"]
    assert 0 < received["b"] <= _share(manifest, (0, 1)) and 0 < received["a"] <= _share(manifest, (2, 3))
    # shards were sent, not only the indexes the other node wrote (b held the rest of the small files)
    assert received["b"] > _small_of(manifest, (0, 1)) and received["a"] > _small_of(manifest, (2, 3))


@pytest.mark.parametrize("damage", ["replica", "manifest"])
def test_a_damaged_replica_is_detected_and_the_root_used(tmp_path: Path, damage: str) -> None:
    """One flipped bit in the only copy of node b's shard (found by the load), or node a's manifest
    of the step overwritten with bytes that are not JSON (found as the leader lists its folder):
    the step is passed over, saying why, and the root's newest restored."""
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1, "replicas": 1}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 5, options, [4], None, work_dir=tmp_path)
    shutil.rmtree(local / "b")
    folder = _tier_folder(local, "a") / step_name(5)
    if damage == "replica":
        replica = folder / "shard-00002.safetensors"
        data = bytearray(replica.read_bytes())
        data[-1] ^= 0x01  # one flipped bit in the last tensor's bytes
        replica.write_bytes(bytes(data))
        reason = ("step 5 does not load", "the file is corrupted")
    else:
        (folder / "manifest.json").write_bytes(b"\xa0 secret")
        reason = ("step 5 of this node is passed over", "manifest.json: not valid JSON (not UTF-8 at byte 0)")
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (4, "root")
        _assert_same_state(got["state"], first[rank]["recorded"][4], f"rank {rank}")
    assert any(all(part in m for part in reason) for m in second[0]["log"]), second[0]["log"]
    assert not any("secret" in m for m in second[0]["log"]), second[0]["log"]  # the file's bytes are never shown


def test_fewer_ranks_restore_from_the_tier_with_resharding(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1, "replicas": 1}
    first = run_ranks(_train_job, 4, str(root), str(local / "{node}"), 6, options, [6], None, work_dir=tmp_path)
    shutil.rmtree(local / "b")  # node b is gone; the job comes back as 2 ranks on node a
    second = run_ranks(_restore_job, 2, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (6, "local")
        _assert_same_state(got["state"], first[0]["recorded"][6], f"rank {rank}")
        assert got["received"] == {"a": 0}  # node a holds the whole step (b's files as its replica): nothing sent


def test_a_node_killed_before_its_copy_leaves_the_older_complete_step(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    options = {"save_every": 4, "local_every": 1}
    crashed = launch(
        _train_job,
        4,
        str(root),
        str(local / "{node}"),
        6,
        options,
        [5],
        None,
        (6, "tier:before-copy"),
        work_dir=tmp_path,
    )
    assert not crashed.ok and crashed.exitcodes[2] == -9  # node b's leader, before its copy of step 6
    assert _files(_tier_folder(local, "a")) == [SPARE_NAME, step_name(5), step_name(6)]  # a committed step 6; b did not
    assert [p.name for p in _tier_folder(local, "b").iterdir() if not p.name.startswith(".")] == [step_name(5)]
    second = run_ranks(_restore_job, 4, str(root), str(local / "{node}"), options, False, work_dir=tmp_path)
    for rank, got in enumerate(second):
        assert (got["step"], got["from"]) == (5, "local")
        _assert_same_state(
            got["state"], torch.load(tmp_path / f"rank{rank}-step5.pt", weights_only=False), f"rank {rank}"
        )
    assert any("passed over step 6: no node holds shard-00002.index.json" in m for m in second[0]["log"]), second[0][
        "log"
    ]


def _transfer_job(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Rank 0 sends two files to rank 1 over the tier's group: one whole, and one whose size is not
    the one the move names (the sender cannot read it as asked)."""
    from shardsafe.manager import tier as tier_module
    from shardsafe.manager.tier import LocalTier, Move

    tier_module.PIECE_BYTES = 256 << 10  # several messages per file
    os.environ[NODE_ENV] = "a" if rank == 0 else "b"
    tier = LocalTier(str(Path(folder) / "root"), get_comm(), 1, str(Path(folder) / "{node}"))
    src, dst = Path(folder) / "src", Path(folder) / "dst"
    data = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes: more than one piece below
    if rank == 0:
        src.mkdir()
        (src / "whole").write_bytes(data)
        (src / "short").write_bytes(data[:-1])
    torch.distributed.barrier()
    moves = [Move("whole", len(data), 0, 1), Move("short", len(data), 0, 1)]
    problem = tier._transfer(moves, lambda name: src / name, lambda name: dst / name)
    return {"problem": None if problem is None else f"{type(problem).__name__}: {problem}", "data": data}


def test_a_transfer_maps_files_whole_and_a_short_source_leaves_nothing(tmp_path: Path) -> None:
    sent, received = run_ranks(_transfer_job, 2, str(tmp_path), work_dir=tmp_path)
    data, dst = received["data"], tmp_path / "dst"
    assert sent["problem"] is not None and "short" in sent["problem"] and "the manifest says" in sent["problem"]
    assert received["problem"] == "SaveError: rank 0 could not read short to send it"
    assert (dst / "whole").read_bytes() == data
    assert sorted(p.name for p in dst.iterdir()) == ["whole"]  # no temp file left of the short one


def _reversed_group_job(rank: int, world_size: int, root: str, local: str, restore: bool) -> dict[str, Any]:
    """A manager over a group whose ranks run in reverse global order (``sort_ranks=False``), with async
    root saves and a local tier: both background groups must number the processes as the group does.
    Saves steps 1-3 and stops without close() (the tier stays), or (``restore``) restores a fresh state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardsafe.core.comm import gloo_copy

    os.environ[NODE_ENV] = _node_of(rank)
    group = dist.new_group(ranks=list(range(world_size))[::-1], backend="gloo", sort_ranks=False)
    comm = get_comm(group)
    copy = gloo_copy(comm)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def state(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        return {f"w{i}": distribute_tensor(torch.randn(8, 4), mesh, [Replicate(), Shard(0)]) for i in range(2)}

    options = {"save_every": 2, "local_every": 1, "replicas": 1, "async_save": True}
    manager = shardsafe.CheckpointManager(root, process_group=group, local_dir=local, **options)
    out: dict[str, Any] = {"ranks": (copy.rank, comm.rank, copy.all_gather(comm.rank))}
    if not restore:
        for step in range(1, 4):
            manager.save(step, state(step))
        manager.wait()
        manager._tier_worker.join()
        return out | {"errors": list(manager._tier.errors) if manager._tier is not None else None}
    fresh = state(100)
    out["restored"] = (manager.restore(fresh), manager.restored_from)
    out["equal"] = all(torch.equal(fresh[k].to_local(), state(3)[k].to_local()) for k in fresh)
    manager.close()
    return out


def test_a_manager_over_a_group_in_reverse_rank_order_numbers_its_background_groups_alike(tmp_path: Path) -> None:
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    saved = run_ranks(_reversed_group_job, 4, str(root), str(local / "{node}"), False, work_dir=tmp_path)
    restored = run_ranks(_reversed_group_job, 4, str(root), str(local / "{node}"), True, work_dir=tmp_path)
    for rank in range(4):
        # the copy's rank r is the group's rank r (global rank 3 - r), and its results are in that order
        assert saved[rank]["ranks"] == restored[rank]["ranks"] == (3 - rank, 3 - rank, [0, 1, 2, 3])
        assert saved[rank]["errors"] == [], saved[rank]
        assert restored[rank]["restored"] == (3, "local") and restored[rank]["equal"], restored[rank]
    assert committed_steps(root) == [2]


def test_a_spare_replaced_by_a_symlink_is_never_written_through(tmp_path: Path) -> None:
    # one process, one node: after steps 1-2 the tier folder's spare is step 1; put a symlink to a
    # folder outside in its place, holding a file named as the next save's shard
    root, local, outside = tmp_path / "ckpt", tmp_path / "shm", tmp_path / "outside"
    outside.mkdir()
    (outside / "shard-00000.safetensors").write_bytes(b"not the tier's")
    model = make_model(0)
    optimizer = make_optimizer(model)
    manager = shardsafe.CheckpointManager(root, save_every=100, local_every=1, local_dir=local)
    for step in (1, 2):
        manager.save(step, {"model": model, "optim": optimizer})
        manager._tier_worker.join()
    assert manager._tier is not None
    spare = manager._tier.folder / SPARE_NAME
    assert (spare / "shard-00000.safetensors").is_file()
    shutil.rmtree(spare)
    spare.symlink_to(outside, target_is_directory=True)
    manager.save(3, {"model": model, "optim": optimizer})
    manager._tier_worker.join()
    assert manager._tier.errors == [] and manager._tier.saved == 3
    assert (outside / "shard-00000.safetensors").read_bytes() == b"not the tier's"
    assert not spare.is_symlink() and (spare / "manifest.json").is_file()  # step 2 is the spare now
    fresh_model = make_model(1)
    fresh_optimizer = make_optimizer(fresh_model)
    # step 3 was written into new files, whole: it loads as any checkpoint
    shardsafe.load(manager._tier.step_folder(3), {"model": fresh_model, "optim": fresh_optimizer})
    assert_tensors_equal(fresh_model.state_dict(), model.state_dict(), "model")
    manager.close()


def _nd_job(rank: int, world_size: int, root: str, local: str, layout: str, nodes: str, save: bool) -> dict[str, Any]:
    """``save``: train 3 steps in ``layout`` (nd_utils) with a local save each, no close (the tier
    stays); else restore a fresh model of ``layout``. Returns this rank's whole tensors (nd_utils)."""
    import nd_utils

    os.environ[NODE_ENV] = nodes[rank]
    model, optimizer = nd_utils.build(layout, rank, world_size, seed=0 if save else 5)
    state = {"model": model, "optim": optimizer, "rng": shardsafe.RNGState()}
    manager = shardsafe.CheckpointManager(root, save_every=100, local_every=1, replicas=1, local_dir=local)
    out: dict[str, Any] = {"layout": nd_utils.local_layout(model)}
    if save:
        for step in range(1, 4):
            nd_utils.step(model, optimizer, step)
            manager.save(step, state)
        manager.wait()
    else:
        out["restored"] = (manager.restore(state), manager.restored_from)
    return out | {"whole": nd_utils.whole_state(model, optimizer)}


def test_a_2d_layout_restores_from_the_tier_on_other_layouts_after_a_node_is_lost(tmp_path: Path) -> None:
    """FSDP2 x tensor parallel (dp=2 x tp=2, torchtitan's layout: the colwise weights ``_StridedShard``),
    saved into the tier by 4 ranks as 2 nodes; node b's folder is wiped. The tier restores it exactly
    at the same layout, and as FSDP2 on 2 ranks with one of them on node b (resharding, each rank's
    rows partly in files its node lacks), from the replicas."""
    root, local = str(tmp_path / "ckpt"), str(tmp_path / "shm" / "{node}")
    saved = run_ranks(_nd_job, 4, root, local, "2d", "aabb", True, work_dir=tmp_path)
    assert "_StridedShard" in saved[0]["layout"]["layers.0.w1.weight"]
    expected: dict[str, torch.Tensor] = {}
    for got in saved:
        expected.update(got["whole"])
    backup = tmp_path / "shm-backup"
    shutil.copytree(tmp_path / "shm", backup)
    for layout, world_size, nodes in (("2d", 4, "aabb"), ("fsdp", 2, "ba")):
        shutil.rmtree(tmp_path / "shm")
        shutil.copytree(backup, tmp_path / "shm")
        shutil.rmtree(tmp_path / "shm" / "b")
        restored = run_ranks(_nd_job, world_size, root, local, layout, nodes, False, work_dir=tmp_path)
        for rank, got in enumerate(restored):
            assert got["restored"] == (3, "local"), (layout, rank)
            assert set(got["whole"]) == set(expected), (layout, rank)
            assert_tensors_equal(got["whole"], expected, f"{layout} rank {rank}")


def _own_job(rank: int, world_size: int, root: str, local: str, save: bool) -> dict[str, Any]:
    """One process on node a: ``save`` steps 1-3 into the tier (no close: it stays), else restore and close."""
    os.environ[NODE_ENV] = "a"
    state = {"w": torch.zeros(4)}
    manager = shardsafe.CheckpointManager(root, save_every=2, local_every=1, local_dir=local)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardsafe").addHandler(handler)
    out: dict[str, Any] = {}
    if save:
        for step in range(1, 4):
            state["w"] += 1
            manager.save(step, state)
        manager.wait()
    else:
        out["restored"] = (manager.restore(state), manager.restored_from, state["w"][0].item())
        manager.close()
    logging.getLogger("shardsafe").removeHandler(handler)
    return out | {"log": messages}


@pytest.mark.parametrize("planted", ["others may write it", "another user's", "a symlink"])
def test_the_tier_uses_only_folders_no_other_user_can_write(tmp_path: Path, planted: str) -> None:
    """The tier makes its folders for this user alone (mode 700). A root's tier folder that others may
    write, a node folder of another user, or a symlink in the node folder's place could hold a planted
    step (manifest and hashes included): restore uses the root instead, saying why; close() and `gc
    --local` remove nothing through it."""
    if planted == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    root, local = tmp_path / "ckpt", tmp_path / "shm"
    run_ranks(_own_job, 1, str(root), str(local / "{node}"), True, work_dir=tmp_path)
    node, folder = local / "a", _tier_folder(local, "a")
    assert stat_mode(node) == stat_mode(folder) == 0o700
    if planted == "others may write it":
        folder.chmod(0o777)
        reason = f"other users may write {folder} (mode 777)"
    elif planted == "another user's":
        os.chown(node, 12345, -1)
        reason = f"{node} belongs to user id 12345"
    else:
        node.rename(local / "elsewhere")
        node.symlink_to(local / "elsewhere")
        reason = f"{node} is not a folder"
    gc = [sys.executable, "-m", "shardsafe.cli", "gc", str(root), "--local", "--local-dir", str(local / "{node}")]
    refused = subprocess.run(gc, capture_output=True, text=True, env={**os.environ, NODE_ENV: "a"}, timeout=60)
    assert refused.returncode == 1 and reason in refused.stderr, refused.stderr
    (got,) = run_ranks(_own_job, 1, str(root), str(local / "{node}"), False, work_dir=tmp_path)
    assert got["restored"] == (2, "root", 2.0)
    assert any("cannot be read" in m and reason in m for m in got["log"]), got["log"]
    assert any("left as it is" in m for m in got["log"]), got["log"]  # close() removed nothing
    kept = local / "elsewhere" / folder.name if planted == "a symlink" else folder
    assert step_name(3) in {p.name for p in kept.iterdir()}


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777
