"""Shared test setup: one thread per process, and the tests folder importable as plain modules.

The multi-process tests fork their ranks from a forkserver (see ``dist_utils``); these settings are
made before torch is imported anywhere so that the server and every rank inherit them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _variable in ("SHARDSAFE_CRASH_AT", "SHARDSAFE_FAIL_AT"):
    os.environ.pop(_variable, None)  # a stray fault point would kill or fail the test process itself

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
