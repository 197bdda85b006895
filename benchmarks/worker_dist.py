"""Distributed half of the benchmark (launched by run.py under torch.distributed.run, gloo, CPU).

Builds an FSDP2 model plus stepped AdamW, then, in alternating order per round: shardsafe.save,
DCP save and (rank 0 only) a dd of the same byte count; then alternating 2->2 loads. Rank 0
writes every measurement as JSON for run.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import (
    PeakMemory,
    allocate_optimizer_state,
    build_model,
    drop_file_cache,
    fingerprint,
    folder_bytes,
    local,
    merge_fingerprints,
    state_tensors,
    zero_state,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardsafe

DD_BLOCK = 64 << 20


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def barrier() -> None:
    dist.barrier()


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def rank0_only(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 while the others wait; everyone gets its result."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    root: Path = args.root
    ss_dir, dcp_dir, dd_file = root / "shardsafe-ckpt", root / "dcp-ckpt", root / "dd.bin"

    log(f"building FSDP2 model: {args.layers} x Linear({args.width}, {args.width}) on {world} ranks")
    model = build_model(args.layers, args.width, device="meta")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        for p in model.parameters():
            local(p).normal_(0.0, 0.02, generator=gen)
    optim = make_optimizer(model)
    model(torch.randn(4, args.width, generator=gen)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    log("model built and optimizer stepped")
    saved_fp = fingerprint(state_tensors(model, optim))
    full_fp = merge_fingerprints(gather(saved_fp))
    gc.collect()

    def save_shardsafe() -> None:
        shardsafe.save(ss_dir, {"model": model, "optim": optim})  # fsync=True is the default

    def save_dcp() -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(dcp_dir, sync_files=True))

    savers = {"shardsafe": (save_shardsafe, ss_dir), "dcp": (save_dcp, dcp_dir)}
    results: dict[str, Any] = {"save": {"shardsafe": [], "dcp": [], "dd": []}}

    def clear(path: Path) -> None:
        def rm() -> None:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            subprocess.run(["sync"], check=False)

        rank0_only(rm)

    # ---------------------------------------------------------------- saves (and dd), alternating
    dd_count = 0
    for i in range(args.runs):
        order = ["shardsafe", "dcp", "dd"]
        order = order[i % 3 :] + order[: i % 3]
        for name in order:
            if name == "dd":
                nbytes = rank0_only(partial(folder_bytes_or_zero, ss_dir))
                if not nbytes:
                    continue  # no shardsafe checkpoint yet to size it; dd runs later in the round
                dd_count = -(-nbytes // DD_BLOCK)
                clear(dd_file)
                barrier()
                rec = rank0_only(partial(run_dd, dd_file, dd_count))
                results["save"]["dd"].append(rec)
                clear(dd_file)
                log(
                    f"round {i + 1}: dd {rec['bytes'] / 1e9:.2f} GB in {rec['seconds']:.2f} s = "
                    f"{rec['bytes'] / rec['seconds'] / 1e9:.3f} GB/s"
                )
                continue
            fn, folder = savers[name]
            clear(folder)
            barrier()
            with PeakMemory() as mem:
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
            per_rank = gather(
                {"seconds": elapsed, "extra_mem": mem.extra, "baseline_rss": mem.baseline, "method": mem.method}
            )
            rec = {
                "seconds": max(r["seconds"] for r in per_rank),
                "extra_mem_per_rank": [r["extra_mem"] for r in per_rank],
                "baseline_rss_per_rank": [r["baseline_rss"] for r in per_rank],
                "mem_method": per_rank[0]["method"],
                "bytes": rank0_only(partial(folder_bytes, folder)),
            }
            results["save"][name].append(rec)
            rank0_only(partial(drop_file_cache, folder))  # same (empty) cache state before every step
            log(
                f"round {i + 1}: {name} save {rec['seconds']:.2f} s, {rec['bytes'] / 1e9:.2f} GB on disk, "
                f"extra peak RSS per rank {[round(m / 2**20, 1) for m in rec['extra_mem_per_rank']]} MiB"
            )
    if len(results["save"]["dd"]) < args.runs:  # the dd that came first in round 1 had nothing to size it by
        clear(dd_file)
        barrier()
        results["save"]["dd"].append(rank0_only(partial(run_dd, dd_file, dd_count)))
        clear(dd_file)

    # ---------------------------------------------------------------- loads at the same world size
    def load_shardsafe() -> None:
        shardsafe.load(ss_dir, {"model": model, "optim": optim})

    def load_dcp() -> None:
        msd, osd = get_state_dict(model, optim)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=FileSystemReader(dcp_dir))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    loaders = {"shardsafe": (load_shardsafe, ss_dir), "dcp": (load_dcp, dcp_dir)}
    for variant in ("fresh", "allocated"):
        results[f"load_2to2_{variant}"] = {"shardsafe": [], "dcp": []}
        if variant == "allocated":
            del optim
            gc.collect()
            optim = make_optimizer(model)
            allocate_optimizer_state(model, optim)  # once; every run then loads into this existing (zeroed) state
        for i in range(args.runs):
            order = ["shardsafe", "dcp"] if i % 2 == 0 else ["dcp", "shardsafe"]
            for name in order:
                fn, folder = loaders[name]
                if variant == "fresh":
                    del optim
                    gc.collect()
                    optim = make_optimizer(model)  # new and stateless: what a resumed job has
                zero_state(model, optim)
                residual = rank0_only(partial(drop_file_cache, folder))
                barrier()
                with PeakMemory() as mem:
                    start = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - start
                ok = fingerprint(state_tensors(model, optim)) == saved_fp
                per_rank = gather({"seconds": elapsed, "extra_mem": mem.extra, "ok": ok})
                rec = {
                    "seconds": max(r["seconds"] for r in per_rank),
                    "extra_mem_per_rank": [r["extra_mem"] for r in per_rank],
                    "cached_bytes_before": residual,
                    "correct": all(r["ok"] for r in per_rank),
                }
                results[f"load_2to2_{variant}"][name].append(rec)
                log(
                    f"round {i + 1}: {name} load 2->2 ({variant} optimizer) {rec['seconds']:.2f} s, correct: "
                    f"{rec['correct']}, cached: {residual}"
                )

    results["world_size"] = world
    results["fingerprint"] = full_fp
    results["tensor_bytes"] = sum(local(t).numel() * t.element_size() for t in state_tensors(model, optim).values())
    results["tensor_bytes"] = sum(gather(results["tensor_bytes"]))
    if rank == 0:
        args.out.write_text(json.dumps(results, indent=1))
    barrier()
    dist.destroy_process_group()


def folder_bytes_or_zero(folder: Path) -> int:
    return folder_bytes(folder) if folder.exists() else 0


def run_dd(path: Path, count: int) -> dict[str, Any]:
    command = ["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK // 2**20}M", f"count={count}", "conv=fdatasync"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "bytes": count * DD_BLOCK,
        "command": " ".join(command),
        "dd_says": done.stderr.strip().splitlines()[-1],
    }


if __name__ == "__main__":
    main()
