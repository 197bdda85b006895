"""The one table of state adapters, and everything that dispatches through it.

Each ``state`` value is handled by the first adapter in :data:`ADAPTERS` that matches it (a
DeepSpeed engine before ``nn.Module``, since an engine is one; a per-rank stateful before a plain
one; a plain value last), and a saved entry by the adapter of its ``kind``. Save
(:func:`describe_for_save`), load (:func:`bind_for_load`, :func:`check_binding`,
:func:`prepare_steps`) and ``inspect`` (:func:`summarize_entry`, :func:`display_shapes`) all go
through this table; no other module branches on kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shardsafe.core.format import Manifest
from shardsafe.core.plan import LocalChunk
from shardsafe.core.values import encode_state, merge_values, state_tensor_keys, subclass_records
from shardsafe.errors import FormatError, SaveError, ShardsafeError, StateMismatchError
from shardsafe.protocol.shard_write import chunk_name
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.adapters import ModuleAdapter, PerRankAdapter, StatefulAdapter, TensorAdapter, ValueAdapter
from shardsafe.state.base import (
    KIND_PER_RANK,
    Bound,
    LoadContext,
    LoadStep,
    Lookup,
    SaveContext,
    SavedLayout,
    StateAdapter,
    TensorCache,
)
from shardsafe.state.deepspeed_engine import ENGINE_ADAPTER
from shardsafe.state.optimizer import OptimizerAdapter
from shardsafe.state.subclasses import subclass_problems, subclass_side_keys

__all__ = [
    "ADAPTERS",
    "DescribeCache",
    "LoadBinding",
    "SaveView",
    "adapter_for",
    "adapter_for_kind",
    "bind_for_load",
    "check_binding",
    "describe_for_save",
    "describe_mismatch",
    "display_shapes",
    "fresh_optimizers",
    "merge_trees",
    "prepare_steps",
    "summarize_entry",
    "unclaimed",
]

ADAPTERS: tuple[StateAdapter, ...] = (
    ENGINE_ADAPTER,
    ModuleAdapter(),
    OptimizerAdapter(),
    PerRankAdapter(),
    TensorAdapter(),
    StatefulAdapter(),
    ValueAdapter(),
)
_BY_KIND: dict[str, StateAdapter] = {a.kind: a for a in ADAPTERS}


def adapter_for(value: Any) -> StateAdapter:
    """The adapter of a live value (the value adapter takes anything)."""
    return next(a for a in ADAPTERS if a.matches(value))


def adapter_for_kind(kind: object) -> StateAdapter | None:
    """The adapter of a saved entry's ``kind`` (None for a kind this version does not know)."""
    return _BY_KIND.get(kind) if isinstance(kind, str) else None


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ShardsafeError(f"state keys must be non-empty strings without '/', got {name!r}")


# ----------------------------------------------------------------------------- save


@dataclass(frozen=True)
class SaveView:
    """What this rank contributes to a save."""

    chunks: list[LocalChunk] = field(default_factory=list)
    tree: dict[str, Any] = field(default_factory=dict)  # shared entries (coordinator's copy is saved)
    per_rank: dict[str, Any] = field(default_factory=dict)  # this rank's per-rank entries


class DescribeCache:
    """What a save of one state keeps for the next save of the same state (a training run's manager).

    The state is described afresh every save (every adapter's state dict, so step counters, learning
    rates, RNG and data positions are always the current ones, and the tree is checked as a load
    checks it), but a tensor unchanged since the previous save (:func:`~shardsafe.state.base.tensor_identity`)
    keeps its chunks and checks (:class:`~shardsafe.state.base.TensorCache`), and when the whole
    structure is unchanged (:attr:`structure`: names, every chunk's key, dtype, shapes, offsets,
    device, rule) the uniqueness check of the chunk names is not repeated.

    ``unchanged``: the last describe found the previous save's structure; ``full`` / ``cached``:
    how many describes found a new structure (or had no previous one) / an unchanged one."""

    def __init__(self) -> None:
        self.tensors = TensorCache()
        self.structure: tuple[Any, ...] | None = None
        self.unchanged = False
        self.full = 0
        self.cached = 0

    def forget(self) -> None:
        """The next describe is a full one (nothing reused)."""
        self.tensors.clear()
        self.structure = None
        self.unchanged = False

    def withdraw(self) -> None:
        """Undo the last describe's reuse: another rank's structure changed, so this rank describes
        again in full (ranks reuse only together). The describe that found its structure unchanged
        is no longer counted as one; the next describe is a full one."""
        if self.unchanged:
            self.cached -= 1
        self.forget()


