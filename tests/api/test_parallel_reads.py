"""Reads that run a few hash blocks at a time, attacked from outside as a user would meet them.

``ChunkReader.run`` splits every read into per-hash-block reads and runs them on a small thread
pool (``core/parallel.TaskRunner``) in file order; an atomic load reads a fresh optimizer's state
straight into place in its checking pass. What must still hold, checked here with checkpoints
saved with 4 KiB hash blocks (so a few KB of tensors make dozens of blocks and a partial last one):

* one flipped byte in the first, a middle or the partial last block of a tensor, of a bf16 tensor,
  of a scalar: ``verify`` and ``load`` (atomic and not) raise IntegrityError naming the file, the
  tensor and that block, and an atomic load leaves every tensor bit-identical;
* two damaged blocks: the one reported is always the first in file order (20 runs each), as a
  serial loop would report, also from the thread pool on its own;
* no reading thread is left after a load, and 50 loads (failing and not) leak no file descriptor,
  also for a checkpoint whose chunks live in a sibling (dedup), which ``verify`` opens from the
  reading threads;
* a shard truncated between the two passes (by a ``load_state_dict`` that runs in between) is a
  clear IntegrityError, not a traceback or a hang;
* 2 -> 3 ranks (FSDP2, gloo): a damaged block that two ranks' reads share, in the model or in a
  fresh optimizer's state, makes every rank raise the same IntegrityError; the model is
  untouched and a fresh optimizer ends with empty state; ``strict=False`` dtype casts (the staged
  path) reshard exactly;
* ``read_all`` batches staged slabs: resharding many large tensors through the staged path keeps
  the peak memory near one batch, not the sum of the slabs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    seeded_step,
    shard,
)
from shardsafe.core.parallel import TaskRunner
from shardsafe.errors import FormatError, IntegrityError, ShardsafeError
from stored_chunks import stored_chunks, use_small_blocks

BLOCK = 4096


@pytest.fixture
def small_blocks() -> Iterator[None]:
    undo = use_small_blocks(BLOCK)
    yield
    undo()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(25_000, generator=g),  # 100000 bytes: 24 blocks + 1696 bytes
        "wide": torch.randn(7, 442, generator=g),  # 12376 bytes: 3 blocks + 88 bytes
        "bf16": torch.randn(5000, generator=g).to(torch.bfloat16),  # 10000 bytes: 2 blocks + 1808
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(7, dtype=torch.int64),
    }


class Holder(nn.Module):
    """The tensors as buffers: a module's tensors are read in place (a plain dict's are decoded whole)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def _sentinels() -> Holder:
    return Holder({k: torch.full_like(v, -1) for k, v in _tensors().items()})


def _bits(module: nn.Module) -> dict[str, bytes]:
    return {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in module.state_dict().items()}


@pytest.fixture
def saved(tmp_path: Path, small_blocks: None) -> Path:
    path = tmp_path / "root" / "ck"
    shardsafe.save(path, {"t": Holder(_tensors()), "note": "saved"})
    assert json.loads((path / "manifest.json").read_text())["hash_block_size"] == BLOCK
    return path


def _flip(path: Path, key: str, at: int, chunk: int = 0) -> tuple[str, int]:
    """Flip one byte ``at`` bytes into chunk ``chunk`` of ``key``; returns (file, absolute offset)."""
    c = stored_chunks(path, key)[chunk]
    assert at < c["end"] - c["begin"]
    target = path / c["file"]
    data = bytearray(target.read_bytes())
    data[c["begin"] + at] ^= 0x20
    target.write_bytes(bytes(data))
    return c["file"], c["begin"] + at


def _block_of(message: str) -> int:
    found = re.search(r"hash mismatch in block (\d+)", message)
    assert found, message
    return int(found.group(1))


