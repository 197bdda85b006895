"""Real half of the scale benchmark (launched by bench_scale.py --real under torch.distributed.run, gloo, CPU).

An FSDP2 model of many small layers (``--layers`` x Linear(64, 64): 4 tensors per parameter with
AdamW's exp_avg, exp_avg_sq and step, ~1,000 tensors), stepped once; then ``--runs`` rounds of
save and load with shardsafe and DCP in alternating order, the page cache dropped before every
load. Rank 0 writes the times as JSON: wall seconds, and the CPU seconds of all ranks together.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardsafe


def drop_caches(folder: Path) -> None:
    """The page cache dropped (as root: all of it; else the folder's files): common.drop_file_cache."""
    from common import drop_file_cache

    drop_file_cache(folder)


def timed(fn: Callable[[], None], cpu: list[float] | None = None) -> float:
    """Wall seconds of ``fn`` on all ranks; with ``cpu``, the CPU seconds of all ranks together appended
    to it (robust to a busy machine, unlike the wall time)."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    used = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - start
    if cpu is not None:
        dist.all_reduce(used)
        cpu.append(float(used))
    return wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=250)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    tensors = 4 * len(list(model.parameters()))
    ss_dir, dcp_dir = args.root / "shardsafe", args.root / "dcp"

    def clear(path: Path) -> None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def save_ss() -> None:
        shardsafe.save(ss_dir, {"model": model, "optim": optim}, overwrite=True)

    def save_dcp() -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(dcp_dir))

    def load_ss() -> None:
        shardsafe.load(ss_dir, {"model": model, "optim": optim})

    def load_dcp() -> None:
        msd, osd = get_state_dict(model, optim)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=FileSystemReader(dcp_dir))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    results: dict[str, dict[str, list[float]]] = {
        "save": {"shardsafe": [], "dcp": []},
        "load": {"shardsafe": [], "dcp": []},
    }
    cpu: dict[str, dict[str, list[float]]] = {op: {"shardsafe": [], "dcp": []} for op in results}
    savers = {"shardsafe": (save_ss, ss_dir), "dcp": (save_dcp, dcp_dir)}
    loaders = {"shardsafe": (load_ss, ss_dir), "dcp": (load_dcp, dcp_dir)}
    for i in range(args.runs):
        order = ["shardsafe", "dcp"] if i % 2 == 0 else ["dcp", "shardsafe"]
        for name in order:
            fn, folder = savers[name]
            clear(folder)
            results["save"][name].append(timed(fn, cpu["save"][name]))
        for name in order:
            fn, folder = loaders[name]
            if rank == 0:
                drop_caches(folder)
            results["load"][name].append(timed(fn, cpu["load"][name]))
    if rank == 0:
        args.out.write_text(json.dumps({"world": world, "tensors": tensors, "results": results, "cpu": cpu}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
