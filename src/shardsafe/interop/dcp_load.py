"""``shardsafe.load(dcp_folder, state)``: a DCP checkpoint loaded (resharded, any world size) through a conversion.

Registered with :mod:`shardsafe.api.foreign` when the package is imported. Every rank converts the
folder (:func:`~shardsafe.interop.dcp_convert.convert_dcp`: restricted reads, sizes checked) into a
private temporary folder (``TMPDIR``), the ranks agree that every conversion succeeded, and the load
is then an ordinary shardsafe load of it: all its checks, its atomicity, its resharding. The cost is
one local copy of the checkpoint per process for the duration of the load; for large checkpoints run
``shardsafe convert`` once and load the result.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from shardsafe.api.foreign import ForeignFormat, register_format
from shardsafe.api.load import load
from shardsafe.core.comm import get_comm
from shardsafe.errors import FormatError
from shardsafe.interop.dcp_convert import convert_dcp
from shardsafe.interop.dcp_metadata import is_dcp_folder


def load_dcp(folder: Path, state: dict[str, Any], *, process_group: Any = None, **options: Any) -> dict[str, Any]:
    """Load the DCP folder into ``state`` like :func:`shardsafe.load` (collective; ``options``: strict, verify, atomic)."""
    comm = get_comm(process_group)
    with tempfile.TemporaryDirectory(prefix="shardsafe-dcp-") as scratch:
        converted = Path(scratch) / "converted"
        problem: Exception | None = None
        try:
            convert_dcp(folder, converted, fsync=False)
        except Exception as exc:  # every rank learns of it and raises the same error
            problem = exc
        comm.agree(problem, default=FormatError)
        return load(converted, state, process_group=process_group, **options)


register_format(
    ForeignFormat(
        "torch.distributed.checkpoint (DCP)",
        is_dcp_folder,
        "DCP records no hashes to verify: `shardsafe inspect` checks its metadata, `shardsafe convert SRC OUT` reads every item",
        load_dcp,
    )
)
