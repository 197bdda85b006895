"""Cold loads at disk speed: `python benchmarks/bench_load.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

2 ranks (gloo, CPU, FSDP2) of ``--layers`` x Linear(width, width) plus stepped AdamW (the default
is ~1.2 GB of tensors); the page cache is dropped before every measurement, as when a job
restarts. Side by side, in rotating order per round (``worker_load.py``): shardsafe's default
atomic load, ``atomic=False``, DCP's load and the cold read bandwidth of the same shard files (one
``cat`` per file, all at once); then, in this process, ``shardsafe.verify`` against one ``cat`` of
the same files. Medians over the rounds; every load is checked against the saved state exactly.
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
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

from common import drop_file_cache, load_average, write_section  # noqa: E402

import shardsafe  # noqa: E402

SECTION = "## Cold load (2 ranks)"
FULL = (24, 2048)  # 24 x 4.19 M fp32 parameters = 403 MB, plus AdamW's two moments: 1.21 GB of tensors
QUICK = (4, 1024)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_verify(folder: Path, runs: int) -> dict[str, list[float]]:
    """``shardsafe.verify`` and one ``cat`` of the same files, alternating, each from a cold cache."""
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    out: dict[str, list[float]] = {"verify": [], "cat": []}
    for i in range(runs):
        for name in ("verify", "cat") if i % 2 == 0 else ("cat", "verify"):
            drop_file_cache(folder)
            start = time.perf_counter()
            if name == "verify":
                shardsafe.verify(folder)
            else:
                subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
            out[name].append(time.perf_counter() - start)
    return out


def render(
    results: dict[str, Any], verify: dict[str, list[float]], command: str, layers: int, width: int, wall: float
) -> str:
    gb = results["checkpoint_bytes"] / 1e9
    cat = median(results["cat"])
    lines = [
        SECTION,
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({wall / 60:.1f} min; load average "
        f"{load_average()} after): "
        f"{os.cpu_count()} CPU cores, 2 ranks (gloo, CPU), FSDP2 {layers} x Linear({width}, {width}, bias=False) + "
        "stepped AdamW, "
        f"{gb:.2f} GB of shard files. Page cache dropped before every measurement (`sync; echo 3 > "
        "/proc/sys/vm/drop_caches`); "
        f"medians of {len(results['cat'])} rounds, methods in rotating order. `cat`: one `cat FILE > /dev/null` per "
        "rank's shard "
        f"file, all at once: {cat:.3f} s ({gb / cat:.2f} GB/s).",
        "",
        "| load into | shardsafe (atomic, default) | `atomic=False` | DCP | shardsafe vs DCP "
        "| bandwidth vs `cat` | DCP's vs `cat` | atomic vs `atomic=False` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    reach: list[str] = []
    for variant, label in (
        ("fresh", "a fresh optimizer (resume)"),
        ("allocated", "existing optimizer state (rollback)"),
    ):
        s = results[variant]
        a, n, d = (median([r["seconds"] for r in s[k]]) for k in ("shardsafe", "shardsafe_nonatomic", "dcp"))
        lines.append(
            f"| {label} | {a:.3f} s | {n:.3f} s | {d:.3f} s | {d / a:.2f}x | {cat / a:.2f}x | {cat / d:.2f}x | "
            f"{a / n:.2f}x |"
        )
        reach.append(f"{label}: 1.5x DCP means {1.5 * cat / d:.2f}x the `cat` bandwidth")
        verdicts += [
            (f"{variant}: cold load >= 1.5x DCP", d / a >= 1.5, f"{d / a:.2f}x"),
            (f"{variant}: cold load >= 0.9x the `cat` bandwidth", cat / a >= 0.9, f"{cat / a:.2f}x"),
            (f"{variant}: atomic <= 1.2x `atomic=False`", a / n <= 1.2, f"{a / n:.2f}x"),
        ]
    correct = all(r["correct"] for v in ("fresh", "allocated") for k in results[v] for r in results[v][k])
    v, c = median(verify["verify"]), median(verify["cat"])
    lines += [
        "",
        "What a DCP ratio asks of the disk (a load cannot read these files faster than `cat` does): "
        + "; ".join(reach)
        + ".",
        "",
        f"`shardsafe.verify` (one process, every block hashed) {v:.3f} s vs one `cat` of all the files {c:.3f} s: "
        f"{c / v:.2f}x the `cat` bandwidth.",
        "",
        "| target | measured | |",
        "|---|---|---|",
        *[f"| {name} | {value} | {'**met**' if ok else '**missed**'} |" for name, ok, value in verdicts],
        "",
        f"Every load restored the saved state exactly: **{correct}**. All runs (seconds): "
        + "; ".join(
            f"{v} {k}: {[round(r['seconds'], 3) for r in results[v][k]]}"
            for v in ("fresh", "allocated")
            for k in results[v]
        )
        + f"; cat: {[round(t, 3) for t in results['cat']]}; verify: {[round(t, 3) for t in verify['verify']]}, "
        + f"its cat: {[round(t, 3) for t in verify['cat']]}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: a small model, 1 round, BENCHMARKS.md untouched unless --md"
    )
    parser.add_argument("--runs", type=int, default=None, help="rounds (default 5; 1 with --quick)")
    parser.add_argument(
        "--dir", type=Path, default=REPO / "bench-run" / "load", help="scratch folder, removed before and after"
    )
    parser.add_argument(
        "--md", type=Path, default=None, help="results file to rewrite (default BENCHMARKS.md; none with --quick)"
    )
    args = parser.parse_args()
    layers, width = QUICK if args.quick else FULL
    runs = args.runs or (1 if args.quick else 5)
    md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
    root = args.dir.absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    exe = Path(sys.executable)
    command = shlex.join(
        [
            str(exe.relative_to(REPO) if exe.is_relative_to(REPO) else exe.name),
            "benchmarks/bench_load.py",
            *sys.argv[1:],
        ]
    )
    start = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    out = root / "load.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    worker = [
        str(HERE / "worker_load.py"),
        "--layers",
        str(layers),
        "--width",
        str(width),
        "--runs",
        str(runs),
        "--root",
        str(root),
        "--out",
        str(out),
    ]
    subprocess.run([*launcher, *worker], check=True, env=env, cwd=REPO)
    results = json.loads(out.read_text())
    verify = measure_verify(root / "shardsafe", runs)
    shutil.rmtree(root, ignore_errors=True)
    text = render(results, verify, command, layers, width, time.perf_counter() - start)
    print(text)
    if md is not None:
        write_section(md, SECTION, text)
        print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
