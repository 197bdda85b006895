"""Reading tensor bytes back: which byte ranges of which files fill a rank's tensors.

:class:`ChunkReader` is what a load, a verify and a conversion hold: it plans reads (a box of a
destination tensor -> the block reads of the stored chunks that overlap it, straight into place or
through a staging slab) over two parts with one job each:

* :class:`~shardsafe.protocol.shard_files.ShardFiles`: the checkpoint's files, opened and checked
  once each (size, header, sibling commit), and the per-rank indexes;
* :class:`~shardsafe.protocol.block_io.BlockExecutor`: doing the block reads, verified, on a few
  threads.

A foreign format replaces the parts it reads differently (``interop/dcp_reader.py``: a ``.distcp``
item located in its archive, CRC-32 instead of block hashes) and keeps the planning. (Writing a
rank's shard file is ``protocol/shard_write.py``.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from shardsafe.core.format import ChunkEntry, Manifest, TensorEntry, element_size, numel
from shardsafe.core.index import IndexParts
from shardsafe.core.integrity import hash_blocks
from shardsafe.core.plan import ReadOp, contiguous_span
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.protocol.block_io import BlockExecutor, BlockRead
from shardsafe.protocol.device_read import read_into_cuda
from shardsafe.protocol.shard_files import ShardFiles
from shardsafe.protocol.sources import FileHandle, LocalSource, RemoteSource
from shardsafe.storage.local import MappedFile, tensor_bytes
from shardsafe.storage.remote import RemoteDir

__all__ = ["STAGED_BATCH_BYTES", "ChunkReader", "PlannedRead", "ReadRequest", "ReadTarget", "direct_span"]

STAGED_BATCH_BYTES = 64 << 20  # staging slabs (boxes not read straight into place) held per batch of reads


def direct_span(
    op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]
) -> tuple[int, int] | None:
    """The elements [start, stop) of ``dest`` that the box of ``op`` fills, when its stored bytes can go
    straight into that memory: ``dest`` a contiguous CPU tensor of the stored dtype, the box
    contiguous in it. Else None (the bytes go through a buffer and a copy)."""
    if dest.device.type != "cpu" or dest.dtype != saved_dtype or not dest.is_contiguous():
        return None
    return contiguous_span(op.offsets, op.shape, dest_offsets, tuple(dest.shape))


class ChunkReader:
    """Positional, verified reads from a committed checkpoint's files: planning over its files and its executor.

    Call order: plan (:meth:`plan`, :meth:`check_reads`, :meth:`plan_into`), then :meth:`run` the
    block reads (or :meth:`read_all` for both), then :meth:`close` (or use it as a context manager).
    """

    files_type: type[ShardFiles] = ShardFiles
    executor_type: type[BlockExecutor] = BlockExecutor

    def __init__(self, folder: Path | RemoteDir, manifest: Manifest, verify: bool = True) -> None:
        self.manifest = manifest
        self.block = manifest.hash_block_size
        self.files = self.files_type(folder, manifest)
        self.blocks = self.executor_type(self.files, self.block, verify)
        self._mapped: dict[tuple[str | None, str], MappedFile] = {}  # files mapped by :meth:`mapped_chunk`

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self.blocks.close()
        self.files.close()

    @property
    def verify(self) -> bool:
        """Whether reads are hashed (an atomic load turns it off for its second, local pass)."""
        return self.blocks.verify

    @verify.setter
    def verify(self, value: bool) -> None:
        self.blocks.verify = value

    @property
    def source(self) -> LocalSource | RemoteSource:
        return self.files.source

    @property
    def remote(self) -> bool:
        return self.files.remote

    def index(self, rank: int) -> IndexParts:
        return self.files.index(rank)

    def plan(self, key: str, entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[ReadOp]:
        return self.files.plan(key, entry, offsets, shape)

    def chunks_of(self, key: str, entry: TensorEntry) -> list[ChunkEntry]:
        return self.files.chunks_of(key, entry)

    def open_file(self, checkpoint: str | None, file: str, needed: int = 0) -> FileHandle:
        return self.files.open_file(checkpoint, file, needed)

    def run(self, reads: list[BlockRead]) -> None:
        """Do ``reads`` (:meth:`BlockExecutor.run <shardsafe.protocol.block_io.BlockExecutor.run>`)."""
        self.blocks.run(reads)

    def check_reads(self, key: str, op: ReadOp, saved_dtype: torch.dtype) -> list[BlockRead]:
        """The block checks that cover what :meth:`plan_into` would read for ``op``, writing nowhere.

        Opens the file (checking its size); with ``verify``, every hash block the read touches is
        to be read into scratch and hashed (by :meth:`run`). Reading the rows of the chunk that
        the box spans covers both ways :meth:`plan_into` may read it.
        """
        chunk = op.chunk
        self.files.open(chunk)
        if not self.verify:
            return []
        if chunk.shape:
            row_elems = numel(chunk.shape[1:])
            row0 = op.offsets[0] - chunk.offsets[0]
            start, stop = row0 * row_elems, (row0 + op.shape[0]) * row_elems
        else:
            start, stop = 0, 1
        es = element_size(saved_dtype)
        return self.block_reads(key, chunk, start * es, stop * es, None)

    def block_reads(self, key: str, chunk: ChunkEntry, lo: int, hi: int, dest: memoryview | None) -> list[BlockRead]:
        """Bytes [lo, hi) of ``chunk`` (into ``dest``, or only checked), one :class:`BlockRead` per hash block."""
        out = []
        for i in range(lo // self.block, -(-hi // self.block)):
            s, e = max(lo, i * self.block), min(hi, (i + 1) * self.block)
            out.append(BlockRead(key, chunk, i, s, e, None if dest is None else dest[s - lo : e - lo]))
        return out

    def whole_chunk_checks(self, key: str, chunk: ChunkEntry) -> list[BlockRead]:
        """A check of every hash block of ``chunk`` (an empty chunk's one block included)."""
        size = chunk.end - chunk.begin
        return self.block_reads(key, chunk, 0, size, None) if size else [BlockRead(key, chunk, 0, 0, 0, None)]

    def read_unverified(self, key: str, chunk: ChunkEntry, dest: memoryview) -> None:
        """The bytes of ``chunk`` into ``dest`` as its file holds them (opened and sized, not hashed):
        for a rank that sends them to ranks which verify them (:meth:`verify_received`)."""
        self.files.open(chunk)
        self.blocks.read_raw(chunk, [dest], chunk.begin, f"{self.files.path_of(chunk)} (tensor {key!r})")

    def mapped_chunk(self, chunk: ChunkEntry) -> torch.Tensor | None:
        """The bytes of ``chunk`` as a view of its file's mapped pages (opened and sized, not hashed,
        the pages mapped in), to send without a copy; None on an object store. Only for files the
        job owns (a node's tier folder): a file that shrinks under the mapping raises SIGBUS."""
        if self.remote:
            return None
        ident = (chunk.checkpoint, chunk.file)
        mapped = self._mapped.get(ident)
        if mapped is None:
            handle = self.files.open(chunk)
            assert isinstance(handle, int)  # a local file descriptor
            fd = os.dup(handle)
            try:
                mapped = self._mapped[ident] = MappedFile(fd, os.fstat(fd).st_size, writable=False)
            except BaseException:
                os.close(fd)
                raise
        mapped.populate(chunk.begin, chunk.end)
        return mapped.bytes[chunk.begin : chunk.end]

    def verify_received(self, key: str, chunk: ChunkEntry, data: memoryview, sender: str) -> None:
        """Check the bytes of ``chunk`` that ``sender`` read from its copy of the file against every
        block hash the manifest gives; :class:`IntegrityError` naming the file, the sender and the block."""
        digests = hash_blocks([data], self.block)
        for block, (got, expected) in enumerate(zip(digests, chunk.hashes)):
            if got != expected:
                raise IntegrityError(
                    f"{chunk.file} as {sender} read it (tensor {key!r}, chunk at {list(chunk.offsets)}): hash "
                    f"mismatch in block {block} (bytes {chunk.begin + block * self.block}..): the file is corrupted "
                    f"in {sender}'s copy; restore it or load an earlier checkpoint"
                )
        if len(digests) != len(chunk.hashes):
            raise IntegrityError(
                f"{chunk.file} as {sender} read it (tensor {key!r}): a block count unlike the manifest's"
            )

    def read_tensor(self, key: str, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor ``key``, from every chunk that holds it.

        Every file is opened (and its size checked against the manifest) before the tensor is
        allocated, so a manifest cannot make the reader allocate more than the files hold.
        """
        zeros = (0,) * len(entry.shape)
        ops = self.plan(key, entry, zeros, entry.shape)
        for op in ops:
            self.files.open(op.chunk)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_all([ReadRequest(key, op, entry.dtype, out, zeros) for op in ops])
        return out

    def read_elements(
        self, key: str, chunk: ChunkEntry, dtype: torch.dtype, start: int, stop: int, dest: memoryview
    ) -> None:
        """Read elements [start, stop) of ``chunk`` into ``dest``, verifying the blocks touched."""
        es = element_size(dtype)
        self.run(self.block_reads(key, chunk, start * es, stop * es, dest))

    def read_into(
        self, key: str, op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]
    ) -> None:
        """Copy the box of ``op`` into ``dest`` (which holds the box at ``dest_offsets``)."""
        self.read_all([ReadRequest(key, op, saved_dtype, dest, dest_offsets)])

    def read_all(self, items: list[ReadRequest], checks: list[BlockRead] | None = None) -> None:
        """Copy the box of every request into its destination
        (and do the block ``checks``, from :meth:`check_reads`, with the first batch).

        Reads run in batches (:meth:`run`); a box that cannot be read straight into its
        destination is read into a temporary slab first and copied once its batch is read, and a
        batch holds at most :data:`STAGED_BATCH_BYTES` of slabs (or one slab, if larger).
        """
        batch: list[BlockRead] = list(checks or ())
        copies: list[Callable[[], None]] = []
        staged = 0
        for item in items:
            planned = self.plan_into(item.key, item.op, item.saved_dtype, item.dest, item.dest_offsets)
            if planned.staged_bytes and staged and staged + planned.staged_bytes > STAGED_BATCH_BYTES:
                self._finish(batch, copies)
                batch, copies, staged = [], [], 0
            batch += planned.reads
            staged += planned.staged_bytes
            if planned.finish is not None:
                copies.append(planned.finish)
        self._finish(batch, copies)

    def _finish(self, reads: list[BlockRead], copies: list[Callable[[], None]]) -> None:
        self.run(reads)
        for copy in copies:
            copy()

    def plan_into(
        self, key: str, op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]
    ) -> PlannedRead:
        """The block reads that put the box of ``op`` into ``dest``: straight into its memory when
        the box is contiguous in both and the dtype and device match, else into a slab of the
        chunk's rows that ``finish`` copies from."""
        chunk = op.chunk
        self.files.open(chunk)
        src = contiguous_span(op.offsets, op.shape, chunk.offsets, chunk.shape)
        dst = direct_span(op, saved_dtype, dest, dest_offsets)
        es = element_size(saved_dtype)
        if src is not None and dst is not None:
            view = tensor_bytes(dest)[dst[0] * es : dst[1] * es]
            return PlannedRead(self.block_reads(key, chunk, src[0] * es, src[1] * es, view))
        if dest.is_cuda:  # pinned buffers, verified on the host, uploaded on a side stream (device_read.py)
            return PlannedRead([], partial(read_into_cuda, self, key, op, saved_dtype, dest, dest_offsets))
        # Staged path: read the dim-0 slab of the chunk covering the box, then copy the box.
        if not chunk.shape:
            raise FormatError(f"tensor {key!r}: scalar chunk cannot be partially read")
        row0 = op.offsets[0] - chunk.offsets[0]
        rows = op.shape[0]
        row_elems = numel(chunk.shape[1:])
        slab = torch.empty((rows, *chunk.shape[1:]), dtype=saved_dtype)
        reads = self.block_reads(key, chunk, row0 * row_elems * es, (row0 + rows) * row_elems * es, tensor_bytes(slab))

        def copy_box() -> None:
            box = slab
            for d in range(1, len(op.shape)):
                box = box.narrow(d, op.offsets[d] - chunk.offsets[d], op.shape[d])
            target = dest
            for d in range(len(op.shape)):
                target = target.narrow(d, op.offsets[d] - dest_offsets[d], op.shape[d])
            with torch.no_grad():
                target.copy_(box)

        return PlannedRead(reads, copy_box, slab.numel() * es)


@dataclass(frozen=True)
class ReadRequest:
    """Copy the box of ``op`` (a stored chunk's overlap with a destination) into ``dest``, which
    holds the box of the global tensor at ``dest_offsets``; ``saved_dtype`` is the stored dtype
    (a ``strict=False`` load casts)."""

    key: str
    op: ReadOp
    saved_dtype: torch.dtype
    dest: torch.Tensor
    dest_offsets: tuple[int, ...]


@dataclass(frozen=True)
class PlannedRead:
    """The block reads that fill one box, and the copy out of a staging slab to run after them."""

    reads: list[BlockRead]
    finish: Callable[[], None] | None = None
    staged_bytes: int = 0


@dataclass(frozen=True)
class ReadTarget:
    """Where a tensor's part on this rank goes: ``tensor`` holds the box of the global tensor at
    ``offsets``, and each ``(view, offsets)`` of ``more`` another (a ``_StridedShard`` local tensor,
    FSDP2 over tensor parallel, covers several). ``fresh``: the load created the tensor (a fresh
    optimizer's state) and drops it if it fails, so it may be written before the ranks agree."""

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    fresh: bool = False
    more: tuple[tuple[torch.Tensor, tuple[int, ...]], ...] = ()

    def boxes(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Every (destination view, global offsets) of this target."""
        return [(self.tensor, self.offsets), *self.more]
