"""Reading tensor bytes back: verified byte ranges of a committed checkpoint's files.

Reads use positional reads straight into the destination tensor's memory; to verify a partial
read they also read the rest of the first and last hash block into the reading thread's scratch
buffer, so no read needs more than one block of extra memory per thread. (Writing a rank's shard
file is ``protocol/shard_write.py``.)

Every file a reader opens is checked first, the same way for ``load`` and ``verify``: its size
against the manifest, its safetensors header (it must parse, and list every chunk the manifest
places in the file with the same byte range, dtype and shape), and, for a chunk stored in another
checkpoint of the same root (dedup), that checkpoint must be committed and its manifest must list
the file with the size it has.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardsafe.core.format import (
    MAX_HEADER_BYTES,
    ChunkEntry,
    Manifest,
    TensorEntry,
    element_size,
    numel,
    parse_manifest,
    parse_safetensors_header,
)
from shardsafe.core.index import IndexParts, parse_index
from shardsafe.core.integrity import BlockHasher
from shardsafe.core.parallel import TaskRunner
from shardsafe.core.plan import ReadOp, candidate_chunks, contiguous_span, plan_reads
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.protocol.device_read import read_into_cuda
from shardsafe.protocol.sources import FileHandle, LocalSource, RemoteSource
from shardsafe.storage.local import tensor_bytes
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

__all__ = ["BlockRead", "ChunkReader", "HEAD_READ_BYTES", "REMOTE_CACHE_BYTES", "ReadRequest", "ReadTarget"]

REMOTE_CACHE_BYTES = 64 << 20
READ_THREADS = 4  # files read at once per reader on a local filesystem (each thread keeps up to one block of scratch)
READ_SCRATCH_BYTES = 64 << 20  # scratch for all reading threads together: fewer threads when hash blocks are large
STAGED_BATCH_BYTES = 64 << 20  # staging slabs (boxes not read straight into place) held per batch of reads
HEAD_READ_BYTES = 64 << 10  # the first read of a shard file: its header length and, usually, the whole header


class ChunkReader:
    """Positional, verified reads from a committed checkpoint's files."""

    def __init__(self, folder: Path | RemoteDir, manifest: Manifest, verify: bool = True) -> None:
        self.source: LocalSource | RemoteSource = as_location(folder).choose(local=LocalSource, remote=RemoteSource)
        self.manifest = manifest
        self.verify = verify
        self.block = manifest.hash_block_size
        self._checked: dict[tuple[str | None, str], FileHandle] = {}  # (checkpoint, file) -> its handle, once checked
        self._indexes: dict[int, IndexParts] = {}  # rank -> its index, parsed and checked once
        self._by_file: dict[tuple[str | None, str], list[tuple[str, torch.dtype, ChunkEntry]]] | None = None
        self._verified: set[tuple[str | None, str, int, int]] = set()  # (checkpoint, file, chunk begin, block)
        self._local = threading.local()  # each reading thread's scratch block
        self._open_lock = threading.RLock()  # reading threads may open a file first (a sibling's, in verify)
        self._runner = TaskRunner(max(1, min(READ_THREADS, READ_SCRATCH_BYTES // self.block)))
        # Object stores only: verified blocks kept for the second pass of an atomic load, so a small
        # state is not downloaded twice (bounded; larger states are fetched again).
        self._cache: dict[tuple[str | None, str, int, int], bytes] = {}
        self._cache_left = REMOTE_CACHE_BYTES if isinstance(self.source, RemoteSource) else 0

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.close()
        self.source.close()

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
            where = self.source.describe(None, found[1].index.file) if found is not None and found[1].index is not None else f"rank {writer}"
            raise FormatError(f"{where}: lists no box at {list(offsets)} of tensor {key!r:.200}, which its layout rule places there")
        return chunk

    def plan(self, key: str, entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[ReadOp]:
        """The reads that fill the box (offsets, shape) of ``key``, parts of a rule resolved through the indexes."""
        return plan_reads(entry, offsets, shape, lambda writer, at: self.part(key, writer, at))

    def chunks_of(self, key: str, entry: TensorEntry) -> list[ChunkEntry]:
        """Every stored chunk of ``key`` (for a rule, every non-empty part: reads every index it needs)."""
        return candidate_chunks(entry, (0,) * len(entry.shape), entry.shape, lambda writer, at: self.part(key, writer, at))

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
            raise IntegrityError(f"{where}: file is {size} bytes, the manifest expects {max(expected, needed)} (truncated or altered)")
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
                f"{where}: a chunk refers to checkpoint {checkpoint!r}, which is not a committed checkpoint next to this one"
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
            raise FormatError(f"{where}: safetensors header length {length} runs past the end of the file ({size} bytes)")
        head = bytes(first[: 8 + length])
        if 8 + length > len(first):
            rest = memoryview(bytearray(8 + length - len(first)))
            self.source.read_into(handle, [rest], len(first), where)
            head += bytes(rest)
        by_range = {(begin, end): (dtype, shape) for dtype, shape, begin, end in parse_safetensors_header(head, size, where).values()}
        for key, dtype, chunk in chunks:
            found = by_range.get((chunk.begin, chunk.end))
            if found is None or found[0] != dtype or tuple(found[1]) != chunk.shape:
                shown = "no entry" if found is None else f"{found[0]} {list(found[1])}"
                raise FormatError(
                    f"{where}: the safetensors header disagrees with the manifest for tensor {key!r} chunk at {list(chunk.offsets)} "
                    f"(bytes [{chunk.begin}, {chunk.end}): manifest {dtype} {list(chunk.shape)}, header {shown})"
                )

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
        return listed + [(key, self.manifest.tensors[key].dtype, c) for key, boxes in parts.items() for c in boxes.values()]

    @property
    def remote(self) -> bool:
        return isinstance(self.source, RemoteSource)

    def check_reads(self, key: str, op: ReadOp, saved_dtype: torch.dtype) -> list[BlockRead]:
        """The block checks that cover what :meth:`plan_into` would read for ``op``, writing nowhere.

        Opens the file (checking its size); with ``verify``, every hash block the read touches is
        to be read into scratch and hashed (by :meth:`run`). Reading the rows of the chunk that
        the box spans covers both ways :meth:`plan_into` may read it.
        """
        chunk = op.chunk
        self.open(chunk)
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

    def run(self, reads: list[BlockRead]) -> None:
        """Do ``reads``: each file's in file order, one reading thread per file, up to
        :data:`READ_THREADS` files at a time on a local (or shared) filesystem.

        One sequential stream per file is what keeps the disk busy: the kernel reads ahead of it
        (the source asks for sequential readahead), so the next blocks are in flight while a block
        is copied and hashed (xxh3, ~1 ms per 16 MiB block); several threads on one file would
        break that pattern and read slower. Each read is independent: a check reads its block into
        the thread's scratch buffer, a read fills its destination (and, with ``verify``, the rest
        of its block into that scratch) and hashes the block. An object store is read one request
        at a time, and the reads of consecutive blocks of a chunk are one request (see :meth:`_spans`).
        """
        by_file: dict[tuple[str, str], list[BlockRead]] = {}
        for read in sorted(reads, key=lambda r: (r.chunk.checkpoint or "", r.chunk.file, r.chunk.begin + r.lo)):
            by_file.setdefault((read.chunk.checkpoint or "", read.chunk.file), []).append(read)
        if self.remote:
            for file_reads in by_file.values():
                for span in self._spans(file_reads):
                    self._do_span(span)
            return
        streams = max(1, self._runner.threads // max(1, len(by_file)))
        tasks = []
        for file_reads in by_file.values():
            regions = _regions(file_reads, streams)
            tasks += [partial(self._do_each, region, own_stream=len(regions) > 1) for region in regions]
        self._runner.run(tasks)

    def _do_each(self, reads: list[BlockRead], own_stream: bool = False) -> None:
        """Do ``reads`` in order; ``own_stream``: through an open file of this thread's own (a region
        of a file other threads read too), so the kernel reads ahead of each region separately."""
        stream = self.source.stream(self.open(reads[0].chunk)) if own_stream and reads else None
        self._local.stream = stream
        try:
            for read in reads:
                self._do(read)
        finally:
            self._local.stream = None
            if stream is not None:
                os.close(stream)

    def _do(self, read: BlockRead) -> None:
        self._do_span([read])

    def _spans(self, reads: list[BlockRead]) -> list[list[BlockRead]]:
        """``reads`` (one file's, in file order) cut into runs that one ranged GET can serve.

        A GET costs a round trip however few bytes it asks for, so the blocks of one chunk that
        follow each other are fetched together (as a read of a whole range was before reads were
        split per block), up to :data:`READ_SCRATCH_BYTES` per request (the response is held in
        memory whole). A block already checked, or kept in the cache, is never part of a run: it
        costs no request.
        """
        spans: list[list[BlockRead]] = []
        size = 0
        for read in reads:
            first, last = self._span_of(read)
            prev = spans[-1][-1] if spans else None
            joins = (
                prev is not None
                and not self._costs_nothing(prev)
                and not self._costs_nothing(read)
                and prev.chunk.begin == read.chunk.begin
                and read.block == prev.block + 1
                and self._span_of(prev)[1] == first
                and size + last - first <= READ_SCRATCH_BYTES
            )
            if joins:
                spans[-1].append(read)
                size += last - first
            else:
                spans.append([read])
                size = last - first
        return spans

    def _span_of(self, read: BlockRead) -> tuple[int, int]:
        """The bytes of its chunk that ``read`` fetches: the whole block when verifying."""
        if read.dest is not None and not self.verify:
            return read.lo, read.hi
        return read.block * self.block, min((read.block + 1) * self.block, read.chunk.end - read.chunk.begin)

    def _ident(self, read: BlockRead) -> tuple[str | None, str, int, int]:
        # A chunk's bytes are its own (no two chunks share any), so its begin names it.
        return (read.chunk.checkpoint, read.chunk.file, read.chunk.begin, read.block)

    def _checked_before(self, read: BlockRead) -> bool:
        """A check of a block this reader verified already. An empty chunk may begin where the next
        one does, so it is never marked (its check is free anyway)."""
        first, last = self._span_of(read)
        return read.dest is None and last > first and self._ident(read) in self._verified

    def _costs_nothing(self, read: BlockRead) -> bool:
        """A check of a block already verified, or a block whose verified bytes are cached."""
        return self._checked_before(read) or self._ident(read) in self._cache

    def _do_span(self, reads: list[BlockRead]) -> None:
        """Do ``reads`` (consecutive blocks of one chunk, see :meth:`_spans`) with one source read,
        then hash each block on its own, in order (the first damaged block is the one reported)."""
        chunk = reads[0].chunk
        where = _Where(self, reads[0])
        if not self.verify and all(read.dest is not None for read in reads):
            self.read_raw(chunk, [read.dest for read in reads if read.dest is not None], chunk.begin + reads[0].lo, where)
            return
        todo = [read for read in reads if not self._checked_before(read)]  # only a span of one can have one
        if not todo:
            return
        scratch = self._thread_scratch(sum(self._scratch_bytes(read) for read in todo))
        views_of: list[list[memoryview]] = []
        for read in todo:
            views, scratch = self._views(read, scratch)
            views_of.append(views)
        self.read_raw(chunk, [view for views in views_of for view in views], chunk.begin + self._span_of(todo[0])[0], where)
        for read, views in zip(todo, views_of):
            self._check_block(read, views, where if read is reads[0] else _Where(self, read))

    def _scratch_bytes(self, read: BlockRead) -> int:
        first, last = self._span_of(read)
        return last - first - (0 if read.dest is None else len(read.dest))

    def _views(self, read: BlockRead, scratch: memoryview) -> tuple[list[memoryview], memoryview]:
        """Where the bytes of ``read``'s block go (its destination, the rest into ``scratch``), and the scratch left."""
        first, last = self._span_of(read)
        if read.dest is None:
            return [scratch[: last - first]], scratch[last - first :]
        head, tail = read.lo - first, last - read.hi
        return [scratch[:head], read.dest, scratch[head : head + tail]], scratch[head + tail :]

    def _check_block(self, read: BlockRead, views: list[memoryview], where: object) -> None:
        """Hash the block read into ``views``; mark it verified and, for a check, cache it (bounded)."""
        first, last = self._span_of(read)
        hasher = BlockHasher(self.block)
        for view in views:
            hasher.update(view)
        if hasher.finish()[0] != read.chunk.hashes[read.block]:
            raise IntegrityError(
                f"{where}: hash mismatch in block {read.block} (bytes {read.chunk.begin + first}..): "
                "the file is corrupted; restore it or load an earlier checkpoint"
            )
        if last > first:
            self._verified.add(self._ident(read))
        if read.dest is None and last > first and last - first <= self._cache_left:
            self._cache[self._ident(read)] = bytes(views[0])
            self._cache_left -= last - first

    def _thread_scratch(self, size: int) -> memoryview:
        """This thread's scratch buffer (a whole block, or the head and tail of a partial one), grown
        to ``size`` when needed: at most one block per reading thread."""
        scratch: memoryview | None = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < size:
            scratch = self._local.scratch = memoryview(bytearray(size))
        return scratch

    def read_raw(self, chunk: ChunkEntry, views: list[memoryview], offset: int, where: object) -> None:
        if self._cache and self._from_cache(chunk, views, offset):
            return
        stream = getattr(self._local, "stream", None)  # this thread's own open file of the region it reads
        self.source.read_into(self.open(chunk) if stream is None else stream, views, offset, where)

    def _from_cache(self, chunk: ChunkEntry, views: list[memoryview], offset: int) -> bool:
        """Fill ``views`` from cached verified blocks when they hold every byte asked for."""
        lo = offset - chunk.begin
        hi = lo + sum(len(v) for v in views)
        if hi <= lo:
            return False
        first = lo // self.block
        blocks = []
        for i in range(first, (hi - 1) // self.block + 1):
            cached = self._cache.get((chunk.checkpoint, chunk.file, chunk.begin, i))
            if cached is None:
                return False
            blocks.append(cached)
        data = memoryview(b"".join(blocks))[lo - first * self.block : hi - first * self.block]
        pos = 0
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)
        return True

    def read_tensor(self, key: str, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor ``key``, from every chunk that holds it.

        Every file is opened (and its size checked against the manifest) before the tensor is
        allocated, so a manifest cannot make the reader allocate more than the files hold.
        """
        zeros = (0,) * len(entry.shape)
        ops = self.plan(key, entry, zeros, entry.shape)
        for op in ops:
            self.open(op.chunk)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_all([ReadRequest(key, op, entry.dtype, out, zeros) for op in ops])
        return out

    def read_elements(self, key: str, chunk: ChunkEntry, dtype: torch.dtype, start: int, stop: int, dest: memoryview) -> None:
        """Read elements [start, stop) of ``chunk`` into ``dest``, verifying the blocks touched."""
        es = element_size(dtype)
        self.run(self.block_reads(key, chunk, start * es, stop * es, dest))

    def read_into(self, key: str, op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]) -> None:
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

    def plan_into(self, key: str, op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]) -> PlannedRead:
        """The block reads that put the box of ``op`` into ``dest``: straight into its memory when
        the box is contiguous in both and the dtype and device match, else into a slab of the
        chunk's rows that ``finish`` copies from."""
        chunk = op.chunk
        self.open(chunk)
        src = contiguous_span(op.offsets, op.shape, chunk.offsets, chunk.shape)
        dst = contiguous_span(op.offsets, op.shape, dest_offsets, tuple(dest.shape))
        es = element_size(saved_dtype)
        direct = src is not None and dst is not None and dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == saved_dtype
        if direct:
            assert src is not None and dst is not None
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


def _regions(reads: list[BlockRead], streams: int) -> list[list[BlockRead]]:
    """One file's ``reads`` (in file order) cut into up to ``streams`` runs of about equal bytes,
    each read by its own thread as a sequential stream: one process reading one large file keeps
    several requests in flight, as several ranks reading their own files do (on this machine a
    cold 1.2 GB file read as 4 streams took 0.95 s, as one 1.60 s; ``cat`` 0.79 s)."""
    if streams <= 1 or len(reads) < 2 * streams:
        return [reads]
    total = sum(r.hi - r.lo for r in reads)
    out: list[list[BlockRead]] = [[]]
    done = 0
    for read in reads:
        if out[-1] and done >= total * len(out) / streams and len(out) < streams:
            out.append([])
        out[-1].append(read)
        done += read.hi - read.lo
    return out


class _Where:
    """Where a block read is, for its errors: built only if one is raised (reads of small tensors are many)."""

    def __init__(self, reader: ChunkReader, read: BlockRead) -> None:
        self.reader, self.read = reader, read

    def __str__(self) -> str:
        chunk = self.read.chunk
        return f"{self.reader.path_of(chunk)} (tensor {self.read.key!r}, chunk at {list(chunk.offsets)})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


@dataclass(frozen=True)
class BlockRead:
    """The bytes of one hash block of a chunk that a read needs, and where they go.

    ``lo``/``hi`` are byte offsets inside the chunk, within block ``block``. With ``dest`` the
    bytes [lo, hi) are read into it (and, when verifying, the rest of the block into scratch, so
    the whole block is hashed); without, the block is only checked.
    """

    key: str
    chunk: ChunkEntry
    block: int
    lo: int
    hi: int
    dest: memoryview | None


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
