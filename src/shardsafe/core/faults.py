"""Named crash points for fault-injection tests.

``SHARDSAFE_CRASH_AT=<point>[@<rank>]`` makes the process SIGKILL itself when it reaches that
point (on every rank, or only on the given rank); ``SHARDSAFE_FAIL_AT=<point>[@<rank>]`` makes
it raise ``OSError(EIO)`` there instead, as a failing disk would. Points are hooks in the code, not timers, so a
test can kill a save exactly between two protocol steps. Unset (the normal case), a point is a
single dictionary look-up. Every point the code passes is listed in :data:`POINTS` and every listed
point is in the code (tests/core/test_faults_registry.py scans the source for both).
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["POINTS", "crash_point"]

POINTS = (
    "save:after-prepare",  # temporary folder exists, nothing written
    "save:mid-write",  # this rank's shard file is half written
    "save:before-fsync",  # this rank's file is completely written, not yet fsynced
    "save:after-write",  # this rank's file is complete and fsynced
    "save:before-manifest",  # coordinator: all ranks agreed, state.json written
    "save:before-publish",  # coordinator: manifest written, folder not yet moved
    "save:between-renames",  # coordinator, no RENAME_EXCHANGE: the old checkpoint moved aside, the new one not yet in
    "save:after-publish",  # coordinator: new checkpoint visible, old one not yet removed
    "async:before-write",  # manager: state staged, background write not started
    "retention:before-rename",  # manager: the checkpoints to retire are chosen, none touched yet
    "retention:after-rename",  # manager: a retired checkpoint is hidden but not yet deleted
    "retention:mid-delete",  # manager: a hidden retired checkpoint is partly deleted (its manifest first)
    "push:before-marker",  # push to an object store: every file uploaded, the commit marker not yet
    # local tier: a node's leader (not the coordinator's node) before writing its copy of the shared files
    "tier:before-copy",
)


def _armed(variable: str, name: str, rank: int) -> bool:
    spec = os.environ.get(variable)
    if not spec:
        return False
    point, _, only = spec.partition("@")
    return point == name and (not only or int(only) == rank)


def crash_point(name: str, rank: int) -> None:
    """Die (``SHARDSAFE_CRASH_AT``) or fail with EIO (``SHARDSAFE_FAIL_AT``) here if armed for ``name`` on ``rank``.

    Args:
        name: one of :data:`POINTS`, written as a literal at the call site.
        rank: the calling process's rank (0 for coordinator-only points).

    Raises:
        OSError: ``EIO``, when ``SHARDSAFE_FAIL_AT`` names this point (and this rank, or no rank).
    """
    if _armed("SHARDSAFE_CRASH_AT", name, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if _armed("SHARDSAFE_FAIL_AT", name, rank):
        raise OSError(errno.EIO, f"injected I/O error at {name} (SHARDSAFE_FAIL_AT)")
