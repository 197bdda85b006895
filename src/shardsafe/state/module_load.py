"""Modules that customise loading: found cheaply, loaded through their own code.

Most modules load *in place*: the checkpoint's bytes are read straight into their parameters and
buffers, no copy. A module whose loading is its own (``load_state_dict`` or ``_load_from_state_dict``
overridden relative to ``nn.Module``, load-state-dict pre/post hooks registered: a buffer that
changes shape, a quantized or LoRA layer, a legacy-key upgrade, a fused weight split on save) must
see the checkpoint's values as torch's ``load_state_dict`` would give them. For each *custom root*
(the topmost such module of its branch) the load reads the checkpoint's values of its subtree into
new tensors (verified, like everything else), then calls ``root.load_state_dict(values)`` (keys
relative to the root, as torch names them), after every rank has verified every byte; a snapshot
of the subtree's parameters and buffers taken just before undoes it if anything fails afterwards.

What is *not* a customisation (the in-place path is exact for them): FSDP2's own hooks (re-shard
before, reset the sharded view after), the activation-checkpoint wrapper's prefix hooks, and the
``_load_from_state_dict`` of torch's norm layers (it only fills ``num_batches_tracked`` for
checkpoints older than the key). The checks are per module and per class (cached), never per
tensor: a model without custom roots pays one pass over its modules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardsafe.core.values import TENSOR_REF, decode_value
from shardsafe.errors import FormatError
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.base import SavedLayout, is_dtensor, read_target
from shardsafe.state.subclasses import rebuild_records

__all__ = [
    "CustomLoad",
    "CustomRoot",
    "clean_name",
    "custom_roots",
    "customises_loading",
    "module_versions",
    "saved_versions",
]

# wrapper modules whose names torch's get_model_state_dict leaves out of the keys it gives
_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# modules whose load hooks keep the in-place path exact (see the module doc)
_BENIGN_HOOK_MODULES = (
    "torch.distributed.fsdp._fully_shard.",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
)


def _benign_overrides() -> frozenset[type]:
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.instancenorm import _InstanceNorm

    return frozenset({nn.Module, _NormBase, _InstanceNorm})


_BY_CLASS: dict[type, bool] = {}


def _class_customises(cls: type) -> bool:
    """Whether ``cls`` customises loading (cached per class: FSDP2 makes one class per wrapped class)."""
    known = _BY_CLASS.get(cls)
    if known is None:
        known = _BY_CLASS[cls] = _overrides_loading(cls)
    return known


def _overrides_loading(cls: type) -> bool:
    """Whether ``cls`` loads through code of its own (an override of ``load_state_dict``,
    ``_load_from_state_dict`` or ``set_extra_state`` by a class other than nn.Module and torch's
    norm layers)."""
    benign = _benign_overrides()
    for method in ("load_state_dict", "_load_from_state_dict", "set_extra_state"):
        owner = next((c for c in cls.__mro__ if method in c.__dict__), nn.Module)
        if owner not in benign:
            return True
    return False


def _hook_is_benign(hook: Any) -> bool:
    function = getattr(hook, "hook", hook)  # torch wraps pre-hooks in _WrappedHook(.hook)
    module = getattr(function, "__module__", None) or ""
    return module.startswith(_BENIGN_HOOK_MODULES)


def customises_loading(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its children) has loading code of its own."""
    if _class_customises(type(module)):
        return True
    hooks = (*module._load_state_dict_pre_hooks.values(), *module._load_state_dict_post_hooks.values())
    return any(not _hook_is_benign(h) for h in hooks)


def clean_name(name: str) -> str:
    """``name`` without the wrapper modules' components (as get_model_state_dict keys it)."""
    if not any(w in name for w in _WRAPPER_NAMES):
        return name
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


@dataclass
class CustomRoot:
    """A topmost module that loads through its own code: its prefix in the state dict's keys."""

    prefix: str  # "" for the model itself
    module: nn.Module
    values: dict[str, Any] = field(default_factory=dict)  # relative key (torch's naming) -> checkpoint value

    def owns(self, key: str) -> bool:
        return not self.prefix or key.startswith(self.prefix + ".")

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key


