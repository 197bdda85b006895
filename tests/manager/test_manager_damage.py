"""A damaged old checkpoint never stops a manager root (issue 11.6): retention, dedup saves,
``list`` and ``gc`` skip it, name it in a warning, and never delete it.

Damage is each way a manifest goes bad on disk: not JSON, cut short, or valid JSON that fails
validation. Every test uses real saves, loads and the real CLI on one process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.cli.main import main
from shardsafe.manager.catalog import committed_steps, list_root, read_manifest
from shardsafe.manager.gc import collect
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.manager.naming import step_name

DAMAGE = ["not-json", "truncated", "invalid"]


def damage(folder: Path, kind: str) -> None:
    """Spoil ``folder``'s manifest the way ``kind`` says (replacing the file: it may be read-only)."""
    manifest = folder / "manifest.json"
    data = manifest.read_bytes()
    if kind == "not-json":
        bad = b"\x00\xffnot a manifest"
    elif kind == "truncated":
        bad = data[: len(data) // 2]
    else:
        raw = json.loads(data)
        raw["world_size"] = 0  # well-formed JSON, refused by validation
        bad = json.dumps(raw).encode()
    manifest.unlink()
    manifest.write_bytes(bad)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": nn.Linear(8, 4), "step": seed}


def _warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and name in r.getMessage()]


