"""Folders that are checkpoints of another format: a registry the readers above this layer fill, consulted by load and
verify.

The api layer does not import the interop readers (layers import only downward), yet
``shardsafe.load(folder)`` on, say, a DCP folder should say what it is and what to do instead of
"no manifest.json". Readers register a :class:`ForeignFormat` (``shardsafe.interop`` does, when the
package is imported): :func:`foreign_format` finds the one that recognises a folder lacking a
manifest, whose ``load`` (when it has one) ``shardsafe.load`` hands the folder to; :func:`refuse_foreign`
names it where there is nothing to hand to (``verify``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import FormatError
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["ForeignFormat", "foreign_format", "refuse_foreign", "register_format"]


@dataclass(frozen=True)
class ForeignFormat:
    """A checkpoint format shardsafe reads only through conversion: its name, how to recognise a folder, what to run
    instead."""

    name: str
    detect: Callable[[Path], bool]
    hint: str  # what to run instead, where a command cannot read it directly
    load: Callable[..., dict[str, Any]] | None = None  # load(folder, state, process_group=, strict=, verify=, atomic=)


_FORMATS: dict[str, ForeignFormat] = {}


def register_format(fmt: ForeignFormat) -> None:
    """Make :func:`refuse_foreign` recognise ``fmt`` (registering a name again replaces it)."""
    _FORMATS[fmt.name] = fmt


def foreign_format(folder: Path | RemoteDir) -> ForeignFormat | None:
    """The registered format of ``folder`` when it has no manifest and one recognises it, else None."""
    # formats are detected in local folders only
    return as_location(folder).choose(local=_detect, remote=lambda _: None)


def _detect(folder: Path) -> ForeignFormat | None:
    if (folder / MANIFEST_NAME).exists():
        return None
    return next((fmt for fmt in _FORMATS.values() if fmt.detect(folder)), None)


def refuse_foreign(folder: Path | RemoteDir) -> None:
    """Raise :class:`FormatError` when ``folder`` has no manifest and is a checkpoint of a registered foreign format."""
    fmt = foreign_format(folder)
    if fmt is not None:
        raise FormatError(f"{folder}: this is a {fmt.name} checkpoint, not a shardsafe one; {fmt.hint}")
