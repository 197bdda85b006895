"""The files of one committed checkpoint, each opened once and checked before any byte of it is used.

Every file a reader opens is checked first, the same way for ``load`` and ``verify``: its size
against the manifest, its safetensors header (it must parse, and list every chunk the manifest
places in the file with the same byte range, dtype and shape), and, for a chunk stored in another
checkpoint of the same root (dedup), that checkpoint must be committed and its manifest must list
the file with the size it has. The per-rank indexes of format version 2 and later (where the parts
of a layout rule are) are read and checked here too, once each.

Which bytes to read is :mod:`shardsafe.protocol.transfer`'s question; reading and verifying them,
:mod:`shardsafe.protocol.block_io`'s.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from shardsafe.core.format import (
    MAX_HEADER_BYTES,
    ChunkEntry,
    Manifest,
    TensorEntry,
    parse_manifest,
    parse_safetensors_header,
)
from shardsafe.core.index import IndexParts, parse_index
from shardsafe.core.plan import ReadOp, candidate_chunks, plan_reads
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.protocol.sources import FileHandle, LocalSource, RemoteSource
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["HEAD_READ_BYTES", "ShardFiles"]

HEAD_READ_BYTES = 64 << 10  # the first read of a shard file: its header length and, usually, the whole header


class ShardFiles:
    """The files of a committed checkpoint (and of the siblings its chunks point into), opened and
    checked once each, and the indexes that say where a layout rule's parts are. Thread-safe: the
    reading threads open files they reach first."""

    def __init__(self, folder: Path | RemoteDir, manifest: Manifest) -> None:
        self.source: LocalSource | RemoteSource = as_location(folder).choose(local=LocalSource, remote=RemoteSource)
        self.manifest = manifest
        self._checked: dict[tuple[str | None, str], FileHandle] = {}  # (checkpoint, file) -> its handle, once checked
        self._indexes: dict[int, IndexParts] = {}  # rank -> its index, parsed and checked once
        self._by_file: dict[tuple[str | None, str], list[tuple[str, torch.dtype, ChunkEntry]]] | None = None
        self._open_lock = threading.RLock()  # reading threads may open a file first (a sibling's, in verify)

    def close(self) -> None:
        self.source.close()

    @property
    def remote(self) -> bool:
        """Whether the files are in an object store (read one request at a time, see block_io)."""
        return isinstance(self.source, RemoteSource)

    def index(self, rank: int) -> IndexParts:
        """Rank ``rank``'s index (format version 2), read, checked against the manifest, cached."""
        cached = self._indexes.get(rank)
        if cached is not None:
            return cached
        found = self.manifest.index_of_rank(rank)
        if found is None:
            return {}
        file, entry = found
        assert entry.index is not None
        where = self.source.describe(None, entry.index.file)
        data = self.source.read_small(entry.index.file, entry.index.size)
        parts = self._indexes[rank] = parse_index(data, self.manifest, file, where)
        return parts

    def part(self, key: str, writer: int, offsets: tuple[int, ...]) -> ChunkEntry:
        """The box at ``offsets`` of rule-described tensor ``key``: from the index of its writer."""
        chunk = self.index(writer).get(key, {}).get(offsets)
        if chunk is None:
            found = self.manifest.index_of_rank(writer)
            where = (
                self.source.describe(None, found[1].index.file)
                if found is not None and found[1].index is not None
                else f"rank {writer}"
            )
            raise FormatError(
                f"{where}: lists no box at {list(offsets)} of tensor {key!r:.200}, which its layout rule places there"
            )
        return chunk

    def plan(self, key: str, entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[ReadOp]:
        """The reads that fill the box (offsets, shape) of ``key``, parts of a rule resolved through the indexes."""
        return plan_reads(entry, offsets, shape, lambda writer, at: self.part(key, writer, at))

    def chunks_of(self, key: str, entry: TensorEntry) -> list[ChunkEntry]:
        """Every stored chunk of ``key`` (for a rule, every non-empty part: reads every index it needs)."""
        return candidate_chunks(
            entry, (0,) * len(entry.shape), entry.shape, lambda writer, at: self.part(key, writer, at)
        )

    def path_of(self, chunk: ChunkEntry) -> str:
        return self.source.describe(chunk.checkpoint, chunk.file)

    def open(self, chunk: ChunkEntry) -> FileHandle:
        """Open (once) the file holding ``chunk``, checked as :meth:`open_file` says."""
        return self.open_file(chunk.checkpoint, chunk.file, chunk.end)

    def open_file(self, checkpoint: str | None, file: str, needed: int = 0) -> FileHandle:
        """Open (once) a file of this checkpoint (or of sibling ``checkpoint``) and check it before any
        byte of it is used: its size (the manifest's, or the sibling manifest's, and at least
        ``needed``), the sibling's commit, and that its safetensors header agrees with the manifest."""
        if (checkpoint, file) in self._checked:
            return self.source.open(checkpoint, file)[0]
        with self._open_lock:  # one open and one header check per file, whichever thread comes first
            return self._open_checked(checkpoint, file, needed)

    def _open_checked(self, checkpoint: str | None, file: str, needed: int) -> FileHandle:
        ident = (checkpoint, file)
        checked = self._checked.get(ident)
        if checked is not None:
            return checked
        where = self.source.describe(checkpoint, file)
        expected = self.manifest.files[file].size if checkpoint is None else self._sibling_size(checkpoint, file, where)
        handle, size = self.source.open(checkpoint, file)
        if size != expected or size < needed:
            raise IntegrityError(
                f"{where}: file is {size} bytes, the manifest expects {max(expected, needed)} (truncated or altered)"
            )
        self._check_header(checkpoint, file, handle, size, where)  # every chunk in the file: their ends included
        self._checked[ident] = handle
        return handle

    def _sibling_size(self, checkpoint: str, file: str, where: str) -> int:
        """The size a committed sibling checkpoint's manifest gives ``file``: a dedup reference may
        only point into a checkpoint of the same root that lists the file (or a retired one that
        kept its manifest as ``manifest.retained.json`` because later checkpoints use its files)."""
        try:
            data, manifest_where = self.source.sibling_manifest(checkpoint)
        except FileNotFoundError:
            raise IntegrityError(
                f"{where}: a chunk refers to checkpoint {checkpoint!r}, which is not a committed checkpoint next to "
                "this one"
            ) from None
        entry = parse_manifest(data, manifest_where).files.get(file)
        if entry is None:
            raise IntegrityError(f"{where}: checkpoint {checkpoint!r} does not list {file!r} among its files")
        return entry.size

    def _check_header(self, checkpoint: str | None, file: str, handle: Any, size: int, where: str) -> None:
        """The file's safetensors header parses and lists every chunk the manifest places in it with
        the same byte range, dtype and shape (what a safetensors reader of the file sees is what is loaded)."""
        chunks = self._chunks_in(checkpoint, file)
        # The header ends where the first chunk begins (if the manifest is right; else the rest is read
        # below): reading just that keeps a load's reads to the bytes it uses, one request either way.
        data_start = min((c.begin for _, _, c in chunks), default=HEAD_READ_BYTES)
        first = memoryview(bytearray(min(size, HEAD_READ_BYTES, max(8, data_start))))
        self.source.read_into(handle, [first], 0, where)
        length = int.from_bytes(first[:8], "little") if len(first) >= 8 else 0
        if len(first) < 8 or length > MAX_HEADER_BYTES or 8 + length > size:
            raise FormatError(
                f"{where}: safetensors header length {length} runs past the end of the file ({size} bytes)"
            )
        head = bytes(first[: 8 + length])
        if 8 + length > len(first):
            rest = memoryview(bytearray(8 + length - len(first)))
            self.source.read_into(handle, [rest], len(first), where)
            head += bytes(rest)
        by_range = {
            (begin, end): (dtype, shape)
            for dtype, shape, begin, end in parse_safetensors_header(head, size, where).values()
        }
        for key, dtype, chunk in chunks:
            found = by_range.get((chunk.begin, chunk.end))
            if found is None or found[0] != dtype or tuple(found[1]) != chunk.shape:
                shown = "no entry" if found is None else f"{found[0]} {list(found[1])}"
                raise FormatError(
                    f"{where}: the safetensors header disagrees with the manifest for tensor {key!r} chunk at "
                    f"{list(chunk.offsets)} "
                    f"(bytes [{chunk.begin}, {chunk.end}): manifest {dtype} {list(chunk.shape)}, header {shown})"
                )

    def head_bytes(self, file: str) -> int:
        """How many leading bytes of shard ``file`` of this checkpoint opening it reads (its header
        check): up to where its first chunk (or index part) begins."""
        data_start = min((c.begin for _, _, c in self._chunks_in(None, file)), default=HEAD_READ_BYTES)
        return min(self.manifest.files[file].size, max(8, data_start))

    def _chunks_in(self, checkpoint: str | None, file: str) -> list[tuple[str, torch.dtype, ChunkEntry]]:
        """Every chunk the manifest places in the file, and, for a shard of this checkpoint with an
        index, every part its index places there (the index is read and checked first)."""
        if self._by_file is None:
            self._by_file = {}
            for key, entry in self.manifest.tensors.items():
                for c in entry.chunks:
                    self._by_file.setdefault((c.checkpoint, c.file), []).append((key, entry.dtype, c))
        listed = self._by_file.get((checkpoint, file), [])
        info = self.manifest.files.get(file) if checkpoint is None else None
        if info is None or info.index is None:
            return listed
        parts = self.index(info.rank)
        return listed + [
            (key, self.manifest.tensors[key].dtype, c) for key, boxes in parts.items() for c in boxes.values()
        ]
