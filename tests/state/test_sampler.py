"""ReshardableSampler: resumed on any sequence of world sizes, the ranks together continue one global
sample order, so no sample is skipped or repeated compared with an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import shardsafe
from dist_utils import run_ranks
from shardsafe.data import ReshardableSampler


def _samplers(n: int, world: int, **kw: Any) -> list[ReshardableSampler]:
    return [ReshardableSampler(range(n), num_replicas=world, rank=r, **kw) for r in range(world)]


def _run(n: int, plan: list[tuple[int, int]], epochs: int, batch: int, **kw: Any) -> list[list[int]]:
    """Train over ``epochs`` with resumes: ``plan`` = [(world size, steps before the next resume), ...]
    (the last entry runs to the end). Returns, per epoch, the samples taken in global order."""
    taken: list[list[int]] = [[] for _ in range(epochs)]
    state: dict[str, Any] | None = None
    segment = 0
    epoch = 0
    while epoch < epochs and segment < len(plan):
        world, budget = plan[segment]
        samplers = _samplers(n, world, **kw)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        epoch = samplers[0].epoch
        last = segment == len(plan) - 1
        while epoch < epochs:
            for s in samplers:
                s.set_epoch(epoch)
            iters = [iter(s) for s in samplers]
            lens = {len(s) for s in samplers}
            assert len(lens) == 1, f"ranks would take different numbers of samples: {lens}"
            stopped = False
            for _step in range(-(-lens.pop() // batch)):
                rounds = [[next(it, None) for _ in range(batch)] for it in iters]
                for i in range(batch):  # global order is round by round, rank by rank
                    taken[epoch] += [r[i] for r in rounds if r[i] is not None]
                budget -= 1
                if budget == 0 and not last:
                    stopped = True
                    break
            if stopped:
                states = [s.state_dict() for s in samplers]
                assert all(st == states[0] for st in states), "the sampler state must be the same on every rank"
                state = states[0]
                break
            epoch += 1
            for s in samplers:
                s.set_epoch(epoch)
        segment += 1
    return taken


def test_block_deals_contiguous_batches_like_the_trainer_and_resumes_at_another_layout() -> None:
    """block=B: rank r takes positions [rB, rB + B) of each round of W*B (a global micro-batch cut as accelerate's
    BatchSamplerShard cuts it); a position saved at 2 ranks x 3 continues at 3 ranks x 2 and at 1 rank x 6."""
    n, seed = 26, 3
    order = ReshardableSampler(range(n), num_replicas=1, rank=0, seed=seed).global_order(0)
    two = _samplers(n, 2, seed=seed, block=3)
    assert [list(s) for s in two] == [
        [
            order[(2 * k + r) * 3 + i] if (2 * k + r) * 3 + i < n else order[(2 * k + r) * 3 + i - n]
            for k in range(5)
            for i in range(3)
        ]
        for r in range(2)
    ], "rank r's k-th batch is block 2k + r of the order; the last round padded from the start"
    assert {len(s) for s in two} == {15}
    taken: list[int] = []
    its = [iter(s) for s in two]
    for _ in range(2):  # two global micro-batches of 6
        for it in its:
            taken += [next(it) for _ in range(3)]
    state = two[0].state_dict()
    assert state["consumed"] == 12 and all(s.state_dict() == state for s in two)
    for world, block in ((3, 2), (1, 6)):
        resumed = _samplers(n, world, seed=seed, block=block)
        for s in resumed:
            s.load_state_dict(state)
            s.set_epoch(0)
        rest = [list(s) for s in resumed]
        merged = [
            i for k in range(len(rest[0]) // block) for r in range(world) for i in rest[r][k * block : (k + 1) * block]
        ]
        assert taken + merged[: n - 12] == order, f"{world} ranks x {block}: not the uninterrupted order"
    with pytest.raises(ValueError, match="block must be a positive"):
        ReshardableSampler(range(4), num_replicas=1, rank=0, block=0)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [37, 48])
def test_resumes_at_2_3_1_continue_the_uninterrupted_order(shuffle: bool, drop_last: bool, n: int) -> None:
    kw = {"shuffle": shuffle, "drop_last": drop_last, "seed": 5}
    resumed = _run(n, [(2, 5), (3, 4), (1, 7), (3, 10**6)], epochs=3, batch=2, **kw)
    reference = ReshardableSampler(range(n), num_replicas=1, rank=0, **kw)
    for epoch, got in enumerate(resumed):
        order = reference.global_order(epoch)
        head = got[:n]
        if drop_last:
            assert head == order[: len(head)] and len(head) >= n - 3, f"epoch {epoch}: skipped or reordered samples"
        else:
            assert head == order, f"epoch {epoch}: the resumed run's samples differ from the uninterrupted order"
            assert got[n:] == order[: len(got) - n]  # the last round padded from the start, as DistributedSampler does
    assert reference.global_order(0) != reference.global_order(1) or not shuffle  # epochs reshuffle


def test_matches_distributed_sampler_without_resume() -> None:
    for world in (1, 2, 3):
        for rank in range(world):
            ours = list(ReshardableSampler(range(23), num_replicas=world, rank=rank, shuffle=False))
            theirs = list(DistributedSampler(range(23), num_replicas=world, rank=rank, shuffle=False))
            assert ours == theirs


def test_works_in_a_dataloader_and_len_counts_the_rest() -> None:
    sampler = ReshardableSampler(range(20), num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(list(range(20)), batch_size=3, sampler=sampler)
    first = next(iter(loader))
    assert first.tolist() == [1, 3, 5]
    state = sampler.state_dict()
    assert state["consumed"] == 6
    again = ReshardableSampler(range(20), num_replicas=4, rank=0, shuffle=False)
    again.load_state_dict(state)
    again.set_epoch(0)  # the restored epoch: keeps the position
    assert len(again) == 4 and list(again) == [6, 10, 14, 18]


def test_bad_states_are_refused_before_anything_changes() -> None:
    sampler = ReshardableSampler(range(10), num_replicas=1, rank=0)
    before = sampler.state_dict()
    for bad in (
        {},
        {"epoch": "x", "seed": 0, "consumed": 0},
        {"epoch": 0, "seed": 0, "consumed": -3},
        {**before, "dataset_length": 11},
        {**before, "shuffle": False},
    ):
        with pytest.raises(ValueError):
            sampler.load_state_dict(bad)
        assert sampler.state_dict() == before
    with pytest.raises(ValueError):
        ReshardableSampler(range(10), num_replicas=2, rank=2)


def _save_job(rank: int, world_size: int, path: str, steps: int) -> list[int]:
    sampler = ReshardableSampler(range(50), seed=3)
    sampler.set_epoch(1)
    it = iter(sampler)
    mine = [next(it) for _ in range(steps)]
    shardsafe.save(path, {"sampler": sampler})
    return mine


def _load_job(rank: int, world_size: int, path: str) -> list[int]:
    sampler = ReshardableSampler(range(50), seed=3)
    shardsafe.load(path, {"sampler": sampler})
    sampler.set_epoch(1)
    return list(sampler)


def test_saved_with_shardsafe_at_2_ranks_continues_at_3(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    first = run_ranks(_save_job, 2, path, 7, work_dir=tmp_path / "a")
    rest = run_ranks(_load_job, 3, path, work_dir=tmp_path / "b")
    order = ReshardableSampler(range(50), num_replicas=1, rank=0, seed=3).global_order(1)
    taken = [first[r][i] for i in range(7) for r in range(2)]
    taken += [rest[r][i] for i in range(len(rest[0])) for r in range(3) if i < len(rest[r])]
    assert taken[:50] == order  # 14 samples at 2 ranks, then the other 36 (+1 padding) at 3 ranks
    assert torch.tensor(taken[:50]).unique().numel() == 50
