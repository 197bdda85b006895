"""Format version 2: split rules instead of per-rank chunk lists, and per-rank index files.

A 16-rank FSDP2 save lists no per-rank chunk of any regular tensor, and its ``tensors`` section is
the size of a 4-rank save's; loading it on one rank (16 -> 1) gives back what the job held. Damaged
or hostile index files (wrong hash, truncated, missing, entries outside the file, over the header,
overlapping, contradicting the rule, a part left out) are refused by load and by verify, naming
the file.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

import shardsafe
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    save_trained,
)
from shardsafe.errors import FormatError, IntegrityError, ShardsafeError

RANK1_FILE = "shard-00001.safetensors"
RANK1_INDEX = "shard-00001.index.json"
KEY = "model/layers.1.weight"  # 13 x 7: 7 rows on rank 0, 6 on rank 1
# A chunk listed beside the rule (as dedup lists parts stored in a sibling) must be exactly one part.
NOT_A_PART = {"offsets": [1, 0], "shape": [6, 7], "file": RANK1_FILE, "begin": 0, "end": 168, "hashes": ["0"]}


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _load_one_rank(path: Path) -> dict[str, Any]:
    model = make_model(seed=4321)
    optimizer = make_optimizer(model, lr=0.5)
    shardsafe.load(path, {"model": model, "optim": optimizer})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("v2")
    path = work / "ckpt"
    reference = run_ranks(save_trained, 2, str(path), 5, work_dir=work)[0]
    return path, reference


def test_sixteen_ranks_list_no_per_rank_chunks(tmp_path: Path) -> None:
    sizes = {}
    for world in (4, 16):
        path = tmp_path / f"w{world}"
        reference = run_ranks(save_trained, world, str(path), 11, work_dir=tmp_path / f"work{world}", timeout=400)[0]
        manifest = _manifest(path)
        assert manifest["format_version"] == 2 and manifest["world_size"] == world
        for key, entry in manifest["tensors"].items():
            if entry["shape"] and key.rsplit("/", 1)[-1].rsplit(".", 1)[-1] in (
                "weight",
                "bias",
                "exp_avg",
                "exp_avg_sq",
            ):
                assert entry["split"] == {"dim": 0, "parts": world, "size": -(-entry["shape"][0] // world)}, key
                assert "chunks" not in entry, key
            else:  # replicated: the buffer, the step counters - one chunk each, whatever the world size
                assert "split" not in entry and len(entry["chunks"]) == 1, key
        indexed = sorted(f["index"]["file"] for f in manifest["files"].values() if "index" in f)
        assert indexed == sorted(p.name for p in path.glob("*.index.json")) and len(indexed) >= world // 2
        sizes[world] = len(re.sub(r"\d+", "0", json.dumps(manifest["tensors"])))  # numbers aside
        assert shardsafe.verify(path)["indexes"] == len(indexed)
        got = _load_one_rank(path)  # world -> 1: every part of every rule, through the indexes
        assert_tensors_equal(got["model"], reference["model"], f"model saved on {world} ranks")
        assert_optimizer_equal(got["optim"], reference["optim"], f"optimizer saved on {world} ranks")
    assert sizes[4] == sizes[16], sizes  # the tensors section does not grow with the world size


def _copy(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(saved[0], dest)
    return dest


def _rewrite_index(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit rank 1's index and record its new size and hash in the manifest: the chain holds, the content lies."""
    index = json.loads((path / RANK1_INDEX).read_text())
    edit(index)
    data = json.dumps(index).encode()
    (path / RANK1_INDEX).write_bytes(data)
    manifest = _manifest(path)
    manifest["files"][RANK1_FILE]["index"].update(size=len(data), hash=xxhash.xxh3_64(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _refused(path: Path, error: type[ShardsafeError], *names: str) -> None:
    for attempt in (lambda: shardsafe.verify(path), lambda: _load_one_rank(path)):
        with pytest.raises(error) as info:
            attempt()
        assert any(name in str(info.value) for name in names), str(info.value)


def test_two_rank_checkpoint_round_trips_and_verifies(saved: tuple[Path, dict[str, Any]]) -> None:
    path, reference = saved
    assert shardsafe.verify(path)["indexes"] == 2
    got = _load_one_rank(path)
    assert_tensors_equal(got["model"], reference["model"], "model")
    assert_optimizer_equal(got["optim"], reference["optim"], "optimizer")


def test_index_with_wrong_hash_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    data = bytearray((path / RANK1_INDEX).read_bytes())
    position = data.index(b'"hashes"') + 12
    data[position] = ord("0") if data[position] != ord("0") else ord("1")
    (path / RANK1_INDEX).write_bytes(bytes(data))
    _refused(path, IntegrityError, RANK1_INDEX)


def test_truncated_index_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    data = (path / RANK1_INDEX).read_bytes()
    (path / RANK1_INDEX).write_bytes(data[: len(data) // 2])
    _refused(path, IntegrityError, RANK1_INDEX)


def test_missing_index_is_refused(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / RANK1_INDEX).unlink()
    _refused(path, IntegrityError, RANK1_INDEX)


def _end_past_file(index: dict[str, Any]) -> None:
    chunk = index["chunks"][KEY]
    size = chunk["end"] - chunk["begin"]
    chunk["begin"], chunk["end"] = 10**9, 10**9 + size


def _over_header(index: dict[str, Any]) -> None:
    chunk = index["chunks"][KEY]
    chunk["end"] -= chunk["begin"]
    chunk["begin"] = 0


def _overlapping(index: dict[str, Any]) -> None:
    chunks = index["chunks"]
    other = chunks["model/layers.1.bias"]
    size = other["end"] - other["begin"]
    other["begin"] = chunks[KEY]["begin"]
    other["end"] = other["begin"] + size


def _contradicts_rule(index: dict[str, Any]) -> None:
    index["chunks"][KEY]["offsets"] = [6, 0]


def _part_left_out(index: dict[str, Any]) -> None:
    del index["chunks"][KEY]


def _other_rank(index: dict[str, Any]) -> None:
    index["rank"] = 0


def _unknown_tensor(index: dict[str, Any]) -> None:
    index["chunks"]["model/nothing"] = index["chunks"].pop(KEY)


@pytest.mark.parametrize(
    ("edit", "error", "names"),
    [
        (_end_past_file, FormatError, (RANK1_INDEX,)),
        (_over_header, FormatError, (RANK1_FILE,)),  # the shard's own safetensors header disagrees
        (_overlapping, FormatError, (RANK1_INDEX,)),
        (_contradicts_rule, FormatError, (RANK1_INDEX,)),
        (_part_left_out, FormatError, (RANK1_INDEX,)),
        (_other_rank, FormatError, (RANK1_INDEX,)),
        (_unknown_tensor, FormatError, (RANK1_INDEX,)),
    ],
    ids=lambda v: getattr(v, "__name__", "").strip("_") or None,
)
def test_hostile_index_is_refused(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, edit: Any, error: Any, names: Any
) -> None:
    path = _copy(saved, tmp_path)
    _rewrite_index(path, edit)
    _refused(path, error, *names)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["tensors"][KEY]["split"].update(size=3), "does not split"),
        (lambda m: m["tensors"][KEY]["split"].update(parts=3), "does not split"),
        (lambda m: m["tensors"][KEY]["split"].update(dim=1), "does not split"),
        (lambda m: m.update(format_version=1), "format version 2 field"),
        (lambda m: m["files"][RANK1_FILE]["index"].update(file="../x.index.json"), "unsafe"),
        (lambda m: m["files"][RANK1_FILE]["index"].update(file="shard-00000.safetensors"), "must be named"),
        (lambda m: m["files"][RANK1_FILE].update(rank=0), "second indexed file"),
        (
            lambda m: m["tensors"][KEY].update(chunks=[NOT_A_PART]),
            "not a part",
        ),
    ],
)
def test_hostile_split_rules_are_refused(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, edit: Any, message: str
) -> None:
    path = _copy(saved, tmp_path)
    manifest = _manifest(path)
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with pytest.raises(FormatError, match=message) as info:
        shardsafe.verify(path)
    assert "manifest.json" in str(info.value)


def test_verify_checks_every_index(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A load at the saved world size reads only its own rank's index; verify reads them all."""
    path = _copy(saved, tmp_path)
    _rewrite_index(path, _part_left_out)
    with pytest.raises(FormatError, match=re.escape(RANK1_INDEX)):
        shardsafe.verify(path)
