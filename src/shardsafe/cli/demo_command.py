"""``shardsafe demo``: its options (the run itself is the package :mod:`shardsafe.cli.demo`, imported when it
starts)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardsafe.cli.formatting import positive_int

__all__ = ["add_parser"]


_DESCRIPTION = (
    "Launch P CPU ranks (gloo) with torchrun to train a small GPT under FSDP2, saving through a CheckpointManager "
    "(async saves every K steps, keep the last 3 and the best by held-out loss, preemption handling). Run 1 gets "
    "SIGTERM partway (a simulated preemption: all ranks write a final checkpoint at the step boundary and exit "
    "cleanly); run 2 resumes from it and is SIGKILLed later; run 3 resumes from the newest committed checkpoint and "
    "finishes. The final checkpoint is reloaded onto one plain process (no process group) to evaluate it, verified, "
    "and a summary is printed (blocked time per async save vs a sync save, retention, resume steps). Takes about a "
    "minute on a 2-core machine."
)


def add_parser(sub: Any) -> None:
    """``shardsafe demo [--steps N] [--save-every K] ...``."""
    p = sub.add_parser(
        "demo",
        help="train a small GPT under FSDP2 with a CheckpointManager: preempt, crash, resume, reshard onto 1 process",
        description=_DESCRIPTION,
    )
    _add_run_options(p)
    _add_fault_options(p)
    p.set_defaults(func=_run)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """What the demo trains and where: steps, save interval, output folder, ranks."""
    p.add_argument("--steps", type=positive_int, default=40, help="total training steps (default: %(default)s)")
    p.add_argument(
        "--save-every",
        type=positive_int,
        default=5,
        metavar="K",
        help="save a checkpoint every K steps (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("demo-run"),
        metavar="DIR",
        help="output folder, wiped at start; a non-empty folder the demo did not make is refused (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--nproc", type=positive_int, default=2, metavar="P", help="number of CPU ranks (default: %(default)s)"
    )


def _add_fault_options(p: argparse.ArgumentParser) -> None:
    """When the demo preempts and crashes its runs, its seed and its launch timeout."""
    p.add_argument(
        "--preempt-at",
        type=positive_int,
        default=None,
        metavar="STEP",
        help="send SIGTERM to every rank of the first run after this step (default: between two saves, about a third "
        "of the way)",
    )
    p.add_argument(
        "--crash-after",
        type=positive_int,
        default=None,
        metavar="STEP",
        help="SIGKILL the second run after this step (default: just before a save, about two thirds of the way)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for the initial weights and data order (default: %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up on a launch after this long (default: %(default)s)",
    )


def _run(args: argparse.Namespace) -> int:
    from shardsafe.cli.demo.run import DemoSettings, run_demo  # torch and the demo model only when the demo runs

    settings = DemoSettings(
        steps=args.steps,
        save_every=args.save_every,
        out=args.out,
        nproc=args.nproc,
        preempt_at=args.preempt_at,
        crash_after=args.crash_after,
        seed=args.seed,
        timeout=args.timeout,
    )
    return run_demo(settings)
