"""What tests that damage or inspect stored bytes need: every chunk of a tensor as the manifest
(format version 1, listed chunks) or the per-rank indexes (version 2, split rules) place it, on a
local folder or an object store; and saves with small hash blocks, so a few KB of tensors make
dozens of blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME, parse_manifest
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage.remote import RemoteDir, is_url


def stored_chunks(path: str | Path, key: str) -> list[dict[str, Any]]:
    """Every stored chunk of ``key`` in checkpoint ``path`` (a folder or an ``s3://`` URL; JSON form:
    offsets, shape, file, begin, end, hashes, and checkpoint for a dedup reference), in the order of
    their offsets."""
    folder: Path | RemoteDir = RemoteDir(str(path)) if is_url(path) else Path(path)
    raw = (
        folder.read_bytes(MANIFEST_NAME, 1 << 30)
        if isinstance(folder, RemoteDir)
        else (folder / MANIFEST_NAME).read_bytes()
    )
    manifest = parse_manifest(raw)
    with ChunkReader(folder, manifest) as reader:
        chunks = reader.chunks_of(key, manifest.tensors[key])
    return [c.to_json() for c in sorted(chunks, key=lambda c: c.offsets)]


def use_small_blocks(block: int = 4096) -> Callable[[], None]:
    """Make saves in this process hash ``block``-byte blocks (the format allows 4 KiB .. 1 GiB;
    save writes 16 MiB). Returns the undo."""
    import shardsafe.api.save as save_module

    old_size, old_manifest = save_module.HASH_BLOCK_SIZE, save_module.new_manifest

    def new_manifest(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(old_manifest(*args, **kwargs), hash_block_size=block)

    save_module.HASH_BLOCK_SIZE, save_module.new_manifest = block, new_manifest  # type: ignore[assignment]

    def undo() -> None:
        save_module.HASH_BLOCK_SIZE, save_module.new_manifest = old_size, old_manifest  # type: ignore[assignment]

    return undo
