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
from common import PeakMemory, build_model, drop_file_cache, fingerprint, fingerprints_match, folder_bytes, state_tensors
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--expect", type=Path, required=True, help="JSON written by worker_dist.py (for the saved fingerprint)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    expected = json.loads(args.expect.read_text())["fingerprint"]
    ss_dir, dcp_dir = args.root / "shardsafe-ckpt", args.root / "dcp-ckpt"

    model = build_model(args.layers, args.width, device="meta").to_empty(device="cpu")

    def load_shardsafe(optim: torch.optim.Optimizer) -> None:
        shardsafe.load(ss_dir, {"model": model, "optim": optim})

    def load_dcp(optim: torch.optim.Optimizer) -> None:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=FileSystemReader(dcp_dir))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    loaders = {"shardsafe": (load_shardsafe, ss_dir), "dcp": (load_dcp, dcp_dir)}
    results: dict[str, Any] = {"shardsafe": [], "dcp": []}
    optim: torch.optim.Optimizer | None = None
    for i in range(args.runs):
        order = ["shardsafe", "dcp"] if i % 2 == 0 else ["dcp", "shardsafe"]
        for name in order:
            fn, folder = loaders[name]
            optim = None
            gc.collect()
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            residual = drop_file_cache(folder)
            with PeakMemory() as mem:
                start = time.perf_counter()
                fn(optim)
                elapsed = time.perf_counter() - start
            ok = fingerprints_match(fingerprint(state_tensors(model, optim)), expected)
            rec = {"seconds": elapsed, "extra_mem": mem.extra, "bytes": folder_bytes(folder), "cached_bytes_before": residual, "correct": ok}
            results[name].append(rec)
            print(f"[{time.strftime('%H:%M:%S')}] round {i + 1}: {name} load 2->1 {elapsed:.2f} s, state matches: {ok}, cached before: {residual}", flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