DAMAGE = [  # (tensor, byte inside its chunk, block reported)
    ("big", 3, 0),
    ("big", 12 * BLOCK + 5, 12),
    ("big", 24 * BLOCK + 1695, 24),  # the last byte of the partial last block
    ("wide", 3 * BLOCK + 7, 3),
    ("bf16", BLOCK, 1),
    ("scalar", 2, 0),
    ("ints", 55, 0),
]


@pytest.mark.parametrize(("key", "at", "block"), DAMAGE, ids=[f"{k}-{a}" for k, a, _ in DAMAGE])
def test_one_damaged_block_is_named_and_changes_nothing(saved: Path, key: str, at: int, block: int) -> None:
    file, _ = _flip(saved, f"t/{key}", at)
    with pytest.raises(IntegrityError) as verified:
        shardsafe.verify(saved)
    messages = [str(verified.value)]
    for atomic in (True, False):
        state: dict[str, Any] = {"t": _sentinels(), "note": None}
        before = _bits(state["t"])
        with pytest.raises(IntegrityError) as loaded:
            shardsafe.load(saved, state, atomic=atomic)
        messages.append(str(loaded.value))
        if atomic:
            assert _bits(state["t"]) == before, "an atomic load that failed changed a tensor"
            assert state["note"] is None
    for message in messages:
        assert str(saved / file) in message and f"tensor 't/{key}'" in message, message
        assert _block_of(message) == block, message
        assert len(message) < 400, message  # names things, echoes no content
    assert messages[1] == messages[2], "atomic and non-atomic loads report different blocks"


def test_an_intact_checkpoint_loads_bit_identically(saved: Path) -> None:
    state: dict[str, Any] = {"t": _sentinels(), "note": None}
    shardsafe.load(saved, state)
    assert _bits(state["t"]) == _bits(Holder(_tensors())) and state["note"] == "saved"
    summary = shardsafe.verify(saved)
    assert summary["bytes_checked"] == sum(v.numel() * v.element_size() for v in _tensors().values())


def test_the_first_damaged_block_in_file_order_is_reported_every_time(saved: Path) -> None:
    damaged = [
        _flip(saved, "t/big", 20 * BLOCK + 9),
        _flip(saved, "t/big", 3 * BLOCK + 1),
        _flip(saved, "t/bf16", 2 * BLOCK),
    ]
    first = min(damaged, key=lambda d: d[1])
    expected_key = "t/big" if first == damaged[1] else "t/bf16"
    seen = set()
    for _ in range(20):
        for call in (
            lambda: shardsafe.verify(saved),
            lambda: shardsafe.load(saved, {"t": _sentinels(), "note": None}, atomic=False),
        ):
            with pytest.raises(IntegrityError) as err:
                call()
            seen.add(str(err.value))
    assert len(seen) == 1, seen
    assert f"tensor {expected_key!r}" in seen.pop()


