"""``shardsafe demo``'s orchestrator: launch the training run three times (preempted, crashed,
finished), reshard its final checkpoint onto one process, verify it and print the summary."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardsafe.api.checkpoint import load, verify
from shardsafe.cli.demo.settings import CKPT, EVENTS, KEEP_LAST, MARKER, DemoError, DemoSettings
from shardsafe.cli.demo.summary import Launch, collect, events_of, format_summary
from shardsafe.cli.demo.worker import warm_imports
from shardsafe.cli.formatting import plural
from shardsafe.errors import ShardsafeError
from shardsafe.manager.catalog import list_checkpoints

__all__ = ["DemoSettings", "run_demo"]

WORKER_MODULE = "shardsafe.cli.demo.worker"


def _say(message: str) -> None:
    print(message, flush=True)


def prepare_out(out: Path) -> None:
    """Start from an empty folder, wiping only one this demo made (never a user's folder)."""
    if out.exists():
        if not out.is_dir():
            raise DemoError(f"{out} exists and is not a folder")
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise DemoError(
                f"{out} is not empty and was not made by `shardsafe demo`; pass another --out or remove it yourself"
            )
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    (out / MARKER).write_text("made by `shardsafe demo`; the demo wipes this folder when it starts\n")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launch's whole process group (torchrun and any worker it left behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _launch(settings: DemoSettings, run: int, *extra: str) -> Launch:
    """Run torchrun with N workers; worker stdout (the progress bar) goes to our stdout, stderr to a log."""
    out = settings.out.absolute()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(settings.nproc),
        "--master_addr",
        "127.0.0.1",
    ]
    cmd += ["--master_port", str(_free_port()), "-m", WORKER_MODULE, "--out", str(out), "--attempt", str(run)]
    cmd += [
        "--steps",
        str(settings.steps),
        "--save-every",
        str(settings.save_every),
        "--seed",
        str(settings.seed),
        *extra,
    ]
    # the folder holding shardsafe/: workers import this very copy
    package_root = str(Path(__file__).resolve().parents[__name__.count(".")])
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
    )
    log_path = out / "logs" / f"run-{run}.log"
    started, clock = time.time(), time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stderr=log, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=settings.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DemoError(
                f"run {run} did not finish within {settings.timeout:.0f} s; end of {log_path}:\n{_tail(log_path)}"
            ) from None
        except BaseException:  # Ctrl-C included: leave no stray workers
            _kill_group(proc)
            raise
        _kill_group(proc)  # torchrun tears its workers down; make sure nothing lingers after a crash
    return Launch(run, returncode, started, time.perf_counter() - clock, log_path, read_events(out, run))


def read_events(out: Path, run: int) -> list[dict[str, Any]]:
    """The events rank 0 recorded for launch ``run`` (the log holds every launch's, one JSON object a line)."""
    path = out / "logs" / EVENTS
    if not path.is_file():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("run") == run]


def _failed(launch: Launch, what: str) -> DemoError:
    return DemoError(
        f"run {launch.run} {what} (exit code {launch.returncode}); end of {launch.log}:\n{_tail(launch.log)}"
    )


def _run_preempted(settings: DemoSettings, preempt: int) -> Launch:
    launch = _launch(settings, 1, "--preempt-at", str(preempt))
    stopped = events_of(launch.events, "preempted")
    if launch.returncode != 0 or not stopped:
        raise _failed(launch, f"should have been preempted after step {preempt} and exited cleanly, but was not")
    if stopped[0]["step"] != preempt:
        raise DemoError(f"run 1 was sent SIGTERM after step {preempt} but stopped after step {stopped[0]['step']}")
    return launch


def _run_crashing(settings: DemoSettings, crash: int) -> Launch:
    launch = _launch(settings, 2, "--crash-after", str(crash))
    if launch.returncode == 0:
        raise DemoError(f"run 2 should have been killed after step {crash} but finished normally; see {launch.log}")
    if not events_of(launch.events, "kill"):
        raise _failed(launch, f"failed before the planned kill after step {crash}")
    if not events_of(launch.events, "resume"):
        raise DemoError("run 2 did not resume from the preemption checkpoint")
    return launch


