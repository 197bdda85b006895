"""The private names of DeepSpeed's ZeRO-3 that shardsafe touches (DeepSpeed is never imported here).

Checked against deepspeed ``CHECKED`` (below). The non-underscore ZeRO-3 optimizer attributes the
engine adapter reads (``fp32_partitioned_groups_flat``, ``fp16_groups``, ``grad_position``, ...)
are listed, and checked on use, in ``state/zero3.py``; the underscore ones are here.

=====================================================================  ==========================================
touched                                                                why
=====================================================================  ==========================================
``DeepSpeedZeroOptimizer_Stage3._unflatten_partitioned_parameters``   re-point each ``param.ds_tensor`` at the
                                                                       refreshed 16-bit flat partition after a
                                                                       load (:func:`unflatten_partitions`)
``param._z3_optimizer``                                                the ZeRO-3 optimizer a partitioned
                                                                       parameter belongs to (:func:`z3_optimizer`)
=====================================================================  ==========================================
"""

from __future__ import annotations

from typing import Any

from shardsafe.compat import missing

__all__ = ["CHECKED", "unflatten_partitions", "z3_optimizer"]

CHECKED = "declared >=0.14, checked on 0.19.8 only"


def unflatten_partitions(opt: Any, sub_group: int) -> None:
    """Point the parameters of ``sub_group`` at their slices of the 16-bit flat partition again, as DeepSpeed's load
    does."""
    unflatten = getattr(opt, "_unflatten_partitioned_parameters", None)
    if unflatten is None:
        raise missing("deepspeed", f"{type(opt).__name__}._unflatten_partitioned_parameters", CHECKED)
    unflatten(sub_group)


def z3_optimizer(param: Any) -> Any:
    """The ZeRO-3 optimizer DeepSpeed linked ``param`` to (``param._z3_optimizer``), or None when it has none."""
    return getattr(param, "_z3_optimizer", None)
