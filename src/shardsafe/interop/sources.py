"""Which reader a checkpoint folder needs: DCP (``.metadata``), DeepSpeed ZeRO (``latest`` + tag folders), else
shardsafe's own."""

from __future__ import annotations

import os

from shardsafe.api.source import CheckpointSource
from shardsafe.errors import ShardsafeError
from shardsafe.interop.dcp_metadata import is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint
from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint
from shardsafe.interop.deepspeed_reader import open_source as open_deepspeed_or_shardsafe

__all__ = ["open_source"]


def open_source(
    path: str | os.PathLike[str], key: str = "model", *, verify: bool = True
) -> DcpCheckpoint | DeepSpeedCheckpoint | CheckpointSource:
    """The export source for ``path``: a :class:`DcpCheckpoint`, a DeepSpeed checkpoint, or a shardsafe
    ``CheckpointSource``."""
    if is_dcp_folder(path):
        if not isinstance(key, str):
            raise ShardsafeError(f"{path}: key must be a string")
        return DcpCheckpoint(path, key)
    return open_deepspeed_or_shardsafe(path, key, verify=verify)
