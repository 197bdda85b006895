"""A DCP checkpoint folder as a :class:`~shardsafe.api.source.TensorSource`: whole tensors and plain values, read
safely.

A tensor chunk's item (a ``torch.save`` archive of one contiguous tensor: its bytes are one stored
zip record) is read by :class:`DcpChunkReader`, the reader ``shardsafe.load`` of the folder uses too:
the item's zip directory and pickle are read and checked by the restricted loader
(:func:`~shardsafe.interop.unpickler.locate_tensor`: a tensor of the chunk's dtype and sizes, inside
its record, inside the item), its record checked against its CRC-32, then the bytes wanted are read
by positional reads straight into the destination. A non-tensor value (``step`` ints, optimizer
``param_groups`` entries) is read by a positional read of exactly its item's ``length`` bytes and
unpickled (:func:`~shardsafe.interop.unpickler.load_bytes`) as plain values only. A whole tensor is
allocated only after :mod:`~shardsafe.interop.dcp_metadata` checked its chunks cover it once, so what
a read allocates is bounded by the items' bytes on disk.
"""

from __future__ import annotations

import os
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.source import TensorInfo, find_config_files
from shardsafe.core.format import ChunkEntry, FileEntry, Manifest, TensorEntry
from shardsafe.core.plan import ReadOp
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.interop.dcp_metadata import DcpItem, DcpMetadata, read_metadata
from shardsafe.interop.unpickler import TensorAt, load_bytes, locate_tensor
from shardsafe.protocol.block_io import BlockExecutor, BlockRead
from shardsafe.protocol.shard_files import ShardFiles
from shardsafe.protocol.sources import FileHandle, LocalSource
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage.local import FileWindow, safe_child
from shardsafe.storage.remote import RemoteDir

__all__ = ["DcpBlocks", "DcpCheckpoint", "DcpChunkReader", "DcpFiles", "dcp_manifest", "format_dcp"]

CRC_PIECE = 8 << 20  # the scratch buffer a record's CRC-32 is computed through


def dcp_manifest(meta: DcpMetadata, keys: dict[str, str]) -> Manifest:
    """The manifest of a DCP folder: each tensor under its shardsafe key, each chunk at its item's
    bytes in its ``.distcp`` file (no hashes: DCP records none), each file with the size it had."""
    tensors = {}
    for fqn, tensor in meta.tensors.items():
        chunks = tuple(
            ChunkEntry(c.offsets, c.sizes, c.item.file, c.item.offset, c.item.offset + c.item.length, ())
            for c in tensor.chunks
        )
        tensors[keys[fqn]] = TensorEntry(tensor.dtype, tensor.shape, chunks)
    files = {name: FileEntry(size, 0) for name, size in meta.file_sizes.items()}
    info = {"format": "torch.distributed.checkpoint", "version": meta.version, "folder": str(meta.folder)}
    return Manifest(
        world_size=1, tensors=tensors, files=files, state_size=0, state_hash="", metadata={"converted_from": info}
    )


