"""Moving tensor bytes: one rank's shard file out, verified byte ranges back in.

Writes stream each chunk straight from its tensor to the file (header computed up front) and
hash it on the way. Reads use positional reads straight into the destination tensor's memory;
to verify a partial read they also read the rest of the first and last hash block into small
scratch buffers, so no read ever needs more than two blocks of extra memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .errors import FormatError, IntegrityError
from .format import SHARD_PATTERN, ChunkEntry, HeaderEntry, Manifest, build_safetensors_header, element_size, numel
from .integrity import BlockHasher, hash_blocks
from .plan import LocalChunk, ReadOp, contiguous_span
from .storage import pread_into, safe_child, tensor_bytes, tensor_pieces, write_tensor_file


def chunk_name(chunk: LocalChunk) -> str:
    """Name of a chunk inside its safetensors file: the key, plus its offsets when sharded."""
    if any(chunk.offsets):
        return f"{chunk.key}@{','.join(map(str, chunk.offsets))}"
    return chunk.key


ReuseMap = dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, ChunkEntry]]


def write_rank_file(
    folder: Path, rank: int, chunks: list[LocalChunk], block_size: int, fsync: bool = True, reuse: ReuseMap | None = None
) -> tuple[str | None, int, list[tuple[LocalChunk, ChunkEntry]]]:
    """Write this rank's chunks into its own shard file; returns (file name, size, entries).

    With ``reuse`` (the chunks of an earlier checkpoint in the same root, each pointing at the
    checkpoint that holds its bytes), a chunk whose bytes hash the same as its earlier self is
    referenced instead of written. The file name is None when nothing had to be written.
    """
    entries: list[tuple[LocalChunk, ChunkEntry]] = []
    to_write = []
    for chunk in chunks:
        earlier = reuse.get((chunk.key, chunk.offsets)) if reuse else None
        if earlier is not None and earlier[0] == chunk.tensor.dtype and earlier[1].shape == chunk.shape:
            digests = hash_blocks(tensor_pieces(chunk.tensor), block_size)
            if tuple(digests) == earlier[1].hashes:
                entries.append((chunk, earlier[1]))
                continue
        to_write.append(chunk)
    if not to_write:
        return None, 0, entries
    name = SHARD_PATTERN.format(rank=rank)
    header = [HeaderEntry(chunk_name(c), c.tensor.dtype, c.shape) for c in to_write]
    prefix, ranges = build_safetensors_header(header)
    size, digests_list = write_tensor_file(folder / name, prefix, [c.tensor for c in to_write], block_size, fsync, rank)
    entries += [(c, ChunkEntry(c.offsets, c.shape, name, begin, end, tuple(d))) for c, (begin, end), d in zip(to_write, ranges, digests_list)]
    return name, size, entries


def reuse_map(manifest: Manifest, checkpoint_name: str) -> ReuseMap:
    """Chunks of a committed checkpoint, each resolved to the checkpoint that stores its bytes."""
    out: ReuseMap = {}
    for key, entry in manifest.tensors.items():
        for chunk in entry.chunks:
            origin = chunk if chunk.checkpoint is not None else replace(chunk, checkpoint=checkpoint_name)
            out[(key, chunk.offsets)] = (entry.dtype, origin)
    return out


class ChunkReader:
    """Positional, verified reads from a committed checkpoint's files."""

    def __init__(self, folder: Path, manifest: Manifest, verify: bool = True) -> None:
        self.folder = folder
        self.manifest = manifest
        self.verify = verify
        self.block = manifest.hash_block_size
        self._fds: dict[tuple[str | None, str], int] = {}

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def path_of(self, chunk: ChunkEntry) -> Path:
        if chunk.checkpoint is None:
            return safe_child(self.folder, chunk.file)
        sibling = safe_child(self.folder.parent, chunk.checkpoint)
        return safe_child(sibling, chunk.file)

    def open(self, chunk: ChunkEntry) -> int:
        """Open (once) the file holding ``chunk``, checking it is as large as the manifest says."""
        ident = (chunk.checkpoint, chunk.file)
        fd = self._fds.get(ident)
        if fd is None:
            path = self.path_of(chunk)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:
                raise IntegrityError(f"{path}: shard file is missing") from None
            except OSError as exc:
                raise IntegrityError(f"{path}: cannot open shard file ({exc.strerror})") from None
            size = os.fstat(fd).st_size
            expected = self.manifest.files[chunk.file].size if chunk.checkpoint is None else None
            if (expected is not None and size != expected) or size < chunk.end:
                os.close(fd)
                raise IntegrityError(
                    f"{path}: file is {size} bytes, the manifest expects {expected if expected is not None else chunk.end} (truncated or altered)"
                )
            self._fds[ident] = fd
        return fd

    def read_elements(self, key: str, chunk: ChunkEntry, dtype: torch.dtype, start: int, stop: int, dest: memoryview) -> None:
        """Read elements [start, stop) of ``chunk`` into ``dest``, verifying the blocks touched."""
        es = element_size(dtype)
        lo, hi = start * es, stop * es
        if hi <= lo:
            return
        fd = self.open(chunk)
        where = f"{self.path_of(chunk)} (tensor {key!r}, chunk at {list(chunk.offsets)})"
        if not self.verify:
            pread_into(fd, [dest], chunk.begin + lo, where)
            return
        chunk_bytes = chunk.end - chunk.begin
        block_lo = lo // self.block * self.block
        block_hi = min(-(-hi // self.block) * self.block, chunk_bytes)
        head = memoryview(bytearray(lo - block_lo))
        tail = memoryview(bytearray(block_hi - hi))
        pread_into(fd, [head, dest, tail], chunk.begin + block_lo, where)
        hasher = BlockHasher(self.block)
        for piece in (head, dest, tail):
            hasher.update(piece)
        got = hasher.finish()
        first = block_lo // self.block
        expected = chunk.hashes[first : first + len(got)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise IntegrityError(
                    f"{where}: hash mismatch in block {first + i} (bytes {chunk.begin + (first + i) * self.block}..): "
                    "the file is corrupted; restore it or load an earlier checkpoint"
                )

    def read_into(self, key: str, op: ReadOp, saved_dtype: torch.dtype, dest: torch.Tensor, dest_offsets: tuple[int, ...]) -> None:
        """Copy the box of ``op`` into ``dest`` (which holds the box at ``dest_offsets``)."""
        chunk = op.chunk
        src = contiguous_span(op.offsets, op.shape, chunk.offsets, chunk.shape)
        dst = contiguous_span(op.offsets, op.shape, dest_offsets, tuple(dest.shape))
        direct = src is not None and dst is not None and dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == saved_dtype
        if direct:
            assert src is not None and dst is not None
            es = element_size(saved_dtype)
            view = tensor_bytes(dest)[dst[0] * es : dst[1] * es]
            self.read_elements(key, chunk, saved_dtype, src[0], src[1], view)
            return
        # Staged path: read the dim-0 slab of the chunk covering the box, then copy the box.
        if not chunk.shape:
            raise FormatError(f"tensor {key!r}: scalar chunk cannot be partially read")
        row0 = op.offsets[0] - chunk.offsets[0]
        rows = op.shape[0]
        row_elems = numel(chunk.shape[1:])
        slab = torch.empty((rows, *chunk.shape[1:]), dtype=saved_dtype)
        self.read_elements(key, chunk, saved_dtype, row0 * row_elems, (row0 + rows) * row_elems, tensor_bytes(slab))
        box = slab
        for d in range(1, len(op.shape)):
            box = box.narrow(d, op.offsets[d] - chunk.offsets[d], op.shape[d])
        target = dest
        for d in range(len(op.shape)):
            target = target.narrow(d, op.offsets[d] - dest_offsets[d], op.shape[d])
        with torch.no_grad():
            target.copy_(box)


@dataclass
class ReadTarget:
    """Where a tensor's box for this rank goes."""

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
