"""The guard used by export, push and save_pretrained: refuse a model folder that is not a real model.

Trainers have shipped weights files holding no tensors at all (an empty state dict saved as
safetensors, 16 bytes: what a ZeRO-3 save without gathering leaves), files of empty tensors
(saved by one rank without gathering), "dummy" files left behind, partial saves, and indexes
pointing at shards that were never written; some of those reached the Hub. Every path that
saves or publishes a model folder calls :func:`check_model_folder` first. It refuses, with a
:class:`~shardsafe.errors.ModelFolderError` that says what is wrong:

1. a weights file with no tensors, with empty tensors, or that safetensors would not open
   (checked on the header first, then with ``safetensors.safe_open``: :mod:`.weights_file`);
2. an index (``model.safetensors.index.json``) whose ``weight_map`` names a missing file or a
   tensor its file lacks, whose files hold tensors it does not list, or whose
   ``metadata.total_size`` is not the tensor bytes the files hold;
3. weights that do not fit the architecture in ``config.json`` (:mod:`.architecture`: names and
   shapes with transformers; the parameter count a known config implies without it,
   :mod:`.param_count`);
4. a shardsafe checkpoint (or ``config.json`` + ``checkpoint/``) whose files are missing or
   shorter than its manifest says, or that holds no tensor data.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, numel, parse_json
from shardsafe.errors import ModelFolderError, ShardsafeError
from shardsafe.hf.architecture import expected_weights, judge
from shardsafe.hf.param_count import config_parameter_count
from shardsafe.hf.weights_file import NO_TENSORS, WeightsFile, open_with_safetensors, read_weights_file, show_name
from shardsafe.storage.local import read_small_file, safe_child

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
__all__ = ["INDEX_FILE", "NO_TENSORS", "SINGLE_FILE", "ModelFolderSummary", "check_model_folder"]


@dataclass(frozen=True)
class ModelFolderSummary:
    kind: str  # "safetensors", "sharded-safetensors" or "shardsafe-checkpoint"
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    parameters: int = 0
    tensor_bytes: int = 0
    # what the architecture check did: "names and shapes of X", "parameter count of X", or "skipped: why"
    architecture: str = ""


def check_model_folder(folder: str | os.PathLike[str]) -> ModelFolderSummary:
    """Raise :class:`ModelFolderError` unless ``folder`` holds complete, real weights that fit its config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: no such model folder")
    if (folder / INDEX_FILE).is_file():
        return _check_safetensors(folder, _sharded_files(folder), "sharded-safetensors")
    if (folder / SINGLE_FILE).exists():
        return _check_safetensors(folder, [read_weights_file(_child(folder, SINGLE_FILE))], "safetensors")
    if (folder / MANIFEST_NAME).is_file():
        return _check_checkpoint(folder)
    if (folder / "checkpoint" / MANIFEST_NAME).is_file():  # save_pretrained(gather_16bit=False): config + checkpoint/
        return _check_checkpoint(_child(folder, "checkpoint"))
    pickles = [name for name in PICKLE_FILES if (folder / name).exists()]
    if pickles:
        raise ModelFolderError(f"{folder}: holds {pickles[0]}, a pickle; shardsafe only publishes safetensors weights")
    raise ModelFolderError(f"{folder}: no weights found ({SINGLE_FILE}, {INDEX_FILE} or a shardsafe {MANIFEST_NAME})")


def _child(folder: Path, name: str) -> Path:
    try:
        return safe_child(folder, name)
    except ShardsafeError as exc:
        raise ModelFolderError(str(exc)) from None


def _check_safetensors(folder: Path, weights: list[WeightsFile], kind: str) -> ModelFolderSummary:
    """The checks every safetensors folder gets once each file's header passed: architecture, then safetensors
    itself."""
    found: dict[str, tuple[int, ...]] = {}
    for w in weights:
        for name, t in w.tensors.items():
            if name in found:
                raise ModelFolderError(f"{folder}: tensor {show_name(name)} is in more than one weights file")
            found[name] = t.shape
    summary = ModelFolderSummary(
        kind,
        files=[w.path.name for w in weights],
        tensors=len(found),
        parameters=sum(w.parameters for w in weights),
        tensor_bytes=sum(w.tensor_bytes for w in weights),
        architecture=_check_architecture(folder, found),
    )
    for w in weights:
        open_with_safetensors(w.path)
    return summary


