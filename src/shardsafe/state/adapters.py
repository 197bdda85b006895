"""The adapters of plain PyTorch and Python state values (the optimizer's is in optimizer.py, a
DeepSpeed engine's in deepspeed_engine.py); state/registry.py puts them in one table.

* module (``nn.Module``: plain, DDP, FSDP2) and tensor (tensors, DTensors): read in place;
* stateful (``state_dict()``/``load_state_dict()``, e.g. an LR scheduler) and per-rank (such an
  object with ``per_rank = True``, like :class:`~shardsafe.state.rng.RNGState`: every rank keeps
  its own): their state is decoded whole, tensors included, then handed to ``load_state_dict``;
* value (JSON-able values): replaced in the state dict.

An object may define ``check_state_dict(state) -> list[str]``: problems with a decoded state, asked
before anything is applied (RNGState checks its generator states with the generators' own setters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardsafe.core.format import Manifest
from shardsafe.core.values import decode_value, state_tensor_keys
from shardsafe.errors import FormatError
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.base import (
    KIND_MODULE,
    KIND_PER_RANK,
    KIND_STATEFUL,
    KIND_TENSOR,
    KIND_VALUE,
    Bound,
    Described,
    LoadContext,
    LoadStep,
    Lookup,
    SaveContext,
    StoredTensor,
    bind_tensors,
    encode_with_chunks,
    snapshot,
    tensor_summary,
    type_problems,
    unwrap_module,
)
from shardsafe.state.module_load import (
    CustomLoad,
    CustomRoot,
    clean_name,
    custom_roots,
    module_versions,
    saved_versions,
)
from shardsafe.state.subclass_load import assign_step, reassigned
from shardsafe.state.subclasses import rebuild_records


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state dict keyed by clean FQNs (torch's ``get_model_state_dict``), or, where a
    state-dict hook renames entries so that torch cannot map them back to parameters (torchtitan's
    fused QKV saves ``wqkv`` as ``wq``/``wk``/``wv``), what ``state_dict()`` itself gives."""
    return _module_state(module)[0]


