"""Damaged checkpoints are detected, and strict loading refuses misfits before touching anything.

A 2-rank FSDP2 job writes one checkpoint; each test damages a copy of it (a flipped byte, a
truncated or missing shard file, a broken manifest or state.json). ``shardsafe.verify`` and
``shardsafe.load`` must both raise the right :mod:`shardsafe.errors` class with a message naming
the file (and, for a hash mismatch, the tensor key) - in this process and on every rank of a job.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash

import shardsafe
from dist_utils import (
    DIMS,
    Net,
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    shard,
    train,
)
from reliability import record
from shardsafe.errors import FormatError, IntegrityError, ShardsafeError, StateMismatchError

WORLD = 2
CORRUPT_KEY = "model/layers.1.weight"  # 13 rows: rank 0 writes rows 0-6, rank 1 rows 7-12
RANK1_FILE = "shard-00001.safetensors"
RANK0_FILE = "shard-00000.safetensors"


def save_base(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = shard(make_model(3), world_size)
    optimizer = make_optimizer(model)
    train(model, optimizer, steps=2, rank=rank, seed=3)
    shardsafe.save(path, {"model": model, "optim": optimizer, "extra": {"note": "base"}})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("corruption-base")
    path = work / "base"
    reference = run_ranks(save_base, WORLD, str(path), work_dir=work)[0]
    shardsafe.verify(path)
    assert {p.name for p in path.glob("*.safetensors")} == {RANK0_FILE, RANK1_FILE}
    return path, reference


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _index_name(path: Path, file: str) -> str:
    return _manifest(path)["files"][file]["index"]["file"]


def _chunk(path: Path, key: str, file: str) -> dict[str, Any]:
    """A split tensor's part in ``file``: format version 2 keeps it in the file's per-rank index."""
    return json.loads((path / _index_name(path, file)).read_text())["chunks"][key]


# Each corruption damages the copy at ``path`` and returns (expected error class, file it must name, key it must name).


def flip_shard_byte(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    chunk = _chunk(path, CORRUPT_KEY, RANK1_FILE)
    target = path / RANK1_FILE
    data = bytearray(target.read_bytes())
    data[(chunk["begin"] + chunk["end"]) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return IntegrityError, RANK1_FILE, CORRUPT_KEY


def truncate_shard(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    target = path / RANK0_FILE
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size - 10)
    return IntegrityError, RANK0_FILE, None


def remove_shard(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    (path / RANK1_FILE).unlink()
    return IntegrityError, RANK1_FILE, None


def truncate_manifest(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    target = path / "manifest.json"
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    return FormatError, "manifest.json", None


def garble_manifest(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    target = path / "manifest.json"
    data = bytearray(target.read_bytes())
    data[data.index(b'"tensors"') + 1] = 0xFF  # not UTF-8 any more
    target.write_bytes(bytes(data))
    return FormatError, "manifest.json", None


def alter_manifest_hash(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    """Valid JSON, but a block hash that the stored bytes do not have: the hash lives in rank 1's
    index (format version 2), which is rewritten with the manifest's record of it updated, so the
    chain manifest -> index holds and only the block hash is wrong."""
    manifest = _manifest(path)
    name = _index_name(path, RANK1_FILE)
    index = json.loads((path / name).read_text())
    chunk = index["chunks"][CORRUPT_KEY]
    digest = chunk["hashes"][0]
    chunk["hashes"][0] = ("0" if digest[0] != "0" else "1") + digest[1:]
    data = json.dumps(index).encode()
    (path / name).write_bytes(data)
    manifest["files"][RANK1_FILE]["index"].update(size=len(data), hash=xxhash.xxh3_64(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return IntegrityError, RANK1_FILE, CORRUPT_KEY


def flip_state_byte(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    target = path / "state.json"
    data = bytearray(target.read_bytes())
    position = data.index(b"base")
    data[position] = ord("B")
    target.write_bytes(bytes(data))
    return IntegrityError, "state.json", None


def remove_state(path: Path) -> tuple[type[ShardsafeError], str, str | None]:
    (path / "state.json").unlink()
    return IntegrityError, "state.json", None


CORRUPTIONS: dict[str, Callable[[Path], tuple[type[ShardsafeError], str, str | None]]] = {
    "flipped-shard-byte": flip_shard_byte,
    "truncated-shard": truncate_shard,
    "missing-shard": remove_shard,
    "truncated-manifest": truncate_manifest,
    "garbled-manifest": garble_manifest,
    "manifest-hash-altered": alter_manifest_hash,
    "flipped-state-byte": flip_state_byte,
    "missing-state": remove_state,
}


def _damaged_copy(base_path: Path, dest: Path, name: str) -> tuple[type[ShardsafeError], str, str | None]:
    shutil.copytree(base_path, dest)
    shardsafe.verify(dest)  # intact before the damage
    return CORRUPTIONS[name](dest)


def _load_state() -> dict[str, Any]:
    model = make_model(11)
    return {"model": model, "optim": make_optimizer(model), "extra": None}


def _check_message(message: str, path: Path, file: str, key: str | None) -> None:
    assert str(path / file) in message, f"the error does not name the file {path / file}: {message}"
    if key is not None:
        assert key in message, f"the error does not name the tensor {key}: {message}"


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corruption_detected_by_verify_and_load(base: tuple[Path, dict[str, Any]], tmp_path: Path, name: str) -> None:
    path = tmp_path / "damaged"
    cls, file, key = _damaged_copy(base[0], path, name)
    with pytest.raises(cls) as verify_error:
        shardsafe.verify(path)
    _check_message(str(verify_error.value), path, file, key)
    if key is not None:
        assert "hash mismatch" in str(verify_error.value)
    with pytest.raises(cls) as load_error:
        shardsafe.load(path, _load_state())
    _check_message(str(load_error.value), path, file, key)
    record("damaged checkpoint files (test_corruption.py)", faults=1)


def test_intact_copy_loads_exactly(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The control for the tests above: the undamaged checkpoint loads, bit for bit."""
    path = tmp_path / "copy"
    shutil.copytree(base[0], path)
    state = _load_state()
    shardsafe.load(path, state)
    assert_tensors_equal(full_model_state(state["model"]), base[1]["model"], "model")
    assert_optimizer_equal(full_optimizer_state(state["model"], state["optim"]), base[1]["optim"], "optimizer")
    assert state["extra"] == {"note": "base"}


