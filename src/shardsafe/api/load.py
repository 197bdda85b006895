"""``load``: check everything, agree, then apply - user code first (undoable), tensors last.

The phases, each ended by an agreement of every rank (so all raise, or none):

1. *Check.* Manifest and state tree parsed and cross-checked; every live value bound and its
   saved entry compared with it (keys, shapes, dtypes, optimizer groups and hyper-parameter
   types, engine layout). Nothing is modified (a fresh optimizer gets state tensors to read into,
   which a failure takes back).
2. *Prepare.* With ``atomic``, every byte range to be read in place is checked (files opened and
   sized, headers checked, hash blocks verified); every other value is decoded whole (its tensors
   read once each, verified) and validated (``check_state_dict``). Nothing is modified.
3. *User code.* Each stateful / per-rank object's ``load_state_dict`` runs, after a snapshot of
   its ``state_dict()``. If any raises, on any rank, every rank restores the objects it had loaded:
   no tensor has been written yet.
4. *Tensors and values.* Tensors read in place, then the optimizer's hyper-parameters and plain
   state, JSON values and the DeepSpeed engine's refresh, all validated in phase 1/2.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.foreign import foreign_format
from shardsafe.api.location import location, shown
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.format import Manifest, TensorEntry
from shardsafe.core.gcpause import gc_paused
from shardsafe.core.values import check_state_tree
from shardsafe.errors import FormatError, ShardsafeError, StateMismatchError
from shardsafe.protocol.block_io import BlockRead
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.shared_read import SharedPlan, plan_shared
from shardsafe.protocol.transfer import ChunkReader, ReadRequest
from shardsafe.state.base import LoadStep, SavedLayout
from shardsafe.state.registry import (
    LoadBinding,
    bind_for_load,
    check_binding,
    describe_mismatch,
    fresh_optimizers,
    prepare_steps,
    unclaimed,
)
from shardsafe.storage.local import prefaulting
from shardsafe.storage.remote import RemoteDir

__all__ = ["Loaded", "load", "load_from", "load_lacking", "open_checkpoint"]

log = logging.getLogger("shardsafe")


def load(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    atomic: bool = True,
    share_reads: bool | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into ``state`` in place. Collective: every rank calls it.

    Works across world sizes: each rank reads only the stored byte ranges that overlap what it
    owns, straight into its tensors. All problems (missing/unexpected keys, shape or dtype
    mismatches, optimizer groups or hyper-parameters of another type, a stateful object's state
    of another type with ``strict``) are collected and raised together, on every rank, before
    anything is modified. JSON-able values are replaced in ``state``. ``verify`` checks block
    hashes of what is read. Returns the checkpoint's user metadata.

    A failed load leaves ``state`` as it was: everything that is not read in place (optimizer
    groups, schedulers and other ``load_state_dict`` values, RNG states, JSON values) is decoded
    and validated first; ``load_state_dict`` calls run before any tensor is written, and if one
    raises (on any rank), every rank restores the objects it had loaded from snapshots of their
    ``state_dict()``.

    ``atomic`` (default): a load that fails on damaged or missing stored data also leaves the
    tensors exactly as they were. Every rank first checks the byte ranges it will read (files
    opened and sized; with ``verify``, each hash block touched is read, one sequential stream per
    file, into its reading thread's scratch buffer and hashed), the ranks agree, and only then is
    anything written. Tensors the load itself created (a fresh optimizer's state, dropped if the
    load fails) are read straight into place in that first pass. The cost is a second read of the
    rest of this rank's share: from the page cache on a local or shared filesystem when it
    fits in free memory (the second pass reuses the open files and skips hashing); on an object
    store the first 64 MiB of verified blocks are kept in memory and the rest is downloaded again
    and re-verified. ``atomic=False`` reads once, straight into the destinations: faster, but a
    hash mismatch found midway leaves the tensors read before it overwritten.

    ``share_reads``: a stored chunk that several ranks need (HSDP replicas, tensor-parallel ranks
    holding the same norm) is read from storage by one of them, verified there, and sent to the
    others as host bytes over gloo (the process group itself where it sends CPU tensors with gloo;
    on NCCL a gloo group of the same ranks, made once per process), so each byte is read from
    storage once per job (protocol/shared_read.py). ``None`` (default): shared when the ranks run on more than
    one node (host name, or ``SHARDSAFE_NODE``) or the checkpoint is in an object store; on one
    node with local files the other ranks read it from the shared page cache, which is faster.
    ``True``: always shared. ``False``: every rank reads what it needs.

    Args:
        path: a checkpoint folder (local path or object-store URL); a DCP folder is read by its own
            reader.
        state: the objects to load into, keyed as they were saved (tensors and DTensors in any
            layout, modules, optimizers, schedulers, stateful objects, values).
        process_group: the ranks that load together (default: the default group, or this process).
        strict: refuse keys the state asks for that the checkpoint lacks, checkpoint tensors no
            rank loads, and dtype mismatches; with False the keys are skipped and dtypes are cast.
        verify: check the block hash of every byte read.
        atomic: a failed load leaves the tensors untouched (see above).
        share_reads: read a chunk several ranks need once and send it to the others (see above).

    Returns:
        The checkpoint's user metadata (``metadata=`` of :func:`~shardsafe.save`).

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path``.
        FormatError: a file is damaged, hostile or of another format version; names the file.
        IntegrityError: a block hash does not match (``verify``); names the tensor and block.
        StateMismatchError: the state does not fit the checkpoint (missing or unexpected keys, shapes,
            dtypes, optimizer groups), every problem reported at once before anything is modified.
    """
    with gc_paused():  # thousands of small entries: see core/gcpause.py
        return _load(path, state, process_group, strict, verify, atomic, share_reads)


