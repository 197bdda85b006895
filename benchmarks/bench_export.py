"""Export benchmarks: `python benchmarks/bench_export.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

1. Gathered save on 2 FSDP2 ranks (gloo, CPU), bf16 output, 500 MB files:
   ``shardsafe.save_pretrained(model, out)`` vs the usual recipe
   ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))``
   then, on rank 0, cast to bf16 and ``model.save_pretrained(out, state_dict=...)`` (transformers).
2. Consolidation in one process, fp32 (what both tools can do), same file split:
   ``shardsafe.export_hf`` from a 2-rank shardsafe checkpoint vs torch's
   ``consolidate_safetensors_files`` from a 2-rank DCP ``HuggingFaceStorageWriter(save_distributed=True)``
   checkpoint; plus ``export_hf`` to bf16. Each runs in a fresh process, file cache dropped first.

The model is a Llama (transformers) of 336.6 M parameters: 1.25 GiB in fp32 (``--quick``: 18 M).
Reports wall time and extra peak RSS (high-water mark above the level before the call) per rank,
checks the outputs are identical, and with ``--md`` writes them as the "## Export" section of that
file (replacing an earlier one, keeping the rest).
"""

from __future__ import annotations

import argparse
import json
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
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from common import PeakMemory, drop_file_cache, folder_bytes, safetensors_index, write_section  # noqa: E402

MAX_SHARD = "500MB"
SECTION = "## Export"
FULL = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
}
QUICK = {
    "vocab_size": 8000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
}


def llama_config(sizes: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**sizes, num_key_value_heads=sizes["num_attention_heads"], tie_word_embeddings=False)


# ----------------------------------------------------------------------------- rank worker (torchrun)


