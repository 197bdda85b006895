"""The private parts of Accelerate that shardsafe touches.

Checked against accelerate ``CHECKED`` (below).

=============================================================  ================================================
touched                                                        why
=============================================================  ================================================
``Accelerator._models``, ``_optimizers``, ``_schedulers``,     what ``save_state`` saves, read as the
``_dataloaders``, ``_custom_objects``                          Accelerator's own ``save_state`` reads them
                                                               (:func:`registries`)
``accelerate.data_loader.BatchSamplerShard``:                  set to 1 and 0, making the shard wrapper a
``num_processes``, ``process_index`` (set)                     passthrough for a sampler that already shards
                                                               (:func:`make_shard_passthrough`)
=============================================================  ================================================
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shardsafe.compat import missing

__all__ = ["CHECKED", "Registries", "is_deepspeed", "make_shard_passthrough", "registries"]

CHECKED = ">=1.3, checked on 1.3.0 and 1.16.0 (make test-compat, 2026-12-03)"


class Registries(NamedTuple):
    """What an Accelerator has prepared or registered, in registration order."""

    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    dataloaders: list[Any]
    custom_objects: list[Any]


def registries(accelerator: Any) -> Registries:
    """The Accelerator's private registries (``_models`` ...), as its ``save_state`` reads them."""
    found = []
    for attr in ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects"):
        value = getattr(accelerator, attr, None)
        if value is None:
            raise missing("accelerate", f"Accelerator.{attr}", CHECKED)
        found.append(list(value))
    return Registries(*found)


def is_deepspeed(accelerator: Any) -> bool:
    """Whether the Accelerator runs DeepSpeed."""
    from accelerate.utils import DistributedType

    return bool(accelerator.distributed_type == DistributedType.DEEPSPEED)


def make_shard_passthrough(loader: Any, sampler: Any) -> None:
    """Make accelerate's ``BatchSamplerShard`` around ``loader``'s batches a passthrough: ``sampler`` already gives each
    rank its share.

    Raises CompatError if ``sampler`` is not where the wrapper keeps it (a changed wrapping).
    """
    from accelerate.data_loader import BatchSamplerShard

    outer = getattr(loader, "batch_sampler", None)
    inner = outer.batch_sampler if isinstance(outer, BatchSamplerShard) else outer
    if getattr(inner, "sampler", None) is not sampler:
        raise missing("accelerate", f"the train sampler inside its {type(outer).__name__}.batch_sampler", CHECKED)
    if isinstance(outer, BatchSamplerShard):
        if not (hasattr(outer, "num_processes") and hasattr(outer, "process_index")):
            raise missing("accelerate", "BatchSamplerShard.num_processes / process_index", CHECKED)
        outer.num_processes, outer.process_index = 1, 0
