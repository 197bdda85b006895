"""CheckpointManager benchmark: `python benchmarks/bench_manager.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

One ``torch.distributed.run`` launch of 2 ranks (gloo, CPU), FSDP2, fsync on everywhere:

1. **Blocked and durable time per checkpoint** of an MLP of 10 x Linear(2880, 2880) (332 MB of fp32
   parameters) plus stepped AdamW state (996 MB in all, 498 MB per rank), each save alone: the
   seconds of the call, until the state is free again (the snapshot taken: what the loop waits for
   before changing it) and until the checkpoint is durable (written, fsynced, committed), for
   shardsafe ``CheckpointManager`` with ``async_save=True``, ``"overlap"`` and ``False``; the async
   peers of ``worker_async.py``: ``torch.distributed.checkpoint.async_save`` in its thread mode (as
   is, with a reused ``DefaultStager`` staging in the call, and staging in a thread) and its process
   mode (``AsyncCheckpointerType.PROCESS`` with a reused shared-memory ``DefaultStager``, staging
   in a thread or in the call), and torch-checkpointing's async ``CheckpointManager``; and a plain
   ``copy_`` of the same local tensors into preallocated buffers, the floor. Ratios shardsafe /
   peer are taken run by run (the peer's save in the same run) and given as median and range.
2. **Extra time the loop loses per checkpoint**: wall time of a save call plus the next W training
   steps, minus the same W steps without a save. Background writes compete with training for the
   same 2 cores here; DCP's async staging and shardsafe's ``"overlap"`` wait for their copy before
   the next ``optimizer.step()`` (an optimizer step pre-hook), as they must.
3. **Dedup**: the same MLP with 90% of its parameters frozen (9 of 10 layers, as in a fine-tune);
   bytes written by a ``dedup=True`` save after one more training step vs a full save.
4. **A checkpoint every step** on the demo model (``shardsafe.cli.demo.model.TinyGPT``, 0.44 M
   parameters, the demo's training step): steps/second with no checkpointing, with a manager that
   only checks for preemption, and with an async (or overlap) save every step, taking turns in
   short blocks.

Every measurement alternates the order of the methods from one run to the next and reports the
median over runs of the slowest rank. ``--quick`` is a smoke test (a small model, 1 run) that
leaves BENCHMARKS.md alone unless ``--md`` is given; otherwise the "## CheckpointManager" section of
BENCHMARKS.md is written (replacing an earlier one; appended below the ``<!-- notes -->`` line).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from worker_async import TC_NAME  # noqa: E402 - benchmarks/ is on the path from here on

SECTION = "## CheckpointManager"
FULL = {"layers": 10, "width": 2880, "batch": 16, "window": 2, "tiny_steps": 8, "tiny_blocks": 6}
QUICK = {"layers": 10, "width": 512, "batch": 8, "window": 1, "tiny_steps": 4, "tiny_blocks": 2}
FROZEN_LAYERS = 0.9  # fraction of the layers frozen in the dedup measurement
# the peers of the loop-time phase: DCP's default, its two async-staging modes, torch-checkpointing
WINDOW_PEERS = (
    "dcp async_save",
    "dcp async_save + DefaultStager(async staging)",
    "dcp async_save(PROCESS) + DefaultStager(shm, async staging)",
    "torch-checkpointing async save",
)
TARGETS = {
    "blocked_vs_dcp": 0.5,
    "blocked_vs_copy": 1.5,
    "overlap_vs_dcp": 1.0,
    "dedup_fraction": 0.15,
    "every_step_overhead": 0.05,
}


# ----------------------------------------------------------------------------- rank worker (torchrun)


def _now() -> float:
    return time.perf_counter()


class Rank:
    """Helpers bound to this rank's process group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 while the others wait; everyone gets its result."""
        box = [fn() if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


def build_mlp(layers: int, width: int, mesh: Any, frozen: int = 0, seed: int = 1234) -> tuple[Any, Any]:
    """FSDP2 MLP (each layer, then the root), materialised shard by shard; AdamW over trainable params."""
    import torch
    from common import build_model
    from torch.distributed.fsdp import fully_shard

    model = build_model(layers, width, device="meta")
    for i, layer in enumerate(model):
        if i < frozen:
            layer.requires_grad_(False)
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)  # one all-gather per step: shorter steps, same state
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed + int(os.environ["RANK"]))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=gen)  # type: ignore[attr-defined]
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    return model, optim