def _structure(view: SaveView) -> tuple[Any, ...]:
    """Everything about ``view`` that a save's checks and plan depend on, except the tree's values."""
    return (
        tuple(view.tree),
        tuple(view.per_rank),
        tuple(
            (
                c.key,
                c.global_shape,
                c.offsets,
                tuple(c.tensor.shape),
                c.tensor.dtype,
                c.tensor.device,
                c.per_rank,
                c.rule,
            )
            for c in view.chunks
        ),
    )


def describe_for_save(state: dict[str, Any], rank: int, cache: DescribeCache | None = None) -> SaveView:
    """This rank's view of ``state``, refused (FormatError) if any reader would refuse what it holds.

    The shared entries, and this rank's per-rank entries as they will sit in ``state.json``, are
    encoded and run through the very checks a load runs on the file (size, depth, tags, tensor
    keys); every chunk name this rank may write is unique in its shard file. So a save refuses,
    before anything is written, what a load would refuse. ``cache``: what the previous describe of
    this state found (:class:`DescribeCache`), reused where nothing changed.
    """
    if cache is None:
        return _describe(state, rank)[0]
    cache.unchanged = False
    try:
        with cache.tensors.active():
            view, structure = _describe(state, rank, cache.structure, True)
    except BaseException:
        cache.forget()
        raise
    cache.unchanged = structure == cache.structure
    cache.structure = structure
    if cache.unchanged:
        cache.cached += 1
    else:
        cache.full += 1
    return view


def _describe(
    state: dict[str, Any], rank: int, previous: tuple[Any, ...] | None = None, cached: bool = False
) -> tuple[SaveView, tuple[Any, ...] | None]:
    """The view, and with ``cached`` its structure (``previous``: the previous save's, its chunk names unique)."""
    chunks: list[LocalChunk] = []
    tree: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    ctx = SaveContext(state, rank)
    for name, value in state.items():
        check_name(name)
        described = adapter_for(value).describe(name, value, ctx)
        if described.entry is not None:
            tree[name] = described.entry
            chunks += described.chunks
        else:
            per_rank[name] = described.per_rank
            chunks += [replace(chunk, per_rank=True) for chunk in described.chunks]
    view = SaveView(chunks, tree, per_rank)
    encode_state(
        {**view.tree, **{n: {"kind": KIND_PER_RANK, "ranks": [e]} for n, e in view.per_rank.items()}}, compact=True
    )
    structure = _structure(view) if cached else None
    if previous is not None and structure == previous:
        return view, structure  # the same chunk keys as the previous save's, whose names were unique
    seen: set[str] = set()
    for chunk in view.chunks:
        shown = chunk_name(chunk)
        if shown in seen:
            raise FormatError(
                f"tensor {chunk.key!r:.200}: its shard-file entry name {shown!r:.200} is another chunk's too (a key "
                "containing '@'?)"
            )
        seen.add(shown)
    return view, structure


