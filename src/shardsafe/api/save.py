"""``save``: every rank describes its state, the state is checked as a load would check it, then
each rank writes its own chunks and the coordinator commits."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from shardsafe._version import __version__
from shardsafe.api.location import location
from shardsafe.core.comm import Comm, Outcome, get_comm
from shardsafe.core.dtypes import dtype_from_name
from shardsafe.core.faults import crash_point
from shardsafe.core.format import ChunkEntry, FileEntry, IndexRef, Manifest, TensorEntry, check_metadata, parse_manifest
from shardsafe.core.gcpause import gc_paused
from shardsafe.core.index import build_index
from shardsafe.core.integrity import HASH_BLOCK_SIZE, hash_bytes
from shardsafe.core.layout import (
    IRREGULAR,
    SPLIT,
    WHOLE,
    LocalLayout,
    RuleHeld,
    describe_layout,
    is_stored,
    stage_rules,
    whole_writers,
)
from shardsafe.core.plan import ChunkSpec, LocalChunk, assign_writers
from shardsafe.core.rule import LayoutRule, spread_writers
from shardsafe.core.values import encode_state
from shardsafe.errors import SaveError, ShardsafeError
from shardsafe.protocol.commit import CommitTarget, agree_and_publish, new_manifest, prepare_save
from shardsafe.protocol.shard_write import ReuseMap, is_plain, write_rank_file
from shardsafe.state.base import KIND_PER_RANK
from shardsafe.state.registry import DescribeCache, SaveView, describe_for_save, merge_trees
from shardsafe.storage.location import as_location, public_path
from shardsafe.storage.remote import RemoteDir

__all__ = [
    "HASH_BLOCK_SIZE",
    "RankResult",
    "describe_collectively",
    "new_manifest",
    "save",
    "tensor_entries",
    "write_checkpoint",
]


def save(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
) -> Path | str:
    """Save ``state`` as a checkpoint folder at ``path``. Collective: every rank calls it.

    Each rank writes only its own chunks into its own file (a replicated tensor is written once,
    by one rank); the coordinator writes the JSON files and publishes the folder atomically.
    Before anything is written, every rank checks its part of the state and ``metadata`` with the
    very checks a load runs (depth, size, keys, tags): what a load would refuse is refused here,
    with the same FormatError, and nothing is left on disk.

    Args:
        path: the checkpoint folder to create: a local path or an object-store URL (``s3://...``,
            any fsspec protocol) or a :class:`~shardsafe.api.location.RemoteDir`.
        state: a dict of tensors (plain, DTensor, FSDP2 / tensor-parallel / HSDP shards), modules,
            optimizers, schedulers and other objects with ``state_dict()``, and JSON-able values.
        process_group: the ranks that save together (default: the initialised default group, or
            this process alone).
        overwrite: replace a checkpoint already at ``path`` (published atomically in its place).
        metadata: JSON-able user metadata, returned by :func:`~shardsafe.load`.
        fsync: make every file and folder durable before the publish (off only for scratch runs).

    Returns:
        The checkpoint's path: a :class:`~pathlib.Path`, or the URL string of an object-store prefix.

    Raises:
        CheckpointExistsError: a checkpoint is at ``path`` and ``overwrite`` is False.
        FormatError: the state or metadata holds what a load would refuse (too deep, too large,
            a key or value of a kind the format cannot store); raised before anything is written.
        SaveError: a rank failed to write; nothing is published and earlier checkpoints are untouched.
    """
    comm = get_comm(process_group)
    with gc_paused():  # thousands of small entries: see core/gcpause.py
        view = describe_collectively(state, comm)
        written = write_checkpoint(location(path), view, comm, overwrite=overwrite, metadata=metadata, fsync=fsync)
    return public_path(written)  # a Path, or the URL string of an object-store prefix


def describe_collectively(
    state: dict[str, Any],
    comm: Comm,
    coordinator_check: Callable[[], None] | None = None,
    default: type[ShardsafeError] = ShardsafeError,
    cache: DescribeCache | None = None,
) -> SaveView:
    """Describe (and check) this rank's state; if any rank cannot, every rank raises (rather than
    some waiting forever).

    ``coordinator_check`` (the manager's refusal of another run's step) runs on the coordinator
    first and shares the same agreement: one collective however many checks, which is all an
    async save's caller waits for besides its copy.

    ``cache`` (a manager's, kept from its previous save of this state): the describe reuses what is
    unchanged (:class:`~shardsafe.state.registry.DescribeCache`); the same agreement carries each
    rank's verdict, and unless every rank found its previous structure, the ranks that did describe
    again in full, without the cache (then a second agreement): the ranks reuse only together."""
    problem: Exception | None = None
    view = None
    try:
        if coordinator_check is not None and comm.is_coordinator:
            coordinator_check()
        with gc_paused():  # the part of an async save the training loop waits for (core/gcpause.py)
            view = describe_for_save(state, comm.rank, cache)
    except Exception as exc:
        problem = exc
    votes = comm.agree(problem, default=default, vote=cache is not None and cache.unchanged)
    if cache is not None and not all(votes):
        problem = None
        try:
            if cache.unchanged:  # another rank's structure changed: this one describes again, in full
                cache.withdraw()
                with gc_paused():
                    view = describe_for_save(state, comm.rank, cache)
        except Exception as exc:
            problem = exc
        comm.agree(problem, default=default)
    assert view is not None
    return view


@dataclass(frozen=True)
class RankResult:
    """What one rank reports to the coordinator after writing its file (the value of its
    :class:`~shardsafe.core.comm.Outcome`, which protocol.commit's agreement step gathers). Parts of
    split tensors are in the rank's index, not here: what a rank sends does not grow with the
    world size (only its listed chunks: replicated, irregular and reused ones)."""

    file: tuple[str, int] | None = None  # (name, size) of the file it wrote
    index: IndexRef | None = None  # the index of that file (its split parts)
    entries: tuple[tuple[str, ChunkEntry], ...] = ()  # (tensor key, chunk) of every chunk the manifest lists
    specs: tuple[ChunkSpec, ...] = ()  # of those chunks
    per_rank: Any = None
    plain_file: tuple[str, int] | None = None  # (name, size) of its file of plainly named whole tensors, if any


@dataclass(frozen=True)
class SavePlan:
    """What every rank writes. ``rule``: the parts of rule-described tensors by their writers
    (core/rule.py, :func:`spread_writers`), replicated tensors by :func:`whole_writers`, irregular
    chunks as ``irregular`` assigns them (the coordinator's pick among the irregular chunks only).
    Otherwise (the ranks hold different tensors or layouts) ``stage`` holds the tensors still
    described by a rule (pipeline stages' tensors on their slice of the world mesh:
    core/layout.stage_rules, writers set), and ``full`` lists, per rank, the indices of its other
    stored chunks it writes, all listed in the manifest."""

    rule: bool
    irregular: list[list[int]] | None = None  # per rank: indices into its irregular chunks
    full: list[list[int]] | None = None  # per rank: indices into its stored chunks of keys not in ``stage``
    stage: dict[str, RuleHeld] | None = None
    trees_differ: bool = False  # the ranks' shared entries differ (pipeline stages): merged on the coordinator
    tree: dict[str, Any] | None = None  # on the coordinator, the tree state.json gets (set locally, never sent)


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
    target: CommitTarget | None = None,
    plain_names: str | None = None,
) -> Path | RemoteDir:
    """Write and commit an already described state (the part an async save runs in the background).

    ``metadata`` is checked first, on every rank, as a load's manifest parser would check it.
    ``before_publish`` runs on the coordinator right before the commit makes the checkpoint
    visible (the lease fencing check of the manager, the Trainer and Accelerate saving); if it
    raises, nothing is published. ``target``: a commit target the caller has already prepared (every
    rank its own; the manager's local tier, whose ranks write into their own node's folder);
    default: :func:`~shardsafe.protocol.commit.prepare_save` of ``final``. ``plain_names``: a key
    prefix (``"model/"``) whose whole tensors the shard headers name without it, by the model's own
    names, in a file of their own per rank (:meth:`~shardsafe.protocol.commit.CommitTarget.plain_name`;
    the Trainer's checkpoints are model folders this way)."""
    problem: Exception | None = None
    try:
        if metadata is not None:
            check_metadata(metadata)
    except Exception as exc:
        problem = exc
    comm.agree(problem)
    target = prepare_save(comm, final, overwrite, fsync) if target is None else target
    crash_point("save:after-prepare", comm.rank)
    layout = describe_layout(view.chunks, comm.rank, comm.world_size)
    try:
        plan = _plan(comm, view, layout)
    except SaveError:
        if comm.is_coordinator:
            target.abort()
        raise
    rules = spread_writers(layout.rules()) if plan.rule else {k: t.rule for k, t in (plan.stage or {}).items()}
    mine = _mine(comm, view, layout, plan, rules)
    result = _write_own_file(final, target, comm, view, mine, set(rules), reuse, plain_names)
    build = _ManifestBuilder(comm, target, plan, layout, rules, metadata)
    agree_and_publish(comm, target, result, build, before_publish)
    return final


def _write_own_file(
    final: Path | RemoteDir,
    target: CommitTarget,
    comm: Comm,
    view: SaveView,
    mine: list[LocalChunk],
    split_keys: set[str],
    reuse: ReuseMap | None,
    plain_names: str | None = None,
) -> Outcome[RankResult]:
    """Write this rank's file (and the index of its split parts); the outcome, a failure included, is what
    the rank brings to the agreement, which every rank must reach. With ``plain_names``, the whole
    tensors under that prefix go into a second file of the rank's, alone (``target.plain_name``)."""
    try:
        file_record, index_record, plain_record = None, None, None
        entries: list[tuple[str, ChunkEntry]] = []
        plain = [c for c in mine if plain_names and is_plain(c, plain_names) and c.key not in split_keys]
        if plain:
            assert plain_names is not None
            mine = [c for c in mine if not (is_plain(c, plain_names) and c.key not in split_keys)]
            name = target.plain_name(comm.rank)
            named = write_rank_file(target, comm.rank, plain, HASH_BLOCK_SIZE, None, plain_names, name=name)
            entries += [(c.key, e) for c, e in named.entries]
            plain_record = (name, named.size)
        if mine:
            earlier = reuse.for_rank(_sibling(final, reuse.checkpoint), comm.rank) if reuse is not None else None
            written = write_rank_file(target, comm.rank, mine, HASH_BLOCK_SIZE, earlier)
            crash_point("save:after-write", comm.rank)
            indexed = [(c.key, e) for c, e in written.entries if c.key in split_keys and e.checkpoint is None]
            entries += [(c.key, e) for c, e in written.entries if not (c.key in split_keys and e.checkpoint is None)]
            if indexed and written.name is not None:
                data = build_index(comm.rank, written.name, indexed)
                index_record = IndexRef(target.write_index(comm.rank, data), len(data), hash_bytes(data))
            file_record = (written.name, written.size) if written.name is not None else None
        specs = {c.key: c.spec() for c in [*plain, *mine]}
        return Outcome(
            value=RankResult(
                file_record,
                index_record,
                tuple(entries),
                tuple(specs[k] for k, _ in entries),
                view.per_rank,
                plain_record,
            )
        )
    except Exception as exc:  # every rank must still reach the agreement step
        return Outcome.failure(exc, comm.rank, SaveError)


@dataclass(frozen=True)
class _ManifestBuilder:
    """The coordinator's step of the commit: the ranks' results made into ``state.json`` and the manifest."""

    comm: Comm
    target: CommitTarget
    plan: SavePlan
    layout: LocalLayout
    rules: dict[str, LayoutRule]
    metadata: dict[str, Any] | None

    def __call__(self, results: list[RankResult]) -> tuple[Manifest, bytes]:
        """The files, checked with the parsers a load runs, before the commit (the last line behind
        the per-rank checks: it also sees what only the sum of the ranks makes, such as the size)."""
        plan = self.plan
        assert plan.tree is not None
        tree = dict(plan.tree)
        for n in sorted({n for r in results for n in r.per_rank}):
            tree[n] = {"kind": KIND_PER_RANK, "ranks": [r.per_rank.get(n) for r in results]}
        state_bytes = encode_state(tree)
        files = {r.file[0]: FileEntry(r.file[1], rank, r.index) for rank, r in enumerate(results) if r.file is not None}
        files |= {r.plain_file[0]: FileEntry(r.plain_file[1], rank) for rank, r in enumerate(results) if r.plain_file}
        tensors = tensor_entries(results, self.layout if plan.rule else None, self.rules, plan.stage)
        made = new_manifest(
            self.comm.world_size,
            files,
            state_bytes,
            self.metadata,
            __version__,
            tensors=tensors,
            state_file=self.target.state_name(),
        )
        manifest = CheckedManifest.of(made)
        parse_manifest(manifest.to_bytes(), "the manifest about to be written")
        return manifest, state_bytes


@dataclass(frozen=True)
class CheckedManifest(Manifest):
    """A manifest whose bytes are made once: the bytes the reader's parser checked before the
    commit are the bytes the commit writes (indented JSON is slow to make for many tensors)."""

    @classmethod
    def of(cls, manifest: Manifest) -> CheckedManifest:
        return cls(**{f.name: getattr(manifest, f.name) for f in fields(manifest)})

    @cached_property
    def _bytes(self) -> bytes:
        return super().to_bytes()

    def to_bytes(self) -> bytes:
        return self._bytes


def _plan(comm: Comm, view: SaveView, layout: LocalLayout) -> SavePlan:
    """Who writes what, with one small gather: each rank sends its layout digest and only its
    irregular chunk specs. Equal digests: the rule plan (O(T + W + irregular) on the coordinator).
    Otherwise a second gather of every rank's chunk specs and the coordinator picks every writer."""
    irregular = [c.spec() for c, cls in zip(view.chunks, layout.classes) if cls == IRREGULAR]
    gathered = comm.gather((layout.digest, irregular, tree_digest(view.tree)))

    def decide() -> SavePlan:
        assert gathered is not None
        differ = len({tree for _, _, tree in gathered}) > 1
        if len({digest for digest, _, _ in gathered}) == 1:
            return SavePlan(True, irregular=assign_writers([specs for _, specs, _ in gathered]), trees_differ=differ)
        return SavePlan(False, trees_differ=differ)

    plan = comm.on_coordinator(decide, default=SaveError)
    tree = view.tree
    if plan.trees_differ:  # every rank's tree to the coordinator, which merges them or refuses the save
        tree = _merged(comm, comm.gather(view.tree), view.tree)
    if plan.rule:
        return replace(plan, tree=tree)
    stored = [c.spec() for c in view.chunks if is_stored(c)]
    held = [RuleHeld(t.key, t.dtype, t.shape, t.rule) for t in layout.tensors if t.rule is not None]
    ruled = {t.key for t in held}
    listed = sorted({s.key for s in stored if s.key not in ruled})
    everything = comm.gather((stored, layout.digest, listed, held))

    def assign() -> tuple[list[list[int]], dict[str, RuleHeld]]:
        gathered = everything or []
        stage = stage_rules([(digest, keys, rules) for _, digest, keys, rules in gathered])
        return assign_writers([[s for s in specs if s.key not in stage] for specs, *_ in gathered]), stage

    full, stage = comm.on_coordinator(assign, default=SaveError)
    return SavePlan(False, full=full, stage=stage, trees_differ=plan.trees_differ, tree=tree)


def tree_digest(tree: dict[str, Any]) -> str:
    """A digest of this rank's shared entries: equal on every rank unless they hold different state."""
    return hashlib.blake2b(encode_state(tree, compact=True), digest_size=16).hexdigest()


def _merged(comm: Comm, trees: list[dict[str, Any]] | None, mine: dict[str, Any]) -> dict[str, Any]:
    """The merged tree on the coordinator (this rank's own elsewhere: only the coordinator writes
    state.json); a disagreement raises SaveError on every rank."""
    merged: dict[str, Any] = {}

    def merge() -> None:
        merged.update(merge_trees(trees or []))

    comm.on_coordinator(merge, default=SaveError)
    return merged if comm.is_coordinator else mine


def _mine(
    comm: Comm, view: SaveView, layout: LocalLayout, plan: SavePlan, rules: dict[str, LayoutRule]
) -> list[LocalChunk]:
    """This rank's chunks to write under ``plan`` (``rules``: each rule-described tensor's, writers set)."""
    if not plan.rule:
        assert plan.full is not None
        stored = [c for c in view.chunks if is_stored(c) and c.key not in rules]
        staged = [c for c in view.chunks if c.key in rules and is_stored(c) and rules[c.key].writes(comm.rank)]
        return [stored[i] for i in plan.full[comm.rank]] + staged
    assert plan.irregular is not None
    whole = [(c.key, c.spec().nbytes) for c, cls in zip(view.chunks, layout.classes) if cls == WHOLE]
    writers = whole_writers(whole, comm.world_size)
    irregular = [c for c, cls in zip(view.chunks, layout.classes) if cls == IRREGULAR]
    mine_irregular = {id(irregular[i]) for i in plan.irregular[comm.rank]}
    out = []
    for chunk, cls in zip(view.chunks, layout.classes):
        if cls == SPLIT and is_stored(chunk) and rules[chunk.key].writes(comm.rank):
            out.append(chunk)
        elif cls == WHOLE and writers[chunk.key] == comm.rank:
            out.append(chunk)
        elif cls == IRREGULAR and id(chunk) in mine_irregular:
            out.append(chunk)
    return out


def _sibling(final: Path | RemoteDir, name: str) -> Path | RemoteDir:
    """The checkpoint ``name`` next to ``final`` (dedup reads its index)."""
    return as_location(final).sibling(name).native


def tensor_entries(
    results: list[RankResult],
    layout: LocalLayout | None,
    rules: dict[str, LayoutRule],
    stage: dict[str, RuleHeld] | None = None,
) -> dict[str, TensorEntry]:
    """The manifest's tensors: listed chunks from the results; with the rule plan, every
    rule-described tensor of the coordinator's layout (equal on every rank: the digests agreed) as
    its rule (``rules``: with the writers the save used); with the listed plan, the tensors of
    ``stage`` (pipeline stages' tensors, from every rank: the coordinator's merge) as theirs."""
    meta: dict[str, tuple[str, tuple[int, ...]]] = {key: (t.dtype, t.shape) for key, t in (stage or {}).items()}
    chunks: dict[str, list[ChunkEntry]] = {}
    for held in layout.tensors if layout is not None else ():
        if held.cls == SPLIT:
            meta[held.key] = (held.dtype, held.shape)
    for r in results:
        for spec in r.specs:
            meta.setdefault(spec.key, (spec.dtype, spec.global_shape))
        for key, entry in r.entries:
            chunks.setdefault(key, []).append(entry)
    out = {}
    for key in sorted(meta):
        dtype, shape = meta[key]
        ordered = sorted(chunks.get(key, []), key=lambda c: c.offsets)
        out[key] = TensorEntry(
            dtype_from_name(dtype.removeprefix("torch."), key), tuple(shape), tuple(ordered), rules.get(key)
        )
    return out
