"""The demo's options and schedule, and the constants the orchestrator, the workers and the summary share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BATCH_PER_RANK",
    "BEST_METRIC",
    "CKPT",
    "DemoError",
    "DemoSettings",
    "EVENTS",
    "KEEP_BEST",
    "KEEP_LAST",
    "LEARNING_RATE",
    "MARKER",
    "SYNC_REFERENCE",
]

DEFAULT_OUT = Path("demo-run")
MARKER = ".shardsafe-demo"  # marks a folder this demo made, so only such a folder is ever wiped
EVENTS = "events.jsonl"
CKPT = "ckpt"  # the CheckpointManager root, under --out
SYNC_REFERENCE = "sync-reference"  # one synchronous save of the same state, timed for comparison, then removed
BATCH_PER_RANK = 8
LEARNING_RATE = 2e-3
KEEP_LAST = 3
KEEP_BEST = 1
BEST_METRIC = "eval_loss"  # held-out loss, measured after every step


class DemoError(Exception):
    """A demo stage failed; the message says which and shows the worker's log tail."""


@dataclass(frozen=True)
class DemoSettings:
    """What ``shardsafe demo`` was asked to run (its command-line options)."""

    steps: int = 40
    save_every: int = 5
    out: Path = DEFAULT_OUT
    nproc: int = 2
    preempt_at: int | None = None  # None: a step between two saves, about a third of the way
    crash_after: int | None = None  # None: the step before a save, about two thirds of the way
    seed: int = 0
    timeout: float = 300.0  # per launch

    def schedule(self) -> tuple[int, int]:
        """(step after which run 1 is preempted, step after which run 2 is killed), validated."""
        k = self.save_every
        if self.steps < 3 or k < 1 or self.nproc < 1:
            raise DemoError("--steps must be at least 3, --save-every and --nproc at least 1")
        preempt = self.preempt_at
        if preempt is None:
            preempt = max(k, self.steps // 3 // k * k) + max(1, (k + 1) // 2)
        crash = self.crash_after
        if crash is None:
            next_save = (preempt // k + 1) * k  # the first periodic save of run 2
            crash = max(next_save, 2 * self.steps // 3 // k * k) + max(1, k - 1)
        if not 1 <= preempt < crash < self.steps:
            raise DemoError(
                f"the preemption (after step {preempt}) must come before the crash (after step {crash}), and both "
                "before the last "
                f"step ({self.steps}): use more --steps, a smaller --save-every, or set --preempt-at / --crash-after"
            )
        return preempt, crash
