"""Hostile checkpoints: folders crafted to escape the folder, hang the reader, exhaust memory, run
code or return wrong data. Each must be refused by ``load`` and ``verify`` with a clear
ShardsafeError (or, where the damage does not touch what is read, load exactly), and

* nothing outside the folder is read: the outside targets are FIFOs (opening one for reading
  would block) or paths that do not exist (the error must be the path-safety one, not "missing");
* nothing is executed: the pickles carry a ``__reduce__`` that would create a marker file;
* memory stays bounded: manifests claiming absurd tensors are processed in a child process whose
  address space is capped, and must fail cleanly, not with an allocation error.

test_format.py covers the parser-level cases (``..`` in chunk file names, huge shapes, unknown
dtypes, duplicate top-level keys, deep manifests, a symlinked shard, ...); these go through the
public API on whole checkpoint folders. Format-aware cases aim at each check a load shares with
verify: shard headers (every file a load opens), dedup references (only into committed
siblings that list the file), the hash block size, chunks sharing bytes, tensor keys and the
state tree's structure. test_load_bounds.py and test_load_atomic_state.py go deeper on each.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import re
import resource
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import assert_tensors_equal, make_model, seeded_values, set_model_values
from reliability import record
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import CheckpointNotFoundError, FormatError, IntegrityError, ShardsafeError, StateMismatchError

SHARD = "shard-00000.safetensors"
KEY = "model/layers.1.weight"  # [13, 7]
DEADLINE_S = 30.0


class Evil:
    """Unpickling this creates ``marker`` (so a test can see whether anything unpickled it)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _state(model: Any) -> dict[str, Any]:
    return {"model": model, "tag": torch.arange(3), "note": "hi"}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    model = make_model(0)
    set_model_values(model, seeded_values(model, "hostile", 0))
    path = tmp_path / "inside" / "ckpt"
    shardsafe.save(path, _state(model))
    return path


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, manifest: dict[str, Any] | bytes) -> None:
    data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(data)


