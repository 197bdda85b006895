"""Quantized tensor subclasses stored by their parts: the allowlist, and their contexts as JSON.

A tensor subclass with ``__tensor_flatten__`` whose inner tensors are not its values (torchao's
``NF4Tensor`` for QLoRA base weights, ``MXTensor``) is stored as its inner tensors, each an ordinary
stored tensor named ``<key>/<inner name>``, plus a ``__subclass__`` record in ``state.json``
(core/values.py): class name, outer shape and stride, and the flatten context as JSON. A load
rebuilds it with ``__tensor_unflatten__`` only for a class in this allowlist: the file names a class,
it never picks code to run, so a name is looked up here and never imported. torchao's classes are
listed by qualified name and their module imported (a fixed name in this file) the first time a
save or load meets that name; users add their own with :func:`register_tensor_subclass`.

A context may hold JSON values, tuples, ``torch.Size``, dtypes and devices, plus the enums,
dataclasses and named tuples a registration lists (``context_types``), stored by qualified name and
looked up in that list. Anything else is refused at save naming the tensor key and the context key.
A device in a context is read back as the device the inner tensors were loaded onto (a checkpoint
saved on a GPU rebuilds on the CPU it is loaded on).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardsafe.core.dtypes import dtype_from_name, dtype_name
from shardsafe.core.jsonsafe import check_json_string
from shardsafe.core.values import DTYPE_TAG, TUPLE_TAG, SubclassRecord
from shardsafe.errors import FormatError

__all__ = [
    "SubclassSpec",
    "class_name",
    "decode_context",
    "encode_context",
    "rebuild",
    "rebuild_records",
    "register_tensor_subclass",
    "same_class",
    "same_context",
    "spec_for_name",
    "spec_for_type",
    "subclass_problems",
    "subclass_side_keys",
    "unknown_class",
    "unregister_tensor_subclass",
]

SIZE_TAG = "__size__"
DEVICE_TAG = "__device__"
ENUM_TAG = "__enum__"
OBJECT_TAG = "__object__"
_CONTEXT_TAGS = (TUPLE_TAG, DTYPE_TAG, SIZE_TAG, DEVICE_TAG, ENUM_TAG, OBJECT_TAG)
_MAX_DEPTH = 32

WithShape = Callable[[Any, tuple[int, ...], tuple[int, ...]], Any]


def class_name(cls: type) -> str:
    """The qualified name a checkpoint records for ``cls`` (and looks up in the allowlist)."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class SubclassSpec:
    """One allowlisted class. ``sharded``: the inner tensors that an FSDP2 ``Shard(0)`` of the outer
    tensor splits along their own dim 0, in equal parts (the others are replicated: every rank holds
    all of them). ``with_shape(context, shape, stride)``: the context of the same tensor at another
    outer shape (a rank's part -> the whole tensor), for classes whose context records the shape."""

    cls: type
    sharded: tuple[str, ...] = ()
    context_types: dict[str, type] = field(default_factory=dict)
    with_shape: WithShape | None = None

    @property
    def name(self) -> str:
        return class_name(self.cls)


_REGISTERED: dict[str, SubclassSpec] = {}
_REMOVED: set[str] = set()  # names unregistered by the user: torchao's are then not registered lazily