@pytest.mark.parametrize("kind", DAMAGE)
def test_retention_skips_a_damaged_checkpoint_and_keeps_working(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(root, keep_last=2) as manager:
            manager.save(1, _state(1))
            manager.save(2, _state(2))
            damage(root / step_name(1), kind)
            for step in (3, 4, 5):
                manager.save(step, _state(step))
            assert manager.retention_errors == []
    assert committed_steps(root) == [1, 4, 5], "steps 2 and 3 retired; the damaged step 1 neither counted nor deleted"
    assert (root / step_name(1) / "manifest.json").exists()
    warned = _warnings(caplog, str(root / step_name(1)))
    assert len(warned) == 1 and "damaged" in warned[0], warned  # named, once per manager


@pytest.mark.parametrize("kind", DAMAGE)
def test_dedup_save_reuses_the_newest_readable_checkpoint(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    frozen = nn.Linear(64, 64)  # unchanged from save to save: stored once
    head = nn.Linear(64, 2)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(root, dedup=True) as manager:
            manager.save(1, {"frozen": frozen, "head": head})
            with torch.no_grad():
                head.weight.add_(1.0)
            manager.save(2, {"frozen": frozen, "head": head})
            damage(root / step_name(2), kind)
            with torch.no_grad():
                head.weight.add_(1.0)
            assert manager.save(3, {"frozen": frozen, "head": head})
    chunks = read_manifest(root / step_name(3)).tensors["frozen/weight"].chunks
    assert {c.checkpoint for c in chunks} == {step_name(1)}, "referenced from step 1, not from the damaged step 2"
    loaded = {"frozen": nn.Linear(64, 64), "head": nn.Linear(64, 2)}
    shardsafe.load(root / step_name(3), loaded)
    assert torch.equal(loaded["frozen"].weight, frozen.weight) and torch.equal(loaded["head"].weight, head.weight)
    assert _warnings(caplog, str(root / step_name(2)))


@pytest.mark.parametrize("kind", DAMAGE)
def test_list_shows_a_damaged_checkpoint_as_skipped(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root, best_metric="loss") as manager:  # no retention: all three stay
        for step, loss in ((1, 0.5), (2, 2.0), (3, 1.0)):
            manager.save(step, _state(step), metrics={"loss": loss})
    damage(root / step_name(1), kind)  # the best by loss
    damage(root / step_name(3), kind)  # and the newest
    infos = shardsafe.list_checkpoints(root)
    assert [(i.step, i.latest, i.best) for i in infos] == [(2, True, True)], "the newest readable one is the latest"
    listing = list_root(root)
    assert [d.step for d in listing.damaged] == [1, 3] and all("manifest.json" in d.reason for d in listing.damaged)

    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line.strip() and not line.startswith("note")]
    assert [(r[0], "damaged" in r) for r in rows] == [("1", True), ("2", False), ("3", True)], out
    assert "2 damaged checkpoint(s) skipped" in out
    assert main(["list", str(root), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["damaged"] is not None, r["latest"]) for r in table] == [
        (1, True, False),
        (2, False, True),
        (3, True, False),
    ]


def test_list_of_a_root_with_only_damaged_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    shardsafe.save(root / step_name(4), _state(4))
    damage(root / step_name(4), "truncated")
    assert shardsafe.list_checkpoints(root) == []
    assert main(["list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "no committed checkpoints" not in out


@pytest.mark.parametrize("kind", DAMAGE)
def test_gc_leaves_a_damaged_checkpoint_and_reports_it(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    damage(root / step_name(1), kind)
    leftover = root / ".step-0000000003.shardsafe-tmp-0123456789ab"
    leftover.mkdir()
    report = collect(root)
    assert report.removed == [leftover] and [d.step for d in report.damaged] == [1]
    assert sorted(p.name for p in root.iterdir() if p.name != LEASE_DIR) == [step_name(1), step_name(2)]
    assert len(list((root / step_name(1)).iterdir())) > 1, "the damaged checkpoint's files are all still there"
    assert main(["gc", str(root), "--min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert f"left damaged checkpoint {root / step_name(1)}" in out and "removed 0 entries" in out
    assert (root / step_name(1) / "manifest.json").exists()


def test_gc_keeps_stored_once_data_a_damaged_checkpoint_may_reference(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 was retired but keeps the frozen weights step 2 points into; step 2's manifest is then damaged:
    nobody can tell what step 2 references any more, so step 1's files stay."""
    root = tmp_path / "ckpt"
    frozen, head = nn.Linear(64, 64), nn.Linear(64, 2)
    with shardsafe.CheckpointManager(root, keep_last=1, dedup=True) as manager:
        manager.save(1, {"frozen": frozen, "head": head})
        with torch.no_grad():
            head.weight.add_(1.0)
        manager.save(2, {"frozen": frozen, "head": head})
    assert committed_steps(root) == [2] and (root / step_name(1)).is_dir()
    kept = sorted(p.name for p in (root / step_name(1)).iterdir())
    damage(root / step_name(2), "truncated")
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        report = collect(root)
    assert report.removed == [] and report.left == [root / step_name(1)]
    assert sorted(p.name for p in (root / step_name(1)).iterdir()) == kept
    assert any("may reference" in m for m in _warnings(caplog, str(root)))


def test_gc_treats_a_manifest_that_is_not_a_file_as_damage(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shardsafe.save(root / step_name(1), _state(1))
    (root / step_name(1) / "manifest.json").unlink()
    (root / step_name(1) / "manifest.json").symlink_to(tmp_path / "nowhere")
    report = collect(root)
    assert report.removed == [] and [d.step for d in report.damaged] == [1]
    assert (root / step_name(1)).is_dir()


def test_a_renamed_step_folder_is_passed_over_before_anything_is_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A root step folder renamed by hand (its manifest records another step) would restore as a step
    it is not, and the run would go on saving under later step names: restore skips it, naming both
    steps, and loads the older real one; nothing of the renamed one reaches the state."""
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    (root / step_name(2)).rename(root / step_name(7))
    state = _state(0)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(root) as manager:
            assert manager.restore(state) == 1
            assert [step for step, _ in manager.skipped] == [7]
    assert torch.equal(state["model"].weight, _state(1)["model"].weight) and state["step"] == 1
    assert any("name says step 7 but its manifest records step 2" in m for m in _warnings(caplog, step_name(7)))


def test_a_renamed_local_tier_step_falls_back_to_the_root(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same in the local tier: its step folder renamed to a newer step is refused (the root loads)."""
    root, local = tmp_path / "ckpt", tmp_path / "local-{node}"
    manager = shardsafe.CheckpointManager(root, save_every=2, local_every=1, local_dir=local)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    manager.wait()
    manager._tier_worker.join()  # the tier's write of step 3 is done; then the job "dies" (no close)
    (folder,) = [p for p in Path(str(local).replace("{node}", "*")).parent.glob("local-*/*") if p.is_dir()]
    (folder / step_name(3)).rename(folder / step_name(9))
    manager.lease.release()  # in this one process, the next "job" would otherwise wait for the lease
    state = _state(0)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(root, save_every=2, local_every=1, local_dir=local) as again:
            assert again.restore(state) == 2 and again.restored_from == "root"
    assert torch.equal(state["model"].weight, _state(2)["model"].weight)
    assert any("name says step 9 but its manifest records step 3" in m for m in _warnings(caplog, "local tier"))
