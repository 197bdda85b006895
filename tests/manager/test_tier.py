"""The local tier of CheckpointManager: node ids, per-node folders, restore from the fastest complete tier.

Four gloo ranks play two "nodes" (``SHARDSAFE_NODE`` = a for ranks 0-1, b for ranks 2-3), each
node with its own folder (``local_dir`` holds ``{node}``), all on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dist_utils import run_ranks
from shardsafe.core.comm import get_comm
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR, NODE_ENV, NodeMap, gather_nodes, node_dir, node_id


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
    assert node_dir(DEFAULT_LOCAL_DIR, node_id()) == Path("/dev/shm/shardsafe-node-7")
    assert node_dir("/tmp/fixed", "x") == Path("/tmp/fixed")
    monkeypatch.delenv(NODE_ENV)
    assert node_id() and "/" not in node_id()
    single = NodeMap.from_ids(["h"], 0)
    assert single.is_leader and single.leaders == (0,) and single.nodes == ("h",)