def train_step(model: Any, optim: Any, batch: int, width: int, gen: Any) -> None:
    import torch

    model(torch.randn(batch, width, generator=gen)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def local_tensors(state: dict[str, Any]) -> list[Any]:
    """Exactly the local tensors a shardsafe save of ``state`` copies (its chunks)."""
    from shardsafe.state.registry import describe_for_save

    return [c.tensor.detach() for c in describe_for_save(state, 0).chunks]


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Savers:
    """What both timing phases save with, created once so that first-call costs fall in the warm-up run."""

    def __init__(self, r: Rank, root: Path) -> None:
        from worker_async import AsyncPeers

        import shardsafe

        self.peers = AsyncPeers(r.dist.new_group(backend="gloo"))
        self.managers = {
            "shardsafe async": shardsafe.CheckpointManager(root / "ss-async", async_save=True),
            "shardsafe overlap": shardsafe.CheckpointManager(root / "ss-overlap", async_save="overlap"),
            "shardsafe sync": shardsafe.CheckpointManager(root / "ss-sync", async_save=False),
        }
        self.root = root
        self.counter = 0

    def next_step(self) -> int:
        self.counter += 1
        return self.counter

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()
        self.peers.close()


def shardsafe_staged(manager: Any) -> Callable[[], None]:
    """Returns once an async save of ``manager`` has copied the state: at once, except in overlap mode,
    whose copy runs in the background (its optimizer pre-hook waits on the same event)."""
    if manager.async_save == "overlap":
        return manager._copied.wait  # type: ignore[no-any-return]
    return lambda: None


def measure_blocked(
    r: Rank, state: dict[str, Any], step: Callable[[], None], savers: Savers, runs: int
) -> dict[str, Any]:
    """Phase 1: for each method and run, seconds from the call until it returns, until the state is
    free again (the snapshot taken) and until the checkpoint is durable, with nothing else running."""
    import torch

    sources = local_tensors(state)
    buffers = [torch.empty_like(s) for s in sources]

    def copy() -> tuple[float, float, float]:
        start = _now()
        with torch.no_grad():
            for b, s in zip(buffers, sources):
                b.copy_(s)
        seconds = _now() - start
        return seconds, seconds, seconds

    def shardsafe_save(name: str) -> Callable[[], tuple[float, float, float]]:
        manager = savers.managers[name]
        staged = shardsafe_staged(manager)

        def run() -> tuple[float, float, float]:
            step = savers.next_step()
            start = _now()
            manager.save(step, state, force=True)
            call = _now() - start
            staged()
            free = _now() - start
            manager.wait()
            done = _now() - start
            r.barrier()
            r.on_rank0(lambda: remove(Path(str(manager.step_path(step)))))
            return call, free, done

        return run

    def peer_save(name: str) -> Callable[[], tuple[float, float, float]]:
        def run() -> tuple[float, float, float]:
            path = savers.root / f"peer-{savers.next_step()}"
            start = _now()
            call, staged, upload = savers.peers.save(name, state, path)
            staged()
            free = _now() - start
            upload.result()
            done = _now() - start
            r.barrier()
            r.on_rank0(lambda: remove(path))
            return call, free, done

        return run

    methods: dict[str, Callable[[], tuple[float, float, float]]] = {
        "memory copy": copy,
        "shardsafe async": shardsafe_save("shardsafe async"),
        "shardsafe overlap": shardsafe_save("shardsafe overlap"),
        "shardsafe sync": shardsafe_save("shardsafe sync"),
        **{name: peer_save(name) for name in savers.peers.names()},
    }
    out: dict[str, list[list[float]]] = {name: [] for name in methods}
    order = list(methods)
    for run in range(
        runs + 1
    ):  # run 0 warms every path up (first-call costs, buffer allocation, daemons) and is dropped
        step()  # the state changes between runs, as between checkpoints
        for name in order if run % 2 == 0 else order[::-1]:
            r.barrier()
            call, free, done = methods[name]()
            if run:
                out[name].append([call, free, done])
        r.log(f"blocked-time run {run}/{runs} done")
    return {"runs": out, "copy_bytes": sum(s.numel() * s.element_size() for s in sources), "tensors": len(sources)}


def measure_window(
    r: Rank, state: dict[str, Any], step: Callable[[], None], savers: Savers, runs: int, window: int
) -> dict[str, Any]:
    """Phase 2: seconds for a save call plus ``window`` training steps, per method and run (warmed up by phase 1)."""
    pending: list[Callable[[], None]] = []  # a peer's wait for its snapshot, called before the next optimizer step

    def wait_for_peer_staging(*args: Any, **kwargs: Any) -> None:
        while pending:
            pending.pop()()

    hook = state["optim"].register_step_pre_hook(wait_for_peer_staging)

    def steps() -> None:
        for _ in range(window):
            step()

    def none() -> tuple[float, bool]:
        start = _now()
        steps()
        return _now() - start, True

    def shardsafe_save(name: str) -> Callable[[], tuple[float, bool]]:
        manager = savers.managers[name]

        def run() -> tuple[float, bool]:
            step = savers.next_step()
            start = _now()
            manager.save(step, state, force=True)
            steps()
            seconds = _now() - start
            finished = not manager.save_in_flight
            manager.wait()
            r.barrier()
            r.on_rank0(lambda: remove(Path(str(manager.step_path(step)))))
            return seconds, finished

        return run

    def peer_save(name: str) -> Callable[[], tuple[float, bool]]:
        def run() -> tuple[float, bool]:
            path = savers.root / f"w-peer-{savers.next_step()}"
            start = _now()
            _, staged, upload = savers.peers.save(name, state, path)
            pending.append(staged)
            steps()
            seconds = _now() - start
            finished = upload.done()
            upload.result()
            r.barrier()
            r.on_rank0(lambda: remove(path))
            return seconds, finished

        return run

    methods = {
        "shardsafe async": shardsafe_save("shardsafe async"),
        "shardsafe overlap": shardsafe_save("shardsafe overlap"),
        **{name: peer_save(name) for name in WINDOW_PEERS},
    }
    # Each measurement is paired with a no-checkpoint window right next to it (before or after, alternating),
    # so the load of the shared machine at that moment cancels out of the difference.
    out: dict[str, list[list[float]]] = {name: [] for name in methods}
    order = list(methods)
    for run in range(runs):
        for i, name in enumerate(order if run % 2 == 0 else order[::-1]):
            seconds: dict[str, float] = {}
            finished = True
            for which in ("none", name) if (run + i) % 2 == 0 else (name, "none"):
                r.barrier()
                seconds[which], done = none() if which == "none" else methods[name]()
                finished = finished and done
            out[name].append([seconds[name], float(finished), seconds["none"]])
        r.log(f"window run {run + 1}/{runs} done")
    hook.remove()
    return {"runs": out, "window": window}


def measure_dedup(r: Rank, layers: int, width: int, batch: int, mesh: Any, root: Path, runs: int) -> dict[str, Any]:
    """Phase 3: a fine-tune with 90% of the layers frozen; full save vs dedup save after a step."""
    import torch

    import shardsafe

    frozen = round(layers * FROZEN_LAYERS)
    model, optim = build_mlp(layers, width, mesh, frozen=frozen, seed=99)
    gen = torch.Generator().manual_seed(7 + r.rank)
    train_step(model, optim, batch, width, gen)
    state = {"model": model, "optim": optim, "step": 0}
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * 4 for p in model.parameters())
    states = {"": state, "model only ": {"model": model}}  # the whole training state; the model alone (no optimizer)
    managers = {
        f"{what}{kind}": shardsafe.CheckpointManager(
            root / f"{what}{kind}".replace(" ", "-"), async_save=False, dedup=kind == "dedup"
        )
        for what in states
        for kind in ("full", "dedup")
    }

    def folder_bytes(path: Path) -> int:
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())

    def save(name: str, step: int) -> tuple[float, int]:
        manager = managers[name]
        r.barrier()
        start = _now()
        manager.save(step, states[name.removesuffix("full").removesuffix("dedup")], force=True)
        seconds = _now() - start
        r.barrier()
        return seconds, r.on_rank0(lambda: folder_bytes(Path(str(manager.step_path(step)))))

    first = {name: save(name, 1) for name in managers if name.endswith("dedup")}  # nothing to reference yet: full saves
    out: dict[str, list[list[float]]] = {name: [] for name in managers}
    order = list(managers)
    for run in range(runs):
        train_step(model, optim, batch, width, gen)
        for name in order if run % 2 == 0 else order[::-1]:
            out[name].append(list(save(name, run + 2)))
        for name in managers:
            if name.endswith("full"):
                done = Path(str(managers[name].step_path(run + 2)))
                r.on_rank0(lambda: remove(done))  # noqa: B023 - called at once
    for manager in managers.values():
        manager.close()
    r.on_rank0(lambda: remove(root))
    r.log("dedup done")
    return {
        "runs": out,
        "first": first,
        "frozen_layers": frozen,
        "param_bytes": total,
        "trainable_param_bytes": trainable,
        "changed_bytes": 3 * trainable,  # trainable parameters + their two AdamW moments
    }


