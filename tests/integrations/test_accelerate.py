"""shardsafe.integrations.accelerate: save_state/load_state of a real multi-process Accelerator (CPU,
gloo) continue training bit-identically, as Accelerate's own save_state/load_state do; automatic
checkpoint naming with total_limit; a resume on another world size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_ranks
from shardsafe.manager.lease import LEASE_DIR

pytest.importorskip("accelerate")

STEPS, SAVE_AT, BATCH = 6, 3, 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.3)  # the RNG of every rank matters for the continuation
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


class Counter:
    """An object registered with register_for_checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def _setup(project: str, world_size: int, **config: Any) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from shardsafe.data import ReshardableSampler

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project, **config))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = torch.randn(64, 9, generator=torch.Generator().manual_seed(1))
    sampler = ReshardableSampler(range(64), seed=2)
    counter = Counter()
    accelerator.register_for_checkpointing(sampler, counter)
    torch.manual_seed(100 + accelerator.process_index)
    return {
        "acc": accelerator,
        "model": model,
        "opt": optimizer,
        "sched": scheduler,
        "data": data,
        "sampler": sampler,
        "counter": counter,
    }


def _train(s: dict[str, Any], steps: int, per_rank_batch: int = BATCH) -> list[float]:
    it = iter(s["sampler"])
    losses = []
    for _ in range(steps):
        idx = torch.tensor([next(it) for _ in range(per_rank_batch)])
        x, y = s["data"][idx, :8], s["data"][idx, 8:]
        loss = torch.nn.functional.mse_loss(s["model"](x), y)
        s["acc"].backward(loss)
        s["opt"].step()
        s["sched"].step()
        s["opt"].zero_grad()
        s["counter"].n += 1
        losses.append(float(loss))
    return losses


def _weights(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in s["acc"].unwrap_model(s["model"]).state_dict().items()}


def _continuation_job(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss_accelerate

    s = _setup(f"{root}/{mode}", world_size)
    s["sampler"].set_epoch(0)
    if mode == "uninterrupted":
        return {"losses": _train(s, STEPS), "weights": _weights(s)}
    first = _train(s, SAVE_AT)
    out = f"{root}/{mode}/ckpt"
    if mode == "shardsafe":
        ss_accelerate.save_state(s["acc"], out)
    else:
        s["acc"].save_state(out)
    fresh = _setup(f"{root}/{mode}", world_size)  # new objects, other random values and RNG
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.add_(1.0)
    if mode == "shardsafe":
        ss_accelerate.load_state(fresh["acc"], out)
    else:
        fresh["acc"].load_state(out)
    fresh["sampler"].set_epoch(0)
    rest = _train(fresh, STEPS - SAVE_AT)
    return {
        "losses": first + rest,
        "weights": _weights(fresh),
        "counter": fresh["counter"].n,
        "step": fresh["acc"].step,
    }


def test_continuation_is_bit_identical_and_matches_accelerate(tmp_path: Path) -> None:
    reference = run_ranks(_continuation_job, 2, str(tmp_path), "uninterrupted", work_dir=tmp_path / "a")
    ours = run_ranks(_continuation_job, 2, str(tmp_path), "shardsafe", work_dir=tmp_path / "b")
    theirs = run_ranks(_continuation_job, 2, str(tmp_path), "accelerate", work_dir=tmp_path / "c")
    for rank in range(2):
        assert ours[rank]["losses"] == reference[rank]["losses"], f"rank {rank}: the resumed run's losses differ"
        assert theirs[rank]["losses"] == reference[rank]["losses"]
        for key, value in reference[rank]["weights"].items():
            assert torch.equal(ours[rank]["weights"][key], value), key
        assert ours[rank]["counter"] == STEPS
    checkpoint = tmp_path / "shardsafe" / "ckpt"
    assert (
        (checkpoint / "manifest.json").is_file()
        and not list(checkpoint.glob("*.pkl"))
        and not list(checkpoint.glob("*.bin"))
    )


def _rotation_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss_accelerate

    s = _setup(root, world_size, automatic_checkpoint_naming=True, total_limit=2)
    s["sampler"].set_epoch(0)
    paths = []
    for _ in range(4):
        _train(s, 1)
        paths.append(ss_accelerate.save_state(s["acc"]))
    after = _setup(root, world_size, automatic_checkpoint_naming=True, total_limit=2)
    loaded = ss_accelerate.load_state(after["acc"])
    return {
        "paths": paths,
        "loaded": loaded,
        "counter": after["counter"].n,
        "iteration": after["acc"].project_configuration.iteration,
    }


def test_automatic_naming_and_total_limit(tmp_path: Path) -> None:
    results = run_ranks(_rotation_job, 2, str(tmp_path / "proj"), work_dir=tmp_path / "run")
    folder = tmp_path / "proj" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir() if p.name != LEASE_DIR) == ["checkpoint_2", "checkpoint_3"]
    assert len(list((folder / LEASE_DIR).glob("epoch-*.json"))) == 1  # the run held one lease on the folder
    for r in results:
        assert [Path(p).name for p in r["paths"]] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
        assert Path(r["loaded"]).name == "checkpoint_3" and r["counter"] == 4 and r["iteration"] == 4


