"""The demo's results: the three runs' event logs and the final checks turned into the flat numbers
of ``summary.json`` (:func:`collect`) and the printed summary (:func:`format_summary`)."""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsafe.cli.demo.settings import BATCH_PER_RANK, BEST_METRIC, CKPT, KEEP_BEST, KEEP_LAST, DemoSettings
from shardsafe.cli.formatting import format_bytes, plural

__all__ = ["Launch", "collect", "events_of", "format_summary"]

SUMMARY_WIDTH = 124


@dataclass(frozen=True)
class Launch:
    """One finished torchrun launch: its exit code, timing, log file and the events rank 0 recorded."""

    run: int
    returncode: int
    started: float  # time.time() at launch
    seconds: float
    log: Path
    events: list[dict[str, Any]]


def events_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The events of one kind (``step``, ``save``, ``resume``...) from a launch's log, in order."""
    return [e for e in events if e["event"] == kind]


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events_of(events, "step")}


@dataclass(frozen=True)
class _Facts:
    """What several summary fields are computed from, derived once from the runs' events and the kept
    checkpoints (in the order a missing event or checkpoint is first noticed)."""

    losses: list[dict[int, float]]
    replayed: list[int]
    saves: list[dict[str, Any]]
    async_saves: list[dict[str, Any]]
    final_save: dict[str, Any]
    slowest: dict[str, Any]
    checks: list[float]
    sync: dict[str, Any]
    resume2: dict[str, Any]
    resume3: dict[str, Any]
    eval_by_step: dict[int, float]
    best: list[Any]
    latest: Any
    kept: list[int]
    median_blocked: float


def _facts(runs: tuple[Launch, Launch, Launch], infos: list[Any]) -> _Facts:
    """The shared facts of :func:`collect`: each derived once, so the fields agree with each other."""
    _, run2, run3 = runs
    losses = [_losses(r.events) for r in runs]
    saves = [s for r in runs for s in events_of(r.events, "save")]
    async_saves = [s for s in saves if s["mode"] == "async"]
    return _Facts(
        losses=losses,
        replayed=sorted(set(losses[1]) & set(losses[2])),
        saves=saves,
        async_saves=async_saves,
        final_save=[s for s in saves if s["mode"] == "final"][0],
        slowest=max(async_saves, key=lambda s: s["seconds"]),
        checks=[e["call_seconds"] for r in runs for e in events_of(r.events, "step") if e.get("saved") is False],
        sync=events_of(run3.events, "sync_save")[0],
        resume2=events_of(run2.events, "resume")[0],
        resume3=events_of(run3.events, "resume")[0],
        eval_by_step={s["step"]: s["eval_loss"] for s in saves},
        best=[i for i in infos if i.best],
        latest=infos[-1],
        kept=[i.step for i in infos],
        median_blocked=statistics.median(s["seconds"] for s in async_saves),
    )


def collect(
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
    facts = _facts(runs, infos)
    return {
        **_setup_fields(settings, schedule, evaluation),
        **_recovery_fields(settings, runs, disk, facts),
        **_save_fields(runs, facts),
        **_retention_fields(infos, facts),
        **_check_fields(runs, evaluation, verified, total_seconds),
    }


def _setup_fields(settings: DemoSettings, schedule: tuple[int, int], evaluation: dict[str, Any]) -> dict[str, Any]:
    """What the demo was asked to do: the settings and the preemption/crash schedule."""
    preempt, crash = schedule
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
    }