def build_sharded(sizes: dict[str, int], world_size: int) -> Any:
    """The Llama on the meta device, FSDP2-sharded, then only the local shards materialised and filled."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(sizes))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=gen)
    return model


def worker_save(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import shardsafe
    from shardsafe.api.source import TensorInfo
    from shardsafe.hf.export import plan_shards

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    root = Path(args.dir)
    sizes = QUICK if args.quick else FULL
    model = build_sharded(sizes, world)

    def ours(out: Path) -> None:
        shardsafe.save_pretrained(model, out, dtype=torch.bfloat16, max_shard_size=MAX_SHARD)

    def baseline(out: Path) -> None:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            full = {k: v.to(torch.bfloat16) for k, v in full.items()}
            model.save_pretrained(out, state_dict=full, max_shard_size=MAX_SHARD, is_main_process=True)
        del full
        dist.barrier()

    results: dict[str, list[dict[str, float]]] = {"save_pretrained": [], "full_state_dict+save_pretrained": []}
    methods = [("save_pretrained", ours), ("full_state_dict+save_pretrained", baseline)]
    for run in range(args.runs):
        for name, fn in methods if run % 2 == 0 else methods[::-1]:
            out = root / f"{name.replace('+', '-')}-{run}"
            dist.barrier()
            with PeakMemory() as mem:
                start = time.perf_counter()
                fn(out)
                dist.barrier()
                wall = time.perf_counter() - start
            results[name].append({"wall_s": wall, "extra_rss": mem.extra, "method": mem.method})  # type: ignore[dict-item]
            if run < args.runs - 1 and rank == 0:
                shutil.rmtree(out)
            dist.barrier()

    # sources for the consolidation benchmark: a shardsafe checkpoint and a DCP Hugging Face checkpoint
    shardsafe.save(root / "ckpt", {"model": model})
    state = get_model_state_dict(model)
    infos = [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    mapping = {t.name: i + 1 for i, (_, group) in enumerate(plan_shards(infos, MAX_SHARD).files) for t in group}
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(
            path=str(root / "dcp"), save_distributed=True, fqn_to_index_mapping=mapping
        ),
    )
    all_results: list[Any] = [None] * world
    dist.all_gather_object(all_results, results)
    if rank == 0:
        (root / "save.json").write_text(json.dumps({"per_rank": all_results, "mapping": mapping}))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- single-process workers


def worker_consolidate(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    import shardsafe

    torch.set_num_threads(1)
    root = Path(args.dir)
    out = root / f"{args.worker}-{args.run}"
    cached = drop_file_cache(root / ("dcp" if args.worker == "consolidate_safetensors_files" else "ckpt"))
    mapping = json.loads((root / "save.json").read_text())["mapping"]
    dtype = torch.bfloat16 if args.worker == "export_hf-bf16" else torch.float32
    with PeakMemory() as mem:
        start = time.perf_counter()
        if args.worker == "consolidate_safetensors_files":
            out.mkdir()
            consolidate_safetensors_files(str(root / "dcp"), str(out), fqn_to_index_mapping=mapping)
        else:
            shardsafe.export_hf(root / "ckpt", out, dtype=dtype, max_shard_size=MAX_SHARD, progress=False)
        wall = time.perf_counter() - start
    print(json.dumps({"wall_s": wall, "extra_rss": mem.extra, "method": mem.method, "cached_before": cached}))


# ----------------------------------------------------------------------------- checks and report


def same_tensors(a: Path, b: Path) -> bool:
    """Two model folders hold the same tensors (names, dtypes, values), compared one tensor at a time."""
    from safetensors import safe_open

    ia, ib = safetensors_index(a), safetensors_index(b)
    if sorted(ia) != sorted(ib):
        return False
    import torch

    for name in ia:
        with safe_open(str(ia[name]), framework="pt") as fa, safe_open(str(ib[name]), framework="pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
    return True


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def section(facts: dict[str, Any], save: dict[str, Any], single: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        SECTION,
        "",
        f"`{facts['command']}` on {facts['when']}: {facts['machine']}. Model: Llama (transformers) with "
        f"{facts['params'] / 1e6:.1f} M parameters, {facts['fp32_bytes'] / 2**30:.2f} GiB in fp32; files split at "
        f"{MAX_SHARD}; "
        f"median of {facts['runs']} runs (alternating order), fsync on for shardsafe. Extra peak RSS = high-water mark "
        "during "
        "the call minus RSS before it (VmHWM reset through /proc/self/clear_refs).",
        "",
        f"**Gathered save** (2 FSDP2 ranks, gloo, CPU; bf16 output of {facts['bf16_bytes'] / 2**30:.2f} GiB):",
        "",
        "| method | wall time | extra peak RSS rank 0 | extra peak RSS rank 1 |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (
        ("save_pretrained", "`shardsafe.save_pretrained(model, out)`"),
        (
            "full_state_dict+save_pretrained",
            "`get_model_state_dict(full_state_dict=True, cpu_offload=True)` + transformers `save_pretrained`",
        ),
    ):
        walls = [statistics.median(r["wall_s"] for r in save["per_rank"][0][name])]
        mem = [
            statistics.median(r["extra_rss"] for r in save["per_rank"][rank][name])
            for rank in range(len(save["per_rank"]))
        ]
        lines.append(f"| {label} | {walls[0]:.1f} s | {mib(mem[0])} | {mib(mem[1])} |")
    lines += [
        "",
        "**Consolidation in one process** (from a checkpoint saved by 2 ranks; file cache dropped before each run):",
        "",
        "| method | output | wall time | extra peak RSS |",
        "|---|---|---:|---:|",
    ]
    for name, label, out in (
        ("export_hf-fp32", "`shardsafe export` (`export_hf`) from a shardsafe checkpoint", "fp32"),
        (
            "consolidate_safetensors_files",
            "torch `consolidate_safetensors_files` from a DCP `HuggingFaceStorageWriter` checkpoint",
            "fp32",
        ),
        ("export_hf-bf16", "`shardsafe export --dtype bfloat16`", "bf16"),
    ):
        runs = single[name]
        lines.append(
            f"| {label} | {out} | {statistics.median(r['wall_s'] for r in runs):.1f} s | "
            f"{mib(statistics.median(r['extra_rss'] for r in runs))} |"
        )
    lines += [
        "",
        f"Outputs checked identical: gathered save vs the recipe's bf16 tensors: {facts['same_save']}; "
        f"export fp32 vs consolidate_safetensors_files: {facts['same_export']}. Largest tensor: "
        f"{mib(facts['largest_fp32'])} in fp32. shardsafe's gathered save holds one gathered tensor at a time on the "
        "coordinator (plus the gather's buffers); the recipe materialises the whole state dict on rank 0 and "
        "transformers' `save_pretrained` serializes each 500 MB file in memory. `export_hf` holds one whole tensor "
        "(plus its cast copy) at a time.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: an 18 M parameter model, 1 run")
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement (default 3; 1 with --quick)")
    parser.add_argument(
        "--dir", type=Path, default=REPO / "bench-run" / "export", help="scratch folder (default ./bench-run/export)"
    )
    parser.add_argument(
        "--md", type=Path, default=None, help="write the results as the '## Export' section of this file"
    )
    parser.add_argument("--keep", action="store_true", help="keep the outputs in --dir")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    if args.worker == "save":
        worker_save(args)
        return 0
    if args.worker is not None:
        worker_consolidate(args)
        return 0

    root: Path = args.dir.absolute()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    passthrough = ["--dir", str(root), "--runs", str(args.runs), *(["--quick"] if args.quick else [])]
    started = time.strftime("%Y-%m-%d", time.gmtime())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            "save",
            *passthrough,
        ],
        check=True,
        env=env,
        cwd=REPO,
    )
    save = json.loads((root / "save.json").read_text())
    single: dict[str, list[dict[str, Any]]] = {
        "export_hf-fp32": [],
        "consolidate_safetensors_files": [],
        "export_hf-bf16": [],
    }
    order = list(single)
    for run in range(args.runs):
        for name in order if run % 2 == 0 else order[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--run", str(run), *passthrough],
                check=True,
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            single[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, single[name][-1], flush=True)
            if run < args.runs - 1:
                shutil.rmtree(root / f"{name}-{run}")
    last = args.runs - 1
    same_save = same_tensors(root / f"save_pretrained-{last}", root / f"full_state_dict-save_pretrained-{last}")
    same_export = same_tensors(root / f"export_hf-fp32-{last}", root / f"consolidate_safetensors_files-{last}")

    import math

    import torch

    from shardsafe.protocol.commit import open_checkpoint

    manifest, _ = open_checkpoint(root / "ckpt")
    params = sum(math.prod(t.shape) for t in manifest.tensors.values())
    facts = {
        "command": "python benchmarks/bench_export.py"
        + (" --quick" if args.quick else "")
        + (f" --runs {args.runs}" if args.runs != 3 else ""),
        "when": started,
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "params": params,
        "fp32_bytes": params * 4,
        "bf16_bytes": folder_bytes(root / f"save_pretrained-{last}"),
        "runs": args.runs,
        "same_save": same_save,
        "same_export": same_export,
        "largest_fp32": max(t.nbytes for t in manifest.tensors.values()),
    }
    text = section(facts, save, single)
    print(text)
    if args.md is not None:
        write_section(args.md, SECTION, text)
        print(f"wrote the {SECTION!r} section of {args.md}")
    if not args.keep:
        shutil.rmtree(root)
    return 0 if same_save and same_export else 1


if __name__ == "__main__":
    raise SystemExit(main())