def measure_every_step(r: Rank, mesh: Any, root: Path, blocks: int, steps: int) -> dict[str, Any]:
    """Phase 4: seconds per block of ``steps`` demo-model steps, without checkpoints and with one every step.

    The variants take turns block by block (order alternating), so a slow phase of the shared
    machine hits them alike. A block ends by waiting for its last save to commit (counted).
    """
    import shardsafe
    from shardsafe.cli.demo.model import split_corpus
    from shardsafe.cli.demo.worker import build_state, train_step

    state = build_state(0, 10_000, mesh)
    data, _ = split_corpus()
    managers = {
        "preemption check only (`handle_preemption=True`, no saves)": shardsafe.CheckpointManager(
            root / "check", handle_preemption=True, save_every=10**9
        ),
        "async save every step (`async_save=True`)": shardsafe.CheckpointManager(
            root / "async", save_every=1, keep_last=2, async_save=True
        ),
        'overlap save every step (`async_save="overlap"`)': shardsafe.CheckpointManager(
            root / "overlap", save_every=1, keep_last=2, async_save="overlap"
        ),
    }
    counter = [0]

    def block(manager: Any) -> float:
        start = _now()
        for _ in range(steps):
            train_step(state, data)
            counter[0] += 1
            state["step"] = counter[0]
            if manager is not None:
                manager.save(counter[0], state)
        if manager is not None:
            manager.wait()
        return _now() - start

    methods: dict[str, Any] = {"no checkpoint": None, **managers}
    out: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for run in range(blocks + 1):  # round 0: warm-up, dropped
        for name in order if run % 2 == 0 else order[::-1]:
            r.barrier()
            seconds = block(methods[name])
            if run:
                out[name].append(seconds)
    r.log("every-step blocks done")
    for manager in managers.values():
        manager.close()
    saver = managers["async save every step (`async_save=True`)"]
    checkpoint = r.on_rank0(
        lambda: sum(p.stat().st_size for p in Path(str(saver.step_path(saver.latest_step() or 0))).iterdir())
    )
    return {
        "runs": out,
        "steps": steps,
        "blocks": blocks,
        "checkpoint_bytes": checkpoint,
        "parameters": sum(p.numel() for p in state["model"].parameters()),
    }