def _recovery_fields(
    settings: DemoSettings, runs: tuple[Launch, Launch, Launch], disk: dict[str, Any], facts: _Facts
) -> dict[str, Any]:
    """How the runs ended and resumed: exit codes, what was committed, the steps replayed after the crash."""
    run1, run2, _ = runs
    losses, replayed = facts.losses, facts.replayed
    return {
        "exit_codes": [r.returncode for r in runs],
        "run_steps": [[min(ls), max(ls)] for ls in losses],
        "preempted_step": events_of(run1.events, "preempted")[0]["step"],
        "final_save_step": facts.final_save["step"],
        "final_save_seconds": facts.final_save["seconds"],
        "committed_after_preemption": disk["after_preemption"],
        "resume1_step": facts.resume2["step"],
        "resume1_seconds": facts.resume2["seconds"],
        "committed_at_kill": events_of(run2.events, "kill")[0]["committed"],
        "committed_after_crash": disk["after_crash"],
        "leftovers_after_crash": disk["leftovers_after_crash"],
        "resume2_step": facts.resume3["step"],
        "resume2_seconds": facts.resume3["seconds"],
        "resume2_skipped": facts.resume3["skipped"],
        "replayed_steps": replayed,
        "replay_max_abs_diff": max((abs(losses[1][s] - losses[2][s]) for s in replayed), default=None),
        "loss_start": losses[0][min(losses[0])],
        "loss_end": losses[2][settings.steps],
    }


def _save_fields(runs: tuple[Launch, Launch, Launch], facts: _Facts) -> dict[str, Any]:
    """Every save, and how long the async ones blocked the loop against one synchronous save."""
    async_saves, slowest, median_blocked, checks = facts.async_saves, facts.slowest, facts.median_blocked, facts.checks
    return {
        "saves": [
            {
                "step": s["step"],
                "run": s["run"],
                "mode": s["mode"],
                "seconds": s["seconds"],
                "eval_loss": s["eval_loss"],
            }
            for s in facts.saves
        ],
        "async_saves": len(async_saves),
        "async_blocked_median": median_blocked,
        "async_blocked_max": slowest["seconds"],
        "async_blocked_max_step": slowest["step"],
        "async_blocked_max_first_of_run": slowest["step"]
        == min(s["step"] for s in async_saves if s["run"] == slowest["run"]),
        "sync_save_seconds": facts.sync["seconds"],
        "sync_vs_async": facts.sync["seconds"] / median_blocked if median_blocked > 0 else None,
        "check_seconds_median": statistics.median(checks) if checks else None,
        "last_drain_seconds": events_of(runs[2].events, "drained")[0]["seconds"],
    }


def _retention_fields(infos: list[Any], facts: _Facts) -> dict[str, Any]:
    """What retention kept and retired, and the kept checkpoints as ``list_checkpoints`` describes them."""
    best, latest, kept = facts.best, facts.latest, facts.kept
    return {
        "kept_steps": kept,
        "retired_steps": sorted({s["step"] for s in facts.saves} - set(kept)),
        "best_step": best[0].step if best else None,
        "best_eval_loss": best[0].metrics.get(BEST_METRIC) if best else None,
        "latest_step": latest.step,
        "eval_by_step": {str(k): v for k, v in sorted(facts.eval_by_step.items())},
        "checkpoints": [
            {
                "name": Path(str(i.path)).name,
                "step": i.step,
                "bytes": i.size,
                "metrics": i.metrics,
                "best": i.best,
                "latest": i.latest,
            }
            for i in infos
        ],
        "final_checkpoint": Path(str(latest.path)).name,
    }


def _check_fields(
    runs: tuple[Launch, Launch, Launch], evaluation: dict[str, Any], verified: dict[str, Any], total_seconds: float
) -> dict[str, Any]:
    """The final checks (reshard, evaluation, verify) and the wall times."""
    return {
        "reshard_load_seconds": evaluation["load_seconds"],
        "eval_loss_one_process": evaluation["loss"],
        "eval_loss_ranks": events_of(runs[2].events, "eval")[0]["loss"],
        "verify_passed": True,
        "verify_tensors": verified["tensors"],
        "verify_files": verified["files"],
        "verify_bytes": verified["bytes_checked"],
        "verify_seconds": verified["seconds"],
        "run_seconds": [r.seconds for r in runs],
        "relaunch_to_first_step_seconds": [events_of(r.events, "step")[0]["time"] - r.started for r in runs],
        "total_seconds": total_seconds,
    }


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


# one paragraph of the summary: its label and its text (wrapped by _wrapped)
_Paragraph = tuple[str, str]


