"""A ``torch.optim.Optimizer`` as a state value: its state keyed by the parameter names of the module
in the same state dict (so it reshards and survives reordering), read in place.

Before anything is modified a load checks the saved optimizer against the live one: the same
number of param groups holding the same parameters, hyper-parameters of the same types (a string
``lr`` or a one-element ``betas`` would only fail at the next step), state entries only for this
optimizer's parameters, each tensor referenced under the key the load reads it by, and plain
entries (an old torch's float ``step``) of the live entries' types.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardsafe.core.format import Manifest
from shardsafe.core.values import decode_value, merge_values, state_tensor_keys
from shardsafe.errors import FormatError, SaveError, ShardsafeError
from shardsafe.state.base import (
    KIND_OPTIMIZER,
    Bound,
    Described,
    LoadContext,
    LoadStep,
    Lookup,
    SaveContext,
    SavedLayout,
    StoredTensor,
    bind_tensors,
    encode_with_chunks,
    local_tensor,
    param_names,
    tensor_summary,
    type_problems,
    unwrap_module,
)

__all__ = ["OptimizerAdapter", "create_state_by_stepping"]


def owner_module(state: dict[str, Any], optimizer: torch.optim.Optimizer, name: str) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= set(param_names(value)):
            return value
    raise ShardsafeError(
        f"state[{name!r}] is an optimizer, but no nn.Module in the same state dict owns all of its "
        "parameters; put the model in the dict too (its parameter names key the optimizer state)"
    )


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter names.

    An optimizer that has not stepped yet is described without touching it: torch's helper would
    run a dummy step to create its state, changing what training does next.
    """
    if optimizer.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer)
    names = param_names(module)
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[id(p)] for p in group["params"]]
        groups.append(g)
    return {"state": {}, "param_groups": groups}


def allocate_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, saved_state: Any, layout: SavedLayout
) -> bool:
    """Give a fresh optimizer empty state tensors shaped like the checkpoint's, to be read into.

    torch's get_optimizer_state_dict creates missing state with a dummy optimizer step, which on
    a large model costs more than reading the checkpoint. Here a parameter-shaped entry
    (``exp_avg``) becomes ``empty_like(param)`` (same sharding and dtype as the parameter, as the
    optimizer itself would make it); any other tensor (``step``) gets the stored shape and dtype,
    on the parameter's device only for ``fused``/``capturable`` groups, as torch places it.
    Every element is then overwritten by the load (the manifest's chunks tile each tensor).

    Sizes come from the checkpoint, so nothing is allocated unless every non-parameter-shaped
    entry is at most as large as its parameter (true of torch's optimizers); otherwise this
    returns False and allocates nothing, and the caller creates the state the optimizer's own way.
    """
    by_name = {n: p for n, p in unwrap_module(module).named_parameters(remove_duplicate=False)}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    decoded = decode_value(saved_state, lambda key: key)
    entries = decoded.get("state", {}) if isinstance(decoded, dict) else {}
    planned: list[tuple[torch.Tensor, str, tuple[int, ...], torch.dtype]] = []
    for fqn, saved in entries.items() if isinstance(entries, dict) else ():
        param = by_name.get(fqn)
        if param is None or id(param) not in group_of or not isinstance(saved, dict):
            continue  # reported by the checks
        for k, key in saved.items():
            found = layout(key) if isinstance(key, str) else None
            if found is None:
                continue
            shape, dtype = found
            if not (param.dim() and shape == tuple(param.shape)) and math.prod(shape) > max(param.numel(), 1):
                return False
            planned.append((param, k, shape, dtype))
    with torch.no_grad():
        for owner, k, shape, dtype in planned:
            if owner.dim() and shape == tuple(owner.shape):
                optimizer.state[owner][k] = torch.empty_like(owner)
            else:
                group = group_of[id(owner)]
                device = (
                    local_tensor(owner).device if group.get("fused") or group.get("capturable") else torch.device("cpu")
                )
                optimizer.state[owner][k] = torch.empty(shape, dtype=dtype, device=device)
    return True


