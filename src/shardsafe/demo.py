"""``shardsafe demo``: crash a sharded training run, resume it, reshard its checkpoint, check it.

Two halves live here:

* the *worker* (``python -m shardsafe.demo worker ...``), started by ``torch.distributed.run`` on
  N CPU ranks with gloo: it trains :class:`~shardsafe.demo_model.TinyGPT` under FSDP2, resumes
  from the latest committed checkpoint it finds, saves every few steps, and, when told to,
  SIGKILLs itself after a given step the way a preempted node dies;
* the *orchestrator* (:func:`run_demo`, behind ``shardsafe demo``): it launches the run, lets it
  die, launches it again, reloads the final checkpoint into one plain process (no process group),
  verifies it and prints what happened.

The worker's rank 0 records everything the summary needs as JSON lines in
``<out>/logs/events.jsonl``, flushed line by line, so a SIGKILL loses nothing written before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch

from .cli import format_bytes

DEFAULT_OUT = Path("demo-run")
MARKER = ".shardsafe-demo"  # marks a folder this demo made, so only such a folder is ever wiped
EVENTS = "events.jsonl"
BATCH_PER_RANK = 8
LEARNING_RATE = 2e-3
_STEP_DIR = re.compile(r"step-(\d{6,})")


class DemoError(Exception):
    """A demo stage failed; the message says which and shows the worker's log tail."""


# ----------------------------------------------------------------------------- shared helpers


def step_dir(step: int) -> str:
    return f"step-{step:06d}"


