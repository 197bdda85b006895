"""Do a model folder's weights fit the architecture its ``config.json`` names?

A weights file can be well formed and still not be the model: a partial save, the wrong model's
weights next to a config, a file whose tensors a gather forgot. transformers would load such a
folder with a warning ("Some weights ... were newly initialized") and a randomly initialised
remainder. The guard refuses it instead.

With transformers installed, :func:`expected_weights` builds the model named by
``config.architectures`` on the meta device (no memory, no download, never remote code) and
lists the names and shapes of its state dict; :func:`compare` then matches the files' tensors
against them the way ``from_pretrained`` does: a tied alias (``lm_head.weight`` tied to the
embedding) may be absent, the model's own ignore lists (``_keys_to_ignore_on_load_missing`` /
``_unexpected`` / ``_on_save``, non-persistent buffers, the old ``rotary_emb.inv_freq`` and
``position_ids`` buffers) are honoured, and the base-model prefix (``model.``, ``transformer.``)
may be added or dropped between a base model and a model with a head. Models whose checkpoint
layout transformers converts at load (fused MoE experts, renamed keys) are compared by parameter
count when the names differ. Without transformers, :mod:`shardsafe.hf.param_count` compares the
parameter count a known architecture's config implies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from shardsafe.core.format import numel

__all__ = ["expected_weights", "judge"]

log = logging.getLogger(__name__)

# transformers ignores these left-overs of older checkpoints whenever the model has such buffers
_OLD_BUFFER_PATTERNS = {"rotary_emb.inv_freq": r"rotary_emb\.inv_freq", "position_ids": r"(^|\.)position_ids$"}
# names transformers' "legacy" renaming maps at load (LayerNorm.gamma -> .weight, weight norm)
_LEGACY_SUFFIXES = (".gamma", ".beta", ".weight_g", ".weight_v")
_SHOWN = 3  # names listed per kind of mismatch
_CACHE_SIZE = 8


@dataclass(frozen=True)
class ExpectedWeights:
    """The state dict a model built from a config has, and what ``from_pretrained`` forgives."""

    architecture: str
    shapes: dict[str, tuple[int, ...]]
    tied: tuple[frozenset[str], ...] = ()  # names that are one tensor: any one of a group present is enough
    may_be_missing: frozenset[str] = frozenset()  # _keys_to_ignore_on_save: never written
    ignore_missing: tuple[str, ...] = ()  # regexes
    ignore_unexpected: tuple[str, ...] = ()  # regexes
    non_persistent: frozenset[str] = frozenset()  # buffers that are not in the state dict; tolerated in a file
    prefix: str = ""  # base_model_prefix
    has_head: bool = False  # the model holds its base model under ``prefix`` (a ...ForCausalLM, say)
    heads_checked: bool = True  # False when no architecture was recorded: only the base model is compared
    converts: bool = False  # transformers converts this model's checkpoint layout at load
    checkpoint_shapes: dict[str, tuple[int, ...]] | None = None  # the layout transformers saves such a model in

    @property
    def unique_parameters(self) -> int:
        """Elements in the state dict, each tied group counted once."""
        aliases = {n for group in self.tied for n in sorted(group)[1:]}
        return sum(numel(s) for n, s in self.shapes.items() if n not in aliases)


@dataclass(frozen=True)
class Mismatch:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    # (name, in files, in model)
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.shapes)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing ({_first(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected ({_first(self.unexpected)})")
        if self.shapes:
            shown = ", ".join(
                f"{n!r}: {list(f)} in the files, {list(m)} in the model" for n, f, m in self.shapes[:_SHOWN]
            )
            parts.append(f"{len(self.shapes)} of another shape ({shown}{', ...' if len(self.shapes) > _SHOWN else ''})")
        return "; ".join(parts)


def _first(names: list[str]) -> str:
    return ", ".join(repr(n[:80]) for n in names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


# ----------------------------------------------------------------------------- the model, from its config

_cache: dict[str, ExpectedWeights | str] = {}


def expected_weights(config: dict[str, Any]) -> ExpectedWeights | str:
    """The weights the model of ``config`` (a parsed config.json) has, or a note saying why that is unknown."""
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _cache:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = _build(config)
    return _cache[key]


def _build(config: dict[str, Any]) -> ExpectedWeights | str:
    try:
        import torch
        import transformers
    except ImportError:
        return "transformers is not installed"
    architectures = config.get("architectures") or []
    name = (
        architectures[0]
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else None
    )
    cls = getattr(transformers, name, None) if name else None
    if name is not None:  # the class decides the config class (and the model_type is then not needed)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            return (
                f"config.json names {name[:60]!r}, which is not a transformers model class (custom code is never run)"
            )
        config_class = cls.config_class
        if config_class is None:
            return f"{name} declares no config class"
    else:  # no architecture recorded: the base model of the model type
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
            return f"config.json names no architecture and no model type transformers knows ({str(model_type)[:40]!r})"
        config_class = transformers.CONFIG_MAPPING[model_type]
    try:
        with _quiet(transformers):
            parsed = config_class.from_dict(dict(config))
            with torch.device("meta"):
                model = cls(parsed) if cls is not None else transformers.AutoModel.from_config(parsed)
    except Exception as exc:  # a config this transformers cannot build (newer or broken): say so, do not guess
        return f"transformers {transformers.__version__} cannot build the model from config.json ({type(exc).__name__})"
    return _describe_model(model, cls is not None)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' own warnings about the config would only be noise here: the guard reports what matters."""
    tf_logging = transformers.utils.logging
    before = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(before)


