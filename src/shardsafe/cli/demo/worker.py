"""One rank of the demo's training run: ``python -m shardsafe.cli.demo.worker ...``, started by torchrun.

It trains :class:`~shardsafe.cli.demo.model.TinyGPT` under FSDP2 on CPU (gloo), saving through a
``CheckpointManager`` and resuming with ``manager.restore``; on request it plays the scheduler
that preempts the job (SIGTERM to every rank) or the node that loses power (SIGKILL). Rank 0
appends what happened to the event log the orchestrator reads (see :mod:`shardsafe.cli.demo`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch

from shardsafe.api.checkpoint import save
from shardsafe.cli.demo.settings import (
    BATCH_PER_RANK,
    BEST_METRIC,
    CKPT,
    EVENTS,
    KEEP_BEST,
    KEEP_LAST,
    LEARNING_RATE,
    SYNC_REFERENCE,
)
from shardsafe.manager.manager import CheckpointManager
from shardsafe.state.rng import RNGState

__all__ = ["build_state", "train_step", "warm_imports"]


class EventLog:
    """Rank 0's record of the run; a no-op on other ranks (pass ``path=None``)."""

    def __init__(self, path: Path | None, run: int) -> None:
        self.run = run
        self._file: TextIO | None = open(path, "a", encoding="utf-8") if path is not None else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"run": self.run, "event": event, "time": time.time(), **fields}) + "\n")
            self._file.flush()  # in the OS before any SIGKILL that follows

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def lr_factor(total_steps: int) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of the run, then a gentle cosine decay to half the peak."""
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 + 0.25 * (1 + math.cos(math.pi * progress))

    return factor


def warm_imports() -> None:
    """Import up front what torch's state-dict helpers import lazily on first use (torch._dynamo, 1-2 s).

    Otherwise the first save or load of a process pays for it and the timings in the summary would
    measure an import rather than checkpoint I/O.
    """
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardsafe.cli.demo.worker", description="One rank of the demo run (started by torchrun)."
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--attempt", type=int, required=True, help="launch number (1, 2, 3), recorded in the event log")
    p.add_argument(
        "--preempt-at", type=int, default=0, help="rank 0 sends SIGTERM to every rank after this step (0: never)"
    )
    p.add_argument("--crash-after", type=int, default=0, help="SIGKILL every rank after this step (0: never)")
    p.add_argument(
        "--sync-reference", action="store_true", help="after the last step, time one synchronous save of the same state"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def worker_main(argv: list[str]) -> int:
    """Train (resuming if a checkpoint exists), save through the manager, maybe be stopped; see the module doc."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    args = _worker_parser().parse_args(argv)
    warm_imports()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        log = EventLog(args.out / "logs" / EVENTS if dist.get_rank() == 0 else None, args.attempt)
        _train(args, mesh, log)
        log.close()
    finally:
        dist.destroy_process_group()
    return 0


