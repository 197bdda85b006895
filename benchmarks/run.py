"""shardsafe vs torch.distributed.checkpoint (DCP), side by side: `make bench-core`.

Runs, in one go, with fsync on for both libraries:

* save: an FSDP2 model (16 x Linear(4096, 4096), fp32, 1.0 GiB of parameters) plus stepped AdamW
  state (3.0 GiB in all) on 2 ranks (gloo, CPU), shardsafe.save vs dcp.save, alternating, plus
  ``dd ... conv=fdatasync`` of the same byte count as the raw-disk reference;
* load 2->2: shardsafe.load vs dcp.load (+ get/set_state_dict) into a fresh optimizer;
* load 2->1: one process, no process group, plain module and fresh optimizer;
* extra peak RSS per rank during save.

Prints a table and rewrites the results part of BENCHMARKS.md (everything below the
``<!-- notes -->`` line there is kept). ``--quick`` is a smoke test: 64 MiB model, 1 run, and
BENCHMARKS.md is left alone unless ``--md`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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

from common import FULL, NOTES_MARK, QUICK, param_bytes  # noqa: E402
from summary import END as SUMMARY_END  # noqa: E402
from summary import START as SUMMARY_START  # noqa: E402

INTRO = [
    "Every number below comes from a script run on this repository's machine (2 shared CPU cores), each",
    "comparing shardsafe with the named peer in the same run (medians of alternating runs, ratios reported).",
    "`make bench` runs them all (~50 min) and then `make bench-summary` (the table below); each section names its",
    "own command and is rewritten by it, so rerun rather than edit the numbers by hand:",
    "",
    "| section | command | peer |",
    "|---|---|---|",
    "| Results ... analysis | `make bench-core` (`benchmarks/run.py`) | `torch.distributed.checkpoint`, `dd` |",
    "| Cold load (2 ranks), Cold load (one process) | `make bench-load` (`benchmarks/bench_load.py`, "
    "`bench_load_one.py`) | DCP, `cat` of the same files |",
    "| Export | `make bench-export` (`benchmarks/bench_export.py`) | transformers `save_pretrained`, torch's "
    "safetensors consolidation |",
    "| CheckpointManager | `make bench-manager` (`benchmarks/bench_manager.py`) | DCP `async_save` (thread, process, "
    "`DefaultStager`), torch-checkpointing |",
    "| DeepSpeed export | `make bench-deepspeed` (`benchmarks/bench_deepspeed.py`) | DeepSpeed `zero_to_fp32` script "
    "and lazy mode |",
    "| Scale (simulated, real processes, 3-D and pipeline meshes) | `make bench-scale` (`benchmarks/bench_scale.py`) "
    "| DCP's planner and metadata; DCP at 4-16 real ranks |",
    "| N-D save and load | `make bench-nd` (`benchmarks/bench_nd.py`) | DCP, torch-checkpointing |",
    "| Local tier | `make bench-tiers` (`benchmarks/bench_tiers.py`) | a memory copy |",
    "| Lightning | `make bench-lightning` (`benchmarks/bench_lightning.py`) | Lightning's `ModelParallelStrategy` |",
    "| torchtitan checkpoint managers | `make bench-torchtitan` (`benchmarks/bench_torchtitan.py`) | torchtitan's DCP "
    "`CheckpointManager` |",
    "| Change guard | `make bench-compare REF=<commit>` (`benchmarks/bench_compare.py`) | this tree against an "
    "earlier commit (and DCP) |",
    "",
    "The first part (down to the notes) is shardsafe vs DCP on the same model.",
]

TARGETS = {"save_vs_dcp": 1.1, "save_vs_dd": 0.85, "load_vs_dcp": 1.5, "extra_mem_mib": 64.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 64 MiB model, 1 run, BENCHMARKS.md untouched unless --md"
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement (default 3; 1 with --quick)")
    parser.add_argument(
        "--dir", type=Path, default=REPO / "bench-run" / "compare", help="scratch folder, removed before and after"
    )
    parser.add_argument(
        "--md", type=Path, default=None, help="results file to rewrite (default BENCHMARKS.md; none with --quick)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --dir afterwards")
    args = parser.parse_args()
    layers, width = QUICK if args.quick else FULL
    runs = args.runs or (1 if args.quick else 3)
    md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
    exe = Path(sys.executable)
    shown = exe.relative_to(REPO) if exe.is_relative_to(REPO) else Path(exe.name)
    command = shlex.join([str(shown), "benchmarks/run.py", *sys.argv[1:]])

    root: Path = args.dir.absolute()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    dist_json, single_json = root / "dist.json", root / "single.json"
    common_args = ["--layers", str(layers), "--width", str(width), "--runs", str(runs), "--root", str(root)]
    size = param_bytes(layers, width) / 2**30
    print(
        f"model: {layers} x Linear({width}, {width}) = {size:.3f} GiB fp32 params + AdamW; {runs} run(s) each",
        flush=True,
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    subprocess.run(
        [*launcher, str(HERE / "worker_dist.py"), *common_args, "--out", str(dist_json)], check=True, env=env, cwd=REPO
    )
    single_cmd = [
        sys.executable,
        str(HERE / "worker_single.py"),
        *common_args,
        "--expect",
        str(dist_json),
        "--out",
        str(single_json),
    ]
    subprocess.run(single_cmd, check=True, env=env, cwd=REPO)
    elapsed = time.perf_counter() - t0

    dist_res = json.loads(dist_json.read_text())
    single_res = json.loads(single_json.read_text())
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    report = summarize(dist_res, single_res)
    facts = machine_facts(root.parent if not args.keep else root)
    facts.update(
        date=started.strftime("%Y-%m-%d %H:%M UTC"),
        command=command,
        wall=f"{elapsed / 60:.1f} min",
        runs=runs,
        layers=layers,
        width=width,
    )
    table = render_table(report)
    print()
    print(table)
    print()
    print(render_verdict(report))
    if args.quick:
        print(
            "\n(--quick is a smoke test: at 64 MiB fixed costs dominate, so these ratios say nothing about the targets)"
        )
    if md is not None:
        write_markdown(md, facts, report, table, dist_res, single_res)
        print(f"\nwrote {md}")
    return 0 if report["all_correct"] else 1


# ----------------------------------------------------------------------------- numbers


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


LOADS = [
    ("load_22_fresh", "load 2->2, fresh optimizer"),
    ("load_22_allocated", "load 2->2, optimizer state allocated"),
    ("load_21_fresh", "load 2->1, fresh optimizer"),
    ("load_21_allocated", "load 2->1, optimizer state allocated"),
]


def load_records(dist_res: dict[str, Any], single_res: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    return {
        "load_22_fresh": dist_res["load_2to2_fresh"],
        "load_22_allocated": dist_res["load_2to2_allocated"],
        "load_21_fresh": single_res["fresh"],
        "load_21_allocated": single_res["allocated"],
    }


def summarize(dist_res: dict[str, Any], single_res: dict[str, Any]) -> dict[str, Any]:
    save = dist_res["save"]
    ckpt_bytes = median([r["bytes"] for r in save["shardsafe"]])
    out: dict[str, Any] = {
        "ckpt_bytes": ckpt_bytes,
        "dcp_bytes": median([r["bytes"] for r in save["dcp"]]),
        "tensor_bytes": dist_res["tensor_bytes"],
    }

    def times(records: list[dict[str, Any]]) -> list[float]:
        return [r["seconds"] for r in records]

    out["save_ss"], out["save_dcp"] = median(times(save["shardsafe"])), median(times(save["dcp"]))
    out["dd_rate"] = median([r["bytes"] / r["seconds"] for r in save["dd"]])
    out["dd_bytes"] = save["dd"][0]["bytes"] if save["dd"] else 0
    out["mem_ss_max"] = max(m for r in save["shardsafe"] for m in r["extra_mem_per_rank"]) / 2**20
    out["mem_dcp_max"] = max(m for r in save["dcp"] for m in r["extra_mem_per_rank"]) / 2**20
    out["mem_method"] = save["shardsafe"][0]["mem_method"]
    out["save_vs_dcp"] = out["save_dcp"] / out["save_ss"]
    out["save_vs_dd"] = (ckpt_bytes / out["save_ss"]) / out["dd_rate"]
    checks = {
        "save >= 1.1x DCP": out["save_vs_dcp"] >= TARGETS["save_vs_dcp"],
        "save >= 0.85x raw disk (dd)": out["save_vs_dd"] >= TARGETS["save_vs_dd"],
    }
    every_load = []
    for key, label in LOADS:
        recs = load_records(dist_res, single_res)[key]
        out[f"{key}_ss"], out[f"{key}_dcp"] = median(times(recs["shardsafe"])), median(times(recs["dcp"]))
        out[f"{key}_vs_dcp"] = out[f"{key}_dcp"] / out[f"{key}_ss"]
        checks[f"{label}: >= 1.5x DCP"] = out[f"{key}_vs_dcp"] >= TARGETS["load_vs_dcp"]
        every_load += [*recs["shardsafe"], *recs["dcp"]]
    checks["extra peak RSS per rank during save <= 64 MiB"] = out["mem_ss_max"] <= TARGETS["extra_mem_mib"]
    out["all_correct"] = all(r["correct"] for r in every_load)
    checks["every load restored the saved state exactly"] = out["all_correct"]
    out["cached_before_load"] = max(r["cached_bytes_before"] for r in every_load)
    out["checks"] = checks
    return out


def cell(nbytes: float, seconds: float) -> str:
    return f"{seconds:.2f} s, {nbytes / seconds / 1e9:.3f} GB/s"


def render_table(r: dict[str, Any]) -> str:
    b = r["ckpt_bytes"]
    rows = [
        (
            "save, 2 ranks",
            cell(b, r["save_ss"]),
            cell(b, r["save_dcp"]),
            cell(b, b / r["dd_rate"]),
            f"{r['save_vs_dcp']:.2f}x DCP",
            ">= 1.1x DCP",
        ),
        ("", "", "", "", f"{r['save_vs_dd']:.2f}x dd", ">= 0.85x dd"),
    ]
    for key, label in LOADS:
        rows.append(
            (
                label,
                cell(b, r[f"{key}_ss"]),
                cell(b, r[f"{key}_dcp"]),
                "",
                f"{r[f'{key}_vs_dcp']:.2f}x DCP",
                ">= 1.5x DCP",
            )
        )
    rows.append(
        (
            "extra peak RSS per rank, save",
            f"{r['mem_ss_max']:.1f} MiB",
            f"{r['mem_dcp_max']:.1f} MiB",
            "",
            "",
            "<= 64 MiB",
        )
    )
    header = ("median of runs", "shardsafe", "DCP", "dd (same bytes)", "shardsafe is", "target")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(row) for row in rows)])


def render_verdict(r: dict[str, Any]) -> str:
    return "\n".join(f"- {'MET   ' if ok else 'MISSED'} {name}" for name, ok in r["checks"].items())


# ----------------------------------------------------------------------------- facts and markdown


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine_facts(where: Path) -> dict[str, Any]:
    import torch

    import shardsafe

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, IndexError, ValueError):
        pass
    fs = _run(["findmnt", "-n", "-o", "FSTYPE,SOURCE,OPTIONS", "--target", str(where)])
    dirty = _run(["git", "status", "--porcelain", "--", "src"])
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "memory": mem,
        "kernel": platform.release(),
        "filesystem": fs,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "shardsafe": shardsafe.__version__,
        "commit": _run(["git", "rev-parse", "--short", "HEAD"])
        + (" + uncommitted changes in src/" if dirty not in ("", "?") else ""),
        "load_avg": " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?",
    }


def _runs_table(title: str, records: dict[str, list[dict[str, Any]]], nbytes: float, mem: bool) -> list[str]:
    lines = [f"**{title}** (seconds per run, in the order they ran)", ""]
    head = (
        "| library | "
        + " | ".join(f"run {i + 1}" for i in range(max(len(v) for v in records.values())))
        + " | median |"
    )
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name, recs in records.items():
        name = {"dcp": "DCP"}.get(name, name)
        cells = [f"{r['seconds']:.2f} s ({r.get('rate_bytes', nbytes) / r['seconds'] / 1e9:.3f} GB/s)" for r in recs]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {median([r['seconds'] for r in recs]):.2f} s |")
    if mem:
        lines += ["", "Extra peak RSS per rank during save (MiB, [rank 0, rank 1] per run):", ""]
        for name, recs in records.items():
            if recs and "extra_mem_per_rank" in recs[0]:
                lines.append(
                    f"- {name}: " + ", ".join(str([round(m / 2**20, 1) for m in r["extra_mem_per_rank"]]) for r in recs)
                )
    return lines + [""]


def write_markdown(
    path: Path,
    facts: dict[str, Any],
    r: dict[str, Any],
    table: str,
    dist_res: dict[str, Any],
    single_res: dict[str, Any],
) -> None:
    notes, summary = "", []
    if path.exists():
        old = path.read_text()
        if NOTES_MARK in old:
            notes = old.split(NOTES_MARK, 1)[1]
        if SUMMARY_START in old and SUMMARY_END in old:  # benchmarks/summary.py's table, kept at the top
            summary = [SUMMARY_START + old.split(SUMMARY_START, 1)[1].split(SUMMARY_END, 1)[0] + SUMMARY_END, ""]
    b = r["ckpt_bytes"]
    save = dist_res["save"]
    dd_recs = [{"seconds": d["seconds"], "rate_bytes": d["bytes"]} for d in save["dd"]]
    out = [
        "# Benchmarks",
        "",
        *INTRO,
        "",
        *summary,
        "## Results",
        "",
        f"- **Command:** `{facts['command']}` (what `make bench-core` runs), {facts['runs']} alternating run(s) per "
        "measurement, medians below",
        f"- **Date:** {facts['date']}, whole benchmark took {facts['wall']}",
        f"- **Machine:** {facts['cpu']}, {facts['memory']} RAM, Linux {facts['kernel']}; disk: {facts['filesystem']}",
        f"- **Software:** Python {facts['python']}, torch {facts['torch']} (CPU), shardsafe {facts['shardsafe']} at "
        f"{facts['commit']}",
        f"- **Load average when it finished:** {facts['load_avg']} (the machine is shared and noisy; see the spread of "
        "the runs)",
        f"- **Model:** FSDP2 over 2 ranks (gloo, CPU), {facts['layers']} x `Linear({facts['width']}, "
        f"{facts['width']})` = "
        f"{param_bytes(facts['layers'], facts['width']) / 2**30:.3f} GiB fp32 parameters, plus AdamW "
        "`exp_avg`/`exp_avg_sq` after one step: "
        f"{r['tensor_bytes'] / 2**30:.3f} GiB of tensors; checkpoint on disk: shardsafe {b / 1e9:.3f} GB, DCP "
        f"{r['dcp_bytes'] / 1e9:.3f} GB; "
        f"dd wrote {r['dd_bytes'] / 1e9:.3f} GB",
        "",
        table,
        "",
        "GB/s is the shardsafe checkpoint size over the time, for both libraries (they store the same tensors; DCP's",
        f"checkpoint is {(r['dcp_bytes'] / b - 1) * 100:+.3f}% of that size); dd's own rate is over the bytes dd "
        "wrote, and its",
        "time column is the time dd's rate needs for the shardsafe checkpoint size. Times are wall time of the "
        "collective call,",
        "barrier before, maximum over ranks. *Fresh optimizer*: the load starts from a new, stateless AdamW, as a "
        "resumed job",
        "does, so the library has to create the optimizer state (DCP's get/set_state_dict runs torch's dummy optimizer "
        "step;",
        "shardsafe allocates empty state shaped like the checkpoint's and reads into it). *Optimizer state",
        "allocated*: the state exists (zeroed) before the timing starts, as when rolling back inside a running job; "
        "this",
        "isolates reading, verifying and copying.",
        "",
        "Targets:",
        "",
        render_verdict(r),
        "",
        "## All runs",
        "",
        *_runs_table(
            "Save, 2 ranks", {"shardsafe": save["shardsafe"], "DCP": save["dcp"], "dd (raw disk)": dd_recs}, b, mem=True
        ),
        *[
            line
            for key, label in LOADS
            for line in _runs_table(label[0].upper() + label[1:], load_records(dist_res, single_res)[key], b, mem=False)
        ],
        "## How it is measured",
        "",
        "- One `torch.distributed.run --nproc_per_node 2` job builds the FSDP2 model (`fully_shard` per layer and on "
        "the root),",
        "  runs one forward/backward and `AdamW.step()`, then per round runs shardsafe save, DCP save and (rank 0, "
        "others waiting)",
        "  `dd if=/dev/zero of=FILE bs=64M count=N conv=fdatasync` for the shardsafe checkpoint's size, rotating the "
        "order each round.",
        "  Each save goes to a freshly removed folder (`sync` after the removal, outside the timing).",
        "- shardsafe: `shardsafe.save(path, {'model': model, 'optim': optim})` (fsync on by default; block hashes "
        "always on).",
        "  DCP: `get_state_dict(model, optim)` then `dcp.save(..., storage_writer=FileSystemWriter(path, "
        "sync_files=True))`",
        "  (its defaults otherwise: one file per rank, one writer thread). Building the state dict is inside the "
        "timing for",
        "  DCP because shardsafe.save does the same work inside its call.",
        "- Loads: parameters are zeroed and a new AdamW is made before every load; for the *allocated* variant",
        "  `get_optimizer_state_dict` creates its state and the state is zeroed, outside the timing. shardsafe:",
        "  `shardsafe.load(path, {'model': model, 'optim': optim})` with hash verification on (the default). DCP:",
        "  `get_state_dict` (which creates the optimizer state when it is missing), `dcp.load(..., "
        "storage_reader=FileSystemReader(path))`,",
        "  `set_state_dict`. 2->1 runs in a separate process without a process group, into an unwrapped "
        "`nn.Sequential`. After",
        "  every load the parameters and both AdamW moments are compared with the saved ones exactly (xxh3 of each "
        "rank's",
        f"  Shard(0) piece): every load restored the state: **{r['all_correct']}**.",
        "- Page cache: before every load it is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches` as root, else the "
        "checkpoint's files",
        "  evicted with `fdatasync` + `posix_fadvise(POSIX_FADV_DONTNEED)`; both libraries, same way), and `fincore` "
        "confirms",
        f"  it: at most {r['cached_before_load']} bytes were cached before any load (-1 = fincore unavailable). Only "
        "the guest's",
        "  cache is dropped; the virtual disk's host may still cache, so reads may be faster than the physical disk.",
        "- Extra peak memory: each rank resets its kernel high-water mark before the call and reads it after "
        f"({r['mem_method']});",
        "  the figure is peak RSS minus RSS just before the call, the maximum over ranks and runs. Page cache is not "
        "RSS.",
        "",
        NOTES_MARK,
    ]
    text = "\n".join(out) + (notes if notes else "\n")
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
