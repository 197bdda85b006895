"""The framework seams: every private or patched name of transformers, Accelerate and huggingface_hub shardsafe touches,
one module per framework.

Each module imports only its framework (and :mod:`shardsafe.errors`), lists in its docstring what
it touches and the versions that was checked against, and raises :class:`CompatError` naming the
installed version and the checked range when a touched name is missing. Callers use these
modules only, never the private names themselves. DeepSpeed's ZeRO-3 internals are read by
``state/zero3.py`` and ``state/deepspeed_engine.py``, whose docstrings list them (checked against
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
