"""One safetensors weights file, checked as strictly as safetensors itself will read it.

The model-folder guard must refuse any file a loader would refuse (or would read as something
else), and say why in its own words: safetensors' errors quote the header they choke on, and an
error here never echoes a file's content. So the cheap structural checks are done here, on the
header alone (the 8-byte length and the JSON after it): the file holds tensors at all (an empty
state dict saved as safetensors, 16 bytes, is what a ZeRO-3 save without gathering leaves), none
is empty, ``__metadata__`` is a string map and not a tensor, every name is valid UTF-8, and the
data offsets tile the rest of the file exactly (no overlap, no gap, no trailing bytes). Then
:func:`open_with_safetensors` lets safetensors itself parse the file, so whatever it refuses is
refused here too, with its error class but not its text.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from shardsafe.core.format import MAX_HEADER_BYTES, numel, parse_json, parse_safetensors_header
from shardsafe.errors import ModelFolderError, ShardsafeError

__all__ = ["METADATA_KEY", "NO_TENSORS", "WeightsFile", "open_with_safetensors", "read_weights_file", "show_name"]

NO_TENSORS = "holds no tensors: looks like a ZeRO-3 save without gathered weights"
METADATA_KEY = "__metadata__"
_NAME_SHOWN = 80  # characters of a tensor name an error shows


@dataclass(frozen=True)
class HeaderTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class WeightsFile:
    """The validated header of one weights file: its tensors by name, in file order."""

    path: Path
    size: int
    tensors: dict[str, HeaderTensor]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def parameters(self) -> int:
        return sum(numel(t.shape) for t in self.tensors.values())


def show_name(name: str) -> str:
    """A tensor name for an error message: repr (so odd characters stay visible), bounded."""
    text = repr(name)
    return text if len(text) <= _NAME_SHOWN else text[: _NAME_SHOWN - 4] + "...'"


def read_weights_file(path: Path) -> WeightsFile:
    """Read and check the header of the safetensors file ``path``; raises :class:`ModelFolderError`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelFolderError(f"{path}: weights file is missing") from None
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot read the weights file ({type(exc).__name__})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelFolderError(f"{path}: weights file is not a regular file")
    size = info.st_size
    if size == 0:
        raise ModelFolderError(f"{path}: weights file is empty (0 bytes)")
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or 8 + length > size or length > MAX_HEADER_BYTES:
            raise ModelFolderError(f"{path}: not a safetensors file (header length {length}, file size {size})")
        head += f.read(length)
    try:
        raw = parse_json(head[8:], str(path))
        if not isinstance(raw, dict):
            raise ModelFolderError(f"{path}: not a safetensors file (the header is not a JSON object)")
        _check_raw_header(path, raw)
        parsed = parse_safetensors_header(head, size, str(path))
    except ModelFolderError:
        raise
    except ShardsafeError as exc:
        raise ModelFolderError(f"{path}: unreadable weights file: {exc}") from None
    tensors = {name: HeaderTensor(dtype, shape, begin, end) for name, (dtype, shape, begin, end) in parsed.items()}
    if not tensors:
        raise ModelFolderError(f"{path} {NO_TENSORS} (an empty state dict saved as safetensors, {size} bytes)")
    empty = [name for name, t in tensors.items() if numel(t.shape) == 0]
    if empty:
        raise ModelFolderError(
            f"{path}: {len(empty)} tensors are empty (e.g. {show_name(empty[0])}); this looks like weights saved by "
            "one rank "
            "without gathering the ZeRO-3/FSDP shards - refusing it"
        )
    _check_layout(path, 8 + length, size, tensors)
    return WeightsFile(path, size, tensors)


def _check_raw_header(path: Path, raw: dict[str, object]) -> None:
    """What the shared header parser lets through but safetensors refuses: a bad ``__metadata__``, non-UTF-8 names."""
    metadata = raw.get(METADATA_KEY)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        what = "a tensor" if isinstance(metadata, dict) and "data_offsets" in metadata else "not a map of strings"
        raise ModelFolderError(f"{path}: its {METADATA_KEY} entry is {what}; safetensors cannot open such a file")
    for name in [*raw, *(metadata if isinstance(metadata, dict) else ())]:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ModelFolderError(
                f"{path}: the header name {show_name(name)} is not valid UTF-8 (a lone surrogate)"
            ) from None


def _check_layout(path: Path, data_start: int, size: int, tensors: dict[str, HeaderTensor]) -> None:
    """The tensors' byte ranges must tile [data_start, size) exactly, as safetensors requires."""
    position = data_start
    for name, t in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if t.begin < position:
            raise ModelFolderError(f"{path}: the data of tensor {show_name(name)} overlaps another tensor's")
        if t.begin > position:
            raise ModelFolderError(
                f"{path}: {t.begin - position} bytes before tensor {show_name(name)} belong to no tensor"
            )
        position = t.end
    if position != size:
        raise ModelFolderError(f"{path}: {size - position} bytes after the last tensor belong to no tensor")


def open_with_safetensors(path: Path) -> None:
    """Open ``path`` with ``safetensors.safe_open`` (header only, memory-mapped): what every loader will do first."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:
        # safetensors' message quotes the header; keep its first two clauses, which say what kind of problem it is
        reason = ":".join(str(exc).split(":")[:2]).strip() or type(exc).__name__
        raise ModelFolderError(f"{path}: safetensors cannot open it ({type(exc).__name__}: {reason[:120]})") from None
