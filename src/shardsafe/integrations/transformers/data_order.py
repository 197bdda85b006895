"""The Trainer's data order as a :class:`~shardsafe.data.ReshardableSampler`, so a resume on another world size
continues it.

The Trainer's own position is per rank: on resume it skips ``steps_trained_in_current_epoch``
batches of each rank's sampler, which at another world size takes other samples. Here the train
dataloader's sampler is a ``ReshardableSampler`` over one global order (``seed + epoch``, the
Trainer's ``RandomSampler`` permutation), each rank taking contiguous ``per_device_train_batch_size``
blocks of each global micro-batch, exactly the batches accelerate's ``BatchSamplerShard`` deals
the plain Trainer. accelerate still wraps the sampler (device placement, end of data), but its
shard wrapper is made a passthrough (``num_processes=1``, as the Trainer does for its rank-aware
``BatchRebalanceSampler``) since the sampler already shards.

The position saved in a checkpoint (entry ``data``, the same on every rank) is *what the optimizer
steps consumed*: the epoch's start position plus ``global batch`` per optimizer step since, not
what the dataloader drew (accelerate prefetches a batch, workers prefetch more). On resume the
sampler continues there by itself, so the Trainer must not skip batches as well: during the
resumed epoch its ``skip_first_batches`` is a passthrough, its step bookkeeping untouched.

That is equivalent to the uninterrupted run only if every optimizer step takes as many samples as
before: the global batch (per device x world size x accumulation) the checkpoint was trained with.
Another one is accepted, as the Trainer accepts it (with a warning): the sampler continues at the
saved sample position and the Trainer enters the saved epoch skipping nothing, so no sample of the
epoch is skipped or repeated; the Trainer's own rule (``global_step % steps per epoch`` batches of
the new size) is not used. ``ignore_data_skip=True`` starts the epoch's data from its beginning,
as the Trainer documents that flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import has_length

from shardsafe.api.checkpoint import load
from shardsafe.compat.accelerate import make_shard_passthrough
from shardsafe.compat.transformers import (
    get_dataloader,
    skips_batches_by_function,
    train_batch_size,
    trainer_skips_nothing,
)
from shardsafe.data.sampler import ReshardableSampler
from shardsafe.errors import StateMismatchError
from shardsafe.integrations.transformers.checkpoints import DATA

__all__ = ["ReshardableDataTrainer"]

log = logging.getLogger(__name__)


def global_batch(trainer: Any) -> dict[str, int]:
    """Samples per optimizer step and its factors, as the Trainer runs now."""
    args = trainer.args
    world, per_device, accumulation = (
        max(1, int(args.world_size)),
        train_batch_size(trainer),
        int(args.gradient_accumulation_steps),
    )
    return {
        "global_batch": world * per_device * accumulation,
        "world_size": world,
        "per_device": per_device,
        "accumulation": accumulation,
    }


def _describe(batch: dict[str, Any]) -> str:
    ranks = "rank" if batch["world_size"] == 1 else "ranks"
    return (
        f"{batch['global_batch']} ({batch['world_size']} {ranks} x {batch['per_device']} per device x "
        f"{batch['accumulation']} accumulation steps)"
    )


def fallback_reason(trainer: Any) -> str | None:
    """Why the Trainer's own sampler is kept (its position does not reshard), or None to use a ReshardableSampler."""
    dataset, args = trainer.train_dataset, trainer.args
    if dataset is None:
        return "no train_dataset"
    if isinstance(dataset, torch.utils.data.IterableDataset) or not has_length(dataset):
        return "the train dataset is iterable (no __len__): its order is the dataset's own"
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        return f"train_sampling_strategy={strategy!r} has its own sampler"
    config = trainer.accelerator.dataloader_config
    if getattr(config, "split_batches", False) or getattr(config, "dispatch_batches", None):
        return "accelerator_config split_batches / dispatch_batches deal the batches from one process"
    if (
        getattr(trainer.accelerator, "torch_device_mesh", None) is not None
        or getattr(trainer.accelerator, "parallelism_config", None) is not None
    ):
        return "a device mesh (tensor, context or sequence parallelism) decides which ranks share data"
    if not skips_batches_by_function():
        return "this transformers version skips resumed batches another way"
    return None


