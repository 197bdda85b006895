"""``shardsafe.load`` of a DCP folder at 2 gloo ranks: wall time, peak extra RSS and bytes written per rank.

    .venv/bin/python benchmarks/bench_dcp_load.py --folder /tmp/bench-dcp --save  # dcp.save once, at 2 FSDP2 ranks
    .venv/bin/python benchmarks/bench_dcp_load.py --folder /tmp/bench-dcp  # then load (shardsafe from PYTHONPATH)

The model is a stack of square ``Linear`` layers (``--layers`` x ``--width``: 6 x 3584 is 308 MB of
fp32), ``fully_shard``ed on 2 CPU ranks. Each rank reports the load's wall time, its peak RSS above
what it held before the load (``VmHWM`` reset through ``/proc/self/clear_refs``), the bytes it wrote
(``wchar`` and ``write_bytes`` of ``/proc/self/io``) and a checksum of its shard, so two versions
can be compared on the same folder.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(layers: int, width: int, seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _io() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        if args.save:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            model = _model(args.layers, args.width, 0)
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=args.folder)
            return
        import shardsafe

        model = _model(args.layers, args.width, 1)
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss0, io0 = _status("VmRSS"), _io()
        start = time.perf_counter()
        shardsafe.load(args.folder, {"model": model})
        seconds = time.perf_counter() - start
        peak, io1 = _status("VmHWM"), _io()
        checksum = sum(float(p.detach().to_local().double().sum()) for p in model.parameters())  # type: ignore[attr-defined]
        out[rank] = {
            "seconds": round(seconds, 3),
            "peak_extra_rss_mb": round((peak - rss0) / 2**20, 1),
            "wchar_mb": round((io1["wchar"] - io0["wchar"]) / 2**20, 1),
            "write_bytes_mb": round((io1["write_bytes"] - io0["write_bytes"]) / 2**20, 1),
            "checksum": checksum,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=3584)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (2, port, args, out), nprocs=2)
        results = dict(out)
    if not args.save:
        print(
            json.dumps(
                {"model_mb": round(args.layers * (args.width + 1) * args.width * 4 / 2**20, 1), "ranks": results},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
