"""What every state adapter is: the interface of one kind of ``state`` value, and the typed pieces
that pass between an adapter, the registry and the api.

A save asks each value's adapter to :meth:`~StateAdapter.describe` it (a JSON entry plus the
tensor chunks this rank holds). A load asks it to :meth:`~StateAdapter.bind` (the tensors read in
place), :meth:`~StateAdapter.check` the saved entry against the live value (problems, nothing
modified), and :meth:`~StateAdapter.prepare` a :class:`LoadStep`: everything decoded and validated,
to be applied only once every rank has prepared. Tensor keys are ``<state name>/<path>``, named by
the same function on save and on load.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import torch
from torch import nn

from shardsafe.core.boxes import DimSplit, dim_runs, local_boxes, local_shape
from shardsafe.core.dtypes import dtype_name, is_packed, safetensors_shape
from shardsafe.core.format import MAX_DIMS, MAX_NUMEL, Manifest, check_tensor_key, numel
from shardsafe.core.plan import LocalChunk
from shardsafe.core.rule import LayoutRule, Placement
from shardsafe.core.values import SubclassRecord, encode_value, subclass_entry
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.protocol.transfer import ReadTarget
from shardsafe.state.subclasses import SubclassSpec, class_name, encode_context, spec_for_type

__all__ = [
    "Bound",
    "Described",
    "KIND_DEEPSPEED_ENGINE",
    "KIND_MODULE",
    "KIND_OPTIMIZER",
    "KIND_PER_RANK",
    "KIND_STATEFUL",
    "KIND_TENSOR",
    "KIND_VALUE",
    "LoadContext",
    "LoadStep",
    "Lookup",
    "Piece",
    "SaveContext",
    "SavedLayout",
    "StateAdapter",
    "StoredTensor",
    "bind_tensors",
    "is_dtensor",
    "TensorCache",
    "check_layout",
    "check_storable",
    "check_subclass",
    "encode_with_chunks",
    "local_tensor",
    "param_names",
    "pieces",
    "read_target",
    "snapshot",
    "subclass_of",
    "subclass_parts",
    "tensor_summary",
    "type_problems",
    "unwrap_module",
]

log = logging.getLogger("shardsafe")

KIND_MODULE = "module"
KIND_OPTIMIZER = "optimizer"
KIND_STATEFUL = "stateful"
KIND_PER_RANK = "per_rank"
KIND_TENSOR = "tensor"
KIND_VALUE = "value"
KIND_DEEPSPEED_ENGINE = "deepspeed_engine"

Lookup = Callable[[str], torch.Tensor]
"""A stored tensor by key, read whole (each key at most once per load: repeated references share it)."""

SavedLayout = Callable[[str], "tuple[tuple[int, ...], torch.dtype] | None"]
"""Global shape and dtype of a stored tensor key (None when the checkpoint lacks it)."""


@dataclass(frozen=True)
class StoredTensor:
    """Stands for a tensor reference while a saved entry is checked (nothing read yet)."""

    key: str


@dataclass(frozen=True)
class Described:
    """What one state value contributes to a save: a shared entry (the coordinator's copy is
    saved) or this rank's per-rank entry, and the chunks this rank holds."""

    entry: dict[str, Any] | None = None
    per_rank: Any = None
    chunks: list[LocalChunk] = field(default_factory=list)