def _load(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    process_group: Any,
    strict: bool,
    verify: bool,
    atomic: bool,
    share_reads: bool | None = None,
) -> dict[str, Any]:
    folder = location(path)
    foreign = foreign_format(folder)  # a DCP folder, ...: read by the reader registered for it (see api/foreign.py)
    if foreign is not None and foreign.load is not None:
        return foreign.load(folder, state, process_group=process_group, strict=strict, verify=verify, atomic=atomic)

    return load_from(
        state,
        partial(_opened, folder),
        lambda manifest: ChunkReader(folder, manifest, verify),
        process_group,
        strict,
        verify,
        atomic,
        share_reads,
    ).metadata


def _opened(folder: Path | RemoteDir) -> tuple[Manifest, dict[str, Any]]:
    manifest, tree = open_checkpoint(folder)
    check_state_tree(tree, f"{shown(folder)}/{manifest.state_file}", manifest)
    return manifest, tree


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_lacking` did: the checkpoint's user metadata, and the bytes other ranks read
    for this one and sent to it over the process group."""

    metadata: dict[str, Any]
    received_bytes: int


def load_lacking(
    path: str | os.PathLike[str],
    state: dict[str, Any],
    lacking: frozenset[str],
    *,
    process_group: Any = None,
    strict: bool = True,
) -> Loaded:
    """:func:`load` (verified, atomic) of a folder that may lack some of the checkpoint's shard
    files, which the folders of other ranks of the load hold: a node's folder of the local tier,
    holding its own ranks' files and its peers' replicas. Collective, with ``lacking`` (this rank's
    missing files, maybe none) given on every rank: whatever this rank needs of a file it lacks
    is read by a rank whose folder has it, sent over the process group and verified here where it
    lands (:mod:`shardsafe.protocol.shared_read`): the values decoded whole (optimizer steps, RNG
    states) first, then the tensors, in the load's first pass (a fresh optimizer's state straight
    into place, a live tensor's bytes kept until the last phase). A file no rank holds fails the
    load as a missing file does. Large chunks are sent from their files' mapped pages: the folders
    must be the job's own (a file truncated while mapped would end the reading process)."""
    folder = location(path)
    return load_from(
        state,
        partial(_opened, folder),
        lambda manifest: ChunkReader(folder, manifest, verify=True),
        process_group,
        strict,
        verify=True,
        atomic=True,
        lacking=lacking,
    )


class _StandIns:
    """A lookup for planning: records each stored tensor a value takes whole and returns a
    storage-less (meta) tensor of its stored shape and dtype in its place."""

    def __init__(self, manifest: Manifest, taken: dict[str, TensorEntry]) -> None:
        self.manifest, self.taken = manifest, taken

    def __call__(self, key: str) -> torch.Tensor:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise FormatError(f"state.json refers to tensor {key!r}, which the manifest does not list")
        self.taken[key] = entry
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")  # no memory: the shape is the file's claim


OpenChecked = Callable[[], tuple[Manifest, dict[str, Any]]]  # the manifest and the state tree, parsed and cross-checked
OpenReader = Callable[[Manifest], ChunkReader]


def load_from(
    state: dict[str, Any],
    opened: OpenChecked,
    open_reader: OpenReader,
    process_group: Any,
    strict: bool,
    verify: bool,
    atomic: bool,
    share_reads: bool | None = None,
    lacking: frozenset[str] | None = None,
) -> Loaded:
    """:func:`load`'s phases over any checkpoint that can be described as a manifest, a state tree and a
    :class:`ChunkReader` of its bytes: shardsafe's own, or a foreign format's reader (a DCP folder,
    read in place through its own reader), so every format gets the same checks, agreement and
    atomicity. Returns the checkpoint's user metadata and what this rank received from others.

    Each phase ends in an agreement of every rank (a rank that failed still runs the collectives of
    the phase, sharing nothing), so all ranks stop at the same phase and undo the same steps.
    ``lacking`` (None on every rank, or a set on every rank): see :func:`load_lacking`."""
    comm = get_comm(process_group)
    # Binding gives a fresh optimizer its state (so there are tensors to read into); a load that
    # fails before reading must take that back, or the next step would differ (step count 1).
    fresh = fresh_optimizers(state)
    manifest, binding = _open_and_bind(comm, state, opened, strict, fresh, atomic)
    with open_reader(manifest) as reader:
        reads = _plan_reads(comm, reader, manifest, binding, share_reads, lacking)
        steps = _prepare(comm, reader, manifest, binding, reads, atomic, fresh)
        if atomic:  # the blocks are verified; local re-reads go through the same open files (page cache)
            reader.verify = verify and reader.remote
        applied = _apply_undoable(comm, steps, fresh)
        problem = _read_and_apply(comm, reader, reads, steps, atomic)
    _agree(comm, problem, reset=fresh, undo=applied)  # a fresh optimizer ends stateless, as it began
    return Loaded(manifest.metadata, reads.fetched_bytes + reads.shared.received_bytes())


def _open_and_bind(
    comm: Comm,
    state: dict[str, Any],
    opened: OpenChecked,
    strict: bool,
    fresh: Sequence[torch.optim.Optimizer],
    atomic: bool = True,
) -> tuple[Manifest, LoadBinding]:
    """Open the checkpoint and bind ``state`` to it, checked; every rank's problems are reported in one
    error before anything is read or modified."""
    problem: Exception | None = None
    checked: tuple[Manifest, LoadBinding] | None = None
    left: set[str] | None = None
    problems: list[str] = []
    try:
        manifest, tree = opened()
        binding = bind_for_load(state, comm.rank, tree, _layout_of(manifest), strict, atomic)
        problems = check_binding(binding, manifest, tree, strict)
        left = unclaimed(binding, tree) if strict else set()
        checked = (manifest, binding)
    except Exception as exc:  # shared with every rank below, so none waits alone
        problem = exc
    problems += _nobody_loads(comm, left)  # every problem in one error, stored tensors no rank loads included
    if problem is None and problems:
        problem = describe_mismatch(problems)
    _agree(comm, problem, reset=fresh)
    assert checked is not None
    return checked


@dataclass(frozen=True)
class _Reads:
    """This rank's reads after the ranks shared out the chunks several of them need, and the problem
    planning them met (reported at the next agreement, after the collective sharing)."""

    fresh: list[ReadRequest]  # into tensors the load created (a fresh optimizer's state, dropped if it fails)
    existing: list[ReadRequest]  # into the other, live tensors
    shared: SharedPlan
    problem: Exception | None
    # stored tensors decoded whole that lie in files this rank lacks, by key: received from ranks holding them
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)
    fetched_bytes: int = 0  # what receiving ``fetched`` took over the process group
    made: frozenset[int] = frozenset()  # ids of the requests into tensors the load made (all of them, shared or not)


def _plan_reads(
    comm: Comm,
    reader: ChunkReader,
    manifest: Manifest,
    binding: LoadBinding,
    share_reads: bool | None,
    lacking: frozenset[str] | None = None,
) -> _Reads:
    """What this rank reads, and from whom it receives what another rank reads for it."""
    problem: Exception | None = None
    fresh_reads: list[ReadRequest] = []
    existing_reads: list[ReadRequest] = []
    try:
        fresh_reads, existing_reads = _plan_targets(reader, manifest, binding)
    except Exception as exc:
        problem = exc
    fetched: dict[str, torch.Tensor] = {}
    fetched_bytes = 0
    if lacking is not None:  # every rank alike: the values decoded whole first, from files some rank lacks
        fetched, fetched_bytes, fetch_problem = _fetch_whole(comm, reader, manifest, binding, lacking, problem)
        problem = problem or fetch_problem
    # What a module's own load code takes (binding.early) must be in place before the third phase, so
    # this rank reads it itself in the first pass, unless it lies in a file this rank lacks (then it is
    # received in the first pass too, by exchange_lacked).
    early = binding.early
    own = [r for r in fresh_reads if r.key in early and not _lacked(r, lacking)] if early else []
    held = set(map(id, own))
    # Collective, so run by a rank whose planning failed too (it shares nothing): chunks several
    # ranks need are read by one of them and sent to the others (protocol/shared_read.py).
    shared = plan_shared(
        comm,
        [] if problem is not None else [r for r in fresh_reads if id(r) not in held] + existing_reads,
        enabled=share_reads,
        remote=reader.remote,
        lacking=lacking,
    )
    made = frozenset(map(id, fresh_reads))
    local_fresh = (
        shared.local([r for r in fresh_reads if id(r) not in held]) + own if held else shared.local(fresh_reads)
    )
    return _Reads(local_fresh, shared.local(existing_reads), shared, problem, fetched, fetched_bytes, made)


def _lacked(request: ReadRequest, lacking: frozenset[str] | None) -> bool:
    """Whether the chunk a request reads lies in a file of the checkpoint this rank lacks."""
    chunk = request.op.chunk
    return lacking is not None and chunk.checkpoint is None and chunk.file in lacking


def _fetch_whole(
    comm: Comm,
    reader: ChunkReader,
    manifest: Manifest,
    binding: LoadBinding,
    lacking: frozenset[str],
    failed: Exception | None,
) -> tuple[dict[str, torch.Tensor], int, Exception | None]:
    """Collective: the stored tensors this rank's values take whole (an optimizer's step, an RNG
    state: found over stand-ins of the stored shapes) that lie in files it lacks,
    read by ranks holding those files and received here, before the values are prepared. Returns
    them by key, the bytes received, and the problem met (for the next agreement)."""
    requests: list[ReadRequest] = []
    fetched: dict[str, torch.Tensor] = {}
    problem: Exception | None = None
    if lacking and failed is None:
        try:
            for key, entry in _taken_whole(manifest, binding).items():
                zeros = (0,) * len(entry.shape)
                ops = reader.plan(key, entry, zeros, entry.shape)
                if any(op.chunk.checkpoint is None and op.chunk.file in lacking for op in ops):
                    # bounded by the bytes on disk: the manifest's chunks lie within its files' sizes, which
                    # the ranks holding the files check as they open them
                    fetched[key] = torch.empty(entry.shape, dtype=entry.dtype)
                    requests += [ReadRequest(key, op, entry.dtype, fetched[key], zeros) for op in ops]
        except Exception as exc:
            problem, requests, fetched = exc, [], {}
    plan = plan_shared(comm, requests, enabled=True, lacking=lacking)
    try:
        if problem is None:
            _read(reader, plan.local(requests))
    except Exception as exc:
        problem = exc
    with torch.no_grad():  # every rank runs its batches
        lacked = plan.exchange_lacked(reader, failed=problem is not None, now=set(map(id, requests)))
        problem = problem or lacked
        exchanged = plan.exchange(reader, failed=problem is not None)
    problem = problem or exchanged
    return fetched, plan.received_bytes(), problem


def _taken_whole(manifest: Manifest, binding: LoadBinding) -> dict[str, TensorEntry]:
    """The stored tensors the bound values decode whole (each adapter's ``prepare`` run over
    stand-ins of the stored shapes; nothing is applied or allocated)."""
    taken: dict[str, TensorEntry] = {}
    stand_ins = _StandIns(manifest, taken)
    for name, bound in binding.bound.items():
        try:
            bound.adapter.prepare(bound, binding.contexts[name], stand_ins)
        # An adapter decodes its entry (every lookup) before it checks what it decoded, which
        # stand-ins can fail (an RNG state's bytes): what it looked up is recorded by then.
        except Exception as exc:
            log.debug("shardsafe: planning %r over stand-ins: %s", name, exc)
    return taken


def _prepare(
    comm: Comm,
    reader: ChunkReader,
    manifest: Manifest,
    binding: LoadBinding,
    reads: _Reads,
    atomic: bool,
    fresh: Sequence[torch.optim.Optimizer],
) -> list[LoadStep]:
    """The load's steps, prepared; with ``atomic``, first every block this rank will read checked in place,
    so a damaged file fails the load before anything is modified."""
    problem = reads.problem
    steps: list[LoadStep] = []
    # Collective: chunks of files a rank lacks, verified where received (into tensors the load made, or
    # held). First, so the ranks that receive them verify while the readers check their own reads.
    with torch.no_grad():
        problem = reads.shared.exchange_lacked(reader, failed=problem is not None, now=reads.made) or problem
    try:
        if problem is not None:
            raise problem
        if atomic:  # check everything this rank will read in place, nothing written
            _check_sources(reader, reads.fresh, reads.existing, reads.shared.checks(reader))
        steps = prepare_steps(binding, SharedLookup(reader, manifest, reads.fetched))
    except Exception as exc:
        problem = exc
    _agree(comm, problem, reset=fresh)
    return steps


def _apply_undoable(comm: Comm, steps: list[LoadStep], fresh: Sequence[torch.optim.Optimizer]) -> list[LoadStep]:
    """Apply the steps that can be undone (``load_state_dict``...); returns them, so a later failure undoes
    them on every rank."""
    applied: list[LoadStep] = []
    problem: Exception | None = None
    try:
        for step in (s for s in steps if s.undo is not None):
            applied.append(step)  # a load_state_dict that raises midway is undone too
            step.apply()
    except Exception as exc:
        problem = exc
    _agree(comm, problem, reset=fresh, undo=applied, default=StateMismatchError)
    return applied


def _read_and_apply(
    comm: Comm, reader: ChunkReader, reads: _Reads, steps: list[LoadStep], atomic: bool
) -> Exception | None:
    """Read the bytes (receiving the shared ones), then apply the steps that cannot be undone; returns the
    problem met, for the final agreement."""
    problem: Exception | None = None
    try:
        _read(reader, reads.existing if atomic else reads.fresh + reads.existing)
    except Exception as exc:
        problem = exc
    with torch.no_grad():
        exchanged = reads.shared.exchange(reader, failed=problem is not None)  # every rank runs its batches
    problem = problem or exchanged
    try:
        if problem is not None:
            raise problem
        for step in (s for s in steps if s.undo is None):
            step.apply()
    except Exception as exc:
        problem = exc
    return problem


def _nobody_loads(comm: Comm, left: set[str] | None) -> list[str]:
    """With ``strict``, what no rank takes of the entries loaded (:func:`~shardsafe.state.registry.unclaimed`),
    as problems on the coordinator (reported once; empty elsewhere). Each rank sends only what it
    leaves, which is nothing unless ranks hold different state (pipeline stages); ``None`` from a
    rank that failed already: no report."""
    sets = comm.gather(sorted(left) if left else left)
    if sets is None or any(s is None for s in sets) or not sets[0]:
        return []
    nobody = set(sets[0]).intersection(*map(set, sets[1:]))
    suffix = " (no rank loads it)" if comm.distributed else ""
    return [f"{problem}{suffix}" for problem in sorted(nobody)]


class SharedLookup:
    """Stored tensors by key, each read whole at most once per load: repeated references in
    ``state.json`` share one tensor, so what is allocated is bounded by the bytes the files hold
    (the manifest parser refuses chunks that share bytes)."""

    def __init__(self, reader: ChunkReader, manifest: Manifest, fetched: dict[str, torch.Tensor] | None = None) -> None:
        self.reader, self.manifest = reader, manifest
        self._read: dict[str, torch.Tensor] = dict(fetched or {})  # ``fetched``: received from other ranks already

    def __call__(self, key: str) -> torch.Tensor:
        tensor = self._read.get(key)
        if tensor is None:
            entry = self.manifest.tensors.get(key)
            if entry is None:
                raise FormatError(f"state.json refers to tensor {key!r}, which the manifest does not list")
            tensor = self._read[key] = self.reader.read_tensor(key, entry)
        return tensor


def _layout_of(manifest: Manifest) -> SavedLayout:
    def layout(key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        entry = manifest.tensors.get(key)
        return None if entry is None else (tuple(entry.shape), entry.dtype)

    return layout


def _agree(
    comm: Comm,
    problem: Exception | None,
    reset: Sequence[torch.optim.Optimizer] = (),
    undo: Sequence[LoadStep] = (),
    default: type[ShardsafeError] = ShardsafeError,
) -> None:
    """:meth:`Comm.agree`; on failure, undo ``undo`` (the objects loaded so far, last first) and
    empty ``reset`` (optimizers whose state the load created), so a failed load changes nothing."""
    try:
        comm.agree(problem, default=default)
    except ShardsafeError as exc:
        failed = []
        for step in reversed(undo):
            try:
                assert step.undo is not None
                step.undo()
            except Exception as undo_exc:
                failed.append(f"{step.name!r}: {type(undo_exc).__name__}: {undo_exc}")
        for optimizer in reset:
            optimizer.state.clear()
        if failed:
            raise type(exc)(
                f"{exc}\nand restoring what was loaded before the failure failed for " + "; ".join(failed)
            ) from exc
        raise


def _plan_targets(
    reader: ChunkReader, manifest: Manifest, binding: LoadBinding
) -> tuple[list[ReadRequest], list[ReadRequest]]:
    """The reads of every in-place target, planned once: (those of fresh targets, those of the others)."""
    fresh: list[ReadRequest] = []
    existing: list[ReadRequest] = []
    for key, target in binding.targets.items():
        entry = manifest.tensors.get(key)
        if entry is None:
            continue
        for dest, offsets in target.boxes():
            ops = reader.plan(key, entry, offsets, tuple(dest.shape))
            (fresh if target.fresh else existing).extend(ReadRequest(key, op, entry.dtype, dest, offsets) for op in ops)
    return fresh, existing


def _read(reader: ChunkReader, items: list[ReadRequest], checks: list[BlockRead] | None = None) -> None:
    with torch.no_grad():
        reader.read_all(items, checks)


def _check_sources(
    reader: ChunkReader, fresh: list[ReadRequest], existing: list[ReadRequest], shared: list[BlockRead]
) -> None:
    """The first pass of an atomic load: everything the in-place reads of ``existing`` targets will
    read is checked and no live tensor is written. Tensors the load itself created (``fresh``: a
    fresh optimizer's state, which a failed load drops) are read, verified, straight into place:
    they are read once, not twice. ``shared``: the checks of the chunks this rank reads for others."""
    checks = [check for r in existing for check in reader.check_reads(r.key, r.op, r.saved_dtype)] + shared
    with prefaulting([r.dest for r in fresh]):  # the new memory's page faults taken while the reads wait
        _read(reader, fresh, checks)  # one pass over the files, in order
