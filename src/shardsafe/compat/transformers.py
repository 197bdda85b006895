"""The private parts of ``transformers.Trainer`` that ``ShardsafeTrainer`` touches.

Checked against transformers ``CHECKED`` (below). ``ShardsafeTrainer`` also overrides these private
``Trainer`` methods, keeping their signatures: ``_save_checkpoint``, ``_load_from_checkpoint``,
``_prepare_for_training``, ``_run_epoch``, ``_finalize_training``, ``_load_rng_state``,
``_load_best_model`` (:func:`check_trainer` refuses a Trainer without them, so an override can never
silently stop being called).

=================================================  ==========================================================
touched                                            why
=================================================  ==========================================================
``transformers.trainer.skip_first_batches``        replaced by a passthrough while a resumed epoch runs
                                                   (:func:`trainer_skips_nothing`): the sampler continues by itself
``Trainer._train_batch_size``                      the per-device batch the dataloader is built with
``Trainer._get_dataloader``                        the Trainer's train dataloader, with shardsafe's sampler
``Trainer._get_output_dir``                        where the Trainer puts ``checkpoint-<step>``
``TrainingArguments.save_total_limit`` (swapped)   hidden from ``_finalize_training`` (:func:`save_total_limit_hidden`)
``Trainer.hp_search_backend``, ``store_flos``      the Trainer's own bookkeeping in ``_save_checkpoint``
``Trainer.init_hf_repo(private=)``                 the keyword is newer than 5.3: passed only where it exists
                                                   (:func:`init_hf_repo`; older ones read ``args.hub_private_repo``)
=================================================  ==========================================================
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import transformers.trainer as hf_trainer
from transformers import Trainer

from shardsafe.compat import missing

__all__ = [
    "CHECKED",
    "OVERRIDDEN",
    "check_trainer",
    "get_dataloader",
    "init_hf_repo",
    "run_output_dir",
    "save_total_limit_hidden",
    "skips_batches_by_function",
    "train_batch_size",
    "trainer_skips_nothing",
]

CHECKED = ">=5.3, checked on 5.3.0 and 5.24.0 (make test-compat, 2026-12-03)"
OVERRIDDEN = (
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_prepare_for_training",
    "_run_epoch",
    "_finalize_training",
    "_load_rng_state",
    "_load_best_model",
    "_get_dataloader",
    "_get_output_dir",
)


def check_trainer() -> None:
    """Raise CompatError if the installed Trainer lacks a private method ShardsafeTrainer overrides or calls."""
    for name in OVERRIDDEN:
        if not callable(getattr(Trainer, name, None)):
            raise missing("transformers", f"Trainer.{name}", CHECKED)


def skips_batches_by_function() -> bool:
    """Whether the Trainer skips resumed batches through ``transformers.trainer.skip_first_batches`` (what is
    patched)."""
    return callable(getattr(hf_trainer, "skip_first_batches", None))


def train_batch_size(trainer: Any) -> int:
    """The per-device train batch size the Trainer builds its dataloader with (``Trainer._train_batch_size``)."""
    size = getattr(trainer, "_train_batch_size", None)
    if size is None:
        raise missing("transformers", "Trainer._train_batch_size", CHECKED)
    return int(size)


def get_dataloader(trainer: Any, sampler_fn: Callable[[Any], Any]) -> Any:
    """The Trainer's train dataloader (collator, workers, accelerate wrapping) with the sampler ``sampler_fn`` makes."""
    build = getattr(trainer, "_get_dataloader", None)
    if build is None:
        raise missing("transformers", "Trainer._get_dataloader", CHECKED)
    return build(
        dataset=trainer.train_dataset,
        description="Training",
        batch_size=train_batch_size(trainer),
        sampler_fn=sampler_fn,
        is_training=True,
    )


def run_output_dir(trainer: Any, trial: Any) -> str:
    """The run folder the Trainer saves ``checkpoint-<step>`` into (``Trainer._get_output_dir``)."""
    return str(trainer._get_output_dir(trial=trial))


@contextmanager
def trainer_skips_nothing() -> Iterator[None]:
    """While the resumed epoch runs, the Trainer's ``skip_first_batches`` returns the dataloader as it is.

    The Trainer keeps its bookkeeping (which micro-step it is at, when to restore the RNG); only
    the data is not skipped twice, since the sampler itself continues at the saved position.
    """
    if not skips_batches_by_function():
        raise missing("transformers", "transformers.trainer.skip_first_batches", CHECKED)
    original = hf_trainer.skip_first_batches
    hf_trainer.skip_first_batches = _passthrough
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


def _passthrough(dataloader: Any, num_batches: int = 0) -> Any:
    return dataloader


@contextmanager
def save_total_limit_hidden(args: Any) -> Iterator[None]:
    """``args.save_total_limit`` is None inside (the Trainer's end-of-training deletion then deletes nothing), restored
    after."""
    limit = args.save_total_limit
    args.save_total_limit = None
    try:
        yield
    finally:
        args.save_total_limit = limit


def init_hf_repo(trainer: Any, token: str | None, private: bool | None) -> None:
    """``trainer.init_hf_repo``, with ``private`` where this transformers takes it (else it reads
    ``args.hub_private_repo``)."""
    if "private" in inspect.signature(trainer.init_hf_repo).parameters:
        trainer.init_hf_repo(token=token, private=private)
    else:
        trainer.init_hf_repo(token=token)