def committed_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under ``out``, oldest first.

    Only folders holding a manifest count: a save interrupted by the crash leaves at most a hidden
    temporary folder, which neither matches the name pattern nor has a manifest.
    """
    from .commit import is_committed

    found = []
    for entry in out.iterdir() if out.is_dir() else []:
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and is_committed(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


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
    p = argparse.ArgumentParser(prog="python -m shardsafe.demo worker", description="One rank of the demo run (started by torchrun).")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--attempt", type=int, required=True, help="launch number (1, 2), recorded in the event log")
    p.add_argument("--crash-after", type=int, default=0, help="SIGKILL every rank after this step (0: never)")
    p.add_argument("--seed", type=int, default=0)
    return p


def worker_main(argv: list[str]) -> int:
    """Train (resuming if a checkpoint exists), save periodically, maybe die; see the module doc."""
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

    import shardsafe

    from .demo_model import GPTConfig, TinyGPT

    torch.manual_seed(seed)  # same initial weights on every rank
    model = TinyGPT(GPTConfig())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor(total_steps))
    torch.manual_seed(seed + 1 + dist.get_rank())  # a different, reproducible data order per rank
    return {"model": model, "optim": optim, "sched": sched, "rng": shardsafe.RNGState(), "step": 0}


def _resume(state: dict[str, Any], out: Path, log: EventLog) -> int:
    """Load the latest committed checkpoint if there is one (rank 0 decides, all ranks load)."""
    import torch.distributed as dist

    import shardsafe

    found = committed_checkpoints(out)
    choice = [str(found[-1][1]) if found else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        log.emit("fresh")
        return 0
    started = time.perf_counter()
    shardsafe.load(choice[0], state)
    log.emit("resume", checkpoint=Path(choice[0]).name, step=int(state["step"]), seconds=time.perf_counter() - started)
    return int(state["step"])


def _train_step(state: dict[str, Any], data: torch.Tensor) -> float:
    """One optimizer step; returns the loss averaged over ranks."""
    import torch.distributed as dist

    from .demo_model import lm_loss, sample_batch

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


def _save(state: dict[str, Any], out: Path, step: int, loss: float, log: EventLog) -> None:
    import shardsafe

    state["step"] = step
    path = out / step_dir(step)
    started = time.perf_counter()
    shardsafe.save(path, state, metadata={"step": step, "loss": loss, "run": log.run})
    seconds = time.perf_counter() - started
    log.emit("save", step=step, checkpoint=path.name, seconds=seconds, bytes=folder_bytes(path) if log.enabled else 0)


def _train(args: argparse.Namespace, mesh: Any, log: EventLog) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from .demo_model import evaluate, split_corpus

    state = _build_state(args.seed, args.steps, mesh)
    start = _resume(state, args.out, log)
    train, held_out = split_corpus()
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
        log.emit("step", step=step, loss=loss)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step == args.crash_after:
            log.emit("kill", step=step)
            bar.close()
            # Without the barrier a rank that dies first can get rank 0 torn down before it records the kill.
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # every rank: no cleanup, no flush, like a node that loses power
        if step % args.save_every == 0 or step == args.steps:
            _save(state, args.out, step, loss, log)
    bar.close()
    log.emit("eval", loss=evaluate(state["model"], held_out, state["model"].cfg.seq_len))
    log.emit("done", step=args.steps)


# ----------------------------------------------------------------------------- orchestrator


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 40
    save_every: int = 5
    out: Path = DEFAULT_OUT
    nproc: int = 2
    crash_after: int | None = None  # None: pick a step between two saves, about halfway
    seed: int = 0
    timeout: float = 300.0  # per launch

    def crash_step(self) -> int:
        """The step after which run 1 is killed; validated so a checkpoint exists before it."""
        if self.steps < 2 or self.save_every < 1 or self.nproc < 1:
            raise DemoError("--steps must be at least 2, --save-every and --nproc at least 1")
        if self.crash_after is not None:
            step = self.crash_after
        else:
            last_save = max(self.save_every, self.steps // 2 // self.save_every * self.save_every)
            step = last_save + (self.save_every + 1) // 2
        if not self.save_every <= step < self.steps:
            raise DemoError(
                f"the crash must come after the first save (step {self.save_every}) and before the last step ({self.steps}), "
                f"but it would be after step {step}: use more --steps, a smaller --save-every, or --crash-after"
            )
        return step


@dataclass
class Launch:
    run: int
    returncode: int
    started: float  # time.time() at launch
    seconds: float
    log: Path


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


def _launch(settings: DemoSettings, run: int, crash_after: int) -> Launch:
    """Run torchrun with N workers; worker stdout (the progress bar) goes to our stdout, stderr to a log."""
    out = settings.out.absolute()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(settings.nproc), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), "-m", "shardsafe.demo", "worker", "--out", str(out), "--attempt", str(run)]
    cmd += ["--steps", str(settings.steps), "--save-every", str(settings.save_every), "--crash-after", str(crash_after), "--seed", str(settings.seed)]
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
    return Launch(run, returncode, started, time.perf_counter() - clock, log_path)


def read_events(out: Path, run: int) -> list[dict[str, Any]]:
    path = out / "logs" / EVENTS
    if not path.is_file():
        return []
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("run") == run]


def _events_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


def _run_crashing(settings: DemoSettings, crash: int) -> tuple[Launch, list[dict[str, Any]]]:
    launch = _launch(settings, 1, crash)
    events = read_events(settings.out, 1)
    if launch.returncode == 0:
        raise DemoError(f"run 1 should have been killed after step {crash} but finished normally; see {launch.log}")
    if not _events_of(events, "kill"):
        raise DemoError(f"run 1 failed before the planned kill (exit code {launch.returncode}); end of {launch.log}:\n{_tail(launch.log)}")
    return launch, events


def _run_resuming(settings: DemoSettings) -> tuple[Launch, list[dict[str, Any]]]:
    launch = _launch(settings, 2, 0)
    events = read_events(settings.out, 2)
    if launch.returncode != 0 or not _events_of(events, "done"):
        raise DemoError(f"run 2 (the resumed run) failed with exit code {launch.returncode}; end of {launch.log}:\n{_tail(launch.log)}")
    if not _events_of(events, "resume"):
        raise DemoError("run 2 did not resume from a checkpoint, though run 1 left committed ones")
    return launch, events


def _evaluate_on_one_process(path: Path) -> dict[str, Any]:
    """Reshard N -> 1: load into a plain module in this process (no process group) and evaluate."""
    import shardsafe

    from .demo_model import GPTConfig, TinyGPT, evaluate, split_corpus

    model = TinyGPT(GPTConfig())
    warm_imports()
    started = time.perf_counter()
    try:
        shardsafe.load(path, {"model": model})
    except shardsafe.ShardsafeError as exc:
        raise DemoError(f"loading {path} onto one process failed: {exc}") from exc
    seconds = time.perf_counter() - started
    _, held_out = split_corpus()
    return {
        "load_seconds": seconds,
        "loss": evaluate(model, held_out, model.cfg.seq_len),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _verify(path: Path) -> dict[str, Any]:
    import shardsafe

    started = time.perf_counter()
    try:
        summary = shardsafe.verify(path)
    except shardsafe.ShardsafeError as exc:
        raise DemoError(f"verify failed on {path}: {exc}") from exc
    return {**summary, "seconds": time.perf_counter() - started}


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
    """Crash, resume, reshard, verify; returns the numbers for the summary."""
    crash = settings.crash_step()
    prepare_out(settings.out)
    n = settings.nproc
    wall = time.perf_counter()
    _say(f"[1/4] run 1: {n} CPU ranks (gloo, FSDP2) train for {settings.steps} steps, saving every {settings.save_every};")
    _say(f"      it will be SIGKILLed after step {crash}")
    run1, events1 = _run_crashing(settings, crash)
    found = committed_checkpoints(settings.out)
    if not found:
        raise DemoError(f"run 1 left no committed checkpoint in {settings.out}")
    _say(f"[2/4] run 1 was killed after step {crash}; relaunching: the new run resumes from {found[-1][1].name}, the latest committed checkpoint")
    run2, events2 = _run_resuming(settings)
    final = committed_checkpoints(settings.out)[-1][1]
    _say(f"[3/4] loading {final.name} onto 1 process (plain module, no process group) and evaluating on held-out text")
    evaluation = _evaluate_on_one_process(final)
    _say(f"[4/4] verifying every block hash of {final.name}")
    verified = _verify(final)
    return _collect(settings, crash, (run1, events1), (run2, events2), evaluation, verified, time.perf_counter() - wall)


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _events_of(events, "step")}


def _collect(
    settings: DemoSettings,
    crash: int,
    first: tuple[Launch, list[dict[str, Any]]],
    second: tuple[Launch, list[dict[str, Any]]],
    evaluation: dict[str, Any],
    verified: dict[str, Any],
    total_seconds: float,
) -> dict[str, Any]:
    """Turn the two runs' event logs and the checks into the flat numbers of the summary."""
    (run1, events1), (run2, events2) = first, second
    resume = _events_of(events2, "resume")[0]
    losses1, losses2 = _losses(events1), _losses(events2)
    replayed = sorted(set(losses1) & set(losses2))
    saves = _events_of(events1, "save") + _events_of(events2, "save")
    seconds = [s["seconds"] for s in saves]
    first_step2 = min(losses2)
    writers = {s["checkpoint"]: s["run"] for s in saves}
    final = committed_checkpoints(settings.out)[-1][1]
    return {
        "out": str(settings.out),
        "nproc": settings.nproc,
        "steps": settings.steps,
        "save_every": settings.save_every,
        "parameters": evaluation["parameters"],
        "crash_after": crash,
        "run1_exit_code": run1.returncode,
        "run1_steps": [min(losses1), max(losses1)],
        "resumed_from": resume["checkpoint"],
        "resumed_step": resume["step"],
        "run2_steps": [first_step2, max(losses2)],
        "loss_start": losses1[min(losses1)],
        "loss_at_crash": losses1[crash],
        "loss_after_resume": losses2[first_step2],
        "loss_end": losses2[settings.steps],
        "replayed_steps": replayed,
        "replay_max_abs_diff": max((abs(losses1[s] - losses2[s]) for s in replayed), default=None),
        "saves": len(saves),
        "save_seconds_median": statistics.median(seconds),
        "save_seconds_max": max(seconds),
        "save_bytes_each": statistics.median(s["bytes"] for s in saves),
        "save_bytes_total": sum(s["bytes"] for s in saves),
        "resume_load_seconds": resume["seconds"],
        "relaunch_to_first_step_seconds": _events_of(events2, "step")[0]["time"] - run2.started,
        "final_checkpoint": final.name,
        "reshard_load_seconds": evaluation["load_seconds"],
        "eval_loss_one_process": evaluation["loss"],
        "eval_loss_ranks": _events_of(events2, "eval")[0]["loss"],
        "verify_passed": True,
        "verify_tensors": verified["tensors"],
        "verify_files": verified["files"],
        "verify_bytes": verified["bytes_checked"],
        "checkpoints": [{"name": p.name, "bytes": folder_bytes(p), "run": writers.get(p.name)} for _, p in committed_checkpoints(settings.out)],
        "run1_seconds": run1.seconds,
        "run2_seconds": run2.seconds,
        "verify_seconds": verified["seconds"],
        "total_seconds": total_seconds,
    }


