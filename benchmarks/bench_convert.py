"""``shardsafe convert`` of a real DeepSpeed ZeRO-3 checkpoint, this tree against an earlier one.

    .venv/bin/python benchmarks/bench_convert.py --before .bench-before/src --md BENCHMARKS.md   # make bench-convert

The checkpoint is the one ``bench_deepspeed.py`` builds and caches (a 152 M parameter Llama after one
bf16 ZeRO-3 AdamW step at 2 CPU ranks, written by ``engine.save_checkpoint``). Each run is a fresh
``shardsafe convert CKPT OUT --no-progress`` process after a cold page cache, with ``PYTHONPATH`` set
to this tree's ``src`` or to ``--before`` (a checkout of another commit's ``src``, e.g. a
``git worktree`` of the commit before the fix of issue 20 item 1, 2ae7ff1^, where every tensor was
reassembled twice). Runs alternate; medians of wall time, CPU time and peak RSS are reported, and the
two outputs are checked to hold the same tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_deepspeed import ensure_checkpoint, measure  # noqa: E402
from common import drop_file_cache, load_average, write_section  # noqa: E402

SECTION = "convert (DeepSpeed ZeRO-3 -> shardsafe), before and after"


def convert_command(ckpt: Path, out: Path) -> list[str]:
    code = "import sys; from shardsafe.cli.main import main; sys.exit(main())"
    return [sys.executable, "-c", code, "convert", str(ckpt), str(out), "--no-progress"]


def same_checkpoint(a: Path, b: Path) -> bool:
    """The two converted checkpoints load into equal state (one process, strict)."""
    code = (
        "import sys, torch, shardsafe\n"
        "from shardsafe.api.source import CheckpointSource\n"
        "a, b = (CheckpointSource(p, key='') for p in sys.argv[1:3])\n"
        "names = sorted(t.name for t in a.tensors())\n"
        "assert names == sorted(t.name for t in b.tensors()), 'names differ'\n"
        "for n in names:\n"
        "    assert torch.equal(a.read(n), b.read(n)), n\n"
        "print(len(names))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, "-c", code, str(a), str(b)], env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other tree's src folder")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the small checkpoint, 1 run")
    parser.add_argument("--dir", type=Path, default=REPO / "bench-run" / "deepspeed")
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    root = args.dir.absolute()
    ckpt = root / ("ckpt-quick" if args.quick else "ckpt")
    load_before = load_average()
    ensure_checkpoint(ckpt, args.quick, dict(os.environ, OMP_NUM_THREADS="1"))
    outs = root / "convert-out"
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir(parents=True)
    log = root / "convert.log"
    log.write_bytes(b"")
    trees = {"before": args.before.absolute(), "after": REPO / "src"}
    res: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for run in range(runs):
        for key in list(trees) if run % 2 == 0 else list(trees)[::-1]:
            out = outs / f"{key}-{run}"
            drop_file_cache(ckpt)
            env = dict(os.environ, PYTHONPATH=str(trees[key]))
            res[key].append(measure(convert_command(ckpt, out), env, log))
            print(f"run {run + 1} {key}: {res[key][-1]}", flush=True)
            if run < runs - 1:
                shutil.rmtree(out)
    same = same_checkpoint(outs / f"before-{runs - 1}", outs / f"after-{runs - 1}")
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in res.items()}
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    rows = [
        "| tree | wall | CPU | peak RSS |",
        "|---|---|---|---|",
        *(
            f"| {k} | {m['wall_s']:.2f} s | {m['cpu_s']:.2f} s | {m['peak_rss'] / 2**20:.0f} MiB |"
            for k, m in med.items()
        ),
    ]
    speedup = med["before"]["wall_s"] / med["after"]["wall_s"]
    text = "\n".join(
        [
            f"`{' '.join(['.venv/bin/python', 'benchmarks/bench_convert.py', *sys.argv[1:]])}`",
            "",
            f"Checkpoint: {size / 2**30:.2f} GiB on disk (DeepSpeed's own ZeRO-3 files); medians of {runs} alternating "
            f"cold-cache runs; load average {load_before} before. *before*: `{args.before}`; *after*: this tree.",
            "",
            *rows,
            "",
            f"after is {speedup:.2f}x faster in wall time; the two outputs hold equal tensors: {same}.",
            "",
            f"Raw: `{json.dumps(res)}`",
        ]
    )
    print(text)
    if args.md is not None:
        write_section(args.md, SECTION, text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
