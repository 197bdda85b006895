"""The GPU path's host-side logic, on a machine without a GPU: the pinned pool, piece splitting, and the
double-buffered transfers run with a CPU "device" (synchronous copies, no streams).

What only a GPU can check (pinned memory, streams, events, the whole save/load on CUDA) is in
``test_cuda_path.py``, which skips without one. Here an unpinned pool (``pin=False``) stands in for
the pinned one: the same class, the same bound and reuse; the checkpoints read are real ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.core.format import MANIFEST_NAME, parse_manifest
from shardsafe.errors import IntegrityError
from shardsafe.protocol.device_read import read_into_cuda
from shardsafe.protocol.transfer import ChunkReader
from shardsafe.storage import pinned
from shardsafe.storage.device_copy import device_pieces
from shardsafe.storage.local import tensor_bytes
from shardsafe.storage.pinned import PinnedPool, split_range

# ----------------------------------------------------------------------------- the pool


def test_pool_reuses_its_buffers_and_never_exceeds_its_bound() -> None:
    pool = PinnedPool(4096, 2, pin=False)
    assert pool.stats().allocated == 0, "nothing is allocated before the first lease"
    with pool.lease(2) as first:
        assert len(first) == 2 and all(b.numel() == 4096 and b.dtype == torch.uint8 for b in first)
        ptrs = {b.data_ptr() for b in first}
    for _ in range(5):
        with pool.lease(2) as again:
            assert {b.data_ptr() for b in again} == ptrs, "the same buffers come back, none is allocated again"
    stats = pool.stats()
    assert (stats.allocated, stats.in_use, stats.leases, stats.overflows) == (2, 0, 6, 0)
    assert stats.allocated_bytes == 2 * 4096


def test_pool_lends_what_is_free_and_an_unpinned_temporary_when_nothing_is() -> None:
    pool = PinnedPool(128, 2, pin=False)
    with pool.lease(2) as held:
        with pool.lease(2) as nothing_free:
            assert len(nothing_free) == 1 and nothing_free[0].data_ptr() not in {b.data_ptr() for b in held}
            assert not nothing_free[0].is_pinned()
        assert pool.stats().overflows == 1
    with pool.lease(1) as one:
        with pool.lease(2) as rest:
            assert len(one) == 1 and len(rest) == 1, "the second lease gets the one buffer left"
    assert pool.stats().allocated == 2 and pool.stats().in_use == 0


def test_pool_buffers_go_back_when_the_user_fails() -> None:
    pool = PinnedPool(128, 2, pin=False)
    with pytest.raises(RuntimeError, match="boom"), pool.lease(2):
        raise RuntimeError("boom")
    assert pool.stats().in_use == 0
    with pytest.raises(ValueError, match="did not come from it"):
        pool.give_back([torch.empty(64, dtype=torch.uint8)])


@pytest.mark.parametrize(
    ("size", "count", "what"), [(100, 2, "multiple of 64"), (0, 2, "multiple of 64"), (4096, 0, "positive integer")]
)
def test_pool_refuses_a_bad_configuration(size: int, count: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        PinnedPool(size, count, pin=False)
    with pytest.raises(ValueError, match=what):
        pinned.configure(size, count)


def test_configure_replaces_the_process_pool_lazily() -> None:
    try:
        pinned.configure(1 << 20, 3)
        pool = pinned.pinned_pool()
        assert (pool.buffer_bytes, pool.limit, pool.stats().allocated) == (1 << 20, 3, 0), (
            "configured, nothing pinned yet"
        )
        assert pinned.pinned_pool() is pool
    finally:
        pinned.configure()
    assert pinned.pinned_pool().buffer_bytes == pinned.DEFAULT_BUFFER_BYTES


# ----------------------------------------------------------------------------- piece splitting


@pytest.mark.parametrize(
    ("lo", "hi", "piece", "align"),
    [(0, 10, 3, 1), (5, 100, 16, 4), (7, 7, 4, 1), (3, 1000, 64, 16), (0, 50, 8, 32), (13, 200, 50, 7)],
)
def test_split_range_covers_the_range_in_bounded_aligned_pieces(lo: int, hi: int, piece: int, align: int) -> None:
    parts = split_range(lo, hi, piece, align)
    assert [x for a, b in parts for x in range(a, b)] == list(range(lo, hi)), "consecutive, exact cover"
    assert all(0 < b - a <= piece for a, b in parts)
    if piece >= align:
        assert all(b % align == 0 for _, b in parts[:-1]), "inner boundaries on multiples of align"
    assert len(parts) <= -(-(hi - lo) // max(1, piece // align * align if piece >= align else piece)) + 1


def test_split_range_refuses_an_empty_piece() -> None:
    with pytest.raises(ValueError, match="piece size must be positive"):
        split_range(0, 10, 0)


# ----------------------------------------------------------------------------- double-buffered device -> host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_device_pieces_streams_every_byte_in_order(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tensor = (torch.randn(1000, 37) * 100).to(dtype)
    pool = PinnedPool(1024, 2, pin=False)
    pieces = [bytes(p) for p in device_pieces(tensor, pool)]
    assert b"".join(pieces) == bytes(tensor_bytes(tensor))
    assert len(pieces) == -(-tensor.numel() * tensor.element_size() // 1024) and all(len(p) <= 1024 for p in pieces)
    strided = tensor.t()  # not contiguous: its row-major bytes, as tensor_pieces gives them
    assert b"".join(bytes(p) for p in device_pieces(strided, pool)) == bytes(tensor_bytes(strided.contiguous()))
    assert pool.stats().allocated == 2 and pool.stats().in_use == 0


def test_device_pieces_abandoned_early_gives_its_buffers_back() -> None:
    pool = PinnedPool(256, 2, pin=False)
    stream = device_pieces(torch.arange(1000, dtype=torch.int32), pool)
    next(stream)
    assert pool.stats().in_use == 2
    stream.close()
    assert pool.stats().in_use == 0
    assert list(device_pieces(torch.empty(0), pool)) == [], "an empty tensor has no piece"


# ----------------------------------------------------------------------------- verified host -> device reads


def _saved(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, object]:
    path = tmp_path / "ckpt"
    shardsafe.save(path, dict(tensors))
    return path, parse_manifest((path / MANIFEST_NAME).read_bytes())


def _read_box(
    path: Path,
    manifest: object,
    key: str,
    offsets: tuple[int, ...],
    dest: torch.Tensor,
    dest_offsets: tuple[int, ...],
    pool: PinnedPool,
) -> None:
    with ChunkReader(path, manifest) as reader:  # type: ignore[arg-type]
        entry = reader.manifest.tensors[key]
        for op in reader.plan(key, entry, offsets, tuple(dest.shape)):
            read_into_cuda(reader, key, op, entry.dtype, dest, dest_offsets, pool)


BOXES = [
    ((0, 0), (1000, 7), "whole tensor: one contiguous span, many pieces"),
    ((3, 0), (990, 7), "full rows: a contiguous span at an offset"),
    ((0, 2), (1000, 3), "inner columns: groups of rows, narrowed"),
    ((17, 1), (5, 6), "a small inner box"),
]


@pytest.mark.parametrize(("offsets", "shape", "what"), BOXES, ids=[b[2] for b in BOXES])
@pytest.mark.parametrize("dest_dtype", [torch.float32, torch.bfloat16])
def test_read_into_device_fills_any_box_exactly(
    tmp_path: Path, offsets: tuple[int, int], shape: tuple[int, int], what: str, dest_dtype: torch.dtype
) -> None:
    torch.manual_seed(1)
    full = torch.randn(1000, 7)
    path, manifest = _saved(tmp_path, {"w": full})
    pool = PinnedPool(512, 2, pin=False)  # 512 bytes: 18 rows a piece, so every box takes several pieces
    dest = torch.zeros(shape, dtype=dest_dtype)
    _read_box(path, manifest, "w", offsets, dest, offsets, pool)
    expected = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]].to(dest_dtype)
    assert torch.equal(dest, expected), what
    assert pool.stats().in_use == 0 and pool.stats().allocated == 2


def test_read_into_device_at_an_offset_in_a_larger_destination_and_rows_larger_than_a_buffer(tmp_path: Path) -> None:
    torch.manual_seed(2)
    wide = torch.randn(4, 300)  # 1200-byte rows, more than a 512-byte buffer: each goes through a temporary
    scalar = torch.tensor(3.5)
    path, manifest = _saved(tmp_path, {"wide": wide, "s": scalar})
    pool = PinnedPool(512, 2, pin=False)
    dest = torch.zeros(4, 300)
    with ChunkReader(path, manifest) as reader:  # type: ignore[arg-type]
        entry = reader.manifest.tensors["wide"]
        for op in reader.plan("wide", entry, (1, 10), (2, 200)):  # into rows 1..2, columns 10..209 of dest
            read_into_cuda(reader, "wide", op, entry.dtype, dest, (0, 0), pool)
        got_scalar = torch.zeros(())
        for op in reader.plan("s", reader.manifest.tensors["s"], (), ()):
            read_into_cuda(reader, "s", op, torch.float32, got_scalar, (), pool)
    expected = torch.zeros(4, 300)
    expected[1:3, 10:210] = wide[1:3, 10:210]
    assert torch.equal(dest, expected)
    assert got_scalar.item() == 3.5


def test_read_into_device_verifies_before_copying(tmp_path: Path) -> None:
    full = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    path, manifest = _saved(tmp_path, {"w": full})
    shard = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    with open(shard, "r+b") as f:  # damage the last byte of the tensor's data: its (only) hash block fails
        f.seek(os.path.getsize(shard) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0xFF]))
    dest = torch.full((1000, 4), -1.0)
    with pytest.raises(IntegrityError, match="hash mismatch"):
        _read_box(path, manifest, "w", (0, 0), dest, (0, 0), PinnedPool(512, 2, pin=False))
    assert torch.equal(dest, torch.full((1000, 4), -1.0)), (
        "no byte of a piece that fails its hash is copied to the destination"
    )
