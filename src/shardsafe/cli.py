"""The ``shardsafe`` command: inspect, verify, demo.

Exit codes: 0 success, 1 a problem with the checkpoint or a failed demo stage (reported as one
``error: ...`` line on stderr, never a traceback), 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Collection
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__
from .adapters import KIND_DEEPSPEED_ENGINE, KIND_MODULE, KIND_OPTIMIZER, KIND_PER_RANK, KIND_STATEFUL, KIND_TENSOR, KIND_VALUE, tensor_keys_of
from .commit import open_checkpoint
from .deepspeed_engine import flat_tensor_shapes
from .deepspeed_zero import add_convert_command
from .errors import ShardsafeError
from .export import add_export_command
from .format import MANIFEST_NAME, STATE_NAME, Manifest, dtype_name
from .hub import add_push_command
from .manager import add_manager_commands

# ----------------------------------------------------------------------------- inspect


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """A JSON-able description of a committed checkpoint, read through the library's own validation.

    Only the manifest and state file are read (and checked against each other); shard contents are
    left to ``verify``.
    """
    folder = Path(path).absolute()
    manifest, tree = open_checkpoint(folder)
    files = [{"name": name, "rank": f.rank, "size": f.size} for name, f in sorted(manifest.files.items())]
    files.append({"name": STATE_NAME, "rank": None, "size": manifest.state_size})
    files.append({"name": MANIFEST_NAME, "rank": None, "size": (folder / MANIFEST_NAME).stat().st_size})
    real_shapes = {
        key: shape
        for name, entry in tree.items()
        if isinstance(entry, dict) and entry.get("kind") == KIND_DEEPSPEED_ENGINE
        for key, shape in flat_tensor_shapes(entry, name).items()
    }
    tensors = [
        {"key": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "chunks": len(t.chunks), "bytes": t.nbytes}
        | ({"param_shape": list(real_shapes[key])} if key in real_shapes else {})
        for key, t in manifest.tensors.items()
    ]
    external = sorted({c.checkpoint for t in manifest.tensors.values() for c in t.chunks if c.checkpoint is not None})
    return {
        "path": str(folder),
        "format_version": manifest.format_version,
        "writer_version": manifest.writer_version,
        "created": manifest.created,
        "created_iso": datetime.fromtimestamp(manifest.created, tz=timezone.utc).isoformat(timespec="seconds"),
        "world_size": manifest.world_size,
        "hash_algorithm": manifest.hash_algorithm,
        "hash_block_size": manifest.hash_block_size,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "total_bytes": sum(f["size"] for f in files),
        "tensors": tensors,
        "files": files,
        "state": [_describe_entry(name, entry, manifest) for name, entry in tree.items()],
        "referenced_checkpoints": external,
        "metadata": manifest.metadata,
    }


def _describe_entry(name: str, entry: Any, manifest: Manifest) -> dict[str, Any]:
    """Kind and a short description of one top-level state.json entry."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    out: dict[str, Any] = {"name": name, "kind": kind}
    if not isinstance(entry, dict):
        return out
    if kind in (KIND_MODULE, KIND_OPTIMIZER, KIND_TENSOR, KIND_DEEPSPEED_ENGINE):
        keys = tensor_keys_of(entry.get("state"))
        out["tensors"] = len(keys)
        out["bytes"] = sum(manifest.tensors[k].nbytes for k in keys if k in manifest.tensors)
    elif kind == KIND_PER_RANK:
        out["ranks"] = len(entry.get("ranks") or [])
    elif kind == KIND_STATEFUL and isinstance(entry.get("state"), dict):
        out["fields"] = {k: v for k, v in entry["state"].items() if v is None or isinstance(v, (bool, int, float, str))}
        out["field_count"] = len(entry["state"])
    elif kind == KIND_VALUE:
        out["value"] = entry.get("state")
    return out


def format_bytes(n: float) -> str:
    """Decimal units (kB, MB, GB), as disk sizes are usually quoted."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _table(headers: list[str], rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Aligned columns; ``right`` holds the indices of right-aligned (numeric) columns."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  " + "  ".join(parts).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def _entry_detail(e: dict[str, Any]) -> str:
    if "tensors" in e:
        return f"{e['tensors']} tensors, {format_bytes(e['bytes'])}"
    if "ranks" in e:
        return f"one entry per rank ({e['ranks']} rank{'' if e['ranks'] == 1 else 's'})"
    if "fields" in e:
        public = [f"{k}={json.dumps(v)}" for k, v in e["fields"].items() if not k.startswith("_")]
        return (", ".join(public) + f" ({e['field_count']} fields)").strip()
    if "value" in e:
        text = json.dumps(e["value"])
        return text if len(text) <= 60 else text[:57] + "..."
    return ""


def _shape(shape: list[int], param_shape: list[int] | None = None) -> str:
    """``[3072]``, or ``[3072] of [32, 96]`` for a DeepSpeed engine's flattened parameter."""
    text = f"[{', '.join(map(str, shape))}]" if shape else "scalar"
    return f"{text} of {_shape(param_shape)}" if param_shape is not None and param_shape != shape else text


def _block_size(n: int) -> str:
    """Hash blocks are powers of two: say 16 MiB, not 16.8 MB."""
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