class DataOrder:
    """The train sampler and the position the optimizer steps reached in it: the checkpoint's ``data`` entry.

    A state value (``state_dict`` / ``load_state_dict``), the same on every rank. ``load_state_dict``
    only keeps what was saved; :meth:`resume` checks it against this run and moves the sampler there.
    """

    def __init__(self, sampler: ReshardableSampler, batch: dict[str, int], global_step: Callable[[], int]) -> None:
        self.sampler = sampler
        self.batch = batch
        self._global_step = global_step
        # (epoch, global step, position) where this run entered the epoch
        self._anchor: tuple[int, int, int] | None = None
        self._saved: dict[str, Any] | None = None
        self._resumed_epoch: int | None = None
        self.other_batch = False  # resumed from a checkpoint trained with another global batch
        self._trainer_skip: tuple[int, int] | None = None  # (epoch, samples) the Trainer skips itself on a fallback

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler.state_dict()
        if self._anchor is not None:
            epoch, step, start = self._anchor
            consumed = start + (self._global_step() - step) * self.batch["global_batch"]
            sampler.update(epoch=epoch, consumed=min(consumed, sampler["dataset_length"]))
        return {"sampler": sampler, **self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = dict(state)

    def resume(self, checkpoint: str, *, ignore_data_skip: bool) -> None:
        """Continue the saved position (collective-free: every rank holds the same state); refuse another global
        batch."""
        saved, self._saved = self._saved, None
        if saved is None or ignore_data_skip:
            return
        try:
            then = {k: int(saved[k]) for k in ("global_batch", "world_size", "per_device", "accumulation")}
            sampler = saved["sampler"]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateMismatchError(
                f"{checkpoint}: its 'data' entry is not a ShardsafeTrainer data position ({type(exc).__name__}: {exc})"
            ) from None
        changed = _changed_dataset(sampler, self.sampler.state_dict())
        if changed:
            # the saved position is a place in another order: the Trainer's own rule, as without a data position
            log.warning(
                "%s was trained on another train dataset (%s): its data position does not apply; the Trainer's rule "
                "does (it skips the batches of global_step's place in the epoch, at this run's batch size)",
                checkpoint,
                changed,
            )
            return
        if then["global_batch"] != self.batch["global_batch"]:
            # accepted, as the Trainer accepts it: the position is in samples, so the order goes on where it stopped
            log.warning(
                "%s was trained with a global batch of %s; this run has %s: the data order continues at the saved "
                "sample position, each optimizer step now takes %d samples (the step counts, the scheduler's horizon "
                "and the epoch bookkeeping no longer describe the same training)",
                checkpoint,
                _describe(then),
                _describe(self.batch),
                self.batch["global_batch"],
            )
            self.other_batch = True
        try:
            self.sampler.load_state_dict(sampler)
        except ValueError as exc:
            raise StateMismatchError(
                f"{checkpoint}: the saved data position does not fit this train dataset: {exc}"
            ) from None
        self._resumed_epoch = self.sampler.epoch

    def resumed_epoch(self) -> tuple[int, int] | None:
        """After a resume from another global batch: (the epoch the Trainer must enter, 0 batches to skip) so that
        the sampler, not the Trainer's step arithmetic at the new batch, decides where the data goes on; None
        otherwise (the Trainer's own arithmetic is the sampler's at the same global batch)."""
        if not self.other_batch or self._resumed_epoch is None:
            return None
        state = self.sampler.state_dict()
        if state["consumed"] >= state["dataset_length"]:  # saved at the end of its epoch: the next one starts fresh
            self._resumed_epoch = None
            return state["epoch"] + 1, 0
        return self._resumed_epoch, 0

    def trainer_skips(self, epoch: int, micro_batches: int) -> None:
        """The Trainer resumes by its own rule (no usable saved position): it enters ``epoch`` skipping
        ``micro_batches`` batches on each rank, so the positions saved in that epoch count those samples too."""
        if self._resumed_epoch is None:
            self._trainer_skip = (epoch, micro_batches * self.batch["per_device"] * self.batch["world_size"])

    def begin_epoch(self, epoch: int, global_step: int) -> bool:
        """Called as the Trainer starts ``epoch``: True if the sampler resumes inside it (the Trainer must then skip
        nothing)."""
        resumes = self._resumed_epoch == epoch
        self._resumed_epoch = None
        skipped = self._trainer_skip[1] if self._trainer_skip is not None and self._trainer_skip[0] == epoch else 0
        self._trainer_skip = None
        # keeps a restored position of this epoch; accelerate's set_epoch may not reach the sampler
        self.sampler.set_epoch(epoch)
        self._anchor = (epoch, global_step, self.sampler.state_dict()["consumed"] if resumes else skipped)
        return resumes


class ReshardableDataTrainer(Trainer):
    """The ``Trainer`` hooks of the data order (``ShardsafeTrainer`` is one): the train dataloader, the epoch, the
    resume."""

    _data: DataOrder | None = None  # the train sampler and its position, when it reshards

    def get_train_dataloader(self) -> Any:
        """The Trainer's train dataloader, its sampler a ``ReshardableSampler`` when the dataset is sized."""
        reason = fallback_reason(self)
        if reason is not None:
            self._data = None
            log.info(
                "ShardsafeTrainer keeps the Trainer's sampler (%s): a resume continues the data order only at the same "
                "world size",
                reason,
            )
            return super().get_train_dataloader()
        loader, self._data = reshardable_train_dataloader(self)
        return loader

    def _run_epoch(self, model: Any, epoch: int, train_dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's epoch; in a resumed epoch whose sampler continues by itself, the Trainer skips no batches."""
        resumes = self._data is not None and self._data.begin_epoch(epoch, self.state.global_step)
        with trainer_skips_nothing() if resumes else nullcontext():
            return super()._run_epoch(model, epoch, train_dataloader, *args, **kwargs)

    def _restore_data_order(self, path: str, saved: bool) -> None:
        """The sampler's saved position (collective), checked against this run's global batch before anything else is
        loaded."""
        if self._data is None:
            return
        if not saved:
            log.warning(
                "%s holds no data position: the Trainer skips batches per rank, right only at the world size it was "
                "saved at",
                path,
            )
            return
        load(path, {DATA: self._data})
        self._data.resume(path, ignore_data_skip=self.args.ignore_data_skip)


def _changed_dataset(saved: Any, now: dict[str, Any]) -> str:
    """How the train dataset differs from the one a saved sampler state walked ("" if not, or if the state is
    malformed: the sampler's own check then refuses it)."""
    if not isinstance(saved, dict):
        return ""
    keys = ("dataset_length", "shuffle")
    return ", ".join(f"{k} {saved[k]!r}, now {now[k]!r}" for k in keys if k in saved and saved[k] != now[k])


def reshardable_train_dataloader(trainer: Any) -> tuple[Any, DataOrder]:
    """The Trainer's train dataloader (its collator, workers, accelerate wrapping) with a ReshardableSampler."""
    args = trainer.args
    world, rank = max(1, int(args.world_size)), int(args.process_index) if args.world_size > 1 else 0
    made: list[ReshardableSampler] = []

    def sampler_fn(dataset: Any) -> ReshardableSampler:
        made.append(
            ReshardableSampler(
                dataset,
                num_replicas=world,
                rank=rank,
                shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
                seed=args.data_seed if args.data_seed is not None else args.seed,
                drop_last=args.dataloader_drop_last,
                block=train_batch_size(trainer),
            )
        )
        return made[-1]

    loader = get_dataloader(trainer, sampler_fn)
    make_shard_passthrough(loader, made[0])  # the sampler already shards
    return loader, DataOrder(made[0], global_batch(trainer), lambda: int(trainer.state.global_step))