class DcpFiles(ShardFiles):
    """A DCP folder's files: a chunk is a ``.distcp`` item, located (and checked against the chunk)
    before any byte of it is used, its record checked against its CRC-32 once."""

    source: LocalSource  # a DCP folder is a local Path

    def __init__(self, folder: Path | RemoteDir, manifest: Manifest) -> None:
        super().__init__(folder, manifest)
        self._dtypes = {
            (c.file, c.begin): (key, entry.dtype) for key, entry in manifest.tensors.items() for c in entry.chunks
        }
        self._located: dict[tuple[str, int], TensorAt] = {}
        self._crc_checked: set[tuple[str, int]] = set()

    def open(self, chunk: ChunkEntry) -> FileHandle:
        """The open file of ``chunk`` (sized as the metadata found it), its item located and checked."""
        self.locate(chunk)
        return self.source.open(None, chunk.file)[0]

    def locate(self, chunk: ChunkEntry) -> TensorAt:
        """Where ``chunk``'s tensor bytes are inside its item (read and checked once)."""
        ident = (chunk.file, chunk.begin)
        found = self._located.get(ident)
        if found is not None:
            return found
        fd, size = self.source.open(None, chunk.file)
        path = self.source.describe(None, chunk.file)
        if size != self.manifest.files[chunk.file].size:
            raise IntegrityError(
                f"{path}: {size} bytes, {self.manifest.files[chunk.file].size} when the metadata was read (changed or "
                "truncated)"
            )
        key, dtype = self._dtypes[ident]
        where = f"{path} (tensor {key!r:.200} at {list(chunk.offsets)}, bytes {chunk.begin}..{chunk.end})"
        found = locate_tensor(FileWindow(fd, chunk.begin, chunk.end - chunk.begin), chunk.end - chunk.begin, where)
        if found.dtype != dtype or found.shape != chunk.shape:
            raise FormatError(
                f"{where}: holds {found.dtype} {list(found.shape)}, the metadata says {dtype} {list(chunk.shape)}"
            )
        self._located[ident] = found
        return found

    def crc_checked(self, chunk: ChunkEntry) -> bool:
        return (chunk.file, chunk.begin) in self._crc_checked

    def check_crc(self, chunk: ChunkEntry, found: TensorAt) -> None:
        """The record holding ``chunk``'s tensor, read whole through a bounded scratch buffer, against its CRC-32 (once
        per reader)."""
        if self.crc_checked(chunk):
            return
        start, length, expected = found.record
        self.expect_crc(chunk, self.crc_through_scratch(chunk, chunk.begin + start, length), expected)

    def crc_through_scratch(self, chunk: ChunkEntry, offset: int, length: int, crc: int = 0) -> int:
        """``crc`` carried over ``length`` bytes of ``chunk``'s file from ``offset``, read through a bounded scratch."""
        path = self.source.describe(None, chunk.file)
        scratch = memoryview(bytearray(min(length, CRC_PIECE)))
        done = 0
        while done < length:
            piece = scratch[: min(len(scratch), length - done)]
            self.source.read_into(self.open(chunk), [piece], offset + done, path)
            crc = zlib.crc32(piece, crc)
            done += len(piece)
        return crc

    def expect_crc(self, chunk: ChunkEntry, crc: int, expected: int) -> None:
        """``chunk``'s record is checked when ``crc`` (computed over all of it) is ``expected``; else IntegrityError."""
        ident = (chunk.file, chunk.begin)
        if crc != expected:
            key = self._dtypes[ident][0]
            raise IntegrityError(
                f"{self.source.describe(None, chunk.file)}: the item of tensor {key!r:.200} at {list(chunk.offsets)} "
                f"(bytes {chunk.begin}..{chunk.end}) fails its CRC-32 check: the file is corrupted"
            )
        self._crc_checked.add(ident)