def load_damaged(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Load every damaged copy on every rank; report what each raised."""
    out = {}
    for name, path in paths.items():
        model = shard(make_model(11), world_size)
        try:
            shardsafe.load(path, {"model": model, "optim": make_optimizer(model), "extra": None})
        except ShardsafeError as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("no error", "")
    return out


def test_corruption_detected_on_every_rank(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """In a 2-rank job only one rank may read the damaged bytes; every rank must raise the same error."""
    expected, paths = {}, {}
    for name in CORRUPTIONS:
        path = tmp_path / name
        expected[name] = (path, *_damaged_copy(base[0], path, name))
        paths[name] = str(path)
    reports = run_ranks(load_damaged, WORLD, paths, work_dir=tmp_path)
    for name, (path, cls, file, key) in expected.items():
        for rank in range(WORLD):
            got_cls, message = reports[rank][name]
            assert got_cls == cls.__name__, f"{name}: rank {rank} raised {got_cls}: {message}"
            _check_message(message, path, file, key)


# ----------------------------------------------------------------------------- strict loading


class Misfit(Net):
    """Net with one layer resized (shape mismatches), a parameter added (missing) and the buffer gone (unexpected)."""

    def __init__(self) -> None:
        super().__init__(dims=(DIMS[0], DIMS[1], DIMS[2] - 2, *DIMS[3:]))
        del self.scale
        self.gain = torch.nn.Parameter(torch.ones(3))


EXPECTED_PROBLEMS = [
    "missing in checkpoint: model/gain",
    "unexpected in checkpoint: model/scale",
    "shape mismatch for model/layers.1.weight",
    "shape mismatch for model/layers.1.bias",
    "shape mismatch for model/layers.2.weight",
]


def _misfit_state(world_size: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(5)
    model = Misfit()
    if world_size > 1:
        shard(model, world_size)
    optimizer = make_optimizer(model)
    train_misfit(model, optimizer, rank)
    return {"model": model, "optim": optimizer}


def train_misfit(model: Any, optimizer: Any, rank: int) -> None:
    """One step, so the optimizer holds state that a failed load must leave alone."""
    torch.manual_seed(rank)
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def strict_load_misfit(rank: int, world_size: int, path: str) -> dict[str, Any]:
    state = _misfit_state(world_size, rank)
    before = {"model": full_model_state(state["model"]), "optim": full_optimizer_state(state["model"], state["optim"])}
    error = None
    try:
        shardsafe.load(path, state)
    except ShardsafeError as exc:
        error = (type(exc).__name__, str(exc))
    after = {"model": full_model_state(state["model"]), "optim": full_optimizer_state(state["model"], state["optim"])}
    return {"error": error, "before": before, "after": after}


def _check_strict(report: dict[str, Any], what: str) -> None:
    assert report["error"] is not None, f"{what}: a misfit checkpoint loaded without error"
    cls, message = report["error"]
    assert cls == StateMismatchError.__name__, f"{what}: {cls}: {message}"
    for problem in EXPECTED_PROBLEMS:  # all of them, in one error
        assert problem in message, f"{what}: {problem!r} not reported in:\n{message}"
    assert_tensors_equal(report["after"]["model"], report["before"]["model"], f"{what}: model changed by a failed load")
    assert_optimizer_equal(
        report["after"]["optim"], report["before"]["optim"], f"{what}: optimizer changed by a failed load"
    )


def test_strict_load_reports_all_problems_before_modifying_anything(base: tuple[Path, dict[str, Any]]) -> None:
    assert not dist.is_initialized()
    _check_strict(strict_load_misfit(0, 1, str(base[0])), "1 rank")


def test_strict_load_reports_all_problems_on_every_rank(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    for rank, report in enumerate(run_ranks(strict_load_misfit, WORLD, str(base[0]), work_dir=tmp_path)):
        _check_strict(report, f"rank {rank} of {WORLD}")


def test_failed_load_leaves_a_fresh_optimizer_fresh(base: tuple[Path, dict[str, Any]]) -> None:
    """A load that fails must not leave optimizer state behind (it would change the next step)."""
    torch.manual_seed(5)
    model = Misfit()
    optimizer = make_optimizer(model)
    before = full_model_state(model)
    with pytest.raises(StateMismatchError):
        shardsafe.load(base[0], {"model": model, "optim": optimizer})
    assert not optimizer.state, "the failed load created optimizer state"
    assert all(p.grad is None for p in model.parameters())
    assert_tensors_equal(full_model_state(model), before, "model")
