"""Which node a rank runs on: the unit that shares a page cache, a ``/dev/shm`` and a network link.

A node is the set of ranks on one host. Its id is the host name, or ``SHARDSAFE_NODE`` when set,
so a test (or a launcher that knows better, e.g. containers that share a host name) can make
ranks on one machine behave as if they ran on several. Read at call time: a process may set it
after import.
"""

from __future__ import annotations

import os
import socket

NODE_ENV = "SHARDSAFE_NODE"


def node_id() -> str:
    """This process's node id: ``$SHARDSAFE_NODE`` if set and not empty, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


__all__ = ["NODE_ENV", "node_id"]