class DcpBlocks(BlockExecutor):
    """Block reads over a DCP folder: no block hashes (DCP records none), so a read is one positional
    read of its bytes inside the item, the record's CRC-32 checked first with ``verify``.

    A tensor read whole into place with ``verify`` (an ``atomic=False`` load, a fresh optimizer's
    state) is one pass instead: its record's CRC-32 is computed over the bytes as they land in the
    destination (and the record's bytes around them, read through scratch), so its bytes are read
    once, not once to check and once more into place. The load's agreement still comes after the
    check: a mismatch raises, and the destination is one the load may overwrite before agreeing."""

    files: DcpFiles

    def run(self, reads: list[BlockRead]) -> None:
        whole, rest = self._whole_tensors(reads)
        if whole:
            self._runner.run([partial(self._read_whole, chunk_reads) for chunk_reads in whole])
        if rest:
            super().run(rest)

    def _whole_tensors(self, reads: list[BlockRead]) -> tuple[list[list[BlockRead]], list[BlockRead]]:
        """``reads`` split into those of tensors read whole into place (per chunk, in order) whose record is not
        checked yet, and the rest."""
        if not self.verify:
            return [], reads
        by_chunk: dict[tuple[str, int], list[BlockRead]] = {}
        for read in reads:
            by_chunk.setdefault((read.chunk.file, read.chunk.begin), []).append(read)
        whole: list[list[BlockRead]] = []
        rest: list[BlockRead] = []
        for chunk_reads in by_chunk.values():
            chunk_reads.sort(key=lambda r: r.lo)
            chunk = chunk_reads[0].chunk
            found = self.files.locate(chunk)
            start, length, _ = found.record
            covered = 0
            for read in chunk_reads:
                covered = read.hi if read.dest is not None and read.lo == covered else -1
            if (
                covered == found.nbytes
                and not self.files.crc_checked(chunk)
                and start <= found.start
                and found.start + found.nbytes <= start + length
            ):
                whole.append(chunk_reads)
            else:
                rest += chunk_reads
        return whole, rest

    def _read_whole(self, reads: list[BlockRead]) -> None:
        """One tensor's bytes into place, its record's CRC-32 carried over them and the record's bytes around them."""
        chunk = reads[0].chunk
        found = self.files.locate(chunk)
        start, length, expected = found.record
        crc = self.files.crc_through_scratch(chunk, chunk.begin + start, found.start - start)
        where = self._where(reads[0])
        handle = self.files.open(chunk)
        for read in reads:
            assert read.dest is not None
            self.files.source.read_into(handle, [read.dest], chunk.begin + found.start + read.lo, where)
            crc = zlib.crc32(read.dest, crc)
        end = found.start + found.nbytes
        crc = self.files.crc_through_scratch(chunk, chunk.begin + end, start + length - end, crc)
        self.files.expect_crc(chunk, crc, expected)

    def _do(self, read: BlockRead) -> None:
        if read.dest is None or read.hi <= read.lo:
            return
        chunk = read.chunk
        found = self.files.locate(chunk)
        if self.verify:
            self.files.check_crc(chunk, found)
        self.files.source.read_into(
            self.files.open(chunk), [read.dest], chunk.begin + found.start + read.lo, self._where(read)
        )

    def _where(self, read: BlockRead) -> str:
        """How an error of ``read`` names its place: the file, the tensor and the chunk's offsets."""
        chunk = read.chunk
        return f"{self.files.source.describe(None, chunk.file)} (tensor {read.key!r:.200} at {list(chunk.offsets)})"


class DcpChunkReader(ChunkReader):
    """:class:`ChunkReader`'s reads over a DCP folder: its files are :class:`DcpFiles` and its reads
    :class:`DcpBlocks`; the read planning and the direct or staged copies into the destinations
    are the base class's, except what a check reads (:meth:`check_reads`)."""

    files_type = DcpFiles
    executor_type = DcpBlocks
    files: DcpFiles

    def check_reads(self, key: str, op: ReadOp, saved_dtype: torch.dtype) -> list[BlockRead]:
        """What the reads for ``op`` will read, checked now, nothing written: the item located and, with
        ``verify``, its record's CRC-32 (DCP stores no block hashes: there are no block checks to return)."""
        found = self.files.locate(op.chunk)
        if self.verify:
            self.files.check_crc(op.chunk, found)
        return []