def custom_roots(module: nn.Module, clean: bool) -> list[CustomRoot]:
    """The topmost modules of ``module``'s tree that customise loading (a child of one is loaded by
    its ancestor's ``load_state_dict``). ``clean``: prefixes as get_model_state_dict names keys."""
    roots: list[CustomRoot] = []

    def walk(m: nn.Module, prefix: str) -> None:
        if customises_loading(m):
            roots.append(CustomRoot(clean_name(prefix) if clean else prefix, m))
            return
        for child_name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(module, "")
    return roots


def _own_names(module: nn.Module) -> Iterator[str]:
    for name, _ in module.named_parameters(remove_duplicate=False):
        yield name
    for name, _ in module.named_buffers(remove_duplicate=False):
        yield name
    for name, _ in module.named_modules(remove_duplicate=False):
        yield f"{name}._extra_state" if name else "_extra_state"


def _fresh(shape: tuple[int, ...], dtype: torch.dtype, like: Any) -> torch.Tensor:
    """A new tensor for a checkpoint value of ``shape``/``dtype``: laid out like the live tensor it
    replaces where the global shapes agree (a DTensor keeps its mesh and placements, so each rank
    reads only its part), else whole, on the live tensor's device."""
    if isinstance(like, torch.Tensor) and tuple(like.shape) == shape:
        if is_dtensor(like):
            from torch.distributed.tensor import DTensor

            local = torch.empty_like(like.to_local(), dtype=dtype)  # type: ignore[attr-defined]
            return DTensor.from_local(
                local,
                like.device_mesh,  # type: ignore[attr-defined]
                like.placements,  # type: ignore[attr-defined]
                run_check=False,
                shape=like.shape,
                stride=like.stride(),
            )
        return torch.empty(shape, dtype=dtype, device=like.device)
    device = torch.device("cpu")
    if isinstance(like, torch.Tensor):
        device = like.to_local().device if is_dtensor(like) else like.device  # type: ignore[attr-defined]
    return torch.empty(shape, dtype=dtype, device="cpu" if device.type == "meta" else device)


class CustomLoad:
    """The custom roots of one module bound for loading: the checkpoint values of each root's
    subtree decoded over new tensors (read-target ``fresh``: read and verified in the load's first
    pass), handed to the root's ``load_state_dict`` by :meth:`apply`."""

    def __init__(self, roots: list[CustomRoot]) -> None:
        self.roots = roots
        self._made: dict[str, torch.Tensor] = {}  # stored key -> the new tensor it is read into
        # the checkpoint's module versions (clean name -> _version; absent: 1), None for a checkpoint
        # written before they were saved (then the live classes' versions are handed on)
        self.versions: dict[str, int] | None = None

    def owns(self, key: str) -> bool:
        return any(root.owns(key) for root in self.roots)

    def bind(
        self,
        name: str,
        saved_state: Any,
        live: dict[str, Any],
        layout: SavedLayout | None,
        clean: bool,
        targets: dict[str, ReadTarget],
    ) -> None:
        """Decode the checkpoint's values under each root, every stored tensor in them a new tensor
        registered in ``targets`` (nothing is read yet)."""
        if not isinstance(saved_state, dict) or layout is None:
            return
        raw: list[dict[str, str]] = [
            {clean_name(n): n for n in _own_names(root.module)} if clean else {} for root in self.roots
        ]
        for key, encoded in saved_state.items():
            if not isinstance(key, str):
                continue
            for root, names in zip(self.roots, raw):
                if not root.owns(key):
                    continue
                like = live.get(key) if _is_ref(encoded) else None
                relative = root.relative(key)
                root.values[names.get(relative, relative)] = decode_value(
                    encoded, self._allocator(layout, like, targets), f"state.json {name!r}"
                )
                break

    def apply(self, strict: bool) -> None:
        for root in self.roots:
            values = _with_versions(rebuild_records(root.values), root, self.versions)
            if strict:
                root.module.load_state_dict(values)
            else:
                root.module.load_state_dict(values, strict=False)

    def snapshot(self) -> Callable[[], None]:
        """An undo of :meth:`apply` that runs no user code: every module of the subtrees gets its
        parameter and buffer objects back, holding their values as they were (one copy of the
        subtrees' local values)."""
        held: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for root in self.roots:
            for m in root.module.modules():
                held.append((m, dict(m._parameters), dict(m._buffers)))
                for t in (*m._parameters.values(), *m._buffers.values()):
                    for part in _memory_of(t) if t is not None else ():
                        if id(part) not in values:
                            values[id(part)] = (part, part.detach().clone())

        def undo() -> None:
            for m, params, buffers in held:
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
            with torch.no_grad():
                for tensor, copy in values.values():
                    tensor.copy_(copy)

        return undo

    def _allocator(
        self, layout: SavedLayout, like: Any, targets: dict[str, ReadTarget]
    ) -> Callable[[str], torch.Tensor]:
        def allocate(key: str) -> torch.Tensor:
            made = self._made.get(key)
            if made is not None:  # one stored tensor referenced twice: one new tensor
                return made
            stored = layout(key)
            if stored is None:  # reported by the checks (state.json refers to a tensor the manifest lacks)
                return torch.empty(0)
            tensor = self._made[key] = _fresh(stored[0], stored[1], like)
            targets[key] = read_target(key, tensor, fresh=True)
            return tensor

        return allocate


