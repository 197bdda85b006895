"""The collective entry points, ``save``, ``load`` and ``verify`` (one module each), and the pieces of
a save the manager runs separately (``describe_collectively``, then ``write_checkpoint``)."""

from __future__ import annotations

from shardsafe.api.load import load
from shardsafe.api.location import location
from shardsafe.api.save import describe_collectively, save, write_checkpoint
from shardsafe.api.verify import verify

__all__ = [
    "describe_collectively",
    "load",
    "location",
    "save",
    "verify",
    "write_checkpoint",
]