def _run_finishing(settings: DemoSettings) -> Launch:
    launch = _launch(settings, 3, "--sync-reference")
    if launch.returncode != 0 or not events_of(launch.events, "done"):
        raise _failed(launch, "(the second resumed run) failed")
    if not events_of(launch.events, "resume"):
        raise DemoError("run 3 did not resume from a checkpoint, though run 2 left committed ones")
    return launch


def _evaluate_on_one_process(path: Path) -> dict[str, Any]:
    """Reshard N -> 1: load into a plain module in this process (no process group) and evaluate."""
    from shardsafe.cli.demo.model import GPTConfig, TinyGPT, evaluate, split_corpus

    model = TinyGPT(GPTConfig())
    warm_imports()
    started = time.perf_counter()
    try:
        load(path, {"model": model})
    except ShardsafeError as exc:
        raise DemoError(f"loading {path} onto one process failed: {exc}") from exc
    seconds = time.perf_counter() - started
    _, held_out = split_corpus()
    return {
        "load_seconds": seconds,
        "loss": evaluate(model, held_out, model.cfg.seq_len),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _verify(path: Path) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        summary = verify(path)
    except ShardsafeError as exc:
        raise DemoError(f"verify failed on {path}: {exc}") from exc
    return {**summary, "seconds": time.perf_counter() - started}


def _on_disk(root: Path) -> tuple[list[int], int]:
    """Committed steps under the manager root, and how many hidden leftovers of interrupted saves lie there."""
    from shardsafe.manager.catalog import committed_steps
    from shardsafe.protocol.temppath import TMP_MARK

    leftovers = sum(1 for p in root.iterdir() if p.name.startswith(".") and TMP_MARK in p.name) if root.is_dir() else 0
    return committed_steps(root), leftovers


def run_demo(settings: DemoSettings) -> int:
    """Run every stage and print the summary; 1 with a clear message if a stage fails."""
    try:
        summary = _run_stages(settings)
    except DemoError as exc:  # a stage failed: its message says which (Ctrl-C is left to the CLI's error boundary)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    (settings.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _say(format_summary(summary))
    return 0


def _run_stages(settings: DemoSettings) -> dict[str, Any]:
    """Preempt, resume, crash, resume, reshard, verify; returns the numbers for the summary."""
    preempt, crash = settings.schedule()
    prepare_out(settings.out)
    n, k, root = settings.nproc, settings.save_every, settings.out / CKPT
    wall = time.perf_counter()
    _say(
        f"[1/5] run 1: {plural(n, 'CPU rank')} (gloo, FSDP2) train for {settings.steps} steps; a CheckpointManager "
        "saves"
    )
    _say(
        f"      asynchronously every {plural(k, 'step')}, keeping the last {KEEP_LAST} and the best by held-out loss; "
        f"after step {preempt}"
    )
    _say("      every rank gets SIGTERM (a preemption)")
    run1 = _run_preempted(settings, preempt)
    after_preemption, _ = _on_disk(root)
    _say(f"[2/5] run 1 saved step {preempt} and exited cleanly; run 2 restores it, and is SIGKILLed after step {crash}")
    run2 = _run_crashing(settings, crash)
    after_crash, leftovers = _on_disk(root)
    if not after_crash:
        raise DemoError(f"run 2 left no committed checkpoint in {root}")
    _say(
        f"[3/5] run 2 was killed after step {crash}; run 3 restores the newest committed checkpoint (step "
        f"{after_crash[-1]}) and finishes"
    )
    run3 = _run_finishing(settings)
    infos = _list(root)
    final = infos[-1].path
    assert isinstance(final, Path)
    _say(f"[4/5] loading {final.name} onto 1 process (plain module, no process group) and evaluating on held-out text")
    evaluation = _evaluate_on_one_process(final)
    _say(f"[5/5] verifying every block hash of {final.name}")
    verified = _verify(final)
    disk = {"after_preemption": after_preemption, "after_crash": after_crash, "leftovers_after_crash": leftovers}
    return collect(
        settings, (preempt, crash), (run1, run2, run3), disk, infos, evaluation, verified, time.perf_counter() - wall
    )


def _list(root: Path) -> list[Any]:
    infos = list_checkpoints(root)
    if not infos:
        raise DemoError(f"no committed checkpoint under {root} at the end of the run")
    return infos