@dataclass(frozen=True)
class Bound:
    """A live value bound for loading: the tensors read into it in place, and what its adapter
    needs again when checking and preparing (``context``: the owner module, the engine layout)."""

    name: str
    value: Any
    adapter: StateAdapter
    targets: dict[str, ReadTarget] = field(default_factory=dict)
    context: Any = None
    # keys of ``targets`` whose values user code takes in the load's third phase (a module's own
    # load_state_dict): read by this rank in the first pass, not after (see api/load.py)
    early: set[str] = field(default_factory=set)
    # live tensor subclasses read in place by their inner tensors: key -> (class name, encoded context)
    subclasses: dict[str, tuple[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadStep:
    """A validated change to one live value, applied only after every rank prepared its own.

    ``undo`` is set for steps that run user code (``load_state_dict``), which may raise: they are
    applied first, before any tensor is written, and undone (on every rank) if any of them fails.
    Steps without ``undo`` only assign values checked already; ``after_tensors`` ones run once the
    in-place tensors are read (a DeepSpeed engine refreshes its 16-bit copies from them).
    """

    name: str
    apply: Callable[[], None]
    undo: Callable[[], None] | None = None
    after_tensors: bool = False


@dataclass(frozen=True)
class SaveContext:
    state: dict[str, Any]
    rank: int


@dataclass(frozen=True)
class LoadContext:
    state: dict[str, Any]
    rank: int
    saved: Any  # this name's entry in the checkpoint's state tree (None when absent)
    layout: SavedLayout | None
    strict: bool = True
    atomic: bool = True  # a failed load must leave the value as it was (a module's own load code: snapshot first)


class StateAdapter(Protocol):
    """One kind of state value. Every method but ``matches`` and ``summarize`` is given the live value.

    Two optional methods, looked up by the registry where an adapter has them:
    ``fresh_optimizers(value)`` (optimizers that binding gives state, which a failed load empties
    again) and ``display_shapes(name, entry)`` (stored key -> the shape ``inspect`` shows).
    """

    kind: str
    in_place: bool  # its tensors are read into the live tensors (keys compared with the checkpoint's)

    def matches(self, value: Any) -> bool: ...

    def describe(self, name: str, value: Any, ctx: SaveContext) -> Described: ...

    def bind(self, name: str, value: Any, ctx: LoadContext) -> Bound: ...

    def check(self, bound: Bound, ctx: LoadContext, manifest: Manifest) -> list[str]: ...

    def prepare(self, bound: Bound, ctx: LoadContext, lookup: Lookup) -> LoadStep: ...

    def summarize(self, entry: dict[str, Any], manifest: Manifest) -> dict[str, Any]: ...


# ----------------------------------------------------------------------------- tensors


def is_dtensor(tensor: object) -> bool:
    """isinstance(tensor, DTensor) without importing torch.distributed.tensor (over a second of a
    CLI start): a DTensor can only exist once that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(tensor, cls)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Piece:
    """One box of a global tensor that this rank holds: ``local`` (a view of its local tensor) is
    the box of the global tensor at ``offsets`` with ``local``'s shape."""

    local: torch.Tensor
    offsets: tuple[int, ...]


def dtensor_splits(tensor: Any) -> tuple[tuple[DimSplit, ...], ...]:
    """The splits a DTensor's placements make of each tensor dim, for this rank (core/boxes.py).

    Raises ShardsafeError for a placement whose local values are not a part of the tensor
    (``Partial``: pending sums) or one this version does not know."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardsafeError("cannot save a DTensor on a mesh this rank is not part of")
    steps: list[list[DimSplit]] = [[] for _ in range(tensor.dim())]
    for mesh_dim, p in enumerate(tensor.placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, (Shard, _StridedShard)):
            factor = int(p.split_factor) if isinstance(p, _StridedShard) else 1
            dim = p.dim if p.dim >= 0 else p.dim + tensor.dim()
            steps[dim].append(DimSplit(mesh.size(mesh_dim), coordinate[mesh_dim], factor))
            continue
        if p.is_partial():
            raise ShardsafeError(
                f"cannot save a DTensor with placements {tuple(tensor.placements)}: {p} on mesh dim {mesh_dim} means "
                "the local values "
                "are partial results still to be reduced; call .redistribute(placements=...) with Replicate() or "
                "Shard(d) there first"
            )
        raise ShardsafeError(
            f"cannot save a DTensor with placement {p} (mesh dim {mesh_dim}): only Shard, _StridedShard and Replicate "
            "are stored"
        )
    return tuple(tuple(s) for s in steps)


@lru_cache(maxsize=64)
def _spans_world(mesh: Any) -> bool:
    """Whether ``mesh`` numbers every rank of the job row-major (``init_device_mesh``'s numbering):
    then a layout rule describes every rank's part without a list (core/rule.py)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    return bool(mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())))


def _root_dims(mesh: Any) -> tuple[Any, tuple[int, ...]] | None:
    """(the root mesh, the root dims ``mesh`` keeps, in order) of a mesh or a named slice of one
    (``mesh["dp"]`` of a ``(dp, tp)`` mesh: the norms under FSDP2 x TP); None for a slice the
    names do not place (a flattened dim) or that reorders dims."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    root = get_root() if callable(get_root) else mesh
    if root is None or root is mesh:
        return mesh, tuple(range(mesh.ndim))
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names is None or root_names is None or any(n not in root_names for n in names):
        return None
    dims = tuple(root_names.index(n) for n in names)
    return (root, dims) if list(dims) == sorted(set(dims)) else None


def dtensor_rule(tensor: Any) -> LayoutRule | None:
    """The layout rule of a DTensor whose mesh (or the mesh it is a slice of) spans the job, with
    ``Replicate`` on the dims its own mesh lacks; None otherwise (its chunks are then listed). The
    save checks every rank's boxes against the rule (core/layout.follows_rule) before trusting it.

    A dim the slice lacks is ``Replicate`` here even for a pipeline stage's slice, whose other
    coordinates do not hold the tensor: one rank cannot tell the two apart. When the ranks hold
    different tensors the save's coordinator makes it ``["at", k]`` from who holds the tensor
    (core/layout.stage_rules); when they hold the same, every coordinate holds it and
    ``Replicate`` is right."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    found = _root_dims(tensor.device_mesh)
    if found is None or not _spans_world(found[0]):
        return None
    root, dims = found
    placements = [Placement(None)] * root.ndim
    for mesh_dim, p in zip(dims, tensor.placements):
        if isinstance(p, (Shard, _StridedShard)):
            dim = p.dim if p.dim >= 0 else p.dim + tensor.dim()
            placements[mesh_dim] = Placement(dim, int(p.split_factor) if isinstance(p, _StridedShard) else 1)
    return LayoutRule(tuple(int(n) for n in root.shape), tuple(placements))


def pieces(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Piece]]:
    """(global shape, the boxes of it this rank holds) of a tensor or DTensor.

    A plain tensor, or a DTensor of ``Shard``/``Replicate`` placements, is one box; a
    ``_StridedShard`` (FSDP2 over tensor parallel) local tensor is several, each a view of it."""
    if not is_dtensor(tensor):
        return tuple(tensor.shape), [Piece(tensor, (0,) * tensor.dim())]
    local = tensor.to_local()  # type: ignore[attr-defined]
    global_shape = tuple(int(n) for n in tensor.shape)
    splits = dtensor_splits(tensor)
    expected = local_shape(global_shape, splits)
    if tuple(local.shape) != expected:
        raise ShardsafeError(
            f"a DTensor of shape {list(global_shape)} with placements {tuple(tensor.placements)} "  # type: ignore[attr-defined]
            f"has a local tensor of shape {list(local.shape)} on this rank; its placements imply {list(expected)}"
        )
    boxes = local_boxes(global_shape, splits)
    per_dim = [dim_runs(n, s) for n, s in zip(global_shape, splits)]
    if not boxes:  # nothing here (a rank past the end of an uneven split): one empty piece says so
        return global_shape, [
            Piece(local, tuple(runs[0].start if runs else size for size, runs in zip(global_shape, per_dim)))
        ]
    out = []
    for box in boxes:
        view = local
        for d, (start, length) in enumerate(zip(box.local_offsets, box.shape)):
            if length != view.shape[d]:
                view = view.narrow(d, start, length)
        out.append(Piece(view, box.offsets))
    return global_shape, out


def check_layout(key: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor whose values are not one strided block of memory (sparse, nested), that has
    none (meta), or a tensor subclass shardsafe does not store (see :func:`check_subclass`), naming
    the key and the remedy, before anything is written or read. Two cheap tests for plain tensors."""
    if tensor.layout is torch.strided and not tensor.is_nested and not tensor.is_meta:
        cls = type(tensor)
        if cls is not torch.Tensor and cls is not nn.Parameter:
            check_subclass(key, tensor)
        return
    where = f"tensor {key!r:.200}"
    if tensor.is_nested:
        raise FormatError(
            f"{where}: a nested tensor cannot be stored; store its parts as a list (t.unbind()) or a padded "
            "tensor (t.to_padded_tensor(0))"
        )
    if tensor.is_meta:
        raise FormatError(
            f"{where}: a meta tensor has no values to store or load; materialize it first (e.g. "
            "module.to_empty(device=...) and initialize it) or leave it out of the state"
        )
    raise FormatError(
        f"{where}: a {str(tensor.layout).removeprefix('torch.')} tensor cannot be stored; store t.to_dense(), "
        "or its indices and values as tensors of their own"
    )


def check_subclass(key: str, tensor: torch.Tensor) -> None:
    """The tensor-subclass policy (docs/FORMAT.md, "Tensor subclasses"). Stored as a plain tensor:
    a Python subclass that keeps torch's own dispatch (its values are its own memory), a DTensor
    (by its local tensor, checked the same way), and a wrapper whose ``__tensor_flatten__`` names an
    inner tensor of the outer's shape and dtype (torchao's float8 training weights): its value is
    that tensor's. Refused: a subclass with its own dispatch and no ``__tensor_flatten__``, and a
    quantized one (no inner tensor is its value: NF4Tensor, MXTensor) unless its class is
    allowlisted (state/subclasses.py: then it is stored by its inner tensors), with the remedy."""
    if is_dtensor(tensor):
        local = getattr(tensor, "_local_tensor", None)
        if isinstance(local, torch.Tensor) and type(local) is not torch.Tensor:
            check_subclass(key, local)
        return
    cls = type(tensor)
    name = f"{cls.__module__}.{cls.__qualname__}"
    where = f"tensor {key!r:.200}"
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        if getattr(cls, "__torch_dispatch__", None) is getattr(torch.Tensor, "__torch_dispatch__", None):
            return  # a Python subclass of a plain tensor
        raise FormatError(
            f"{where}: a {name} (a tensor subclass with its own dispatch and no __tensor_flatten__) cannot be "
            "stored; store a plain tensor of its values instead"
        )
    if spec_for_type(cls) is not None:
        return  # allowlisted: stored by its inner tensors (subclass_parts)
    names, _ = flatten()
    for inner_name in names:
        inner = getattr(tensor, inner_name, None)
        if isinstance(inner, torch.Tensor) and inner.shape == tensor.shape and inner.dtype == tensor.dtype:
            return  # a wrapper of a plain tensor (torchao float8 training): its value is stored
    raise FormatError(
        f"{where}: a {name} is a tensor subclass whose inner tensors {list(names)[:6]} are not its values, and "
        "its class is not allowlisted for storing by parts; if you trust its __tensor_unflatten__, call "
        "shardsafe.register_tensor_subclass(<the class>) before saving and loading, or save the weights it was made "
        "from or a dequantized copy (e.g. t.dequantize() / t.get_original_weight()) and convert again after loading"
    )


def subclass_of(tensor: torch.Tensor) -> SubclassSpec | None:
    """The allowlist entry of a tensor (or a DTensor's local tensor) stored by its inner tensors;
    None for everything else (two type tests for plain tensors)."""
    cls: type = type(tensor)
    if cls is torch.Tensor or cls is nn.Parameter:
        return None
    if is_dtensor(tensor):
        cls = type(getattr(tensor, "_local_tensor", None))
        if cls is torch.Tensor or cls is nn.Parameter:
            return None
    if getattr(cls, "__tensor_flatten__", None) is None:
        return None
    return spec_for_type(cls)


def subclass_parts(
    key: str, tensor: torch.Tensor, spec: SubclassSpec
) -> tuple[dict[str, torch.Tensor], Any, tuple[int, ...], tuple[int, ...]]:
    """(inner tensors by name, encoded context, outer shape, outer stride) of an allowlisted subclass
    tensor, at its global shape: for a DTensor, each inner tensor is a DTensor on the same mesh, split
    along its dim 0 where the outer is ``Shard(0)`` and the class lists it as sharded, else
    replicated, and the context is the whole tensor's (``with_shape``)."""
    where = f"tensor {key!r:.200}: its {spec.name}"
    shape, stride = tuple(int(n) for n in tensor.shape), tuple(int(n) for n in tensor.stride())
    local: Any = tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    names, context = local.__tensor_flatten__()
    inner = {str(n): getattr(local, n) for n in names}
    for n, t in inner.items():
        if type(t) is not torch.Tensor:
            raise FormatError(f"{where}: inner tensor {n!r} is a {class_name(type(t))}, not a plain tensor")
    if is_dtensor(tensor):
        if not spec.sharded and tuple(local.shape) != shape:
            raise FormatError(
                f"{where} is split over ranks as a DTensor, and its registration names no inner tensors that split "
                "with it (register_tensor_subclass(..., sharded_inner=...)); gather it (full_tensor()) to save it"
            )
        if spec.with_shape is not None:
            context = spec.with_shape(context, shape, stride)
        inner = {n: _inner_dtensor(where, tensor, t, n in spec.sharded) for n, t in inner.items()}
    return inner, encode_context(context, spec, where), shape, stride


def _inner_dtensor(where: str, outer: Any, inner: torch.Tensor, sharded: bool) -> torch.Tensor:
    """``inner`` (a rank's inner tensor of a subclass DTensor) as a DTensor of the whole inner tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    placements: list[Any] = []
    size = list(inner.shape)
    for mesh_dim, p in enumerate(outer.placements):
        if isinstance(p, Replicate):
            placements.append(Replicate())
        elif type(p) is Shard and p.dim in (0, -outer.dim()):
            parts = outer.device_mesh.size(mesh_dim)
            if outer.shape[0] % parts:
                raise FormatError(
                    f"{where} is split unevenly ({outer.shape[0]} rows over {parts} ranks): its inner tensors are "
                    "stored only for even splits"
                )
            if sharded and size:
                placements.append(Shard(0))
                size[0] *= parts
            else:
                placements.append(Replicate())
        else:
            raise FormatError(
                f"{where} is a DTensor with placements {tuple(outer.placements)}: a tensor subclass is stored by its "
                "parts only under Shard(0) and Replicate"
            )
    contiguous = torch.empty(size, device="meta").stride()
    return DTensor.from_local(
        inner, outer.device_mesh, placements, run_check=False, shape=torch.Size(size), stride=contiguous
    )


def check_storable(key: str, tensor: torch.Tensor, global_shape: tuple[int, ...]) -> None:
    """Refuse, before anything is written, a tensor the manifest parser would refuse on load."""
    where = f"tensor {key!r:.200}"
    check_tensor_key(key, where)
    try:
        dtype_name(tensor.dtype)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if not global_shape and is_packed(tensor.dtype):
        safetensors_shape(tensor.dtype, global_shape)  # raises: a 0-d packed tensor has no safetensors shape
    if len(global_shape) > MAX_DIMS or numel(global_shape) > MAX_NUMEL:
        raise FormatError(
            f"{where}: shape {list(global_shape)} has more than {MAX_DIMS} dimensions or {MAX_NUMEL} elements"
        )


def unique_paths(name: str) -> Callable[[str], None]:
    """Refuse a second tensor under the same key: a dict key containing '/' can spell another entry's
    path (``{"a/0": t1, "a": [t2]}``), and one of the two tensors would silently take the other's place."""
    seen: set[str] = set()

    def check(path: str) -> None:
        if path in seen:
            raise ShardsafeError(
                f"state[{name!r}]: two tensors map to the checkpoint key {path!r} (a dict key containing '/'?); rename "
                "one"
            )
        seen.add(path)

    return check


def tensor_identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a tensor's description (its chunks, their checks) depends on, read without describing it:
    the memory its local values occupy (address, shape, strides, dtype, device, type) and, for a
    DTensor, its global shape, placements and mesh. Equal identities mean equal chunks, pointing at
    the same memory: a cached chunk keeps its storage alive, so no other storage can start there."""
    if is_dtensor(tensor):
        local = getattr(tensor, "_local_tensor", None)
        if not isinstance(local, torch.Tensor):
            local = tensor.to_local()  # type: ignore[attr-defined]
        mesh = tensor.device_mesh  # type: ignore[attr-defined]
        extra: tuple[Any, ...] = (tuple(tensor.shape), tuple(tensor.placements), id(mesh))  # type: ignore[attr-defined]
    else:
        local, extra = tensor, ()
    return (
        type(tensor),
        type(local),
        local.data_ptr(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
        local.device,
        *extra,
    )


class TensorCache:
    """The chunks of every tensor a save described, by checkpoint key, kept for the next save of the
    same state (the manager's): a tensor whose :func:`tensor_identity` is unchanged gets its previous
    chunks (and its previous checks: key, dtype, shape, placements), without being described again.
    ``reused`` / ``described``: tensors taken from the cache / described afresh by the last save."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[tuple[Any, ...], Any, tuple[LocalChunk, ...]]] = {}
        self._seen: dict[str, tuple[tuple[Any, ...], Any, tuple[LocalChunk, ...]]] = {}
        self.reused = 0
        self.described = 0

    def clear(self) -> None:
        self._held = {}

    @contextmanager
    def active(self) -> Iterator[None]:
        """Describe with this cache (:func:`encode_with_chunks` consults it); what was not seen is dropped."""
        self._seen, self.reused, self.described = {}, 0, 0
        token = _ACTIVE_CACHE.set(self)
        try:
            yield
        finally:
            _ACTIVE_CACHE.reset(token)
        self._held, self._seen = self._seen, {}

    def lookup(self, path: str, tensor: torch.Tensor) -> tuple[tuple[Any, ...], tuple[LocalChunk, ...] | None]:
        ident = tensor_identity(tensor)
        held = self._held.get(path)
        if held is not None and held[0] == ident:  # the mesh's id: the same mesh, which the entry keeps alive
            self._seen[path] = held
            self.reused += 1
            return ident, held[2]
        return ident, None

    def keep(self, path: str, ident: tuple[Any, ...], tensor: torch.Tensor, chunks: tuple[LocalChunk, ...]) -> None:
        mesh = tensor.device_mesh if is_dtensor(tensor) else None  # type: ignore[attr-defined]
        self._seen[path] = (ident, mesh, chunks)
        self.described += 1


_ACTIVE_CACHE: ContextVar[TensorCache | None] = ContextVar("shardsafe_tensor_cache", default=None)


def encode_with_chunks(value: Any, name: str, chunks: list[LocalChunk]) -> Any:
    """Encode ``value``, adding this rank's chunk of every tensor in it to ``chunks`` (through the
    active :class:`TensorCache`, when a save describes with one)."""
    unique = unique_paths(name)
    cache = _ACTIVE_CACHE.get()

    def ref(path: str, tensor: torch.Tensor) -> str | dict[str, Any]:
        spec = subclass_of(tensor)
        if spec is not None:  # stored by its inner tensors, each an ordinary stored tensor
            unique(path)
            inner, context, shape, stride = subclass_parts(path, tensor, spec)
            keys = {n: ref(f"{path}/{n}", t) for n, t in inner.items()}
            return subclass_entry(spec.name, shape, stride, keys, context)  # type: ignore[arg-type]
        unique(path)
        if cache is not None:
            ident, cached = cache.lookup(path, tensor)
            if cached is not None:
                chunks.extend(cached)
                return path
        check_layout(path, tensor)
        global_shape, held = pieces(tensor)
        check_storable(path, tensor, global_shape)
        rule = dtensor_rule(tensor) if is_dtensor(tensor) else None
        # Empty shards too (FSDP2 ranks past the end of dim 0): they are never written, but say which
        # part of the split rule this rank holds, so every rank describes the same tensors (core/layout).
        made = tuple(LocalChunk(path, piece.local, global_shape, piece.offsets, rule=rule) for piece in held)
        chunks.extend(made)
        if cache is not None:
            cache.keep(path, ident, tensor, made)
        return path

    return encode_value(value, name, ref)


def bind_tensors(
    targets: dict[str, ReadTarget],
    value: Any,
    name: str,
    fresh: bool = False,
    subclasses: dict[str, tuple[str, Any]] | None = None,
) -> None:
    """Every tensor in ``value`` as an in-place read target, keyed as :func:`encode_with_chunks` names it
    (``fresh``: tensors this load created, see :class:`ReadTarget`). An allowlisted subclass tensor is
    read in place by its inner tensors; its class and context go to ``subclasses`` (to be compared
    with the checkpoint's record)."""
    unique = unique_paths(name)

    def ref(path: str, tensor: torch.Tensor) -> str:
        unique(path)
        spec = subclass_of(tensor)
        if spec is None:
            targets[path] = read_target(path, tensor, fresh)
            return path
        inner, context, _, _ = subclass_parts(path, tensor, spec)
        for n, t in inner.items():
            targets[f"{path}/{n}"] = read_target(f"{path}/{n}", t, fresh)
        if subclasses is not None:
            subclasses[path] = (spec.name, context)
        return path

    encode_value(value, name, ref)


def read_target(key: str, tensor: torch.Tensor, fresh: bool = False) -> ReadTarget:
    """The read target of every box of ``tensor`` (a tensor or DTensor) this rank holds."""
    check_layout(key, tensor)
    global_shape, held = pieces(tensor)
    first = held[0]
    rest = tuple((p.local, p.offsets) for p in held[1:])
    return ReadTarget(key, first.local, global_shape, first.offsets, fresh, rest)


# ----------------------------------------------------------------------------- modules


def unwrap_module(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    if isinstance(module, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


def param_names(module: nn.Module) -> dict[int, str]:
    """Parameter id -> FQN; a tied parameter gets its first name, as torch's get_optimizer_state_dict keys it."""
    names: dict[int, str] = {}
    for name, p in unwrap_module(module).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


# ----------------------------------------------------------------------------- checking saved values


def kind_of(value: Any) -> str:
    """A coarse type for comparing a saved value with a live one: numbers are one kind (1 and 1.0)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (torch.Tensor, StoredTensor, SubclassRecord)):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "sequence"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def type_problems(current: Any, saved: Any, where: str, same_length: bool = False) -> list[str]:
    """Where ``saved`` has a different kind of value than ``current`` (None matches anything).

    Dicts are compared on their shared keys; sequences element by element when their lengths
    agree, and with ``same_length`` (hyper-parameters such as ``betas``) a length change is a problem.
    """
    if current is None or saved is None:
        return []
    a, b = kind_of(current), kind_of(saved)
    if a != b:
        return [f"{where} is a {b} in the checkpoint, a {a} here"]
    if isinstance(current, dict):
        return [
            p
            for k in current.keys() & saved.keys()
            for p in type_problems(current[k], saved[k], f"{where}[{k!r}]", same_length)
        ]
    if isinstance(current, (list, tuple)):
        if len(current) != len(saved):
            return [f"{where} has {len(saved)} elements in the checkpoint, {len(current)} here"] if same_length else []
        return [
            p for i, (c, s) in enumerate(zip(current, saved)) for p in type_problems(c, s, f"{where}[{i}]", same_length)
        ]
    return []


def snapshot(obj: Any, name: str) -> Callable[[], None] | None:
    """An undo for ``obj.load_state_dict``: a deep copy of its current ``state_dict()``, put back on undo.

    The cost is one copy of the object's state (a scheduler or RNG state: a few KB). An object
    whose state cannot be deep-copied loads without an undo (logged): a failure elsewhere then
    leaves it loaded.
    """
    try:
        saved = copy.deepcopy(obj.state_dict())
    except Exception as exc:
        log.warning(
            "shardsafe: state[%r]: cannot snapshot its state_dict() (%s); a failed load cannot restore it", name, exc
        )
        return None

    def undo() -> None:
        obj.load_state_dict(saved)

    return undo


def tensor_summary(keys: list[str], manifest: Manifest) -> dict[str, Any]:
    unique = sorted(set(keys))
    return {"tensors": len(unique), "bytes": sum(manifest.tensors[k].nbytes for k in unique if k in manifest.tensors)}
