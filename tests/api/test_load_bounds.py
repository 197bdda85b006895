"""What a load allocates and which files it trusts, against checkpoints crafted to push both.

* Repeated references: a state.json that refers to one 8 MiB tensor 10,000 times reads it once
  and shares it (80 GB otherwise); 10,000 tensor entries that all claim the same bytes of a file
  are refused by the manifest parser. Both in a child whose address space is capped, with the
  peak memory growth measured.
* ``hash_block_size``: bounded (4 KiB .. 1 GiB, a power of two); a checkpoint declaring 1 GiB
  blocks loads and verifies with a scratch buffer sized to its data, not to the block.
* Headers: the safetensors header of every shard a load opens must parse and agree with the
  manifest, with or without ``verify`` (load refuses what verify refuses).
* Dedup references: a chunk stored in another checkpoint must name a committed sibling whose
  manifest lists that file with its size; any other folder is refused, and the legitimate case loads.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import resource
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from reliability import record
from shardsafe.core.integrity import hash_bytes, num_blocks
from shardsafe.errors import FormatError, IntegrityError, ShardsafeError

BIG = 2 << 20  # float32 elements: 8 MiB


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest))


def _set_state(path: Path, tree: dict[str, Any]) -> None:
    data = json.dumps(tree).encode()
    (path / "state.json").write_bytes(data)
    manifest = _manifest(path)
    manifest["state"].update(size=len(data), hash=hash_bytes(data))
    _write_manifest(path, manifest)


@pytest.fixture
def big(tmp_path: Path) -> Path:
    path = tmp_path / "root" / "big"
    shardsafe.save(path, {"weights": {"w": torch.arange(BIG, dtype=torch.float32)}, "note": "x"})
    # One load here, in the parent: whatever the load path imports lazily (and, in a fresh venv, compiles
    # to bytecode) is then not counted as the measured child's memory growth.
    shardsafe.load(path, {"weights": None, "note": None})
    return path


def _bounded(fn: Callable[[], Any], queue: Any) -> None:
    """In a child: cap the address space at 2 GiB above what it uses, run, report outcome and peak RSS growth."""
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (2 << 30), resource.RLIM_INFINITY))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        outcome = ("ok", fn())
    except BaseException as exc:
        outcome = (type(exc).__name__, str(exc)[:300])
    queue.put((*outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024))


def run_bounded(fn: Callable[[], Any]) -> tuple[str, Any, int]:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_bounded, args=(fn, queue))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child died ({child.exitcode})"
    return queue.get(timeout=5)


def test_one_tensor_referenced_10000_times_is_read_once(big: Path) -> None:
    # The same load of the checkpoint as saved (one reference), measured the same way: what a forked
    # child's peak RSS grows by regardless of the references (allocator arenas, lazy imports) differs by
    # environment, so the bound applies to the difference.
    baseline_name, _, baseline = run_bounded(lambda: shardsafe.load(big, {"weights": None, "note": None}))
    assert baseline_name == "ok"
    tree = json.loads((big / "state.json").read_text())
    tree["note"] = {"kind": "value", "state": [{"__tensor__": "weights/w"}] * 10_000}
    _set_state(big, tree)

    def load() -> Any:
        state: dict[str, Any] = {"weights": None, "note": None}
        shardsafe.load(big, state)
        refs = state["note"]
        return (
            len(refs),
            all(r is refs[0] for r in refs),
            bool(torch.equal(refs[0], torch.arange(BIG, dtype=torch.float32))),
        )

    name, result, growth = run_bounded(load)
    assert name == "ok", result
    assert result == (10_000, True, True)
    assert growth - baseline < 4 * BIG * 4, (
        f"peak memory grew by {(growth - baseline) >> 20} MiB more than a plain load, for an 8 MiB tensor"
    )
    record("hostile checkpoint folders (load and verify)", faults=1)


def test_many_tensors_claiming_the_same_bytes_are_refused(big: Path) -> None:
    manifest = _manifest(big)
    entry = manifest["tensors"]["weights/w"]
    for i in range(10_000):
        manifest["tensors"][f"alias/{i}"] = entry
    _write_manifest(big, manifest)
    tree = json.loads((big / "state.json").read_text())
    tree["note"] = {"kind": "value", "state": [{"__tensor__": f"alias/{i}"} for i in range(10_000)]}
    _set_state(big, tree)
    name, message, growth = run_bounded(lambda: shardsafe.load(big, {"weights": None, "note": None}))
    assert name == "FormatError" and "claim the same bytes" in message, message
    assert growth < 256 << 20, f"peak memory grew by {growth >> 20} MiB"
    with pytest.raises(FormatError, match="claim the same bytes"):
        shardsafe.verify(big)
    record("hostile checkpoint folders (load and verify)", faults=1)


@pytest.mark.parametrize("block", [0, 2048, 4095, 3 << 20, (1 << 30) + 4096, 1 << 31, 1 << 62])
def test_hash_block_size_is_bounded(big: Path, block: int) -> None:
    manifest = _manifest(big)
    manifest["hash_block_size"] = block
    _write_manifest(big, manifest)
    for call in (lambda: shardsafe.verify(big), lambda: shardsafe.load(big, {"weights": None, "note": None})):
        with pytest.raises(FormatError, match="hash block size .* is not a power of two between 4096 and 1073741824"):
            call()
    record("hostile checkpoint folders (load and verify)", faults=2)


def test_a_one_gib_block_uses_a_buffer_sized_to_the_data(tmp_path: Path) -> None:
    """Chunks smaller than a block have one hash of all their bytes, whatever the block size: so the
    declared block can be raised to 1 GiB with the hashes still valid, and load/verify must not
    allocate a 1 GiB scratch buffer for a checkpoint of a few KB."""
    path = tmp_path / "small"
    shardsafe.save(path, {"t": torch.arange(1000, dtype=torch.float32), "u": torch.ones(7, 3)})
    manifest = _manifest(path)
    manifest["hash_block_size"] = 1 << 30
    _write_manifest(path, manifest)

    def both() -> Any:
        summary = shardsafe.verify(path)
        state = {"t": torch.zeros(1000), "u": torch.zeros(7, 3)}
        shardsafe.load(path, state)
        return summary["bytes_checked"], bool(torch.equal(state["t"], torch.arange(1000, dtype=torch.float32)))

    name, result, growth = run_bounded(both)
    assert name == "ok" and result == (4084, True), result
    assert growth < 64 << 20, f"peak memory grew by {growth >> 20} MiB"


# ----------------------------------------------------------------------------- shard headers


def _header(path: Path, file: str) -> tuple[int, dict[str, Any]]:
    data = (path / file).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def _put_header(path: Path, file: str, header: dict[str, Any], length: int) -> None:
    """Rewrite the header in place, padded to its old length (the data offsets stay valid)."""
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= length, "the edited header must fit in the old one"
    data = bytearray((path / file).read_bytes())
    data[8 : 8 + length] = body + b" " * (length - len(body))
    (path / file).write_bytes(bytes(data))


SHARD = "shard-00000.safetensors"


def header_dtype_relabelled(path: Path) -> str:
    length, header = _header(path, SHARD)
    header["weights/w"]["dtype"] = "I32"
    _put_header(path, SHARD, header, length)
    return "disagrees with the manifest"


def header_shape_changed(path: Path) -> str:
    length, header = _header(path, SHARD)
    header["weights/w"]["shape"] = [BIG // 2, 2]
    _put_header(path, SHARD, header, length)
    return "disagrees with the manifest"


def header_entry_missing(path: Path) -> str:
    length, header = _header(path, SHARD)
    header["weights/x"] = header.pop("weights/w")
    header["weights/x"]["data_offsets"][0] += 4
    header["weights/x"]["shape"] = [BIG - 1]
    _put_header(path, SHARD, header, length)
    return "no entry"


def header_not_json(path: Path) -> str:
    data = bytearray((path / SHARD).read_bytes())
    data[9] = ord("}")
    (path / SHARD).write_bytes(bytes(data))
    return "not valid JSON"


def header_duplicate_key(path: Path) -> str:
    """``__metadata__`` renamed to ``weights/w`` (padded, so nothing moves): the name appears twice."""
    data = (path / SHARD).read_bytes()
    assert data.count(b'"__metadata__"') == 1
    (path / SHARD).write_bytes(data.replace(b'"__metadata__"', b'"weights/w"   ', 1))
    return "duplicate"


def header_length_beyond_file(path: Path) -> str:
    data = bytearray((path / SHARD).read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    (path / SHARD).write_bytes(bytes(data))
    return "header length"


def header_length_absurd(path: Path) -> str:
    data = bytearray((path / SHARD).read_bytes())
    data[:8] = struct.pack("<Q", 1 << 62)
    (path / SHARD).write_bytes(bytes(data))
    return "header length"


def header_offsets_past_end(path: Path) -> str:
    length, header = _header(path, SHARD)
    header["weights/w"]["data_offsets"] = [8, 8 + BIG * 4]
    _put_header(path, SHARD, header, length)
    return "do not fit"


HEADERS = {f.__name__: f for f in [
    header_dtype_relabelled, header_shape_changed, header_entry_missing, header_not_json, header_duplicate_key,
    header_length_beyond_file, header_length_absurd, header_offsets_past_end,
]}  # fmt: skip


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("name", list(HEADERS))
def test_load_refuses_what_verify_refuses_in_a_header(big: Path, name: str, verify: bool) -> None:
    pattern = HEADERS[name](big)
    with pytest.raises(FormatError, match=pattern) as verify_error:
        shardsafe.verify(big)
    assert str(big / SHARD) in str(verify_error.value)
    state: dict[str, Any] = {"weights": {"w": torch.zeros(BIG)}, "note": None}
    with pytest.raises(FormatError, match=pattern) as load_error:
        shardsafe.load(big, state, verify=verify)
    assert str(big / SHARD) in str(load_error.value)
    assert not state["weights"]["w"].any() and state["note"] is None, "the refused load modified the state"
    record("hostile checkpoint folders (load and verify)", faults=2)


# ----------------------------------------------------------------------------- dedup references


def _refer(path: Path, checkpoint: str) -> None:
    manifest = _manifest(path)
    manifest["tensors"]["weights/w"]["chunks"][0]["checkpoint"] = checkpoint
    _write_manifest(path, manifest)


def sibling_committed(path: Path) -> Any:
    """The legitimate case: the chunk's file lives in a committed sibling that lists it."""
    shutil.copytree(path, path.parent / "earlier")
    _refer(path, "earlier")
    return None, ""


