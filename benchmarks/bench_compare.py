"""HEAD against another commit, alternately in one run: the guard for changes to the save and load paths.

    make bench-compare REF=<commit>
    .venv/bin/python benchmarks/bench_compare.py --ref <commit> [--rounds 3] [--md BENCHMARKS.md]

Why: each other benchmark runs alone, on the code of the day, and its numbers move with the machine
(a 20% regression at 16 ranks went unnoticed for two weeks). Here both trees are measured in the
same run, turn about, so the machine's drift falls on both, and the report is a ratio.

REF is checked out once as a detached worktree in ``.bench-ref/<sha>`` (kept for the next run; HEAD is
this working tree, uncommitted changes included). Every measurement is a fresh process whose
``PYTHONPATH`` puts one tree's ``src/`` first; the probes' own code is this tree's, through the public
API (the simulation excepted, see below), so both trees are measured by the same harness. In each
round every probe runs for both trees, the first tree alternating between rounds. For each number
the report gives both medians, the median of the per-round ratios HEAD/REF and their range (below 1:
HEAD is faster). CPU seconds (all processes of the job together) are given beside the wall time
because they barely move with the load of a shared machine.

Probes (~4 min a round on 2 cores, ~13 min for the default 3 rounds; 16 processes starting dominate):

- ``core``: one process, 8 Linear(2048, 2048) (128 MiB fp32) and 500 Linear(32, 32) layers with AdamW
  state (2,016 tensors, 384 MiB): save (fsync on), load warm, load from a cold page cache; medians of 3 each.
- ``16 ranks``: ``worker_scale.py``: 16 gloo processes, FSDP2 of 250 Linear(64, 64) + AdamW (1,000
  tensors), shardsafe and DCP in the same job (DCP measured with each tree, an anchor for the machine):
  save, load from a cold page cache.
- ``N-D``: ``bench_nd.py``'s job: 4 gloo ranks, dp=2 x tp=2 (FSDP2 over TP), 4 blocks at dim 512, AdamW:
  save, resume from a cold page cache, shardsafe and DCP.
- ``simulated``: ``bench_scale.py``'s 16,384-rank 3-D mesh (2,000 tensors) and its pipeline split: one
  rank's parse + plan, CPU time. It calls internal functions: a REF whose internals differ reports n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SECTION = "## Change guard: HEAD against a reference commit"
PROBES = ("core", "dist16", "nd", "simulated")
Metrics = dict[str, float]


# ----------------------------------------------------------------------------- the trees


def ref_tree(ref: str) -> Path:
    """``src/`` of ``ref``, checked out once as a detached worktree in ``.bench-ref/<sha>``."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if not sha:
        sys.exit(f"bench-compare: {ref!r} is not a commit of this repository (give REF=<commit>)")
    tree = REPO / ".bench-ref" / sha[:12]
    if not (tree / "src" / "shardsafe").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True)
    return tree / "src"


