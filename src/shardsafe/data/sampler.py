"""A data position that reshards: :class:`ReshardableSampler`.

``DistributedSampler`` gives rank ``r`` of ``W`` the indices ``order[r::W]`` of one epoch's order,
and its position lives in each rank's loop, so a resume on another world size either refuses or
skips and repeats samples. Here the position is *global*: the number of samples of the epoch's
order that all ranks together have consumed. The order depends only on ``(seed, epoch)`` and the
dataset length, never on the world size, so after a resume at any world size the ranks continue
the same global sequence exactly where it stopped:

    global order of the epoch:  o[0] o[1] o[2] ...
    W ranks from position p:    rank r reads o[p + r], o[p + r + W], o[p + r + 2W], ...
    the same with block=B:      rank r reads o[p + rB .. p + rB + B-1], then the same W*B further on

``block`` is how many consecutive positions a rank takes per round (default 1). With ``block`` set to
the per-rank batch size, one round is one global micro-batch cut into contiguous per-rank pieces,
which is how the Trainer's default (``RandomSampler`` + accelerate's ``BatchSamplerShard``) deals
batches, so ``ShardsafeTrainer`` gives the ranks the same batches as the plain Trainer.

:meth:`state_dict` (``epoch``, ``seed``, ``consumed``) is the same on every rank and is saved like
any stateful value (``{"sampler": sampler}``). ``consumed`` advances by ``W`` per sample a rank
takes, which is exact when every rank takes the same number of samples between saves (they do in
data-parallel training: one batch per step). For training to be *equivalent* after a change of
world size, keep the global batch size constant (per-rank batch x W x gradient accumulation).

The end of an epoch: the last round may have fewer than ``W * block`` samples left. With
``drop_last=True`` those are skipped (as DistributedSampler drops them); otherwise the round is
completed with samples from the start of the order, so every rank takes the same number. Which
samples that tail drops or repeats depends on the world size of the last part of the epoch;
every position of the order before it is taken exactly once, whatever the world sizes were.

The position counts what the ranks *drew from the sampler*. A ``DataLoader`` with
``num_workers > 0`` draws indices ahead of training (``prefetch_factor`` batches per worker);
those are counted as consumed when a checkpoint is taken mid-epoch. With ``num_workers=0`` the
count is exact at every step boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch

__all__ = ["ReshardableSampler"]


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class ReshardableSampler(torch.utils.data.Sampler[int]):
    """Drop-in for ``torch.utils.data.DistributedSampler`` whose position survives a change of world size."""

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        block: int = 1,
    ) -> None:
        world, me = _world()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = me if rank is None else int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        if int(block) < 1:
            raise ValueError(f"block must be a positive number of samples, not {block}")
        self.block = int(block)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order taken by all ranks together
        self._resume_at: int | None = None

    # ------------------------------------------------------------------ the global order

    def _length(self) -> int:
        return len(self.dataset)

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The epoch's order of dataset indices, independent of the world size."""
        n = self._length()
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(n, generator=g).tolist()

    def _round(self) -> int:
        """Positions all ranks take together per round: ``block`` each."""
        return self.num_replicas * self.block

    def _end(self, start: int) -> int:
        """Where the epoch ends for ranks starting at ``start``: a whole number of rounds past it,
        so every rank takes the same number of samples (the last round dropped or padded)."""
        remaining, size = max(0, self._length() - start), self._round()
        rounds = remaining // size if self.drop_last else math.ceil(remaining / size)
        return start + rounds * size

    def _start(self) -> int:
        return self._resume_at if self._resume_at is not None else 0

    # ------------------------------------------------------------------ Sampler

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless a restored position belongs to it."""
        if self._resume_at is not None and epoch == self.epoch:
            return
        self.epoch = int(epoch)
        self.consumed = 0
        self._resume_at = None

    def __len__(self) -> int:
        start = self._start()
        return (self._end(start) - start) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        n, size = len(order), self._round()
        start = self._start()
        self._resume_at = None
        self.consumed = start
        end = self._end(start)
        for base in range(start, end, size):
            self.consumed = base + size  # this round is taken, on every rank
            first = base + self.rank * self.block
            for pos in range(first, first + self.block):
                yield order[pos % n]  # the last round padded from the start
        self.consumed = end

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        consumed = self._resume_at if self._resume_at is not None else self.consumed
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": consumed,
            "shuffle": self.shuffle,
            "dataset_length": self._length(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the global order at the saved position (any world size); validated before anything changes."""
        try:
            epoch, seed, consumed = int(state["epoch"]), int(state["seed"]), int(state["consumed"])
            length = int(state.get("dataset_length", self._length()))
            shuffle = bool(state.get("shuffle", self.shuffle))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a ReshardableSampler state: {type(exc).__name__}: {exc}") from None
        if epoch < 0 or consumed < 0:
            raise ValueError(f"ReshardableSampler state has a negative epoch or position ({epoch}, {consumed})")
        if length != self._length():
            raise ValueError(f"the sampler was saved over {length} samples, the dataset now has {self._length()}")
        if shuffle != self.shuffle:
            raise ValueError(f"the sampler was saved with shuffle={shuffle}, this one has shuffle={self.shuffle}")
        self.epoch, self.seed = epoch, seed
        self.consumed = consumed
        self._resume_at = consumed