def _describe_model(model: Any, heads_checked: bool) -> ExpectedWeights:
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    groups: dict[int, set[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in shapes:
            groups.setdefault(id(tensor), set()).add(name)
    tied = [frozenset(g) for g in groups.values() if len(g) > 1]
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():  # transformers 5
        if target in shapes and source in shapes:
            tied.append(frozenset({str(target), str(source)}))
    ignore_missing: set[str] = set()
    ignore_unexpected: set[str] = set()
    never_saved: set[str] = set()
    # transformers 4 keeps the lists on each class; 5 gathers them on the top one
    for prefix, sub in model.named_modules():
        ignore_missing.update(str(p) for p in getattr(sub, "_keys_to_ignore_on_load_missing", None) or ())
        ignore_unexpected.update(str(p) for p in getattr(sub, "_keys_to_ignore_on_load_unexpected", None) or ())
        never_saved.update(
            f"{prefix}.{k}" if prefix else str(k) for k in getattr(sub, "_keys_to_ignore_on_save", None) or ()
        )
    buffers = [name for name, _ in model.named_buffers()]
    ignore_unexpected.update(
        p for suffix, p in _OLD_BUFFER_PATTERNS.items() if any(b.endswith(suffix) for b in buffers)
    )
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    converts = _has_conversions(model)
    return ExpectedWeights(
        architecture=type(model).__name__,
        shapes=shapes,
        tied=tuple(tied),
        may_be_missing=frozenset(never_saved & set(shapes)),
        ignore_missing=tuple(sorted(ignore_missing)),
        ignore_unexpected=tuple(sorted(ignore_unexpected)),
        non_persistent=frozenset(b for b in buffers if b not in shapes),
        prefix=prefix,
        has_head=bool(prefix) and any(n.startswith(prefix + ".") for n in shapes),
        heads_checked=heads_checked,
        converts=converts,
        checkpoint_shapes=_checkpoint_layout(model, state) if converts else None,
    )


def _has_conversions(model: Any) -> bool:
    """Whether transformers renames or fuses this model's checkpoint tensors at load (beyond the legacy renames)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: no load-time conversions
        return False
    try:
        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:  # an API that changed shape: assume conversions, so names are not held against the files
        return True


def _checkpoint_layout(model: Any, state: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes transformers' ``save_pretrained`` would write (its load-time conversion reversed, on meta
    tensors)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(state))
        return {str(name): tuple(t.shape) for name, t in reverted.items()}
    except Exception as exc:  # not in this transformers, or it cannot run on meta tensors: counts are compared instead
        log.debug("cannot derive the checkpoint layout of %s (%s: %s)", type(model).__name__, type(exc).__name__, exc)
        return None


# ----------------------------------------------------------------------------- comparing


def judge(expected: ExpectedWeights, found: dict[str, tuple[int, ...]], where: str) -> tuple[str | None, Mismatch]:
    """(how the files fit ``expected``, or None when they do not; the closest mismatch).

    The files may be in the model's own layout (what shardsafe writes) or, for a model whose
    checkpoint layout transformers converts at load, in that checkpoint layout (what
    transformers writes). When that layout cannot be derived, names that differ only by the
    conversion are forgiven if the parameter counts agree.
    """
    name = expected.architecture
    mismatch = compare(expected, found)
    if not mismatch:
        return f"names and shapes of {name}", mismatch
    if expected.checkpoint_shapes is not None:
        other = compare(replace(expected, shapes=expected.checkpoint_shapes), found)
        if not other:
            return f"names and shapes of {name} (in its checkpoint layout)", other
        mismatch = min(mismatch, other, key=lambda m: len(m.missing) + len(m.unexpected) + len(m.shapes))
    elif looks_converted(expected, mismatch) and counts_agree(expected, found):
        log.info(
            "%s: names differ from %s's (%s), as when transformers converts them at load; counts agree",
            where,
            name,
            mismatch.describe(),
        )
        return f"parameter count of {name} (names in a converted layout)", mismatch
    return None, mismatch


def compare(expected: ExpectedWeights, found: dict[str, tuple[int, ...]]) -> Mismatch:
    """Match the files' tensors (name -> shape) against ``expected`` the way ``from_pretrained`` would."""
    found, outside = _align_prefix(expected, found)
    names = set(found)
    missing = set(expected.shapes) - names
    for group in expected.tied:
        if group & names:
            missing -= group
    missing -= expected.may_be_missing
    missing = {n for n in missing if not _matches(n, expected.ignore_missing)}
    tolerated = outside | expected.non_persistent
    unexpected = {
        n for n in names - set(expected.shapes) if n not in tolerated and not _matches(n, expected.ignore_unexpected)
    }
    shapes = [
        (n, found[n], expected.shapes[n])
        for n in sorted(names & set(expected.shapes))
        if found[n] != expected.shapes[n]
    ]
    return Mismatch(sorted(missing), sorted(unexpected), shapes)


def _align_prefix(
    expected: ExpectedWeights, found: dict[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The files' names in the model's terms: the base-model prefix added or dropped as from_pretrained does.

    Also returns the names that lie outside the base model when only the base model is checked.
    """
    dot = expected.prefix + "." if expected.prefix else ""
    if not dot:
        return found, set()
    found_has = any(n.startswith(dot) for n in found)
    if expected.has_head and not found_has:  # a base model's files loaded into a model with a head
        return {(dot + n if dot + n in expected.shapes else n): s for n, s in found.items()}, set()
    if not expected.has_head and found_has:  # a model with a head's files loaded into its base model
        outside = set() if expected.heads_checked else {n for n in found if not n.startswith(dot)}
        return {n.removeprefix(dot): s for n, s in found.items()}, outside
    return found, set()


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except re.error:
            continue
    return False


def looks_converted(expected: ExpectedWeights, mismatch: Mismatch) -> bool:
    """Names that differ only because transformers would convert them at load: compare counts instead of names."""
    return expected.converts or any(n.endswith(_LEGACY_SUFFIXES) for n in mismatch.unexpected)


def counts_agree(expected: ExpectedWeights, found: dict[str, tuple[int, ...]]) -> bool:
    """The files hold as many elements as the model (tied weights once, or every alias written out)."""
    total = sum(numel(s) for s in found.values())
    return total in (expected.unique_parameters, sum(numel(s) for s in expected.shapes.values()))
