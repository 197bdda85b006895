"""Which node a rank runs on: the unit that shares a page cache, a ``/dev/shm`` and a network link.

A node is the set of ranks on one host. Its id is the host name, or ``SHARDSAFE_NODE`` when set,
so a test (or a launcher that knows better, e.g. containers that share a host name) can make
ranks on one machine behave as if they ran on several. Read at call time: a process may set it
after import.

Two uses, one id: ``load`` compares ids to decide whether sharing reads saves storage reads
(:func:`node_id`, which never raises: it runs just before a collective); the manager's local tier
also makes a folder of it (:func:`folder_node_id`, which refuses an override that is no plain name).
"""

from __future__ import annotations

import os
import re
import socket

NODE_ENV = "SHARDSAFE_NODE"
_SAFE_NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def node_id() -> str:
    """This process's node id: ``$SHARDSAFE_NODE`` if set and not empty, else the host name reduced
    to a plain name (each character other than letters, digits, ``.``, ``_``, ``-`` becomes ``_``)."""
    return (
        os.environ.get(NODE_ENV)
        or re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:128].lstrip(".")
        or "localhost"
    )


def folder_node_id() -> str:
    """:func:`node_id`, as a folder name: an override outside 1-128 letters, digits, ``.``, ``_``,
    ``-`` (not starting with ``.``) is a ValueError rather than a path."""
    node = node_id()
    if not _SAFE_NODE.fullmatch(node):
        raise ValueError(
            f"{NODE_ENV}={node!r} is not a usable node id: it names a folder, so use 1-128 letters, digits, '.', '_' "
            "or '-', not starting with '.'"
        )
    return node


__all__ = ["NODE_ENV", "folder_node_id", "node_id"]
