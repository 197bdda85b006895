"""The local tier at 4 gloo ranks as 2 simulated nodes x 2: blocked time, restore after a lost node, throughput.

    .venv/bin/python benchmarks/bench_tiers.py --md BENCHMARKS.md       # make bench-tiers

State: an FSDP2 stack of ``Linear(width, width, bias=False)`` layers + AdamW after one step (about
1 GB of parameters and moments at the default size, a quarter per rank). Ranks 0-1 are node ``a``,
ranks 2-3 node ``b`` (``SHARDSAFE_NODE``), each node with its own folder under ``/dev/shm``; the
persistent root is on this machine's disk. Every measurement is a fresh 4-rank (or 2-rank) job.

1. **Blocked per save** (medians over saves 2..N, the slowest rank per save): a local-tier save
   (``local_every=1, replicas=1``: the caller copies the state into the tier's staging buffers, the
   tier's thread writes it), against a ``copy_`` of every local tensor into buffers allocated
   before (the memcpy floor) and against an async persistent save (``async_save=True``); and a
   step due in both tiers (one describe and one copy, which the tier's thread and the background
   writer both write from).
2. **Restore after losing node b**: steps 1-3 saved (root every 2 steps: step 2; the tier: step 3),
   the job killed, node b's folder wiped; a new 4-rank job restores: from the tier (b gets the small
   files over the tier's group, and its ranks' loads receive what they read of b's shard files from
   node a's ranks, which hold them as replicas), and, for comparison, a job with no tier from the
   root with a cold page cache (step 2, the same bytes). Bytes read from disk (``read_bytes``) and
   moved over the process group (what b gets: the small files, and the chunks its ranks' loads
   received) are reported.
3. **4 -> 2**: the same, restored by 2 ranks both on node a (resharding), from the tier and from the root.
4. **Throughput**: steps padded to ~1 s, with ``local_every=1`` against no checkpoints: a real
   FSDP training step on this machine's cores (which alone takes longer than the pad here), and a
   modeled GPU step (the host sleeps while "the device" runs forward/backward, then the real AdamW
   step on the rank's shards), with the tier's copy in the call and in overlap mode.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

SECTION = "## Local tier (4 ranks as 2 nodes)"
BLOCKED = ("memcpy", "tier", "tier overlap", "async root", "both")  # the blocked-time measurements


def _node(rank: int, world: int) -> str:
    return "a" if world == 2 or rank < 2 else "b"


def _model(layers: int, width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int, index: int) -> None:
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(index))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for entries in optimizer.state.values():
        out += [
            v.to_local() if hasattr(v, "to_local") else v
            for v in entries.values()
            if isinstance(v, torch.Tensor) and v.dim()
        ]
    return [t.detach() for t in out]


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread (gloo's, the prefault thread) included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _all_ranks_cpu(since: float) -> float:
    """Collective: the CPU seconds every rank used since its ``since`` (:func:`_cpu_seconds`), summed."""
    used = torch.tensor([_cpu_seconds() - since], dtype=torch.float64)
    dist.all_reduce(used)
    return float(used)


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    slowest = torch.tensor([seconds])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _blocked(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import shardsafe

    model, optimizer = _model(job["layers"], job["width"], 0)
    _step(model, optimizer, job["width"], 0)
    state = {"model": model, "optim": optimizer}
    sources = _local_tensors(model, optimizer)
    buffers = [torch.empty_like(t) for t in sources]
    for b in buffers:
        b.zero_()  # touched, as the reused staging buffers are after the first save

    def copy() -> None:
        for b, t in zip(buffers, sources):
            b.copy_(t)

    out: dict[str, Any] = {"memcpy": [_timed(copy) for _ in range(job["saves"])]}
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in sources)
    tier = shardsafe.CheckpointManager(
        job["root"] + "-tier", save_every=10**9, local_every=1, local_dir=job["local"], replicas=1
    )
    out["tier"] = []
    for step in range(1, job["saves"] + 1):
        out["tier"].append(_timed(lambda step=step: tier.save(step, state)))
        tier.wait()  # the write itself, outside the blocked time (a step of training would overlap it)
    tier.close()
    overlapped = shardsafe.CheckpointManager(
        job["root"] + "-overlap",
        save_every=10**9,
        local_every=1,
        local_dir=job["local"],
        replicas=1,
        async_save="overlap",
    )
    out["tier overlap"] = []
    for step in range(1, job["saves"] + 1):
        out["tier overlap"].append(_timed(lambda step=step: overlapped.save(step, state)))
        overlapped.wait()
    overlapped.close()
    persistent = shardsafe.CheckpointManager(job["root"] + "-async", async_save=True, keep_last=1)
    out["async root"] = []
    for step in range(1, job["saves"] + 1):
        out["async root"].append(_timed(lambda step=step: persistent.save(step, state)))
        persistent.wait()
    persistent.close()
    both = shardsafe.CheckpointManager(
        job["root"] + "-both", async_save=True, keep_last=1, local_every=1, local_dir=job["local"], replicas=1
    )
    out["both"] = []
    for step in range(1, job["saves"] + 1):
        out["both"].append(_timed(lambda step=step: both.save(step, state)))
        both.wait()
    both.close()
    return out


def _train_then_crash(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import shardsafe

    model, optimizer = _model(job["layers"], job["width"], 0)
    manager = shardsafe.CheckpointManager(job["root"], save_every=2, local_every=1, local_dir=job["local"], replicas=1)
    state = {"model": model, "optim": optimizer}
    for step in range(1, 4):
        _step(model, optimizer, job["width"], step)
        manager.save(step, state)
    manager.wait()
    return {}  # no close(): the job dies with the tier in place


def _restore(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import shardsafe

    model, optimizer = _model(job["layers"], job["width"], 1)
    options = {"local_every": 1, "local_dir": job["local"], "replicas": 1} if job["tier"] else {}
    manager = shardsafe.CheckpointManager(job["root"], save_every=2, **options)
    state = {"model": model, "optim": optimizer}
    read0 = _read_bytes()
    box: dict[str, Any] = {}
    cpu = _cpu_seconds()
    seconds = _timed(lambda: box.update(step=manager.restore(state)))
    cpu = _all_ranks_cpu(cpu)
    read = torch.tensor([_read_bytes() - read0])
    dist.all_reduce(read)
    # the bytes sent to the nodes: the small files over the tier's group, and what the loads received from other nodes
    moved = sum(manager._tier.received.values()) if manager._tier is not None else 0
    return {
        "seconds": seconds,
        "cpu": cpu,
        "step": box["step"],
        "from": manager.restored_from,
        "read": int(read),
        "moved": moved,
    }


def _throughput(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Seconds for ``steps`` steps, each padded to ``step_time``, saving every step when ``options`` is set.

    ``modeled``: the step a GPU node's host sees: it waits for the device's forward/backward
    (a sleep, the host idle meanwhile, as under a CUDA synchronize) and runs the real optimizer step
    on this rank's shards with fixed random gradients, so the state changes every step. Otherwise
    a real FSDP forward/backward/step on this machine's cores."""
    import shardsafe

    model, optimizer = _model(job["layers"], job["width"], 0)
    state = {"model": model, "optim": optimizer}
    options = job["options"]
    manager = (
        shardsafe.CheckpointManager(job["root"], save_every=10**9, local_dir=job["local"], replicas=1, **options)
        if options is not None
        else None
    )
    _step(model, optimizer, job["width"], 0)
    if job["modeled"]:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3

    def loop(steps: range) -> None:
        for step in steps:
            begin = time.perf_counter()
            if job["modeled"]:
                time.sleep(job["step_time"] * job["device_share"])  # the device's forward/backward
                optimizer.step()  # overlap mode: waits here for the previous save's copy
            else:
                _step(model, optimizer, job["width"], step)
            pad = torch.tensor([job["step_time"] - (time.perf_counter() - begin)])
            dist.all_reduce(pad, op=dist.ReduceOp.MIN)  # every rank pads alike: the step ends together
            time.sleep(max(0.0, float(pad)))
            if manager is not None:
                manager.save(step, state)

    # steady state: the first saves allocate the staging buffers and the tier's first steps of host memory
    loop(range(1, job["warmup"] + 1))
    seconds = _timed(lambda: loop(range(job["warmup"] + 1, job["warmup"] + job["steps"] + 1)))
    if manager is not None:
        manager.close()
    return {"seconds": seconds}


