"""CheckpointManager defaults that must never silently do nothing (issue 11.2), and step naming.

One process, real saves and loads: ``save(step, state)`` with default arguments writes a
checkpoint on every call; ``save_every`` is the only thing that makes a call skip; bad option
values are refused at construction, not discovered as missing checkpoints later.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import NoLoadableCheckpointError
from shardsafe.manager.catalog import committed_steps
from shardsafe.manager.naming import STEP_NAMING, StepNaming, step_name


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": nn.Linear(4, 3), "step": step}


def test_save_with_defaults_saves_on_every_call(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root) as manager:
        assert manager.save_every is None and manager.should_save(7)
        saved = [manager.save(step, _state(step)) for step in (1, 2, 5)]
    assert saved == [True, True, True]
    assert committed_steps(root) == [1, 2, 5]
    restored = {"model": nn.Linear(4, 3), "step": None}
    assert shardsafe.CheckpointManager(root).restore(restored) == 5
    assert restored["step"] == 5 and torch.equal(restored["model"].weight, _state(5)["model"].weight)


def test_save_every_saves_multiples_and_force_always_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root, save_every=3) as manager:
        saved = {step: manager.save(step, _state(step)) for step in range(1, 7)}
        assert manager.save(4, _state(4), force=True)
    assert [s for s, did in saved.items() if did] == [3, 6]
    assert committed_steps(root) == [3, 4, 6]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"save_every": 0}, "save_every"),
        ({"save_every": -5}, "save_every"),
        ({"save_every": True}, "save_every"),
        ({"save_every": 2.5}, "save_every"),
        ({"keep_last": -1}, "keep_last"),
        ({"keep_best": -1, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": 1}, "best_metric"),
        ({"best_mode": "lowest"}, "best_mode"),
        ({"async_save": "yes"}, "async_save"),
    ],
)
def test_options_that_would_never_save_or_keep_are_refused(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shardsafe.CheckpointManager(tmp_path / "ckpt", **options)
    assert not (tmp_path / "ckpt").exists()


def test_a_save_without_the_best_metric_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """keep_best ranks by best_metric: metrics under another name would silently never be ranked."""
    root = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(root, keep_last=1, keep_best=1, best_metric="loss") as manager:
            for step, value in enumerate([0.1, 5.0, 6.0], 1):
                manager.save(step, _state(step), metrics={"eval_loss": value})
    warnings = [r.getMessage() for r in caplog.records if "best_metric" in r.getMessage()]
    assert len(warnings) == 1 and "'loss'" in warnings[0] and "eval_loss" in warnings[0]
    assert committed_steps(root) == [3], "nothing was ranked, so only the latest is kept"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        with shardsafe.CheckpointManager(tmp_path / "ok", keep_best=1, best_metric="loss") as manager:
            manager.save(1, _state(1), metrics={"loss": 1.0})
    assert not [r for r in caplog.records if "best_metric" in r.getMessage()]


def test_an_async_save_in_flight_at_exit_is_finished_not_lost(tmp_path: Path) -> None:
    """A script that never closes its async manager: the interpreter's exit would kill the save."""
    root = tmp_path / "ckpt"
    script = textwrap.dedent(
        f"""
        import torch, shardsafe
        manager = shardsafe.CheckpointManager({str(root)!r}, async_save=True)
        state = {{"model": torch.nn.Linear(256, 256), "big": torch.randn(2_000_000)}}
        manager.save(1, state)
        manager.save(2, state)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert committed_steps(root) == [1, 2]
    assert "finishing the save in flight" in done.stderr
    shardsafe.verify(root / step_name(2))


def test_restore_when_every_checkpoint_is_damaged_refuses_to_start_from_scratch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    with shardsafe.CheckpointManager(root) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        writer = manager.lease.run_id
    (root / step_name(2) / "manifest.json").write_bytes(b"{")
    next(p for p in (root / step_name(1)).iterdir() if p.name.startswith("shard-")).write_bytes(b"x")
    manager = shardsafe.CheckpointManager(root)
    with caplog.at_level(logging.WARNING, logger="shardsafe"), pytest.raises(NoLoadableCheckpointError) as info:
        manager.restore({"model": nn.Linear(4, 3), "step": None})
    message = str(info.value)
    assert "none of the 2 committed checkpoints" in message and "restore(state, step=N)" in message
    assert f"step 1, written by run {writer} (lease epoch 1): IntegrityError" in message
    assert "step 2, written by an unknown run (its manifest cannot be read: FormatError): FormatError" in message
    assert [s for s, _ in manager.skipped] == [2, 1]
    manager.close()


def test_step_names_parse_back_only_in_their_canonical_form() -> None:
    assert step_name(100) == "step-0000000100" and STEP_NAMING.parse("step-0000000100") == 100
    assert STEP_NAMING.parse("step-12345678901") == 12345678901  # more digits than the padding
    for other in (
        "step-5",
        "step-",
        "step-00000000x1",
        "step-٠٠٠٠٠٠٠٠٠١",
        "checkpoint-5",
        ".step-0000000001",
        "step-0000000001.tmp",
    ):
        assert STEP_NAMING.parse(other) is None, other
    trainer = StepNaming("checkpoint-")
    assert trainer.name(7) == "checkpoint-7" and trainer.parse("checkpoint-7") == 7
    assert trainer.parse("checkpoint-007") is None and trainer.parse("checkpoint-0") == 0
    with pytest.raises(ValueError):
        step_name(-1)


def test_a_non_canonical_step_folder_is_not_a_checkpoint_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shardsafe.save(root / "step-5", _state(5))  # not the manager's name for step 5
    with shardsafe.CheckpointManager(root) as manager:
        assert manager.steps() == []
        assert manager.restore(_state(0)) is None
    assert shardsafe.collect_garbage(root) == [] and (root / "step-5" / "manifest.json").is_file()
