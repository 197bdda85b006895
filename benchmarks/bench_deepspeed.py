"""DeepSpeed ZeRO-3 export benchmark: `python benchmarks/bench_deepspeed.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

Exports a real DeepSpeed ZeRO-3 checkpoint (written by DeepSpeed itself on 2 CPU ranks) into an fp32
Hugging Face safetensors folder three ways, each in a fresh process:

a. ``shardsafe export CKPT OUT --dtype float32`` (the command line);
b. DeepSpeed's ``zero_to_fp32.py CKPT OUT --safe_serialization``, the copy DeepSpeed put into the
   checkpoint folder (default ``--max_shard_size 5GB``: one shard, materialised whole, then
   ``safetensors.torch.save_file``);
c. DeepSpeed's lazy mode: ``get_fp32_state_dict_from_zero_checkpoint(CKPT, lazy_mode=True)``, then
   each tensor materialised with ``.contiguous()`` (as DeepSpeed's docstring shows), written into
   ``model.safetensors`` right away (header first, from the lazy tensors' shapes) and dropped: one
   tensor at a time, the most frugal way to write the same file with DeepSpeed's lazy mode.

All three run with ``OMP_NUM_THREADS=1``; shardsafe and the lazy mode also with the inherited
environment (torch's default thread count), since torch's parallel copies out of a memory-mapped
file behave very differently. Controls: the lazy mode plus an ``fsync`` of its file (shardsafe
fsyncs its output, DeepSpeed does not), and processes that only import each tool.

The checkpoint is a Llama (transformers) of 141.7 M parameters (567 MB in fp32; odd vocabulary and
MLP sizes, MLP biases: 48 tensors of odd size), trained one step (AdamW) with bf16 mixed precision
under ZeRO-3 on 2 ranks (gloo, CPU accelerator); it is built once and cached in ``--dir``.
``--quick``: a 0.6 M parameter Llama, 1 run.

Each process's wall time (start to exit, imports included) and peak RSS (its ``ru_maxrss`` from
``os.wait4``: interpreter, imports and mapped file pages included) are measured; the checkpoint's
page cache is dropped before each (``posix_fadvise(DONTNEED)``) and dirty pages are flushed
(``os.sync``) between processes, outside the timing. The median of ``--runs`` runs (alternating
order) is reported with the ratios shardsafe / lazy mode and shardsafe / script, against the
targets wall <= 1.0x and peak RSS <= 0.5x of the lazy mode. The outputs are compared tensor by
tensor (bit-exact) once, outside the timing. ``--md`` writes the "## DeepSpeed export" section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SECTION = "## DeepSpeed export"
# Llama sizes: odd vocabulary and intermediate sizes, MLP biases (odd-sized tensors), untied head
# (zero_to_fp32 --safe_serialization refuses tied weights).
FULL = {
    "vocab_size": 49157,
    "hidden_size": 576,
    "intermediate_size": 1537,
    "num_hidden_layers": 24,
    "num_attention_heads": 9,
}
QUICK = {
    "vocab_size": 1009,
    "hidden_size": 128,
    "intermediate_size": 345,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
# key -> (what is run, OMP_NUM_THREADS: "1" or None for the inherited environment)
SPECS: dict[str, tuple[str, str | None]] = {
    "shardsafe": ("shardsafe", "1"),
    "script": ("script", "1"),
    "lazy": ("lazy", "1"),
    "lazy+fsync": ("lazy+fsync", "1"),
    "shardsafe-nofsync": ("shardsafe-nofsync", "1"),
    "shardsafe/default": ("shardsafe", None),
    "lazy/default": ("lazy", None),
    "import-shardsafe": ("import-shardsafe", "1"),
    "import-deepspeed": ("import-deepspeed", "1"),
}
LABELS = {
    "shardsafe": "`shardsafe export CKPT OUT --dtype float32`",
    "script": "DeepSpeed `python CKPT/zero_to_fp32.py CKPT OUT --safe_serialization`",
    "lazy": "DeepSpeed `get_fp32_state_dict_from_zero_checkpoint(CKPT, lazy_mode=True)`, "
    "one tensor at a time into `model.safetensors`",
    "lazy+fsync": "the same lazy mode, then `os.fsync` of its file (control: durable like shardsafe's output)",
    "shardsafe-nofsync": "`shardsafe export ... --no-fsync` (control: not durable, like DeepSpeed's writers)",
    "import-shardsafe": "`import shardsafe.cli.main` only (control)",
    "import-deepspeed": "`import deepspeed.utils.zero_to_fp32` only (control)",
}
_ST_DTYPES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "bool": "BOOL",
}


def llama_config(sizes: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    heads = sizes["num_attention_heads"]
    return LlamaConfig(
        **sizes,
        num_key_value_heads=heads // 3 if heads % 3 == 0 else heads // 2,
        mlp_bias=True,
        tie_word_embeddings=False,
    )


# ----------------------------------------------------------------------------- checkpoint (torchrun, 2 ranks)


def worker_train(args: argparse.Namespace) -> None:
    """Build the Llama, one bf16 ZeRO-3 AdamW step under DeepSpeed, ``save_checkpoint``; rank 0 writes config.json and
    the marker."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    start = time.perf_counter()
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    sizes = QUICK if args.quick else FULL
    config = llama_config(sizes)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    tokens = torch.randint(0, sizes["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(7 + rank))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    folder = Path(args.ckpt)
    engine.save_checkpoint(str(folder))
    dist.barrier()
    if rank == 0:
        config.save_pretrained(folder)  # config.json next to `latest`, as the HF Trainer leaves it
        marker = {
            "sizes": sizes,
            "params": params,
            "precision": "bf16",
            "seconds": time.perf_counter() - start,
            "world_size": dist.get_world_size(),
        }
        (folder / "bench-ckpt.json").write_text(json.dumps(marker))
    dist.barrier()
    dist.destroy_process_group()


def ensure_checkpoint(ckpt: Path, quick: bool, env: dict[str, str]) -> dict[str, Any]:
    """The cached checkpoint's marker; builds the checkpoint first when it is missing or of other sizes."""
    marker = ckpt / "bench-ckpt.json"
    sizes = QUICK if quick else FULL
    if marker.is_file() and json.loads(marker.read_text()).get("sizes") == sizes:
        return json.loads(marker.read_text())
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the DeepSpeed ZeRO-3 checkpoint in {ckpt} (2 ranks) ...", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        "--worker",
        "train",
        "--ckpt",
        str(ckpt),
    ]
    subprocess.run([*cmd, *(["--quick"] if quick else [])], check=True, env=env, cwd=REPO)
    return json.loads(marker.read_text())


# ----------------------------------------------------------------------------- DeepSpeed lazy mode (a child process)


def worker_lazy(ckpt: Path, out: Path, fsync: bool) -> None:
    """DeepSpeed's lazy mode writing ``out/model.safetensors``: header first, then one materialised tensor at a time."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), lazy_mode=True)
    if len({id(t) for t in state.values()}) != len(state):
        raise SystemExit("tied weights: not handled by this writer")

    def target(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype.is_floating_point else dtype  # what zero_to_fp32 writes (dtype=float32)

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in state.items():
        dtype = target(t.dtype)
        nbytes = math.prod(t.shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[str(dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in list(state):
            lazy = state.pop(name)
            tensor = lazy.contiguous().to(target(lazy.dtype))
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del lazy, tensor
        if fsync:
            f.flush()
            os.fsync(f.fileno())


# ----------------------------------------------------------------------------- measuring


def command(name: str, ckpt: Path, out: Path) -> list[str]:
    exe = sys.executable
    if name in ("shardsafe", "shardsafe-nofsync"):
        cli = Path(exe).parent / "shardsafe"
        prefix = (
            [str(cli)]
            if cli.is_file()
            else [exe, "-c", "import sys; from shardsafe.cli.main import main; sys.exit(main())"]
        )
        flags = ["--no-fsync"] if name == "shardsafe-nofsync" else []
        return [*prefix, "export", str(ckpt), str(out), "--dtype", "float32", "--no-progress", *flags]
    if name == "script":
        return [exe, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out), "--safe_serialization"]
    if name in ("lazy", "lazy+fsync"):
        return [exe, __file__, "--worker", name, "--ckpt", str(ckpt), "--out", str(out)]
    if name == "import-shardsafe":
        return [exe, "-c", "import shardsafe.cli.main"]
    if name == "import-deepspeed":
        return [exe, "-c", "import deepspeed.utils.zero_to_fp32"]
    raise ValueError(name)


def measure(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Wall time and peak RSS (the child's own ru_maxrss, via os.wait4) of one process."""
    with open(log, "ab") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{cmd} failed ({proc.returncode}); see {log}")
    return {"wall_s": wall, "peak_rss": usage.ru_maxrss * 1024, "cpu_s": usage.ru_utime + usage.ru_stime}


def same_tensors(a: Path, b: Path) -> tuple[bool, str]:
    """Two model folders hold the same tensors: names, dtypes, shapes and bytes, one tensor at a time."""
    import torch
    from common import safetensors_index
    from safetensors import safe_open

    ia, ib = safetensors_index(a), safetensors_index(b)
    if sorted(ia) != sorted(ib):
        return False, f"names differ: {sorted(set(ia) ^ set(ib))[:5]}"
    for name in ia:
        with safe_open(str(ia[name]), framework="pt") as fa, safe_open(str(ib[name]), framework="pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            return False, f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}"
    return True, f"{len(ia)} tensors"


# ----------------------------------------------------------------------------- report


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def section(facts: dict[str, Any], res: dict[str, list[dict[str, float]]]) -> str:
    med = {k: {m: statistics.median(r[m] for r in runs) for m in runs[0]} for k, runs in res.items()}
    default = facts["default_threads"]

    def label(key: str) -> str:
        what, threads = SPECS[key]
        return (
            f"{LABELS[what]}, {'1 thread' if threads else default}" if what in ("shardsafe", "lazy") else LABELS[what]
        )

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    def ratio_row(target: str, ours: str, peer: str, field: str, limit: float | None) -> str:
        a, b = med[ours][field], med[peer][field]
        shown = (f"{a:.2f} s vs {b:.2f} s" if field == "wall_s" else f"{mb(a)} vs {mb(b)}") + f": {a / b:.2f}x"
        return f"| {target} | {shown} | {verdict(a / b <= limit) if limit is not None else ''} |"

    gap = med["shardsafe"]["wall_s"] - med["lazy"]["wall_s"]
    imports = med["import-shardsafe"]["wall_s"] - med["import-deepspeed"]["wall_s"]
    fsync = med["lazy+fsync"]["wall_s"] - med["lazy"]["wall_s"]
    lines = [
        SECTION,
        "",
        f"`{facts['command']}` on {facts['when']}: {facts['machine']}; load average {facts['load_before']} before, "
        f"{facts['load_after']} after (the machine is shared and noisy: compare within a run, and see the spread of "
        "the runs). "
        f"Whole benchmark {facts['total_s']:.0f} s.",
        "",
        f"**Checkpoint**: written by DeepSpeed {facts['ds_version']} itself (`engine.save_checkpoint`) after one AdamW "
        "step of ZeRO-3 on "
        f"{facts['world_size']} CPU ranks (gloo, CPU accelerator), {facts['precision']} mixed precision (fp32 master "
        "weights and Adam moments "
        f"in the optimizer files). Model: Llama (transformers, {facts['sizes']}, MLP biases, untied head) with "
        f"{facts['params'] / 1e6:.1f} M "
        f"parameters = {mb(facts['params'] * 4)} in fp32, {facts['tensors']} tensors ({facts['odd']} of odd size), "
        "largest "
        f"{mb(facts['largest'])}; {mb(facts['ckpt_bytes'])} on disk. Built once and cached ({facts['build_s']:.0f} s "
        "to build).",
        "",
        f"**Measured**: each row a fresh process, {facts['runs']} run(s) in alternating order, medians. Output: one "
        "fp32 "
        f"`model.safetensors` of {mb(facts['out_bytes'])} (shard limit 5 GB for all). Before each process the "
        "checkpoint's page "
        "cache is dropped (`posix_fadvise(DONTNEED)` on its files) and dirty pages are flushed (`os.sync`), outside "
        "the timing. "
        "Wall = process start to exit (interpreter and imports included); peak RSS = the process's own `ru_maxrss` "
        "(`os.wait4`), which counts the interpreter, the imports and every mapped file page it touched; *above "
        "imports* subtracts "
        f"the peak of a process that only imports the same tool. Threads: `OMP_NUM_THREADS=1`, or {default}.",
        "",
        "| method | wall time | peak RSS | above imports | CPU time |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in SPECS:
        m = med[key]
        base = med["import-shardsafe" if SPECS[key][0] == "shardsafe" else "import-deepspeed"]["peak_rss"]
        above = "" if key.startswith("import") else mb(m["peak_rss"] - base)
        lines.append(f"| {label(key)} | {m['wall_s']:.2f} s | {mb(m['peak_rss'])} | {above} | {m['cpu_s']:.2f} s |")
    lines += [
        "",
        "| target (shardsafe vs DeepSpeed's lazy mode, same run) | measured | |",
        "|---|---|---|",
        ratio_row("wall time <= 1.0x lazy mode, 1 thread", "shardsafe", "lazy", "wall_s", 1.0),
        ratio_row(f"wall time <= 1.0x lazy mode, {default}", "shardsafe/default", "lazy/default", "wall_s", 1.0),
        ratio_row("peak RSS <= 0.5x lazy mode, 1 thread", "shardsafe", "lazy", "peak_rss", 0.5),
        ratio_row(f"peak RSS <= 0.5x lazy mode, {default}", "shardsafe/default", "lazy/default", "peak_rss", 0.5),
        ratio_row(
            "(control) wall vs lazy mode + fsync, both durable, 1 thread", "shardsafe", "lazy+fsync", "wall_s", None
        ),
        ratio_row("(control) wall, both without fsync, 1 thread", "shardsafe-nofsync", "lazy", "wall_s", None),
        ratio_row("(info) wall vs the script, 1 thread", "shardsafe", "script", "wall_s", None),
        ratio_row("(info) peak RSS vs the script", "shardsafe", "script", "peak_rss", None),
        "",
        "All runs (wall time, peak RSS), in the order they ran:",
        "",
        "| row | " + " | ".join(f"run {i + 1}" for i in range(facts["runs"])) + " |",
        "|---|" + "---:|" * facts["runs"],
    ]
    for key in SPECS:
        lines.append(f"| {key} | " + " | ".join(f"{r['wall_s']:.2f} s, {mb(r['peak_rss'])}" for r in res[key]) + " |")
    lines += [
        "",
        "Outputs identical tensor by tensor (names, dtypes, shapes, bytes): shardsafe vs script: "
        f"{facts['same_script']}; "
        f"shardsafe vs lazy mode: {facts['same_lazy']}.",
        "",
        "Notes:",
        "",
        "- How DeepSpeed exposes lazy mode (0.19.8): only as `get_fp32_state_dict_from_zero_checkpoint(..., "
        "lazy_mode=True)`, which "
        "returns `GatheredTensor` stand-ins over the memory-mapped fp32 partitions; `.contiguous()` materialises one. "
        "There is no "
        "`--lazy` flag and no `lazy_mode` argument of `convert_zero_checkpoint_to_fp32_state_dict`: that function (and "
        "the "
        "`zero_to_fp32.py` script, which calls it) always uses lazy mode internally, but materialises each output "
        "shard "
        "(`--max_shard_size`, 5 GB by default, so the whole model here) before `safetensors.torch.save_file`. The "
        "lazy-mode "
        "rows are the streaming use of that API (one tensor at a time), the lowest-memory way to write the same file "
        "with DeepSpeed.",
        "- Memory: all three memory-map the optimizer files (`torch.load(mmap=True)`). DeepSpeed's readers leave every "
        "page of "
        "the fp32 master weights they touched mapped, so it counts in their RSS until exit (the whole model), plus the "
        "tensor (lazy "
        "mode) or the whole shard (script) being written. shardsafe copies each rank's slice out in 8 MB pieces and "
        "unmaps each "
        "piece right after (`madvise(MADV_DONTNEED)`): its peak is its imports + the largest tensor + one piece.",
        "- Time: every wall time includes the tool's imports (see the import-only rows; `shardsafe.cli` no longer "
        "imports "
        "`torch.distributed.tensor`, over a second here, unless a DTensor is involved). shardsafe fsyncs its output by "
        "default "
        "(starting writeback while writing, then one fsync; the folder is built hidden and renamed into place); "
        "DeepSpeed's "
        "writers do not fsync, so their time excludes writing the file to disk, which this disk does at a few hundred "
        "MB/s. "
        "The controls compare like with like: both durable (lazy mode + fsync) and both not (`--no-fsync`). "
        f"shardsafe minus lazy mode, 1 thread: {gap:+.2f} s; the import difference {imports:+.2f} s; "
        f"the fsync's cost to the lazy mode {fsync:+.2f} s.",
        "- Threads: DeepSpeed materialises tensors with torch's parallel `copy_`/`cat` straight from the mapped file; "
        "its threads "
        "fault on the same file pages, which on a cold page cache is slower and much more variable than one thread on "
        "this "
        "machine. shardsafe copies with one `memmove` per piece, whatever the thread count."
        + (
            ""
            if facts["quick"]
            else " (Before it did so, it used torch's `copy_` of each whole slice and then unmapped the slice: in an "
            "earlier run "
            "of this benchmark on 2026-11-29 it peaked at 461 MB, and in a separate measurement reading all 291 "
            "tensors from a "
            "cold cache took 4.6-7.2 s with 2 threads against 1.3-2.1 s with one, 3 runs each.)"
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: a 0.6 M parameter Llama, 1 run")
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement (default 3; 1 with --quick)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=REPO / "bench-run" / "deepspeed",
        help="scratch folder; the checkpoint is cached here",
    )
    parser.add_argument(
        "--md", type=Path, default=None, help=f"write the results as the {SECTION!r} section of this file"
    )
    parser.add_argument("--keep", action="store_true", help="keep the outputs in --dir")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "train":
        worker_train(args)
        return 0
    if args.worker in ("lazy", "lazy+fsync"):
        worker_lazy(args.ckpt, args.out, fsync=args.worker == "lazy+fsync")
        return 0
    args.runs = args.runs or (1 if args.quick else 3)

    from common import drop_file_cache, folder_bytes, load_average, write_section

    began, load_before = time.perf_counter(), load_average()
    root: Path = args.dir.absolute()
    ckpt = root / ("ckpt-quick" if args.quick else "ckpt")
    marker = ensure_checkpoint(ckpt, args.quick, dict(os.environ, OMP_NUM_THREADS="1"))
    outs = root / "out"
    if outs.exists():
        shutil.rmtree(outs)
    outs.mkdir(parents=True)
    log = root / "children.log"
    log.write_bytes(b"")
    res: dict[str, list[dict[str, float]]] = {k: [] for k in SPECS}
    order = list(res)
    for run in range(args.runs):
        for key in order if run % 2 == 0 else order[::-1]:
            what, threads = SPECS[key]
            env = dict(os.environ, OMP_NUM_THREADS=threads) if threads else dict(os.environ)
            out = outs / f"{key.replace('/', '-')}-{run}"
            os.sync()
            drop_file_cache(ckpt)
            res[key].append(measure(command(what, ckpt, out), env, log))
            print(f"run {run + 1} {key}: {res[key][-1]}", flush=True)
            os.sync()
            if run < args.runs - 1 and out.exists():
                shutil.rmtree(out)

    last = args.runs - 1
    same_script = same_tensors(outs / f"shardsafe-{last}", outs / f"script-{last}")
    same_lazy = same_tensors(outs / f"shardsafe-{last}", outs / f"lazy-{last}")
    print("same:", same_script, same_lazy, flush=True)

    import deepspeed
    import torch
    from safetensors import safe_open

    with safe_open(str(outs / f"shardsafe-{last}" / "model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
    sizes = dict(marker["sizes"])
    facts = {
        "command": ".venv/bin/python benchmarks/bench_deepspeed.py"
        + (" --quick" if args.quick else "")
        + (f" --runs {args.runs}" if args.runs != (1 if args.quick else 3) else "")
        + (f" --md {args.md}" if args.md is not None else ""),
        "default_threads": f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (inherited)"
        if os.environ.get("OMP_NUM_THREADS")
        else f"torch's default ({torch.get_num_threads()} threads)",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPU cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB RAM, "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, deepspeed {deepspeed.__version__}",
        "ds_version": deepspeed.__version__,
        "load_before": load_before,
        "load_after": load_average(),
        "sizes": ", ".join(f"{k.replace('num_', '').replace('_size', '')} {v}" for k, v in sizes.items()),
        "params": marker["params"],
        "precision": marker["precision"],
        "world_size": marker["world_size"],
        "build_s": marker["seconds"],
        "tensors": len(shapes),
        "odd": sum(1 for s in shapes if math.prod(s) % 2),
        "largest": max(math.prod(s) for s in shapes) * 4,
        "ckpt_bytes": folder_bytes(ckpt),
        "out_bytes": folder_bytes(outs / f"script-{last}"),
        "runs": args.runs,
        "quick": args.quick,
        "same_script": same_script[0],
        "same_lazy": same_lazy[0],
    }
    facts["total_s"] = time.perf_counter() - began
    text = section(facts, res)
    print(text)
    if args.md is not None:
        write_section(args.md, SECTION, text)
        print(f"wrote the {SECTION!r} section of {args.md}")
    if not args.keep:
        shutil.rmtree(outs)
    return 0 if same_script[0] and same_lazy[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
