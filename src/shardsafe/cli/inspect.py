"""``shardsafe inspect`` (what a checkpoint holds, from its manifest and state file) and
``shardsafe verify`` (every byte checked)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shardsafe.api.checkpoint import verify
from shardsafe.cli.formatting import format_bytes, table
from shardsafe.core.format import MANIFEST_NAME, STATE_NAME, Manifest, dtype_name
from shardsafe.core.values import state_tensor_keys as tensor_keys_of
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.state.base import (
    KIND_DEEPSPEED_ENGINE,
    KIND_MODULE,
    KIND_OPTIMIZER,
    KIND_PER_RANK,
    KIND_STATEFUL,
    KIND_TENSOR,
    KIND_VALUE,
)
from shardsafe.state.deepspeed_engine import flat_tensor_shapes


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
        *table(["name", "kind", "contents"], [[e["name"], str(e["kind"]), _entry_detail(e)] for e in info["state"]]),
        "",
        f"tensors ({len(info['tensors'])})",
        *table(
            ["key", "dtype", "shape", "chunks", "bytes"],
            [[t["key"], t["dtype"], _shape(t["shape"], t.get("param_shape")), str(t["chunks"]), format_bytes(t["bytes"])] for t in info["tensors"]],
            right={3, 4},
        ),
        "",
        f"files ({len(info['files'])})",
        *table(
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


def add_parsers(sub: Any) -> None:
    """``shardsafe inspect PATH [--json]`` and ``shardsafe verify PATH``."""
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = describe_checkpoint(args.path)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    summary = verify(args.path)
    print(
        f"ok: {summary['path']}: {summary['tensors']} tensors in {summary['files']} files, {format_bytes(summary['bytes_checked'])} "
        f"hashed; world size {summary['world_size']}, format v{summary['format_version']}"
    )
    return 0