def merge_trees(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's tree from every rank's shared entries (in rank order), when ranks hold
    different state (pipeline stages, experts on their own ranks): the union of the names, each
    entry merged by its adapter's ``merge`` where it has one (an optimizer's param groups), else
    key by key with every value several ranks hold equal (:func:`~shardsafe.core.values.merge_values`).
    Raises SaveError on a disagreement, before anything is written."""
    names: dict[str, None] = {}
    for tree in trees:
        names.update(dict.fromkeys(tree))
    merged: dict[str, Any] = {}
    for name in names:
        held = [(rank, tree[name]) for rank, tree in enumerate(trees) if name in tree]
        kinds = {entry.get("kind") for _, entry in held}
        if len(kinds) > 1:
            raise SaveError(
                f"state[{name!r}] is saved as {sorted(map(str, kinds))} on different ranks; one name must be one kind "
                "of value"
            )
        adapter = adapter_for_kind(held[0][1].get("kind"))
        merge = getattr(adapter, "merge", None)
        merged[name] = merge(name, held) if merge is not None else merge_values(held, f"state[{name!r}]")
    return merged


# ----------------------------------------------------------------------------- load


@dataclass(frozen=True)
class LoadBinding:
    """Every live value bound for loading, with what its adapter was told about the checkpoint."""

    bound: dict[str, Bound] = field(default_factory=dict)
    contexts: dict[str, LoadContext] = field(default_factory=dict)

    @property
    def targets(self) -> dict[str, ReadTarget]:
        """Every in-place read target, by tensor key."""
        return {key: t for b in self.bound.values() for key, t in b.targets.items()}

    @property
    def early(self) -> set[str]:
        """The target keys whose values user code takes before the last phase (see Bound.early)."""
        return {key for b in self.bound.values() for key in b.early}


def bind_for_load(
    state: dict[str, Any],
    rank: int,
    saved_tree: dict[str, Any] | None = None,
    layout: SavedLayout | None = None,
    strict: bool = True,
    atomic: bool = True,
) -> LoadBinding:
    """Destinations for loading into ``state``; with the checkpoint's tree and ``layout``, a fresh
    optimizer first gets state tensors shaped like the stored ones, and a module's subtree that
    loads through its own code new tensors for the checkpoint's values."""
    binding = LoadBinding()
    for name, value in state.items():
        check_name(name)
        saved = saved_tree.get(name) if saved_tree is not None else None
        ctx = LoadContext(state, rank, saved, layout, strict, atomic)
        binding.bound[name] = adapter_for(value).bind(name, value, ctx)
        binding.contexts[name] = ctx
    return binding


def check_binding(binding: LoadBinding, manifest: Manifest, tree: dict[str, Any], strict: bool = True) -> list[str]:
    """Every reason the checkpoint does not fit the bound state on this rank (nothing is modified):
    a missing or differently kinded entry, tensors this rank asks for that the checkpoint lacks
    (``strict``), shapes and dtypes, and each adapter's own checks of the saved entry against the
    live value. Stored tensors this rank does not ask for are another rank's (a pipeline stage's):
    :func:`unclaimed_keys` gives them, and the load reports those that no rank asked for."""
    problems: list[str] = []
    for name, bound in binding.bound.items():
        adapter = bound.adapter
        if name not in tree:
            problems.append(f"{name!r}: not in the checkpoint (it holds {sorted(tree)})")
            continue
        saved_kind = tree[name].get("kind") if isinstance(tree[name], dict) else None
        if saved_kind != adapter.kind:
            problems.append(f"{name!r}: saved as {saved_kind}, loading into a {adapter.kind}")
            continue
        if adapter.in_place:
            saved = set(state_tensor_keys(tree[name].get("state")))
            records = subclass_records(tree[name].get("state"))
            side = subclass_side_keys(records, bound.subclasses, bound.targets.keys(), saved)
            if strict:
                problems += [f"missing in checkpoint: {k}" for k in sorted(bound.targets.keys() - saved - side)]
            for key in sorted(bound.targets.keys() & saved):
                problems += _compare_tensor(key, manifest, bound.targets[key], strict)
            problems += subclass_problems(records, bound.subclasses, bound.targets.keys(), saved)
        problems += adapter.check(bound, binding.contexts[name], manifest)
    return problems


