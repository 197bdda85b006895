"""``shardsafe.load(dcp_folder, state)``: a DCP checkpoint loaded in place (resharded, any world size), with no copy on disk.

Registered with :mod:`shardsafe.api.foreign` when the package is imported. The folder's checked
``.metadata`` (:mod:`~shardsafe.interop.dcp_metadata`) is described as a shardsafe manifest and
state tree, the same ones ``shardsafe convert`` would write (:func:`~shardsafe.interop.dcp_convert.dcp_state_tree`),
and :func:`shardsafe.api.load.load_from` runs every phase of an ordinary load over them, so the
checks, the agreement of the ranks, the atomicity and the resharding are the ones of any shardsafe
load. Only the bytes come from elsewhere: :class:`DcpChunkReader` reads each ``.distcp`` item in
place.

A DCP tensor item is a ``torch.save`` archive of one contiguous chunk; its tensor's bytes are one
stored zip record. A rank that owns part of a chunk reads the item's zip directory and pickle
(small, restricted: :func:`~shardsafe.interop.unpickler.locate_tensor`), which must describe a
tensor of the metadata's dtype and sizes inside its record, and then ``preadv``s exactly the byte
ranges it owns straight into its tensors. With ``verify``, every record it reads from is also
checked whole against the CRC-32 the archive records (DCP writes no other hash), in the check pass
of an atomic load, so a damaged item is found before anything is written.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.foreign import ForeignFormat, register_format
from shardsafe.api.load import load_from
from shardsafe.core.format import ChunkEntry, FileEntry, Manifest, TensorEntry, element_size
from shardsafe.core.plan import ReadOp
from shardsafe.core.values import check_state_tree
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.interop.dcp_convert import dcp_state_tree
from shardsafe.interop.dcp_metadata import METADATA_NAME, DcpMetadata, is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint
from shardsafe.interop.unpickler import TensorAt, locate_tensor
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage.local import FileWindow

CRC_PIECE = 8 << 20  # the scratch buffer a record's CRC-32 is computed through


def dcp_manifest(meta: DcpMetadata, keys: dict[str, str]) -> Manifest:
    """The manifest of a DCP folder: each tensor under its shardsafe key, each chunk at its item's
    bytes in its ``.distcp`` file (no hashes: DCP records none), each file with the size it had."""
    tensors = {}
    for fqn, tensor in meta.tensors.items():
        chunks = tuple(ChunkEntry(c.offsets, c.sizes, c.item.file, c.item.offset, c.item.offset + c.item.length, ()) for c in tensor.chunks)
        tensors[keys[fqn]] = TensorEntry(tensor.dtype, tensor.shape, chunks)
    files = {name: FileEntry(size, 0) for name, size in meta.file_sizes.items()}
    info = {"format": "torch.distributed.checkpoint", "version": meta.version, "folder": str(meta.folder)}
    return Manifest(world_size=1, tensors=tensors, files=files, state_size=0, state_hash="", metadata={"converted_from": info})


class DcpChunkReader(ChunkReader):
    """:class:`ChunkReader`'s reads over a DCP folder: a chunk is a ``.distcp`` item, located before any byte of it is used.

    Overrides only where the bytes of a chunk are (:meth:`open`: the file sized as the metadata
    found it, the item's archive located and checked against the chunk) and how a read is checked
    (a CRC-32 per record instead of block hashes); the read planning and the direct or staged
    copies into the destinations are the base class's.
    """

    def __init__(self, folder: Path, manifest: Manifest, verify: bool = True) -> None:
        super().__init__(folder, manifest, verify)
        self._dtypes = {(c.file, c.begin): (key, entry.dtype) for key, entry in manifest.tensors.items() for c in entry.chunks}
        self._located: dict[tuple[str, int], TensorAt] = {}
        self._crc_checked: set[tuple[str, int]] = set()

    def open(self, chunk: ChunkEntry) -> Any:
        """The open file of ``chunk`` (sized as the metadata found it), its item located and checked."""
        self._locate(chunk)
        return self.source.open(None, chunk.file)[0]

    def _locate(self, chunk: ChunkEntry) -> TensorAt:
        ident = (chunk.file, chunk.begin)
        found = self._located.get(ident)
        if found is not None:
            return found
        fd, size = self.source.open(None, chunk.file)
        path = self.source.describe(None, chunk.file)
        if size != self.manifest.files[chunk.file].size:
            raise IntegrityError(f"{path}: {size} bytes, {self.manifest.files[chunk.file].size} when the metadata was read (changed or truncated)")
        key, dtype = self._dtypes[ident]
        where = f"{path} (tensor {key!r:.200} at {list(chunk.offsets)}, bytes {chunk.begin}..{chunk.end})"
        found = locate_tensor(FileWindow(fd, chunk.begin, chunk.end - chunk.begin), chunk.end - chunk.begin, where)
        if found.dtype != dtype or found.shape != chunk.shape:
            raise FormatError(f"{where}: holds {found.dtype} {list(found.shape)}, the metadata says {dtype} {list(chunk.shape)}")
        self._located[ident] = found
        return found

    def _check_crc(self, chunk: ChunkEntry, found: TensorAt) -> None:
        """The record holding ``chunk``'s tensor, read whole through a bounded scratch buffer, against its CRC-32 (once per reader)."""
        ident = (chunk.file, chunk.begin)
        if ident in self._crc_checked:
            return
        start, length, expected = found.record
        path = self.source.describe(None, chunk.file)
        scratch = memoryview(bytearray(min(length, CRC_PIECE)))
        crc, done = 0, 0
        while done < length:
            piece = scratch[: min(len(scratch), length - done)]
            self.source.read_into(self.open(chunk), [piece], chunk.begin + start + done, path)
            crc = zlib.crc32(piece, crc)
            done += len(piece)
        if crc != expected:
            key = self._dtypes[ident][0]
            raise IntegrityError(
                f"{path}: the item of tensor {key!r:.200} at {list(chunk.offsets)} (bytes {chunk.begin}..{chunk.end}) fails its CRC-32 check: "
                "the file is corrupted"
            )
        self._crc_checked.add(ident)

    def check_read(self, key: str, op: ReadOp, saved_dtype: torch.dtype) -> None:
        """What :meth:`read_into` will read for ``op``, checked, nothing written: the item located and, with ``verify``, its record's CRC-32."""
        found = self._locate(op.chunk)
        if self.verify:
            self._check_crc(op.chunk, found)

    def read_elements(self, key: str, chunk: ChunkEntry, dtype: torch.dtype, start: int, stop: int, dest: memoryview) -> None:
        """Elements [start, stop) of ``chunk``'s tensor, one positional read into ``dest`` (the record's CRC-32 first, with ``verify``)."""
        found = self._locate(chunk)
        if self.verify:
            self._check_crc(chunk, found)
        es = element_size(dtype)
        if stop * es <= start * es:
            return
        where = f"{self.source.describe(None, chunk.file)} (tensor {key!r:.200} at {list(chunk.offsets)})"
        self.source.read_into(self.open(chunk), [dest], chunk.begin + found.start + start * es, where)


def load_dcp(
    folder: Path, state: dict[str, Any], *, process_group: Any = None, strict: bool = True, verify: bool = True, atomic: bool = True
) -> dict[str, Any]:
    """Load the DCP folder into ``state`` like :func:`shardsafe.load` (collective), reading its items in place."""

    def opened() -> tuple[Manifest, dict[str, Any]]:
        with DcpCheckpoint(folder, key="") as ckpt:
            keys, tree = dcp_state_tree(ckpt)
            manifest = dcp_manifest(ckpt.meta, keys)
        check_state_tree(tree, f"{folder / METADATA_NAME}", manifest)
        return manifest, tree

    return load_from(state, opened, lambda manifest: DcpChunkReader(Path(folder), manifest, verify), process_group, strict, verify, atomic)


register_format(
    ForeignFormat(
        "torch.distributed.checkpoint (DCP)",
        is_dcp_folder,
        "DCP records no hashes to verify: `shardsafe inspect` checks its metadata, `shardsafe convert SRC OUT` reads every item",
        load_dcp,
    )
)