def _sharded_files(folder: Path) -> list[WeightsFile]:
    """Every file the index names, each holding exactly the tensors the index maps to it, and the bytes it says."""
    index_path = _child(folder, INDEX_FILE)
    try:
        index = parse_json(read_small_file(index_path, MAX_JSON_BYTES), str(index_path))
    except ShardsafeError as exc:
        raise ModelFolderError(f"{index_path}: unreadable index: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(f"{index_path}: has no weight_map entries")
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ModelFolderError(f"{index_path}: weight_map[{show_name(name)}] is not a file name")
        by_file.setdefault(file, set()).add(name)
    paths = {file: _child(folder, file) for file in sorted(by_file)}
    missing = [path for path in paths.values() if not path.exists()]
    if missing:  # the most telling problem first: a shard that was never written
        raise ModelFolderError(
            f"{missing[0]}: weights file is missing ({len(missing)} of the {len(paths)} files {INDEX_FILE} names)"
        )
    weights = []
    problems = []
    for file, names in sorted(by_file.items()):
        w = read_weights_file(paths[file])
        lacking = sorted(names - set(w.tensors))
        if lacking:
            problems.append(
                f"{w.path}: lacks {len(lacking)} tensors its index maps to it (e.g. {show_name(lacking[0])})"
            )
        unlisted = sorted(set(w.tensors) - names)
        if unlisted:
            problems.append(
                f"{w.path}: holds {len(unlisted)} tensors {INDEX_FILE} does not map to it (e.g. "
                f"{show_name(unlisted[0])})"
            )
        weights.append(w)
    if problems:  # all of them at once: a tensor in the wrong file shows up twice
        raise ModelFolderError(
            "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        )
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    held = sum(w.tensor_bytes for w in weights)
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total != held):
        shown = total if isinstance(total, int) else type(total).__name__
        raise ModelFolderError(
            f"{folder}: the weights files hold {held} bytes of tensors, {INDEX_FILE} says total_size {shown}"
        )
    return weights


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = parse_json(read_small_file(_child(folder, CONFIG_FILE), MAX_JSON_BYTES), str(path))
    except ShardsafeError as exc:
        raise ModelFolderError(f"{path}: unreadable config: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFolderError(f"{path}: not a JSON object")
    return config


def _check_architecture(folder: Path, found: dict[str, tuple[int, ...]]) -> str:
    """Refuse weights that do not fit config.json's architecture; returns what was checked (or why nothing was)."""
    config = _read_config(folder)
    if config is None:
        return "skipped: no config.json"
    # packed weights (GPTQ, AWQ, bitsandbytes...) have their own names and shapes
    if config.get("quantization_config") is not None:
        note = "skipped: quantized weights (config.json has a quantization_config)"
        log.info("%s: no architecture check of the weights (%s)", folder, note.removeprefix("skipped: "))
        return note
    expected = expected_weights(config)
    if not isinstance(expected, str):
        how, mismatch = judge(expected, found, str(folder))
        if how is None:
            what = f"the {expected.architecture} architecture in {CONFIG_FILE}"
            raise ModelFolderError(f"{folder}: the weights do not match {what}: {mismatch.describe()}")
        return how
    count = config_parameter_count(config)
    if isinstance(count, str):
        note = f"skipped: {expected}; {count}"
        log.info("%s: no architecture check of the weights (%s)", folder, note.removeprefix("skipped: "))
        return note
    if not count.agrees(found):
        total = sum(numel(s) for s in found.values())
        raise ModelFolderError(
            f"{folder}: the weights hold {total:,} parameters, the {count.architecture} architecture in {CONFIG_FILE} "
            "has "
            f"{count.parameters:,} ({expected}, so only the parameter count was compared)"
        )
    return f"parameter count of {count.architecture} ({expected})"


def _check_checkpoint(folder: Path) -> ModelFolderSummary:
    from shardsafe.protocol.commit import open_checkpoint

    manifest, _ = open_checkpoint(folder)
    for name, entry in manifest.files.items():
        path = _child(folder, name)
        size = path.stat().st_size if path.is_file() else -1
        if size != entry.size:
            raise ModelFolderError(
                f"{path}: {'missing' if size < 0 else f'{size} bytes'}, the manifest says {entry.size}"
            )
    tensor_bytes = sum(t.nbytes for t in manifest.tensors.values())
    if tensor_bytes == 0:
        raise ModelFolderError(f"{folder}: checkpoint holds no tensor data")
    return ModelFolderSummary(
        "shardsafe-checkpoint",
        files=list(manifest.files),
        tensors=len(manifest.tensors),
        parameters=sum(numel(t.shape) for t in manifest.tensors.values()),
        tensor_bytes=tensor_bytes,
        architecture="skipped: a shardsafe checkpoint (verified against its manifest)",
    )
