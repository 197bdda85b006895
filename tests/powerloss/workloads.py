"""What runs on the recording file system: real shardsafe saves, a manager, exports, and the anchors.

Run as a program by the harness, one workload per process (so a hung FUSE call can be killed
with it)::

    python tests/powerloss/workloads.py NAME MOUNT WORKDIR [ARG]

Multi-rank workloads start their ranks with ``dist_utils.launch`` (gloo, FSDP2 on CPU). Every
file the code under test writes is under ``MOUNT``; the ranks' logs, results and the gloo store
stay in ``WORKDIR``. A workload tells the harness what happened by *markers* (``marker``), which
``fusefs`` logs in the operation order: ``begin:X`` before an operation, ``done:X`` once it
returned, ``point:NAME@RANK`` at each named crash point reached (``core/faults.py``, observed by
wrapping ``crash_point`` where it is imported; the point still does what the environment says),
and ``sync`` where everything before it is to count as written back long ago.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORLD = 2
KEEP_LAST = 2
MARKER_PREFIX = ".powerloss-"
CRASH_POINT_MODULES = (
    "shardsafe.api.save",
    "shardsafe.protocol.commit",
    "shardsafe.protocol.temppath",
    "shardsafe.storage.safetensors",
    "shardsafe.manager.manager",
    "shardsafe.manager.retention",
    "shardsafe.hf.push_fsspec",
)


def marker(mount: str, text: str) -> None:
    """Log ``text`` at this point of the operation order (a lookup the file system answers ENOENT)."""
    try:
        os.stat(os.path.join(mount, MARKER_PREFIX + quote(text, safe="")))
    except FileNotFoundError:
        pass


def watch_crash_points(mount: str) -> None:
    """Log a marker at every named crash point this process reaches (then run the point as usual)."""
    import importlib

    from shardsafe.core import faults

    original = faults.crash_point

    def point(name: str, rank: int) -> None:
        marker(mount, f"point:{name}@{rank}")
        original(name, rank)

    for module in CRASH_POINT_MODULES:
        mod = importlib.import_module(module)
        if getattr(mod, "crash_point", None) is original:
            mod.crash_point = point  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- shardsafe.save


def save_versions() -> list[tuple[str, str, bool]]:
    """(folder, version, overwrite) in the order the save workload writes them."""
    return [("run/a", "A", False), ("run/a", "B", True), ("run/c", "C", False)]


def _save_rank(rank: int, world_size: int, mount: str) -> str:
    import torch.distributed as dist

    import shardsafe
    from dist_utils import make_model, seeded_values, set_model_values, shard
    from powerloss.checks import version_state

    watch_crash_points(mount)
    model = shard(make_model(0), world_size)
    for folder, version, overwrite in save_versions():
        set_model_values(model, seeded_values(model, version, 0))
        if rank == 0:
            marker(mount, f"begin:{folder}:{version}")
        shardsafe.save(os.path.join(mount, folder), version_state(model, version), overwrite=overwrite)
        dist.barrier()
        if rank == 0:
            marker(mount, f"done:{folder}:{version}")
    return "ok"


# ----------------------------------------------------------------------------- CheckpointManager


def manager_options(variant: str) -> dict[str, Any]:
    return {
        "sync": {},
        "dedup": {"dedup": True},
        "async": {"async_save": True},
        "async-dedup": {"async_save": True, "dedup": True},
    }[variant]


def _manager_session(rank: int, world_size: int, mount: str, variant: str, steps: list[int], resume: bool) -> str:
    import torch.distributed as dist

    import shardsafe
    from dist_utils import make_model, set_model_values, shard
    from fault_utils import step_state, step_values

    watch_crash_points(mount)
    frozen = "dedup" in variant
    root = os.path.join(mount, "run")
    model = shard(make_model(0), world_size)
    options = manager_options(variant)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=KEEP_LAST, **options) as manager:
        if resume:
            state = step_state(model, 0)
            state["meta"] = None
            restored = manager.restore(state)
            if rank == 0:
                marker(mount, f"restored:{restored}")
        for step in steps:
            set_model_values(model, step_values(model, step, frozen))
            if rank == 0:
                marker(mount, f"begin:{step}")
            manager.save(step, step_state(model, step))
            if not manager.async_save or step % 2 == 0 or step == steps[-1]:
                manager.wait()
                dist.barrier()
                if rank == 0:
                    for done in steps[: steps.index(step) + 1]:
                        marker(mount, f"done:{done}")
        if resume:
            dist.barrier()
            if rank == 0:
                marker(mount, "begin:gc")
                shardsafe.collect_garbage(root)
                marker(mount, "done:gc")
            dist.barrier()
    return "ok"


# ----------------------------------------------------------------------------- exports, push, convert


def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _exports(mount: str) -> None:
    import shardsafe

    watch_crash_points(mount)
    model = tiny_gpt2()
    run = os.path.join(mount, "run")
    steps = [
        ("ckpt", lambda: shardsafe.save(os.path.join(run, "ckpt"), {"model": model})),
        (
            "hf",
            lambda: shardsafe.export_hf(
                os.path.join(run, "ckpt"), os.path.join(run, "hf"), config=model.config, progress=False
            ),
        ),
        (
            "pushed",
            lambda: shardsafe.push(os.path.join(run, "hf"), "file://" + os.path.join(run, "pushed"), progress=False),
        ),
        ("dcp", lambda: shardsafe.export_dcp(os.path.join(run, "ckpt"), os.path.join(run, "dcp"))),
        ("fromdcp", lambda: shardsafe.convert_dcp(os.path.join(run, "dcp"), os.path.join(run, "fromdcp"))),
    ]
    for name, action in steps:
        marker(mount, f"begin:{name}")
        action()
        marker(mount, f"done:{name}")


# ----------------------------------------------------------------------------- anchors


def dcp_state(version: str) -> dict[str, Any]:
    import zlib

    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(version.encode()))
    return {
        "model": {"w": torch.randn(96, 64, generator=gen), "b": torch.randn(300, generator=gen)},
        "step": torch.tensor(ord(version)),
    }


DCP_VERSIONS = ("A", "B", "C")


def _dcp(mount: str) -> None:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(mount, "dcp", "ckpt")
    for i, version in enumerate(DCP_VERSIONS):
        marker(mount, f"begin:{version}")
        dcp.save(dcp_state(version), checkpoint_id=path, no_dist=True)
        if i == 0:
            marker(mount, "sync")  # the first checkpoint is old and written back: only overwrites are tried
        marker(mount, f"done:{version}")


TRAINER_STEPS = 4


def _trainer(mount: str, workdir: str) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Markers(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marker(mount, f"begin:{state.global_step}")

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marker(mount, f"done:{state.global_step}")

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (16, 8), generator=gen)]
    args = TrainingArguments(
        output_dir=os.path.join(mount, "out"),
        max_steps=TRAINER_STEPS,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    Trainer(model=tiny_gpt2(), args=args, train_dataset=data, callbacks=[Markers()]).train()


# ----------------------------------------------------------------------------- harness self-test


def _selftest(mount: str) -> None:
    """Plain file operations whose crash states are known: the harness's own check (test_model.py)."""

    def write(path: str, data: bytes, sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        if sync:
            os.fsync(fd)
        os.close(fd)

    def sync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)

    os.mkdir(os.path.join(mount, "d"))
    sync_dir(mount)
    write(os.path.join(mount, "d", "careless.tmp"), b"x" * 10000, sync=False)
    os.rename(os.path.join(mount, "d", "careless.tmp"), os.path.join(mount, "d", "careless"))
    marker(mount, "done:careless")
    write(os.path.join(mount, "d", "careful.tmp"), b"y" * 10000, sync=True)
    os.rename(os.path.join(mount, "d", "careful.tmp"), os.path.join(mount, "d", "careful"))
    sync_dir(os.path.join(mount, "d"))
    marker(mount, "done:careful")


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str]) -> int:
    name, mount, workdir = argv[:3]
    extra = argv[3] if len(argv) > 3 else ""
    if name == "selftest":
        _selftest(mount)
        return 0
    from dist_utils import launch, run_ranks

    if name == "save":
        run_ranks(_save_rank, WORLD, mount, work_dir=workdir)
    elif name == "manager":
        run_ranks(_manager_session, WORLD, mount, extra, [1, 2, 3, 4], False, work_dir=workdir)
        run_ranks(_manager_session, WORLD, mount, extra, [5], True, work_dir=workdir)
    elif name == "manager-killed":  # a real SIGKILL at a named point of step 3 (or its retention), then a resume
        variant, point = extra.split(",")
        os.environ["SHARDSAFE_CRASH_AT"] = ""
        launch(_killed_session, WORLD, mount, variant, point, work_dir=workdir)
        os.environ.pop("SHARDSAFE_CRASH_AT", None)
        run_ranks(_manager_session, WORLD, mount, variant, [4], True, work_dir=workdir)
    elif name == "exports":
        _exports(mount)
    elif name == "dcp":
        _dcp(mount)
    elif name == "trainer":
        _trainer(mount, workdir)
    else:
        raise SystemExit(f"unknown workload {name}")
    return 0


def _killed_session(rank: int, world_size: int, mount: str, variant: str, point: str) -> str:
    import fault_utils
    import shardsafe
    from dist_utils import make_model, set_model_values, shard

    watch_crash_points(mount)
    frozen = "dedup" in variant
    root = os.path.join(mount, "run")
    model = shard(make_model(0), world_size)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=KEEP_LAST, **manager_options(variant)) as manager:
        for step in (1, 2, 3):
            if step == 3:
                manager.wait()
                os.environ["SHARDSAFE_CRASH_AT"] = point
            set_model_values(model, fault_utils.step_values(model, step, frozen))
            if rank == 0:
                marker(mount, f"begin:{step}")
            manager.save(step, fault_utils.step_state(model, step))
            manager.wait()
            if rank == 0:
                marker(mount, f"done:{step}")
    return "survived"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
