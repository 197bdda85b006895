"""``shardsafe demo``: a sharded training run under :class:`~shardsafe.CheckpointManager`, preempted,
crashed, resumed twice, its checkpoint resharded and checked.

Two halves live here:

* the *worker* (``python -m shardsafe.cli.demo worker ...``), started by ``torch.distributed.run`` on
  N CPU ranks with gloo: it trains :class:`~shardsafe.cli.demo_model.TinyGPT` under FSDP2 and saves
  through a ``CheckpointManager`` (async saves every K steps, ``keep_last=3``, ``keep_best=1`` by
  held-out loss, ``handle_preemption=True``), resuming with ``manager.restore``. When told to, it
  simulates a preemption (rank 0 sends SIGTERM to every rank's process after a given step, as a
  scheduler would; the manager makes all ranks write a final checkpoint at that step boundary and
  the run exits cleanly) or a hard crash (every rank SIGKILLs itself after a given step);
* the *orchestrator* (:func:`run_demo`, behind ``shardsafe demo``): it launches the run three
  times (preempted, crashed, finished), reloads the final checkpoint into one plain process (no
  process group), verifies it, lists what retention kept and prints what happened.

The worker's rank 0 records everything the summary needs as JSON lines in
``<out>/logs/events.jsonl``, flushed line by line, so a SIGKILL loses nothing written before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch

from shardsafe.api.checkpoint import load, save, verify
from shardsafe.cli.formatting import format_bytes
from shardsafe.errors import ShardsafeError
from shardsafe.manager.catalog import list_checkpoints
from shardsafe.manager.manager import CheckpointManager
from shardsafe.state.rng import RNGState

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
SUMMARY_WIDTH = 124


class DemoError(Exception):
    """A demo stage failed; the message says which and shows the worker's log tail."""


# ----------------------------------------------------------------------------- worker


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
    p = argparse.ArgumentParser(prog="python -m shardsafe.cli.demo worker", description="One rank of the demo run (started by torchrun).")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--attempt", type=int, required=True, help="launch number (1, 2, 3), recorded in the event log")
    p.add_argument("--preempt-at", type=int, default=0, help="rank 0 sends SIGTERM to every rank after this step (0: never)")
    p.add_argument("--crash-after", type=int, default=0, help="SIGKILL every rank after this step (0: never)")
    p.add_argument("--sync-reference", action="store_true", help="after the last step, time one synchronous save of the same state")
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


