"""A module's subclass tensors that cannot take the checkpoint's parts in place: rebuilt and assigned.

An allowlisted subclass tensor of a module (state/subclasses.py) is normally read in place, into its
inner tensors. That needs the live tensor's context to be the checkpoint's: an NF4 weight quantized
with another block size has inner tensors of other shapes. Such a tensor (same class, another
context, not a DTensor: FSDP2 owns its parameters' objects) gets new inner tensors of the stored
shapes, read and verified like every other byte (same outer shape only); once every rank has verified everything, the
checkpoint's tensor is rebuilt from them with ``__tensor_unflatten__`` and assigned in the live
one's place (a new ``nn.Parameter`` with the old one's ``requires_grad``, or a buffer). The undo
puts the old objects back. An optimizer holding the old parameter keeps it: assign before building
the optimizer, or quantize the model as the checkpoint was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardsafe.core.values import SubclassRecord, subclass_records
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.base import SavedLayout, is_dtensor, read_target, subclass_of, subclass_parts, unwrap_module
from shardsafe.state.subclasses import rebuild, same_class, same_context

__all__ = ["Reassigned", "assign_step", "reassigned"]


@dataclass(frozen=True)
class Reassigned:
    """A live subclass tensor to replace: where it sits, and the checkpoint's record whose inner
    tensors are the new tensors its parts are read into."""

    fqn: str
    owner: nn.Module
    attr: str
    record: SubclassRecord


def reassigned(
    name: str,
    module: nn.Module,
    state: dict[str, Any],
    saved_state: Any,
    layout: SavedLayout | None,
    targets: dict[str, ReadTarget],
) -> list[Reassigned]:
    """The entries of ``state`` (the module's, by FQN) to rebuild and assign rather than read in
    place; their stored parts are registered in ``targets`` as new tensors (nothing is read yet)."""
    records = subclass_records(saved_state) if layout is not None and isinstance(saved_state, dict) else {}
    out: list[Reassigned] = []
    for fqn, tensor in state.items() if records else ():
        key = f"{name}/{fqn}"
        record = records.get(key)
        spec = subclass_of(tensor) if record is not None and isinstance(tensor, torch.Tensor) else None
        if record is None or spec is None or is_dtensor(tensor) or not same_class(record.cls, spec.name):
            continue
        if tuple(int(n) for n in tensor.shape) != record.shape:
            continue  # another shape: refused by the checks, as torch's load_state_dict refuses it
        if same_context(record.context, subclass_parts(key, tensor, spec)[1]):
            continue  # read in place
        owner_name, _, attr = fqn.rpartition(".")
        try:
            owner = unwrap_module(module).get_submodule(owner_name)
        except AttributeError:
            continue  # a name the module does not resolve (a wrapper's): the checks report the mismatch
        if attr not in owner._parameters and attr not in owner._buffers:
            continue
        inner: dict[str, torch.Tensor] = {}
        for inner_name in record.inner:
            stored = layout(f"{key}/{inner_name}") if layout is not None else None
            if stored is None:  # refused when the state file was checked against the manifest
                break
            made = torch.empty(stored[0], dtype=stored[1], device=tensor.device)
            targets[f"{key}/{inner_name}"] = read_target(f"{key}/{inner_name}", made, fresh=True)
            inner[inner_name] = made
        else:
            out.append(Reassigned(fqn, owner, attr, replace(record, inner=inner)))
    return out


def assign_step(items: list[Reassigned]) -> tuple[Callable[[], None], Callable[[], None]]:
    """(apply, undo): rebuild each checkpoint tensor from its parts (read by now) and put it in the
    module's place; the undo gives the modules their old objects back."""
    before = [(it.owner, it.attr, it.owner._parameters.get(it.attr), it.owner._buffers.get(it.attr)) for it in items]

    def apply() -> None:
        for it in items:
            new = rebuild(it.record)
            old = it.owner._parameters.get(it.attr)
            if it.attr in it.owner._parameters:
                requires_grad = bool(old.requires_grad) if old is not None else False
                it.owner._parameters[it.attr] = nn.Parameter(new, requires_grad=requires_grad)
            else:
                it.owner._buffers[it.attr] = new

    def undo() -> None:
        for owner, attr, param, buffer in before:
            if attr in owner._parameters:
                owner._parameters[attr] = param
            else:
                owner._buffers[attr] = buffer

    return apply, undo
