"""A manager's saves reuse the previous save's description while the state's structure is unchanged
(state/registry.DescribeCache): proven by its counters, never by timing, and by what the checkpoints load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    rank_batch,
    run_ranks,
    shard,
    train_step,
)
from shardsafe.errors import ShardsafeError


def _live(world_size: int, seed: int = 0) -> dict[str, Any]:
    model = shard(make_model(seed), world_size)
    optimizer = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # lr changes every step: fresh values
    return {"model": model, "optim": optimizer, "sched": sched, "rng": shardsafe.RNGState(), "step": 0}


def _step(state: dict[str, Any], rank: int, step: int) -> None:
    torch.manual_seed(1000 * step + rank)
    train_step(state["model"], state["optim"], *rank_batch(rank, step), state["sched"])
    state["step"] = step


def _expected(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": full_model_state(state["model"]),
        "optim": full_optimizer_state(state["model"], state["optim"]),
        "sched": state["sched"].state_dict(),
        "rng": torch.get_rng_state(),
        "step": state["step"],
        "extra": {k: full(v) for k, v in state.items() if isinstance(v, torch.Tensor)},
    }


def _assert_loads_as(path: Path, expected: dict[str, Any], world_size: int, extra: dict[str, Any]) -> None:
    fresh = _live(world_size, seed=7)
    fresh.update({k: torch.zeros_like(v) for k, v in extra.items()})
    shardsafe.load(path, fresh)
    assert_tensors_equal(full_model_state(fresh["model"]), expected["model"], "model")
    assert_optimizer_equal(full_optimizer_state(fresh["model"], fresh["optim"]), expected["optim"], "optimizer")
    assert fresh["sched"].state_dict() == expected["sched"]
    assert fresh["step"] == expected["step"]
    assert torch.equal(fresh["rng"].state_dict()["torch"], expected["rng"])
    assert_tensors_equal({k: full(fresh[k]) for k in extra}, expected["extra"], "plain tensors")


def _unchanged(rank: int, world_size: int, root: str, async_save: Any) -> dict[str, Any]:
    """Local saves every step, root saves every 3: the first describe is full, every later one reuses."""
    state = _live(world_size)
    _step(state, rank, 1)
    counts = []
    with shardsafe.CheckpointManager(
        root, save_every=3, local_every=1, local_dir=f"{root}-local/{{node}}", async_save=async_save
    ) as manager:
        cache = manager._describe_cache
        for step in (1, 2, 3):
            if step > 1:
                _step(state, rank, step)  # new tensor values, a new lr, a new step counter, a new RNG state
            expected = _expected(state)
            manager.save(step, state)
            counts.append((cache.full, cache.cached, cache.tensors.reused, cache.tensors.described))
        manager.wait()
    _assert_loads_as(Path(root) / "step-0000000003", expected, world_size, {})
    return {"counts": counts}


@pytest.mark.parametrize("async_save", [True, False])
def test_unchanged_structure_reuses_the_description_and_saves_the_current_state(
    tmp_path: Path, async_save: Any
) -> None:
    results = run_ranks(_unchanged, 2, str(tmp_path / "root"), async_save, work_dir=tmp_path)
    for r in results:
        # step 1: one full describe (local); step 2: local, cached; step 3: local and root, cached: one describe
        # for both when async (the tier writes from the root's staged copy), two when the root save is synchronous
        third = (1, 2) if async_save is True else (1, 3)
        assert [(full, cached) for full, cached, _, _ in r["counts"]] == [(1, 0), (1, 1), third]
        _, _, reused, described = r["counts"][-1]
        # The model's parameters and the optimizer's moments are taken from the cache; only the RNG state's tensors
        # (new tensors at every state_dict()) are described again.
        assert reused >= 3 * 4 and described <= 4, r["counts"]


def _changes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _live(world_size)
    _step(state, rank, 1)
    seen: dict[str, Any] = {}
    with shardsafe.CheckpointManager(root, async_save=True) as manager:
        cache = manager._describe_cache

        def save(step: int, what: str) -> None:
            expected = _expected(state)
            before = (cache.full, cache.cached)
            manager.save(step, state)
            manager.wait()
            seen[what] = (cache.full - before[0], cache.cached - before[1], cache.tensors.described)
            extra = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            _assert_loads_as(Path(root) / f"step-{step:010d}", expected, world_size, extra)

        save(1, "first")
        state["extra"] = torch.arange(6.0)  # a new key
        _step(state, rank, 2)
        save(2, "new key")
        state["extra"] = torch.arange(6.0) + 10  # another tensor object of the same shape, dtype and device
        _step(state, rank, 3)
        save(3, "replaced tensor")
        state["extra"] = torch.arange(8.0)  # another shape
        _step(state, rank, 4)
        save(4, "new shape")
        state["extra"] = state["extra"].double()  # another dtype
        _step(state, rank, 5)
        save(5, "new dtype")
        _step(state, rank, 6)
        save(6, "unchanged")
        # What a load would refuse is still refused before writing, on the cached path too.
        state["step"] = {"bad": {1, 2}}
        try:
            manager.save(7, state)
        except ShardsafeError as exc:
            seen["refused"] = str(exc)
        state["step"] = 7
        save(7, "after a refusal")
    return seen


def test_structure_changes_describe_in_full_and_save_the_current_state(tmp_path: Path) -> None:
    results = run_ranks(_changes, 2, str(tmp_path / "root"), work_dir=tmp_path)
    for seen in results:
        assert seen["first"][:2] == (1, 0)
        assert seen["new key"][:2] == (1, 0)
        # Same structure: cached, but the replaced tensor itself is described afresh (its chunk is the new tensor), on
        # top of what every save describes afresh (the RNG state's new tensors).
        assert seen["replaced tensor"][:2] == (0, 1)
        assert seen["replaced tensor"][2] == seen["unchanged"][2] + 1
        assert seen["new shape"][:2] == (1, 0)
        assert seen["new dtype"][:2] == (1, 0)
        assert seen["unchanged"][:2] == (0, 1)
        assert "cannot store" in seen["refused"] and "set" in seen["refused"]
        assert seen["after a refusal"][:2] == (1, 0)  # a failed describe forgets the cache


def _one_rank_changes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _live(world_size)
    _step(state, rank, 1)
    with shardsafe.CheckpointManager(root, async_save=True) as manager:
        cache = manager._describe_cache
        manager.save(1, state)
        _step(state, rank, 2)
        if rank == 1:
            state["only1"] = torch.arange(5.0) * 3  # this rank's structure changes, rank 0's does not
        expected = _expected(state)
        manager.save(2, state)
        manager.wait()
        counts = (cache.full, cache.cached)
        _step(state, rank, 3)
        if rank == 0:
            state["only0"] = torch.ones(3, dtype=torch.int64)
        manager.save(3, state)
        manager.wait()
        later = (cache.full, cache.cached)
    extra = {k: v for k, v in state.items() if k == "only1"}
    _assert_loads_as(Path(root) / "step-0000000002", expected, world_size, extra)
    return {"counts": counts, "later": later}


def test_a_change_on_one_rank_makes_every_rank_describe_in_full(tmp_path: Path) -> None:
    results = run_ranks(_one_rank_changes, 2, str(tmp_path / "root"), work_dir=tmp_path)
    assert [r["counts"] for r in results] == [(2, 0), (2, 0)]
    assert [r["later"] for r in results] == [(3, 0), (3, 0)]
