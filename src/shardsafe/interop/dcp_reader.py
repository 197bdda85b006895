"""A DCP checkpoint folder as a :class:`~shardsafe.api.source.TensorSource`: whole tensors and plain values, read safely.

Each item is read by a positional read of exactly its ``length`` bytes (already checked to lie in its
file) and unpickled by the package's restricted loader (:func:`~shardsafe.interop.unpickler.load_bytes`):
a tensor chunk must come back as a tensor of the chunk's dtype and sizes; a non-tensor value
(``step`` ints, optimizer ``param_groups`` entries) as plain values only. A whole tensor is allocated
only after :mod:`~shardsafe.interop.dcp_metadata` checked its chunks cover it once, so what a read
allocates is bounded by the items' bytes on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.source import TensorInfo, find_config_files
from shardsafe.errors import FormatError
from shardsafe.interop.dcp_metadata import DcpItem, DcpMetadata, read_metadata
from shardsafe.interop.unpickler import load_bytes
from shardsafe.storage.local import safe_child


class DcpCheckpoint:
    """A DCP checkpoint folder: tensors under ``key`` (``model``) for export, and every tensor and value for conversion."""

    default_dtype: torch.dtype | None = None
    aliases_recorded = True  # a DCP state dict holds tied weights once per name; export writes them as saved
    total_parameters: int | None = None

    def __init__(self, path: str | os.PathLike[str], key: str = "model") -> None:
        self.folder = self.model_folder = Path(path).absolute()
        self.meta: DcpMetadata = read_metadata(self.folder)
        self.key = key
        self._names: dict[str, str] = {}
        for fqn in self.meta.tensors:
            name = self._export_name(fqn)
            if name is not None:
                self._names[name] = fqn
        if not self._names and key:
            keys = sorted({str(p[0]) for p in self.meta.paths.values()})
            raise FormatError(f"{self.folder}: no tensors under {key!r} (the DCP checkpoint holds {keys}); pick one with key=/--key")
        self.aliases: dict[str, str] = {}

    def _export_name(self, fqn: str) -> str | None:
        path = self.meta.paths.get(fqn, (fqn,))
        if not self.key:
            return fqn
        if path[0] == self.key and len(path) > 1:
            return ".".join(str(p) for p in path[1:])
        return None

    def tie(self, aliases: dict[str, str]) -> None:
        """Tied weights are saved under each name by DCP; nothing to leave out."""

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(name, self.meta.tensors[fqn].dtype, self.meta.tensors[fqn].shape) for name, fqn in self._names.items()]

    def read(self, name: str) -> torch.Tensor:
        return self.read_fqn(self._names[name])

    def read_fqn(self, fqn: str) -> torch.Tensor:
        """The whole tensor saved under the flattened key ``fqn``, assembled from its chunks."""
        entry = self.meta.tensors[fqn]
        out = torch.zeros(entry.shape, dtype=entry.dtype)
        for chunk in entry.chunks:
            where = f"{self.folder / chunk.item.file} (tensor {fqn[:120]!r} at {list(chunk.offsets)})"
            value = load_bytes(self._item_bytes(chunk.item), where)
            if not isinstance(value, torch.Tensor) or value.dtype != entry.dtype or tuple(value.shape) != chunk.sizes:
                got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise FormatError(f"{where}: holds {got}, the metadata says {entry.dtype} {list(chunk.sizes)}")
            view = out
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, offset, size)
            view.copy_(value)
        return out

    def value(self, fqn: str) -> Any:
        """The non-tensor value saved under ``fqn`` (a ``torch.save`` pickle of plain values and tensors)."""
        item = self.meta.values[fqn]
        return load_bytes(self._item_bytes(item), f"{self.folder / item.file} (value {fqn[:120]!r})")

    def _item_bytes(self, item: DcpItem) -> bytearray:
        path = safe_child(self.folder, item.file)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if os.fstat(fd).st_size != self.meta.file_sizes[item.file]:
                raise FormatError(f"{path}: changed size since the metadata was read")
            buffer = bytearray(item.length)
            view = memoryview(buffer)
            done = 0
            while done < item.length:
                n = os.preadv(fd, [view[done:]], item.offset + done)
                if n <= 0:
                    raise FormatError(f"{path}: ends before byte {item.offset + item.length}")
                done += n
            return buffer
        finally:
            os.close(fd)

    def config_files(self) -> dict[str, Path]:
        return find_config_files(self.folder)

    def describe(self) -> dict[str, Any]:
        """What the folder holds, for ``shardsafe inspect``."""
        return {
            "folder": str(self.folder),
            "format": "torch.distributed.checkpoint",
            "version": self.meta.version,
            "files": dict(sorted(self.meta.file_sizes.items())),
            "tensors": {fqn: (str(t.dtype).removeprefix("torch."), list(t.shape), len(t.chunks)) for fqn, t in self.meta.tensors.items()},
            "values": sorted(self.meta.values),
        }

    def close(self) -> None:
        pass

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_dcp(info: dict[str, Any]) -> str:
    """``shardsafe inspect``'s text for a DCP folder (:meth:`DcpCheckpoint.describe`)."""
    lines = [
        f"{info['folder']}: torch.distributed.checkpoint (DCP {info['version']}), {len(info['files'])} data files, "
        f"{sum(info['files'].values())} bytes"
    ]
    for fqn, (dtype, shape, chunks) in info["tensors"].items():
        lines.append(f"  {fqn!r:60} {dtype:10} {shape}  {chunks} chunk{'s' if chunks != 1 else ''}")
    lines.extend(f"  {fqn!r:60} value" for fqn in info["values"])
    return "\n".join(lines)
