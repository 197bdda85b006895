"""CheckpointManager under real FSDP2 process groups: retention, async, failures, preemption, dedup."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from dist_utils import full_model_state, launch, make_model, make_optimizer, rank_batch, run_ranks, shard, train_step
from shardsafe.errors import SaveError
from shardsafe.manager.catalog import committed_steps
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.manager.naming import step_name
from shardsafe.manager.retention import choose_kept
from stored_chunks import stored_chunks

# ----------------------------------------------------------------------------- retention rules


class _Info:
    def __init__(self, step: int, loss: float | None) -> None:
        self.step, self.metrics = step, ({} if loss is None else {"loss": loss})


@pytest.mark.parametrize(
    "keep_last, keep_best, losses, mode",
    [
        (2, None, [5, 4, 3, 2, 1], "min"),
        (1, 1, [0.1, 4, 3, 2, 1], "min"),  # the best is the oldest
        (None, 2, [0.1, 4, 0.2, 2, 1], "min"),
        (2, 1, [9, 1, 2, 3, 0.5], "max"),
        (0, None, [1, 2, 3, 4, 5], "min"),
        (3, 2, [None, 1, None, 0.5, None], "min"),
    ],
)
def test_retention_rule_keeps_latest_and_best(
    keep_last: int | None, keep_best: int | None, losses: list[Any], mode: str
) -> None:
    infos = [_Info(10 * (i + 1), loss) for i, loss in enumerate(losses)]
    kept = choose_kept(infos, keep_last, keep_best, "loss", mode)  # type: ignore[arg-type]
    keep, best = kept.steps, kept.best
    steps = [i.step for i in infos]
    scored = [(loss, s) for s, loss in zip(steps, losses) if loss is not None]
    expected_best = (min if mode == "min" else max)(scored, key=lambda ls: ls[0])[1]
    assert best == expected_best
    assert steps[-1] in keep and best in keep
    if keep_last:
        assert set(steps[-keep_last:]) <= keep
    ranked = sorted(scored, key=lambda ls: ls[0] if mode == "min" else -ls[0])
    if keep_best:
        assert {s for _, s in ranked[:keep_best]} <= keep
    allowed = (
        {steps[-1], best} | set(steps[-keep_last:] if keep_last else []) | {s for _, s in ranked[: keep_best or 0]}
    )
    assert keep == allowed


# ----------------------------------------------------------------------------- multi-rank jobs


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> dict[str, Any]:
    return {"model": model, "optim": optimizer, "rng": shardsafe.RNGState(), "step": step}


def _job(
    rank: int, world_size: int, root: str, steps: int, options: dict[str, Any], losses_metric: bool, env: dict[str, str]
) -> dict[str, Any]:
    """Train ``steps`` steps with a manager saving every step; report what happened."""
    os.environ.update(env)
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    torch.manual_seed(100 + rank)
    losses = []
    with shardsafe.CheckpointManager(root, save_every=1, **options) as manager:
        for step in range(1, steps + 1):
            loss = train_step(model, optimizer, *rank_batch(rank, step))
            losses.append(loss)
            state["step"] = step
            manager.save(
                step, state, metrics={"loss": [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0][step - 1]} if losses_metric else None
            )
        manager.wait()
    return {"losses": losses, "final": full_model_state(model)}


def _load_full(path: Path) -> dict[str, torch.Tensor]:
    model = make_model(1)
    shardsafe.load(path, {"model": model}, strict=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_retention_under_fsdp2_keeps_best_oldest_and_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    options = {"keep_last": 2, "keep_best": 1, "best_metric": "loss", "async_save": True}
    results = run_ranks(_job, 2, str(root), 7, options, True, {}, work_dir=tmp_path)
    # losses by step: 3, 1 (best), 4, 1.5, 9, 2.6, 5 -> keep best step 2 and the last two
    assert committed_steps(root) == [2, 6, 7]
    assert sorted(p.name for p in root.iterdir() if p.name != LEASE_DIR) == [step_name(s) for s in (2, 6, 7)]
    infos = shardsafe.list_checkpoints(root)
    assert [(i.step, i.best, i.latest) for i in infos] == [(2, True, False), (6, False, False), (7, False, True)]
    latest = _load_full(root / step_name(7))
    for key, value in results[0]["final"].items():
        assert torch.equal(latest[key], value), key


def test_kill_during_rotation_leaves_only_whole_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    options = {"keep_last": 1}
    result = launch(
        _job, 2, str(root), 3, options, False, {"SHARDSAFE_CRASH_AT": "retention:after-rename@0"}, work_dir=tmp_path
    )
    assert not result.ok and result.exitcodes[0] == -signal.SIGKILL
    # rank 0 died right after hiding step 1 (retention after the save of step 2)
    assert committed_steps(root) == [2]
    hidden = [p.name for p in root.iterdir() if p.name.startswith(".") and p.name != LEASE_DIR]
    assert len(hidden) == 1 and "deleting" in hidden[0]
    shardsafe.verify(root / step_name(2))
    assert set(_load_full(root / step_name(2))) == set(make_model(0).state_dict())
    removed = shardsafe.collect_garbage(root)
    assert [p.name for p in removed] == hidden
    assert sorted(p.name for p in root.iterdir() if p.name != LEASE_DIR) == [step_name(2)]


def _async_vs_sync(rank: int, world_size: int, root: str, mode: Any) -> list[str]:
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    torch.manual_seed(7 + rank)
    with shardsafe.CheckpointManager(Path(root) / "async", async_save=mode) as manager:
        for step in range(1, 4):
            train_step(model, optimizer, *rank_batch(rank, step))
        state["step"] = 3
        shardsafe.save(Path(root) / "sync", state)  # the reference, written before training goes on
        manager.save(3, state, force=True)
        for step in range(4, 7):  # training continues while the async save runs
            train_step(model, optimizer, *rank_batch(rank, step))
    return []


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_async_save_is_bit_identical_to_sync_save(tmp_path: Path, mode: Any) -> None:
    run_ranks(_async_vs_sync, 2, str(tmp_path), mode, work_dir=tmp_path)
    sync = json.loads((tmp_path / "sync" / "manifest.json").read_text())["tensors"]
    asynchronous = json.loads((tmp_path / "async" / step_name(3) / "manifest.json").read_text())["tensors"]
    assert sync.keys() == asynchronous.keys() and len(sync) > 10
    for key in sync:
        if key.startswith("rng/"):
            continue  # the reference save ran later, after the RNG moved on
        sync_hashes = [c["hashes"] for c in stored_chunks(tmp_path / "sync", key)]
        assert sync_hashes == [c["hashes"] for c in stored_chunks(tmp_path / "async" / step_name(3), key)], key
    shardsafe.verify(tmp_path / "async" / step_name(3))


def _failing_background(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    outcome: dict[str, Any] = {}
    manager = shardsafe.CheckpointManager(root, async_save=True, save_every=1)
    train_step(model, optimizer, *rank_batch(rank, 1))
    manager.save(1, state)
    manager.wait()
    os.environ["SHARDSAFE_FAIL_AT"] = "save:after-write@1"
    train_step(model, optimizer, *rank_batch(rank, 2))
    manager.save(2, state)  # fails in the background on rank 1
    train_step(model, optimizer, *rank_batch(rank, 3))
    try:
        manager.save(3, state)
    except SaveError as exc:
        outcome["error"] = str(exc)
    del os.environ["SHARDSAFE_FAIL_AT"]
    manager.save(3, state)  # the manager goes on working after reporting
    manager.close()
    return outcome


def test_background_failure_surfaces_on_next_call(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks(_failing_background, 2, str(root), work_dir=tmp_path)
    for outcome in results:
        assert (
            "background save failed" in outcome["error"]
            and "rank 1" in outcome["error"]
            and "injected I/O error" in outcome["error"]
        )
    assert committed_steps(root) == [1, 3]
    # the failed save cleaned up after itself
    assert not [p for p in root.iterdir() if p.name.startswith(".") and p.name != LEASE_DIR]
    shardsafe.verify(root / step_name(1))


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _preemptible(rank: int, world_size: int, root: str, steps: int, signal_at: int | None) -> dict[str, Any]:
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = _state(model, optimizer)
    _seed_everything(100 + rank)
    losses: dict[int, float] = {}
    with shardsafe.CheckpointManager(root, save_every=100, handle_preemption=True) as manager:
        start = (manager.restore(state) or 0) + 1
        for step in range(start, steps + 1):
            losses[step] = train_step(model, optimizer, *rank_batch(rank, step))
            if step == signal_at and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, to one process
            state["step"] = step
            manager.save(step, state)
            if manager.stop_requested:
                break
    return {"start": start, "losses": losses, "stopped": manager.stop_requested}


def test_resume_after_sigterm_matches_uninterrupted_run(tmp_path: Path) -> None:
    straight = run_ranks(_preemptible, 2, str(tmp_path / "a"), 8, None, work_dir=tmp_path)
    first = run_ranks(_preemptible, 2, str(tmp_path / "b"), 8, 4, work_dir=tmp_path)
    assert all(r["stopped"] for r in first) and committed_steps(tmp_path / "b") == [4]
    second = run_ranks(_preemptible, 2, str(tmp_path / "b"), 8, None, work_dir=tmp_path)
    for rank in range(2):
        assert second[rank]["start"] == 5
        combined = first[rank]["losses"] | second[rank]["losses"]
        assert combined == straight[rank]["losses"]


def _frozen_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 96), nn.Linear(96, 96), nn.Linear(96, 96), nn.Linear(96, 96), nn.Linear(96, 3))
    for layer in list(model)[:4]:
        layer.requires_grad_(False)  # ~90% of the parameters are frozen, as in a fine-tune
    for layer in model:
        shard_layer = __import__("torch.distributed.fsdp", fromlist=["fully_shard"]).fully_shard
        shard_layer(layer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    state = {"model": model, "optim": optimizer}
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=1, dedup=True) as manager:
        for step in (1, 2, 3):
            model(torch.randn(4, 96)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, state)
    return {"final": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def test_unchanged_tensors_are_stored_once(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks(_frozen_job, 2, str(root), work_dir=tmp_path)

    def data_bytes(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))

    full, second = data_bytes(root / step_name(1)), data_bytes(root / step_name(3))
    assert committed_steps(root) == [3]  # step 1 holds the frozen weights but is no longer a checkpoint
    assert second <= 0.15 * full, (second, full)
    shardsafe.verify(root / step_name(3))
    model = nn.Sequential(*[nn.Linear(96, 96) for _ in range(4)], nn.Linear(96, 3))
    shardsafe.load(root / step_name(3), {"model": model})
    for key, value in results[0]["final"].items():
        assert torch.equal(model.state_dict()[key], value), key
    assert shardsafe.collect_garbage(root) == []  # referenced data is not garbage


def test_list_and_gc_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardsafe.cli.main import main

    root = tmp_path / "ckpt"
    model = nn.Linear(3, 2)
    losses = [3.0, 1.0, 4.0, 5.0]
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=2, keep_best=1, best_metric="loss") as manager:
        for step, loss in enumerate(losses, 1):
            manager.save(step, {"model": model}, metrics={"loss": loss})
    (root / ".step-0000000009.shardsafe-tmp-0123456789ab").mkdir()
    (root / step_name(8)).mkdir()  # a step folder without manifest
    assert main(["list", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["best"], r["latest"], r["metrics"]["loss"]) for r in rows] == [
        (2, True, False, 1.0),
        (3, False, False, 4.0),
        (4, False, True, 5.0),
    ]
    assert main(["gc", str(root), "--dry-run", "--min-age", "0"]) == 0
    assert "would remove 2 entries" in capsys.readouterr().out
    assert main(["gc", str(root), "--min-age", "0"]) == 0
    assert sorted(p.name for p in root.iterdir() if p.name != LEASE_DIR) == [step_name(s) for s in (2, 3, 4)]
    assert main(["gc", str(root)]) == 0 and "removed 0 entries" in capsys.readouterr().out.splitlines()[-1]


def test_retention_parses_each_manifest_once_and_rereads_a_resaved_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention after every save reuses parsed manifests (no re-parsing in the background thread each save),
    but a checkpoint saved again under the same step is read again: its new metrics decide what is kept."""
    import shardsafe.manager.catalog as catalog_module

    parsed: list[str] = []
    real = catalog_module.read_manifest

    def counting(folder: Any) -> Any:
        parsed.append(Path(str(folder)).name)
        return real(folder)

    monkeypatch.setattr(catalog_module, "read_manifest", counting)
    root = tmp_path / "ckpt"
    model = nn.Linear(3, 2)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=2, keep_best=1, best_metric="loss") as manager:
        for step, loss in enumerate([0.5, 3.0, 2.0, 1.0], 1):
            manager.save(step, {"model": model}, metrics={"loss": loss})
        assert committed_steps(root) == [1, 3, 4]  # the best (step 1) and the last two
        assert sorted(parsed) == [step_name(s) for s in (1, 2, 3, 4)]  # each manifest parsed once over 4 retentions
        manager.save(4, {"model": model}, metrics={"loss": 0.1}, force=True)  # step 4 again, now the best
    assert committed_steps(root) == [3, 4]
    assert parsed.count(step_name(4)) == 2
    assert [(i.step, i.best) for i in shardsafe.list_checkpoints(root)] == [(3, False), (4, True)]
