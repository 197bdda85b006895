"""Whole tensors out of a committed checkpoint, one at a time: what export and conversion read.

A :class:`TensorSource` lists named tensors (:class:`TensorInfo`) and returns each whole tensor on
``read(name)``; :class:`CheckpointSource` implements it over a shardsafe checkpoint, and the
DeepSpeed reader (``shardsafe.interop.deepspeed_reader``) over DeepSpeed's own ZeRO checkpoints, so the
Hugging Face export above both layers needs neither's details.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from shardsafe.core.format import MANIFEST_NAME, dtype_from_name, element_size, numel
from shardsafe.core.values import state_tensor_keys as tensor_keys_of
from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.state.engine_entry import KIND_DEEPSPEED_ENGINE, engine_model_tensors
from shardsafe.storage.local import safe_child

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointSource",
    "DTYPE_CHOICES",
    "EXPORT_META",
    "TensorInfo",
    "TensorSource",
    "find_config_files",
]

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")
CHECKPOINT_DIR = "checkpoint"  # where save_pretrained(gather_16bit=False) puts the sharded checkpoint
EXPORT_META = "shardsafe_export"  # checkpoint metadata key save_pretrained records for export
DTYPE_CHOICES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the output: its name in the model folder, dtype and shape as written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)


@runtime_checkable
class TensorSource(Protocol):
    """What an export reads from: named whole tensors, fetched one at a time.

    ``tensors()`` lists what to write, in state-dict order, with names as they appear in the model
    folder and the *stored* dtype (tied aliases already left out). ``read(name)`` returns that
    whole tensor (CPU, stored dtype). ``config_files()`` names files to copy next to the
    weights (``config.json``, ``generation_config.json``); ``default_dtype`` is the dtype to
    export in when the caller gives none (None: keep the stored dtypes).
    """

    default_dtype: torch.dtype | None

    def tensors(self) -> list[TensorInfo]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def config_files(self) -> dict[str, Path]: ...

    def close(self) -> None: ...


def find_config_files(*folders: Path) -> dict[str, Path]:
    """config.json / generation_config.json, from the first of ``folders`` that has each."""
    found = {}
    for name in CONFIG_FILES:
        for folder in folders:
            if (folder / name).is_file():
                found[name] = safe_child(folder, name)
                break
    return found


def find_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(model folder, checkpoint folder) for a checkpoint or a ``gather_16bit=False`` model folder."""
    folder = Path(path).absolute()
    if (folder / MANIFEST_NAME).is_file():
        return folder, folder
    inner = folder / CHECKPOINT_DIR
    if (inner / MANIFEST_NAME).is_file():
        safe_child(folder, CHECKPOINT_DIR)
        return folder, inner
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such folder")
    raise CheckpointNotFoundError(
        f"{folder}: neither a shardsafe checkpoint ({MANIFEST_NAME}) nor a model folder holding one in "
        f"{CHECKPOINT_DIR}/{MANIFEST_NAME}"
    )


