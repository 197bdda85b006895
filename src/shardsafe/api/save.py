"""``save``: every rank describes its state, the state is checked as a load would check it, then
each rank writes its own chunks and the coordinator commits."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsafe._version import __version__
from shardsafe.api.location import location
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.dtypes import dtype_from_name
from shardsafe.core.faults import crash_point
from shardsafe.core.format import ChunkEntry, FileEntry, Manifest, TensorEntry, check_metadata, parse_manifest
from shardsafe.core.integrity import HASH_BLOCK_SIZE
from shardsafe.core.plan import ChunkSpec, assign_writers
from shardsafe.core.values import encode_state
from shardsafe.errors import SaveError
from shardsafe.protocol.commit import agree_and_publish, new_manifest, prepare_save
from shardsafe.protocol.transfer import ReuseMap, write_rank_file
from shardsafe.state.base import KIND_PER_RANK
from shardsafe.state.registry import SaveView, describe_for_save
from shardsafe.storage.remote import RemoteDir


def save(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
) -> Path | RemoteDir:
    """Save ``state`` as a checkpoint folder at ``path``. Collective: every rank calls it.

    Each rank writes only its own chunks into its own file (a replicated tensor is written once,
    by one rank); the coordinator writes the JSON files and publishes the folder atomically.
    Before anything is written, every rank checks its part of the state and ``metadata`` with the
    very checks a load runs (depth, size, keys, tags): what a load would refuse is refused here,
    with the same FormatError, and nothing is left on disk.
    Returns the checkpoint path. Raises :class:`~shardsafe.errors.CheckpointExistsError` if a
    checkpoint is there and ``overwrite`` is False, :class:`~shardsafe.errors.SaveError` if any
    rank failed (nothing is published; earlier checkpoints are untouched).
    """
    comm = get_comm(process_group)
    view = describe_collectively(state, comm)
    return write_checkpoint(location(path), view, comm, overwrite=overwrite, metadata=metadata, fsync=fsync)


def describe_collectively(state: dict[str, Any], comm: Comm) -> SaveView:
    """Describe (and check) this rank's state; if any rank cannot, every rank raises (rather than
    some waiting forever)."""
    problem: Exception | None = None
    view = None
    try:
        view = describe_for_save(state, comm.rank)
    except Exception as exc:
        problem = exc
    comm.agree(problem)
    assert view is not None
    return view


@dataclass(frozen=True)
class RankResult:
    """What one rank reports to the coordinator after writing its file (sent as ``("ok", result)``,
    or ``("error", message)``: the agreement step of protocol.commit reads that pair)."""

    file: tuple[str, int] | None = None  # (name, size) of the file it wrote
    entries: tuple[tuple[str, ChunkEntry], ...] = ()  # (tensor key, chunk) of every chunk it stored
    specs: tuple[ChunkSpec, ...] = ()
    per_rank: Any = None


def write_checkpoint(
    final: Path | RemoteDir,
    view: SaveView,
    comm: Comm,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
    reuse: ReuseMap | None = None,
    before_publish: Callable[[], None] | None = None,
) -> Path | RemoteDir:
    """Write and commit an already described state (the part an async save runs in the background).

    ``metadata`` is checked first, on every rank, as a load's manifest parser would check it.
    ``before_publish`` runs on the coordinator right before the commit makes the checkpoint
    visible (the lease fencing check of the manager, the Trainer and Accelerate saving); if it
    raises, nothing is published."""
    problem: Exception | None = None
    try:
        if metadata is not None:
            check_metadata(metadata)
    except Exception as exc:
        problem = exc
    comm.agree(problem)
    target = prepare_save(comm, final, overwrite, fsync)
    crash_point("save:after-prepare", comm.rank)
    specs = [c.spec() for c in view.chunks]
    try:
        assignment = _plan(comm, specs)
    except SaveError:
        if comm.is_coordinator:
            target.abort()
        raise
    mine = [view.chunks[i] for i in assignment]
    result: tuple[str, Any]
    try:
        file_record = None
        entries: list[tuple[str, ChunkEntry]] = []
        if mine:
            name, size, written = write_rank_file(target, comm.rank, mine, HASH_BLOCK_SIZE, reuse)
            crash_point("save:after-write", comm.rank)
            entries = [(c.key, e) for c, e in written]
            file_record = (name, size) if name is not None else None
        result = ("ok", RankResult(file_record, tuple(entries), tuple(c.spec() for c in mine), view.per_rank))
    except Exception as exc:  # every rank must still reach the agreement step
        result = ("error", f"rank {comm.rank}: {type(exc).__name__}: {exc}")

    def build(results: list[RankResult]) -> tuple[Manifest, bytes]:
        """The files, checked with the parsers a load runs, before the commit (the last line behind
        the per-rank checks: it also sees what only the sum of the ranks makes, such as the size)."""
        tree = dict(view.tree)
        for n in sorted({n for r in results for n in r.per_rank}):
            tree[n] = {"kind": KIND_PER_RANK, "ranks": [r.per_rank.get(n) for r in results]}
        state_bytes = encode_state(tree)
        files = {r.file[0]: FileEntry(r.file[1], rank) for rank, r in enumerate(results) if r.file is not None}
        manifest = CheckedManifest(**vars(new_manifest(comm.world_size, files, state_bytes, metadata, __version__)))
        manifest.tensors = _tensor_entries(results)
        manifest.state_file = target.state_name()
        parse_manifest(manifest.to_bytes(), "the manifest about to be written")
        return manifest, state_bytes

    agree_and_publish(comm, target, result, lambda results: build([r[1] for r in results]), before_publish)
    return final


class CheckedManifest(Manifest):
    """A manifest whose bytes are made once: the bytes the reader's parser checked before the
    commit are the bytes the commit writes (indented JSON is slow to make for many tensors)."""

    _made: tuple[str, bytes] | None = None

    def to_bytes(self) -> bytes:
        if self._made is None or self._made[0] != self.state_file:
            self._made = (self.state_file, super().to_bytes())
        return self._made[1]


def _plan(comm: Comm, specs: list[ChunkSpec]) -> list[int]:
    """Every rank's chunk specs to the coordinator, which picks one writer per chunk; each rank learns its own."""
    gathered = comm.gather(specs)
    plan = comm.on_coordinator(lambda: assign_writers(gathered or []), default=SaveError)
    return list(plan[comm.rank])


def _tensor_entries(results: list[RankResult]) -> dict[str, TensorEntry]:
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    chunks: dict[str, list[ChunkEntry]] = {}
    for r in results:
        for spec in r.specs:
            meta[spec.key] = (spec.dtype, spec.global_shape)
        for key, entry in r.entries:
            chunks.setdefault(key, []).append(entry)
    out = {}
    for key in sorted(meta):
        dtype, shape = meta[key]
        ordered = sorted(chunks[key], key=lambda c: c.offsets)
        out[key] = TensorEntry(dtype_from_name(dtype.removeprefix("torch."), key), tuple(shape), tuple(ordered))
    return out
