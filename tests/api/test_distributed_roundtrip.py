"""Exact round trip of a whole FSDP2 training state, and bit-exact resumption.

One 2-rank job trains N steps and saves at step K; a second, fresh 2-rank job (new process group,
differently initialised model, differently seeded RNGs) loads step K and trains on to N. What the
second job loads must equal, bit for bit, what the first held when it saved (model, AdamW state
and param groups, LR scheduler, every RNG, JSON values), and its losses for steps K+1..N must be
exactly the first job's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import OneCycleLR

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    rank_batch,
    run_ranks,
    shard,
    train_step,
    typed,
)

N_STEPS = 6
SAVE_AT = 3
WORLD = 2


def extra_values(step: int) -> dict[str, Any]:
    """JSON-able values of every kind the format must keep apart (ints vs floats, tuples vs lists, int keys)."""
    return {
        "step": step,
        "big": 2**62 + 1,
        "negative": -3,
        "flag": True,
        "ratio": 0.1,
        "name": "run-\u03b1",
        "nested": {"t": (1, (2, 3), [4, {"x": (5,)}]), "none": None, "empty": {}, "list": []},
        "int_keys": {1: "a", 7: (8, 9)},
    }


def _setup(rank: int, world_size: int, model_seed: int, rng_seed: int) -> tuple[Any, Any, Any]:
    model = shard(make_model(model_seed), world_size)
    optimizer = make_optimizer(model)
    scheduler = OneCycleLR(optimizer, max_lr=0.05, total_steps=N_STEPS + 1)  # also cycles AdamW's betas
    torch.manual_seed(rng_seed + rank)  # every rank its own streams: a per-rank restore is needed
    random.seed(rng_seed * 7 + rank)
    np.random.seed(rng_seed * 13 + rank)
    return model, optimizer, scheduler


def _rng_snapshot() -> dict[str, Any]:
    """The generators' state, read with the libraries' own getters (independent of shardsafe.RNGState)."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}


def _snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return {
        "model": full_model_state(model),
        "optim": full_optimizer_state(model, optimizer),
        "sched": scheduler.state_dict(),
        "rng": _rng_snapshot(),
    }


def train_and_save(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optimizer, scheduler = _setup(rank, world_size, model_seed=1, rng_seed=100)
    counter = torch.zeros((), dtype=torch.int64)
    losses, at_save = [], None
    for step in range(1, N_STEPS + 1):
        losses.append(train_step(model, optimizer, *rank_batch(rank, step), scheduler))
        counter += 1
        if step == SAVE_AT:
            state = {
                "model": model,
                "optim": optimizer,
                "sched": scheduler,
                "rng": shardsafe.RNGState(),
                "counter": counter,
                "extra": extra_values(step),
                "step": step,
            }
            shardsafe.save(path, state, metadata={"run": "roundtrip", "step": step})
            at_save = _snapshot(model, optimizer, scheduler) | {
                "counter": counter.clone(),
                "extra": extra_values(step),
                "step": step,
            }
    return {"losses": losses, "at_save": at_save, "final": full_model_state(model)}


def load_and_resume(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optimizer, scheduler = _setup(rank, world_size, model_seed=2, rng_seed=900)
    before = _snapshot(model, optimizer, scheduler)
    counter = torch.full((), -1, dtype=torch.int64)
    state = {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "rng": shardsafe.RNGState(),
        "counter": counter,
        "extra": None,
        "step": -1,
    }
    metadata = shardsafe.load(path, state)
    loaded = _snapshot(model, optimizer, scheduler) | {
        "counter": counter.clone(),
        "extra": state["extra"],
        "step": state["step"],
    }
    losses = [
        train_step(model, optimizer, *rank_batch(rank, step), scheduler) for step in range(SAVE_AT + 1, N_STEPS + 1)
    ]
    return {
        "before": before,
        "loaded": loaded,
        "metadata": metadata,
        "losses": losses,
        "final": full_model_state(model),
    }


def _assert_rng_equal(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert got["python"] == expected["python"], f"{what}: python random state differs"
    assert torch.equal(got["torch"], expected["torch"]), f"{what}: torch RNG state differs"
    g, e = got["numpy"], expected["numpy"]
    assert g[0] == e[0] and np.array_equal(g[1], e[1]) and tuple(g[2:]) == tuple(e[2:]), (
        f"{what}: numpy RNG state differs"
    )


def test_exact_round_trip_and_bit_exact_resume(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    first = run_ranks(train_and_save, WORLD, str(path), work_dir=tmp_path)
    summary = shardsafe.verify(path)
    assert summary["world_size"] == WORLD and summary["metadata"] == {"run": "roundtrip", "step": SAVE_AT}

    second = run_ranks(load_and_resume, WORLD, str(path), work_dir=tmp_path)

    # The ranks really had different RNG streams, and the fresh job really started elsewhere.
    assert not torch.equal(first[0]["at_save"]["rng"]["torch"], first[1]["at_save"]["rng"]["torch"])
    for rank in range(WORLD):
        ref, before, got = first[rank]["at_save"], second[rank]["before"], second[rank]["loaded"]
        what = f"rank {rank}"
        assert not torch.equal(before["model"]["layers.0.weight"], ref["model"]["layers.0.weight"])
        assert before["optim"]["state"] == {}

        assert_tensors_equal(got["model"], ref["model"], f"{what} model")
        assert_optimizer_equal(got["optim"], ref["optim"], f"{what} optimizer")
        assert typed(got["sched"]) == typed(ref["sched"]), f"{what}: scheduler state differs"
        _assert_rng_equal(got["rng"], ref["rng"], what)
        assert torch.equal(got["counter"], ref["counter"])
        assert typed(got["extra"]) == typed(ref["extra"]), (
            f"{what}: JSON values changed type or value: {got['extra']!r}"
        )
        assert typed(got["step"]) == typed(ref["step"])
        assert second[rank]["metadata"] == {"run": "roundtrip", "step": SAVE_AT}

        # Training on after the load is the same computation, bit for bit, as never stopping.
        assert second[rank]["losses"] == first[rank]["losses"][SAVE_AT:], f"{what}: resumed losses differ"
        assert_tensors_equal(second[rank]["final"], first[rank]["final"], f"{what} final model")