def _save_two(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss_accelerate

    s = _setup(root, world_size)
    s["sampler"].set_epoch(0)
    _train(s, SAVE_AT)
    ss_accelerate.save_state(s["acc"], f"{root}/ckpt")
    return {"weights": _weights(s), "consumed": s["sampler"].state_dict()["consumed"]}


def _load_one(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss_accelerate

    s = _setup(root, world_size)
    ss_accelerate.load_state(s["acc"], f"{root}/ckpt")
    return {"weights": _weights(s), "consumed": s["sampler"].state_dict()["consumed"], "step": s["acc"].step}


def test_resume_on_another_world_size(tmp_path: Path) -> None:
    saved = run_ranks(_save_two, 2, str(tmp_path), work_dir=tmp_path / "a")
    loaded = run_ranks(_load_one, 1, str(tmp_path), work_dir=tmp_path / "b")
    assert loaded[0]["consumed"] == saved[0]["consumed"] == 2 * BATCH * SAVE_AT
    for key, value in saved[0]["weights"].items():
        assert torch.equal(loaded[0]["weights"][key], value), key


def _first_run(rank: int, world_size: int, root: str) -> str | None:
    from shardsafe.integrations import accelerate as ss_accelerate

    s = _setup(root, world_size, automatic_checkpoint_naming=True)
    for _ in range(2):
        _train(s, 1)
        ss_accelerate.save_state(s["acc"])  # checkpoint_0, checkpoint_1
    return ss_accelerate._LEASES[str((Path(root) / "checkpoints").absolute())].run_id


def _second_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A new run on the first one's project: it waits for a live holder before it picks the newest, and replaces only
    what it loaded."""
    import shutil
    import threading
    import time

    from shardsafe.errors import CheckpointExistsError
    from shardsafe.integrations import accelerate as ss_accelerate
    from shardsafe.manager.lease import Lease

    folder = Path(root) / "checkpoints"
    s = _setup(root, world_size, automatic_checkpoint_naming=True)
    config = s["acc"].project_configuration
    if rank == 0:  # another run still holds the folder, commits checkpoint_2, then ends
        other = Lease(folder, timeout=1.0)
        other.acquire()

        def finish() -> None:
            time.sleep(1.0)
            shutil.copytree(folder / "checkpoint_1", folder / "checkpoint_2")
            other.release()

        threading.Thread(target=finish).start()
    loaded = ss_accelerate.load_state(s["acc"])
    after_load = config.iteration
    config.iteration = 0
    try:
        ss_accelerate.save_state(s["acc"])
        refused = ""
    except CheckpointExistsError as exc:
        refused = str(exc)
    config.iteration = 2
    again = ss_accelerate.save_state(s["acc"])  # the checkpoint it loaded
    config.iteration = 0
    forced = ss_accelerate.save_state(s["acc"], overwrite=True)
    return {
        "loaded": Path(loaded).name,
        "iteration": after_load,
        "refused": refused,
        "saved": [Path(again).name, Path(forced).name],
    }


def test_a_second_run_loads_under_the_lease_and_never_replaces_the_first_runs_checkpoint(tmp_path: Path) -> None:
    root = str(tmp_path / "proj")
    first = run_ranks(_first_run, 1, root, work_dir=tmp_path / "a")[0]
    results = run_ranks(_second_run, 2, root, work_dir=tmp_path / "b")
    for r in results:
        assert r["loaded"] == "checkpoint_2" and r["iteration"] == 3, "the newest once the other run had ended"
        assert (
            f"step 0 is a committed checkpoint written by run {first}" in r["refused"]
            and "overwrite=True" in r["refused"]
        )
        assert r["saved"] == ["checkpoint_2", "checkpoint_0"]