def timing_phases(r: Rank, mesh: Any, sizes: dict[str, int], root: Path, runs: int, save_runs: int) -> dict[str, Any]:
    """Phases 1 and 2 on the full MLP (freed on return)."""
    import torch

    layers, width, batch = sizes["layers"], sizes["width"], sizes["batch"]
    model, optim = build_mlp(layers, width, mesh)
    gen = torch.Generator().manual_seed(1 + r.rank)
    state = {"model": model, "optim": optim, "step": 0}

    def step() -> None:
        train_step(model, optim, batch, width, gen)

    step()
    step_times = []
    for _ in range(3):
        r.barrier()
        start = _now()
        step()
        step_times.append(_now() - start)
    results: dict[str, Any] = {
        "step_seconds": statistics.median(step_times),
        "param_bytes": sum(p.numel() * 4 for p in model.parameters()),
    }
    r.log(
        f"model: {layers} x Linear({width}, {width}), {results['param_bytes'] / 1e6:.0f} MB fp32 params; step "
        f"{results['step_seconds']:.2f} s"
    )
    savers = Savers(r, root)
    results["blocked"] = measure_blocked(r, state, step, savers, save_runs)
    results["window"] = measure_window(r, state, step, savers, runs, sizes["window"])
    savers.close()
    return results


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardsafe.cli.demo.worker import warm_imports

    warm_imports()
    dist.init_process_group("gloo")
    r = Rank()
    mesh = init_device_mesh("cpu", (r.world,))
    sizes = QUICK if args.quick else FULL
    root: Path = args.dir
    results: dict[str, Any] = {"sizes": sizes, "runs": args.runs}
    results.update(timing_phases(r, mesh, sizes, root / "timing", args.runs, args.save_runs))
    gc.collect()
    results["dedup"] = measure_dedup(
        r, sizes["layers"], sizes["width"], sizes["batch"], mesh, root / "dedup", args.runs
    )
    results["every_step"] = measure_every_step(r, mesh, root / "every", sizes["tiny_blocks"], sizes["tiny_steps"])
    per_rank = r.gather(results)
    if r.rank == 0:
        (root / "results.json").write_text(json.dumps(per_rank))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- report


def _slowest(per_rank: list[dict[str, Any]], path: list[str], index: int | None = None) -> dict[str, list[float]]:
    """Per method, per run: the largest value over ranks (``index`` picks one field of a run's record)."""
    tables = []
    for res in per_rank:
        node: Any = res
        for key in path:
            node = node[key]
        tables.append(node)
    out = {}
    for name in tables[0]:
        runs = zip(*(t[name] for t in tables))
        out[name] = [max(v if index is None else v[index] for v in run) for run in runs]
    return out


