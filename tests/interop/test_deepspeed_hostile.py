"""Hostile DeepSpeed checkpoints: crafted pickles, archives, layouts and ``latest`` files, each refused cleanly.

The reader opens files nobody vouches for (a checkpoint downloaded from a hub, a folder a CI job was
handed). Each case here breaks one thing of a sound ZeRO-3 (or ZeRO-2) folder written by
``ds_scripts/craft.py`` (the sound folders are read exactly first, so each hostile one is refused
for what it breaks, not for a flaw of the crafting): a global or opcode outside the allow-lists, a
tensor whose storage or strides point outside its bytes (meta, device, stride 0, negative stride,
offset or extent past the end, a storage claiming more than the file holds), allocation bombs
(``bytearray``, a memo index of 2**32, a shape of 10**12 elements, shared values expanding
exponentially), cycles and deep nesting, a damaged archive, and ``latest`` as a symlink, a hard link,
an oversized, binary or traversing file. Every one must end in :class:`FormatError` (or
:class:`CheckpointNotFoundError`) naming the file, with no traceback, no crash, no allocation beyond
the process's cap, and no byte of a file outside the folder in the message.

The folder cases are read in one child process (``ds_scripts/read_hostile.py``) through every entry
point (read, optimizer state, convert, convert for the engine, export), so a segfault is seen as the
child's death, with the case it was reading. A few go through ``python -m shardsafe.cli`` too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from ds_scripts.craft import Call, DSFolder, Forged, save_crafted, zero2_folder, zero3_folder
from ds_scripts.hostile_cases import CASES, SECRET, SECRET_CASES, build
from reliability import record
from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.interop import pickle_scan
from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint
from shardsafe.interop.mapped_copy import copy_out
from shardsafe.interop.unpickler import load_file, load_pt

TESTS = Path(__file__).resolve().parents[1]
SRC = Path(shardsafe.__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )


@pytest.mark.parametrize("make", [zero3_folder, zero2_folder])
def test_sound_crafted_folders_read_exactly(tmp_path: Path, make: Callable[[Path], DSFolder]) -> None:
    """The baseline: what the hostile cases break, unbroken, reads exactly (and torch.load agrees on every file)."""
    ds = make(tmp_path / "ds")
    for name in [*ds.optim, *ds.model]:
        assert isinstance(torch.load(ds.tag_folder / name, weights_only=True), dict)
        load_pt(ds.tag_folder / name)
    with DeepSpeedCheckpoint(ds.root) as ckpt:
        assert sorted(ckpt.names()) == sorted(ds.expected)
        for key, expected in ds.expected.items():
            got = ckpt.read(key)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
        assert ckpt.param_groups()[0]["params"] == [n for n in ds.expected if n in ckpt.trainable]
    out = shardsafe.convert_deepspeed(ds.root, tmp_path / "converted", progress=False)
    assert shardsafe.verify(out)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case built, then read by one child process; its JSON lines, return code and stderr."""
    root = tmp_path_factory.mktemp("hostile_ds")
    folders = {name: build(root, name) for name in CASES}
    args = [f"{name}={ds.root}" for name, ds in folders.items()]
    proc = subprocess.run(
        [sys.executable, str(TESTS / "ds_scripts" / "read_hostile.py"), str(root / "out"), *args],
        capture_output=True, text=True, env=_env(), timeout=CHILD_TIMEOUT_S, cwd=root,
    )  # fmt: skip
    results: dict[str, Any] = {}
    started: list[str] = []
    for line in proc.stdout.splitlines():
        entry = json.loads(line)
        if entry.get("start"):
            started.append(entry["case"])
        else:
            results[entry["case"]] = entry
    return {
        "results": results,
        "started": started,
        "returncode": proc.returncode,
        "stderr": proc.stderr,
        "root": root,
        "folders": folders,
    }