def _floor(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """The least work any restore of this case does on this machine, with nothing else: the load's
    first import of ``torch.distributed.checkpoint`` (both restores pay it), every rank's share put
    into its tensors (a third already in memory, as the model's parameters are; two thirds new, as a
    fresh optimizer's moments are) and hashed with xxh3 in 1 MiB pieces, as the load verifies; at 4
    ranks node b's share comes from node a's replica files, sent from their mapped pages straight
    into b's tensors (no file on b, no planning), while a's ranks read their own from their files."""
    import torch.distributed.fsdp  # noqa: F401  (the restore job's model imported it before its clock started)
    import xxhash

    from shardsafe.manager.tier import PIECE_BYTES  # the tier's point-to-point message
    from shardsafe.storage.local import MappedFile, tensor_bytes

    folder, size = Path(job["files"]), job["bytes"]
    mine = [f"own-{rank}"] if world == 4 else [f"own-{rank}", f"replica-{rank + 2}"]
    out = torch.empty(size * len(mine), dtype=torch.uint8)
    for i in range(len(mine)):
        out[i * size : i * size + size // 3].fill_(1)  # the parameters' pages exist before a restore
    piece = 1 << 20

    def hashed(view: memoryview) -> None:
        for at in range(0, len(view), piece):
            xxhash.xxh3_64_digest(view[at : at + piece])

    def restore() -> None:
        import torch.distributed.checkpoint.state_dict  # noqa: F401  (the first import every restore pays)

        if world == 4 and rank < 2:  # node a: b's share from the replica file's pages, then its own
            source = MappedFile.for_reading(folder / f"replica-{rank + 2}", size)
            for at in range(0, size, PIECE_BYTES):
                source.populate(at, min(size, at + PIECE_BYTES))
                dist.send(source.bytes[at : at + PIECE_BYTES], rank + 2)
            source.close()
        if world == 4 and rank >= 2:  # node b: straight into its tensors, then verified
            for at in range(0, size, PIECE_BYTES):
                dist.recv(out[at : at + PIECE_BYTES], rank - 2)
            hashed(tensor_bytes(out))
            return
        view = tensor_bytes(out)
        for i, name in enumerate(mine):
            with open(folder / name, "rb", buffering=0) as f:
                for at in range(i * size, (i + 1) * size, piece):
                    f.readinto(view[at : at + piece])
                    hashed(view[at : at + piece])

    cpu = _cpu_seconds()
    seconds = _timed(restore)
    return {"seconds": seconds, "cpu": _all_ranks_cpu(cpu)}


JOBS = {
    "blocked": _blocked,
    "crash": _train_then_crash,
    "restore": _restore,
    "throughput": _throughput,
    "floor": _floor,
}


def _rank(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SHARDSAFE_NODE=_node(rank, world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out[rank] = JOBS[job["kind"]](rank, world, job)
    finally:
        dist.destroy_process_group()


def run_job(world: int = 4, **job: Any) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, (world, port, job, out), nprocs=world)
        return dict(out[0])


def _lose_node_b(local: Path) -> None:
    shutil.rmtree(local / "b", ignore_errors=True)


def restore_case(base: Path, local: Path, size: dict[str, int], world: int, tier: bool) -> dict[str, Any]:
    """Train 3 steps (root: step 2, tier: step 3), lose node b, restore with ``world`` ranks."""
    root = base / "root"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    run_job(kind="crash", root=str(root), local=str(local / "{node}"), **size)
    _lose_node_b(local)
    drop_file_cache(root)
    result = run_job(world, kind="restore", root=str(root), local=str(local / "{node}"), tier=tier, **size)
    return result | {"root_bytes": folder_bytes(root / "step-0000000002")}


def _step_note(step: float, pad: float, memcpy: float) -> str:
    """What the throughput line measured: a step padded to ``pad`` seconds, or (when training alone takes longer
    on this machine) a longer one whose cores the tier's background work competes for."""
    floor = (
        f"The copy the loop waits for alone is {memcpy * 1000:.0f} ms per save "
        f"({memcpy / pad * 100:.1f}% of a {pad:.1f} s step)."
    )
    if step <= pad * 1.05:
        return f"A step without checkpoints took {step:.2f} s (padded). {floor}"
    return (
        f"A step without checkpoints took {step:.2f} s, not {pad:.1f} s: training alone keeps this machine's 2 cores "
        f"busy past the pad, so every byte the tier copies, hashes, writes and sends is CPU taken from training "
        f"(on a GPU node the host is mostly idle during a step). {floor}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/shardsafe-bench-tiers")
    parser.add_argument("--local", default="/dev/shm/shardsafe-bench-tiers", help="the nodes' folders (tmpfs)")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-time", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=3, help="throughput: steps (and saves) before the timed ones")
    parser.add_argument(
        "--device-share", type=float, default=0.8, help="modeled step: the part of it the host waits for the device"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the restore comparison (medians)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: a small model, 1 round, BENCHMARKS.md untouched unless --md"
    )
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.saves, args.steps, args.step_time, args.rounds = 2, 256, 3, 3, 0.2, 1
        args.warmup = 1
    base, local_base = Path(args.dir), Path(args.local)
    for folder in (base, local_base):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    size = {"layers": args.layers, "width": args.width}
    started = time.perf_counter()

    blocked = run_job(
        kind="blocked",
        root=str(base / "blocked"),
        local=str(local_base / "blocked" / "{node}"),
        saves=args.saves,
        **size,
    )
    med = {k: statistics.median(blocked[k][1:]) for k in BLOCKED}
    print(f"blocked: {json.dumps(med)}", file=sys.stderr, flush=True)

    restores: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        cases = [("tier", 4, True), ("root", 4, False), ("tier 4->2", 2, True), ("root 4->2", 2, False)]
        for name, world, tier in cases if round_ % 2 == 0 else cases[::-1]:
            result = restore_case(base / "restore", local_base / "restore", size, world, tier)
            restores.setdefault(name, []).append(result)
        print(f"restore round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    # the floors, from files of one rank's share each in node a's tmpfs folder (its own ranks' and b's replicas)
    floor_dir = local_base / "floor"
    floor_dir.mkdir()
    share = blocked["state_bytes"]
    for name in ("own-0", "own-1", "replica-2", "replica-3"):
        with open(floor_dir / name, "wb") as f:
            for _ in range(0, share, 64 << 20):
                f.write(os.urandom(min(64 << 20, share - f.tell())))
    floors: dict[str, list[float]] = {}
    floor_cpus: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, world in (("tier", 4), ("tier 4->2", 2)):
            floor_run = run_job(world, kind="floor", files=str(floor_dir), bytes=share)
            floors.setdefault(name, []).append(floor_run["seconds"])
            floor_cpus.setdefault(name, []).append(floor_run["cpu"])
    shutil.rmtree(floor_dir)
    print(f"floors: {json.dumps(floors)}, CPU {json.dumps(floor_cpus)}", file=sys.stderr, flush=True)

    loop: dict[str, dict[str, float]] = {}
    for kind, modeled in (("training on this machine's cores", False), ("modeled GPU step", True)):
        variants: list[tuple[str, dict[str, Any] | None]] = [
            ("no checkpoints", None),
            ("local_every=1", {"local_every": 1}),
        ]
        if modeled:
            variants.append(("local_every=1, overlap", {"local_every": 1, "async_save": "overlap"}))
        for name, options in variants:
            shutil.rmtree(base / "loop", ignore_errors=True)
            shutil.rmtree(local_base / "loop", ignore_errors=True)
            where: dict[str, Any] = {"root": str(base / "loop"), "local": str(local_base / "loop" / "{node}")}
            loop.setdefault(kind, {})[name] = run_job(
                kind="throughput",
                options=options,
                modeled=modeled,
                device_share=args.device_share,
                warmup=args.warmup,
                steps=args.steps,
                step_time=args.step_time,
                **where,
                **size,
            )["seconds"]
        print(f"throughput ({kind}): {json.dumps(loop[kind])}", file=sys.stderr, flush=True)
    for folder in (base, local_base):
        shutil.rmtree(folder, ignore_errors=True)

    state_mb = blocked["state_bytes"] * 4 / 2**20
    rmed = {
        name: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "cpu", "read", "moved", "root_bytes")}
        for name, runs in restores.items()
    }
    froms = {name: sorted({f"{r['from']} step {r['step']}" for r in runs}) for name, runs in restores.items()}
    lines = [
        SECTION,
        "",
        f"`.venv/bin/python benchmarks/bench_tiers.py{' --quick' if args.quick else ''} --md BENCHMARKS.md` (`make "
        "bench-tiers`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({(time.perf_counter() - started) / 60:.1f} min; "
        f"load average {load_average()} after): 4 gloo ranks as 2 simulated nodes x 2 on this machine "
        f"({os.cpu_count()} cores), "
        f"FSDP2 over {args.layers} x Linear({args.width}, {args.width}) + AdamW: {state_mb:.0f} MiB of state "
        f"({state_mb / 4:.0f} MiB per rank). "
        "Node folders in `/dev/shm`, the root on disk.",
        "",
        f"Blocked per save (median of saves 2-{args.saves}, slowest rank):",
        "",
        "| save | blocked | vs memcpy | target |",
        "|---|---|---|---|",
        f"| memcpy of the rank's state (preallocated) | {med['memcpy'] * 1e3:.0f} ms | 1.00x | |",
        f"| local tier (`local_every=1, replicas=1`) | {med['tier'] * 1e3:.0f} ms | {med['tier'] / med['memcpy']:.2f}x "
        "| <= 1.5x: "
        f"{'met' if med['tier'] <= 1.5 * med['memcpy'] else 'MISSED'} |",
        f'| local tier, `async_save="overlap"` (the call; the tier\'s thread then writes from the live tensors) | '
        f"{med['tier overlap'] * 1e3:.0f} ms | {med['tier overlap'] / med['memcpy']:.2f}x | |",
        f"| async persistent save (`async_save=True`) | {med['async root'] * 1e3:.0f} ms | "
        f"{med['async root'] / med['memcpy']:.2f}x | |",
        "| a step due in both (`async_save=True, local_every=1`: one copy, two writers) | "
        f"{med['both'] * 1e3:.0f} ms | "
        f"{med['both'] / med['memcpy']:.2f}x | |",
        "",
        f"Restore after losing node b (its folder wiped; medians of {args.rounds} alternating rounds; the root's page "
        "cache dropped first):",
        "",
        "| restore | time | CPU, all ranks | loaded | read from disk | sent over the group |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rmed.items():
        lines.append(
            f"| {name} | {r['seconds']:.2f} s | {r['cpu']:.2f} s | {', '.join(froms[name])} | "
            f"{r['read'] / 2**20:.0f} MiB | {r['moved'] / 2**20:.0f} MiB |"
        )
    cores = os.cpu_count() or 1
    busy = rmed["tier"]["cpu"] / (cores * rmed["tier"]["seconds"])
    lines += [
        "",
        "CPU: the user and system seconds of every rank's process (all its threads: gloo's, the prefault thread) "
        f"during the call, summed; {cores} cores give a restore of T seconds at most {cores}T. "
        f"The tier's restore at 4 ranks kept {busy:.0%} of the cores busy"
        + (": it is bound by the CPU the four ranks share, so only less work makes it faster." if busy >= 0.8 else "."),
    ]
    speedup = rmed["root"]["seconds"] / rmed["tier"]["seconds"]
    speedup2 = rmed["root 4->2"]["seconds"] / rmed["tier 4->2"]["seconds"]
    floor = {name: statistics.median(runs) for name, runs in floors.items()}
    floor_cpu = {name: statistics.median(runs) for name, runs in floor_cpus.items()}
    lines += [
        "",
        f"Tier vs root: {speedup:.2f}x faster at 4 ranks, {speedup2:.2f}x after 4 -> 2 (target >= 2x: "
        f"{'met' if min(speedup, speedup2) >= 2 else 'MISSED'}). The 4 -> 2 job runs on node a alone, which holds b's "
        "files as its replica.",
        "",
        "The floor of a restore from the tier here (medians of the same rounds; `_floor` in the script): only the "
        "work every restore of the case must do, with no planning, checks, files or agreement: the load's first import "
        "of `torch.distributed.checkpoint` (the root's restore pays it too), each rank's share put into its tensors "
        "(two thirds into new memory, as a fresh optimizer's moments) and hashed with xxh3; at 4 ranks node b's share "
        "sent from node a's replica files' mapped pages straight into b's tensors.",
        "",
        "| restore | floor (CPU, all ranks) | the tier's restore (CPU) | the root's "
        "| best tier vs root possible here |",
        "|---|---|---|---|---|",
    ]
    for name, root_name in (("tier", "root"), ("tier 4->2", "root 4->2")):
        lines.append(
            f"| {name} | {floor[name]:.2f} s ({floor_cpu[name]:.2f} s) | {rmed[name]['seconds']:.2f} s "
            f"({rmed[name]['cpu']:.2f} s) | {rmed[root_name]['seconds']:.2f} s | "
            f"{rmed[root_name]['seconds'] / floor[name]:.2f}x |"
        )
    lines += [
        "",
        f"Throughput, {args.steps} steps each padded to {args.step_time:.1f} s after {args.warmup} untimed ones "
        "(the first saves allocate the staging buffers and the tier's host memory), a local save every step "
        "(`local_every=1, replicas=1`) against none (target <= +5%):",
        "",
        "| loop | a step without checkpoints | saving | slower | target |",
        "|---|---|---|---|---|",
    ]
    for kind, runs in loop.items():
        bare = runs["no checkpoints"]
        for name, seconds in runs.items():
            if name == "no checkpoints":
                continue
            slower = seconds / bare - 1
            lines.append(
                f"| {kind}, `{name}` | {bare / args.steps:.2f} s | {seconds / args.steps:.2f} s | "
                f"{slower * 100:+.1f}% | {'met' if slower <= 0.05 else 'MISSED'} |"
            )
    cpu = loop["training on this machine's cores"]["no checkpoints"] / args.steps
    lines += [
        "",
        _step_note(cpu, args.step_time, med["memcpy"])
        + f" The modeled GPU step sleeps {args.device_share * args.step_time:.1f} s (the host waiting for the "
        "device's forward/backward, its cores idle) and then runs the real AdamW step on the rank's shards "
        'with fixed random gradients (the state changes every step); with `async_save="overlap"` the tier\'s '
        "thread writes the node's files from the live tensors during that wait (no copy of a host state) and the "
        "optimizer step waits for them.",
        "",
        "Raw: `" + json.dumps({"blocked": {k: [round(v, 4) for v in blocked[k]] for k in BLOCKED}}) + "`",
        "`" + json.dumps({"restore": rmed, "floors": floors, "floor_cpus": floor_cpus, "loop": loop}) + "`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md is not None:
        write_section(args.md, SECTION, text)


if __name__ == "__main__":
    main()
