"""One-process ``ShardsafeTrainer`` runs for the tests in this process (tests/integrations/test_trainer_*.py).

A tiny GPT-2 (1 layer, 8 wide) over a few fixed token rows, CPU, a checkpoint every step by
default: a run of a few steps takes about a second. The torchrun tests build theirs in
``trainer_scripts/run_trainer.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SEQ, VOCAB = 4, 32

# ShardsafeTrainer's own keywords; every other one is a TrainingArguments field
TRAINER_KEYWORDS = ("keep_later_checkpoints", "lease_timeout", "overwrite_checkpoints", "save_dtype", "max_shard_size")


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``n`` fixed rows of token ids; each row's first token is its index, so a model can record what it trained
    on."""

    def __init__(self, n: int = 8) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))
        self.x[:, 0] = torch.arange(n) % VOCAB

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class OrderRecorder(torch.nn.Module):
    """Like transformers' test_resume_batch_order model: a buffer that grows with the samples it trains on (their
    :class:`Tokens` index), and a ``load_state_dict`` that resizes it first (loaded through its own code: issue 37)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(VOCAB))
        self.register_buffer("data_order", torch.zeros(0, dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.data_order = torch.cat([self.data_order, input_ids[:, 0]])
        return {"loss": self.w[input_ids].pow(2).mean() + self.w.sum() * 0 + 1.0}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.data_order = torch.zeros_like(state_dict["data_order"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=8))


def small_trainer(
    out: Path,
    max_steps: int,
    *,
    model: Callable[[], torch.nn.Module] = tiny_gpt2,
    train_dataset: Any = None,
    **kwargs: Any,
) -> Any:
    """A ShardsafeTrainer into ``out`` (model built after ``torch.manual_seed(0)``, so two calls train alike).

    ``kwargs``: ShardsafeTrainer's own keywords (:data:`TRAINER_KEYWORDS`), ``eval_dataset`` /
    ``compute_metrics``, and TrainingArguments fields overriding the defaults below.
    """
    from transformers import TrainingArguments

    from shardsafe.integrations.transformers import ShardsafeTrainer

    own = {k: kwargs.pop(k) for k in (*TRAINER_KEYWORDS, "eval_dataset", "compute_metrics") if k in kwargs}
    defaults: dict[str, Any] = {
        "per_device_train_batch_size": 2,
        "save_strategy": "steps",
        "save_steps": 1,
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "log_level": "error",
    }
    args = TrainingArguments(str(out), max_steps=max_steps, **{**defaults, **kwargs})
    torch.manual_seed(0)
    dataset = Tokens() if train_dataset is None else train_dataset
    return ShardsafeTrainer(model=model(), args=args, train_dataset=dataset, **own)
