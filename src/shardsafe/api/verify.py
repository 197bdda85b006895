"""``verify``: a checkpoint checked completely - manifest, state tree, every file's size and
safetensors header (the checks every load runs on the files it opens), every per-rank index
(format version 2+: its hash, and every box of every part of every rule present in it), every block hash."""

from __future__ import annotations

import os
from typing import Any

from shardsafe.api.foreign import refuse_foreign
from shardsafe.api.location import location, shown
from shardsafe.core.values import check_state_tree
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage.remote import RemoteDir

__all__ = ["verify"]


def verify(path: str | os.PathLike[str] | RemoteDir) -> dict[str, Any]:
    """Check a checkpoint completely: manifest, state file, shard headers and every block hash.

    Reads a few hash blocks at a time (file by file, in order), each into its reading thread's
    scratch buffer: at most 64 MiB of buffers. Not collective: one process checks everything.

    Args:
        path: a checkpoint folder (local path or object-store URL).

    Returns:
        A summary dict: ``path``, ``format_version``, ``world_size``, ``tensors``, ``files``,
        ``indexes``, ``bytes_checked``, ``state_entries`` (the state file's top-level keys) and the
        user ``metadata``.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path``.
        FormatError: a file is missing, damaged or hostile (names the file and tensor).
        IntegrityError: a block hash does not match (names the tensor and block).
    """
    folder = location(path)
    refuse_foreign(folder)  # a DCP folder, ...: say so (see api/foreign.py)
    manifest, tree = open_checkpoint(folder)
    check_state_tree(tree, f"{shown(folder)}/{manifest.state_file}", manifest)
    with ChunkReader(folder, manifest, verify=True) as reader:
        for name in manifest.files:
            reader.open_file(None, name)  # and its index (format version 2), checked against the manifest
        # every part of every rule
        stored = {key: reader.chunks_of(key, entry) for key, entry in manifest.tensors.items()}
        reader.run(
            [
                check
                for key, chunks in stored.items()
                for chunk in chunks
                for check in reader.whole_chunk_checks(key, chunk)
            ]
        )
        checked = sum(chunk.end - chunk.begin for chunks in stored.values() for chunk in chunks)
    return {
        "path": shown(folder),
        "format_version": manifest.format_version,
        "world_size": manifest.world_size,
        "tensors": len(manifest.tensors),
        "files": len(manifest.files),
        "indexes": sum(1 for f in manifest.files.values() if f.index is not None),
        "bytes_checked": checked,
        "state_entries": sorted(tree),
        "metadata": manifest.metadata,
    }
