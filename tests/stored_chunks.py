"""What tests that damage or inspect stored bytes need: every chunk of a tensor as the manifest
(format version 1, listed chunks) or the per-rank indexes (version 2, split rules) place it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME, parse_manifest
from shardsafe.protocol.transfer import ChunkReader


def stored_chunks(path: str | Path, key: str) -> list[dict[str, Any]]:
    """Every stored chunk of ``key`` in checkpoint ``path`` (JSON form: offsets, shape, file, begin,
    end, hashes), in the order of their offsets."""
    path = Path(path)
    manifest = parse_manifest((path / MANIFEST_NAME).read_bytes())
    with ChunkReader(path, manifest) as reader:
        chunks = reader.chunks_of(key, manifest.tensors[key])
    return [c.to_json() for c in sorted(chunks, key=lambda c: c.offsets)]
