"""Distributed half of the cold-load benchmark (launched by bench_load.py under torch.distributed.run, gloo, CPU).

Builds an FSDP2 model plus stepped AdamW, saves it once with shardsafe and once with DCP, then runs
``--runs`` rounds; in each, in an order that rotates per round, with the page cache dropped
before every measurement: shardsafe's default (atomic) load, ``atomic=False``, DCP's load, and
(rank 0, while the other ranks wait) one ``cat`` per rank's shard file, all in parallel: the cold
read bandwidth of the same files. Each load goes into a fresh optimizer (a resumed job) and, in a
second series, into optimizer state that exists already (a rollback in a running job). Every load
is checked against the saved state exactly. Rank 0 writes the times as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import allocate_optimizer_state, drop_file_cache, fingerprint, local, state_tensors, zero_state
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardsafe


def rank0_only(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 while the others wait; everyone gets its result."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cat_files(files: list[Path]) -> float:
    """Seconds for one ``cat > /dev/null`` per file, all at once (as the ranks read)."""
    start = time.perf_counter()
    procs = [subprocess.Popen(["cat", str(f)], stdout=subprocess.DEVNULL) for f in files]
    for p in procs:
        p.wait()
    return time.perf_counter() - start


def build(layers: int, width: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local(p).normal_(0.0, 0.02, generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, generator=gen)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, optim = build(args.layers, args.width, world)
    saved = fingerprint(state_tensors(model, optim))
    ss_dir, dcp_dir = args.root / "shardsafe", args.root / "dcp"
    shardsafe.save(ss_dir, {"model": model, "optim": optim})
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(dcp_dir, sync_files=True))
    del msd, osd
    shard_files = sorted(ss_dir.glob("*.safetensors"))
    state: dict[str, Any] = {"optim": optim}

    def load_shardsafe(atomic: bool) -> None:
        shardsafe.load(ss_dir, {"model": model, "optim": state["optim"]}, atomic=atomic)

    def load_dcp() -> None:
        m, o = get_state_dict(model, state["optim"])
        sd: dict[str, Any] = {"model": m, "optim": o}
        dcp.load(sd, storage_reader=FileSystemReader(dcp_dir))
        set_state_dict(model, state["optim"], model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    methods: dict[str, Callable[[], None]] = {
        "shardsafe": partial(load_shardsafe, True),
        "shardsafe_nonatomic": partial(load_shardsafe, False),
        "dcp": load_dcp,
    }
    results: dict[str, Any] = {
        "cat": [],
        "world_size": world,
        "checkpoint_bytes": sum(f.stat().st_size for f in shard_files),
    }
    for variant in ("fresh", "allocated"):
        series: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
        results[variant] = series
        names = [*methods, "cat"]
        for i in range(args.runs):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                if name == "cat":
                    rank0_only(partial(drop_file_cache, ss_dir))
                    results["cat"].append(rank0_only(partial(cat_files, shard_files)))
                    continue
                if variant == "fresh" or i == 0 and name == names[i % len(names)]:
                    # new and stateless, as a resumed job has
                    state["optim"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
                    gc.collect()
                    if variant == "allocated":
                        allocate_optimizer_state(model, state["optim"])  # once; every run then loads into this state
                zero_state(model, state["optim"])
                rank0_only(partial(drop_file_cache, args.root))
                dist.barrier()
                start = time.perf_counter()
                methods[name]()
                elapsed = time.perf_counter() - start
                ok = fingerprint(state_tensors(model, state["optim"])) == saved
                per_rank: list[Any] = [None] * world
                dist.all_gather_object(per_rank, (elapsed, ok))
                series[name].append({"seconds": max(t for t, _ in per_rank), "correct": all(c for _, c in per_rank)})
                if dist.get_rank() == 0:
                    print(
                        f"[{variant} {i + 1}] {name}: {series[name][-1]['seconds']:.3f} s "
                        f"correct={series[name][-1]['correct']}",
                        flush=True,
                    )
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