def _module_state(module: nn.Module) -> tuple[dict[str, Any], bool]:
    """:func:`model_state`, and whether its keys are torch's clean FQNs (else ``state_dict()``'s own)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    try:
        return get_model_state_dict(module), True
    except AttributeError:
        return dict(unwrap_module(module).state_dict()), False


def _made_by_hooks(module: nn.Module, state: dict[str, Any], clean: bool) -> list[str]:
    """The entries of ``state`` that are not the module's own parameters and buffers (made by a
    state-dict hook): only the module's own ``load_state_dict`` can take them back. ``clean``: the
    keys are get_model_state_dict's (without the compile / activation-checkpoint wrappers' names)."""
    inner = unwrap_module(module)
    own = {name for name, _ in inner.named_parameters(remove_duplicate=False)} | {
        name for name, _ in inner.named_buffers(remove_duplicate=False)
    }
    if clean:
        own = {clean_name(name) for name in own}
    return [k for k in state if k not in own]


def _state_of(ctx: LoadContext) -> Any:
    return ctx.saved.get("state") if isinstance(ctx.saved, dict) else None


def _no_step(name: str) -> LoadStep:
    return LoadStep(name, lambda: None)


def _custom_load(value: nn.Module, state: dict[str, Any], clean: bool) -> CustomLoad | None:
    """The module's custom roots (module_load.py); the whole module is one where a state-dict hook
    made entries outside every custom root (torch's load_state_dict is then the only way back)."""
    inner = unwrap_module(value)
    roots = custom_roots(inner, clean)
    custom = CustomLoad(roots)
    made = _made_by_hooks(value, state, clean)
    if made and not all(custom.owns(k) for k in made):
        custom = CustomLoad([CustomRoot("", inner)])
    return custom if custom.roots else None


class ModuleAdapter:
    """``nn.Module`` (plain, DDP, FSDP2): its model state dict, read in place into its parameters and
    buffers; a subtree that loads through its own code (module_load.py) gets the checkpoint's values
    in new tensors, handed to its ``load_state_dict`` once every byte is verified."""

    kind = KIND_MODULE
    in_place = True

    def matches(self, value: Any) -> bool:
        return isinstance(value, nn.Module)

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        chunks: list[Any] = []
        state = encode_with_chunks(model_state(value), name, chunks)
        # the modules' _version (state_dict()._metadata), for their own _load_from_state_dict
        return Described(
            {"kind": self.kind, "state": state, "versions": module_versions(unwrap_module(value))}, chunks=chunks
        )

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        state, clean = _module_state(value)
        custom = _custom_load(value, state, clean)
        own = state if custom is None else {k: v for k, v in state.items() if not custom.owns(k)}
        targets: dict[str, ReadTarget] = {}
        # subclass tensors whose context differs from the checkpoint's (subclass_load.py): rebuilt, assigned
        moved = reassigned(name, value, own, _state_of(ctx), ctx.layout, targets)
        bound = Bound(name, value, self, targets=targets, context=(custom, moved), early=set(targets))
        if moved:
            own = {k: v for k, v in own.items() if k not in {m.fqn for m in moved}}
        bind_tensors(bound.targets, own, name, subclasses=bound.subclasses)
        if custom is None:
            return bound
        before = set(bound.targets)
        custom.versions = saved_versions(ctx.saved, f"state.json {name!r}")
        custom.bind(name, _state_of(ctx), state, ctx.layout, clean, bound.targets)
        bound.early.update(set(bound.targets) - before)
        return bound

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        return []

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        custom, moved = bound.context if isinstance(bound.context, tuple) else (None, [])
        if custom is None and not moved:
            return _no_step(bound.name)
        strict = ctx.strict
        assign, unassign = assign_step(moved)

        def apply() -> None:
            if custom is not None:
                custom.apply(strict)
            assign()

        if not ctx.atomic:  # no undo to keep: run once every tensor is read
            return LoadStep(bound.name, apply, after_tensors=True)
        undo: list[Callable[[], None]] = []

        def apply_undoable() -> None:  # the third phase: every byte verified, nothing live written yet
            undo.append(custom.snapshot() if custom is not None else lambda: None)
            undo.append(unassign)
            apply()

        def undo_all() -> None:
            for step in reversed(undo):
                step()

        return LoadStep(bound.name, apply_undoable, undo=undo_all)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        return tensor_summary(state_tensor_keys(entry.get("state")), manifest)


class TensorAdapter(ModuleAdapter):
    """A tensor or DTensor: read in place."""

    kind = KIND_TENSOR

    def matches(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        chunks: list[Any] = []
        return Described({"kind": self.kind, "state": encode_with_chunks(value, name, chunks)}, chunks=chunks)

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        bound = Bound(name, value, self)
        bind_tensors(bound.targets, value, name, subclasses=bound.subclasses)
        return bound


def _checked_state(obj: Any, state: Any, name: str) -> None:
    """Ask the object itself (``check_state_dict``), if it can say, whether ``state`` would load."""
    check = getattr(obj, "check_state_dict", None)
    problems = check(state) if callable(check) else []
    if problems:
        raise FormatError(
            f"state.json: {name!r} cannot be loaded into its object: " + "; ".join(str(p) for p in problems[:10])
        )


def _load_step(name: str, obj: Any, state: Any) -> LoadStep:
    undo = snapshot(obj, name)

    def apply() -> None:
        obj.load_state_dict(state)

    return LoadStep(name, apply, undo=undo or (lambda: None))


class StatefulAdapter:
    """Anything with ``state_dict()`` and ``load_state_dict()`` (schedulers, samplers, user objects).

    On load its saved state is decoded whole (its tensors read, each stored key once) and, with
    ``strict``, compared with its current ``state_dict()`` for values of another type (a string
    where the scheduler has a number); ``load_state_dict`` runs before any tensor is written,
    after a snapshot of the current state that a failure anywhere puts back.
    """

    kind = KIND_STATEFUL
    in_place = False

    def matches(self, value: Any) -> bool:
        return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        chunks: list[Any] = []
        return Described(
            {"kind": self.kind, "state": encode_with_chunks(value.state_dict(), name, chunks)}, chunks=chunks
        )

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        return Bound(name, value, self)

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        if not ctx.strict:
            return []
        saved = decode_value(_state_of(ctx), StoredTensor, f"state.json {bound.name!r}")
        return type_problems(bound.value.state_dict(), saved, f"{bound.name!r}: state")

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        state = rebuild_records(decode_value(_state_of(ctx), lookup, f"state.json {bound.name!r}"))
        _checked_state(bound.value, state, bound.name)
        return _load_step(bound.name, bound.value, state)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        state = entry.get("state")
        if not isinstance(state, dict):
            return {}
        return {
            "fields": {k: v for k, v in state.items() if v is None or isinstance(v, (bool, int, float, str))},
            "field_count": len(state),
        }


class PerRankAdapter(StatefulAdapter):
    """A stateful object with ``per_rank = True``: every rank saves its own state (under
    ``<name>/rank<r>/...``) and loads the one its rank saved (round-robin on more ranks)."""

    kind = KIND_PER_RANK

    def matches(self, value: Any) -> bool:
        return (
            bool(getattr(value, "per_rank", False))
            and hasattr(value, "state_dict")
            and hasattr(value, "load_state_dict")
        )

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        chunks: list[Any] = []
        return Described(
            per_rank=encode_with_chunks(value.state_dict(), f"{name}/rank{ctx.rank}", chunks), chunks=chunks
        )

    def _mine(self, bound: Bound, ctx: LoadContext) -> Any:
        ranks = ctx.saved.get("ranks") if isinstance(ctx.saved, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise FormatError(f"state.json: {bound.name!r} has no per-rank entries")
        return ranks[ctx.rank % len(ranks)]

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        decode_value(self._mine(bound, ctx), StoredTensor, f"state.json {bound.name!r}")
        return []

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        state = rebuild_records(decode_value(self._mine(bound, ctx), lookup, f"state.json {bound.name!r}"))
        _checked_state(bound.value, state, bound.name)
        return _load_step(bound.name, bound.value, state)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        ranks = entry.get("ranks")
        return {"ranks": len(ranks) if isinstance(ranks, list) else 0}


class ValueAdapter:
    """Any other value: stored as JSON (tensors inside by reference), replaced in the state dict on load."""

    kind = KIND_VALUE
    in_place = False

    def matches(self, value: Any) -> bool:
        return True

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        chunks: list[Any] = []
        return Described({"kind": self.kind, "state": encode_with_chunks(value, name, chunks)}, chunks=chunks)

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        return Bound(name, value, self)

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        return []

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        decoded = rebuild_records(decode_value(_state_of(ctx), lookup, f"state.json {bound.name!r}"))
        state = ctx.state

        def apply() -> None:
            state[bound.name] = decoded

        return LoadStep(bound.name, apply)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        return {"value": entry.get("state")}


__all__ = [
    "ModuleAdapter",
    "PerRankAdapter",
    "StatefulAdapter",
    "TensorAdapter",
    "ValueAdapter",
    "model_state",
    "unwrap_module",
]
