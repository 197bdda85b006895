"""GPU benchmark: `python benchmarks/bench_gpu.py [--quick] [--md BENCHMARKS.md] [--root DIR]` (`make bench-gpu`).

Needs a CUDA GPU: on a machine without one it stops at once with a message saying so. One process,
FSDP2 over a world of 1 (nccl; gloo where nccl is missing), an MLP of 32 x Linear(4096, 4096)
(537 M fp32 parameters, 2.15 GB; 6.4 GB with AdamW's two moments), all on the GPU, fsync on:

1. **Blocked time per checkpoint**: how long the training loop waits in the save call, and how much
   longer the call plus the next training step take than a training step alone (``loop loss``:
   for ``"overlap"`` and DCP's async staging the copy runs during that step and the optimizer
   waits for it), for shardsafe ``CheckpointManager(async_save=True)`` and ``"overlap"``, DCP
   ``async_save`` as is and with a reused ``DefaultStager`` (pinned memory, async staging,
   non-blocking copies), and the floor: a plain ``copy_(non_blocking=True)`` of the same local
   tensors into preallocated pinned buffers, then a synchronize.
2. **Save and load** (synchronous): ``shardsafe.save``/``load`` vs ``dcp.save``/``dcp.load`` (with
   ``get_state_dict``/``set_state_dict``) of the whole state, the files evicted from the page cache
   before each load.
3. **A checkpoint every step, dedup**: the same MLP with 90% of its layers frozen (a fine-tune);
   steps per second without checkpointing vs a manager with ``dedup=True`` saving every step
   (``async_save=True`` and ``"overlap"``), taking turns in blocks; target: at most 5% fewer steps/s.
   Also the bytes a dedup save writes vs a full one.

Pinned host memory is read from shardsafe's pool (``shardsafe.storage.pinned.pinned_pool().stats()``)
and torch's host allocator before and after, to show nothing is pinned per save. Medians over runs;
the method order alternates from run to run. ``--quick`` is a small smoke test (a 4 x 1024 MLP) that
leaves BENCHMARKS.md alone unless ``--md`` is given; otherwise the "## GPU" section is written.
Sized to finish in under 8 minutes on one H200 (most of it disk writes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

SECTION = "## GPU"
FULL = {
    "layers": 32,
    "width": 4096,
    "batch": 8192,
    "runs": 3,
    "io_runs": 2,
    "ft_batch": 32768,
    "ft_steps": 12,
    "ft_blocks": 3,
}
QUICK = {
    "layers": 4,
    "width": 1024,
    "batch": 512,
    "runs": 1,
    "io_runs": 1,
    "ft_batch": 512,
    "ft_steps": 3,
    "ft_blocks": 1,
}
FROZEN = 0.9  # fraction of the layers frozen in the every-step measurement
TARGET_EVERY_STEP = 0.05  # at most 5% fewer steps per second with a dedup save every step


def require_cuda() -> None:
    """Stop with a clear message where there is no GPU (the dev/CI machines run the CPU build of torch)."""
    if not torch.cuda.is_available():
        raise SystemExit(
            f"bench_gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). "
            "Run `make bench-gpu` on a machine with an NVIDIA GPU and a CUDA build of torch; "
            "the CPU benchmarks are `make bench`."
        )


def now() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def init_world() -> str:
    """A process group of one (FSDP2 needs one): nccl when this torch has it, else gloo."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(
        backend, rank=0, world_size=1, device_id=torch.device("cuda", 0) if backend == "nccl" else None
    )
    return backend


def build(layers: int, width: int, frozen: int = 0, seed: int = 1234) -> tuple[Any, Any]:
    """FSDP2 MLP on the GPU (each layer, then the root, over a mesh of one); AdamW over the trainable parameters."""
    from common import build_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,))
    model = build_model(layers, width, device="meta")
    for i, layer in enumerate(model):
        if i < frozen:
            layer.requires_grad_(False)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=gen)  # type: ignore[attr-defined]
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.01)
    return model, optim


