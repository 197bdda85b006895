"""Where a DeepSpeed checkpoint is and which files it holds: ``latest``, the tag folder, one file per rank, loaded
lazily.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/`` holding
``*_model_states.pt`` and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (one per
data-parallel rank). ``latest`` is read only as a small regular file inside the folder: opened
without following a symlink, at most :data:`MAX_LATEST_BYTES`, one folder name; what it holds is
never echoed in an error unless it has DeepSpeed's own form ``global_step<N>`` (which no secret
has), since ``latest`` may be a file planted to make the reader print another file's content.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.interop.mapped_copy import FileMapping
from shardsafe.interop.unpickler import load_file
from shardsafe.storage.local import open_regular, safe_child

__all__ = ["DeepSpeedFiles", "find_deepspeed_checkpoint", "is_deepspeed_checkpoint"]

LATEST = "latest"
MAX_LATEST_BYTES = 1024  # a tag is one folder name (at most 255 bytes), plus a newline
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d{1,6})_mp_rank_(\d{1,6})_optim_states\.pt$")
_MODEL_FILE_Z3 = re.compile(r"^zero_pp_rank_(\d{1,6})_mp_rank_(\d{1,6})_model_states\.pt$")
_MODEL_FILE_Z12 = re.compile(r"^mp_rank_(\d{1,6})_model_states\.pt$")
_UNSUPPORTED_FILES = re.compile(r"^(layer_\d+|expp_rank_\d+|.*_moe_).*\.pt$")
_TAG = re.compile(r"^[^\x00-\x1f\x7f/\\]{1,255}$")
_DEEPSPEED_TAG = re.compile(r"^global_step[0-9]{1,20}$")


@dataclass(frozen=True)
class DeepSpeedLocation:
    """A DeepSpeed checkpoint: the folder ``save_checkpoint`` wrote, its tag folder, the tag, and whether the tag may be
    shown."""

    model_folder: Path
    folder: Path
    tag: str
    shown: bool = True  # False: the tag came from `latest` and is not of DeepSpeed's form, so errors do not print it


def _is_tag_folder(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(OPTIM_FILE.match(p.name) for p in folder.iterdir())
    except OSError:
        return False


def is_deepspeed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder (holding ``latest``) or one of its tag folders."""
    folder = Path(path)
    if (folder / MANIFEST_NAME).is_file():
        return False
    if os.path.lexists(folder / LATEST) and not (folder / LATEST).is_dir():
        return True  # a `latest` that is a symlink or a FIFO is a DeepSpeed folder the reader then refuses, by name
    return _is_tag_folder(folder)


def is_valid_tag(tag: str) -> bool:
    """One folder name: no separator, no control character, not ``.`` or ``..``."""
    return bool(_TAG.match(tag)) and tag not in (".", "..")


