"""Loading on a different number of ranks than saved, optimizer state included.

A job of ``save_world`` ranks trains a few steps and saves model + AdamW; a job of ``load_world``
ranks loads into a freshly built model and optimizer. The whole tensors it then holds
(``DTensor.full_tensor()``) must equal, bit for bit, what the saving job held. One rank means no
process group at all: a plain ``nn.Module`` in this (the test) process. The weights have dim 0 of
7, 13, 5 and 2, which split unevenly over 2 and 3 ranks (and 2 rows over 3 ranks leaves one rank
with nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    save_trained,
    shard,
)


def load_fresh(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = make_model(seed=12345)
    if world_size > 1:
        shard(model, world_size)
    optimizer = make_optimizer(model, lr=0.5)  # hyperparameters come back from the checkpoint too
    assert not optimizer.state
    shardsafe.load(path, {"model": model, "optim": optimizer})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


def _run(fn: Any, world_size: int, *args: Any, work_dir: Path) -> list[dict[str, Any]]:
    if world_size == 1:  # no process group, no FSDP: a plain module in this process
        assert not dist.is_initialized()
        return [fn(0, 1, *args)]
    return run_ranks(fn, world_size, *args, work_dir=work_dir)


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2), (2, 3), (3, 2), (3, 1)], ids=lambda w: str(w))
def test_reshard_model_and_optimizer(tmp_path: Path, save_world: int, load_world: int) -> None:
    path = tmp_path / f"from-{save_world}"
    saved = _run(save_trained, save_world, str(path), 10 * save_world + load_world, work_dir=tmp_path)
    reference = saved[0]
    for other in saved[1:]:  # full tensors agree on every saving rank
        assert_tensors_equal(other["model"], reference["model"], "saving ranks disagree")
    assert reference["optim"]["state"], "the saved optimizer has state (exp_avg, exp_avg_sq, step)"
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in reference["optim"]["state"].values())
    assert shardsafe.verify(path)["world_size"] == save_world

    loaded = _run(load_fresh, load_world, str(path), work_dir=tmp_path)
    assert len(loaded) == load_world
    for rank, got in enumerate(loaded):
        assert_tensors_equal(got["model"], reference["model"], f"{save_world}->{load_world} rank {rank} model")
        assert_optimizer_equal(got["optim"], reference["optim"], f"{save_world}->{load_world} rank {rank} optimizer")