class CheckpointSource:
    """The tensors of one state entry (``key``, e.g. ``model``) of a committed shardsafe checkpoint.

    Each :meth:`read` allocates the whole tensor and fills it with verified positional reads of
    only the chunks it needs (``plan_reads`` + ``ChunkReader``), whatever the saving world size.
    ``aliases`` (name -> the name it is tied to) are left out when both hold the same values;
    save_pretrained records them in the checkpoint metadata, and ``export_hf`` derives them from a
    transformers config.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: str = "model",
        *,
        verify: bool = True,
        aliases: dict[str, str] | None = None,
    ) -> None:
        self.model_folder, self.folder = find_checkpoint(path)
        self.manifest, self.tree = open_checkpoint(self.folder)
        self.key = key = self._engine_key_for(key)
        self.prefix = f"{key}/" if key else ""
        meta = self.manifest.metadata.get(EXPORT_META)
        self.export_meta: dict[str, Any] = meta if isinstance(meta, dict) and meta.get("key", key) == key else {}
        stored = self.export_meta.get("dtype")
        self.default_dtype: torch.dtype | None = (
            dtype_from_name(stored, "checkpoint metadata") if stored is not None else None
        )
        total = self.export_meta.get("total_parameters")
        self.total_parameters: int | None = total if isinstance(total, int) and not isinstance(total, bool) else None
        self._stored = self._stored_layout()
        if not self._stored:
            names = sorted({k.split("/", 1)[0] for k in self.manifest.tensors})
            raise FormatError(
                f"{self.folder}: no tensors under {key!r} (the checkpoint holds {names}); pick one with key=/--key"
            )
        self._reader = ChunkReader(self.folder, self.manifest, verify)
        recorded = self.export_meta.get("aliases")
        self.aliases_recorded = isinstance(recorded, dict)
        self.aliases: dict[str, str] = {}
        self.tie(recorded if isinstance(recorded, dict) else aliases or {})

    def _engine_key_for(self, key: str) -> str:
        """The default key ``model`` finds the model of a checkpoint saved from a DeepSpeed engine
        (ShardsafeTrainer under ZeRO-3 saves it as ``engine``) when there is no ``model`` entry."""
        if key != "model" or key in self.tree:
            return key
        engines = [
            name
            for name, entry in self.tree.items()
            if isinstance(entry, dict) and entry.get("kind") == KIND_DEEPSPEED_ENGINE
        ]
        return engines[0] if len(engines) == 1 else key

    def _stored_layout(self) -> dict[str, tuple[str, tuple[int, ...] | None]]:
        """Output tensor name -> (stored key, shape to give it; None keeps the stored one), in the
        state-dict order recorded in state.json. A DeepSpeed engine entry stores parameters flat
        (one 1-D tensor each); its recorded shapes restore them."""
        entry = self.tree.get(self.key) if self.key else None
        if isinstance(entry, dict) and entry.get("kind") == KIND_DEEPSPEED_ENGINE:
            layout = engine_model_tensors(entry, f"{self.folder}/state.json: {self.key!r}")
            for name, (stored, shape) in layout.items():
                entry_ = self.manifest.tensors.get(stored)
                if entry_ is None:
                    raise FormatError(
                        f"{self.folder}: state.json refers to tensor {stored!r}, which the manifest does not list"
                    )
                if shape is not None and math.prod(shape) != math.prod(entry_.shape):
                    raise FormatError(
                        f"{self.folder}: {stored!r} holds {math.prod(entry_.shape)} elements, {name!r} needs "
                        f"{list(shape)}"
                    )
            return layout
        keys = [k for k in self.manifest.tensors if k.startswith(self.prefix)]
        recorded = tensor_keys_of(entry.get("state")) if isinstance(entry, dict) else []
        present = set(keys)
        ordered = [k for k in recorded if k in present]
        listed = set(ordered)
        return {k[len(self.prefix) :]: (k, None) for k in ordered + sorted(k for k in keys if k not in listed)}

    def _same_stored_content(self, a: str, b: str) -> bool:
        """Whether two stored tensors hold the same bytes, judged from their chunk layouts and block
        hashes (the parts of a split rule from the indexes)."""
        (key_a, _), (key_b, _) = self._stored[a], self._stored[b]
        entry_a, entry_b = self.manifest.tensors[key_a], self.manifest.tensors[key_b]
        if entry_a.dtype != entry_b.dtype or entry_a.shape != entry_b.shape:
            return False
        layout_a = sorted((c.offsets, c.shape, c.hashes) for c in self._reader.chunks_of(key_a, entry_a))
        layout_b = sorted((c.offsets, c.shape, c.hashes) for c in self._reader.chunks_of(key_b, entry_b))
        return layout_a == layout_b

    def tie(self, aliases: dict[str, str]) -> None:
        """Leave out each ``alias`` (name -> the name it is tied to) that holds the same values as its target."""
        names = set(self._stored)
        self.aliases = {}
        for alias, target in aliases.items():
            if alias in names and target in names and alias != target and target not in self.aliases:
                if self._same_stored_content(alias, target):
                    self.aliases[alias] = target
                else:
                    log.warning(
                        "%s and %s are declared tied but hold different values; both are exported", alias, target
                    )

    def tensors(self) -> list[TensorInfo]:
        out = []
        for name, (stored, shape) in self._stored.items():
            if name not in self.aliases:
                entry = self.manifest.tensors[stored]
                out.append(TensorInfo(name, entry.dtype, shape if shape is not None else entry.shape))
        return out

    def read(self, name: str) -> torch.Tensor:
        stored, shape = self._stored[name]
        tensor = self._reader.read_tensor(stored, self.manifest.tensors[stored])
        return tensor.view(shape) if shape is not None else tensor

    def config_files(self) -> dict[str, Path]:
        return find_config_files(self.model_folder, self.folder)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
