"""N-D save and load at 4 gloo ranks: shardsafe against torch.distributed.checkpoint (DCP) and Meta's
torch-checkpointing, side by side.

    .venv/bin/python benchmarks/bench_nd.py --md BENCHMARKS.md       # make bench-nd

The model is a stack of torchtitan-style feed-forward blocks (``w1``/``w3`` colwise, ``w2`` rowwise)
on a ``(dp=2, tp=2)`` mesh: tensor parallel, then FSDP2 over ``dp`` (the colwise weights are
``_StridedShard``), with AdamW state after one step (~1 GB of parameters + moments at the default
size). Each measurement is a fresh 4-rank job doing one operation; the page cache is dropped
before every load, for every library; the libraries alternate within each round and medians over
the rounds are reported. Also an HSDP ``(replicate=2, shard=2)`` restore, for the bytes each
library reads per job (``rchar`` and ``read_bytes`` of ``/proc/self/io``, summed over ranks, after
a cold cache; shardsafe also with ``share_reads=True``, which its default does only across nodes, and with
``atomic=False``), and each rank's
extra peak RSS (``VmHWM`` reset before the operation).

Operations: ``save`` (fsync on: shardsafe's default and DCP's ``FileSystemWriter`` default);
``resume`` (load into a fresh model and a fresh AdamW, what a restarted job does: DCP's
``get_state_dict`` gives the optimizer its state first, as its docs say); ``rollback`` (load
into a model and an optimizer that have stepped).

torch-checkpointing (``pip install torch-checkpointing``) runs in its CPU configuration: the synchronous
saver and ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its default ``O_DIRECT`` stream fails
with EINVAL on close for unaligned writes on this file system), and no resharder: its metadata
all-gather creates CUDA tensors (``metadata_manager.py``: ``device="cuda"``), so on CPU it can only load
onto the layout it saved, which is what these operations do. It writes one pickle file per rank and
item and does not fsync; its load uses ``torch.load(weights_only=False)``. Its manager is built before
the timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_file_cache, folder_bytes, load_average, write_section  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


def _model(layout: str, blocks: int, dim: int, hidden: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(*[Block(dim, hidden) for _ in range(blocks)])
    if layout == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model:
            parallelize_module(
                block, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
            )
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:  # hsdp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, dim: int) -> None:
    x = torch.randn(2, dim, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _io(field: str) -> int:
    """``read_bytes`` (what this process made the disk read) or ``rchar`` (every byte read system
    calls returned from files, page cache or not: what ranks on separate nodes would each fetch)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _prepare(lib: str) -> Any:
    """What a library builds once per job, outside the timed part: torch-checkpointing's manager."""
    if lib != "torch-checkpointing":
        return None
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
    ).build()


def _operate(
    lib: str,
    op: str,
    folder: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    prepared: Any,
    share: bool | None = None,
    atomic: bool = True,
) -> None:
    if lib == "shardsafe":
        import shardsafe

        if op == "save":
            shardsafe.save(folder, {"model": model, "optim": optimizer})
        else:
            shardsafe.load(folder, {"model": model, "optim": optimizer}, share_reads=share, atomic=atomic)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, optimizer)  # a fresh AdamW gets its state here (DCP's documented resume path)
    if lib == "torch-checkpointing":
        if op == "save":
            prepared.save(folder, state)
        else:
            state = dict(prepared.load(folder, into=state))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    if op == "save":
        dcp.save(state, checkpoint_id=folder)
    else:
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as _dcp  # noqa: F401  (imports outside the timed part, for both libraries)

    import shardsafe  # noqa: F401

    prepared = _prepare(job["lib"])
    try:
        model, optimizer = _model(
            job["layout"], job["blocks"], job["dim"], job["hidden"], 0 if job["op"] == "save" else 1
        )
        if job["op"] != "resume":
            _step(model, optimizer, job["dim"])
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss0, read0, rchar0 = _status("VmRSS"), _io("read_bytes"), _io("rchar")
        start = time.perf_counter()
        _operate(
            job["lib"], job["op"], job["folder"], model, optimizer, prepared, job.get("share"), job.get("atomic", True)
        )
        dist.barrier()
        seconds = time.perf_counter() - start
        extra = _status("VmHWM") - rss0
        out[rank] = {
            "seconds": seconds,
            "peak_extra": extra,
            "read": _io("read_bytes") - read0,
            "rchar": _io("rchar") - rchar0,
        }
    finally:
        if prepared is not None:
            prepared.close()
        dist.destroy_process_group()