def _build_state(seed: int, total_steps: int, mesh: Any) -> dict[str, Any]:
    """Model (FSDP2: each block, then the root), AdamW, LR schedule, RNG and step, as saved."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from shardsafe.cli.demo_model import GPTConfig, TinyGPT

    torch.manual_seed(seed)  # same initial weights on every rank
    model = TinyGPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor(total_steps))
    torch.manual_seed(seed + 1 + dist.get_rank())  # a different, reproducible data order per rank
    return {"model": model, "optim": optim, "sched": sched, "rng": RNGState(), "step": 0}


def _train_step(state: dict[str, Any], data: torch.Tensor) -> float:
    """One optimizer step; returns the loss averaged over ranks."""
    import torch.distributed as dist

    from shardsafe.cli.demo_model import lm_loss, sample_batch

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


def make_manager(out: Path, save_every: int) -> Any:
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
    from tqdm import tqdm

    from shardsafe.cli.demo_model import evaluate, split_corpus

    state = _build_state(args.seed, args.steps, mesh)
    train, held_out = split_corpus()
    seq_len = state["model"].cfg.seq_len
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    with make_manager(args.out, args.save_every) as manager:
        started = time.perf_counter()
        restored = manager.restore(state)
        if restored is None:
            log.emit("fresh")
        else:
            log.emit("resume", step=restored, seconds=time.perf_counter() - started, skipped=[s for s, _ in manager.skipped])
        start = restored or 0
        bar = tqdm(
            range(start + 1, args.steps + 1),
            initial=start,
            total=args.steps,
            desc=f"run {args.attempt}",
            unit="step",
            file=sys.stdout,
            disable=True if dist.get_rank() else None,  # rank 0 only, and only on a terminal
            dynamic_ncols=True,
        )
        for step in bar:
            loss = _train_step(state, train)
            eval_loss = evaluate(state["model"], held_out, seq_len)  # every step: a preemption can make any step a save
            bar.set_postfix(loss=f"{loss:.3f}", held_out=f"{eval_loss:.3f}")
            if step == args.preempt_at and log.enabled:
                _simulate_preemption(step, pids, log)
            if step == args.crash_after:
                log.emit("step", step=step, loss=loss, eval_loss=eval_loss)
                bar.close()
                _crash(step, manager, log)
            state["step"] = step
            clock = time.perf_counter()
            saved = manager.save(step, state, metrics={BEST_METRIC: eval_loss, "train_loss": loss}, force=step == args.steps)
            call = time.perf_counter() - clock
            log.emit("step", step=step, loss=loss, eval_loss=eval_loss, saved=saved, call_seconds=call)
            if saved:
                log.emit("save", step=step, seconds=call, mode="final" if manager.stop_requested else "async", eval_loss=eval_loss)
            if manager.stop_requested:
                bar.close()
                log.emit("preempted", step=step)
                break
        bar.close()
        clock = time.perf_counter()
        manager.wait()  # the last async save, if still in flight
        log.emit("drained", seconds=time.perf_counter() - clock)
    if manager.stop_requested:
        return  # the manager restored the signal handlers; the process exits 0 like any finished job
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


# ----------------------------------------------------------------------------- orchestrator


@dataclass(frozen=True)
class DemoSettings:
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
                f"the preemption (after step {preempt}) must come before the crash (after step {crash}), and both before the last "
                f"step ({self.steps}): use more --steps, a smaller --save-every, or set --preempt-at / --crash-after"
            )
        return preempt, crash


@dataclass
class Launch:
    run: int
    returncode: int
    started: float  # time.time() at launch
    seconds: float
    log: Path
    events: list[dict[str, Any]]


def _say(message: str) -> None:
    print(message, flush=True)


def prepare_out(out: Path) -> None:
    """Start from an empty folder, wiping only one this demo made (never a user's folder)."""
    if out.exists():
        if not out.is_dir():
            raise DemoError(f"{out} exists and is not a folder")
        if any(out.iterdir()) and not (out / MARKER).is_file():
            raise DemoError(f"{out} is not empty and was not made by `shardsafe demo`; pass another --out or remove it yourself")
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(settings.nproc), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), "-m", "shardsafe.cli.demo", "worker", "--out", str(out), "--attempt", str(run)]
    cmd += ["--steps", str(settings.steps), "--save-every", str(settings.save_every), "--seed", str(settings.seed), *extra]
    package_root = str(Path(__file__).resolve().parents[1])  # workers import this very shardsafe
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    log_path = out / "logs" / f"run-{run}.log"
    started, clock = time.time(), time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stderr=log, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=settings.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DemoError(f"run {run} did not finish within {settings.timeout:.0f} s; end of {log_path}:\n{_tail(log_path)}") from None
        except BaseException:  # Ctrl-C included: leave no stray workers
            _kill_group(proc)
            raise
        _kill_group(proc)  # torchrun tears its workers down; make sure nothing lingers after a crash
    return Launch(run, returncode, started, time.perf_counter() - clock, log_path, read_events(out, run))


def read_events(out: Path, run: int) -> list[dict[str, Any]]:
    path = out / "logs" / EVENTS
    if not path.is_file():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("run") == run]


def _events_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _failed(launch: Launch, what: str) -> DemoError:
    return DemoError(f"run {launch.run} {what} (exit code {launch.returncode}); end of {launch.log}:\n{_tail(launch.log)}")


def _run_preempted(settings: DemoSettings, preempt: int) -> Launch:
    launch = _launch(settings, 1, "--preempt-at", str(preempt))
    stopped = _events_of(launch.events, "preempted")
    if launch.returncode != 0 or not stopped:
        raise _failed(launch, f"should have been preempted after step {preempt} and exited cleanly, but was not")
    if stopped[0]["step"] != preempt:
        raise DemoError(f"run 1 was sent SIGTERM after step {preempt} but stopped after step {stopped[0]['step']}")
    return launch


def _run_crashing(settings: DemoSettings, crash: int) -> Launch:
    launch = _launch(settings, 2, "--crash-after", str(crash))
    if launch.returncode == 0:
        raise DemoError(f"run 2 should have been killed after step {crash} but finished normally; see {launch.log}")
    if not _events_of(launch.events, "kill"):
        raise _failed(launch, f"failed before the planned kill after step {crash}")
    if not _events_of(launch.events, "resume"):
        raise DemoError("run 2 did not resume from the preemption checkpoint")
    return launch


def _run_finishing(settings: DemoSettings) -> Launch:
    launch = _launch(settings, 3, "--sync-reference")
    if launch.returncode != 0 or not _events_of(launch.events, "done"):
        raise _failed(launch, "(the second resumed run) failed")
    if not _events_of(launch.events, "resume"):
        raise DemoError("run 3 did not resume from a checkpoint, though run 2 left committed ones")
    return launch