def format_summary(v: dict[str, Any]) -> str:
    """The human summary of :func:`_collect`'s numbers: one labelled line (or a few) per fact."""
    n = v["nproc"]
    lines = ["", f"shardsafe demo: summary ({v['out']})"]

    def row(label: str, *texts: str) -> None:
        lines.append(f"  {label:<14}{texts[0]}")
        lines.extend(f"  {'':<14}{t}" for t in texts[1:])

    row(
        "demonstrated",
        f"a {n}-rank FSDP2 training run was SIGKILLed mid-run after step {v['crash_after']}; the restart found the last",
        f"committed checkpoint ({v['resumed_from']}) and resumed model, optimizer, LR schedule and RNG from it; the final",
        f"{n}-rank checkpoint was then resharded onto 1 plain process for evaluation, and verified.",
    )
    row("model", f"TinyGPT, {v['parameters'] / 1e6:.2f}M parameters; {n} ranks x {BATCH_PER_RANK} sequences of 64 bytes per step")
    row(
        "steps",
        f"{v['steps']}: run 1 did {v['run1_steps'][0]}-{v['run1_steps'][1]} and was SIGKILLed (torchrun exit code {v['run1_exit_code']}); "
        f"run 2 resumed at step {v['resumed_step']} and did {v['run2_steps'][0]}-{v['run2_steps'][1]}",
    )
    row(
        "loss",
        f"start {v['loss_start']:.3f} (step 1); first step after resume {v['loss_after_resume']:.3f} (step {v['run2_steps'][0]}); "
        f"end {v['loss_end']:.3f} (step {v['steps']})",
    )
    if v["replayed_steps"]:
        steps = v["replayed_steps"]
        same = "bitwise identical to" if v["replay_max_abs_diff"] == 0 else f"within {v['replay_max_abs_diff']:.2g} of"
        row("replay", f"steps {steps[0]}-{steps[-1]}, lost in the crash, were redone by run 2 with losses {same} run 1's")
    row(
        "saves",
        f"{v['saves']} saves: median {v['save_seconds_median']:.3f} s, max {v['save_seconds_max']:.3f} s; "
        f"{format_bytes(v['save_bytes_each'])} each, {format_bytes(v['save_bytes_total'])} written in all",
    )
    row(
        "resume",
        f"load of {v['resumed_from']} on {n} ranks {v['resume_load_seconds']:.2f} s (includes torch's one-time set-up of the optimizer state);",
        f"relaunch to first new step done {v['relaunch_to_first_step_seconds']:.1f} s (mostly process start and importing torch)",
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
    marks = {v["resumed_from"]: "  <- run 2 resumed from here", v["final_checkpoint"]: "  <- final"}
    row(
        "checkpoints",
        *[f"{c['name']}  {format_bytes(c['bytes']):>8}  run {c['run']}{marks.get(c['name'], '')}" for c in v["checkpoints"]],
    )
    row("wall time", f"{v['total_seconds']:.1f} s (run 1 {v['run1_seconds']:.1f} s, run 2 {v['run2_seconds']:.1f} s)")
    row("details", f"{Path(v['out']) / 'summary.json'}; worker logs in {Path(v['out']) / 'logs'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardsafe.demo worker ...`` (what torchrun starts on each rank)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "worker":
        print("usage: python -m shardsafe.demo worker ...  (run `shardsafe demo` instead)", file=sys.stderr)
        return 2
    return worker_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
