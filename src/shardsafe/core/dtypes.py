"""The dtypes a checkpoint can hold: torch dtype <-> manifest name <-> safetensors name."""

from __future__ import annotations

import torch

from shardsafe.errors import FormatError

__all__ = [
    "dtype_from_name",
    "dtype_from_safetensors_name",
    "dtype_from_torch_text",
    "dtype_name",
    "element_size",
    "safetensors_dtype",
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
_BY_NAME = {name: dtype for dtype, (name, _) in _DTYPES.items()}
_BY_ST_NAME = {st: dtype for dtype, (_, st) in _DTYPES.items()}
_BY_TORCH_TEXT = {str(dtype): dtype for dtype in _DTYPES}  # "torch.float32": how a save's records name a dtype


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be stored by shardsafe") from None


def dtype_from_name(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _BY_NAME:
        # The value is file content: say what it is, not what it says (it could be anything, a secret included).
        what = f"a {len(name)}-character string" if isinstance(name, str) else f"a {type(name).__name__}"
        raise FormatError(f"{where}: unknown dtype ({what}; expected one of {', '.join(sorted(_BY_NAME))})")
    return _BY_NAME[name]


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
