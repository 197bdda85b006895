"""Which ranks share a node: each rank's node id (``SHARDSAFE_NODE``, else the hostname), gathered once.

A *node* is the set of ranks whose node-local folder (``local_dir``, a tmpfs such as ``/dev/shm``)
is the same. By default that is the set of ranks on one host. The environment variable
``SHARDSAFE_NODE`` overrides a rank's node id, so a test (or a machine split into several failure
domains) can run several "nodes" on one host, each with its own folder: ``local_dir`` may contain
``{node}``, replaced by the rank's node id, and ``{user}``, replaced by the user the process runs
as (:func:`node_dir`): ``/dev/shm`` is every user's, and a folder there belongs to whoever made it
first (the tier uses only folders of its own user, manager/tier.py).

:func:`gather_nodes` is collective (one ``all_gather`` of the node ids over the process group) and
returns a :class:`NodeMap`, the same on every rank.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from shardsafe.core.comm import Comm
from shardsafe.core.nodes import NODE_ENV
from shardsafe.core.nodes import folder_node_id as node_id

__all__ = ["DEFAULT_LOCAL_DIR", "NODE_ENV", "NodeMap", "gather_nodes", "node_dir", "node_id", "user_name"]

# host memory on Linux: survives the process, not the machine; one folder per user and node
DEFAULT_LOCAL_DIR = "/dev/shm/shardsafe-{user}-{node}"


def node_dir(template: str | os.PathLike[str], node: str) -> Path:
    """``template`` with ``{node}`` replaced by ``node`` (a template without it is the same folder on
    every node) and ``{user}`` by :func:`user_name`."""
    text = os.fspath(template)
    if "{user}" in text:
        text = text.replace("{user}", user_name())
    return Path(text.replace("{node}", node))


def user_name() -> str:
    """The name of the user this process runs as, or its user id where it has no usable name (a
    container without a password entry, a name that is not a plain file name)."""
    uid = os.geteuid()
    try:
        import pwd

        name = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)
    return name if re.fullmatch(r"[A-Za-z0-9._][A-Za-z0-9._-]*", name) and name not in (".", "..") else str(uid)


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of a process group, and this rank's (ranks are group ranks).

    ``node_of[r]``: the node id of rank ``r``. ``ranks_of[node]``: its ranks, ascending; nodes in
    the order of their lowest rank. The node's *leader* is its lowest rank."""

    node_of: tuple[str, ...]
    ranks_of: Mapping[str, tuple[int, ...]]
    rank: int

    @classmethod
    def from_ids(cls, ids: list[str] | tuple[str, ...], rank: int) -> NodeMap:
        members: dict[str, list[int]] = {}
        for r, node in enumerate(ids):
            members.setdefault(node, []).append(r)
        return cls(tuple(ids), MappingProxyType({n: tuple(rs) for n, rs in members.items()}), rank)

    @property
    def node(self) -> str:
        """This rank's node id."""
        return self.node_of[self.rank]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node id, in the order of their lowest rank."""
        return tuple(self.ranks_of)

    def leader(self, node: str | None = None) -> int:
        """The lowest rank of ``node`` (default: this rank's node)."""
        return self.ranks_of[self.node if node is None else node][0]

    @property
    def is_leader(self) -> bool:
        return self.leader() == self.rank

    @property
    def leaders(self) -> tuple[int, ...]:
        """The leader of every node, in node order."""
        return tuple(ranks[0] for ranks in self.ranks_of.values())


def gather_nodes(comm: Comm) -> NodeMap:
    """Collective (one ``all_gather``): every rank's :func:`node_id`, as one :class:`NodeMap`
    (equal on every rank). A rank whose ``SHARDSAFE_NODE`` is unusable makes every rank raise the
    same ValueError, naming that rank (no rank is left waiting)."""
    mine: tuple[str, str | None]
    try:
        mine = (node_id(), None)
    except ValueError as exc:
        mine = ("", str(exc))
    reports = comm.all_gather(mine)
    bad = [f"rank {r}: {problem}" for r, (_, problem) in enumerate(reports) if problem is not None]
    if bad:
        raise ValueError("; ".join(bad))
    return NodeMap.from_ids([node for node, _ in reports], comm.rank)
