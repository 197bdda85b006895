"""The framework seams: every private or patched name of transformers, Accelerate, huggingface_hub and DeepSpeed
shardsafe touches, one module per framework.

Each module imports only its framework (and :mod:`shardsafe.errors`), lists in its docstring what
it touches and the versions that was checked against, and raises :class:`CompatError` naming the
installed version and the checked range when a touched name is missing. Callers use these
modules only, never the private names themselves. DeepSpeed's underscore ZeRO-3 names are in
``compat/deepspeed.py`` (which never imports DeepSpeed); the public ZeRO-3 optimizer attributes the
engine adapter reads are listed, and checked on use, in ``state/zero3.py`` (checked against
DeepSpeed 0.19.8).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from shardsafe.errors import ShardsafeError

__all__ = ["CompatError", "installed_version", "missing"]


class CompatError(ShardsafeError):
    """A private name of a framework that shardsafe relies on is not in the installed version."""


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"not installed"``."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def missing(distribution: str, name: str, checked: str) -> CompatError:
    """The error for a touched name ``name`` that the installed ``distribution`` lacks."""
    return CompatError(
        f"shardsafe relies on {name} of {distribution}, which the installed {distribution} "
        f"{installed_version(distribution)} lacks; "
        f"shardsafe was checked against {distribution} {checked}: install a version in that range"
    )
