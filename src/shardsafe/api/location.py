"""Where a checkpoint lives: a local folder, or a prefix on an object store."""

from __future__ import annotations

import os
from pathlib import Path

from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir, is_url, local_path_of

__all__ = ["location", "shown"]


def location(path: str | os.PathLike[str] | RemoteDir) -> Path | RemoteDir:
    """A local folder, or a prefix on an object store for fsspec URLs such as ``s3://bucket/ckpt``."""
    if not isinstance(path, (str, os.PathLike)):
        return path  # already a folder
    if is_url(path):
        return RemoteDir(str(path))
    return Path(local_path_of(path)).absolute()


def shown(folder: Path | RemoteDir) -> str:
    """The folder as errors and summaries name it."""
    return as_location(folder).url
