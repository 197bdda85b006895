"""What the fuzz targets share: a scratch folder per run, and splicing fuzzer bytes into a seed.

Imported by the targets, which run as scripts (``python tests/fuzz/fuzz_X.py``), so this folder is
on ``sys.path``. Not instrumented itself (no shardsafe code here).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import atheris

BASE = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def work_folder(tag: str) -> Path:
    """A new empty folder for this run, ``shardsafe-fuzz-<tag>-<pid>``.

    libFuzzer ends the process with exit() from C, past atexit, so the folders that earlier runs
    whose process is gone left behind are removed first (the atexit removal covers normal exits).
    """
    for old in BASE.glob(f"shardsafe-fuzz-{tag}-*"):
        try:
            os.kill(int(old.name.rsplit("-", 1)[1]), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(old, ignore_errors=True)
        except PermissionError:
            pass
    work = BASE / f"shardsafe-fuzz-{tag}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    return work


def splice(seed: bytes, fdp: atheris.FuzzedDataProvider) -> bytes:
    """``seed`` with up to 64 of its bytes at a fuzzer-chosen place replaced by up to 64 fuzzer bytes."""
    at = fdp.ConsumeIntInRange(0, len(seed))
    cut = fdp.ConsumeIntInRange(0, 64)
    return seed[:at] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) + seed[at + cut :]
