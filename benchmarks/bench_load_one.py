"""Cold loads in one process: `python benchmarks/bench_load_one.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

One process saves ``--layers`` x Linear(width, width) plus stepped AdamW (default ~1.2 GB, one shard
file); then each load runs in a fresh process after ``sync; echo 3 > /proc/sys/vm/drop_caches``:
a resume (fresh AdamW, no state: what a restarted job has, atomic), a rollback (AdamW with state,
atomic) and a rollback with ``atomic=False``, side by side with a cold and a hot ``cat`` of the same
file, in alternating order per round; medians. Targets (issue 22): resume >= 0.85x the cold ``cat``
bandwidth, rollback <= 1.15x (cold + hot ``cat``), ``atomic=False`` >= 0.9x cold ``cat``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import drop_file_cache, load_average, write_section  # noqa: E402

SECTION = "## Cold load (one process)"
FULL = (24, 2048)
QUICK = (4, 512)
BUILD = r"""
import sys, torch
from torch import nn
layers, width, stepped = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
if stepped:
    model(torch.randn(2, width)).sum().backward(); optim.step(); optim.zero_grad(set_to_none=True)
state = {"model": model, "optim": optim}
"""
PHASES = [
    ("preadv", "read syscalls"),
    ("xxh3", "hashing (xxh3)"),
    ("copy_", "copies"),
    ("bytearray", "scratch buffers"),
]
SAVE = BUILD + "import shardsafe; shardsafe.save(sys.argv[4], state)\n"
LOAD = (
    BUILD
    + f"PHASES = {PHASES!r}\n"
    + r"""
import cProfile, json, pstats, time, shardsafe
from shardsafe.protocol import block_io
profiles = []
if sys.argv[6] == "1":  # every reading task under its own profiler (the reads run on the reader's threads)
    unprofiled = block_io.BlockExecutor._do_each
    def profiled(self, *args, **kwargs):
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()
        try:
            return unprofiled(self, *args, **kwargs)
        finally:
            profile.disable()
    block_io.BlockExecutor._do_each = profiled
if stepped:  # one more step than the save: a rollback's target holds other values than the checkpoint
    model(torch.randn(2, width)).sum().backward(); optim.step(); optim.zero_grad(set_to_none=True)
start = time.perf_counter()
shardsafe.load(sys.argv[4], state, atomic=sys.argv[5] == "1")
seconds = time.perf_counter() - start
phases = {}
for profile in profiles:
    for (file, line, name), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
        phase = next((p for k, p in PHASES if k in name), "other reading work")
        phases[phase] = phases.get(phase, 0.0) + tottime