def build_state(seed: int, total_steps: int, mesh: Any) -> dict[str, Any]:
    """Model (FSDP2: each block, then the root), AdamW, LR schedule, RNG and step, as saved."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from shardsafe.cli.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(seed)  # same initial weights on every rank
    model = TinyGPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor(total_steps))
    torch.manual_seed(seed + 1 + dist.get_rank())  # a different, reproducible data order per rank
    return {"model": model, "optim": optim, "sched": sched, "rng": RNGState(), "step": 0}


def train_step(state: dict[str, Any], data: torch.Tensor) -> float:
    """One optimizer step; returns the loss averaged over ranks."""
    import torch.distributed as dist

    from shardsafe.cli.demo.model import lm_loss, sample_batch

    model, optim, sched = state["model"], state["optim"], state["sched"]
    x, y = sample_batch(data, BATCH_PER_RANK, model.cfg.seq_len)
    loss = lm_loss(model, x, y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def make_manager(out: Path, save_every: int) -> CheckpointManager:
    """The manager every rank of every run uses (the same settings, so retention agrees across restarts)."""

    return CheckpointManager(
        out / CKPT,
        save_every=save_every,
        keep_last=KEEP_LAST,
        keep_best=KEEP_BEST,
        best_metric=BEST_METRIC,
        async_save=True,
        handle_preemption=True,
    )


def _simulate_preemption(step: int, pids: list[int], log: EventLog) -> None:
    """Rank 0 plays the scheduler: SIGTERM to every rank's process (itself included) after ``step``.

    The manager's handler only sets a flag; the ranks act on it together in the next ``save`` call.
    Rank 0 signals itself synchronously, so that call is the one of this very step on every rank.
    """
    log.emit("sigterm", step=step, pids=pids)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)


def _crash(step: int, manager: Any, log: EventLog) -> None:
    """Every rank SIGKILLs itself: no cleanup, no flush, no final save, like a node that loses power."""
    import torch.distributed as dist

    log.emit("kill", step=step, committed=manager.steps() if log.enabled else [])
    # Without the barrier a rank that dies first can get rank 0 torn down before it records the kill.
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _train(args: argparse.Namespace, mesh: Any, log: EventLog) -> None:
    import torch.distributed as dist

    from shardsafe.cli.demo.model import split_corpus

    state = build_state(args.seed, args.steps, mesh)
    train, held_out = split_corpus()
    seq_len = state["model"].cfg.seq_len
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    with make_manager(args.out, args.save_every) as manager:
        start = _restore(manager, state, log)
        bar = _progress_bar(args, start)
        loop = _Loop(args, state, manager, bar, log, train, held_out, seq_len, pids)
        for step in bar:
            if loop.run_step(step):
                break
        bar.close()
        clock = time.perf_counter()
        manager.wait()  # the last async save, if still in flight
        log.emit("drained", seconds=time.perf_counter() - clock)
    if manager.stop_requested:
        return  # the manager restored the signal handlers; the process exits 0 like any finished job
    _finish(args, state, held_out, seq_len, log)


def _restore(manager: CheckpointManager, state: dict[str, Any], log: EventLog) -> int:
    """Resume from the newest committed checkpoint if there is one; returns the step to continue after
    (0 for a fresh start), and records how long the restore took."""
    started = time.perf_counter()
    restored = manager.restore(state)
    if restored is None:
        log.emit("fresh")
    else:
        seconds = time.perf_counter() - started
        log.emit("resume", step=restored, seconds=seconds, skipped=[s for s, _ in manager.skipped])
    return restored or 0


def _progress_bar(args: argparse.Namespace, start: int) -> Any:
    """The steps still to do, shown as a progress bar on rank 0 when it writes to a terminal."""
    import torch.distributed as dist
    from tqdm import tqdm

    return tqdm(
        range(start + 1, args.steps + 1),
        initial=start,
        total=args.steps,
        desc=f"run {args.attempt}",
        unit="step",
        file=sys.stdout,
        disable=True if dist.get_rank() else None,  # rank 0 only, and only on a terminal
        dynamic_ncols=True,
    )


@dataclass(frozen=True)
class _Loop:
    """What every step of the training loop uses: one place for the step's train, evaluate, save and the
    simulated preemption and crash."""

    args: argparse.Namespace
    state: dict[str, Any]
    manager: CheckpointManager
    bar: Any
    log: EventLog
    train: torch.Tensor
    held_out: torch.Tensor
    seq_len: int
    pids: list[Any]

    def run_step(self, step: int) -> bool:
        """Train, evaluate and offer ``step`` to the manager; True when the job was preempted (stop now)."""
        from shardsafe.cli.demo.model import evaluate

        args, log = self.args, self.log
        loss = train_step(self.state, self.train)
        eval_loss = evaluate(self.state["model"], self.held_out, self.seq_len)  # a preemption can make any step a save
        self.bar.set_postfix(loss=f"{loss:.3f}", held_out=f"{eval_loss:.3f}")
        if step == args.preempt_at and log.enabled:
            _simulate_preemption(step, self.pids, log)
        if step == args.crash_after:
            log.emit("step", step=step, loss=loss, eval_loss=eval_loss)
            self.bar.close()
            _crash(step, self.manager, log)
        self.state["step"] = step
        self._save(step, loss, eval_loss)
        if self.manager.stop_requested:
            self.bar.close()
            log.emit("preempted", step=step)
            return True
        return False

    def _save(self, step: int, loss: float, eval_loss: float) -> None:
        """``manager.save`` of the step, timed: how long it blocks the loop is what the summary reports."""
        manager = self.manager
        clock = time.perf_counter()
        saved = manager.save(
            step, self.state, metrics={BEST_METRIC: eval_loss, "train_loss": loss}, force=step == self.args.steps
        )
        call = time.perf_counter() - clock
        self.log.emit("step", step=step, loss=loss, eval_loss=eval_loss, saved=saved, call_seconds=call)
        if saved:
            self.log.emit(
                "save",
                step=step,
                seconds=call,
                mode="final" if manager.stop_requested else "async",
                eval_loss=eval_loss,
            )


def _finish(
    args: argparse.Namespace, state: dict[str, Any], held_out: torch.Tensor, seq_len: int, log: EventLog
) -> None:
    """After the last step: the ranks' held-out loss and, when asked, one synchronous save of the same state
    to compare the async saves' blocking time against."""
    import torch.distributed as dist

    from shardsafe.cli.demo.model import evaluate

    log.emit("eval", loss=evaluate(state["model"], held_out, seq_len))
    if args.sync_reference:
        reference = args.out / SYNC_REFERENCE
        dist.barrier()
        clock = time.perf_counter()
        save(reference, state, overwrite=True)
        log.emit("sync_save", seconds=time.perf_counter() - clock, bytes=_folder_bytes(reference) if log.enabled else 0)
        if log.enabled:
            shutil.rmtree(reference)
    log.emit("done", step=args.steps)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    """``python -m shardsafe.cli.demo.worker ...`` (what torchrun starts on each rank)."""
    return worker_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
