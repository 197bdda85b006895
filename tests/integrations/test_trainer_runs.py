"""Two ShardsafeTrainer runs on one ``output_dir`` (issue 19), in this process on CPU: a resume takes the
run's lease before it reads (waiting for a run still holding it), and a run never silently replaces a
checkpoint another run committed (``overwrite_checkpoints=True`` does, on purpose)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from shardsafe.errors import CheckpointExistsError, LeaseHeldError  # noqa: E402
from shardsafe.manager.catalog import committed_steps  # noqa: E402
from shardsafe.manager.lease import Lease  # noqa: E402

SEQ, VOCAB = 4, 32


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.x = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(out: Path, max_steps: int, **kwargs: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardsafe.integrations.transformers import ShardsafeTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    args = TrainingArguments(
        str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        log_level="error",
    )
    return ShardsafeTrainer(model=model, args=args, train_dataset=Tokens(), **kwargs)


def _writers(out: Path) -> dict[int, str | None]:
    import shardsafe

    return {
        step: shardsafe.verify(out / f"checkpoint-{step}")["metadata"]["shardsafe.trainer"]["run_id"]
        for step in committed_steps(out, _naming())
    }


def _naming() -> Any:
    from shardsafe.integrations.transformers.checkpoints import TRAINER_NAMING

    return TRAINER_NAMING


def test_trainer_resumes_under_the_lease_and_never_replaces_another_runs_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _trainer(out, max_steps=2).train()
    first = _writers(out)
    assert sorted(first) == [1, 2] and first[1] == first[2] is not None

    # a fresh run into the same output_dir, as an unchanged script restarted
    with pytest.raises(CheckpointExistsError) as info:
        _trainer(out, max_steps=1).train()
    assert f"step 1 is a committed checkpoint written by run {first[1]}" in str(info.value)
    assert "resume_from_checkpoint=True" in str(info.value) and "overwrite_checkpoints=True" in str(info.value)
    assert _writers(out) == first

    other = Lease(out, timeout=1.0)  # another run holds output_dir (renewing it; a waiter gives up after 2 s)
    other.acquire()
    with pytest.raises(LeaseHeldError):
        # refused before it reads anything
        _trainer(out, max_steps=3, lease_timeout=0.5).train(resume_from_checkpoint=True)
    threading.Timer(1.0, other.release).start()
    started = time.monotonic()
    resumed = _trainer(out, max_steps=3, lease_timeout=30.0)
    resumed.train(resume_from_checkpoint=True)  # waits for the other run, then resumes its newest checkpoint
    assert time.monotonic() - started >= 1.0 and resumed.state.global_step == 3
    after = _writers(out)
    assert {s: after[s] for s in (1, 2)} == first and after[3] not in (None, first[1])

    _trainer(out, max_steps=1, overwrite_checkpoints=True).train()  # on purpose
    replaced = _writers(out)
    assert replaced[1] not in (first[1], after[3]) and replaced[2] == first[2]
