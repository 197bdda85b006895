"""Bytes several ranks need, read from storage once per job and passed over the process group.

HSDP replicas, tensor-parallel ranks that all hold a replicated norm, and reshards in which ranks
need the same rows of a stored chunk would each read the same bytes from storage (DCP reads them
once per replica). Here a stored chunk whose byte ranges two or more ranks need is read by one of
them (verified as that rank verifies every read) and sent to the others, which copy their boxes
out of it. Ranks that need disjoint parts of a chunk (an FSDP2 reshard to more ranks) still read
their own parts: no byte is read twice either way.

Call order, on every rank of the load (each step collective, run even by a rank that failed
before it, so none waits alone):

1. :func:`plan_shared`: every rank sends the byte spans of the stored chunks its requests read
   (one ``all_gather``); a chunk whose spans overlap gets one reader, the needer with the fewest
   shared bytes so far (ties: lowest rank), chosen alike on every rank. The result says which of
   this rank's requests it still reads itself (:meth:`SharedPlan.local`).
2. The load's first pass runs :meth:`SharedPlan.exchange_lacked` (chunks of files a rank lacks,
   see below); an atomic one adds :meth:`SharedPlan.checks`: every block of the other chunks
   this rank reads for others is verified before the ranks agree that the load can go ahead.
3. :meth:`SharedPlan.exchange`: in one global order, each batch's reader reads its chunks whole,
   sends them with a last byte that says whether the read succeeded, and every needer copies its
   boxes out of them. A rank whose read failed still sends (the flag says so), so no rank waits
   for bytes that never come; the first problem is returned after the last batch. The messages
   of a batch are all posted at once (``isend``/``irecv``) and waited together: gloo pays a round
   trip per blocking message, which for 60 chunks of 4 MiB nearly doubled the time of a transfer.

Files a rank cannot read (``plan_shared``'s ``lacking``): a node's folder of the local tier may
hold only some of a step's shard files, the rest being in other nodes' folders. Every rank then
names the files it lacks in step 1's ``all_gather``; a chunk in a file one of its needers lacks is
read by a needer that has it or, if none has, by one holder of that file for all such chunks of
it (the holder with the fewest shared bytes when the file is first met, so that different holders
stream different files at once), and sent to the needers that lack it. Such a reader learns the
chunk's record (key, hashes) from the needer in the same ``all_gather``. These *lacked* batches
travel in the load's first pass, before anything live is written
(:meth:`SharedPlan.exchange_lacked`): the reader sends the bytes as its file holds them (a chunk
of :data:`DIRECT_BYTES` or more straight from the file's mapped pages, as a message of its own)
and each receiver hashes them where they land, straight in the tensor the load made for them (a
fresh optimizer's state, dropped if the load fails) or in a buffer kept until the last phase for
a live tensor. The hashing is then done once, where the bytes are needed, and the bytes are copied
once, by the process group.

When to share (``plan_shared``'s ``enabled``): ``True`` always, ``False`` never, ``None`` (what
``load`` passes by default) only when it saves reads from storage: when the ranks run on more than
one node (:mod:`shardsafe.core.nodes`) or the checkpoint is in an object store. Ranks of one node
reading local files share one page cache, so there the second reader of a chunk gets it from
memory, which is cheaper than sending it over the process group (BENCHMARKS.md, "N-D save and
load": 1.99 s shared against 0.86 s not, on one node). The node ids travel in step 1's
``all_gather``, so deciding costs no extra collective.

The bytes travel as CPU tensors over gloo: over the job's own group when it sends CPU tensors with
gloo (``gloo``, ``cpu:gloo,cuda:nccl``), else (NCCL) over a gloo side group with the same ranks,
made once per process when a load first shares (:func:`~shardsafe.core.comm.cpu_transport`); a
receiver copies its boxes from the host bytes into its tensors, on the GPU or not.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from shardsafe.core.comm import Comm, cpu_transport, global_ranks
from shardsafe.core.dtypes import element_size
from shardsafe.core.fields import numel
from shardsafe.core.format import ChunkEntry
from shardsafe.core.nodes import node_id
from shardsafe.errors import PeerFailedError
from shardsafe.protocol.block_io import BlockRead
from shardsafe.protocol.transfer import ChunkReader, ReadRequest, direct_span
from shardsafe.storage.local import prefaulting, tensor_bytes

BATCH_BYTES = 64 << 20  # bytes of chunks sent as one message (one chunk may be larger)
# a chunk of a lacked file this large travels as a message of its own, received straight into its tensor
DIRECT_BYTES = 1 << 20
ALIGN = 16

ChunkId = tuple[str, str, int, int]  # (sibling checkpoint or "", file, begin, end): unique per stored chunk


def chunk_id(chunk: ChunkEntry) -> ChunkId:
    return (chunk.checkpoint or "", chunk.file, chunk.begin, chunk.end)


def _span(request: ReadRequest) -> tuple[int, int]:
    """The bytes of its chunk a request reads: the chunk's rows its box spans."""
    op, chunk = request.op, request.op.chunk
    if not chunk.shape:
        return 0, chunk.end - chunk.begin
    row = numel(chunk.shape[1:]) * element_size(request.saved_dtype)
    first = op.offsets[0] - chunk.offsets[0]
    return first * row, (first + op.shape[0]) * row


