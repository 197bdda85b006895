"""Read DeepSpeed folders through every entry point of the reader, in a process of its own, one JSON line per folder.

Run with ``python read_hostile.py OUT_DIR NAME=FOLDER ...`` (tests/interop/test_deepspeed_hostile.py does). For
each folder: open :class:`DeepSpeedCheckpoint`, read every tensor, every optimizer state entry, the
param groups and flat groups, then ``convert_deepspeed`` (module layout, then the engine layout) and
``export_hf``. It prints ``{"case": NAME, "start": true}`` before and ``{"case": NAME, "outcome":
"read" | "refused" | "exception", "error": ..., "message": ...}`` after, so a crash (a segfault
kills this process) names the folder it was reading. The address space is capped at what the
process uses after its imports plus :data:`HEADROOM`, so a reader that tried to allocate what a
hostile shape claims would fail with an allocation error, which the test sees in the message.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from pathlib import Path

import torch

from shardsafe.errors import ShardsafeError
from shardsafe.hf.export import export_hf
from shardsafe.interop.deepspeed_convert import convert_deepspeed
from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint

HEADROOM = 1 << 30


def read_everything(folder: Path, out: Path) -> None:
    with DeepSpeedCheckpoint(folder) as ckpt:
        for name in ckpt.names():
            ckpt.read(name)
        for name in ckpt.trainable:
            for key in ckpt.optimizer_state_spec(name):
                ckpt.optimizer_state(name, key)
        ckpt.param_groups()
        ckpt.flat_groups()
        ckpt.loss_scaling()
    convert_deepspeed(folder, out / "module", progress=False)
    if ckpt.stage == 3:
        convert_deepspeed(folder, out / "engine", progress=False, for_engine=True)
    export_hf(folder, out / "hf", progress=False)


def _virtual_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def main(out: Path, cases: list[str]) -> None:
    torch.zeros(1).sum()  # torch's lazy start-up allocations before the cap
    size = _virtual_size()
    if size:
        resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, resource.RLIM_INFINITY))
    for case in cases:
        name, folder = case.split("=", 1)
        print(json.dumps({"case": name, "start": True}), flush=True)
        result: dict[str, object] = {"case": name}
        try:
            read_everything(Path(folder), out / name)
            result["outcome"] = "read"
        except ShardsafeError as exc:
            result.update(outcome="refused", error=type(exc).__name__, message=str(exc))
        except Exception as exc:
            result.update(outcome="exception", error=type(exc).__name__, message=traceback.format_exc()[-3000:])
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
