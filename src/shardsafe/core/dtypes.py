"""The dtypes a checkpoint can hold: torch dtype <-> manifest name <-> safetensors name."""

from __future__ import annotations

import torch

from shardsafe.errors import FormatError

__all__ = [
    "dtype_from_name",
    "dtype_from_safetensors_name",
    "dtype_from_torch_text",
    "dtype_name",
    "dtype_or_none",
    "element_size",
    "is_cast_on_export",
    "output_dtype",
    "is_packed",
    "safetensors_dtype",
    "safetensors_shape",
    "torch_shape",
]

# torch dtype <-> (manifest name, safetensors name)
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float64: ("float64", "F64"),
    torch.float32: ("float32", "F32"),
    torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.int64: ("int64", "I64"),
    torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"),
    torch.int8: ("int8", "I8"),
    torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"),
    torch.float8_e4m3fn: ("float8_e4m3fn", "F8_E4M3"),
    torch.float8_e5m2: ("float8_e5m2", "F8_E5M2"),
    torch.uint16: ("uint16", "U16"),
    torch.uint32: ("uint32", "U32"),
    torch.uint64: ("uint64", "U64"),
    torch.complex64: ("complex64", "C64"),
}
# Newer dtypes, where this torch has them: the MX scale type, packed FP4 (two values a byte: NVFP4/MXFP4
# weights), and the "fnuz" float8 variants; each one safetensors names.
for _attr, _names in (
    ("float8_e8m0fnu", ("float8_e8m0fnu", "F8_E8M0")),
    ("float4_e2m1fn_x2", ("float4_e2m1fn_x2", "F4")),
    ("float8_e4m3fnuz", ("float8_e4m3fnuz", "F8_E4M3FNUZ")),
    ("float8_e5m2fnuz", ("float8_e5m2fnuz", "F8_E5M2FNUZ")),
):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _DTYPES[getattr(torch, _attr)] = _names
# dtypes whose torch element holds several values: safetensors counts values ("F4": a byte is 2 of the
# last dim), torch and the manifest count bytes (float4_e2m1fn_x2)
_PACKED: dict[torch.dtype, int] = {torch.float4_e2m1fn_x2: 2} if hasattr(torch, "float4_e2m1fn_x2") else {}
_BY_NAME = {name: dtype for dtype, (name, _) in _DTYPES.items()}
_BY_ST_NAME = {st: dtype for dtype, (_, st) in _DTYPES.items()}
_BY_TORCH_TEXT = {str(dtype): dtype for dtype in _DTYPES}  # "torch.float32": how a save's records name a dtype


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise FormatError(
            f"dtype {dtype} cannot be stored by shardsafe (it stores {', '.join(sorted(_BY_NAME))}); convert the "
            "tensor to one of them (a quantized tensor: t.dequantize() or t.int_repr() with its scales)"
        ) from None


def dtype_from_name(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _BY_NAME:
        # The value is file content: say what it is, not what it says (it could be anything, a secret included).
        what = f"a {len(name)}-character string" if isinstance(name, str) else f"a {type(name).__name__}"
        raise FormatError(f"{where}: unknown dtype ({what}; expected one of {', '.join(sorted(_BY_NAME))})")
    return _BY_NAME[name]


def dtype_or_none(name: object) -> torch.dtype | None:
    """The dtype safetensors name ``name`` stands for, None if it is none (the caller then says why
    with :func:`dtype_from_safetensors_name`): a header parse's per-entry fast path."""
    return _BY_ST_NAME.get(name) if type(name) is str else None


def dtype_from_torch_text(text: str) -> torch.dtype:
    """The dtype ``str(dtype)`` names (``"torch.float32"``): what this process's save records carry
    (:class:`~shardsafe.core.plan.ChunkSpec`), never file content, so an unknown one is a bug."""
    return _BY_TORCH_TEXT[text]


def safetensors_dtype(dtype: torch.dtype) -> str:
    return _DTYPES[dtype][1]


_SIZES = {dtype: dtype.itemsize for dtype in _DTYPES}


def element_size(dtype: torch.dtype) -> int:
    size = _SIZES.get(dtype)
    return size if size is not None else torch.empty((), dtype=dtype).element_size()


def dtype_from_safetensors_name(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _BY_ST_NAME:
        what = f"a {len(name)}-character string" if isinstance(name, str) else f"a {type(name).__name__}"
        raise FormatError(
            f"{where}: unknown dtype (safetensors name, {what}; expected one of {', '.join(sorted(_BY_ST_NAME))})"
        )
    return _BY_ST_NAME[name]


# block-scaled formats' parts: packed FP4 values and E8M0 scales mean nothing without each other, so a
# floating-point cast of a model's weights (export's dtype=) leaves them as stored
_NOT_CAST = frozenset(getattr(torch, a) for a in ("float4_e2m1fn_x2", "float8_e8m0fnu") if hasattr(torch, a))


def is_cast_on_export(dtype: torch.dtype) -> bool:
    """Whether an export's floating-point cast (``dtype=``) applies to tensors stored as ``dtype``:
    floating-point ones, except packed FP4 and the E8M0 scale type (kept as stored)."""
    return dtype.is_floating_point and dtype not in _NOT_CAST


def output_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an export (``dtype=``) writes a tensor stored as ``stored`` in: floating-point
    tensors are cast to ``dtype``; integer and bool tensors keep theirs, and so do packed FP4 values
    and E8M0 scales (block-scaled parts: a cast of either alone would be meaningless, and torch
    cannot cast packed FP4 at all). The one rule for every writer of model weights."""
    return dtype if dtype is not None and is_cast_on_export(stored) else stored


def is_packed(dtype: torch.dtype) -> bool:
    """Whether one torch element of ``dtype`` holds several values (float4_e2m1fn_x2: two)."""
    return dtype in _PACKED


def safetensors_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header gives a tensor of torch ``shape``: for packed FP4 the last dim
    counts values, twice torch's count of bytes (as safetensors' own writer does)."""
    per = _PACKED.get(dtype)
    if per is None:
        return list(shape)
    if not shape:
        raise FormatError(f"a 0-dimensional {dtype} tensor has no safetensors shape; reshape it to (1,)")
    return [*shape[:-1], shape[-1] * per]


def torch_shape(dtype: torch.dtype, shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """Inverse of :func:`safetensors_shape`. Packed FP4 values are stored two a byte: a last dim of an
    odd number of values (a byte split between two tensors or two shards) is refused."""
    per = _PACKED.get(dtype)
    if per is None:
        return tuple(shape)
    if not shape or shape[-1] % per:
        raise FormatError(
            f"{where}: {safetensors_dtype(dtype)} (packed FP4) with shape {list(shape)}: the last dimension must "
            f"be a multiple of {per} values (two per byte); a shard or tensor boundary inside a byte cannot be stored"
        )
    return (*shape[:-1], shape[-1] // per)