def format_summary(v: dict[str, Any]) -> str:
    """The human summary of :func:`collect`'s numbers: one labelled paragraph (or table) per fact."""
    lines = ["", f"shardsafe demo: summary ({v['out']})"]
    for label, text in [*_story(v), *_recovery(v), *_timings(v), *_results(v)]:
        lines.extend(_wrapped(label, text))
    lines.extend(_checkpoint_table(v))
    for label, text in _closing(v):
        lines.extend(_wrapped(label, text))
    return "\n".join(lines)


def _wrapped(label: str, text: str) -> list[str]:
    """A paragraph wrapped to the summary's width, its label in a left column so the facts line up."""
    wrapped = textwrap.wrap(text, SUMMARY_WIDTH - 16) or [""]
    return [f"  {label:<14}{wrapped[0]}", *(f"  {'':<14}{t}" for t in wrapped[1:])]


def _story(v: dict[str, Any]) -> list[_Paragraph]:
    """What the demo did, the model it trained and how run 1 was preempted."""
    n = v["nproc"]
    (a1, b1), (_, _), (_, _) = v["run_steps"]  # all three unpacked here, where a malformed list is first noticed
    return [
        (
            "demonstrated",
            f"a {n}-rank FSDP2 run saving through shardsafe.CheckpointManager (async saves every "
            f"{plural(v['save_every'], 'step')}, "
            f"keep_last={v['keep_last']}, keep_best={v['keep_best']} by {v['best_metric']}) was preempted by SIGTERM "
            "and resumed, then "
            f"SIGKILLed and resumed from its newest committed async checkpoint; the final {n}-rank checkpoint was "
            "resharded onto 1 "
            "process, evaluated and verified.",
        ),
        (
            "model",
            f"TinyGPT, {v['parameters'] / 1e6:.2f}M parameters; {plural(n, 'rank')} x {BATCH_PER_RANK} sequences of "
            "64 bytes per step",
        ),
        (
            "preemption",
            f"run 1 did steps {a1}-{b1}; after step {v['preempt_after']} rank 0 sent SIGTERM to "
            f"{'both' if n == 2 else f'all {n}'} ranks' "
            f"processes; at that step boundary the ranks agreed, wrote a final checkpoint of step "
            f"{v['final_save_step']} synchronously "
            f"({v['final_save_seconds']:.2f} s) and exited cleanly (torchrun exit code {v['exit_codes'][0]}); "
            "committed then: steps "
            f"{_steps(v['committed_after_preemption'])}",
        ),
    ]


def _recovery(v: dict[str, Any]) -> list[_Paragraph]:
    """The first resume, the crash and the resume from the newest committed checkpoint after it."""
    (_, _), (a2, b2), (a3, b3) = v["run_steps"]
    leftovers = v["leftovers_after_crash"]
    replay = ""
    if v["replayed_steps"]:
        steps = v["replayed_steps"]
        same = "bitwise identical to" if v["replay_max_abs_diff"] == 0 else f"within {v['replay_max_abs_diff']:.2g} of"
        replay = f"; steps {steps[0]}-{steps[-1]}, lost in the crash, were redone with losses {same} run 2's"
    skipped = f" (skipping damaged {_steps(v['resume2_skipped'])})" if v["resume2_skipped"] else ""
    return [
        (
            "resume 1",
            f"run 2: restore() loaded step {v['resume1_step']} in {v['resume1_seconds']:.2f} s and did steps {a2}-{b2}",
        ),
        (
            "crash",
            f"run 2 was SIGKILLed after step {v['crash_after']} (torchrun exit code {v['exit_codes'][1]}), no final "
            "save; committed on disk "
            f"afterwards: steps {_steps(v['committed_after_crash'])}"
            + (
                f", plus {plural(leftovers, 'hidden unfinished save folder')} (invisible; `shardsafe gc` removes them)"
                if leftovers
                else ""
            ),
        ),
        (
            "resume 2",
            f"run 3: restore() loaded step {v['resume2_step']}, the newest committed checkpoint{skipped}, in "
            f"{v['resume2_seconds']:.2f} s "
            f"and did steps {a3}-{b3}{replay}",
        ),
    ]


