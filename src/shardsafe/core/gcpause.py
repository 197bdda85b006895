"""Pausing Python's cyclic garbage collector for the length of one load or save.

Parsing a manifest and binding, checking and planning thousands of small tensors allocates many
short-lived objects, none of them cyclic garbage; each allocation burst triggers a collection that
walks the whole heap, and a training process's heap is large. Measured on a 2,000-tensor state
(250 x Linear(64, 64) + AdamW, warm cache): 0.21-0.33 s of CPU per load with the collector, 0.15 s
without. With 16 ranks on one node's cores that difference is paid by every rank.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees everything); the
    collector is turned back on after it only if it was on before (nesting-safe)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