def train_step(model: Any, optim: Any, batch: int, width: int) -> None:
    model(torch.randn(batch, width, device="cuda")).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def local_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Exactly the local tensors a shardsafe save of ``state`` copies (its chunks)."""
    from shardsafe.state.registry import describe_for_save

    return [c.tensor.detach() for c in describe_for_save(state, 0).chunks]


def pinned_now() -> dict[str, int]:
    """Pinned host memory right now: shardsafe's pool, and torch's host allocator (blocks it has created)."""
    from shardsafe.storage.pinned import pinned_pool

    stats = pinned_pool().stats()
    host = getattr(torch.cuda, "host_memory_stats", None)
    host_stats = host() if host is not None else {}
    return {
        "pool_buffers": stats.allocated,
        "pool_bytes": stats.allocated_bytes,
        "pool_overflows": stats.overflows,
        "torch_host_allocs": int(host_stats.get("num_host_alloc", -1)),
        "torch_host_bytes": int(host_stats.get("allocated_bytes.current", -1)),
    }


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- 1. blocked time


def dcp_stagers() -> dict[str, Any]:
    """DCP's stagers to compare with: None (async_save as is) and a reused pinned, async, non-blocking DefaultStager."""
    out: dict[str, Any] = {"dcp async_save": None}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # an older torch: only async_save as is
        return out
    out["dcp async_save + DefaultStager(pinned, async, non-blocking)"] = DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
        )
    )
    return out