def _timings(v: dict[str, Any]) -> list[_Paragraph]:
    """The loss curve's ends and how long saving (and not saving) held up the training loop."""
    first = ", the first save of its process" if v["async_blocked_max_first_of_run"] else ""
    ratio = f"{v['sync_vs_async']:.1f}x the median" if v["sync_vs_async"] is not None else "n/a"
    paragraphs = [
        ("loss", f"start {v['loss_start']:.3f} (step 1); end {v['loss_end']:.3f} (step {v['steps']})"),
        (
            "async saves",
            f"{plural(v['async_saves'], 'save')} blocked the training loop for median "
            f"{_ms(v['async_blocked_median'])}, max "
            f"{_ms(v['async_blocked_max'])} (step {v['async_blocked_max_step']}{first}); write, hash, commit and "
            "retention ran in a "
            f"background thread. One synchronous save of the same state (shardsafe.save after the run) blocked it for "
            f"{_ms(v['sync_save_seconds'])} ({ratio})",
        ),
    ]
    if v["check_seconds_median"] is not None:
        paragraphs.append(
            (
                "other steps",
                f"manager.save() on steps without a save took median {_ms(v['check_seconds_median'])} (an all-gather "
                "of the preemption "
                "flag, which also waits for the slowest rank)",
            )
        )
    return paragraphs


def _results(v: dict[str, Any]) -> list[_Paragraph]:
    """What retention kept, and the final checkpoint resharded onto one process, evaluated and verified."""
    n = v["nproc"]
    best = (
        f"step {v['best_step']} ({v['best_metric']} {v['best_eval_loss']:.4f})"
        if v["best_step"] is not None
        else "none"
    )
    among = ", the best among them" if v["best_step"] in v["kept_steps"][-v["keep_last"] :] else " plus the best"
    return [
        (
            "retention",
            f"list_checkpoints: steps {_steps(v['kept_steps'])} remain (the last {v['keep_last']}{among}); best "
            f"{best}, latest step "
            f"{v['latest_step']}; retired: steps {_steps(v['retired_steps'])}",
        ),
        (
            f"reshard {n}->1",
            f"load of {v['final_checkpoint']} into a plain module, no process group: {v['reshard_load_seconds']:.3f} s",
        ),
        (
            "eval loss",
            f"{v['eval_loss_one_process']:.4f} on held-out text (1 process); the {plural(n, 'rank')} measured "
            f"{v['eval_loss_ranks']:.4f} "
            f"(|diff| {abs(v['eval_loss_one_process'] - v['eval_loss_ranks']):.1g})",
        ),
        (
            "verify",
            f"passed on {v['final_checkpoint']}: {plural(v['verify_tensors'], 'tensor')} in "
            f"{plural(v['verify_files'], 'shard file')}, "
            f"{format_bytes(v['verify_bytes'])} hashed in {v['verify_seconds']:.2f} s",
        ),
    ]


def _checkpoint_table(v: dict[str, Any]) -> list[str]:
    """One unwrapped line per kept checkpoint (name, size, metric, marks), so the columns stay aligned."""
    lines = []
    for i, c in enumerate(v["checkpoints"]):
        marks = [m for m, on in (("latest", c["latest"]), ("best", c["best"])) if on]
        metric = c["metrics"].get(v["best_metric"])
        text = (
            f"{c['name']}  {format_bytes(c['bytes']):>8}  {v['best_metric']} {metric:.4f}"
            if metric is not None
            else c["name"]
        )
        lines.append(f"  {'checkpoints' if i == 0 else '':<14}{text}{'  <- ' + ', '.join(marks) if marks else ''}")
    return lines


def _closing(v: dict[str, Any]) -> list[_Paragraph]:
    """The wall times, and where to look further."""
    secs = v["run_seconds"]
    return [
        (
            "wall time",
            f"{v['total_seconds']:.1f} s (run 1 {secs[0]:.1f} s, run 2 {secs[1]:.1f} s, run 3 {secs[2]:.1f} s)",
        ),
        (
            "details",
            f"{Path(v['out']) / 'summary.json'}; worker logs in {Path(v['out']) / 'logs'}; "
            f"`shardsafe list {v['root']}`",
        ),
    ]
