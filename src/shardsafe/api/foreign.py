"""Folders that are checkpoints of another format: a registry the readers above this layer fill, consulted by load and verify.

The api layer does not import the interop readers (layers import only downward), yet
``shardsafe.load(folder)`` on, say, a DCP folder should say what it is and what to do instead of
"no manifest.json". Readers register a :class:`ForeignFormat` (``shardsafe.interop`` does, when the
package is imported); :func:`refuse_foreign` names the first that recognises a folder lacking a manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import FormatError
from shardsafe.storage.remote import RemoteDir


@dataclass(frozen=True)
class ForeignFormat:
    """A checkpoint format shardsafe reads only through conversion: its name, how to recognise a folder, what to run instead."""

    name: str
    detect: Callable[[Path], bool]
    hint: str


_FORMATS: dict[str, ForeignFormat] = {}


def register_format(fmt: ForeignFormat) -> None:
    """Make :func:`refuse_foreign` recognise ``fmt`` (registering a name again replaces it)."""
    _FORMATS[fmt.name] = fmt


def refuse_foreign(folder: Path | RemoteDir) -> None:
    """Raise :class:`FormatError` when ``folder`` has no manifest and is a checkpoint of a registered foreign format."""
    if isinstance(folder, RemoteDir) or (folder / MANIFEST_NAME).exists():
        return
    for fmt in _FORMATS.values():
        if fmt.detect(folder):
            raise FormatError(f"{folder}: this is a {fmt.name} checkpoint, not a shardsafe one; {fmt.hint}")