def dcp_async(state: dict[str, Any], path: Path, stager: Any, group: Any) -> tuple[Any, Any]:
    """The DCP recipe: get_state_dict, then async_save; returns (staging future or None, upload future)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state["model"], state["optim"])
    kwargs = {"async_stager": stager} if stager is not None else {}
    result = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=group, **kwargs)
    staging = getattr(result, "staging_completion", None)
    upload = getattr(result, "upload_completion", result)
    return staging, upload


def measure_blocked(state: dict[str, Any], step: Callable[[], None], root: Path, runs: int) -> dict[str, Any]:
    """Per method and run: seconds blocked in the call, and seconds of call + next step minus a step alone."""
    import torch.distributed as dist

    import shardsafe

    sources = local_tensors(state)
    pinned = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in sources]
    pending: list[Any] = []  # DCP staging futures the next optimizer step waits for (as it must)
    hook = state["optim"].register_step_pre_hook(lambda *a, **k: [pending.pop().result() for _ in list(pending)])
    managers = {
        "shardsafe async": shardsafe.CheckpointManager(root / "ss-async", async_save=True),
        "shardsafe overlap": shardsafe.CheckpointManager(root / "ss-overlap", async_save="overlap"),
    }
    stagers = dcp_stagers()
    dcp_group = dist.new_group(backend="gloo")
    counter = [0]

    def plain_copy() -> Callable[[], None]:
        with torch.no_grad():
            for b, s in zip(pinned, sources):
                b.copy_(s, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return lambda: None

    def shardsafe_save(name: str) -> Callable[[], Callable[[], None]]:
        manager = managers[name]

        def call() -> Callable[[], None]:
            counter[0] += 1
            n = counter[0]
            manager.save(n, state, force=True)

            def finish() -> None:
                manager.wait()
                remove(Path(str(manager.step_path(n))))

            return finish

        return call

    def dcp_save(stager: Any) -> Callable[[], Callable[[], None]]:
        def call() -> Callable[[], None]:
            counter[0] += 1
            path = root / f"dcp-{counter[0]}"
            staging, upload = dcp_async(state, path, stager, dcp_group)
            if staging is not None:
                pending.append(staging)

            def finish() -> None:
                if staging is not None:
                    staging.result()
                upload.result()
                remove(path)

            return finish

        return call

    methods: dict[str, Callable[[], Callable[[], None]]] = {"pinned copy_(non_blocking) (floor)": plain_copy}
    methods.update({name: shardsafe_save(name) for name in managers})
    methods.update({name: dcp_save(stager) for name, stager in stagers.items()})
    out: dict[str, dict[str, list[float]]] = {name: {"blocked": [], "loop_loss": [], "commit": []} for name in methods}
    order = list(methods)
    for run in range(runs + 1):  # run 0 warms every path up (first-call costs, buffers) and is dropped
        for name in order if run % 2 == 0 else order[::-1]:
            torch.cuda.synchronize()
            start = now()
            step()
            torch.cuda.synchronize()
            alone = now() - start
            start = now()
            finish = methods[name]()
            blocked = now() - start
            step()
            torch.cuda.synchronize()
            with_save = now() - start
            finish()
            committed = now() - start
            if run:
                out[name]["blocked"].append(blocked)
                out[name]["loop_loss"].append(with_save - alone)
                out[name]["commit"].append(committed)
        log(f"blocked time: run {run}/{runs}")
    hook.remove()
    for manager in managers.values():
        manager.close()
    for stager in stagers.values():
        if stager is not None:
            stager.close()
    return {"runs": out, "bytes": sum(s.numel() * s.element_size() for s in sources), "tensors": len(sources)}


# ----------------------------------------------------------------------------- 2. save / load


def measure_io(state: dict[str, Any], root: Path, runs: int) -> dict[str, list[float]]:
    """Synchronous save and (cold-cache) load seconds: shardsafe vs DCP."""
    import torch.distributed.checkpoint as dcp
    from common import drop_file_cache
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardsafe

    out: dict[str, list[float]] = {k: [] for k in ("shardsafe save", "shardsafe load", "dcp save", "dcp load")}
    for run in range(runs):
        for which in ("shardsafe", "dcp") if run % 2 == 0 else ("dcp", "shardsafe"):
            path = root / f"io-{which}-{run}"
            torch.cuda.synchronize()
            start = now()
            if which == "shardsafe":
                shardsafe.save(path, state)
            else:
                msd, osd = get_state_dict(state["model"], state["optim"])
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            torch.cuda.synchronize()
            out[f"{which} save"].append(now() - start)
            drop_file_cache(path)
            start = now()
            if which == "shardsafe":
                shardsafe.load(path, state)
            else:
                msd, osd = get_state_dict(state["model"], state["optim"])
                loaded = {"model": msd, "optim": osd}
                dcp.load(loaded, checkpoint_id=path)
                set_state_dict(
                    state["model"], state["optim"], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
                )
            torch.cuda.synchronize()
            out[f"{which} load"].append(now() - start)
            remove(path)
        log(f"save/load: run {run + 1}/{runs}")
    return out


# ----------------------------------------------------------------------------- 3. every step, dedup


def measure_every_step(cfg: dict[str, int], root: Path) -> dict[str, Any]:
    """Steps/s of a 90%-frozen fine-tune without checkpoints vs with a dedup save every step."""
    from common import folder_bytes

    import shardsafe

    layers, width, batch = cfg["layers"], cfg["width"], cfg["ft_batch"]
    model, optim = build(layers, width, frozen=round(layers * FROZEN), seed=99)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    for _ in range(2):
        train_step(model, optim, batch, width)
    managers = {
        mode: shardsafe.CheckpointManager(root / f"ft-{mode}", async_save=value, dedup=True, keep_last=2)
        for mode, value in (("async", True), ("overlap", "overlap"))
    }
    steps = [0]

    def block(manager: Any) -> float:
        torch.cuda.synchronize()
        start = now()
        for _ in range(cfg["ft_steps"]):
            train_step(model, optim, batch, width)
            steps[0] += 1
            state["step"] = steps[0]
            if manager is not None:
                manager.save(steps[0], state)  # every call saves: no save_every
        torch.cuda.synchronize()
        rate = cfg["ft_steps"] / (now() - start)
        if manager is not None:
            manager.wait()  # not timed: the next block starts with no save in flight
        return rate

    for manager in managers.values():  # warm-up: first (full) save, buffers, threads
        block(manager)
    block(None)
    pinned_before = pinned_now()
    rates: dict[str, list[float]] = {"none": [], **{m: [] for m in managers}}
    names = ["none", *managers]
    for b in range(cfg["ft_blocks"]):
        for name in names if b % 2 == 0 else names[::-1]:
            rates[name].append(block(managers.get(name)))
        log(f"every step: block {b + 1}/{cfg['ft_blocks']}")
    pinned_after = pinned_now()
    manager = managers["async"]
    latest = manager.latest_step()
    written = {}
    if latest is not None:
        written["dedup_save_bytes"] = folder_bytes(Path(str(manager.step_path(latest))))
    full_path = root / "ft-full"
    shardsafe.save(full_path, state)
    written["full_save_bytes"] = folder_bytes(full_path)
    remove(full_path)
    for m in managers.values():
        m.close()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    saves = sum(len(v) for k, v in rates.items() if k != "none") * cfg["ft_steps"]
    return {
        "rates": rates,
        "trainable_fraction": trainable / total,
        "saves": saves,
        "pinned_before": pinned_before,
        "pinned_after": pinned_after,
        **written,
    }


# ----------------------------------------------------------------------------- report


def measure_full_state(cfg: dict[str, int], root: Path) -> dict[str, Any]:
    """Phases 1 and 2, on the full model with AdamW state (freed when this returns)."""
    model, optim = build(cfg["layers"], cfg["width"])
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}

    def step() -> None:
        train_step(model, optim, cfg["batch"], cfg["width"])

    for _ in range(2):  # AdamW state exists from here on
        step()
    log(f"model built: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
    return {"blocked": measure_blocked(state, step, root, cfg["runs"]), "io": measure_io(state, root, cfg["io_runs"])}


def report(result: dict[str, Any], quick: bool) -> str:
    cfg = result["config"]
    gb = 1e9
    lines = [
        SECTION,
        "",
        f"{result['device']}, torch {result['torch']} (CUDA {result['cuda']}), FSDP2 over a world of 1 "
        f"({result['backend']}), "
        f"MLP {cfg['layers']} x Linear({cfg['width']}, {cfg['width']}), batch {cfg['batch']} (fine-tune: "
        f"{cfg['ft_batch']}), fsync on. "
        f"Medians of {cfg['runs']} runs{' (--quick)' if quick else ''}; {time.strftime('%Y-%m-%d')}.",
        "",
        f"**Blocked time per checkpoint** ({result['blocked']['tensors']} local tensors, "
        f"{result['blocked']['bytes'] / gb:.2f} GB: "
        "parameters and AdamW state). *Loop loss*: save call + next training step, minus a training step alone.",
        "",
        "| method | blocked in the call (s) | loop loss (s) | until committed (s) |",
        "|---|---:|---:|---:|",
    ]
    for name, runs in result["blocked"]["runs"].items():
        lines.append(
            f"| {name} | {median(runs['blocked']):.3f} | {median(runs['loop_loss']):.3f} | "
            f"{median(runs['commit']):.2f} |"
        )
    io = result["io"]
    size = result["blocked"]["bytes"] / gb
    lines += [
        "",
        f"**Save and load** of the whole state ({size:.2f} GB), synchronous; page cache dropped before each load.",
        "",
        "| | shardsafe (s) | DCP (s) | shardsafe GB/s |",
        "|---|---:|---:|---:|",
    ]
    for op in ("save", "load"):
        s, d = median(io[f"shardsafe {op}"]), median(io[f"dcp {op}"])
        lines.append(f"| {op} | {s:.2f} | {d:.2f} | {size / s:.2f} |")
    every = result["every_step"]
    base = median(every["rates"]["none"])
    lines += [
        "",
        f"**A dedup checkpoint every step**: the same MLP, {1 - every['trainable_fraction']:.0%} of its parameters "
        "frozen "
        f"(target: at most {TARGET_EVERY_STEP:.0%} fewer steps/s).",
        "",
        "| | steps/s | fewer steps/s | target met |",
        "|---|---:|---:|:---:|",
        f"| no checkpoints | {base:.2f} | | |",
    ]
    for mode in ("async", "overlap"):
        rate = median(every["rates"][mode])
        loss = 1 - rate / base
        shown = "True" if mode == "async" else "'overlap'"
        met = "yes" if loss <= TARGET_EVERY_STEP else "no"
        lines.append(f"| dedup save every step, async_save={shown} | {rate:.2f} | {loss:.1%} | {met} |")
    if "dedup_save_bytes" in every:
        lines += [
            "",
            f"A dedup save writes {every['dedup_save_bytes'] / gb:.3f} GB, a full save "
            f"{every['full_save_bytes'] / gb:.3f} GB.",
        ]
    before, after, end = every["pinned_before"], every["pinned_after"], result["pinned_end"]
    lines += [
        "",
        f"**Pinned host memory**: over the {every['saves']} timed every-step saves, torch's host allocator created "
        f"{after['torch_host_allocs'] - before['torch_host_allocs']} pinned blocks and shardsafe's pool went from "
        f"{before['pool_buffers']} to {after['pool_buffers']} buffers (async staging buffers are allocated at a "
        "manager's first save). "
        f"After everything above the pool holds {end['pool_buffers']} buffers ({end['pool_bytes'] / 2**20:.0f} MiB "
        "pinned), "
        f"{end['pool_overflows']} overflows.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke test; BENCHMARKS.md untouched unless --md")
    parser.add_argument(
        "--md",
        type=Path,
        default=None,
        help="the file to write the GPU section into (default: BENCHMARKS.md unless --quick)",
    )
    parser.add_argument(
        "--root", type=Path, default=None, help="where checkpoints are written (default: a temporary folder)"
    )
    args = parser.parse_args()
    require_cuda()
    cfg = dict(QUICK if args.quick else FULL)
    backend = init_world()
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.root))
    try:
        started = now()
        result: dict[str, Any] = {
            "config": cfg,
            "backend": backend,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
        result.update(measure_full_state(cfg, root))
        gc.collect()
        torch.cuda.empty_cache()  # the full model is gone: room for the fine-tune's
        result["every_step"] = measure_every_step(cfg, root)
        result["pinned_end"] = pinned_now()
        result["seconds"] = now() - started
        print(json.dumps(result, indent=1, default=str))
        text = report(result, args.quick)
        print(text)
        md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
        if md is not None:
            from common import write_section

            write_section(md, SECTION, text)
            log(f"wrote the {SECTION[3:]} section of {md}")
        log(f"done in {result['seconds']:.0f} s")
    finally:
        remove(root)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