def read_latest(folder: Path) -> str:
    """The tag ``folder/latest`` names, read as a small regular file (no symlink, no FIFO); never echoed in an error."""
    path = folder / LATEST
    try:
        fd = open_regular(path, follow=False)
    except FormatError:
        raise FormatError(
            f"{path}: not a regular file; `latest` must be a small text file naming a tag folder"
        ) from None
    except OSError as exc:
        if os.path.islink(path):
            raise FormatError(
                f"{path}: is a symbolic link; `latest` must be a regular file inside the checkpoint folder"
            ) from None
        raise FormatError(f"{path}: cannot be read ({exc.strerror})") from None
    with open(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_LATEST_BYTES:
            raise FormatError(f"{path}: {size} bytes; `latest` holds one tag name of at most {MAX_LATEST_BYTES} bytes")
        raw = f.read(MAX_LATEST_BYTES + 1)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise FormatError(f"{path}: bad checkpoint tag: not a valid tag name (not UTF-8 text)") from None
    if not is_valid_tag(tag):
        raise FormatError(
            f"{path}: bad checkpoint tag: not a valid tag name (it must be one folder name: no '/', '\\', '..' or "
            "control characters)"
        )
    return tag


def find_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedLocation:
    """The DeepSpeed checkpoint at ``path``: its root folder (holding ``latest``) or a tag folder; ``tag`` picks another
    tag."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such folder")
    if tag is None and _is_tag_folder(folder):
        return DeepSpeedLocation(folder.parent, folder, folder.name)
    shown = True
    if tag is None:
        if not os.path.lexists(folder / LATEST):
            tags = sorted(p.name for p in folder.iterdir() if _is_tag_folder(p))
            hint = f"; it holds the tag folders {tags}, pick one with tag=/--tag or pass that folder" if tags else ""
            raise CheckpointNotFoundError(
                f"{folder}: not a DeepSpeed checkpoint (no {LATEST!r} file and no *_optim_states.pt files){hint}"
            )
        tag = read_latest(folder)
        shown = bool(_DEEPSPEED_TAG.match(tag))
    elif not is_valid_tag(tag):
        raise FormatError(f"{folder}: bad checkpoint tag {tag[:80]!r}; it must be one folder name")
    label = str(folder / tag) if shown else f"{folder}: the tag folder {LATEST!r} names"
    try:
        inner = safe_child(folder, tag)
    except FormatError:
        raise FormatError(f"{label}: is a symbolic link or leads outside the checkpoint folder") from None
    if not _is_tag_folder(inner):
        raise CheckpointNotFoundError(f"{label}: tag folder is missing or holds no *_optim_states.pt files")
    return DeepSpeedLocation(folder, inner, tag, shown)


class DeepSpeedFiles:
    """The rank files of one tag folder, each loaded (memory-mapped, restricted) on first use and kept until
    :meth:`close`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        optim: dict[int, Path] = {}
        self.models: dict[int, Path] = {}  # rank -> ZeRO-3 model file; -1 -> ZeRO-1/2's single file
        for entry in sorted(folder.iterdir()):
            name = entry.name
            if m := OPTIM_FILE.match(name):
                rank, mp = int(m.group(2)), int(m.group(3))
                if mp != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {mp}) are not supported")
                if rank in optim:
                    raise FormatError(f"{folder}: two optimizer files for rank {rank} ({optim[rank].name}, {name})")
                optim[rank] = entry
            elif m := _MODEL_FILE_Z3.match(name):
                if int(m.group(2)) != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {m.group(2)}) are not supported")
                self.models[int(m.group(1))] = entry
            elif m := _MODEL_FILE_Z12.match(name):
                if int(m.group(1)) != 0:
                    raise FormatError(f"{entry}: tensor-parallel checkpoints (mp_rank {m.group(1)}) are not supported")
                self.models[-1] = entry
            elif _UNSUPPORTED_FILES.match(name):
                raise FormatError(f"{entry}: pipeline-parallel or MoE expert checkpoint files are not supported")
        ranks = sorted(optim)
        if ranks != list(range(len(ranks))):
            raise FormatError(
                f"{folder}: optimizer files for ranks {ranks[:8]}; expected 0..{len(ranks) - 1} (a rank's file is "
                "missing)"
            )
        for path in [*optim.values(), *self.models.values()]:
            # regular files inside the tag folder, no symlinks out (the loader opens without following)
            safe_child(folder, path.name)
        self.optim = [optim[r] for r in ranks]
        self.stage = 3
        self._loaded: dict[Path, Any] = {}
        self._mappings: dict[Path, FileMapping | None] = {}

    @property
    def world_size(self) -> int:
        return len(self.optim)

    def check_model_files(self, stage: int) -> None:
        """ZeRO-3 keeps one model file per rank, ZeRO-1/2 one for all; refuse a tag folder without them."""
        self.stage = stage
        if stage == 3:
            ranks = sorted(r for r in self.models if r >= 0)
            if ranks != list(range(self.world_size)):
                raise FormatError(
                    f"{self.folder}: ZeRO-3 model state files for ranks {ranks[:8]}; expected 0..{self.world_size - 1}"
                )
        elif -1 not in self.models:
            raise FormatError(f"{self.folder}: no mp_rank_00_model_states.pt (ZeRO-{stage} keeps one model file)")

    def model_path(self, rank: int) -> Path:
        key = rank if self.stage == 3 else -1
        if key not in self.models:
            name = (
                f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"
            )
            raise FormatError(f"{self.folder}: {name} is missing (ZeRO-{self.stage})")
        return self.models[key]

    def load(self, path: Path) -> Any:
        """The unpickled value of ``path`` (one of this folder's rank files), loaded once."""
        if path not in self._loaded:
            loaded = load_file(path, mmap=True)
            self._loaded[path], self._mappings[path] = loaded.value, loaded.mapping
        return self._loaded[path]

    def mapping(self, path: Path) -> FileMapping | None:
        """Where ``path``'s tensors are mapped (after :meth:`load`)."""
        return self._mappings.get(path)

    def close(self) -> None:
        self._loaded.clear()
        self._mappings.clear()