def _evaluate_on_one_process(path: Path) -> dict[str, Any]:
    """Reshard N -> 1: load into a plain module in this process (no process group) and evaluate."""
    from shardsafe.cli.demo_model import GPTConfig, TinyGPT, evaluate, split_corpus

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
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    (settings.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _say(format_summary(summary))
    return 0


def _run_stages(settings: DemoSettings) -> dict[str, Any]:
    """Preempt, resume, crash, resume, reshard, verify; returns the numbers for the summary."""
    preempt, crash = settings.schedule()
    prepare_out(settings.out)
    n, k, root = settings.nproc, settings.save_every, settings.out / CKPT
    wall = time.perf_counter()
    _say(f"[1/5] run 1: {n} CPU ranks (gloo, FSDP2) train for {settings.steps} steps; a CheckpointManager saves asynchronously every {k}")
    _say(f"      steps, keeping the last {KEEP_LAST} and the best by held-out loss; after step {preempt} every rank gets SIGTERM (preemption)")
    run1 = _run_preempted(settings, preempt)
    after_preemption, _ = _on_disk(root)
    _say(f"[2/5] run 1 saved step {preempt} and exited cleanly; run 2 restores it, and is SIGKILLed after step {crash}")
    run2 = _run_crashing(settings, crash)
    after_crash, leftovers = _on_disk(root)
    if not after_crash:
        raise DemoError(f"run 2 left no committed checkpoint in {root}")
    _say(f"[3/5] run 2 was killed after step {crash}; run 3 restores the newest committed checkpoint (step {after_crash[-1]}) and finishes")
    run3 = _run_finishing(settings)
    infos = _list(root)
    final = infos[-1].path
    assert isinstance(final, Path)
    _say(f"[4/5] loading {final.name} onto 1 process (plain module, no process group) and evaluating on held-out text")
    evaluation = _evaluate_on_one_process(final)
    _say(f"[5/5] verifying every block hash of {final.name}")
    verified = _verify(final)
    disk = {"after_preemption": after_preemption, "after_crash": after_crash, "leftovers_after_crash": leftovers}
    return _collect(settings, (preempt, crash), (run1, run2, run3), disk, infos, evaluation, verified, time.perf_counter() - wall)


def _list(root: Path) -> list[Any]:

    infos = list_checkpoints(root)
    if not infos:
        raise DemoError(f"no committed checkpoint under {root} at the end of the run")
    return infos


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _events_of(events, "step")}


