"""Single-process half of the benchmark: load the 2-rank checkpoints into one plain module (2->1).

No process group: shardsafe.load and dcp.load both run in their single-process mode. Writes its
measurements as JSON for run.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from common import (
    PeakMemory,
    allocate_optimizer_state,
    build_model,
    drop_file_cache,
    fingerprint,
    state_tensors,
    zero_state,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument(
        "--expect", type=Path, required=True, help="JSON written by worker_dist.py (for the saved fingerprint)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    saved = json.loads(args.expect.read_text())
    expected, world = saved["fingerprint"], saved["world_size"]
    ss_dir, dcp_dir = args.root / "shardsafe-ckpt", args.root / "dcp-ckpt"

    model = build_model(args.layers, args.width, device="meta").to_empty(device="cpu")

    def make_optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def load_shardsafe(optim: torch.optim.Optimizer) -> None:
        shardsafe.load(ss_dir, {"model": model, "optim": optim})

    def load_dcp(optim: torch.optim.Optimizer) -> None:
        msd, osd = get_state_dict(model, optim)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=FileSystemReader(dcp_dir))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    loaders = {"shardsafe": (load_shardsafe, ss_dir), "dcp": (load_dcp, dcp_dir)}
    results: dict[str, Any] = {}
    optim: torch.optim.Optimizer | None = None
    for variant in ("fresh", "allocated"):
        results[variant] = {"shardsafe": [], "dcp": []}
        if variant == "allocated":
            optim = None
            gc.collect()
            optim = make_optimizer()
            allocate_optimizer_state(model, optim)  # once; every run then loads into this existing (zeroed) state
        for i in range(args.runs):
            order = ["shardsafe", "dcp"] if i % 2 == 0 else ["dcp", "shardsafe"]
            for name in order:
                fn, folder = loaders[name]
                if variant == "fresh" or optim is None:
                    optim = None
                    gc.collect()
                    optim = make_optimizer()  # new and stateless: what a resumed job has
                zero_state(model, optim)
                residual = drop_file_cache(folder)
                with PeakMemory() as mem:
                    start = time.perf_counter()
                    fn(optim)
                    elapsed = time.perf_counter() - start
                ok = fingerprint(state_tensors(model, optim), parts=world) == expected
                rec = {"seconds": elapsed, "extra_mem": mem.extra, "cached_bytes_before": residual, "correct": ok}
                results[variant][name].append(rec)
                stamp = time.strftime("%H:%M:%S")
                print(
                    f"[{stamp}] round {i + 1}: {name} load 2->1 ({variant}) {elapsed:.2f} s, correct: {ok}, cached: "
                    f"{residual}",
                    flush=True,
                )
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