@dataclass(frozen=True)
class Batch:
    """Chunks one rank reads and sends to the same receivers, in one message. ``lacked``: chunks of a
    file a receiver lacks (sent unverified, each receiver verifies them, in the load's first pass)."""

    reader: int
    receivers: tuple[int, ...]
    chunks: tuple[ChunkId, ...]
    lacked: bool = False

    def positions(self) -> tuple[list[int], int]:
        """Where each chunk lies in the message (16-byte aligned, so every dtype can view it), and its length."""
        out, position = [], 0
        for _, _, begin, end in self.chunks:
            out.append(position)
            position += -(-(end - begin) // ALIGN) * ALIGN
        return out, position


@dataclass(frozen=True)
class SharedPlan:
    """This rank's part in the exchange (see the module doc for the call order)."""

    rank: int
    transport: Any = None  # the process group the batches travel on (CPU tensors over gloo); None: nothing shared
    global_ranks: tuple[int, ...] = ()  # the global rank of each group rank (how the transport addresses them)
    batches: list[Batch] = field(default_factory=list)  # every batch this rank takes part in, in the global order
    shared: set[ChunkId] = field(default_factory=set)  # chunks served by the exchange
    requests: dict[ChunkId, list[ReadRequest]] = field(default_factory=dict)  # this rank's requests of those chunks
    # (key, chunk) of those this rank reads
    entries: dict[ChunkId, tuple[str, ChunkEntry]] = field(default_factory=dict)
    # lacked chunks received and verified for requests into live tensors, copied into them by :meth:`exchange`
    held: dict[ChunkId, torch.Tensor] = field(default_factory=dict)
    _in_place: set[ChunkId] = field(default_factory=set)  # lacked chunks received straight into their tensor

    def local(self, requests: Sequence[ReadRequest]) -> list[ReadRequest]:
        """The requests this rank reads from storage itself (those of unshared chunks)."""
        return [r for r in requests if chunk_id(r.op.chunk) not in self.shared]

    def checks(self, reader: ChunkReader) -> list[BlockRead]:
        """Block checks of every chunk this rank reads for others, but lacked ones (an atomic load's first pass)."""
        return [
            c
            for b in self.batches
            if b.reader == self.rank and not b.lacked
            for cid in b.chunks
            for c in reader.whole_chunk_checks(*self.entries[cid])
        ]

    def received_bytes(self) -> int:
        """The bytes this rank receives in the exchange (what other ranks read for it)."""
        return sum(b.positions()[1] for b in self.batches if b.reader != self.rank)

    def exchange_lacked(self, reader: ChunkReader, failed: bool = False, now: Collection[int] = ()) -> Exception | None:
        """The batches of chunks in files a receiver lacks (a load's first pass, before anything
        live is written): each reader sends the chunks' bytes as its file holds them (size
        checked, not hashed) and each receiver verifies every block of them before it uses them,
        so the hashing is done where the bytes are needed, once. The requests whose ``id`` is in
        ``now`` (into tensors the load made) are copied into place at once; for the others the
        verified chunk is kept (:attr:`held`) until :meth:`exchange`. ``failed`` and the return:
        as :meth:`exchange`."""
        batches = [b for b in self.batches if b.lacked]
        if not batches:
            return None
        landings = {} if failed else self._landings([b for b in batches if b.reader != self.rank], set(now))
        # the new memory they land in faulted in ahead of the receives (it never changes a byte): one
        # madvise per tensor instead of a fault per page inside each receive
        with prefaulting(list(landings.values())):
            return self._run(batches, reader, failed, set(now), landings)

    def exchange(self, reader: ChunkReader, failed: bool = False) -> Exception | None:
        """Run every other batch this rank is in (``failed``: this rank failed before; it sends failure
        flags and drops what it receives), then copy the :attr:`held` chunks into place. Returns the
        first problem rather than raising: every rank runs every batch it is in."""
        problem = self._run([b for b in self.batches if not b.lacked], reader, failed, None, {})
        if problem is None and not failed:
            for cid, data in self.held.items():
                for request in self.requests.get(cid, []):
                    _copy_box(request, data)
        self.held.clear()
        return problem

    def _run(
        self,
        batches: list[Batch],
        reader: ChunkReader,
        failed: bool,
        now: set[int] | None,
        landings: dict[ChunkId, torch.Tensor],
    ) -> Exception | None:
        """Each of ``batches`` in order; ``now`` None: reader-verified batches, else lacked ones, whose
        chunks in ``landings`` are received there (:meth:`_landings`)."""
        problem: Exception | None = None
        # one buffer for every batch (each a front of it, its last byte the read's flag): allocated and
        # faulted in once, not per message
        whole = torch.empty(max((b.positions()[1] for b in batches), default=0) + 1, dtype=torch.uint8)
        for batch in batches:
            buffer = whole[: batch.positions()[1] + 1]
            if batch.reader == self.rank:
                # read for others even after a failed receive
                # a lacked batch's large chunks are sent from their files' mapped pages
                landed: dict[ChunkId, torch.Tensor] = {}
                read_problem = None if failed else self._read(reader, batch, buffer, now is None, landed)
                problem = problem or read_problem
                buffer[-1] = int(not failed and read_problem is None)
                sends = []  # every message of the batch in flight at once: one round trip each would add up
                segments = _segments(batch, now is not None)
                for receiver in batch.receivers:  # each is at this batch too (the same global order everywhere)
                    for segment, cid in segments:
                        source = landed[cid] if cid in landed and read_problem is None else buffer[segment]
                        sends.append(dist.isend(source, self.global_ranks[receiver], group=self.transport))
                _wait_all(sends)
                for receiver in batch.receivers:
                    dist.send(buffer[-1:], self.global_ranks[receiver], group=self.transport)
            else:
                landed = {} if failed else {cid: landings[cid] for cid in batch.chunks if cid in landings}
                receives = []
                for segment, cid in _segments(batch, now is not None):
                    target = landed[cid] if cid in landed else buffer[segment]
                    receives.append(dist.irecv(target, self.global_ranks[batch.reader], group=self.transport))
                _wait_all(receives)
                dist.recv(buffer[-1:], self.global_ranks[batch.reader], group=self.transport)
                if not buffer[-1]:
                    problem = problem or PeerFailedError(
                        f"rank {batch.reader} could not read chunks it reads for rank {self.rank} (see its error)"
                    )
            if not buffer[-1] or failed or problem is not None:
                continue
            if now is None:
                self._copy_out(batch, buffer)
                continue
            try:
                self._verify_and_place(reader, batch, buffer, landed, now)
            except Exception as exc:
                problem = exc
        return problem

    def _landings(self, batches: list[Batch], now: set[int]) -> dict[ChunkId, torch.Tensor]:
        """Where the chunks of lacked batches sent as messages of their own (:func:`_segments`) are
        received, when not into the batch's buffer: straight into the one tensor the load made that
        takes the chunk whole, or into a new tensor of their own kept for requests into live tensors."""
        out: dict[ChunkId, torch.Tensor] = {}
        for cid in (c for b in batches for c in b.chunks):
            requests = self.requests.get(cid, [])
            if not requests or cid[3] - cid[2] < DIRECT_BYTES:
                continue
            if any(id(r) not in now for r in requests):
                out[cid] = torch.empty(cid[3] - cid[2], dtype=torch.uint8)
            elif len(requests) == 1:
                whole = _whole_chunk_bytes(requests[0])
                if whole is not None:
                    out[cid] = whole
                    self._in_place.add(cid)
        return out

    def _read(
        self,
        reader: ChunkReader,
        batch: Batch,
        buffer: torch.Tensor,
        verified: bool,
        mapped: dict[ChunkId, torch.Tensor],
    ) -> Exception | None:
        """Read a batch this rank sends into ``buffer``: verified, or (a lacked batch) as the files
        hold it, its chunks of :data:`DIRECT_BYTES` or more as views of their files' mapped pages
        put in ``mapped`` instead (on local files)."""
        view = tensor_bytes(buffer)
        try:
            if not verified:  # the receivers verify
                for cid, position in zip(batch.chunks, batch.positions()[0]):
                    key, chunk = self.entries[cid]
                    pages = reader.mapped_chunk(chunk) if cid[3] - cid[2] >= DIRECT_BYTES else None
                    if pages is not None:
                        mapped[cid] = pages
                    else:
                        reader.read_unverified(key, chunk, view[position : position + chunk.end - chunk.begin])
                return None
            reads: list[BlockRead] = []
            for cid, position in zip(batch.chunks, batch.positions()[0]):
                key, chunk = self.entries[cid]
                size = chunk.end - chunk.begin
                reads += reader.block_reads(key, chunk, 0, size, view[position : position + size])
            reader.run(reads)
        except Exception as exc:
            return exc
        return None

    def _verify_and_place(
        self,
        reader: ChunkReader,
        batch: Batch,
        buffer: torch.Tensor,
        landed: dict[ChunkId, torch.Tensor],
        now: set[int],
    ) -> None:
        """A lacked batch received: each chunk this rank asked for verified where it landed, then
        copied into its requests' tensors made by the load (``now``) or kept for :meth:`exchange`."""
        with torch.no_grad():
            for cid, position in zip(batch.chunks, batch.positions()[0]):
                requests = self.requests.get(cid, [])
                if not requests:
                    continue
                key, chunk = self.entries[cid]
                data = landed.get(cid)
                if data is None:
                    data = buffer[position : position + cid[3] - cid[2]]
                reader.verify_received(key, chunk, tensor_bytes(data), f"rank {batch.reader}")
                if cid in self._in_place:
                    continue  # received straight into place
                for request in requests:
                    if id(request) in now:
                        _copy_box(request, data)
                if any(id(request) not in now for request in requests):
                    # a tensor of its own received here is kept; a view of the buffer or of a mapped file is copied
                    self.held[cid] = data if cid in landed and batch.reader != self.rank else data.clone()

    def _copy_out(self, batch: Batch, buffer: torch.Tensor) -> None:
        """Each of this rank's requests of the batch's chunks, copied out of the received bytes."""
        with torch.no_grad():
            for cid, position in zip(batch.chunks, batch.positions()[0]):
                for request in self.requests.get(cid, []):
                    _copy_box(request, buffer[position : position + cid[3] - cid[2]])


def _wait_all(works: list[Any]) -> None:
    """Wait for every posted send or receive (all of them, even after one fails, so no buffer is
    reused while gloo still writes into or reads from it); then raise the first failure."""
    failure: BaseException | None = None
    for work in works:
        try:
            work.wait()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def _segments(batch: Batch, lacked: bool) -> list[tuple[slice, ChunkId | None]]:
    """The messages a batch's bytes travel as, alike on both ends, each with the chunk it is the whole
    of (None for several): one for a reader-verified batch; for a lacked one, each chunk of
    :data:`DIRECT_BYTES` or more alone (received straight into place where it can be) and the runs
    of smaller chunks between them together. Empty chunks send nothing."""
    positions, length = batch.positions()
    if not lacked:
        return [(slice(0, length), None)] if length else []
    out: list[tuple[slice, ChunkId | None]] = []
    run_start: int | None = None
    for cid, position in zip(batch.chunks, positions):
        size = cid[3] - cid[2]
        if size >= DIRECT_BYTES:
            if run_start is not None:
                out.append((slice(run_start, position), None))
                run_start = None
            out.append((slice(position, position + size), cid))
        elif size and run_start is None:
            run_start = position
    if run_start is not None:
        out.append((slice(run_start, length), None))
    return out


def _whole_chunk_bytes(request: ReadRequest) -> torch.Tensor | None:
    """The bytes of ``request``'s destination that its chunk fills, as one contiguous host byte
    tensor, when the request takes the whole chunk, unconverted; else None."""
    op = request.op
    if op.offsets != op.chunk.offsets or op.shape != op.chunk.shape:
        return None
    span = direct_span(op, request.saved_dtype, request.dest, request.dest_offsets)
    if span is None:
        return None
    return request.dest.detach().reshape(-1)[span[0] : span[1]].view(torch.uint8)


def _copy_box(request: ReadRequest, data: torch.Tensor) -> None:
    op, chunk = request.op, request.op.chunk
    source = data.view(request.saved_dtype).view(chunk.shape)
    target = request.dest
    for d in range(len(op.shape)):
        source = source.narrow(d, op.offsets[d] - chunk.offsets[d], op.shape[d])
        target = target.narrow(d, op.offsets[d] - request.dest_offsets[d], op.shape[d])
    target.copy_(source)


def can_share(comm: Comm) -> bool:
    """Whether this job's reads can be shared: several ranks (on any backend: see the module doc)."""
    return comm.distributed


# what one rank sends in step 1: its node, the byte spans of each chunk it needs, the files it lacks,
# and the record (key, chunk) of each chunk it needs in a file it lacks (for the rank that reads it)
_Report = tuple[str, list[tuple[ChunkId, int, int]], list[str], list[tuple[str, ChunkEntry]]]


def plan_shared(
    comm: Comm,
    requests: Sequence[ReadRequest],
    enabled: bool | None = True,
    remote: bool = False,
    lacking: Collection[str] | None = None,
) -> SharedPlan:
    """Step 1 (collective unless ``enabled`` is False or not :func:`can_share`): who reads each chunk
    several ranks need. ``enabled=None``: only if the ranks span nodes or ``remote`` (an object store;
    the same on every rank), see the module doc. ``lacking`` (None on every rank, or given on
    every rank): the files of the checkpoint this rank cannot read, whose chunks it needs are read
    by a rank that can, whatever ``enabled`` says of the others."""
    plan = SharedPlan(comm.rank)
    # one process: nobody to read for it (with ``lacking``, its own reads name the missing files)
    if not can_share(comm) or (lacking is None and enabled is False):
        return plan
    lacks = frozenset(lacking or ())
    spans: dict[ChunkId, tuple[int, int]] = {}
    for r in requests:
        chunk = r.op.chunk
        if chunk.end - chunk.begin != numel(chunk.shape) * element_size(r.saved_dtype):
            continue  # not raw tensor bytes (a foreign format's item, e.g. DCP's): read by each rank as it needs
        cid = chunk_id(chunk)
        lo, hi = _span(r)
        old = spans.get(cid)
        spans[cid] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        plan.requests.setdefault(cid, []).append(r)
        plan.entries.setdefault(cid, (r.key, r.op.chunk))
    records = [plan.entries[cid] for cid in sorted(spans) if _in(cid, lacks)]
    report: _Report = (
        node_id(),
        sorted((cid, lo, hi) for cid, (lo, hi) in spans.items() if cid[3] > cid[2]),
        sorted(lacks),
        records,
    )
    gathered: list[_Report] = comm.all_gather(report)
    everyone_lacks = [frozenset(lacked) for _, _, lacked, _ in gathered]
    # one node, local files: a second reader gets the bytes from the shared page cache
    overlaps = enabled is True or (enabled is None and (remote or len({node for node, *_ in gathered}) > 1))
    if not overlaps and not any(everyone_lacks):
        return plan
    batches = _batches(gathered, everyone_lacks, overlaps)
    if not batches:
        return plan  # nothing to share (disjoint parts): no transport, no side group made
    # the same decision on every rank (from the gathered spans): collective where it makes a side group
    plan = replace(plan, transport=cpu_transport(comm), global_ranks=tuple(global_ranks(comm)))
    for _, _, _, theirs in gathered:  # records of chunks this rank may read for a rank that lacks their file
        for key, chunk in theirs:
            plan.entries.setdefault(chunk_id(chunk), (key, chunk))
    for batch in batches:
        if comm.rank == batch.reader or comm.rank in batch.receivers:
            plan.batches.append(batch)
            plan.shared.update(batch.chunks)
    return plan


def _in(cid: ChunkId, files: frozenset[str]) -> bool:
    """Whether the chunk lies in one of ``files`` (of the checkpoint itself, not a sibling)."""
    return not cid[0] and cid[1] in files


def _batches(gathered: list[_Report], lacks: list[frozenset[str]], overlaps: bool) -> list[Batch]:
    """Every rank's part of the exchange, alike on every rank: for each chunk shared (a needer
    lacks its file, or, with ``overlaps``, two needers' spans overlap), its reader and receivers,
    grouped into batches of at most :data:`BATCH_BYTES` per (reader, receivers)."""
    needers: dict[ChunkId, list[tuple[int, int, int]]] = {}
    for rank, (_, items, _, _) in enumerate(gathered):
        for cid, lo, hi in items:
            needers.setdefault(cid, []).append((rank, lo, hi))
    load = [0] * len(gathered)
    open_batches: dict[tuple[int, tuple[int, ...], bool], list[ChunkId]] = {}
    batches: list[Batch] = []
    batch_chunks: list[list[ChunkId]] = []
    file_reader: dict[str, int] = {}  # a lacked file's reader for the chunks no needer holds
    for cid in sorted(needers):
        ranks = needers[cid]
        unable = {r for r, _, _ in ranks if _in(cid, lacks[r])}
        if not unable and (not overlaps or len(ranks) < 2 or not _overlapping(ranks)):
            continue
        able = [r for r, _, _ in ranks if r not in unable]
        if able:
            reader = min(able, key=lambda r: (load[r], r))
        elif cid[1] in file_reader:
            reader = file_reader[cid[1]]
        else:
            # no needer holds it: one holder reads every such chunk of the file, so each holder streams
            # whole files to their needers and the streams of different holders run at once
            holders = [r for r in range(len(gathered)) if not _in(cid, lacks[r])]
            if not holders:
                continue  # no rank can read it: its needers read it themselves and fail naming the file
            reader = file_reader[cid[1]] = min(holders, key=lambda r: (load[r], r))
        load[reader] += cid[3] - cid[2]
        # a needer that holds the file reads it itself unless overlapping reads are shared anyway
        shared_overlap = overlaps and len(ranks) > 1 and _overlapping(ranks)
        receivers = tuple(r for r, _, _ in ranks if r != reader and (r in unable or shared_overlap))
        key = (reader, receivers, bool(unable))
        current = open_batches.get(key)
        if current is None or sum(c[3] - c[2] for c in current) + cid[3] - cid[2] > BATCH_BYTES:
            current = open_batches[key] = []
            batches.append(Batch(reader, receivers, (), bool(unable)))
            batch_chunks.append(current)
        current.append(cid)
    return [replace(batch, chunks=tuple(chunks)) for batch, chunks in zip(batches, batch_chunks)]


def _overlapping(spans: list[tuple[int, int, int]]) -> bool:
    """Whether any two ranks' byte spans of a chunk overlap (else each reads its own part)."""
    ordered = sorted((lo, hi) for _, lo, hi in spans)
    return any(b_lo < a_hi for (_, a_hi), (b_lo, _) in zip(ordered, ordered[1:]))


__all__ = ["BATCH_BYTES", "Batch", "SharedPlan", "can_share", "chunk_id", "plan_shared"]
