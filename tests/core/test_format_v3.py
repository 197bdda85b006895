"""Format version 3: N-D layout rules (mesh + placements) in the manifest, boxes in the writers' indexes.

One real 4-rank FSDP2 x TP save (``(dp=2, tp=2)``: ``_StridedShard`` weights, norms sharded on dp
and replicated on tp). Its manifest lists no chunk of any parameter or moment; it loads bit for bit
in one process. Hostile manifests whose rule lies (a mesh larger than the world, placements on
dims the tensor lacks, a writer that is no replica, a rule beside a split, a version that predates
rules; format 4's ``["at", k]`` with a coordinate outside its mesh dim, not an integer, on
every dim, in a version-3 manifest, or naming holders whose indexes do not hold the parts) and
hostile indexes (a box outside its part or outside the tensor, a box left out or listed
twice, a part written by a rank that is not its writer) are refused by load and verify with a
FormatError naming the file, and a refused load leaves the model as it was.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import nd_utils
import shardsafe
from dist_utils import run_ranks
from shardsafe.core.rule import LayoutRule
from shardsafe.errors import FormatError

STRIDED = "model/layers.0.w1.weight"  # (_StridedShard(0, sf=2), Shard(0)): FSDP2 over colwise TP
NORM = "model/norm.weight"  # (Shard(0), Replicate()): written by one replica of each part


def save_job(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = nd_utils.build("2d", rank, world_size)
    nd_utils.step(model, optimizer, 0)
    shardsafe.save(path, {"model": model, "optim": optimizer})
    return nd_utils.whole_state(model, optimizer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    work = tmp_path_factory.mktemp("v3")
    path = work / "ckpt"
    return path, run_ranks(save_job, 4, str(path), work_dir=work)[0]


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def _load_one(path: Path) -> dict[str, torch.Tensor]:
    model, optimizer = nd_utils.build("one", 0, 1, seed=7)
    shardsafe.load(path, {"model": model, "optim": optimizer})
    return nd_utils.whole_state(model, optimizer)


def _writer_file(path: Path, key: str) -> tuple[str, str]:
    """(shard, index) of a rank whose index holds a box of ``key``."""
    manifest = _manifest(path)
    for name, f in sorted(manifest["files"].items()):
        if "index" in f and key in json.loads((path / f["index"]["file"]).read_text())["chunks"]:
            return name, f["index"]["file"]
    raise AssertionError(f"no index holds {key}")


def test_the_manifest_holds_rules_and_loads_in_one_process(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, reference = saved
    manifest = _manifest(path)
    assert manifest["format_version"] == 3 and manifest["world_size"] == 4
    for key, entry in manifest["tensors"].items():
        if not key.endswith("/step"):
            assert "layout" in entry and "chunks" not in entry, key
    assert manifest["tensors"][STRIDED]["layout"]["placements"] == [["strided", 0, 2], ["shard", 0]]
    assert manifest["tensors"][NORM]["layout"]["placements"] == [["shard", 0], ["replicate"]]
    # Every rank writes (the parts of the TP-sharded weights), and the norms' parts (replicated on
    # tp) are each written by one replica, the one the rule names.
    assert sorted(f["rank"] for f in manifest["files"].values() if "index" in f) == [0, 1, 2, 3]
    norm = LayoutRule.from_json(manifest["tensors"][NORM]["layout"], "manifest")
    for part in range(norm.parts):
        holders = [r for r in range(4) if norm.part_of(r) == part]
        assert len(holders) == 2 and [r for r in holders if norm.writes(r)] == [norm.writer_of(part)]
    assert shardsafe.verify(path)["indexes"] == 4
    got = _load_one(path)
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(got[key], value), key


def _copy(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(saved[0], dest)
    return dest


def _rewrite_index(path: Path, key: str, edit: Callable[[list[dict[str, Any]]], Any]) -> str:
    """Edit the boxes of ``key`` in its writer's index and record the new size and hash in the
    manifest: the integrity chain holds, the content lies. Returns the index's name."""
    shard, name = _writer_file(path, key)
    index = json.loads((path / name).read_text())
    boxes = index["chunks"][key]
    boxes = boxes if isinstance(boxes, list) else [boxes]
    index["chunks"][key] = edit(boxes)
    data = json.dumps(index).encode()
    (path / name).write_bytes(data)
    manifest = _manifest(path)
    manifest["files"][shard]["index"].update(size=len(data), hash=xxhash.xxh3_64(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return name


def _refused(path: Path, name: str, match: str) -> None:
    with pytest.raises(FormatError, match=match) as info:
        shardsafe.verify(path)
    assert name in str(info.value)
    model, optimizer = nd_utils.build("one", 0, 1, seed=7)
    before = nd_utils.whole_state(model, optimizer)
    with pytest.raises(FormatError, match=match):
        shardsafe.load(path, {"model": model, "optim": optimizer})
    after = nd_utils.whole_state(model, optimizer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the model"


def _shifted(boxes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    boxes[0]["offsets"] = [boxes[0]["offsets"][0] + 1, 0]
    return boxes


def _outside(boxes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    boxes[0]["offsets"] = [100, 0]
    return boxes


def _left_out(boxes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return boxes[:-1]


def _twice(boxes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [boxes[0], boxes[0]]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_shifted, "contradicts the layout rule"),
        (_outside, "contradicts the layout rule"),
        (_left_out, "lists (no box|0 boxes)"),
        (_twice, "twice|lists 2 boxes"),
    ],
    ids=lambda v: getattr(v, "__name__", "").strip("_") or None,
)
def test_hostile_index_boxes_are_refused(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, edit: Any, match: str
) -> None:
    path = _copy(saved, tmp_path)
    name = _rewrite_index(path, STRIDED, edit)
    _refused(path, name, match)


def _edit_rule(key: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["tensors"][key]["layout"].update(fields)

    return edit


def _both_rules(manifest: dict[str, Any]) -> None:
    manifest["tensors"][NORM]["split"] = {"dim": 0, "parts": 4, "size": 2}


def _not_a_box(manifest: dict[str, Any]) -> None:
    shard = sorted(manifest["files"])[0]
    manifest["tensors"][NORM]["chunks"] = [
        {"offsets": [1], "shape": [3], "file": shard, "begin": 0, "end": 12, "hashes": ["0"]}
    ]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_edit_rule(NORM, mesh=[4, 2]), "does not span"),
        (_edit_rule(NORM, mesh=[4]), "one placement per mesh dim"),
        (_edit_rule(STRIDED, placements=[["strided", 5, 2], ["shard", 0]]), "does not split"),
        (_edit_rule(NORM, writer=2), "writer"),
        (_edit_rule(NORM, placements=[["replicate"], ["replicate"]]), "shards nothing"),
        (_edit_rule(NORM, placements=[["shard", 0], "R"]), "placement"),
        (_both_rules, "not both"),
        (lambda m: m.update(format_version=2), "format version 3 field"),
        (_not_a_box, "not a part of its layout rule"),
        # ["at", k] (format 4: a pipeline stage's tensors)
        (_edit_rule(NORM, placements=[["shard", 0], ["at", 2]]), r"coordinate outside 0\.\.1"),
        (_edit_rule(NORM, placements=[["shard", 0], ["at", -1]]), r"coordinate outside 0\.\.1"),
        (_edit_rule(NORM, placements=[["shard", 0], ["at", True]]), "placement"),
        (_edit_rule(NORM, placements=[["shard", 0], ["at", "0"]]), "placement"),
        (_edit_rule(NORM, placements=[["at", 0], ["at", 1]]), "shards nothing"),
        (_edit_rule(NORM, placements=[["shard", 0], ["at", 0]]), "format version 4 field"),
    ],
)
def test_hostile_layout_rules_are_refused(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, edit: Any, match: str
) -> None:
    path = _copy(saved, tmp_path)
    manifest = _manifest(path)
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _refused(path, "manifest.json", match)


def test_a_writer_that_is_not_the_rule_s_is_refused(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """The manifest names other replicas as writers than the ranks whose indexes hold the parts."""
    path = _copy(saved, tmp_path)
    manifest = _manifest(path)
    rule = manifest["tensors"][NORM]["layout"]
    rule["writer"] = 1 - rule["writer"]
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _refused(path, "index.json", "writes under the layout rule")


def test_a_stage_rule_whose_holders_did_not_write_is_refused(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A format 4 rule that says only the tp=1 ranks hold the norm, while a tp=0 rank's index holds a part of it."""
    path = _copy(saved, tmp_path)
    manifest = _manifest(path)
    manifest["format_version"] = 4
    manifest["tensors"][NORM]["layout"].update(placements=[["shard", 0], ["at", 1]], writer=0)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _refused(path, "index.json", "writes under the layout rule")
