"""Two ShardsafeTrainer runs on one ``output_dir`` (issue 19), in this process on CPU: a resume takes the
run's lease before it reads (waiting for a run still holding it), and a run never silently replaces a
checkpoint another run committed (``overwrite_checkpoints=True`` does, on purpose)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import shardsafe  # noqa: E402
from hf_trainer_utils import OrderRecorder, Tokens, small_trainer  # noqa: E402
from shardsafe.errors import CheckpointExistsError, LeaseHeldError  # noqa: E402
from shardsafe.manager.catalog import committed_steps  # noqa: E402
from shardsafe.manager.lease import LEASE_DIR, Lease  # noqa: E402


class SavedData:
    """Receives a checkpoint's ``data`` entry (the train sampler's position) as saved."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _writers(out: Path) -> dict[int, str | None]:
    return {
        step: shardsafe.verify(out / f"checkpoint-{step}")["metadata"]["shardsafe.trainer"]["run_id"]
        for step in committed_steps(out, _naming())
    }


def _naming() -> Any:
    from shardsafe.integrations.transformers.checkpoints import TRAINER_NAMING

    return TRAINER_NAMING


def test_trainer_resumes_under_the_lease_and_never_replaces_another_runs_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    small_trainer(out, max_steps=2).train()
    first = _writers(out)
    assert sorted(first) == [1, 2] and first[1] == first[2] is not None

    # a fresh run into the same output_dir, as an unchanged script restarted
    with pytest.raises(CheckpointExistsError) as info:
        small_trainer(out, max_steps=1).train()
    assert f"step 1 is a committed checkpoint written by run {first[1]}" in str(info.value)
    assert "resume_from_checkpoint=True" in str(info.value) and "overwrite_checkpoints=True" in str(info.value)
    assert _writers(out) == first

    other = Lease(out, timeout=1.0)  # another run holds output_dir (renewing it; a waiter gives up after 2 s)
    other.acquire()
    with pytest.raises(LeaseHeldError):
        # refused before it reads anything
        small_trainer(out, max_steps=3, lease_timeout=0.5).train(resume_from_checkpoint=True)
    threading.Timer(1.0, other.release).start()
    started = time.monotonic()
    resumed = small_trainer(out, max_steps=3, lease_timeout=30.0)
    resumed.train(resume_from_checkpoint=True)  # waits for the other run, then resumes its newest checkpoint
    assert time.monotonic() - started >= 1.0 and resumed.state.global_step == 3
    after = _writers(out)
    assert {s: after[s] for s in (1, 2)} == first and after[3] not in (None, first[1])

    small_trainer(out, max_steps=1, overwrite_checkpoints=True).train()  # on purpose
    replaced = _writers(out)
    assert replaced[1] not in (first[1], after[3]) and replaced[2] == first[2]


def test_resume_on_another_train_dataset_takes_the_trainers_rule(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint trained over 16 samples, resumed over 12 (the Trainer accepts it): the saved sample position is a
    place in another order, so the Trainer's rule applies (skip global_step's batches of the epoch), with a warning;
    the positions saved afterwards count the samples the Trainer skipped."""
    out = tmp_path / "out"
    small_trainer(out, max_steps=3, model=OrderRecorder, train_dataset=Tokens(16)).train()
    uninterrupted = small_trainer(tmp_path / "twelve", max_steps=5, model=OrderRecorder, train_dataset=Tokens(12))
    uninterrupted.train()
    with caplog.at_level("WARNING"):
        resumed = small_trainer(out, max_steps=5, model=OrderRecorder, train_dataset=Tokens(12))
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert "was trained on another train dataset (dataset_length 16, now 12)" in caplog.text
    # steps 4-5 take what the 12-sample run took there: the Trainer skipped the epoch's first 3 batches
    assert resumed.model.data_order[6:].tolist() == uninterrupted.model.data_order[6:10].tolist()
    position = SavedData()
    shardsafe.load(out / "checkpoint-5", {"data": position})
    assert position.state["sampler"] | {"seed": None} == {
        "epoch": 0,
        "seed": None,
        "consumed": 10,  # 3 skipped batches + 2 trained, of 2 samples each
        "shuffle": True,
        "dataset_length": 12,
    }


def test_save_total_limit_1_keeps_only_the_best_at_the_end(tmp_path: Path) -> None:
    """As the Trainer: with save_total_limit=1 and a best checkpoint, the end of training leaves the best one only
    (the newest is deleted too), each deleted as rotation deletes (one rename, then the files)."""
    out = tmp_path / "out"
    holder: dict[str, Any] = {}

    def score(_: Any) -> dict[str, float]:  # checkpoint-1 is the best
        return {"score": 1.0 if holder["trainer"].state.global_step == 1 else 0.0}

    trainer = small_trainer(
        out,
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        save_total_limit=1,
        metric_for_best_model="score",
        greater_is_better=True,
        eval_dataset=Tokens(2),
        compute_metrics=score,
    )
    holder["trainer"] = trainer
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-1")
    assert sorted(p.name for p in out.iterdir() if p.name != LEASE_DIR) == ["checkpoint-1"]
    shardsafe.verify(out / "checkpoint-1")