def create_state_by_stepping(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """torch's way to give a fresh optimizer its state: a step with zero gradients (get_optimizer_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(module, optimizer)


def _saved_tree(name: str, saved_entry: Any) -> dict[str, Any]:
    """The saved optimizer state with tensors as :class:`StoredTensor`; FormatError if malformed."""
    where = f"state.json {name!r} (optimizer)"
    saved = decode_value(saved_entry.get("state") if isinstance(saved_entry, dict) else None, StoredTensor, where)
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("state"), dict)
        or not isinstance(saved.get("param_groups"), list)
    ):
        raise FormatError(f"{where}: needs a 'state' object and a 'param_groups' list")
    for g in saved["param_groups"]:
        if (
            not isinstance(g, dict)
            or not isinstance(g.get("params"), list)
            or not all(isinstance(p, str) for p in g["params"])
        ):
            raise FormatError(f"{where}: a param group without a list of parameter names")
    for fqn, entries in saved["state"].items():
        if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
            raise FormatError(f"{where}: the state of parameter {fqn!r:.100} is not an object with string keys")
    return saved


def check_saved_optimizer(
    name: str, module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], strict: bool
) -> list[str]:
    """Problems that would make restoring the optimizer wrong, found before anything is modified."""
    where = f"{name!r} (optimizer)"
    names = param_names(module)
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    stored = [list(g["params"]) for g in saved["param_groups"]]
    # A pipeline stage's optimizer holds its own parameters of each saved group (the checkpoint's
    # groups are the merge over ranks); in one process that is every parameter, in the same order.
    if len(current) != len(stored) or any(not set(c) <= set(s) or _order(c, s) != c for c, s in zip(current, stored)):
        return [
            f"{name}: optimizer parameter groups differ (saved {[len(g) for g in stored]} params per group, now "
            f"{[len(g) for g in current]})"
        ]
    problems: list[str] = []
    for g, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        for k in (group.keys() & saved_group.keys()) - {"params"}:
            problems += type_problems(group[k], saved_group[k], f"{where}: param group {g} {k!r}", same_length=True)
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    for fqn, entries in saved["state"].items():
        param = by_name.get(fqn)
        if param is None:  # another rank's (a pipeline stage); state no rank loads is reported once by the load
            continue
        live = optimizer.state.get(param, {})
        for k, v in entries.items():
            expected = f"{name}/state/{fqn}/{k}"
            if isinstance(v, StoredTensor) and v.key != expected:
                raise FormatError(
                    f"state.json {where}: state {k!r} of {fqn!r:.100} refers to tensor {v.key!r:.100}, not "
                    f"{expected!r:.100}"
                )
            if not isinstance(v, StoredTensor) and k in live:
                problems += type_problems(live[k], v, f"{where}: state {k!r} of {fqn!r:.100}")
    return problems


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def merge_optimizer_entries(name: str, held: list[tuple[int, Any]]) -> dict[str, Any]:
    """One optimizer entry from the ranks that hold one (pipeline stages: each its own
    parameters). Param group g of the checkpoint holds every rank's group g parameters (in rank
    order, each once); its hyper-parameters, and the state of a parameter several ranks hold,
    must be equal on every rank."""
    where = f"state[{name!r}] (optimizer)"
    counts = {rank: len(entry["state"]["param_groups"]) for rank, entry in held}
    if len(set(counts.values())) > 1:
        raise SaveError(
            f"{where}: the ranks' optimizers have different numbers of param groups ({counts}); every rank must have "
            "the same groups"
        )
    groups = []
    for g in range(next(iter(counts.values()))):
        params: dict[str, None] = {}
        for _, entry in held:
            params.update(dict.fromkeys(entry["state"]["param_groups"][g]["params"]))
        hyper = merge_values(
            [(r, {k: v for k, v in e["state"]["param_groups"][g].items() if k != "params"}) for r, e in held],
            f"{where} param group {g}",
        )
        groups.append({**hyper, "params": list(params)})
    rest = merge_values([(r, {k: v for k, v in e["state"].items() if k != "param_groups"}) for r, e in held], where)
    return {"kind": KIND_OPTIMIZER, "state": {**rest, "param_groups": groups}}


def _order(current: list[str], stored: list[str]) -> list[str]:
    """``current``'s names in the order ``stored`` has them."""
    position = {n: i for i, n in enumerate(stored)}
    return sorted(current, key=lambda n: position.get(n, -1))


class OptimizerAdapter:
    kind = KIND_OPTIMIZER
    in_place = True

    def merge(self, name: str, held: list[tuple[int, Any]]) -> dict[str, Any]:
        return merge_optimizer_entries(name, held)

    def unclaimed(self, bound: Bound, ctx: LoadContext) -> set[str]:
        """State saved for parameters this optimizer does not have (another stage's, or nobody's)."""
        saved = _saved_tree(bound.name, ctx.saved)
        names = param_names(bound.context)
        mine = {names[id(p)] for group in bound.value.param_groups for p in group["params"]}
        where = f"{bound.name!r} (optimizer)"
        return {
            f"{where}: the checkpoint holds state for {fqn!r:.100}, not a parameter of this optimizer"
            for fqn in saved["state"]
            if fqn not in mine
        }

    def matches(self, value: Any) -> bool:
        return isinstance(value, torch.optim.Optimizer)

    def fresh_optimizers(self, value: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        return [] if value.state else [value]

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described:
        osd = optimizer_state(owner_module(ctx.state, value, name), value)
        chunks: list[Any] = []
        return Described({"kind": self.kind, "state": encode_with_chunks(osd, name, chunks)}, chunks=chunks)

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound:
        """In-place targets for the state tensors; a fresh optimizer first gets state tensors shaped
        like the stored ones (``api.load`` empties them again if the load fails)."""
        module = owner_module(ctx.state, value, name)
        fresh = not value.state
        if fresh:
            saved = ctx.saved
            if not (
                ctx.layout is not None
                and isinstance(saved, dict)
                and allocate_optimizer_state(module, value, saved.get("state"), ctx.layout)
            ):
                create_state_by_stepping(module, value)
        bound = Bound(name, value, self, context=module)
        # State this load created is fresh: a failed load drops it, so it may be read into before the ranks agree.
        bind_tensors(bound.targets, optimizer_state(module, value)["state"], f"{name}/state", fresh=fresh)
        return bound

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]:
        return check_saved_optimizer(
            bound.name, bound.context, bound.value, _saved_tree(bound.name, ctx.saved), ctx.strict
        )

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep:
        """Hyper-parameters and plain state entries, assigned once the tensors are read in place."""
        saved = _saved_tree(bound.name, ctx.saved)
        optimizer: torch.optim.Optimizer = bound.value
        names = param_names(bound.context)
        by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
        plain = [
            (by_name[fqn], k, v)
            for fqn, entries in saved["state"].items()
            if fqn in by_name
            for k, v in entries.items()
            if not isinstance(v, StoredTensor)
        ]

        def apply() -> None:
            for group, values in zip(optimizer.param_groups, hyper):
                group.update(values)
            for param, k, v in plain:
                optimizer.state[param][k] = v

        return LoadStep(bound.name, apply)

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
        return tensor_summary(state_tensor_keys(entry.get("state")), manifest)