def test_the_task_runner_reports_the_first_failure_in_order() -> None:
    """Every task fails: a thread that took task 0 must not skip it because a later one failed first."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race window is tiny
    runner = TaskRunner(4)
    reported = []

    def failing(i: int) -> Callable[[], None]:
        def task() -> None:
            raise ValueError(i)

        return task

    try:
        for _ in range(3000):
            with pytest.raises(ValueError) as err:
                runner.run([failing(i) for i in range(8)])
            reported.append(err.value.args[0])
    finally:
        sys.setswitchinterval(interval)
        runner.close()
    assert set(reported) == {0}, f"later failures reported {len([r for r in reported if r])} times"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _reading_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shardsafe-read")]


def test_no_thread_or_fd_is_left_after_loads(saved: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "root" / "damaged"
    shutil.copytree(saved, damaged)
    _flip(damaged, "t/big", 7 * BLOCK)
    shardsafe.load(saved, {"t": _sentinels(), "note": None})  # lazy imports done
    before = _fds()
    for i in range(50):
        path, atomic = (saved, True) if i % 2 else (damaged, bool(i % 4))
        try:
            shardsafe.load(path, {"t": _sentinels(), "note": None}, atomic=atomic)
        except IntegrityError:
            assert path == damaged
        assert not _reading_threads(), _reading_threads()
    assert _fds() == before, f"{_fds() - before} file descriptors leaked over 50 loads"


def test_verify_of_a_dedup_reference_opens_the_sibling_once(saved: Path) -> None:
    """Chunks that live in a committed sibling: verify opens that file from the reading threads."""
    shutil.copytree(saved, saved.parent / "earlier")
    manifest = json.loads((saved / "manifest.json").read_text())
    for entry in manifest["tensors"].values():
        for chunk in entry["chunks"]:
            chunk["checkpoint"] = "earlier"
    (saved / "manifest.json").write_text(json.dumps(manifest))
    shardsafe.verify(saved)
    before = _fds()
    for _ in range(20):
        shardsafe.verify(saved)
    assert _fds() == before, f"{_fds() - before} file descriptors leaked over 20 verifies"
    state: dict[str, Any] = {"t": _sentinels(), "note": None}
    shardsafe.load(saved, state)
    assert _bits(state["t"]) == _bits(Holder(_tensors()))
    _flip(saved.parent / "earlier", "t/big", 5 * BLOCK + 3)
    with pytest.raises(IntegrityError, match=r"earlier/shard-00000\.safetensors \(tensor 't/big'.*block 5 "):
        shardsafe.verify(saved)


class Truncator:
    """A stateful object whose ``load_state_dict`` (run between an atomic load's two passes) cuts a shard."""

    def __init__(self, file: Path, keep: float = 1 / 2) -> None:
        self.file, self.keep = file, keep

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        os.truncate(self.file, int(self.file.stat().st_size * self.keep))


def test_a_shard_cut_between_the_passes_is_a_clear_error(tmp_path: Path, small_blocks: None) -> None:
    path = tmp_path / "cut"
    shardsafe.save(path, {"t": Holder(_tensors()), "job": Truncator(Path("unused"))})
    shard_file = next(path.glob("*.safetensors"))
    state: dict[str, Any] = {"t": _sentinels(), "job": Truncator(shard_file)}
    with pytest.raises(IntegrityError, match=re.escape(str(shard_file)) + r".*(ends early|truncated)"):
        shardsafe.load(path, state)
    assert not _reading_threads()


def test_a_shard_replaced_by_a_fifo_a_symlink_or_a_folder(saved: Path) -> None:
    shard_file = next(saved.glob("*.safetensors"))
    moved = saved.parent / "moved.safetensors"
    os.rename(shard_file, moved)
    for make, pattern in [
        (lambda: os.mkfifo(shard_file), "cannot open shard file|not a regular file"),  # and never blocks
        (
            lambda: os.symlink(moved, shard_file),
            "cannot open shard file|symbolic link|not a regular file|leads outside the checkpoint",
        ),
        (lambda: os.mkdir(shard_file), "cannot open shard file|not a regular file|directory"),
    ]:
        make()
        for call in (lambda: shardsafe.verify(saved), lambda: shardsafe.load(saved, {"t": _sentinels(), "note": None})):
            with pytest.raises(ShardsafeError, match=pattern) as err:
                call()
            assert str(shard_file) in str(err.value) and "Traceback" not in str(err.value)
        if shard_file.is_dir() and not shard_file.is_symlink():
            shard_file.rmdir()
        else:
            shard_file.unlink()
        assert not _reading_threads()


# ----------------------------------------------------------------------------- 2 -> 3 ranks

DIMS = (64, 97, 41)  # layers.0.weight: 97 x 64 float32, rows 0-48 on rank 0 of 2 (3 blocks + 256 bytes)


def save_small_blocks(rank: int, world_size: int, path: str) -> dict[str, Any]:
    use_small_blocks()
    model = shard(make_model(7, DIMS), world_size)
    optimizer = make_optimizer(model)
    seeded_step(model, optimizer, DIMS, rank, 7)
    shardsafe.save(path, {"model": model, "optim": optimizer})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


def load_damaged_at_3(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in paths.items():
        if name == "intact":
            continue
        for fresh in (True, False):
            model = shard(make_model(11, DIMS), world_size)
            optimizer = make_optimizer(model)
            if not fresh:
                seeded_step(model, optimizer, DIMS, rank, 11)
            before = (
                full_model_state(model),
                full_optimizer_state(model, optimizer),
                dict(optimizer.state_dict()["param_groups"][0]),
            )
            try:
                shardsafe.load(path, {"model": model, "optim": optimizer})
                error = None
            except IntegrityError as exc:
                error = str(exc)
            after = (
                full_model_state(model),
                full_optimizer_state(model, optimizer),
                dict(optimizer.state_dict()["param_groups"][0]),
            )
            assert_tensors_equal(after[0], before[0], f"{name} fresh={fresh} model")
            assert_optimizer_equal(after[1], before[1], f"{name} fresh={fresh} optimizer")
            assert after[2] == before[2]
            out[f"{name}/{fresh}"] = (error, len(optimizer.state))
    model = shard(make_model(11, DIMS), world_size)
    optimizer = make_optimizer(model)
    shardsafe.load(paths["intact"], {"model": model, "optim": optimizer})
    out["intact"] = (full_model_state(model), full_optimizer_state(model, optimizer))
    cast = shard(make_model(11, DIMS).to(torch.bfloat16), world_size)
    shardsafe.load(paths["intact"], {"model": cast}, strict=False)
    out["cast"] = full_model_state(cast)
    out["threads"] = _reading_threads()
    return out


@pytest.mark.timeout(120)
def test_damage_shared_by_two_ranks_reads_when_resharding_2_to_3(tmp_path: Path) -> None:
    saved = tmp_path / "root" / "intact"
    reference = run_ranks(save_small_blocks, 2, str(saved), work_dir=tmp_path)[0]
    paths = {"intact": str(saved)}
    # Rows 32-47 of layers.0.weight share block 2 of rank 0's chunk; at 3 ranks rank 0 reads rows
    # 0-32 and rank 1 rows 33-65: both read that block, rank 2 does not.
    for name, key, at, chunk in [
        ("model", "model/layers.0.weight", 40 * 256, 0),
        ("fresh_state", "optim/state/layers.0.weight/exp_avg", 40 * 256, 0),
        ("state_tail", "optim/state/layers.0.weight/exp_avg_sq", 3 * BLOCK + 10, 0),  # the partial last block
    ]:
        dest = tmp_path / "root" / name
        shutil.copytree(saved, dest)
        _flip(dest, key, at, chunk)
        paths[name] = str(dest)
    results = run_ranks(load_damaged_at_3, 3, paths, work_dir=tmp_path)
    cases = [
        ("model", "'model/layers.0.weight'", 2),
        ("fresh_state", "'optim/state/layers.0.weight/exp_avg'", 2),
        ("state_tail", "'optim/state/layers.0.weight/exp_avg_sq'", 3),
    ]
    for name, key, block in cases:
        for fresh in (True, False):
            errors = [r[f"{name}/{fresh}"][0] for r in results]
            assert all(e is not None for e in errors), (name, fresh, errors)
            plain = {re.sub(r"^\(reported by rank \d+\) ", "", e) for e in errors}
            assert len(plain) == 1, plain  # the same error on every rank
            message = plain.pop()
            assert f"tensor {key}" in message and _block_of(message) == block, message
            if fresh:
                assert all(r[f"{name}/{fresh}"][1] == 0 for r in results), (
                    "a fresh optimizer kept state after a failed load"
                )
    assert_tensors_equal(results[0]["intact"][0], reference["model"], "model loaded at 3")
    assert_optimizer_equal(results[0]["intact"][1], reference["optim"], "optimizer loaded at 3")
    cast = {k: v.to(torch.bfloat16) for k, v in reference["model"].items()}
    assert_tensors_equal(results[0]["cast"], cast, "bf16 model loaded with strict=False at 3")
    assert all(not r["threads"] for r in results)


# ----------------------------------------------------------------------------- staged batches

STAGED_TENSORS = 20  # x 8 MiB float32, loaded into bfloat16 destinations: every box is staged (160 MiB of slabs)


STAGED_CHILD = """
import resource, sys, torch, shardsafe
from torch import nn
class Holder(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
n = int(sys.argv[2])
state = {"t": Holder({f"w{i}": torch.full((1024, 2048), -1, dtype=torch.bfloat16) for i in range(n)})}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
shardsafe.load(sys.argv[1], state, strict=False)
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) << 10
assert all(torch.equal(getattr(state["t"], f"w{i}"), torch.full((1024, 2048), i, dtype=torch.bfloat16)) for i in
range(n))
print(growth)
"""


def test_staged_reads_are_batched(tmp_path: Path, small_blocks: None) -> None:
    """Every box goes through a slab (float32 stored, bfloat16 live, strict=False casts); 4 KiB
    blocks keep the reading threads' scratch negligible, so what grows is the slabs. Measured in a
    fresh interpreter (a forked child inherits the test process's heap)."""
    path = tmp_path / "staged"
    shardsafe.save(
        path, {"t": Holder({f"w{i}": torch.full((1024, 2048), float(i)) for i in range(STAGED_TENSORS)})}, fsync=False
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", STAGED_CHILD, str(path), str(STAGED_TENSORS)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    growth = int(done.stdout.split()[-1])
    # one batch of slabs (STAGED_BATCH_BYTES, 64 MiB) and the next slab, not all 160 MiB
    assert growth < 120 << 20, f"peak memory grew by {growth >> 20} MiB for 160 MiB of staged slabs"


def test_a_fresh_optimizer_stays_stateless_when_the_last_pass_fails(tmp_path: Path) -> None:
    """The shard is cut after the checking pass: the in-place pass fails (the documented gap: the
    model is partly written), and the optimizer the load gave state to ends without any, as it began."""
    model = nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    path = tmp_path / "cut"
    shardsafe.save(path, {"model": model, "optim": optim, "job": Truncator(Path("unused"))})
    shard_file = next(path.glob("*.safetensors"))
    fresh = torch.optim.AdamW(model.parameters())
    with pytest.raises(IntegrityError, match=re.escape(str(shard_file))):
        # into the weight
        shardsafe.load(path, {"model": model, "optim": fresh, "job": Truncator(shard_file, keep=1 / 8)})
    assert not fresh.state


def test_an_os_error_while_reading_names_the_file(tmp_path: Path) -> None:
    """A read the OS refuses (here EBADF: a write-only descriptor; EIO from a failing disk is the same
    path) is an IntegrityError naming the place, not a bare OSError traceback."""
    from shardsafe.storage.local import pread_into

    target = tmp_path / "f"
    target.write_bytes(b"x" * 16)
    fd = os.open(target, os.O_WRONLY)
    try:
        with pytest.raises(IntegrityError, match=r"somewhere: cannot read at byte 0 \(Bad file descriptor\)"):
            pread_into(fd, [memoryview(bytearray(8))], 0, "somewhere")
    finally:
        os.close(fd)


def test_one_file_is_read_as_ordered_regions_through_their_own_open_files(saved: Path) -> None:
    """One large file and several threads: its reads are cut into contiguous runs in file order
    (so the first damaged block is still the one reported), each read through a second open file
    of the same inode (its own readahead stream), all closed afterwards."""
    from shardsafe.core.format import parse_manifest
    from shardsafe.protocol.block_io import _regions
    from shardsafe.protocol.transfer import ChunkReader

    manifest = parse_manifest((saved / "manifest.json").read_bytes(), "manifest.json")
    with ChunkReader(saved, manifest) as reader:
        entry = manifest.tensors["t/big"]
        reads = reader.whole_chunk_checks("t/big", entry.chunks[0])
        regions = _regions(reads, 4)
        assert 2 <= len(regions) <= 4
        assert [r for region in regions for r in region] == reads
        sizes = [sum(r.hi - r.lo for r in region) for region in regions]
        assert max(sizes) - min(sizes) <= 2 * BLOCK
        assert _regions(reads[:5], 4) == [reads[:5]]  # too few reads to be worth several streams
        handle = reader.files.open(entry.chunks[0])
        stream = reader.source.stream(handle)
        assert stream is not None and stream != handle
        assert os.fstat(stream).st_ino == os.fstat(handle).st_ino
        os.close(stream)


def test_blocks_read_in_pieces_smaller_than_a_block(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local block is read and hashed in pieces (``block_io.PIECE_BYTES``). With pieces of 1000 bytes against 4 KiB
    blocks a piece boundary falls inside the destination and inside the scratch before and after a partial read:
    whole and partial reads are exact, loads bit-identical, and a byte flipped mid-piece is still found in its block.
    """
    from shardsafe.core.format import parse_manifest
    from shardsafe.protocol import block_io
    from shardsafe.protocol.transfer import ChunkReader
    from shardsafe.storage.local import tensor_bytes

    monkeypatch.setattr(block_io, "PIECE_BYTES", 1000)
    expected = _tensors()["big"]
    manifest = parse_manifest((saved / "manifest.json").read_bytes(), "manifest.json")
    chunk = manifest.tensors["t/big"].chunks[0]
    spans = [(0, 25_000), (1000, 20_000), (1023, 1025), (24_990, 25_000), (3 * 1024 - 1, 3 * 1024 + 1)]
    for verify in (True, False):
        with ChunkReader(saved, manifest, verify=verify) as reader:
            for start, stop in spans:
                out = torch.full((stop - start,), -1.0)
                reader.read_elements("t/big", chunk, torch.float32, start, stop, tensor_bytes(out))
                assert torch.equal(out, expected[start:stop]), (verify, start, stop)
    for atomic in (True, False):
        state: dict[str, Any] = {"t": _sentinels(), "note": None}
        shardsafe.load(saved, state, atomic=atomic)
        assert _bits(state["t"]) == _bits(Holder(_tensors()))
    _flip(saved, "t/big", 12 * BLOCK + 2500)  # inside block 12's third piece
    with ChunkReader(saved, manifest) as reader, pytest.raises(IntegrityError, match="hash mismatch in block 12"):
        reader.read_elements("t/big", chunk, torch.float32, 12 * 1024 + 5, 12 * 1024 + 6, tensor_bytes(torch.empty(1)))
    for atomic in (True, False):
        state = {"t": _sentinels(), "note": None}
        before = _bits(state["t"])
        with pytest.raises(IntegrityError, match="hash mismatch in block 12"):
            shardsafe.load(saved, state, atomic=atomic)
        assert not atomic or _bits(state["t"]) == before


def test_a_mapped_file_reads_and_writes_pages_and_refuses_what_it_must_not_map(tmp_path: Path) -> None:
    from shardsafe.storage.local import MappedFile

    path = tmp_path / "f"
    written = MappedFile.for_writing(path, 10_000, [(0, 100), (9_000, 10_000)])
    written.populate(0, 10_000)
    written.bytes[:100] = 7
    written.bytes[9_000:] = 9
    written.sync()
    written.close()
    data = path.read_bytes()
    assert data == bytes([7] * 100) + bytes(8_900) + bytes([9] * 1_000)
    with pytest.raises(FileExistsError):  # never over a file that is there
        MappedFile.for_writing(path, 10, [(0, 10)])
    read = MappedFile.for_reading(path, 10_000)
    read.populate(0, 10_000)
    assert bytes(read.bytes[95:105].tolist()) == bytes([7] * 5 + [0] * 5)
    read.close()
    with pytest.raises(IntegrityError, match="10000 bytes, the manifest says 10001"):
        MappedFile.for_reading(path, 10_001)
    (tmp_path / "link").symlink_to(path)  # a symlink in the folder is not followed out of it
    with pytest.raises(OSError):
        MappedFile.for_reading(tmp_path / "link", 10_000)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FormatError, match="not a regular file"):  # nothing that could hang or change under the map
        MappedFile.for_reading(tmp_path / "fifo", 0)
    empty = MappedFile.for_writing(tmp_path / "empty", 0, [])
    assert empty.bytes.numel() == 0
    empty.close()


def test_a_recycled_file_is_written_over_in_place_and_anything_but_a_regular_file_is_left_alone(
    tmp_path: Path,
) -> None:
    # the local tier's spare: a retired step's file, moved to the new name and written over (its pages kept)
    from shardsafe.core.safetensors_header import HeaderEntry, build_safetensors_header
    from shardsafe.storage.local import MappedFile, create_or_recycle
    from shardsafe.storage.safetensors import write_tensor_file

    spare = tmp_path / "spare"
    spare.mkdir()
    (spare / "old").write_bytes(b"x" * 5_000)
    inode = (spare / "old").stat().st_ino
    mapped = MappedFile.for_writing(tmp_path / "new", 3_000, [(0, 3_000)], recycled=spare / "old")
    mapped.bytes[:] = 5
    mapped.close()
    assert (tmp_path / "new").stat().st_ino == inode and not (spare / "old").exists()
    assert (tmp_path / "new").read_bytes() == bytes([5] * 3_000)  # sized to the new file: no old tail
    # a streamed shard file over a longer recycled one: truncated to what was written
    tensor = torch.arange(10, dtype=torch.float32)
    prefix, _ = build_safetensors_header([HeaderEntry("t", torch.float32, (10,))])
    fresh = tmp_path / "fresh.safetensors"
    size, digests = write_tensor_file(fresh, prefix, [tensor], 64)
    (spare / "long").write_bytes(b"y" * 10 * size)
    inode = (spare / "long").stat().st_ino
    over = tmp_path / "over.safetensors"
    assert write_tensor_file(over, prefix, [tensor], 64, recycled=spare / "long") == (size, digests)
    assert over.stat().st_ino == inode and over.read_bytes() == fresh.read_bytes()
    # no spare file (a new one is made), and never through a symlink or over a folder
    fd, recycled = create_or_recycle(tmp_path / "a", spare / "missing")
    os.close(fd)
    assert not recycled
    (tmp_path / "target").write_bytes(b"keep")
    (spare / "link").symlink_to(tmp_path / "target")
    (spare / "dir").mkdir()
    for name in ("link", "dir"):
        fd, recycled = create_or_recycle(tmp_path / f"from-{name}", spare / name)
        os.write(fd, b"new")
        os.close(fd)
        assert not recycled and (tmp_path / f"from-{name}").read_bytes() == b"new"
    assert (tmp_path / "target").read_bytes() == b"keep" and (spare / "link").is_symlink() and (spare / "dir").is_dir()
    os.link(tmp_path / "target", spare / "hardlink")  # a second name of a file elsewhere: never written through
    fd, recycled = create_or_recycle(tmp_path / "from-hardlink", spare / "hardlink")
    os.close(fd)
    assert not recycled and (tmp_path / "target").read_bytes() == b"keep" and (spare / "hardlink").exists()
    with pytest.raises(FileExistsError):  # the new name is never an existing file
        create_or_recycle(tmp_path / "target", None)
    (spare / "again").write_bytes(b"spare")
    with pytest.raises(FileExistsError):  # not even through a recycled file's rename, which would replace it
        create_or_recycle(tmp_path / "target", spare / "again")
    assert (tmp_path / "target").read_bytes() == b"keep" and (spare / "again").read_bytes() == b"spare"