# What was saved: the same build, stepped (the save always steps); parameters and AdamW moments compared.
torch.manual_seed(0)
ref = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-3)
ref(torch.randn(2, width)).sum().backward(); ref_optim.step()
pairs = list(zip(model.parameters(), ref.parameters()))
correct = all(torch.equal(a, b) for a, b in pairs) and all(
    torch.equal(optim.state[a][k], ref_optim.state[b][k]) for a, b in pairs for k in ("exp_avg", "exp_avg_sq", "step")
)
print(json.dumps({"seconds": seconds, "phases": phases, "correct": correct}))
"""
)
LOADS = {"resume": ("0", "1"), "rollback": ("1", "1"), "rollback atomic=False": ("1", "0")}  # (stepped, atomic)


def run_load(folder: Path, layers: int, width: int, name: str, profile: bool = False) -> dict[str, Any]:
    stepped, atomic = LOADS[name]
    drop_file_cache(folder)
    argv = [sys.executable, "-c", LOAD, str(layers), str(width), stepped, str(folder), atomic, "1" if profile else "0"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def phase_table(folder: Path, layers: int, width: int) -> list[str]:
    """One more cold load of each kind, its reading tasks under cProfile: seconds per phase, summed
    over the reading threads (own time of the functions doing it; read syscalls include the page
    faults taken inside them). Not part of the medians."""
    names = [phase for _, phase in PHASES] + ["other reading work"]
    lines = ["| load (profiled, cold) | total | " + " | ".join(names) + " |", "|---|" + "---:|" * (len(names) + 1)]
    for name in LOADS:
        result = run_load(folder, layers, width, name, profile=True)
        cells = [f"{result['phases'].get(n, 0.0):.3f} s" for n in names]
        lines.append(f"| {name} | {result['seconds']:.3f} s | " + " | ".join(cells) + " |")
    return lines


def run_cat(folder: Path, hot: bool) -> float:
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    if hot:
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    else:
        drop_file_cache(folder)
    start = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: a small model, 1 round, BENCHMARKS.md untouched unless --md"
    )
    parser.add_argument("--runs", type=int, default=None, help="rounds (default 5; 1 with --quick)")
    parser.add_argument(
        "--dir", type=Path, default=REPO / "bench-run" / "load-one", help="scratch folder, removed before and after"
    )
    parser.add_argument("--md", type=Path, default=None, help="results file (default BENCHMARKS.md; none with --quick)")
    args = parser.parse_args()
    layers, width = QUICK if args.quick else FULL
    runs = args.runs or (1 if args.quick else 5)
    md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
    root = args.dir.absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    folder = root / "ckpt"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", SAVE, str(layers), str(width), "1", str(folder)], check=True)
    gb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
    times: dict[str, list[float]] = {name: [] for name in [*LOADS, "cold cat", "hot cat"]}
    correct = True
    order = [*LOADS, "cold cat", "hot cat"]
    for i in range(runs):
        for name in order if i % 2 == 0 else order[::-1]:
            if name in LOADS:
                result = run_load(folder, layers, width, name)
                times[name].append(result["seconds"])
                correct = correct and bool(result["correct"])
            else:
                times[name].append(run_cat(folder, hot=name == "hot cat"))
    phases = phase_table(folder, layers, width)
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    cold, hot = med["cold cat"], med["hot cat"]
    verdicts = [
        ("resume >= 0.85x the cold `cat` bandwidth", cold / med["resume"], cold / med["resume"] >= 0.85),
        (
            "rollback <= 1.15x (cold + hot `cat`)",
            med["rollback"] / (cold + hot),
            med["rollback"] / (cold + hot) <= 1.15,
        ),
        (
            "`atomic=False` >= 0.9x the cold `cat` bandwidth",
            cold / med["rollback atomic=False"],
            cold / med["rollback atomic=False"] >= 0.9,
        ),
    ]
    exe = Path(sys.executable)
    command = shlex.join(
        [
            str(exe.relative_to(REPO) if exe.is_relative_to(REPO) else exe.name),
            "benchmarks/bench_load_one.py",
            *sys.argv[1:],
        ]
    )
    lines = [
        SECTION,
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({(time.perf_counter() - start) / 60:.1f} min; "
        f"load average {load_average()} after): {os.cpu_count()} CPU cores, one process, {layers} x Linear({width}, "
        f"{width}, bias=False) "
        f"+ AdamW, one shard file of {gb:.2f} GB; every load in a fresh process after dropping the page cache, medians "
        f"of {runs} "
        "rounds in alternating order. Every load restored the saved parameters and AdamW moments exactly: "
        f"**{correct}**.",
        "",
        "| load | median | all runs (s) |",
        "|---|---:|---|",
        *[f"| {name} | {med[name]:.3f} s | {[round(t, 3) for t in v]} |" for name, v in times.items()],
        "",
        "| target | measured | |",
        "|---|---|---|",
        *[f"| {name} | {value:.2f}x | {'**met**' if ok else '**missed**'} |" for name, value, ok in verdicts],
        "",
        "Where the time goes (one more cold load of each kind; its reading tasks under cProfile, each phase's own time "
        "summed over the reading threads, so a row can exceed the wall total; the rest of the wall time is checks, "
        "planning, "
        "the agreement and the second pass's setup):",
        "",
        *phases,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if md is not None:
        write_section(md, SECTION, text)
        print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