def register_tensor_subclass(
    cls: type,
    *,
    sharded_inner: Iterable[str] = (),
    context_types: Iterable[type] = (),
    with_shape: WithShape | None = None,
    aliases: Iterable[str] = (),
) -> type:
    """Allow shardsafe to store tensors of ``cls`` by their inner tensors and rebuild them on load.

    Register only classes whose ``__tensor_unflatten__`` you trust with a checkpoint's values: a
    load calls it with the stored inner tensors and context. ``context_types``: the enums,
    dataclasses and named tuples its ``__tensor_flatten__`` context may hold (stored by name, looked
    up here). ``sharded_inner`` and ``with_shape``: only for classes that FSDP2 shards
    (see :class:`SubclassSpec`). ``aliases``: other qualified names under which checkpoints
    recorded this class (it moved to another module). Returns ``cls`` (usable as a class decorator).
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise TypeError(f"register_tensor_subclass: {cls!r} is not a torch.Tensor subclass")
    if not callable(getattr(cls, "__tensor_flatten__", None)) or not callable(
        getattr(cls, "__tensor_unflatten__", None)
    ):
        raise TypeError(
            f"register_tensor_subclass: {class_name(cls)} has no __tensor_flatten__/__tensor_unflatten__; a subclass "
            "without them is stored only as a plain tensor of its values"
        )
    types: dict[str, type] = {}
    for t in context_types:
        if not isinstance(t, type) or not (issubclass(t, enum.Enum) or dataclasses.is_dataclass(t) or _is_named(t)):
            raise TypeError(
                f"register_tensor_subclass: context type {t!r} is not an Enum, a dataclass or a named tuple"
            )
        types[class_name(t)] = t
    spec = SubclassSpec(cls, tuple(sharded_inner), types, with_shape)
    for name in (class_name(cls), *aliases):
        _REGISTERED[name] = spec
        _REMOVED.discard(name)
    return cls


def unregister_tensor_subclass(cls: type) -> None:
    """Take ``cls`` off the allowlist, under every name (torchao's classes too, until registered again)."""
    names = {class_name(cls), *(n for n, spec in _REGISTERED.items() if spec.cls is cls)}
    loader = _BUILTIN.get(class_name(cls))
    names |= {n for n, load in _BUILTIN.items() if loader is not None and load is loader}
    for name in names:
        _REGISTERED.pop(name, None)
        _REMOVED.add(name)


def same_class(a: str, b: str) -> bool:
    """Whether two recorded class names are one allowlisted class (one may be an alias)."""
    if a == b:
        return True
    spec_a, spec_b = spec_for_name(a), spec_for_name(b)
    return spec_a is not None and spec_b is not None and spec_a.cls is spec_b.cls


# --------------------------------------------------------------------------- torchao, registered lazily


def _nf4() -> None:
    module = importlib.import_module("torchao.quantization")
    cls = module.NF4Tensor
    nf4 = importlib.import_module(cls.__module__)

    def with_shape(context: Any, shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
        meta = dataclasses.replace(context["tensor_meta"], original_shape=torch.Size(shape), original_strides=stride)
        return {**context, "tensor_meta": meta}

    register_tensor_subclass(
        cls,
        sharded_inner=getattr(nf4, "_INNER_TENSOR_NAMES_FOR_SHARDING", ()),
        context_types=[nf4.SubclassTensorArgs],
        with_shape=with_shape,
        aliases=[name for name, load in _BUILTIN.items() if load is _nf4],  # where older torchao had it
    )


def _mx() -> None:
    mx = importlib.import_module("torchao.prototype.mx_formats.mx_tensor")
    types: list[type] = [importlib.import_module("torchao.quantization.quantize_.common").KernelPreference]
    kwargs = getattr(mx, "QuantizeTensorToMXKwargs", None)
    if isinstance(kwargs, type):
        types.append(kwargs)
    register_tensor_subclass(mx.MXTensor, context_types=types)


# qualified name -> what registers it (a fixed module of torchao's, imported only when the name is met)
_BUILTIN: dict[str, Callable[[], None]] = {
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor": _nf4,
    "torchao.dtypes.nf4tensor.NF4Tensor": _nf4,
    "torchao.prototype.mx_formats.mx_tensor.MXTensor": _mx,
}


def spec_for_name(name: str) -> SubclassSpec | None:
    """The allowlisted class a checkpoint's record names (torchao's registered on first use)."""
    spec = _REGISTERED.get(name)
    if spec is None and name in _BUILTIN and name not in _REMOVED:
        removed = set(_REMOVED)
        try:
            _BUILTIN[name]()
        except (ImportError, AttributeError):
            return None
        for other in removed:  # what the user took off stays off (the loader registers every alias)
            _REGISTERED.pop(other, None)
        _REMOVED.update(removed)
        spec = _REGISTERED.get(name)
    return spec


def spec_for_type(cls: type) -> SubclassSpec | None:
    """The registration of exactly ``cls`` (a class of the same name that is not it does not count)."""
    spec = spec_for_name(class_name(cls))
    return spec if spec is not None and spec.cls is cls else None


# --------------------------------------------------------------------------- contexts <-> JSON


def _is_named(t: type) -> bool:
    return issubclass(t, tuple) and hasattr(t, "_fields")


def encode_context(value: Any, spec: SubclassSpec, where: str, path: str = "context", depth: int = 0) -> Any:
    """``value`` (a flatten context) as JSON; refuses what JSON cannot hold, naming ``where`` and ``path``."""
    if depth > _MAX_DEPTH:
        raise FormatError(f"{where}: {path} is nested deeper than {_MAX_DEPTH} levels")
    if type(value) in (bool, int, float) or value is None:  # exactly: an IntEnum is not an int here
        return value
    if type(value) is str:
        check_json_string(value, f"{where}: {path}")
        return value
    if isinstance(value, torch.dtype):
        try:
            return {DTYPE_TAG: dtype_name(value)}
        except FormatError as exc:
            raise FormatError(f"{where}: {path}: {exc}") from None
    if isinstance(value, torch.device):
        return {DEVICE_TAG: str(value)}
    if isinstance(value, torch.Size):
        return {SIZE_TAG: list(value)}
    named = spec.context_types.get(class_name(type(value)))
    if named is type(value) and isinstance(value, enum.Enum):
        return {ENUM_TAG: [class_name(named), value.name]}
    if named is type(value):
        obj: Any = value
        fields = obj._asdict() if _is_named(named) else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return {
            OBJECT_TAG: [
                class_name(named),
                {k: encode_context(v, spec, where, f"{path}.{k}", depth + 1) for k, v in fields.items()},
            ]
        }
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {TUPLE_TAG: [encode_context(v, spec, where, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_context(v, spec, where, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) and k not in _CONTEXT_TAGS for k in value):
        return {k: encode_context(v, spec, where, f"{path}[{k!r}]", depth + 1) for k, v in value.items()}
    if isinstance(value, dict):
        raise FormatError(
            f"{where}: {path} is a dict with a key that is not a string (or is a tag); JSON cannot hold it"
        )
    raise FormatError(
        f"{where}: {path} is a {class_name(type(value))}, which JSON cannot hold; if it is an Enum, a dataclass or a "
        f"named tuple, list its class in register_tensor_subclass({spec.cls.__qualname__}, context_types=[...])"
    )


def decode_context(value: Any, spec: SubclassSpec, device: torch.device, where: str) -> Any:
    """Inverse of :func:`encode_context`; types only from ``spec``'s list, devices as ``device``."""
    if isinstance(value, list):
        return [decode_context(v, spec, device, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag in _CONTEXT_TAGS:
            return _decode_tagged(tag, inner, spec, device, where)
    return {k: decode_context(v, spec, device, where) for k, v in value.items()}


def _decode_tagged(tag: str, inner: Any, spec: SubclassSpec, device: torch.device, where: str) -> Any:
    if tag == DTYPE_TAG:
        return dtype_from_name(inner, where)
    if tag == DEVICE_TAG:
        return device
    if tag in (TUPLE_TAG, SIZE_TAG) and isinstance(inner, list):
        items = [decode_context(v, spec, device, where) for v in inner]
        if tag == TUPLE_TAG:
            return tuple(items)
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in items):
            return torch.Size(items)
    if tag in (ENUM_TAG, OBJECT_TAG) and isinstance(inner, list) and len(inner) == 2 and isinstance(inner[0], str):
        t = spec.context_types.get(inner[0])
        if t is None:
            raise FormatError(
                f"{where}: the context holds a {inner[0]!r:.200}, which the registration of {spec.name} does not list "
                "(context_types=); register it if you trust it"
            )
        if tag == ENUM_TAG and issubclass(t, enum.Enum) and isinstance(inner[1], str) and inner[1] in t.__members__:
            return t.__members__[inner[1]]
        if tag == OBJECT_TAG and not issubclass(t, enum.Enum) and isinstance(inner[1], dict):
            fields = {k: decode_context(v, spec, device, where) for k, v in inner[1].items()}
            try:
                return t(**fields)
            except TypeError as exc:
                raise FormatError(
                    f"{where}: the context's {inner[0]!r:.200} does not take its stored fields ({exc})"
                ) from None
    raise FormatError(f"{where}: malformed {tag} in a tensor subclass context: {inner!r:.80}")


def same_context(a: Any, b: Any) -> bool:
    """Whether two encoded contexts are equal, devices aside (a GPU save loads on the CPU)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if DEVICE_TAG in a and DEVICE_TAG in b:
            return True
        return a.keys() == b.keys() and all(same_context(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_context(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


# --------------------------------------------------------------------------- rebuilding


def unknown_class(key: str, name: str) -> FormatError:
    return FormatError(
        f"tensor {key!r:.200}: the checkpoint stores it as a {name!r:.200}, a tensor subclass shardsafe does not "
        "rebuild unless allowed; if you trust that class, call shardsafe.register_tensor_subclass(<the class>) before "
        "loading (a name read from a checkpoint is never imported)"
    )


def rebuild(record: SubclassRecord) -> torch.Tensor:
    """The tensor a record describes, its inner tensors loaded (``__tensor_unflatten__`` of an allowlisted class)."""
    where = f"tensor {record.path!r:.200}"
    spec = spec_for_name(record.cls)
    if spec is None:
        raise unknown_class(record.path, record.cls)
    inner = record.inner
    if not all(isinstance(t, torch.Tensor) for t in inner.values()):
        raise FormatError(f"{where}: the inner tensors of its {record.cls} record are not all stored tensors")
    first = next(iter(inner.values()))
    context = decode_context(record.context, spec, first.device, where)
    cls: Any = spec.cls
    try:
        out = cls.__tensor_unflatten__(dict(inner), context, torch.Size(record.shape), record.stride)
    except Exception as exc:
        raise FormatError(
            f"{where}: {record.cls} could not be rebuilt from its stored parts ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(out, torch.Tensor) or not isinstance(out, spec.cls) or tuple(out.shape) != record.shape:
        raise FormatError(f"{where}: {record.cls} rebuilt from its parts is not a tensor of shape {list(record.shape)}")
    return out


def rebuild_records(value: Any) -> Any:
    """``value`` (a decoded state) with every :class:`SubclassRecord` in it rebuilt."""
    if isinstance(value, SubclassRecord):
        return rebuild(value)
    if isinstance(value, list):
        return [rebuild_records(v) for v in value]
    if isinstance(value, tuple):
        return tuple(rebuild_records(v) for v in value)
    if isinstance(value, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = rebuild_records(v)
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    return value


def subclass_problems(
    saved: dict[str, SubclassRecord],
    live: dict[str, tuple[str, Any]],
    targets: Collection[str],
    saved_keys: Collection[str],
) -> list[str]:
    """Where an in-place load's live subclass tensors (``live``: key -> class name and encoded
    context at the whole tensor's shape) and the checkpoint's records disagree: another class,
    another context (block sizes), a plain tensor on one side. Raises FormatError for a record of a
    class not allowlisted that the load would take."""
    problems: list[str] = []
    for key, (name, context) in live.items():
        record = saved.get(key)
        if record is None:
            if key in saved_keys:
                problems.append(
                    f"{key}: a plain tensor in the checkpoint, a {name} here; load it into a model without the "
                    "subclass and convert (quantize) after loading"
                )
        elif not same_class(record.cls, name):
            problems.append(f"{key}: a {record.cls} in the checkpoint, a {name} here")
        elif not same_context(record.context, context):
            problems.append(
                f"{key}: the checkpoint's {name} was made with {_shown(record.context)}, the model's with "
                f"{_shown(context)}; build (quantize) the model with the same settings as the saved one"
            )
    for key, record in saved.items():
        if key in live or key not in targets:
            continue
        if spec_for_name(record.cls) is None:
            raise unknown_class(key, record.cls)
        problems.append(
            f"{key}: the checkpoint holds a {record.cls} (a tensor subclass stored by its parts), the model a plain "
            "tensor; build the model with the same subclass (quantize it as it was when saved) before loading"
        )
    return problems


def subclass_side_keys(
    saved: dict[str, SubclassRecord],
    live: dict[str, tuple[str, Any]],
    targets: Collection[str],
    saved_keys: Collection[str],
) -> set[str]:
    """The keys a plain-vs-subclass problem of :func:`subclass_problems` already explains (the plain
    tensor's key and the other side's inner keys), left out of the missing / unexpected lists."""
    out: set[str] = set()
    for key, record in saved.items():
        if key not in live and key in targets:
            out |= {key, *(f"{key}/{n}" for n in record.inner)}
    for key in live:
        if key in saved_keys:
            out |= {key, *(t for t in targets if t.startswith(key + "/"))}
    return out


def _shown(context: Any) -> str:
    text = json.dumps(context, separators=(",", ":"))
    return text if len(text) <= 200 else text[:197] + "..."