def unclaimed(binding: LoadBinding, tree: dict[str, Any]) -> set[str]:
    """What this rank leaves of the entries it loads, each as the problem it is if no rank takes
    it (the load intersects every rank's set): stored tensors of in-place entries it does not read,
    and whatever an adapter's optional ``unclaimed(bound, ctx)`` names (an optimizer: state saved
    for parameters it does not have). Other ranks' parts, on pipeline stages."""
    out: set[str] = set()
    for name, bound in binding.bound.items():
        entry = tree.get(name)
        if not (isinstance(entry, dict) and entry.get("kind") == bound.adapter.kind):
            continue
        if bound.adapter.in_place:
            saved = set(state_tensor_keys(entry.get("state")))
            records = subclass_records(entry.get("state"))
            side = subclass_side_keys(records, bound.subclasses, bound.targets.keys(), saved)
            out |= {f"unexpected in checkpoint: {k}" for k in saved - bound.targets.keys() - side}
        extra = getattr(bound.adapter, "unclaimed", None)
        if extra is not None:
            out |= extra(bound, binding.contexts[name])
    return out


def _compare_tensor(key: str, manifest: Manifest, target: ReadTarget, strict: bool) -> list[str]:
    entry = manifest.tensors.get(key)
    if entry is None:
        return [f"{key}: referenced by state.json but not in the manifest"]
    if entry.shape != target.global_shape:
        return [f"shape mismatch for {key}: checkpoint {list(entry.shape)}, model {list(target.global_shape)}"]
    if entry.dtype != target.tensor.dtype and strict:
        return [f"dtype mismatch for {key}: checkpoint {entry.dtype}, model {target.tensor.dtype} (strict=False casts)"]
    return []


def fresh_optimizers(state: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state`` that have not stepped (a DeepSpeed engine's inner one included):
    binding gives them state tensors to read into, which a failed load must take back."""
    out: list[torch.optim.Optimizer] = []
    for value in state.values():
        fresh = getattr(adapter_for(value), "fresh_optimizers", None)
        out += fresh(value) if fresh is not None else []
    return out


def prepare_steps(binding: LoadBinding, lookup: Lookup) -> list[LoadStep]:
    """Every bound value's change, decoded and validated (tensors it takes whole read through
    ``lookup``); nothing is modified."""
    return [b.adapter.prepare(b, binding.contexts[name], lookup) for name, b in binding.bound.items()]


def describe_mismatch(problems: list[str]) -> StateMismatchError:
    shown = "\n  ".join(problems[:50])
    more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
    return StateMismatchError(f"checkpoint does not fit the state ({len(problems)} problems):\n  {shown}{more}")


# ----------------------------------------------------------------------------- inspect


def summarize_entry(name: str, entry: Any, manifest: Manifest) -> dict[str, Any]:
    """Kind and a short description of one top-level ``state.json`` entry (for ``inspect``):
    ``tensors``/``bytes`` for in-place kinds, ``ranks`` for per-rank ones, ``fields``/``field_count``
    for stateful objects, ``value`` for plain values; only name and kind for an unknown kind."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    out: dict[str, Any] = {"name": name, "kind": kind}
    adapter = adapter_for_kind(kind)
    if adapter is not None and isinstance(entry, dict):
        out.update(adapter.summarize(entry, manifest))
    return out


def display_shapes(tree: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Stored key -> the shape to show for it, where that differs from the stored one (a DeepSpeed
    engine stores its parameters flattened); empty for malformed entries."""
    out: dict[str, tuple[int, ...]] = {}
    for name, entry in tree.items():
        adapter = adapter_for_kind(entry.get("kind") if isinstance(entry, dict) else None)
        shapes = getattr(adapter, "display_shapes", None)
        if shapes is not None:
            out.update(shapes(name, entry))
    return out