class DcpCheckpoint:
    """A DCP checkpoint folder: tensors under ``key`` (``model``) for export, and every tensor and value for
    conversion."""

    default_dtype: torch.dtype | None = None
    aliases_recorded = True  # a DCP state dict holds tied weights once per name; export writes them as saved
    total_parameters: int | None = None

    def __init__(self, path: str | os.PathLike[str], key: str = "model") -> None:
        self.folder = self.model_folder = Path(path).absolute()
        self.meta: DcpMetadata = read_metadata(self.folder)
        self.key = key
        self._names: dict[str, str] = {}
        for fqn in self.meta.tensors:
            name = self._export_name(fqn)
            if name is not None:
                self._names[name] = fqn
        if not self._names and key:
            keys = sorted({str(p[0]) for p in self.meta.paths.values()})
            raise FormatError(
                f"{self.folder}: no tensors under {key!r} (the DCP checkpoint holds {keys}); pick one with key=/--key"
            )
        self.aliases: dict[str, str] = {}
        self._reader: DcpChunkReader | None = None  # opened at the first tensor read

    def _export_name(self, fqn: str) -> str | None:
        path = self.meta.paths.get(fqn, (fqn,))
        if not self.key:
            return fqn
        if path[0] == self.key and len(path) > 1:
            return ".".join(str(p) for p in path[1:])
        return None

    def tie(self, aliases: dict[str, str]) -> None:
        """Tied weights are saved under each name by DCP; nothing to leave out."""

    def tensors(self) -> list[TensorInfo]:
        return [
            TensorInfo(name, self.meta.tensors[fqn].dtype, self.meta.tensors[fqn].shape)
            for name, fqn in self._names.items()
        ]

    def read(self, name: str) -> torch.Tensor:
        return self.read_fqn(self._names[name])

    def read_fqn(self, fqn: str) -> torch.Tensor:
        """The whole tensor saved under the flattened key ``fqn``, assembled from its chunks (each record's CRC-32
        checked)."""
        if self._reader is None:
            self._reader = DcpChunkReader(self.folder, dcp_manifest(self.meta, {f: f for f in self.meta.tensors}))
        return self._reader.read_tensor(fqn, self._reader.manifest.tensors[fqn])

    def value(self, fqn: str) -> Any:
        """The non-tensor value saved under ``fqn`` (a ``torch.save`` pickle of plain values and tensors)."""
        item = self.meta.values[fqn]
        return load_bytes(self._item_bytes(item), f"{self.folder / item.file} (value {fqn[:120]!r})")

    def _item_bytes(self, item: DcpItem) -> bytearray:
        path = safe_child(self.folder, item.file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size != self.meta.file_sizes[item.file]:
                raise FormatError(f"{path}: changed size since the metadata was read")
            buffer = bytearray(item.length)
            view = memoryview(buffer)
            done = 0
            while done < item.length:
                n = os.preadv(fd, [view[done:]], item.offset + done)
                if n <= 0:
                    raise FormatError(f"{path}: ends before byte {item.offset + item.length}")
                done += n
            return buffer
        finally:
            os.close(fd)

    def config_files(self) -> dict[str, Path]:
        return find_config_files(self.folder)

    def describe(self) -> dict[str, Any]:
        """What the folder holds, for ``shardsafe inspect``."""
        return {
            "folder": str(self.folder),
            "format": "torch.distributed.checkpoint",
            "version": self.meta.version,
            "files": dict(sorted(self.meta.file_sizes.items())),
            "tensors": {
                fqn: (str(t.dtype).removeprefix("torch."), list(t.shape), len(t.chunks))
                for fqn, t in self.meta.tensors.items()
            },
            "values": sorted(self.meta.values),
        }

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_dcp(info: dict[str, Any]) -> str:
    """``shardsafe inspect``'s text for a DCP folder (:meth:`DcpCheckpoint.describe`)."""
    lines = [
        f"{info['folder']}: torch.distributed.checkpoint (DCP {info['version']}), {len(info['files'])} data files, "
        f"{sum(info['files'].values())} bytes"
    ]
    for fqn, (dtype, shape, chunks) in info["tensors"].items():
        lines.append(f"  {fqn!r:60} {dtype:10} {shape}  {chunks} chunk{'s' if chunks != 1 else ''}")
    lines.extend(f"  {fqn!r:60} value" for fqn in info["values"])
    return "\n".join(lines)