def run_job(**job: Any) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (4, port, job, out), nprocs=4)
        ranks = [out[r] for r in range(4)]
    summed = {"read": sum(r["read"] for r in ranks), "rchar": sum(r["rchar"] for r in ranks)}
    return {"seconds": max(r["seconds"] for r in ranks), "peak_extra": max(r["peak_extra"] for r in ranks)} | summed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/shardsafe-bench-nd")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    libs = ["shardsafe", "dcp", "torch-checkpointing"]
    size = {"blocks": args.blocks, "dim": args.dim, "hidden": args.hidden}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    sizes: dict[str, int] = {}
    for round_ in range(args.rounds):
        order = libs[round_ % len(libs) :] + libs[: round_ % len(libs)]  # each library first in turn
        for lib in order:
            folder = base / f"{lib}-2d"
            shutil.rmtree(folder, ignore_errors=True)
            results.setdefault((lib, "save"), []).append(
                run_job(lib=lib, op="save", layout="2d", folder=str(folder), **size)
            )
            sizes[lib] = folder_bytes(folder)
            for op in ("resume", "rollback"):
                drop_file_cache(folder)
                results.setdefault((lib, op), []).append(
                    run_job(lib=lib, op=op, layout="2d", folder=str(folder), **size)
                )
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    hsdp: dict[str, dict[str, Any]] = {}
    for lib in libs:
        folder = base / f"{lib}-hsdp"
        run_job(lib=lib, op="save", layout="hsdp", folder=str(folder), **size)
        variants = [("", {})]
        if lib == "shardsafe":  # the default shares reads only across nodes: all 4 ranks are on this one
            variants += [
                (", share_reads=True", {"share": True}),
                (", share_reads=True, atomic=False", {"share": True, "atomic": False}),
            ]
        for suffix, options in variants:
            drop_file_cache(folder)
            hsdp[lib + suffix] = run_job(lib=lib, op="resume", layout="hsdp", folder=str(folder), **options, **size) | {
                "size": folder_bytes(folder)
            }
    med = {
        key: {m: statistics.median(r[m] for r in runs) for m in ("seconds", "peak_extra", "read", "rchar")}
        for key, runs in results.items()
    }
    state_mb = sizes["shardsafe"] / 2**20
    lines = [
        "## N-D save and load (4 ranks, dp=2 x tp=2)",
        "",
        f"`.venv/bin/python benchmarks/bench_nd.py --md BENCHMARKS.md` (`make bench-nd`), {args.blocks} blocks of "
        f"`w1`/`w3` [{args.hidden}, {args.dim}] colwise and `w2` rowwise, FSDP2 over TP (`_StridedShard`), AdamW after "
        "one step: "
        f"{state_mb:.0f} MiB of checkpoint. 4 gloo ranks on this machine ({os.cpu_count()} cores; load average before: "
        f"{load_average()}); "
        f"each operation a fresh 4-rank job, page cache dropped before every load, medians of {args.rounds} "
        "alternating rounds. "
        "Time: the slowest rank, barrier to barrier. Peak: the largest per-rank extra RSS during the operation.",
        "",
        "torch-checkpointing's save does not fsync (shardsafe's and DCP's do); see the module docstring for its "
        "configuration.",
        "",
        "| operation | shardsafe | DCP | torch-checkpointing | shardsafe speed vs DCP | vs torch-checkpointing "
        "| peak extra RSS (shardsafe / DCP / torch-checkpointing) |",
        "|---|---|---|---|---|---|---|",
    ]
    for op in ("save", "resume", "rollback"):
        a, b, c = med[("shardsafe", op)], med[("dcp", op)], med[("torch-checkpointing", op)]
        lines.append(
            f"| {op} | {a['seconds']:.2f} s | {b['seconds']:.2f} s | {c['seconds']:.2f} s | "
            f"{b['seconds'] / a['seconds']:.2f}x | "
            f"{c['seconds'] / a['seconds']:.2f}x | "
            + " / ".join(f"{m['peak_extra'] / 2**20:.0f}" for m in (a, b, c))
            + " MiB |"
        )
    lines += [
        "",
        "HSDP `(replicate=2, shard=2)` restore, bytes read per job, summed over the 4 ranks (cold cache). `rchar`: "
        "every byte "
        "the ranks' read calls got from the checkpoint's file system, page cache or not: what ranks on separate nodes "
        "would each "
        "fetch from storage (shardsafe's atomic load reads what it checked a second time, from the page cache of the "
        "node "
        "that read it: counted here). `read_bytes`: what this one node's disk read (its page cache is shared by the 4 "
        "ranks, "
        "so every library reads about 1x here).",
        "",
        "| library | rchar | rchar / size | disk read_bytes / size | checkpoint size | time |",
        "|---|---|---|---|---|---|",
    ]
    for name, h in hsdp.items():
        size_b = max(1, h["size"])
        lines.append(
            f"| {name} | {h['rchar'] / 2**20:.0f} MiB | {h['rchar'] / size_b:.2f}x | {h['read'] / size_b:.2f}x | "
            f"{h['size'] / 2**20:.0f} MiB | {h['seconds']:.2f} s |"
        )
    lines += ["", "Raw medians: `" + json.dumps({f"{k[0]}/{k[1]}": v for k, v in med.items()}) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md is not None:
        write_section(args.md, lines[0], text)


if __name__ == "__main__":
    main()