def sibling_retained(path: Path) -> Any:
    """Legitimate too: a retired sibling that kept its manifest because later checkpoints use its files."""
    shutil.copytree(path, path.parent / "earlier")
    os.rename(path.parent / "earlier" / "manifest.json", path.parent / "earlier" / "manifest.retained.json")
    _refer(path, "earlier")
    return None, ""


def sibling_without_manifest(path: Path) -> Any:
    (path.parent / "loose").mkdir()
    shutil.copy(path / SHARD, path.parent / "loose" / SHARD)
    _refer(path, "loose")
    return IntegrityError, "not a committed checkpoint"


def sibling_missing(path: Path) -> Any:
    _refer(path, "nowhere")
    return IntegrityError, "not a committed checkpoint|missing"


def sibling_not_listing_the_file(path: Path) -> Any:
    shutil.copytree(path, path.parent / "earlier")
    manifest = _manifest(path.parent / "earlier")
    manifest["files"] = {}
    manifest["tensors"] = {}
    _write_manifest(path.parent / "earlier", manifest)
    _refer(path, "earlier")
    return IntegrityError, "does not list"


def sibling_listing_another_size(path: Path) -> Any:
    shutil.copytree(path, path.parent / "earlier")
    with open(path.parent / "earlier" / SHARD, "ab") as f:
        f.write(b"\0" * 64)  # the sibling's file grew; its manifest still says the old size
    _refer(path, "earlier")
    return IntegrityError, "the manifest expects"


