"""Writing one rank's shard file: its chunks streamed out, hashed on the way, or referenced.

Writes stream each chunk straight from its tensor to the file (header computed up front) and
hash it on the way. With dedup, a chunk whose bytes hash the same as in an earlier committed
checkpoint of the same root is referenced instead of written (:class:`ReuseMap`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from shardsafe.core.format import ChunkEntry, HeaderEntry, Manifest, build_safetensors_header
from shardsafe.core.integrity import hash_blocks
from shardsafe.core.plan import LocalChunk
from shardsafe.errors import FormatError, IntegrityError
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage.local import tensor_pieces
from shardsafe.storage.remote import RemoteDir

__all__ = ["RankFile", "ReuseMap", "chunk_name", "is_plain", "plain_file_name", "reuse_map", "write_rank_file"]


def chunk_name(chunk: LocalChunk, plain_prefix: str | None = None) -> str:
    """Name of a chunk inside its safetensors file: the key, plus its offsets when sharded.

    A whole tensor whose key starts with ``plain_prefix`` is named by the rest of its key (a
    model's own parameter names, so a ``model.safetensors.index.json`` can point into the shard
    files): a load finds chunks by their byte ranges, never by these names.
    """
    if plain_prefix and is_plain(chunk, plain_prefix):
        return chunk.key[len(plain_prefix) :]
    if any(chunk.offsets):
        return f"{chunk.key}@{','.join(map(str, chunk.offsets))}"
    return chunk.key


def is_plain(chunk: LocalChunk, plain_prefix: str) -> bool:
    """A whole tensor under ``plain_prefix``: :func:`chunk_name` gives it the rest of its key as its name."""
    return chunk.key.startswith(plain_prefix) and chunk.shape == chunk.global_shape


def plain_file_name(shard_name: str) -> str:
    """The name of a rank's file of plainly named whole tensors, from its shard file's (``model-00003.safetensors``
    next to ``shard-00003.safetensors``): only those tensors, so a model loader reading it sees nothing else."""
    return "model-" + shard_name.removeprefix("shard-")


ReuseChunks = dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, ChunkEntry]]  # (key, offsets) -> earlier chunk


class ShardSink(Protocol):
    """Where one save's shard files go (a local temporary folder, or an object-store prefix)."""

    def shard_name(self, rank: int) -> str: ...

    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]: ...

    def write_index(self, rank: int, data: bytes) -> str: ...


@dataclass(frozen=True)
class RankFile:
    """What :func:`write_rank_file` wrote: the shard file (None when nothing had to be written),
    its size, and where each chunk lies (in that file, or in the earlier checkpoint it reuses)."""

    name: str | None
    size: int
    entries: list[tuple[LocalChunk, ChunkEntry]]


def write_rank_file(
    sink: ShardSink,
    rank: int,
    chunks: list[LocalChunk],
    block_size: int,
    reuse: ReuseChunks | None = None,
    plain_prefix: str | None = None,
    name: str | None = None,
) -> RankFile:
    """Write this rank's chunks into its own shard file (header names: :func:`chunk_name`).

    With ``reuse`` (the chunks of an earlier checkpoint in the same root, each pointing at the
    checkpoint that holds its bytes), a chunk whose bytes hash the same as its earlier self is
    referenced instead of written.
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
        return RankFile(None, 0, entries)
    name = name or sink.shard_name(rank)
    header = [HeaderEntry(chunk_name(c, plain_prefix), c.tensor.dtype, c.shape) for c in to_write]
    prefix, ranges = build_safetensors_header(header)
    size, digests_list = sink.write_shard(name, prefix, [c.tensor for c in to_write], block_size, rank)
    entries += [
        (c, ChunkEntry(c.offsets, c.shape, name, begin, end, tuple(d)))
        for c, (begin, end), d in zip(to_write, ranges, digests_list)
    ]
    return RankFile(name, size, entries)


@dataclass(frozen=True)
class ReuseMap:
    """The chunks of an earlier committed checkpoint of the same root, for dedup: each a save can
    point at instead of writing it again. Listed chunks come from its manifest; the parts of its
    split tensors from the index of this rank (part p of a rule is written by rank p, so a rank
    needs only its own index, never all W)."""

    manifest: Manifest
    checkpoint: str

    def for_rank(self, folder: Path | RemoteDir, rank: int) -> ReuseChunks:
        """(key, offsets) -> (dtype, chunk, pointing at the checkpoint holding its bytes), for ``rank``;
        ``folder`` is the earlier checkpoint. An unreadable index only means those parts are written again."""
        out: ReuseChunks = {}
        for key, entry in self.manifest.tensors.items():
            for chunk in entry.chunks:
                origin = chunk if chunk.checkpoint is not None else replace(chunk, checkpoint=self.checkpoint)
                out[(key, chunk.offsets)] = (entry.dtype, origin)
        if self.manifest.index_of_rank(rank) is None:
            return out
        try:
            with ChunkReader(folder, self.manifest) as reader:
                parts = reader.index(rank)
        except (FormatError, IntegrityError, OSError):
            return out
        for key, boxes in parts.items():
            for chunk in boxes.values():
                out[(key, chunk.offsets)] = (
                    self.manifest.tensors[key].dtype,
                    replace(chunk, checkpoint=self.checkpoint),
                )
        return out


def reuse_map(manifest: Manifest, checkpoint_name: str) -> ReuseMap:
    """The chunks of committed checkpoint ``checkpoint_name`` (its ``manifest``) a save may reuse."""
    return ReuseMap(manifest, checkpoint_name)
