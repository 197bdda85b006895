"""Per-block content hashes.

Each chunk is hashed in fixed-size blocks (``HASH_BLOCK_SIZE``) with xxh3-64, so that a rank
that reads only part of a chunk (resharding) can still verify what it read by reading at most
one extra partial block at each end, and never has to read a whole chunk to check a slice.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

__all__ = ["BlockHasher", "HASH_ALGORITHM", "HASH_BLOCK_SIZE", "hash_blocks", "hash_bytes", "num_blocks"]

HASH_ALGORITHM = "xxh3_64"
HASH_BLOCK_SIZE = 16 * 1024 * 1024


def num_blocks(nbytes: int, block_size: int = HASH_BLOCK_SIZE) -> int:
    """Number of hash blocks a chunk of ``nbytes`` has (an empty chunk still has one)."""
    return max(1, -(-nbytes // block_size))


class BlockHasher:
    """Hashes a byte stream fed in arbitrary pieces into per-block digests."""

    def __init__(self, block_size: int = HASH_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._current = xxhash.xxh3_64()
        self._filled = 0
        self.digests: list[str] = []

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block_size:
                self.digests.append(self._current.hexdigest())
                self._current = xxhash.xxh3_64()
                self._filled = 0

    def finish(self) -> list[str]:
        """Close the last partial block and return all digests."""
        if self._filled or not self.digests:
            self.digests.append(self._current.hexdigest())
            self._current = xxhash.xxh3_64()
            self._filled = 0
        return self.digests


def hash_blocks(pieces: Iterable[memoryview | bytes], block_size: int = HASH_BLOCK_SIZE) -> list[str]:
    """Digests of the concatenation of ``pieces``, one per block."""
    hasher = BlockHasher(block_size)
    for piece in pieces:
        hasher.update(piece)
    return hasher.finish()


def hash_bytes(data: bytes) -> str:
    """Digest of a small whole file (state JSON)."""
    return xxhash.xxh3_64(data).hexdigest()
