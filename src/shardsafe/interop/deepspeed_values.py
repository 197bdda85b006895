"""Is a value from a DeepSpeed checkpoint file what DeepSpeed writes there? Small checks the reader makes before using
one.

The restricted loader guarantees plain values (dicts, lists, tuples, strings, numbers, stand-ins,
tensors lying inside the file); these say whether a given entry has the type and range the reader
needs, so that a hostile or damaged file ends in a :class:`FormatError` naming it, never in a
TypeError deep inside, and so that no shape from a file is used for an allocation unchecked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.interop.pickle_scan import MAX_DIMS

__all__ = ["flat_tensor", "get_entry", "hyper_parameter", "is_scalar", "reading", "shapes_of", "short", "small_int"]

MAX_NUMEL = 1 << 62  # elements of one shape (each dimension and their product)
_P = ParamSpec("_P")
_R = TypeVar("_R")
# What a value of the wrong type raises when used as if it were right (after the explicit checks missed it).
_MALFORMED = (TypeError, ValueError, AttributeError, IndexError, OverflowError, RuntimeError, ZeroDivisionError)


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for naming a bad value in an error without printing all of it."""
    try:
        text = repr(value)
    except Exception:  # an int beyond str()'s digit limit, ...
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reading(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn a TypeError/ValueError/... raised while interpreting a checkpoint's values into a :class:`FormatError`
    naming the folder.

    The second line of defence: the reader checks what it uses explicitly; a value that slips past
    those checks still ends as ``error: ...`` on the command line, not a traceback.
    """

    @functools.wraps(method)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except ShardsafeError:
            raise
        except _MALFORMED as exc:
            where = getattr(args[0], "folder", "the DeepSpeed checkpoint") if args else "the DeepSpeed checkpoint"
            raise FormatError(
                f"{where}: holds values that are not what DeepSpeed writes ({type(exc).__name__} in {method.__name__})"
            ) from exc

    return checked


def get_entry(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``obj[key]``, which must exist and be a ``kind``."""
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: no {key!r} entry; not a DeepSpeed ZeRO checkpoint file")
    value = obj[key]
    if not isinstance(value, kind):
        raise FormatError(f"{where}: {key!r} is a {type(value).__name__}, expected {kind}")
    return value


def small_int(value: Any) -> int | None:
    """``value`` if it is a plain integer (a counter, a world size), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 63 else None


def shape_of(value: Any, where: str) -> tuple[int, ...]:
    """A tensor shape: at most :data:`~shardsafe.interop.pickle_scan.MAX_DIMS` non-negative ints, at most
    :data:`MAX_NUMEL` elements."""
    if (
        not isinstance(value, (torch.Size, tuple, list))
        or len(value) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_NUMEL for d in value)
        or math.prod(value) > MAX_NUMEL
    ):
        raise FormatError(f"{where}: bad shape {short(value)}")
    return tuple(int(d) for d in value)


def shapes_of(value: Any, where: str) -> dict[str, tuple[int, ...]]:
    """A mapping of parameter names to shapes."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise FormatError(f"{where}: expected a mapping of parameter names to shapes")
    return {k: shape_of(v, f"{where}[{short(k)}]") for k, v in value.items()}


def flat_tensor(value: Any, where: str) -> torch.Tensor:
    """A 1-D tensor (a rank's flat partition)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise FormatError(
            f"{where}: expected a 1-D tensor, got {type(value).__name__} {list(getattr(value, 'shape', []))[:8]}"
        )
    return value


def is_scalar(value: Any) -> bool:
    """A plain value or a one-element tensor: optimizer state shared by a flat group's parameters (``step``)."""
    return (
        value is None
        or isinstance(value, (bool, int, float))
        or (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1)
    )


def hyper_parameter(value: Any, where: str, depth: int = 0) -> Any:
    """A param group's hyper-parameter as JSON can hold it: a number, string, None or short list/tuple of those; a
    one-element tensor as its item."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and depth < 4 and len(value) <= 1024:
        return type(value)(hyper_parameter(v, where, depth + 1) for v in value)
    raise FormatError(f"{where}: a hyper-parameter that is a {type(value).__name__}")
