"""shardsafe.integrations.lightning: real Lightning Trainers (CPU, gloo) save through shardsafe and resume on
other world sizes and layouts bit-exactly; ModelCheckpoint's rotation, "last" and "best" on folders; what is
refused at save; another run's checkpoints are never replaced or deleted."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning_scripts"))

import lit_utils  # noqa: E402

import shardsafe  # noqa: E402
from dist_utils import assert_optimizer_equal, assert_tensors_equal, run_ranks  # noqa: E402

EVERY_EPOCH = {"every_n_epochs": 1, "save_top_k": -1, "save_last": True}


def _fit(world: int, root: Path, layout: str, epochs: int, work: Path, **kw: Any) -> dict[str, Any]:
    results = run_ranks(lit_utils.fit_run, world, str(root), layout, epochs, *_args(kw), work_dir=work, timeout=300)
    return results[0]


def _args(kw: dict[str, Any]) -> tuple[Any, ...]:
    return (kw.get("ckpt_path"), kw.get("checkpoint"), kw.get("hparams"), kw.get("module_layout"))


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """2 ranks, FSDP2: 2 epochs (4 steps), a checkpoint each epoch and last.ckpt."""
    root = tmp_path_factory.mktemp("lightning-first")
    return root, _fit(2, root, "fsdp", 2, root / "work", checkpoint=EVERY_EPOCH)


def _assert_resumed_exactly(resumed: dict[str, Any], saved: dict[str, Any], what: str) -> None:
    model, optim = resumed["start"]
    assert_tensors_equal(model, saved["end"][0], f"{what}: params")
    assert_optimizer_equal(optim, saved["end"][1], f"{what}: optimizer")


def test_checkpoints_are_shardsafe_folders(first: tuple[Path, dict[str, Any]]) -> None:
    root, result = first
    names = sorted(p.name for p in (root / "ckpts").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    summary = shardsafe.verify(root / "ckpts" / "last.ckpt")
    assert summary["world_size"] == 2
    tree = json.loads((root / "ckpts" / "last.ckpt" / "state.json").read_text())
    assert sorted(tree) == ["lightning", "optimizer_0", "state_dict"]
    rest = tree["lightning"]["state"]
    assert rest["global_step"] == 4 and rest["epoch"] == 1
    assert "loops" in rest and "callbacks" in rest and "lr_schedulers" in rest
    assert rest["hyper_parameters"]["layout"] == "fsdp"
    assert result["last"].endswith("last.ckpt")


def test_resume_on_one_process_plain(first: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """2 FSDP2 ranks -> 1 process, plain module: params and AdamW moments bit-exact, the loop continues."""
    root, saved = first
    resumed = _fit(1, root, "plain", 4, tmp_path, ckpt_path=str(root / "ckpts" / "last.ckpt"), checkpoint=EVERY_EPOCH)
    _assert_resumed_exactly(resumed, saved, "2 ranks -> 1")
    assert resumed["global_step"] == 8 and len(resumed["losses"]) == 4
    reference = _fit(2, tmp_path / "ref", "fsdp", 4, tmp_path / "work-ref")
    assert resumed["losses"] == pytest.approx(reference["losses"][4:], rel=1e-5)
    assert resumed["lr"] == reference["lr"]
