"""The guard used by export, push and load: refuse a model folder without real weights.

Trainers have shipped weights files of a few hundred KB holding empty tensors (ZeRO-3 saves done
by one rank without gathering), "dummy" files left behind, and indexes pointing at shards that
were never written; some of those reached the Hub. Every path that publishes a model folder calls
:func:`check_model_folder` first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, numel, parse_json, parse_safetensors_header
from shardsafe.errors import ModelFolderError, ShardsafeError
from shardsafe.storage.local import read_small_file, safe_child

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class ModelFolderSummary:
    kind: str  # "safetensors", "sharded-safetensors" or "shardsafe-checkpoint"
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    parameters: int = 0
    tensor_bytes: int = 0


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Validated header of a safetensors file (name -> (dtype, shape, begin, end))."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or 8 + length > size:
            raise ModelFolderError(f"{path}: not a safetensors file (header length {length}, file size {size})")
        head += f.read(length)
    return parse_safetensors_header(head, size, str(path))


def _check_weights_file(path: Path, summary: ModelFolderSummary, expected: set[str] | None = None) -> set[str]:
    if not path.is_file():
        raise ModelFolderError(f"{path}: weights file is missing")
    if path.stat().st_size == 0:
        raise ModelFolderError(f"{path}: weights file is empty (0 bytes)")
    try:
        header = read_safetensors_header(path)
    except ShardsafeError as exc:
        raise ModelFolderError(f"{path}: unreadable weights file: {exc}") from None
    empty = [name for name, (_, shape, _, _) in header.items() if numel(shape) == 0]
    if empty:
        raise ModelFolderError(
            f"{path}: {len(empty)} tensors are empty (e.g. {empty[0]!r}); this looks like weights saved by one rank "
            "without gathering the ZeRO-3/FSDP shards - refusing it"
        )
    if expected is not None and not expected <= set(header):
        missing = sorted(expected - set(header))
        raise ModelFolderError(f"{path}: lacks {len(missing)} tensors its index maps to it (e.g. {missing[0]!r})")
    summary.files.append(path.name)
    summary.tensors += len(header)
    summary.parameters += sum(numel(shape) for _, shape, _, _ in header.values())
    summary.tensor_bytes += sum(end - begin for _, _, begin, end in header.values())
    return set(header)


def check_model_folder(folder: str | os.PathLike[str]) -> ModelFolderSummary:
    """Raise :class:`ModelFolderError` unless ``folder`` holds complete, non-empty weights."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder}: no such model folder")
    if (folder / INDEX_FILE).is_file():
        return _check_sharded(folder)
    if (folder / SINGLE_FILE).exists():
        summary = ModelFolderSummary("safetensors")
        _check_weights_file(safe_child(folder, SINGLE_FILE), summary)
        return summary
    if (folder / MANIFEST_NAME).is_file():
        return _check_checkpoint(folder)
    if (folder / "checkpoint" / MANIFEST_NAME).is_file():  # save_pretrained(gather_16bit=False): config + checkpoint/
        return _check_checkpoint(safe_child(folder, "checkpoint"))
    pickles = [name for name in PICKLE_FILES if (folder / name).exists()]
    if pickles:
        raise ModelFolderError(f"{folder}: holds {pickles[0]}, a pickle; shardsafe only publishes safetensors weights")
    raise ModelFolderError(f"{folder}: no weights found ({SINGLE_FILE}, {INDEX_FILE} or a shardsafe {MANIFEST_NAME})")


def _check_sharded(folder: Path) -> ModelFolderSummary:
    index_path = safe_child(folder, INDEX_FILE)
    index = parse_json(read_small_file(index_path, MAX_JSON_BYTES), str(index_path))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFolderError(f"{index_path}: has no weight_map entries")
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ModelFolderError(f"{index_path}: weight_map[{name!r}] is not a file name")
        by_file.setdefault(file, set()).add(name)
    summary = ModelFolderSummary("sharded-safetensors")
    for file, names in sorted(by_file.items()):
        try:
            path = safe_child(folder, file)
        except ShardsafeError as exc:
            raise ModelFolderError(str(exc)) from None
        _check_weights_file(path, summary, names)
    total = (index.get("metadata") or {}).get("total_size")
    if isinstance(total, int) and summary.tensor_bytes < total:
        raise ModelFolderError(f"{folder}: weights hold {summary.tensor_bytes} bytes of tensors, the index says {total}")
    return summary


def _check_checkpoint(folder: Path) -> ModelFolderSummary:
    from shardsafe.protocol.commit import open_checkpoint

    manifest, _ = open_checkpoint(folder)
    summary = ModelFolderSummary("shardsafe-checkpoint")
    for name, entry in manifest.files.items():
        path = safe_child(folder, name)
        size = path.stat().st_size if path.is_file() else -1
        if size != entry.size:
            raise ModelFolderError(f"{path}: {'missing' if size < 0 else f'{size} bytes'}, the manifest says {entry.size}")
        summary.files.append(name)
    summary.tensors = len(manifest.tensors)
    summary.parameters = sum(numel(t.shape) for t in manifest.tensors.values())
    summary.tensor_bytes = sum(t.nbytes for t in manifest.tensors.values())
    if summary.tensor_bytes == 0:
        raise ModelFolderError(f"{folder}: checkpoint holds no tensor data")
    return summary