def _memory_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s values: itself, a DTensor's local tensor, or a tensor
    subclass's inner tensors (an NF4 weight's clone() would quantize again, with other settings)."""
    local: Any = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    flatten = getattr(local, "__tensor_flatten__", None)
    if type(local) in (torch.Tensor, nn.Parameter) or flatten is None:
        return [local]
    names, _ = flatten()
    return [part for name in names for part in _memory_of(getattr(local, name))]


def _is_ref(encoded: Any) -> bool:
    return isinstance(encoded, dict) and len(encoded) == 1 and TENSOR_REF in encoded


def module_versions(module: nn.Module) -> dict[str, int]:
    """What a save records of the modules' ``_version`` (torch's ``state_dict()._metadata``): every
    module whose version is not 1 (nn.Module's), by clean name (a load takes an absent one as 1)."""
    return {
        clean_name(name): m._version
        for name, m in module.named_modules(remove_duplicate=False)
        if getattr(m, "_version", 1) != 1
    }


def saved_versions(entry: Any, where: str) -> dict[str, int] | None:
    """A module entry's ``versions`` (None when the checkpoint has none: written before they were saved)."""
    versions = entry.get("versions") if isinstance(entry, dict) else None
    if versions is None:
        return None
    if not isinstance(versions, dict) or not all(
        type(v) is int and -(1 << 62) < v < 1 << 62 for v in versions.values()
    ):
        raise FormatError(f"{where}: 'versions' must map module names to integer versions")
    return versions


def _with_versions(values: dict[str, Any], root: CustomRoot, versions: dict[str, int] | None) -> dict[str, Any]:
    """``values`` as torch's state_dict() gives them, with ``_metadata`` holding each module's
    ``_version``: the checkpoint's (so a module's own ``_load_from_state_dict`` migrates what an older
    version of its class saved), or, for a checkpoint written before versions were saved, the live
    classes' (a module that upgrades older layouts by version must not take it for an old one)."""
    out: Any = OrderedDict(values)
    metadata: OrderedDict[str, dict[str, int]] = OrderedDict()
    for name, m in root.module.named_modules(remove_duplicate=False):
        if versions is None:
            metadata[name] = {"version": m._version}
        else:
            full = clean_name(f"{root.prefix}.{name}" if root.prefix and name else root.prefix or name)
            metadata[name] = {"version": versions.get(full, 1)}
    out._metadata = metadata  # type: ignore[attr-defined]
    return out