def run_probe(probe: str, src: Path, scratch: Path) -> Metrics | None:
    """One probe in a fresh process importing shardsafe from ``src``; None if it failed."""
    env = dict(os.environ, PYTHONPATH=f"{src}:{BENCH}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", probe, "--scratch", str(scratch)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    print(f"  {probe} with {src} failed (rc {done.returncode}): {' | '.join(tail)}", file=sys.stderr, flush=True)
    return None


# ----------------------------------------------------------------------------- the probes (child processes)


def _cold(folder: Path) -> None:
    from common import drop_file_cache

    drop_file_cache(folder)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def probe_core(scratch: Path) -> Metrics:
    import torch
    from torch import nn

    import shardsafe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)], *[nn.Linear(32, 32) for _ in range(500)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    state = {"model": model, "optim": optim}
    folder = scratch / "core"
    out: dict[str, list[float]] = {}

    def record(name: str, fn: Callable[[], Any], cold: bool = False) -> None:
        for _ in range(3):
            if cold:
                _cold(folder)
            wall, cpu = _timed(fn)
            out.setdefault(f"{name} wall", []).append(wall)
            out.setdefault(f"{name} CPU", []).append(cpu)

    record("save", lambda: shardsafe.save(folder, state, overwrite=True))
    record("load warm", lambda: shardsafe.load(folder, state))
    record("load cold", lambda: shardsafe.load(folder, state), cold=True)
    return {k: statistics.median(v) for k, v in out.items()}


def probe_dist16(scratch: Path) -> Metrics:
    result = scratch / "dist16.json"
    root = scratch / "dist16"
    root.mkdir(exist_ok=True)
    worker = [str(BENCH / "worker_scale.py"), "--layers", "250", "--runs", "1"]
    worker += ["--root", str(root), "--out", str(result)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=16", *worker]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(result.read_text())
    out: Metrics = {}
    for op in ("save", "load"):
        for lib in ("shardsafe", "dcp"):
            out[f"{op} wall ({lib})"] = statistics.median(data["results"][op][lib])
            if "cpu" in data:
                out[f"{op} CPU ({lib})"] = statistics.median(data["cpu"][op][lib])
    return out


def probe_nd(scratch: Path) -> Metrics:
    from bench_nd import run_job

    size = {"blocks": 4, "dim": 512, "hidden": 1408}
    out: Metrics = {}
    for lib in ("shardsafe", "dcp"):
        folder = scratch / f"nd-{lib}"
        shutil.rmtree(folder, ignore_errors=True)
        out[f"save wall ({lib})"] = run_job(lib=lib, op="save", layout="2d", folder=str(folder), **size)["seconds"]
        _cold(folder)
        out[f"resume wall ({lib})"] = run_job(lib=lib, op="resume", layout="2d", folder=str(folder), **size)["seconds"]
    return out


def probe_simulated(scratch: Path) -> Metrics:
    import shardsafe  # noqa: F401  (first, from PYTHONPATH: bench_scale puts this tree's src on sys.path)

    time.perf_counter = time.process_time  # CPU time: bench_scale reads time.perf_counter at call time
    import bench_scale

    out: Metrics = {}
    for name, once, layout in (
        ("3-D", bench_scale.nd_once, bench_scale.nd_layout()),
        ("pipeline", bench_scale.pp_once, bench_scale.pp_layout()),
    ):
        samples = [once(layout, 16384) for _ in range(3)]  # type: ignore[operator]
        out[f"{name} parse + plan CPU"] = statistics.median(s.load_plan for s in samples)
        out[f"{name} coordinator CPU"] = statistics.median(s.coordinator for s in samples)
    return out


def child(probe: str, scratch: Path) -> None:
    import shardsafe

    assert str(Path(shardsafe.__file__).resolve()).startswith(os.environ["PYTHONPATH"].split(":")[0])
    fn = {"core": probe_core, "dist16": probe_dist16, "nd": probe_nd, "simulated": probe_simulated}[probe]
    print("RESULT " + json.dumps(fn(scratch)), flush=True)


# ----------------------------------------------------------------------------- the report

TITLES = {
    "core": "one process, 2,016 tensors, 384 MiB",
    "dist16": "16 ranks, FSDP2, 1,000 small tensors",
    "nd": "4 ranks, dp=2 x tp=2",
    "simulated": "16,384 simulated ranks, 3-D mesh",
}


def ratio_row(probe: str, metric: str, head: list[Metrics | None], ref: list[Metrics | None]) -> str:
    pairs = [(h[metric], r[metric]) for h, r in zip(head, ref) if h and r and metric in h and metric in r]
    if not pairs:
        return f"| {TITLES[probe]} | {metric} | n/a | n/a | n/a | |"
    hs, rs = [p[0] for p in pairs], [p[1] for p in pairs]
    ratios = [h / r for h, r in pairs if r > 0]
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"
    mark = " **slower**" if ratios and min(ratios) > 1.05 else ""
    return (
        f"| {TITLES[probe]} | {metric} | {_s(statistics.median(hs))} | {_s(statistics.median(rs))} | "
        f"{statistics.median(ratios):.2f}{mark} | {spread} |"
    )


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def versus_dcp(results: dict[str, dict[str, list[Metrics | None]]]) -> list[str]:
    """Each tree's speed against DCP measured in the same job (DCP/shardsafe, medians of the rounds)."""
    lines = ["", "Against DCP in the same jobs (DCP time / shardsafe time, median of the rounds; above 1: shardsafe "
             "faster):", "", "| probe | operation | HEAD | REF |", "|---|---|---|---|"]  # fmt: skip
    for probe, ops in (("dist16", ("save", "load")), ("nd", ("save", "resume"))):
        if not any(results["HEAD"][probe] + results["REF"][probe]):
            continue
        for op in ops:
            cells = []
            for tree in ("HEAD", "REF"):
                vals = [
                    m[f"{op} wall (dcp)"] / m[f"{op} wall (shardsafe)"] for m in results[tree][probe] if m is not None
                ]
                cells.append(f"{statistics.median(vals):.2f}x ({min(vals):.2f}-{max(vals):.2f})" if vals else "n/a")
            lines.append(f"| {TITLES[probe]} | {op} | {cells[0]} | {cells[1]} |")
    return lines


def report(
    results: dict[str, dict[str, list[Metrics | None]]], probes: list[str], ref: str, sha: str, rounds: int, took: float
) -> str:
    lines = [
        SECTION,
        "",
        f"- **Command:** `make bench-compare REF={ref}` (HEAD = this working tree; REF = {sha[:12]}); {rounds} "
        f"rounds, the trees alternating; took {took / 60:.1f} min; load average at the end "
        f"{_load_average()}.",
        "- **Reading:** ratio = HEAD / REF per round, median and range over the rounds; below 1 HEAD is faster. "
        "**slower** marks a ratio above 1.05 in every round.",
        "",
        "| probe | measure | HEAD | REF | HEAD / REF | range |",
        "|---|---|---|---|---|---|",
    ]
    for probe in probes:
        metrics: list[str] = []
        for m in results["HEAD"][probe] + results["REF"][probe]:
            metrics += [k for k in (m or {}) if k not in metrics and "(dcp)" not in k]
        lines += [ratio_row(probe, metric, results["HEAD"][probe], results["REF"][probe]) for metric in metrics]
        if not metrics:
            lines.append(f"| {TITLES[probe]} | (failed for both trees) | | | | |")
    lines += versus_dcp(results)
    return "\n".join(lines) + "\n"


def _load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", help="the commit to compare HEAD (this working tree) against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    parser.add_argument("--md", type=Path, default=None, help="write the table as a section of this file")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # a child process: run one probe
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        child(args.probe, args.scratch)
        return
    if not args.ref:
        sys.exit("bench-compare: give the commit to compare against: make bench-compare REF=<commit>")
    probes = [p for p in args.probes.split(",") if p]
    unknown = sorted(set(probes) - set(PROBES))
    if unknown:
        sys.exit(f"bench-compare: unknown probe(s) {unknown}; choose from {list(PROBES)}")
    trees = {"HEAD": REPO / "src", "REF": ref_tree(args.ref)}
    sha = trees["REF"].parent.name
    results: dict[str, dict[str, list[Metrics | None]]] = {t: {p: [] for p in PROBES} for t in trees}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        for round_ in range(args.rounds):
            for probe in probes:
                order = ["HEAD", "REF"] if (round_ + PROBES.index(probe)) % 2 == 0 else ["REF", "HEAD"]
                for tree in order:
                    scratch = Path(tmp) / tree
                    shutil.rmtree(scratch, ignore_errors=True)
                    scratch.mkdir()
                    t0 = time.perf_counter()
                    results[tree][probe].append(run_probe(probe, trees[tree], scratch))
                    print(f"round {round_ + 1}/{args.rounds} {probe} {tree}: {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)  # fmt: skip
    text = report(results, probes, args.ref, sha, args.rounds, time.perf_counter() - start)
    print(text)
    if args.md is not None:
        from common import write_section

        write_section(args.md, SECTION, text)
        print(f"wrote the {SECTION!r} section of {args.md}")


if __name__ == "__main__":
    main()
