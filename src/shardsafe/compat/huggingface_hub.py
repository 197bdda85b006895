"""The private parts of huggingface_hub that ``shardsafe push`` touches.

Checked against huggingface_hub ``CHECKED`` (below).

=====================================================  ============================================================
touched                                                why
=====================================================  ============================================================
``CommitOperationAdd.as_file(with_tqdm)`` (subclassed)  the LFS upload reads the file through it: a subclass counts
                                                       the bytes read for shardsafe's progress bar
                                                       (:func:`tracked_add_class`)
``CommitOperationAdd.path_or_fileobj``                 the file the upload reads
``huggingface_hub.utils._runtime.is_xet_available``    whether uploads go through Xet (which bypasses ``as_file``)
=====================================================  ============================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from huggingface_hub import CommitOperationAdd

from shardsafe.compat import missing

__all__ = ["CHECKED", "tracked_add_class", "xet_enabled"]

CHECKED = ">=1.3, checked on 1.3.0 and 2.4.0 (make test-compat, 2026-12-03)"


def xet_enabled() -> bool:
    """Whether this huggingface_hub uploads through Xet (private ``utils._runtime.is_xet_available``; False when
    absent)."""
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


_TRACKED_ADD: Any = None


def tracked_add_class() -> Any:
    """``CommitOperationAdd`` whose uploads (the LFS PUT of the file) call ``op.on_read(bytes read so far)``.

    Set ``on_read`` on an instance to follow its upload; without it the upload is the base class's.
    """
    global _TRACKED_ADD
    if _TRACKED_ADD is not None:
        return _TRACKED_ADD
    if not callable(getattr(CommitOperationAdd, "as_file", None)):
        raise missing("huggingface_hub", "CommitOperationAdd.as_file", CHECKED)

    class TrackedAdd(CommitOperationAdd):  # type: ignore[misc]
        on_read: Callable[[int], None] | None = None

        @contextmanager
        def as_file(self, with_tqdm: bool = False) -> Iterator[Any]:
            on_read = self.on_read
            if not with_tqdm or on_read is None or not isinstance(self.path_or_fileobj, str):
                with super().as_file(with_tqdm=with_tqdm) as file:
                    yield file
                return
            with open(self.path_or_fileobj, "rb") as file:
                read = file.read

                def tracked_read(size: int | None = -1) -> bytes:
                    data = read(size)
                    on_read(file.tell())
                    return data

                file.read = tracked_read  # type: ignore[method-assign]
                yield file

    _TRACKED_ADD = TrackedAdd
    return TrackedAdd
