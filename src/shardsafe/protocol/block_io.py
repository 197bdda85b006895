"""Doing block reads: each hash block of a chunk read (into its destination, the rest into scratch)
and hashed, on a few threads, one sequential stream per file region.

Reads use positional reads straight into the destination tensor's memory; to verify a partial
read they also read the rest of the first and last hash block into the reading thread's scratch
buffer, so no read needs more than one block of extra memory per thread. A local block is read
and hashed :data:`PIECE_BYTES` at a time, so each piece is hashed while still in the CPU's cache
(a check's pieces all pass through the same scratch bytes). A block verified once is
not hashed again by the same executor (an atomic load's second pass), and on an object store the
first :data:`REMOTE_CACHE_BYTES` of checked blocks are kept so a small state is not downloaded
twice. The files come from :class:`~shardsafe.protocol.shard_files.ShardFiles`; which reads to do,
from :mod:`shardsafe.protocol.transfer`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from shardsafe.core.format import ChunkEntry
from shardsafe.core.integrity import BlockHasher
from shardsafe.core.parallel import TaskRunner
from shardsafe.errors import IntegrityError
from shardsafe.protocol.shard_files import ShardFiles

__all__ = ["PIECE_BYTES", "READ_SCRATCH_BYTES", "READ_THREADS", "REMOTE_CACHE_BYTES", "BlockExecutor", "BlockRead"]

REMOTE_CACHE_BYTES = 64 << 20
READ_THREADS = 4  # files read at once per reader on a local filesystem (each thread keeps up to one block of scratch)
READ_SCRATCH_BYTES = 64 << 20  # scratch for all reading threads together: fewer threads when hash blocks are large
# A local block is read and hashed a piece at a time, each piece hashed while it is still in the CPU's cache (and a
# check's pieces land in the same few scratch bytes): one pass over memory instead of a write and a read of a whole
# block (~20% less CPU for a check read from the page cache, measured here).
PIECE_BYTES = 1 << 20


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


class BlockExecutor:
    """Does :class:`BlockRead` lists over one checkpoint's files (see the module doc)."""

    def __init__(self, files: ShardFiles, block: int, verify: bool = True) -> None:
        self.files = files
        self.block = block
        self.verify = verify
        self._verified: set[tuple[str | None, str, int, int]] = set()  # (checkpoint, file, chunk begin, block)
        self._local = threading.local()  # each reading thread's scratch block and own stream
        self._runner = TaskRunner(max(1, min(READ_THREADS, READ_SCRATCH_BYTES // block)))
        # Object stores only: verified blocks kept for the second pass of an atomic load, so a small
        # state is not downloaded twice (bounded; larger states are fetched again).
        self._cache: dict[tuple[str | None, str, int, int], bytes] = {}
        self._cache_left = REMOTE_CACHE_BYTES if files.remote else 0

    def close(self) -> None:
        self._runner.close()

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
        if self.files.remote:
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
        stream = self.files.source.stream(self.files.open(reads[0].chunk)) if own_stream and reads else None
        self._local.stream = stream
        try:
            for read in reads:
                self._do(read)
        finally:
            self._local.stream = None
            if stream is not None:
                os.close(stream)

    def _do(self, read: BlockRead) -> None:
        """One block read (the unit a format without block hashes overrides, see interop/dcp_reader.py)."""
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
        where = _Where(self.files, reads[0])
        if not self.verify and all(read.dest is not None for read in reads):
            self.read_raw(
                chunk, [read.dest for read in reads if read.dest is not None], chunk.begin + reads[0].lo, where
            )
            return
        todo = [read for read in reads if not self._checked_before(read)]  # only a span of one can have one
        if not todo:
            return
        if len(todo) == 1 and not self.files.remote:
            self._read_in_pieces(todo[0], where if todo[0] is reads[0] else _Where(self.files, todo[0]))
            return
        scratch = self._thread_scratch(sum(self._scratch_bytes(read) for read in todo))
        views_of: list[list[memoryview]] = []
        for read in todo:
            views, scratch = self._views(read, scratch)
            views_of.append(views)
        self.read_raw(
            chunk, [view for views in views_of for view in views], chunk.begin + self._span_of(todo[0])[0], where
        )
        for read, views in zip(todo, views_of):
            self._check_block(read, views, where if read is reads[0] else _Where(self.files, read))

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

    def _read_in_pieces(self, read: BlockRead, where: object) -> None:
        """One local block read and verified :data:`PIECE_BYTES` at a time: its destination's bytes
        in place, the rest (all of it for a check) through this thread's scratch."""
        first, last = self._span_of(read)
        hasher = BlockHasher(self.block)
        offset = read.chunk.begin + first
        pieces: Iterator[list[memoryview]]
        if read.dest is None:
            scratch = self._thread_scratch(min(PIECE_BYTES, last - first))
            pieces = ([scratch[: min(PIECE_BYTES, last - pos)]] for pos in range(first, last, PIECE_BYTES))
        else:
            views, _ = self._views(read, self._thread_scratch(self._scratch_bytes(read)))
            pieces = _in_pieces(views, PIECE_BYTES)
        for piece in pieces:
            self.read_raw(read.chunk, piece, offset, where)
            for view in piece:
                hasher.update(view)
                offset += len(view)
        self._accept(read, hasher.finish()[0], where)

    def _check_block(self, read: BlockRead, views: list[memoryview], where: object) -> None:
        """Hash the block read into ``views``; mark it verified and, for a check, cache it (bounded)."""
        hasher = BlockHasher(self.block)
        for view in views:
            hasher.update(view)
        self._accept(read, hasher.finish()[0], where, views[0])

    def _accept(self, read: BlockRead, digest: str, where: object, checked: memoryview | None = None) -> None:
        """The block's digest against the manifest's; mark it verified and, for a check whose bytes are
        ``checked`` (an object store's), cache them (bounded)."""
        first, last = self._span_of(read)
        if digest != read.chunk.hashes[read.block]:
            raise IntegrityError(
                f"{where}: hash mismatch in block {read.block} (bytes {read.chunk.begin + first}..): "
                "the file is corrupted; restore it or load an earlier checkpoint"
            )
        if last > first:
            self._verified.add(self._ident(read))
        if checked is not None and read.dest is None and last > first and last - first <= self._cache_left:
            self._cache[self._ident(read)] = bytes(checked)
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
        self.files.source.read_into(self.files.open(chunk) if stream is None else stream, views, offset, where)

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


def _in_pieces(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``views`` (consecutive bytes of a file) cut into runs of ``size`` bytes (the last shorter), each a list of
    slices of them."""
    piece: list[memoryview] = []
    left = size
    for view in views:
        while len(view):
            take = min(len(view), left)
            piece.append(view[:take])
            view, left = view[take:], left - take
            if not left:
                yield piece
                piece, left = [], size
    if piece:
        yield piece


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

    def __init__(self, files: ShardFiles, read: BlockRead) -> None:
        self.files, self.read = files, read

    def __str__(self) -> str:
        chunk = self.read.chunk
        return f"{self.files.path_of(chunk)} (tensor {self.read.key!r}, chunk at {list(chunk.offsets)})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