def _ratios(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest of the per-run ratios ours / theirs (runs paired by index)."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(ratios), min(ratios), max(ratios)


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    res = per_rank[0]
    med = statistics.median
    calls = _slowest(per_rank, ["blocked", "runs"], 0)
    frees = _slowest(per_rank, ["blocked", "runs"], 1)
    durables = _slowest(per_rank, ["blocked", "runs"], 2)
    call = {k: med(v) for k, v in calls.items()}
    blocked = {k: med(v) for k, v in frees.items()}
    committed = {k: med(v) for k, v in durables.items()}
    dcp_saves = [k for k in blocked if k.startswith("dcp")]
    best_dcp_blocked = min(dcp_saves, key=lambda k: blocked[k])
    best_dcp_durable = min(dcp_saves, key=lambda k: committed[k])
    vs = {  # per run, paired: shardsafe's time / the peer's time in the same run
        (ours, metric, peer): _ratios(table[ours], table[peer])
        for ours in ("shardsafe async", "shardsafe overlap")
        for metric, table in (("blocked", frees), ("durable", durables))
        for peer in {best_dcp_blocked, best_dcp_durable, TC_NAME}
    }
    windows = _slowest(per_rank, ["window", "runs"], 0)
    baselines = _slowest(per_rank, ["window", "runs"], 2)
    window = {"no checkpoint": med(x for v in baselines.values() for x in v), **{k: med(v) for k, v in windows.items()}}
    # every run, every rank
    finished = {k: min(run[1] for r in per_rank for run in r["window"]["runs"][k]) > 0 for k in windows}
    paired = {k: [w - n for w, n in zip(v, baselines[k])] for k, v in windows.items()}
    extra = {k: med(v) for k, v in paired.items()}  # each against the no-checkpoint window measured next to it
    dcp_modes = [k for k in extra if k.startswith("dcp")]
    best_dcp = min(dcp_modes, key=lambda k: extra[k])
    dd = res["dedup"]
    full_bytes = med(run[1] for run in dd["runs"]["full"])
    dedup_bytes = med(run[1] for run in dd["runs"]["dedup"])
    model_full_bytes = med(run[1] for run in dd["runs"]["model only full"])
    model_dedup_bytes = med(run[1] for run in dd["runs"]["model only dedup"])
    every = {k: med(v) for k, v in _slowest(per_rank, ["every_step", "runs"]).items()}
    steps = res["every_step"]["steps"]  # per block
    rates = {k: steps / v for k, v in every.items()}
    overhead = {k: rates["no checkpoint"] / v - 1 for k, v in rates.items() if k != "no checkpoint"}
    return {
        "call": call,
        "blocked": blocked,
        "committed": committed,
        "best_dcp_blocked": best_dcp_blocked,
        "best_dcp_durable": best_dcp_durable,
        "vs": vs,
        "copy_bytes": max(r["blocked"]["copy_bytes"] for r in per_rank),
        "state_bytes": sum(r["blocked"]["copy_bytes"] for r in per_rank),
        "tensors": res["blocked"]["tensors"],
        "window": window,
        "window_steps": res["window"]["window"],
        "finished": finished,
        "extra": extra,
        "extra_runs": paired,
        "best_dcp": best_dcp,
        "dedup_full_bytes": full_bytes,
        "dedup_bytes": dedup_bytes,
        "dedup_model_full_bytes": model_full_bytes,
        "dedup_model_bytes": model_dedup_bytes,
        "dedup_changed_bytes": dd["changed_bytes"],
        "dedup_full_seconds": med(
            max(r["dedup"]["runs"]["full"][i][0] for r in per_rank) for i in range(len(dd["runs"]["full"]))
        ),
        "dedup_seconds": med(
            max(r["dedup"]["runs"]["dedup"][i][0] for r in per_rank) for i in range(len(dd["runs"]["dedup"]))
        ),
        "dedup": dd,
        "every": every,
        "rates": rates,
        "overhead": overhead,
        "every_steps": steps,
        "every_blocks": res["every_step"]["blocks"],
        "every_checkpoint_bytes": res["every_step"]["checkpoint_bytes"],
        "tiny_parameters": res["every_step"]["parameters"],
        "step_seconds": max(r["step_seconds"] for r in per_rank),
        "param_bytes": res["param_bytes"],
        "sizes": res["sizes"],
        "runs": res["runs"],
        "runs_blocked": len(frees["memory copy"]),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 10e6 else f"{n / 1e6:,.1f} MB"


def _s(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if abs(seconds) < 10 else f"{seconds:,.1f} s"


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def _busy(load_before: str) -> str:
    """What the 1-minute load average before the run says about the machine (the shared VM has 2 cores)."""
    from common import was_busy

    if was_busy(load_before):
        return "**the machine was shared and noisy** (other jobs ran when the measurement started), so "
    return "quiet when the measurement started; the machine is shared, so "


def section(s: dict[str, Any], facts: dict[str, Any]) -> str:
    sizes = s["sizes"]
    copy = s["blocked"]["memory copy"]
    labels = {
        "memory copy": "plain `copy_` of the same local tensors into preallocated buffers (floor)",
        "shardsafe async": "shardsafe `CheckpointManager(async_save=True)`",
        "shardsafe overlap": 'shardsafe `CheckpointManager(async_save="overlap")` (copy runs during the next step)',
        "shardsafe sync": "shardsafe `CheckpointManager(async_save=False)`",
        "dcp async_save": "DCP `async_save` (plain thread mode: default staging in the call, fresh buffers)",
        "dcp async_save + DefaultStager": (
            "DCP `async_save` (thread) + `DefaultStager(StagingOptions(False, False, False, False))`, reused"
        ),
        "dcp async_save + DefaultStager(async staging)": (
            "DCP `async_save` (thread) + `DefaultStager(StagingOptions(False, False, True, False))`, reused "
            "(staging in a thread)"
        ),
        "dcp async_save(PROCESS) + DefaultStager(shm, async staging)": (
            "DCP `async_save(PROCESS)` + `DefaultStager(StagingOptions(False, True, True, False))`, reused "
            "(shared memory, staging in a thread: torchtitan's `async_with_pinned_mem` on CPU)"
        ),
        "dcp async_save(PROCESS) + DefaultStager(shm)": (
            "DCP `async_save(PROCESS)` + `DefaultStager(StagingOptions(False, True, False, False))`, reused "
            "(shared memory, staging in the call)"
        ),
        TC_NAME: (
            "torch-checkpointing 0.1.1 `CheckpointManager` async save (its defaults: shared memory, staging in a "
            "thread, a writer subprocess; fsync added, see the notes)"
        ),
        "no checkpoint": "no checkpoint",
    }
    state_bytes = s["state_bytes"]
    lines = [
        SECTION,
        "",
        f"`{facts['command']}` on {facts['when']} (UTC): {facts['machine']}; load average {facts['load_before']} "
        f"before, {facts['load_after']} after (the benchmark's own processes included): {_busy(facts['load_before'])}"
        "only ratios measured in the same runs are meaningful. 2 ranks (gloo, CPU, "
        "`torch.distributed.run --nproc_per_node 2`), "
        f"FSDP2, fsync on for every writer, `OMP_NUM_THREADS=1`. Model: {sizes['layers']} x Linear({sizes['width']}, "
        f"{sizes['width']}), {_mb(s['param_bytes'])} of fp32 parameters plus stepped AdamW state: {_mb(state_bytes)} "
        "of tensors "
        f"({_mb(s['copy_bytes'])}, {s['tensors']} tensors, on the slowest rank); one training step (batch "
        f"{sizes['batch']}) takes "
        f"{s['step_seconds']:.2f} s. Median of {s['runs_blocked']} runs per number in "
        f"the blocked/durable table, of {s['runs']} in the others (method order alternating, after a dropped "
        f"warm-up run), each the slowest rank's time. Total benchmark time {facts['elapsed']:.0f} s.",
        "",
        "**Training loop blocked per checkpoint, and time to a durable checkpoint.** Each save runs with nothing "
        "else going on: *call* is the save call; *blocked* is from the call until the state is free again (the "
        "snapshot taken: what a loop waits for before its next optimizer step; the same as the call where the call "
        "copies; for the modes that stage in a thread, DCP's `staging_completion`, torch-checkpointing's "
        "`manager.lock()`, shardsafe overlap's copy); *durable* is from the call until every file is written and "
        "fsynced and the checkpoint committed (DCP's `upload_completion`, torch-checkpointing's write future, "
        "shardsafe's `wait()`). DCP's default planner and writer (`FileSystemWriter`, `sync_files=True`), each "
        "peer's state dict from `get_state_dict` (inside the timed call, as in their recipes):",
        "",
        "| method | call | blocked | blocked vs memory copy | durable |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, seconds in s["blocked"].items():
        done = "" if name == "memory copy" else _s(s["committed"][name])
        call = "" if name == "memory copy" else _s(s["call"][name])
        lines.append(f"| {labels[name]} | {call} | {_s(seconds)} | {seconds / copy:.2f}x | {done} |")
    best_b, best_d = s["best_dcp_blocked"], s["best_dcp_durable"]

    def ratio(key: tuple[str, str, str]) -> str:
        mid, low, high = s["vs"][key]
        return f"{mid:.2f}x ({low:.2f}-{high:.2f})"

    def vs_dcp(mode: str, metric: str, peer: str, limit: float) -> str:
        """A target row: shardsafe ``mode``'s ``metric`` <= ``limit`` x the DCP mode ``peer``'s (median ratio)."""
        what = f"<= {limit}x DCP's best mode" if metric == "blocked" else "no later than DCP's fastest-durable mode"
        key = ("shardsafe " + mode, metric, peer)
        return f"| {mode} {metric} {what} | {ratio(key)} | {_verdict(s['vs'][key][0] <= limit)} |"

    short = {best_d: "DCP's fastest-durable mode", best_b: "DCP's best-blocked mode", TC_NAME: "torch-checkpointing"}
    if best_b == best_d:
        short[best_b] = "DCP's best mode (blocked and durable)"
    lines += [
        "",
        f"DCP's best mode for blocked time here (lowest median): `{best_b}`; for durable time: `{best_d}`. "
        "Ratios shardsafe / peer, each run paired with the peer's save in the same "
        f"run, median (lowest-highest) over the {s['runs_blocked']} runs:",
        "",
        "| shardsafe | vs | blocked | durable |",
        "|---|---|---:|---:|",
    ]
    floor = copy / s["blocked"][best_b]
    for ours in ("shardsafe async", "shardsafe overlap"):
        for peer in dict.fromkeys((best_b, best_d, TC_NAME)):
            lines.append(
                f"| {ours.removeprefix('shardsafe ')} | {short[peer]} | {ratio((ours, 'blocked', peer))} | "
                f"{ratio((ours, 'durable', peer))} |"
            )
    lines += [
        "",
        f"The plain memory copy of the same bytes alone takes {floor:.2f}x the blocked time of DCP's best mode here: "
        "any saver that copies the state before the loop may change it (all of these do) is blocked at least that "
        f"long, so blocked <= {TARGETS['blocked_vs_dcp']}x DCP's best is out of reach for a copying snapshot of CPU "
        "tensors on this machine. shardsafe's blocked time is the copy plus its describe-and-agree step.",
    ]
    w = s["window_steps"]
    lines += [
        "",
        f"**Time the loop loses per checkpoint**: a save call plus the next {w} training steps, minus {w} steps "
        "without a save "
        "measured right next to it (before or after, alternating); median of these paired differences, each round's "
        "listed. "
        "The background write shares the 2 cores with training here (on a GPU node it would mostly not), and the "
        "spread "
        "between rounds is of the order of the differences:",
        "",
        f"| method | call + {w} steps | extra | extra per round | background save finished within the window |",
        "|---|---:|---:|---:|---|",
    ]
    for name, seconds in s["window"].items():
        extra = "" if name == "no checkpoint" else _s(s["extra"][name])
        rounds = "" if name == "no checkpoint" else ", ".join(_s(x) for x in s["extra_runs"][name])
        done = "" if name == "no checkpoint" else ("yes" if s["finished"][name] else "not in every run")
        lines.append(f"| {labels[name]} | {_s(seconds)} | {extra} | {rounds} | {done} |")
    dd = s["dedup"]
    lines += [
        "",
        f"**Dedup** (same MLP, {dd['frozen_layers']} of {sizes['layers']} layers frozen = "
        f"{1 - dd['trainable_param_bytes'] / dd['param_bytes']:.0%} of the parameters; AdamW over the rest; one "
        "training step "
        "between saves):",
        "",
        "| save | bytes written | vs full | save time |",
        "|---|---:|---:|---:|",
        f"| full (`dedup=False`) | {_mb(s['dedup_full_bytes'])} | 100% | {_s(s['dedup_full_seconds'])} |",
        f"| `dedup=True`, after one training step | {_mb(s['dedup_bytes'])} | "
        f"{s['dedup_bytes'] / s['dedup_full_bytes']:.1%} | "
        f"{_s(s['dedup_seconds'])} |",
        "| what changed: trainable parameters + their 2 AdamW moments (the floor for any writer) | "
        f"{_mb(s['dedup_changed_bytes'])} | "
        f"{s['dedup_changed_bytes'] / s['dedup_full_bytes']:.1%} | |",
        f"| model only (no optimizer state), full | {_mb(s['dedup_model_full_bytes'])} | 100% | |",
        f"| model only, `dedup=True` after one training step | {_mb(s['dedup_model_bytes'])} | "
        f"{s['dedup_model_bytes'] / s['dedup_model_full_bytes']:.1%} | |",
        "",
        f"**A checkpoint every step** on the demo model (TinyGPT, {s['tiny_parameters'] / 1e6:.2f} M parameters, "
        f"{_mb(s['every_checkpoint_bytes'])} per checkpoint, the demo's training step; `keep_last=2`). The variants "
        "take turns in "
        f"blocks of {s['every_steps']} steps ({s['every_blocks']} blocks each after a warm-up round, order "
        "alternating); a block "
        "includes waiting for its last save to commit; median block time:",
        "",
        "| run | steps/s | cost vs no checkpoint |",
        "|---|---:|---:|",
    ]
    for name, rate in s["rates"].items():
        cost = "" if name == "no checkpoint" else f"{s['overhead'][name]:+.1%}"
        lines.append(f"| {name} | {rate:.2f} | {cost} |")
    ss_blocked = s["blocked"]["shardsafe async"] / copy
    overlap_extra, dcp_extra = s["extra"]["shardsafe overlap"], s["extra"][s["best_dcp"]]
    dedup_fraction = s["dedup_bytes"] / s["dedup_full_bytes"]
    every_key = "async save every step (`async_save=True`)"
    every_cost = s["overhead"][every_key]
    lines += [
        "",
        "**Targets**:",
        "",
        "| target | measured | |",
        "|---|---|---|",
        *(vs_dcp(mode, "blocked", best_b, TARGETS["blocked_vs_dcp"]) for mode in ("async", "overlap")),
        *(vs_dcp(mode, "durable", best_d, 1.0) for mode in ("async", "overlap")),
        f"| async blocked time <= {TARGETS['blocked_vs_copy']}x the memory copy | "
        f"{_s(s['blocked']['shardsafe async'])} vs "
        f"{_s(copy)}: {ss_blocked:.2f}x | {_verdict(ss_blocked <= TARGETS['blocked_vs_copy'])} |",
        f'| overlap-mode extra time <= DCP\'s best async mode ("{s["best_dcp"]}") | '
        f"{_s(overlap_extra)} vs "
        f"{_s(dcp_extra)}: {overlap_extra / dcp_extra:.2f}x | {_verdict(overlap_extra <= dcp_extra)} |"
        if dcp_extra > 0
        else f"| overlap-mode extra time <= DCP's best async mode | {_s(overlap_extra)} vs {_s(dcp_extra)} | "
        f"{_verdict(overlap_extra <= dcp_extra)} |",
        f"| dedup second save <= {TARGETS['dedup_fraction']:.0%} of a full save's bytes | {dedup_fraction:.1%} (floor: "
        f"{s['dedup_changed_bytes'] / s['dedup_full_bytes']:.1%}) | "
        f"{_verdict(dedup_fraction <= TARGETS['dedup_fraction'])} |",
        f"| a checkpoint every step costs <= {TARGETS['every_step_overhead']:.0%} of throughput (demo model) | "
        f"{every_cost:+.1%} "
        f"({s['rates'][every_key]:.2f} vs {s['rates']['no checkpoint']:.2f} steps/s) | "
        f"{_verdict(every_cost <= TARGETS['every_step_overhead'])} |",
        "",
        "**Notes.**",
        "",
        "- Blocked time is the time until the snapshot is taken, also for the modes whose call returns earlier "
        "(DCP and torch-checkpointing staging in a thread, shardsafe overlap): with nothing to overlap here, a loop "
        "that changes the state next waits that long. How much of it hides behind the next forward and backward "
        "is the loop-time table's matter; on this CPU-only machine the copy competes with training for the cores.",
        "- Pinned memory: `DefaultStager`'s `use_pinned_memory` and `use_non_blocking_copy` need CUDA; on this "
        "CPU-only machine the first is ignored with a warning and the second refuses to run, so both are off (torch-"
        "checkpointing turns both off by itself without CUDA). With CPU tensors there is no device-to-host copy "
        "for pinning to speed up; shared memory (`use_shared_memory=True`) is what the process modes use to hand "
        "the staged state to their writer process.",
        "- DCP's process mode spawns one checkpoint daemon per rank at its first save (in the dropped warm-up run), "
        "with a gloo group of its own; each save pickles the staged state's shared-memory handles through a pipe.",
        "- torch-checkpointing fsyncs nothing (files, folders or its commit rename). For a durable time the benchmark "
        "gives it a `pre_finalize_callback` that fsyncs every file and folder it wrote and a `finalize_callback` "
        "that fsyncs the parent of its renamed folder, run in its writer subprocess, so its durable time includes "
        "them. Its default O_DIRECT writes fail on this ext4 (EINVAL on the unaligned writes of its `torch.save` "
        "layout), so it writes buffered (`use_direct_io=False`).",
        "- DCP fsyncs its data files and `.metadata` (`sync_files=True`) but not the checkpoint folder; shardsafe "
        "fsyncs its files and folders before it publishes.",
        f"- Dedup: with {1 - dd['trainable_param_bytes'] / dd['param_bytes']:.0%} of the parameters frozen, a quarter "
        "of a model + "
        "AdamW checkpoint still changes every step: the trainable parameters and their two moments (10% + 20% of the "
        "parameter "
        "bytes, against 100% + 20% for the whole state). The dedup save writes exactly that and references the rest, "
        "so the 15% "
        "target is below what any writer can reach for this state; for the model alone the second save is "
        f"{s['dedup_model_bytes'] / s['dedup_model_full_bytes']:.1%} of a full one.",
        "- A checkpoint every step: a demo-model step takes "
        f"{1 / s['rates']['no checkpoint'] * 1000:.0f} ms here, and one save costs about as much CPU as a step. In the "
        "call, most of the "
        "blocked time is describing the state's 116 tensors through torch's state-dict helpers (copying its 2.7 MB per "
        "rank takes "
        "~1 ms); in the background thread, profiled separately with cProfile on this machine, a save takes ~0.1-0.2 s "
        "of CPU "
        "(the manifest's JSON encoding, five fsyncs, the commit's collectives, retention), which competes with "
        "training for the "
        "2 cores and for the GIL. Meeting 5% would need the whole per-save cost under a twentieth of a step. The "
        "preemption "
        "check is one `all_gather_object` per step (~2 ms here in a separate microbenchmark, ~0.5 ms as a tensor "
        "`all_reduce`); its row is within the noise.",
        "- Retention used to parse every kept checkpoint's manifest after every save, in the background thread, "
        "holding the "
        "GIL; the manager now keeps parsed manifests while the file is unchanged (`_ManifestCache` in `manager.py`). "
        "A/B on the "
        "demo model with a save every step, `keep_last=3, keep_best=1` (one process pair, 8 alternating blocks of 8 "
        "steps each, "
        "load average ~6, 2026-11-29): median 3.66 s per block with the cache, 7.35 s without, 2.19 s without "
        "checkpoints.",
        "- On this CPU-only machine training itself keeps both cores busy, so every background copy, hash and write is "
        "paid "
        "for by the training loop; DCP's background threads are in the same position. The blocked-time table is the "
        "part "
        "that carries over to GPU nodes, where the host CPU is mostly idle during a step.",
        "",
    ]
    return "\n".join(lines)


def _tree() -> str:
    """The commit measured, and the files under src/ that differed from it (others edit the same checkout)."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "diff", "--name-only", "HEAD", "--", "src"], capture_output=True, text=True)
    files = changed.stdout.split()
    return f"{head}" + (f" with uncommitted changes to {', '.join(files)}" if files else "")


def render(kept: Path, md: Path | None) -> int:
    """Print the section (and write it into ``md``) from a kept run's ``results.json`` and ``facts.json``."""
    from common import write_section

    per_rank = json.loads((kept / "results.json").read_text())
    text = section(summarize(per_rank), json.loads((kept / "facts.json").read_text()))
    print(text)
    if md is not None:
        write_section(md, SECTION, text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: a small model, 1 run, BENCHMARKS.md untouched unless --md"
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="runs per loop-time and dedup measurement (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--save-runs",
        type=int,
        default=None,
        help="runs of the blocked/durable phase (default 6; 1 with --quick)",
    )
    parser.add_argument(
        "--dir", type=Path, default=REPO / "bench-run" / "manager", help="scratch folder, removed before and after"
    )
    parser.add_argument(
        "--md",
        type=Path,
        default=None,
        help="results file to write the section into (default BENCHMARKS.md; none with --quick)",
    )
    parser.add_argument("--keep", action="store_true", help="keep --dir (and results.json in it) afterwards")
    parser.add_argument(
        "--render", type=Path, default=None, help="write the section again from the results.json/facts.json kept there"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    args.save_runs = args.save_runs or (1 if args.quick else 6)
    args.dir = args.dir.absolute()
    if args.worker:
        worker(args)
        return 0

    md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
    if args.render is not None:
        return render(args.render, md)
    exe = Path(sys.executable)
    shown = exe.relative_to(REPO) if exe.is_relative_to(REPO) else Path(exe.name)
    command = shlex.join([str(shown), "benchmarks/bench_manager.py", *sys.argv[1:]])
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    import datetime

    import torch

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    from common import load_average

    load_before = load_average()
    started = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    passthrough = [
        "--dir",
        str(args.dir),
        "--runs",
        str(args.runs),
        "--save-runs",
        str(args.save_runs),
        *(["--quick"] if args.quick else []),
    ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    subprocess.run([*launcher, __file__, "--worker", *passthrough], check=True, env=env, cwd=REPO)
    per_rank = json.loads((args.dir / "results.json").read_text())
    facts = {
        "command": command,
        "when": when,
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, shardsafe at {_tree()}",
        "load_before": load_before,
        "load_after": load_average(),
        "elapsed": time.perf_counter() - started,
    }
    (args.dir / "facts.json").write_text(json.dumps(facts))  # with results.json: what --render rewrites it from
    text = section(summarize(per_rank), facts)
    print(text)
    if md is not None:
        from common import write_section

        write_section(md, SECTION, text)
        print(f"wrote the {SECTION!r} section of {md}")
    if not args.keep:
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