def _collect(
    settings: DemoSettings,
    schedule: tuple[int, int],
    runs: tuple[Launch, Launch, Launch],
    disk: dict[str, Any],
    infos: list[Any],
    evaluation: dict[str, Any],
    verified: dict[str, Any],
    total_seconds: float,
) -> dict[str, Any]:
    """Turn the three runs' event logs and the checks into the flat numbers of the summary."""
    preempt, crash = schedule
    run1, run2, run3 = runs
    losses = [_losses(r.events) for r in runs]
    replayed = sorted(set(losses[1]) & set(losses[2]))
    saves = [s for r in runs for s in _events_of(r.events, "save")]
    async_saves = [s for s in saves if s["mode"] == "async"]
    final_save = [s for s in saves if s["mode"] == "final"][0]
    slowest = max(async_saves, key=lambda s: s["seconds"])
    checks = [e["call_seconds"] for r in runs for e in _events_of(r.events, "step") if e.get("saved") is False]
    sync = _events_of(run3.events, "sync_save")[0]
    resume2, resume3 = _events_of(run2.events, "resume")[0], _events_of(run3.events, "resume")[0]
    eval_by_step = {s["step"]: s["eval_loss"] for s in saves}
    best = [i for i in infos if i.best]
    latest = infos[-1]
    kept = [i.step for i in infos]
    median_blocked = statistics.median(s["seconds"] for s in async_saves)
    return {
        "out": str(settings.out),
        "root": str(settings.out / CKPT),
        "nproc": settings.nproc,
        "steps": settings.steps,
        "save_every": settings.save_every,
        "keep_last": KEEP_LAST,
        "keep_best": KEEP_BEST,
        "best_metric": BEST_METRIC,
        "parameters": evaluation["parameters"],
        "preempt_after": preempt,
        "crash_after": crash,
        "exit_codes": [r.returncode for r in runs],
        "run_steps": [[min(ls), max(ls)] for ls in losses],
        "preempted_step": _events_of(run1.events, "preempted")[0]["step"],
        "final_save_step": final_save["step"],
        "final_save_seconds": final_save["seconds"],
        "committed_after_preemption": disk["after_preemption"],
        "resume1_step": resume2["step"],
        "resume1_seconds": resume2["seconds"],
        "committed_at_kill": _events_of(run2.events, "kill")[0]["committed"],
        "committed_after_crash": disk["after_crash"],
        "leftovers_after_crash": disk["leftovers_after_crash"],
        "resume2_step": resume3["step"],
        "resume2_seconds": resume3["seconds"],
        "resume2_skipped": resume3["skipped"],
        "replayed_steps": replayed,
        "replay_max_abs_diff": max((abs(losses[1][s] - losses[2][s]) for s in replayed), default=None),
        "loss_start": losses[0][min(losses[0])],
        "loss_end": losses[2][settings.steps],
        "saves": [{"step": s["step"], "run": s["run"], "mode": s["mode"], "seconds": s["seconds"], "eval_loss": s["eval_loss"]} for s in saves],
        "async_saves": len(async_saves),
        "async_blocked_median": median_blocked,
        "async_blocked_max": slowest["seconds"],
        "async_blocked_max_step": slowest["step"],
        "async_blocked_max_first_of_run": slowest["step"] == min(s["step"] for s in async_saves if s["run"] == slowest["run"]),
        "sync_save_seconds": sync["seconds"],
        "sync_vs_async": sync["seconds"] / median_blocked if median_blocked > 0 else None,
        "check_seconds_median": statistics.median(checks) if checks else None,
        "last_drain_seconds": _events_of(run3.events, "drained")[0]["seconds"],
        "kept_steps": kept,
        "retired_steps": sorted({s["step"] for s in saves} - set(kept)),
        "best_step": best[0].step if best else None,
        "best_eval_loss": best[0].metrics.get(BEST_METRIC) if best else None,
        "latest_step": latest.step,
        "eval_by_step": {str(k): v for k, v in sorted(eval_by_step.items())},
        "checkpoints": [
            {"name": Path(str(i.path)).name, "step": i.step, "bytes": i.size, "metrics": i.metrics, "best": i.best, "latest": i.latest} for i in infos
        ],
        "final_checkpoint": Path(str(latest.path)).name,
        "reshard_load_seconds": evaluation["load_seconds"],
        "eval_loss_one_process": evaluation["loss"],
        "eval_loss_ranks": _events_of(run3.events, "eval")[0]["loss"],
        "verify_passed": True,
        "verify_tensors": verified["tensors"],
        "verify_files": verified["files"],
        "verify_bytes": verified["bytes_checked"],
        "verify_seconds": verified["seconds"],
        "run_seconds": [r.seconds for r in runs],
        "relaunch_to_first_step_seconds": [_events_of(r.events, "step")[0]["time"] - r.started for r in runs],
        "total_seconds": total_seconds,
    }


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def format_summary(v: dict[str, Any]) -> str:
    """The human summary of :func:`_collect`'s numbers: one labelled paragraph (or table) per fact."""
    n = v["nproc"]
    lines = ["", f"shardsafe demo: summary ({v['out']})"]

    def row(label: str, text: str) -> None:
        wrapped = textwrap.wrap(text, SUMMARY_WIDTH - 16) or [""]
        lines.append(f"  {label:<14}{wrapped[0]}")
        lines.extend(f"  {'':<14}{t}" for t in wrapped[1:])

    (a1, b1), (a2, b2), (a3, b3) = v["run_steps"]
    row(
        "demonstrated",
        f"a {n}-rank FSDP2 run saving through shardsafe.CheckpointManager (async saves every {v['save_every']} steps, "
        f"keep_last={v['keep_last']}, keep_best={v['keep_best']} by {v['best_metric']}) was preempted by SIGTERM and resumed, then "
        f"SIGKILLed and resumed from its newest committed async checkpoint; the final {n}-rank checkpoint was resharded onto 1 "
        "process, evaluated and verified.",
    )
    row("model", f"TinyGPT, {v['parameters'] / 1e6:.2f}M parameters; {n} ranks x {BATCH_PER_RANK} sequences of 64 bytes per step")
    row(
        "preemption",
        f"run 1 did steps {a1}-{b1}; after step {v['preempt_after']} rank 0 sent SIGTERM to {'both' if n == 2 else f'all {n}'} ranks' "
        f"processes; at that step boundary the ranks agreed, wrote a final checkpoint of step {v['final_save_step']} synchronously "
        f"({v['final_save_seconds']:.2f} s) and exited cleanly (torchrun exit code {v['exit_codes'][0]}); committed then: steps "
        f"{_steps(v['committed_after_preemption'])}",
    )
    row("resume 1", f"run 2: restore() loaded step {v['resume1_step']} in {v['resume1_seconds']:.2f} s and did steps {a2}-{b2}")
    leftovers = v["leftovers_after_crash"]
    row(
        "crash",
        f"run 2 was SIGKILLed after step {v['crash_after']} (torchrun exit code {v['exit_codes'][1]}), no final save; committed on disk "
        f"afterwards: steps {_steps(v['committed_after_crash'])}"
        + (f", plus {leftovers} hidden unfinished save folder(s) (invisible; `shardsafe gc` removes them)" if leftovers else ""),
    )
    replay = ""
    if v["replayed_steps"]:
        steps = v["replayed_steps"]
        same = "bitwise identical to" if v["replay_max_abs_diff"] == 0 else f"within {v['replay_max_abs_diff']:.2g} of"
        replay = f"; steps {steps[0]}-{steps[-1]}, lost in the crash, were redone with losses {same} run 2's"
    skipped = f" (skipping damaged {_steps(v['resume2_skipped'])})" if v["resume2_skipped"] else ""
    row(
        "resume 2",
        f"run 3: restore() loaded step {v['resume2_step']}, the newest committed checkpoint{skipped}, in {v['resume2_seconds']:.2f} s "
        f"and did steps {a3}-{b3}{replay}",
    )
    row("loss", f"start {v['loss_start']:.3f} (step 1); end {v['loss_end']:.3f} (step {v['steps']})")
    first = ", the first save of its process" if v["async_blocked_max_first_of_run"] else ""
    ratio = f"{v['sync_vs_async']:.1f}x the median" if v["sync_vs_async"] is not None else "n/a"
    row(
        "async saves",
        f"{v['async_saves']} saves blocked the training loop for median {_ms(v['async_blocked_median'])}, max "
        f"{_ms(v['async_blocked_max'])} (step {v['async_blocked_max_step']}{first}); write, hash, commit and retention ran in a "
        f"background thread. One synchronous save of the same state (shardsafe.save after the run) blocked it for "
        f"{_ms(v['sync_save_seconds'])} ({ratio})",
    )
    if v["check_seconds_median"] is not None:
        row(
            "other steps",
            f"manager.save() on steps without a save took median {_ms(v['check_seconds_median'])} (an all-gather of the preemption "
            "flag, which also waits for the slowest rank)",
        )
    best = f"step {v['best_step']} ({v['best_metric']} {v['best_eval_loss']:.4f})" if v["best_step"] is not None else "none"
    among = ", the best among them" if v["best_step"] in v["kept_steps"][-v["keep_last"] :] else " plus the best"
    row(
        "retention",
        f"list_checkpoints: steps {_steps(v['kept_steps'])} remain (the last {v['keep_last']}{among}); best {best}, latest step "
        f"{v['latest_step']}; retired: steps {_steps(v['retired_steps'])}",
    )
    row(f"reshard {n}->1", f"load of {v['final_checkpoint']} into a plain module, no process group: {v['reshard_load_seconds']:.3f} s")
    row(
        "eval loss",
        f"{v['eval_loss_one_process']:.4f} on held-out text (1 process); the {n} ranks measured {v['eval_loss_ranks']:.4f} "
        f"(|diff| {abs(v['eval_loss_one_process'] - v['eval_loss_ranks']):.1g})",
    )
    row(
        "verify",
        f"passed on {v['final_checkpoint']}: {v['verify_tensors']} tensors in {v['verify_files']} files, "
        f"{format_bytes(v['verify_bytes'])} hashed in {v['verify_seconds']:.2f} s",
    )
    for i, c in enumerate(v["checkpoints"]):
        marks = [m for m, on in (("latest", c["latest"]), ("best", c["best"])) if on]
        metric = c["metrics"].get(v["best_metric"])
        text = f"{c['name']}  {format_bytes(c['bytes']):>8}  {v['best_metric']} {metric:.4f}" if metric is not None else c["name"]
        lines.append(f"  {'checkpoints' if i == 0 else '':<14}{text}{'  <- ' + ', '.join(marks) if marks else ''}")
    secs = v["run_seconds"]
    row("wall time", f"{v['total_seconds']:.1f} s (run 1 {secs[0]:.1f} s, run 2 {secs[1]:.1f} s, run 3 {secs[2]:.1f} s)")
    row("details", f"{Path(v['out']) / 'summary.json'}; worker logs in {Path(v['out']) / 'logs'}; `shardsafe list {v['root']}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardsafe.cli.demo worker ...`` (what torchrun starts on each rank)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "worker":
        print("usage: python -m shardsafe.cli.demo worker ...  (run `shardsafe demo` instead)", file=sys.stderr)
        return 2
    return worker_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