def sibling_hidden_temporary(path: Path) -> Any:
    shutil.copytree(path, path.parent / ".earlier.shardsafe-tmp-0123456789ab")
    _refer(path, ".earlier.shardsafe-tmp-0123456789ab")
    return FormatError, "hidden folder"


def sibling_manifest_garbage(path: Path) -> Any:
    shutil.copytree(path, path.parent / "earlier")
    (path.parent / "earlier" / "manifest.json").write_text("{not json")
    _refer(path, "earlier")
    return FormatError, "not valid JSON"


def sibling_is_a_file(path: Path) -> Any:
    (path.parent / "earlier").write_bytes(b"x")
    _refer(path, "earlier")
    return IntegrityError, "not a committed checkpoint"


def sibling_manifest_a_symlink_out(path: Path) -> Any:
    shutil.copytree(path, path.parent / "earlier")
    outside = path.parent.parent / "outside-manifest.json"
    os.rename(path.parent / "earlier" / "manifest.json", outside)
    (path.parent / "earlier" / "manifest.json").symlink_to(outside)
    _refer(path, "earlier")
    return FormatError, "symbolic link|outside"


SIBLINGS = {f.__name__: f for f in [
    sibling_committed, sibling_retained, sibling_without_manifest, sibling_missing, sibling_not_listing_the_file,
    sibling_listing_another_size, sibling_hidden_temporary, sibling_manifest_garbage, sibling_is_a_file,
    sibling_manifest_a_symlink_out,
]}  # fmt: skip


@pytest.mark.parametrize("name", list(SIBLINGS))
def test_dedup_references_must_name_a_committed_sibling(big: Path, name: str) -> None:
    expected, pattern = SIBLINGS[name](big)
    state: dict[str, Any] = {"weights": {"w": torch.zeros(BIG)}, "note": None}
    if expected is None:
        shardsafe.verify(big)
        shardsafe.load(big, state)
        assert torch.equal(state["weights"]["w"], torch.arange(BIG, dtype=torch.float32))
        return
    for call in (lambda: shardsafe.verify(big), lambda: shardsafe.load(big, state)):
        with pytest.raises(ShardsafeError) as error:
            call()
        assert isinstance(error.value, expected) and re.search(pattern, str(error.value)), repr(error.value)
    assert not state["weights"]["w"].any() and state["note"] is None, "the refused load modified the state"
    record("hostile checkpoint folders (load and verify)", faults=2)


def test_absurd_block_count_is_refused_before_hashing(big: Path) -> None:
    """A chunk whose hash list does not match its size at the declared block size is refused by the parser."""
    manifest = _manifest(big)
    manifest["tensors"]["weights/w"]["chunks"][0]["hashes"] *= num_blocks(BIG * 4, 4096)
    _write_manifest(big, manifest)
    with pytest.raises(FormatError, match="block hashes"):
        shardsafe.verify(big)