def test_child_reading_every_hostile_folder_did_not_crash(hostile: dict[str, Any]) -> None:
    crashed = (
        hostile["started"][-1] if hostile["started"] and hostile["started"][-1] not in hostile["results"] else None
    )
    assert hostile["returncode"] == 0, (
        f"reader process died (rc {hostile['returncode']}) reading {crashed}:\n{hostile['stderr'][-3000:]}"
    )
    assert set(hostile["results"]) == set(CASES)
    assert "Traceback" not in hostile["stderr"], hostile["stderr"][-3000:]
    assert not (hostile["root"] / "MARKER").exists(), "a pickled command ran"
    refused = sum(1 for r in hostile["results"].values() if r["outcome"] == "refused")
    record("hostile DeepSpeed checkpoints (read, convert, export)", cases=len(CASES), faults=refused)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_folder(hostile: dict[str, Any], name: str) -> None:
    result = hostile["results"].get(name)
    assert result is not None, f"{name}: not read (the reader process died at {hostile['started'][-1:]})"
    _, _, expected, pattern = CASES[name]
    if expected == "read":
        assert result["outcome"] == "read", result
        return
    assert result["outcome"] == "refused", result
    assert result["error"] == expected, result
    message = result["message"]
    assert len(message) < 1500, f"{name}: a {len(message)}-character message"
    assert str(hostile["folders"][name].root) in message, f"{name}: the message names no file of the folder: {message}"
    assert re.search(pattern, message), f"{name}: {message!r} does not match {pattern!r}"
    if name in SECRET_CASES:
        assert SECRET not in message and "root:" not in message, (
            f"{name}: the message shows a file's content: {message}"
        )


def test_cuda_labelled_storage_reads_as_the_same_bytes_on_cpu(tmp_path: Path) -> None:
    """GPU runs save storages labelled cuda:N; the bytes are in the file, read onto the CPU (as
    torch.load(map_location='cpu'))."""
    value = torch.arange(6, dtype=torch.float32)
    path = save_crafted({"t": Forged(value, location="cuda:3")}, tmp_path / "x.pt")
    loaded = load_file(path)
    assert loaded.value["t"].device.type == "cpu" and torch.equal(loaded.value["t"], value)
    assert loaded.mapping is not None and loaded.mapping.holds(loaded.value["t"])


def test_copy_out_never_advises_or_moves_outside_a_mapping(tmp_path: Path) -> None:
    """A meta source is refused; a heap source (outside the mapping) is copied by torch and stays intact (MADV_DONTNEED
    would zero it)."""
    loaded = load_file(save_crafted({"t": torch.arange(1 << 12, dtype=torch.float32)}, tmp_path / "x.pt"))
    assert loaded.mapping is not None
    dest = torch.empty(1 << 12)
    with pytest.raises(FormatError, match="a tensor on meta; only CPU tensors"):
        copy_out(dest, torch.empty(1 << 12, device="meta"), loaded.mapping, "x.pt")
    heap = torch.arange(1 << 12, dtype=torch.float32) + 1
    copy_out(dest, heap, loaded.mapping, "x.pt")
    assert torch.equal(dest, heap) and torch.equal(heap, torch.arange(1 << 12, dtype=torch.float32) + 1)
    copy_out(dest, loaded.value["t"], loaded.mapping, "x.pt")
    assert torch.equal(dest, loaded.value["t"])
    with pytest.raises(FormatError, match="a slice of 4096 elements where 10 are needed"):
        copy_out(torch.empty(10), loaded.value["t"], loaded.mapping, "x.pt")


def test_pickle_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte and opcode bounds are checked before a pickle is unpickled."""
    path = save_crafted({"x": list(range(1000))}, tmp_path / "x.pt")
    monkeypatch.setattr(pickle_scan, "MAX_OPCODES", 100)
    with pytest.raises(FormatError, match="more than 100 opcodes"):
        load_pt(path)
    monkeypatch.setattr(pickle_scan, "MAX_PICKLE_BYTES", 64)
    with pytest.raises(FormatError, match="more than the 64 allowed"):
        load_pt(path)


def test_restricted_loader_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = save_crafted({"x": Call(os.system, f"touch {marker}")}, tmp_path / "x.pt")
    with pytest.raises(FormatError, match=f"{path}: refused pickle: global"):
        load_pt(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is live
    assert marker.exists()


def test_not_found_is_not_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        load_pt(tmp_path / "missing.pt")


CLI_CASES = [
    ("convert", "meta_location"),
    ("export", "meta_location"),
    ("inspect", "meta_location"),
    ("convert", "latest_symlink_secret"),
    ("export", "latest_symlink_secret"),
    ("inspect", "latest_symlink_secret"),
    ("convert", "frozen_shape_bomb"),
    ("export", "stride_zero_broadcast"),
]


@pytest.mark.parametrize(("command", "name"), CLI_CASES)
def test_cli_prints_one_error_line_and_exits_1(tmp_path: Path, command: str, name: str) -> None:
    ds = build(tmp_path, name)
    args = [str(ds.root)] + ([] if command == "inspect" else [str(tmp_path / "out")])
    proc = subprocess.run(
        [sys.executable, "-m", "shardsafe.cli", command, *args], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.startswith("error: ") or "\nerror: " in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