def _edit(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = _manifest(path)
    edit(manifest)
    _write_manifest(path, manifest)


def _set_state(path: Path, data: bytes) -> None:
    """Replace state.json and make the manifest vouch for it (size and hash), as an attacker can."""
    (path / "state.json").write_bytes(data)
    _edit(path, lambda m: m["state"].update(size=len(data), hash=hash_bytes(data)))


def _chunk(manifest: dict[str, Any], key: str = KEY) -> dict[str, Any]:
    return manifest["tensors"][key]["chunks"][0]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _unblock(fifos: list[Path]) -> None:
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: nobody is blocked reading it
                raise


def _call(fn: Callable[[], Any], fifos: list[Path]) -> BaseException | None:
    """Run ``fn`` with a deadline; a reader blocked on one of ``fifos`` (it opened it) fails the test."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            box[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        _unblock(fifos)
        thread.join(5)
        pytest.fail("the reader blocked: it opened a FIFO it should have refused")
    return box[0]


# ----------------------------------------------------------------------------- the cases
# Each takes the checkpoint folder, damages it, and returns (expected error classes, regex the message must match,
# FIFOs).


def state_file_outside(path: Path) -> Any:
    _edit(path, lambda m: m["state"].update(file="../state-outside.json"))  # does not exist: must not be looked at
    return FormatError, "unsafe", []


def state_file_absolute(path: Path) -> Any:
    _edit(path, lambda m: m["state"].update(file=str(path.parent / "state-nowhere.json")))
    return FormatError, "unsafe", []


def chunk_file_outside(path: Path) -> Any:
    _edit(path, lambda m: _chunk(m).update(file="../shard-outside.safetensors"))
    return FormatError, "unsafe", []


def chunk_checkpoint_parent(path: Path) -> Any:
    _edit(path, lambda m: _chunk(m).update(checkpoint=".."))
    return FormatError, "unsafe", []


def chunk_checkpoint_symlink_out(path: Path) -> Any:
    """A sibling 'checkpoint' that is a symlink to a folder outside the root, holding a FIFO."""
    outside = path.parent.parent / "elsewhere"
    outside.mkdir()
    fifo = _fifo(outside / SHARD)
    (path.parent / "sibling").symlink_to(outside)
    _edit(path, lambda m: _chunk(m).update(checkpoint="sibling"))
    return FormatError, "outside|symbolic link", [fifo]


def state_symlink_to_fifo(path: Path) -> Any:
    fifo = _fifo(path.parent.parent / "state-fifo")
    (path / "state.json").unlink()
    (path / "state.json").symlink_to(fifo)
    return FormatError, "outside|symbolic link", [fifo]


def manifest_symlink_out(path: Path) -> Any:
    outside = path.parent.parent / "manifest-copy.json"
    outside.write_bytes((path / "manifest.json").read_bytes())
    (path / "manifest.json").unlink()
    (path / "manifest.json").symlink_to(outside)
    return FormatError, "outside|symbolic link", []


def shard_symlink_to_fifo(path: Path) -> Any:
    fifo = _fifo(path.parent.parent / "shard-fifo")
    (path / SHARD).unlink()
    (path / SHARD).symlink_to(fifo)
    return FormatError, "outside|symbolic link", [fifo]


def shard_is_fifo(path: Path) -> Any:
    (path / SHARD).unlink()
    fifo = _fifo(path / SHARD)
    return (FormatError, IntegrityError), "not a regular file|missing", [fifo]


def state_is_fifo(path: Path) -> Any:
    (path / "state.json").unlink()
    fifo = _fifo(path / "state.json")
    return FormatError, "not a regular file", [fifo]


def duplicate_tensor_key(path: Path) -> Any:
    text = (path / "manifest.json").read_text()
    manifest = _manifest(path)
    entry = json.dumps(manifest["tensors"][KEY])
    _write_manifest(path, text.replace('"tensors": {', f'"tensors": {{"{KEY}": {entry},', 1).encode())
    return FormatError, "duplicate", []


def duplicate_file_key(path: Path) -> Any:
    text = (path / "manifest.json").read_text()
    _write_manifest(path, text.replace('"files": {', f'"files": {{"{SHARD}": {{"size": 1, "rank": 0}},', 1).encode())
    return FormatError, "duplicate", []


def duplicate_key_in_state(path: Path) -> Any:
    data = (
        (path / "state.json")
        .read_bytes()
        .replace(b'"note": {', b'"note": {"kind": "value", "state": "evil"}, "note": {', 1)
    )
    _set_state(path, data)
    return FormatError, "duplicate", []


def offsets_past_end(path: Path) -> Any:
    def edit(m: dict[str, Any]) -> None:
        _chunk(m).update(begin=_chunk(m)["begin"] + 10**6, end=_chunk(m)["end"] + 10**6)

    _edit(path, edit)
    return FormatError, "past the end", []


def offsets_past_end_and_size_lie(path: Path) -> Any:
    def edit(m: dict[str, Any]) -> None:
        _chunk(m).update(begin=_chunk(m)["begin"] + 10**6, end=_chunk(m)["end"] + 10**6)
        m["files"][SHARD]["size"] += 10**6

    _edit(path, edit)
    return IntegrityError, "bytes, the manifest expects", []


def header_length_past_end(path: Path) -> Any:
    """Load checks the header of every shard it opens, as verify does."""
    data = bytearray((path / SHARD).read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    (path / SHARD).write_bytes(bytes(data))
    return (IntegrityError, FormatError), "header length", []


def _shard_header(path: Path) -> tuple[bytearray, int, dict[str, Any]]:
    data = bytearray((path / SHARD).read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    return data, length, json.loads(data[8 : 8 + length])


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the shard's header JSON in place, padded to its old length (nothing else moves)."""
    data, length, header = _shard_header(path)
    edit(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= length
    data[8 : 8 + length] = body + b" " * (length - len(body))
    (path / SHARD).write_bytes(bytes(data))


def header_dtype_relabelled(path: Path) -> Any:
    _rewrite_header(path, lambda h: h[KEY].update(dtype="I32"))  # what safetensors would read: other numbers
    return FormatError, "header disagrees with the manifest", []


def header_shape_transposed(path: Path) -> Any:
    _rewrite_header(path, lambda h: h[KEY].update(shape=[7, 13]))
    return FormatError, "header disagrees with the manifest", []


def header_entry_renamed_and_moved(path: Path) -> Any:
    def edit(h: dict[str, Any]) -> None:
        entry = h.pop(KEY)
        h["other"] = dict(entry, data_offsets=[entry["data_offsets"][0], entry["data_offsets"][1] - 4], shape=[90])

    _rewrite_header(path, edit)
    return FormatError, "no entry", []


def header_names_metadata_twice(path: Path) -> Any:
    data = (path / SHARD).read_bytes()
    (path / SHARD).write_bytes(data.replace(f'"{KEY}"'.encode(), b'"__metadata__"' + b" " * (len(KEY) + 2 - 14), 1))
    return FormatError, "duplicate", []


def header_not_utf8(path: Path) -> Any:
    data, _, _ = _shard_header(path)
    data[data.index(b"dtype")] = 0xFF
    (path / SHARD).write_bytes(bytes(data))
    return FormatError, "not valid JSON", []


def chunk_in_sibling_without_manifest(path: Path) -> Any:
    (path.parent / "loose").mkdir()
    (path.parent / "loose" / SHARD).write_bytes((path / SHARD).read_bytes())
    _edit(path, lambda m: _chunk(m).update(checkpoint="loose"))
    return IntegrityError, "not a committed checkpoint", []


def chunk_in_hidden_sibling(path: Path) -> Any:
    _edit(path, lambda m: _chunk(m).update(checkpoint=".ckpt.shardsafe-old-0123456789ab"))
    return FormatError, "hidden folder", []


def chunk_in_sibling_not_listing_it(path: Path) -> Any:
    sibling = path.parent / "other"
    shardsafe.save(sibling, {"x": 1})  # committed, but holds no shard file
    (sibling / SHARD).write_bytes((path / SHARD).read_bytes())
    _edit(path, lambda m: _chunk(m).update(checkpoint="other"))
    return IntegrityError, "does not list", []


def hash_block_size_not_a_power_of_two(path: Path) -> Any:
    _edit(path, lambda m: m.update(hash_block_size=3 << 20))
    return FormatError, "not a power of two", []


def hash_block_size_beyond_a_gib(path: Path) -> Any:
    _edit(path, lambda m: m.update(hash_block_size=1 << 40))
    return FormatError, "not a power of two between", []


def two_tensors_share_bytes(path: Path) -> Any:
    _edit(path, lambda m: m["tensors"].update({"model/alias": m["tensors"][KEY]}))
    return FormatError, "claim the same bytes", []


def tensor_key_is_header_metadata(path: Path) -> Any:
    _edit(path, lambda m: m["tensors"].update({"__metadata__": m["tensors"].pop("tag")}))
    return FormatError, "invalid tensor key", []


def tensor_key_lone_surrogate(path: Path) -> Any:
    text = (path / "manifest.json").read_text()
    assert text.count('"tag"') == 1
    _write_manifest(path, text.replace('"tag"', '"tag\\ud800"').encode())  # JSON escape of a lone surrogate
    return FormatError, "not valid UTF-8", []


def _edit_state(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    tree = json.loads((path / "state.json").read_text())
    edit(tree)
    _set_state(path, json.dumps(tree).encode())


def state_reference_not_a_string(path: Path) -> Any:
    _edit_state(path, lambda t: t["note"].update(state={"__tensor__": 7}))
    return FormatError, "bad tensor reference", []


def state_entry_not_an_object(path: Path) -> Any:
    _edit_state(path, lambda t: t.update(extra=5))
    return FormatError, "has no kind", []


def state_per_rank_without_ranks(path: Path) -> Any:
    _edit_state(path, lambda t: t.update(rng={"kind": "per_rank", "ranks": []}))
    return FormatError, "no per-rank entries", []


def state_bad_dtype_tag(path: Path) -> Any:
    _edit_state(path, lambda t: t["note"].update(state={"__dtype__": "float128"}))
    return FormatError, "unknown dtype", []


def dtype_relabelled(path: Path) -> Any:
    _edit(path, lambda m: m["tensors"][KEY].update(dtype="int32"))  # same size, other meaning
    return (StateMismatchError, FormatError), "dtype mismatch|disagrees", []


def shape_transposed(path: Path) -> Any:
    def edit(m: dict[str, Any]) -> None:
        m["tensors"][KEY]["shape"] = [7, 13]
        _chunk(m)["shape"] = [7, 13]

    _edit(path, edit)
    return (StateMismatchError, FormatError), "shape mismatch|disagrees", []


def deep_state(path: Path) -> Any:
    _set_state(path, b'{"note": {"kind": "value", "state": ' + b"[" * 5000 + b"]" * 5000 + b"}}")
    return FormatError, "deeper|deeply", []


def huge_manifest(path: Path) -> Any:
    """A 1 GiB + 1 byte manifest (sparse): refused from its size, before it is read."""
    with open(path / "manifest.json", "r+b") as f:
        f.truncate((1 << 30) + 1)
    return FormatError, "more than the", []


def huge_state_claim(path: Path) -> Any:
    _edit(path, lambda m: m["state"].update(size=(1 << 30) + 1))
    return FormatError, "out of range", []


def huge_integer(path: Path) -> Any:
    text = (path / "manifest.json").read_text()
    _write_manifest(path, text.replace('"world_size": 1', '"world_size": 1' + "0" * 5000, 1).encode())
    return FormatError, "not valid JSON", []


def created_not_a_number(path: Path) -> Any:
    _edit(path, lambda m: m.update(created="yesterday"))
    return FormatError, "created", []


def unhashable_pair_key(path: Path) -> Any:
    data = (path / "state.json").read_bytes().replace(b'"state": "hi"', b'"state": {"__pairs__": [[[1, 2], "x"]]}', 1)
    _set_state(path, data)
    return FormatError, "pair", []


def state_refers_to_missing_tensor(path: Path) -> Any:
    data = (path / "state.json").read_bytes().replace(b'"state": "hi"', b'"state": {"__tensor__": "no/such/tensor"}', 1)
    _set_state(path, data)
    return FormatError, "does not list", []


def overlapping_chunks_beyond_64(path: Path) -> Any:
    """70 one-row chunks where row 3 is stored twice and row 69 not at all: the volume adds up, and
    without an overlap check row 69 would silently keep whatever the destination held."""
    manifest = _manifest(path)
    base = _chunk(manifest, "model/layers.0.weight")
    rows = [*range(69), 3]
    chunks = [dict(base, offsets=[r, 0], shape=[1, 5], begin=base["begin"], end=base["begin"] + 20) for r in rows]
    manifest["tensors"]["model/layers.0.weight"] = {"dtype": "float32", "shape": [70, 5], "chunks": chunks}
    _write_manifest(path, manifest)
    return FormatError, "overlap", []


def manifest_is_a_pickle(path: Path) -> Any:
    torch.save(Evil(str(path.parent.parent / "MARKER")), path / "manifest.json")
    return FormatError, "not valid JSON|not a shardsafe", []


def state_is_a_pickle(path: Path) -> Any:
    _set_state(path, pickle.dumps(Evil(str(path.parent.parent / "MARKER"))))
    return FormatError, "not valid JSON", []


def shard_is_a_pickle_of_the_same_size(path: Path) -> Any:
    size = (path / SHARD).stat().st_size
    payload = pickle.dumps(Evil(str(path.parent.parent / "MARKER")), protocol=2)
    assert len(payload) < size
    (path / SHARD).write_bytes(payload + b"\0" * (size - len(payload)))
    return (IntegrityError, FormatError), "hash mismatch|header|safetensors", []


def checkpoint_is_a_pickle_file(path: Path) -> Any:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    torch.save(Evil(str(path.parent.parent / "MARKER")), path)
    return CheckpointNotFoundError, "no such checkpoint folder", []


CASES: dict[str, Callable[[Path], Any]] = {f.__name__: f for f in [
    state_file_outside, state_file_absolute, chunk_file_outside, chunk_checkpoint_parent,
    chunk_checkpoint_symlink_out, state_symlink_to_fifo, manifest_symlink_out, shard_symlink_to_fifo, shard_is_fifo,
    state_is_fifo, duplicate_tensor_key, duplicate_file_key, duplicate_key_in_state, offsets_past_end,
    offsets_past_end_and_size_lie, header_length_past_end, dtype_relabelled, shape_transposed, deep_state,
    huge_manifest, huge_state_claim, huge_integer, created_not_a_number, unhashable_pair_key,
    state_refers_to_missing_tensor, overlapping_chunks_beyond_64, manifest_is_a_pickle, state_is_a_pickle,
    shard_is_a_pickle_of_the_same_size, checkpoint_is_a_pickle_file, header_dtype_relabelled,
    header_shape_transposed, header_entry_renamed_and_moved, header_names_metadata_twice, header_not_utf8,
    chunk_in_sibling_without_manifest, chunk_in_hidden_sibling, chunk_in_sibling_not_listing_it,
    hash_block_size_not_a_power_of_two, hash_block_size_beyond_a_gib, two_tensors_share_bytes,
    tensor_key_is_header_metadata, tensor_key_lone_surrogate, state_reference_not_a_string,
    state_entry_not_an_object, state_per_rank_without_ranks, state_bad_dtype_tag,
]}  # fmt: skip
# Damage that load does not read: load may succeed, exactly. None left since load checks every
# header it opens (it used to hold header_length_past_end).
LOAD_MAY_SUCCEED: set[str] = set()


def test_the_pickle_payload_is_live(tmp_path: Path) -> None:
    """The control for the pickle cases: unpickling the payload does create the marker."""
    marker = tmp_path / "MARKER"
    pickle.loads(pickle.dumps(Evil(str(marker))))
    assert marker.exists()


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_checkpoint_is_refused(ckpt: Path, name: str) -> None:
    expected, pattern, fifos = CASES[name](ckpt)
    marker = ckpt.parent.parent / "MARKER"
    verify_error = _call(lambda: shardsafe.verify(ckpt), fifos)
    assert isinstance(verify_error, expected), f"verify: {verify_error!r}"
    assert re.search(pattern, str(verify_error)), f"verify: unclear error: {verify_error}"
    model = make_model(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model, "tag": torch.zeros(3, dtype=torch.int64), "note": None}
    load_error = _call(lambda: shardsafe.load(ckpt, state), fifos)
    if load_error is None:
        assert name in LOAD_MAY_SUCCEED, f"{name}: load accepted a hostile checkpoint"
        reference = make_model(0)
        set_model_values(reference, seeded_values(reference, "hostile", 0))
        assert_tensors_equal(dict(model.state_dict()), dict(reference.state_dict()), "loaded despite damage")
    else:
        assert isinstance(load_error, ShardsafeError), f"load: {load_error!r}"
        assert isinstance(load_error, expected), f"load: {load_error!r}"
        assert re.search(pattern, str(load_error)), f"load: unclear error: {load_error}"
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), f"{name}: the refused load modified {key}"
    assert not marker.exists(), "a pickle was executed"
    record("hostile checkpoint folders (load and verify)", faults=2)


# ----------------------------------------------------------------------------- absurd sizes, bounded memory


def _absurd_tensor(path: Path, elements: int) -> None:
    """Add a uint8 tensor of ``elements`` elements, referenced from state.json as a plain value, whose
    chunk claims bytes the shard file does not have (the manifest's file size lies to match)."""
    from shardsafe.core.integrity import num_blocks

    manifest = _manifest(path)
    size = manifest["files"][SHARD]["size"]
    manifest["files"][SHARD]["size"] = size + elements
    manifest["tensors"]["big"] = {
        "dtype": "uint8",
        "shape": [elements],
        "chunks": [
            {
                "offsets": [0],
                "shape": [elements],
                "file": SHARD,
                "begin": size,
                "end": size + elements,
                "hashes": ["0"] * num_blocks(elements),
            }
        ],
    }
    _write_manifest(path, manifest)
    data = (path / "state.json").read_bytes().replace(b'"state": "hi"', b'"state": {"__tensor__": "big"}', 1)
    _set_state(path, data)


def _bounded_load(path: str, queue: Any) -> None:
    """In a child: cap the address space at 2 GiB above what it uses, load, report the outcome and the peak RSS
    growth."""
    with open("/proc/self/statm") as f:
        vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (2 << 30), resource.RLIM_INFINITY))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcome: tuple[str, str]
    try:
        shardsafe.load(path, {"model": make_model(1), "tag": torch.zeros(3, dtype=torch.int64), "note": None})
        outcome = ("loaded", "")
    except BaseException as exc:
        outcome = (type(exc).__name__, str(exc)[:500])
    queue.put((*outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024))


@pytest.mark.parametrize(
    "elements, expected", [(10**15, "FormatError"), (1 << 40, "IntegrityError"), (1 << 34, "IntegrityError")]
)
def test_absurd_sizes_keep_memory_bounded(ckpt: Path, elements: int, expected: str) -> None:
    if elements > 1 << 48:  # beyond MAX_NUMEL: refused by the parser; the hashes list would be absurd too
        _edit(ckpt, lambda m: m["tensors"][KEY].update(shape=[elements]))
    else:
        _absurd_tensor(ckpt, elements)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_bounded_load, args=(str(ckpt), queue))
    child.start()
    child.join(120)
    assert child.exitcode == 0, f"the child died ({child.exitcode})"
    name, message, growth = queue.get(timeout=5)
    assert name == expected, f"{name}: {message}"
    assert growth < 256 << 20, f"peak memory grew by {growth >> 20} MiB"
    record("hostile checkpoint folders (load and verify)", faults=1)