def format_inspection(info: dict[str, Any]) -> str:
    created = datetime.fromtimestamp(info["created"], tz=timezone.utc).astimezone()
    lines = [
        f"checkpoint    {info['path']}",
        f"format        shardsafe format v{info['format_version']}, written by shardsafe {info['writer_version'] or '?'}",
        f"created       {created:%Y-%m-%d %H:%M:%S %Z}",
        f"world size    {info['world_size']}",
        f"total size    {format_bytes(info['total_bytes'])} in {len(info['files'])} files "
        f"({format_bytes(info['tensor_bytes'])} of tensors; {info['hash_algorithm']} hash per {_block_size(info['hash_block_size'])} block)",
        "",
        f"state entries ({len(info['state'])})",
        *_table(["name", "kind", "contents"], [[e["name"], str(e["kind"]), _entry_detail(e)] for e in info["state"]]),
        "",
        f"tensors ({len(info['tensors'])})",
        *_table(
            ["key", "dtype", "shape", "chunks", "bytes"],
            [[t["key"], t["dtype"], _shape(t["shape"], t.get("param_shape")), str(t["chunks"]), format_bytes(t["bytes"])] for t in info["tensors"]],
            right={3, 4},
        ),
        "",
        f"files ({len(info['files'])})",
        *_table(
            ["name", "rank", "size"],
            [[f["name"], "" if f["rank"] is None else str(f["rank"]), format_bytes(f["size"])] for f in info["files"]],
            right={1, 2},
        ),
    ]
    if info["referenced_checkpoints"]:
        lines += ["", "chunks stored in sibling checkpoints: " + ", ".join(info["referenced_checkpoints"])]
    lines += ["", "metadata"]
    if info["metadata"]:
        lines += ["  " + line for line in json.dumps(info["metadata"], indent=2, sort_keys=True).splitlines()]
    else:
        lines.append("  (none)")
    return "\n".join(lines)


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = describe_checkpoint(args.path)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


# ----------------------------------------------------------------------------- verify


def _cmd_verify(args: argparse.Namespace) -> int:
    from .api import verify

    summary = verify(args.path)
    print(
        f"ok: {summary['path']}: {summary['tensors']} tensors in {summary['files']} files, {format_bytes(summary['bytes_checked'])} "
        f"hashed; world size {summary['world_size']}, format v{summary['format_version']}"
    )
    return 0


# ----------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DemoSettings, run_demo

    settings = DemoSettings(
        steps=args.steps,
        save_every=args.save_every,
        out=args.out,
        nproc=args.nproc,
        preempt_at=args.preempt_at,
        crash_after=args.crash_after,
        seed=args.seed,
        timeout=args.timeout,
    )
    return run_demo(settings)


# ----------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="Inspect and verify shardsafe checkpoints, or run the preempt/crash/resume/reshard demo.",
        epilog="Exit status: 0 ok, 1 the checkpoint has a problem (or a demo stage failed), 2 bad usage.",
    )
    parser.add_argument("--version", action="version", version=f"shardsafe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds",
        description="Show a checkpoint's world size, format, creation time, tensors (dtype, global shape, chunks, bytes), files, "
        "state entries and user metadata. Reads and validates manifest.json and state.json only; use `verify` to check the data.",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="checkpoint folder (the one holding manifest.json)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables (sizes in bytes, shapes as lists)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check a checkpoint completely (exit 0 when sound, 1 otherwise)",
        description="Check manifest, state file, shard headers and every block hash. Prints one summary line and exits 0 when the "
        "checkpoint is sound; prints `error: <reason>` (naming the file) and exits 1 otherwise.",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="checkpoint folder (the one holding manifest.json)")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "demo",
        help="train a small GPT under FSDP2 with a CheckpointManager: preempt, crash, resume, reshard onto 1 process",
        description="Launch P CPU ranks (gloo) with torchrun to train a small GPT under FSDP2, saving through a CheckpointManager "
        "(async saves every K steps, keep the last 3 and the best by held-out loss, preemption handling). Run 1 gets SIGTERM "
        "partway (a simulated preemption: all ranks write a final checkpoint at the step boundary and exit cleanly); run 2 "
        "resumes from it and is SIGKILLed later; run 3 resumes from the newest committed checkpoint and finishes. The final "
        "checkpoint is reloaded onto one plain process (no process group) to evaluate it, verified, and a summary is printed "
        "(blocked time per async save vs a sync save, retention, resume steps). Takes about a minute on a 2-core machine.",
    )
    p.add_argument("--steps", type=_positive_int, default=40, help="total training steps (default: %(default)s)")
    p.add_argument("--save-every", type=_positive_int, default=5, metavar="K", help="save a checkpoint every K steps (default: %(default)s)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("demo-run"),
        metavar="DIR",
        help="output folder, wiped at start; a non-empty folder the demo did not make is refused (default: %(default)s)",
    )
    p.add_argument("--nproc", type=_positive_int, default=2, metavar="P", help="number of CPU ranks (default: %(default)s)")
    p.add_argument(
        "--preempt-at",
        type=_positive_int,
        default=None,
        metavar="STEP",
        help="send SIGTERM to every rank of the first run after this step (default: between two saves, about a third of the way)",
    )
    p.add_argument(
        "--crash-after",
        type=_positive_int,
        default=None,
        metavar="STEP",
        help="SIGKILL the second run after this step (default: just before a save, about two thirds of the way)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and data order (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="give up on a launch after this long (default: %(default)s)")
    p.set_defaults(func=_cmd_demo)

    add_push_command(sub)  # `shardsafe push`, defined with push in hub.py
    add_export_command(sub)  # `shardsafe export`, defined with export_hf in export.py
    add_manager_commands(sub)  # `shardsafe list` and `shardsafe gc`, defined with the manager
    add_convert_command(sub)  # `shardsafe convert`, DeepSpeed ZeRO -> shardsafe
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardsafe`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `shardsafe inspect ... | head`: not an error worth a message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 1
    except (ShardsafeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
