"""Mount the recording file system, run a workload through it, then cut and check.

:func:`record` runs one workload (``workloads.py``) in its own process against a fresh mount and
returns its operation log (:class:`~powerloss.crashfs.OpLog`); the mount is always taken down,
also when the workload fails or hangs (``fusermount3 -u``, then a lazy unmount, then the server
is killed). :func:`explore` cuts the log at each named crash point reached, right after each
"done" marker, and at random moments, generates the crash states the profile allows at each cut,
replays each into a fresh folder and asks the checker about it. With
``SHARDSAFE_POWERLOSS_REPORT`` set, each exploration appends its counts to that file (JSON
lines), which ``tools/powerloss_report.py`` turns into the table in docs/RELIABILITY.md.
"""

from __future__ import annotations

import ctypes.util
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from powerloss.checks import Checker, Problem, Verdict
from powerloss.crashfs import OpLog, materialise, state_hash

HERE = Path(__file__).resolve().parent
MOUNT_TIMEOUT_S = 20.0
WORKLOAD_TIMEOUT_S = 300.0


def unavailable() -> str | None:
    """Why the harness cannot run here (None when it can)."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (apt-get install fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is missing (apt-get install libfuse3-3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"the FUSE binding mfusepy cannot be loaded: {exc}"
    return None


def _unmount(mount: Path, server: subprocess.Popen[bytes]) -> None:
    for args in (["fusermount3", "-u", str(mount)], ["fusermount3", "-u", "-z", str(mount)]):
        if server.poll() is not None and not os.path.ismount(mount):
            break
        subprocess.run(args, capture_output=True, timeout=30)
        try:
            server.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    if server.poll() is None:
        server.kill()
        server.wait(timeout=15)
    if os.path.ismount(mount):
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], capture_output=True, timeout=30)


def record(workload: str, work: Path, arg: str = "", timeout: float = WORKLOAD_TIMEOUT_S) -> OpLog:
    """Run ``workload`` on a fresh recording mount under ``work``; returns its operation log."""
    backing, mount, logdir, scratch = (work / n for n in ("backing", "mount", "log", "scratch"))
    for d in (backing, mount, logdir, scratch):
        d.mkdir(parents=True)
    server_log = open(logdir / "server.log", "wb")  # noqa: SIM115 - closed below
    command = [sys.executable, str(HERE / "fusefs.py"), str(backing), str(mount), str(logdir)]
    server = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(mount):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the FUSE server did not mount {mount}: "
                    f"{(logdir / 'server.log').read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.pop("SHARDSAFE_CRASH_AT", None)
        env.pop("SHARDSAFE_FAIL_AT", None)
        cmd = [sys.executable, str(HERE / "workloads.py"), workload, str(mount), str(scratch), *([arg] if arg else [])]
        with open(logdir / "workload.log", "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)
                rc = None
        if rc != 0:
            raise RuntimeError(
                f"workload {workload} {arg} exited "
                f"{rc}:\n{(logdir / 'workload.log').read_text(errors='replace')[-6000:]}"
            )
    finally:
        _unmount(mount, server)
        server_log.close()
    return OpLog(logdir)


@dataclass
class Exploration:
    workload: str
    library: str
    profile: str
    cuts: int = 0
    states: int = 0  # (cut, surviving subset) pairs checked
    distinct: int = 0  # distinct file-system states among them
    failing: int = 0
    lost: int = 0  # states where a returned save / the previous good checkpoint is gone
    broken: int = 0  # states that publish a broken checkpoint
    other: int = 0  # lease / gc problems
    examples: list[str] = field(default_factory=list)

    def add(self, cut: int, label: str, problems: list[Problem]) -> None:
        self.states += 1
        if not problems:
            return
        self.failing += 1
        categories = {c for c, _ in problems}
        self.lost += "lost" in categories
        self.broken += "broken" in categories
        self.other += bool(categories - {"lost", "broken"})
        if len(self.examples) < 6:
            self.examples.append(f"cut {cut} ({label}): " + "; ".join(f"[{c}] {m}" for c, m in problems[:3]))

    def describe(self) -> str:
        head = (
            f"{self.workload} [{self.profile}]: {self.cuts} cuts, {self.states} states ({self.distinct} distinct), "
            f"{self.failing} failing"
        )
        return "\n  ".join([head, *self.examples])


def cut_points(log: OpLog, random_cuts: int, rng: random.Random, every: int = 0, each_point: bool = True) -> list[int]:
    """Where to cut: before each named crash point reached (``each_point=False``: before one
    occurrence of each point, chosen at random), right after each "done" marker, and at random
    moments (``every``: also after every ``every``-th entry)."""
    occurrences: dict[str, list[int]] = {}
    for pos, text in log.marker_positions("point:"):
        occurrences.setdefault(text, []).append(pos)
    cuts = {pos for found in occurrences.values() for pos in (found if each_point else [rng.choice(found)])}
    cuts |= {pos + 1 for pos, _ in log.marker_positions("done:")}
    cuts.add(len(log))
    if every:
        cuts |= set(range(1, len(log), every))
    cuts |= {rng.randint(1, len(log)) for _ in range(random_cuts)} if len(log) else set()
    return sorted(cuts)


def explore(
    log: OpLog,
    checker: Checker,
    workload: str,
    profile: str,
    scratch: Path,
    *,
    random_cuts: int = 8,
    randoms: int = 2,
    every: int = 0,
    each_point: bool = True,
    seed: int = 0,
) -> Exploration:
    rng = random.Random(f"{workload}/{profile}/{seed}")
    result = Exploration(workload, checker.library, profile)
    cache: dict[str, Verdict] = {}
    cuts = cut_points(log, random_cuts, rng, every, each_point)
    result.cuts = len(cuts)
    for cut in cuts:
        markers = log.markers_before(cut)
        for label, chosen in log.crash_states(cut, profile, rng, randoms):
            nodes = log.replay(cut, profile, chosen)
            key = state_hash(nodes)
            verdict = cache.get(key)
            if verdict is None:
                folder = scratch / f"state-{len(cache)}"
                materialise(nodes, folder)
                try:
                    verdict = checker.summarise(folder)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                cache[key] = verdict
            result.add(cut, label, verdict.problems + checker.judge(verdict, markers))
    result.distinct = len(cache)
    _report(result)
    return result


def _report(result: Exploration) -> None:
    target = os.environ.get("SHARDSAFE_POWERLOSS_REPORT")
    if not target:
        return
    keys = (
        "workload",
        "library",
        "profile",
        "cuts",
        "states",
        "distinct",
        "failing",
        "lost",
        "broken",
        "other",
        "examples",
    )
    entry = {k: getattr(result, k) for k in keys}
    with open(target, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(entry) + "\n")
