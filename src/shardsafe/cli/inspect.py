"""``shardsafe inspect`` (what a checkpoint holds, from its manifest and state file) and
``shardsafe verify`` (every byte checked).

``inspect`` reads only manifest.json and state.json, through the library's own parsers, and then
checks the few things it shows that those parsers leave alone (the creation time, file sizes, the
state entries' shapes), so a malformed field is one ``FormatError`` naming the file and the field,
never a Python error from deep inside the formatting. Both commands count files the same way:
the shard files (what ``verify`` hashes) plus the state file and the manifest.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shardsafe.api.checkpoint import verify
from shardsafe.cli.formatting import format_bytes, natural_key, plural, printable, table
from shardsafe.core.format import MANIFEST_NAME, FileEntry, Manifest, TensorEntry, dtype_name
from shardsafe.core.values import SubclassRecord, decode_value, subclass_records
from shardsafe.errors import FormatError
from shardsafe.interop.dcp_metadata import is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint, format_dcp
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

__all__ = ["add_parsers", "describe_checkpoint", "format_inspection"]

MAX_FILE_SIZE = (1 << 63) - 1  # off_t: no file system holds a larger file
MAX_CREATED = 253_370_764_800.0  # 9998-12-31 UTC: inside what datetime can show in any time zone
TENSOR_KINDS = (KIND_MODULE, KIND_OPTIMIZER, KIND_TENSOR, KIND_DEEPSPEED_ENGINE)


def _chunk_count(t: TensorEntry) -> int:
    """Stored pieces of a tensor: its listed chunks, or, under a layout rule, the non-empty boxes of its parts."""
    return len(t.chunks) if t.rule is None else t.rule.stored_boxes(t.shape)


def _layout(t: TensorEntry, files: dict[str, FileEntry]) -> dict[str, Any]:
    """How a tensor is laid out: its rule (mesh and placements), or the ranks whose files hold its
    listed chunks (pipeline stages, experts on their own ranks, replicated tensors: the writer)."""
    if t.rule is not None:
        return {"layout": t.rule.describe(), "written_by": None}
    ranks = sorted({files[c.file].rank for c in t.chunks if c.checkpoint is None and c.file in files})
    return {"layout": "listed chunks", "written_by": ranks}


def _ranks_text(ranks: list[int]) -> str:
    """``0-3, 6``: runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """A JSON-able description of a committed checkpoint, read through the library's own validation.

    Only the manifest and state file are read (and checked against each other: every tensor the
    state refers to is in the manifest); shard contents are left to ``verify``. Tensors and files
    are listed in natural order (``layer.2`` before ``layer.10``), state entries as saved.
    """
    folder = Path(path).absolute()
    manifest, tree = open_checkpoint(folder)
    manifest_where = str(folder / MANIFEST_NAME)
    state_where = str(folder / manifest.state_file)
    created = _created(manifest.created, manifest_where)
    for name, f in manifest.files.items():
        if f.size > MAX_FILE_SIZE:
            raise FormatError(f"{manifest_where}: file {name!r} has a size no file can have")
    files: list[dict[str, Any]] = [
        {"name": name, "kind": "shard", "rank": manifest.files[name].rank, "size": manifest.files[name].size}
        for name in sorted(manifest.files, key=natural_key)
    ]
    files += [
        {"name": f.index.file, "kind": "index", "rank": f.rank, "size": f.index.size}
        for name, f in sorted(manifest.files.items(), key=lambda item: natural_key(item[0]))
        if f.index is not None
    ]
    files.append({"name": manifest.state_file, "kind": "state", "rank": None, "size": manifest.state_size})
    files.append(
        {"name": MANIFEST_NAME, "kind": "manifest", "rank": None, "size": (folder / MANIFEST_NAME).lstat().st_size}
    )
    real_shapes = _engine_shapes(tree, state_where)
    records = _subclasses(tree, state_where)
    part_of = {f"{r.path}/{n}": r.cls for r in records for n in r.inner}
    tensors = [
        {"key": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "chunks": _chunk_count(t), "bytes": t.nbytes}
        | _layout(t, manifest.files)
        | ({"param_shape": list(real_shapes[key])} if key in real_shapes else {})
        | ({"subclass": part_of[key]} if key in part_of else {})
        for key, t in sorted(manifest.tensors.items(), key=lambda item: natural_key(item[0]))
    ]
    subclasses = [
        {"key": r.path, "class": r.cls, "shape": list(r.shape), "inner": list(r.inner)}
        for r in sorted(records, key=lambda r: natural_key(r.path))
    ]
    external = sorted(
        {c.checkpoint for t in manifest.tensors.values() for c in t.chunks if c.checkpoint is not None}, key=natural_key
    )
    return {
        "path": str(folder),
        "format_version": manifest.format_version,
        "writer_version": manifest.writer_version,
        "created": manifest.created,
        "created_iso": created.isoformat(timespec="seconds"),
        "world_size": manifest.world_size,
        "hash_algorithm": manifest.hash_algorithm,
        "hash_block_size": manifest.hash_block_size,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "total_bytes": sum(f["size"] for f in files),
        "shard_files": len(manifest.files),
        "tensors": tensors,
        "subclasses": subclasses,
        "files": files,
        "state": [_describe_entry(name, entry, manifest, state_where) for name, entry in tree.items()],
        "referenced_checkpoints": external,
        "metadata": manifest.metadata,
    }


def _subclasses(tree: dict[str, Any], where: str) -> list[SubclassRecord]:
    """The tensor subclasses stored by their parts (``__subclass__`` records), in every entry."""
    out: list[SubclassRecord] = []
    for name, entry in tree.items():
        if isinstance(entry, dict):
            out += subclass_records([entry.get("state"), entry.get("ranks")], f"{where}: entry {name!r}").values()
    return out


def _created(value: float, where: str) -> datetime:
    """The save time; a value no clock gives (negative, NaN, past year 9998) is a malformed field."""
    if not 0 <= value <= MAX_CREATED:  # also false for NaN
        raise FormatError(f"{where}: field 'created' is not a valid time")
    return datetime.fromtimestamp(value, tz=timezone.utc)


def _engine_shapes(tree: dict[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Stored key -> parameter shape for the flat tensors of DeepSpeed engine entries (display only).

    ``flat_tensor_shapes`` validates the layout it needs; a shape it does not expect (a list where
    a table belongs) surfaces as a Python error, reported here as a malformed entry.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in tree.items():
        if isinstance(entry, dict) and entry.get("kind") == KIND_DEEPSPEED_ENGINE:
            try:
                shapes.update(flat_tensor_shapes(entry, name))
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                raise FormatError(
                    f"{where}: entry {name!r} is not a well-formed DeepSpeed engine entry ({type(exc).__name__})"
                ) from None
    return shapes


def _describe_entry(name: str, entry: Any, manifest: Manifest, where: str) -> dict[str, Any]:
    """Kind and a short description of one top-level state.json entry (refusing what load refuses)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        raise FormatError(f"{where}: entry {name!r} has no kind")
    kind = entry["kind"]
    out: dict[str, Any] = {"name": name, "kind": kind}
    if kind == KIND_PER_RANK:
        ranks = entry.get("ranks")
        if not isinstance(ranks, list):
            raise FormatError(f"{where}: entry {name!r}: field 'ranks' must be a list (one entry per rank)")
        keys = _tensor_keys(ranks, f"{where}: entry {name!r}")
        out["ranks"] = len(ranks)
    else:
        keys = _tensor_keys(entry.get("state"), f"{where}: entry {name!r}")
    unique = list(dict.fromkeys(keys))  # a tensor referred to twice (tied weights) is one tensor
    missing = [k for k in unique if k not in manifest.tensors]
    if missing:
        raise FormatError(f"{where}: entry {name!r} refers to tensor {missing[0]!r}, which the manifest does not list")
    if kind in TENSOR_KINDS:
        out["tensors"] = len(unique)
        out["bytes"] = sum(manifest.tensors[k].nbytes for k in unique)
    elif kind == KIND_STATEFUL and isinstance(entry.get("state"), dict):
        out["fields"] = {k: v for k, v in entry["state"].items() if v is None or isinstance(v, (bool, int, float, str))}
        out["field_count"] = len(entry["state"])
    elif kind == KIND_VALUE:
        out["value"] = entry.get("state")
    return out


def _tensor_keys(value: Any, where: str) -> list[str]:
    """Every tensor key an encoded value refers to, decoded by the format's own decoder (so a
    malformed tag is refused as load refuses it), with errors naming the file and the entry."""
    keys: list[str] = []
    decode_value(value, keys.append, where)
    return keys


def _entry_detail(e: dict[str, Any]) -> str:
    if "tensors" in e:
        return f"{plural(e['tensors'], 'tensor')}, {format_bytes(e['bytes'])}"
    if "ranks" in e:
        return f"one entry per rank ({plural(e['ranks'], 'rank')})"
    if "fields" in e:
        public = [f"{k}={_short_json(v)}" for k, v in e["fields"].items() if not k.startswith("_")]
        return (", ".join(public) + f" ({plural(e['field_count'], 'field')})").strip()
    if "value" in e:
        return _short_json(e["value"])
    return ""


def _short_json(value: Any, limit: int = 60) -> str:
    """JSON of a value, cut to ``limit`` characters (escaped, so safe on a terminal)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shape(shape: list[int], param_shape: list[int] | None = None) -> str:
    """``[3072]``, or ``[3072] of [32, 96]`` for a DeepSpeed engine's flattened parameter."""
    text = f"[{', '.join(map(str, shape))}]" if shape else "scalar"
    return f"{text} of {_shape(param_shape)}" if param_shape is not None and param_shape != shape else text


def _block_size(n: int) -> str:
    """Hash blocks are powers of two: say 16 MiB, not 16.8 MB."""
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


def _file_count(info: dict[str, Any]) -> str:
    """``3 files: 1 shard file (5.3 MB), state.json, manifest.json``: counted as ``verify`` counts
    them, and the shard bytes shown apart, as ``list`` gives a checkpoint's size."""
    shards = sum(f["size"] for f in info["files"] if f["kind"] == "shard")
    indexes = sum(1 for f in info["files"] if f["kind"] == "index")
    others = ", ".join(printable(f["name"]) for f in info["files"] if f["kind"] not in ("shard", "index"))
    if indexes:
        others = f"{plural(indexes, 'index file')}, {others}"
    return (
        f"{plural(len(info['files']), 'file')}: {plural(info['shard_files'], 'shard file')} "
        f"({format_bytes(shards)}), {others}"
    )


def _layout_text(t: dict[str, Any]) -> str:
    if t["written_by"] is None or not t["written_by"]:
        return str(t["layout"])
    return (
        f"rank {_ranks_text(t['written_by'])}" if len(t["written_by"]) == 1 else f"ranks {_ranks_text(t['written_by'])}"
    )


def _subclass_lines(subclasses: list[dict[str, Any]]) -> list[str]:
    """The table of tensor subclasses stored by their parts (none: no lines)."""
    if not subclasses:
        return []
    return [
        "",
        f"tensor subclasses ({len(subclasses)}), rebuilt on load from the tensors <key>/<inner>",
        *table(
            ["key", "class", "shape", "inner tensors"],
            [[s["key"], s["class"], _shape(s["shape"]), ", ".join(s["inner"])] for s in subclasses],
        ),
    ]


def format_inspection(info: dict[str, Any]) -> str:
    """The human form of :func:`describe_checkpoint` (every name from the files printed escaped)."""
    created = datetime.fromtimestamp(info["created"], tz=timezone.utc).astimezone()
    lines = [
        f"checkpoint    {printable(info['path'])}",
        f"format        shardsafe format v{info['format_version']}, written by shardsafe "
        f"{printable(info['writer_version'] or '?')}",
        f"created       {created:%Y-%m-%d %H:%M:%S %Z}",
        f"world size    {info['world_size']}",
        f"total size    {format_bytes(info['total_bytes'])} in {_file_count(info)} "
        f"({format_bytes(info['tensor_bytes'])} of tensors; "
        f"{printable(info['hash_algorithm'])} hash per {_block_size(info['hash_block_size'])} block)",
        "",
        f"state entries ({len(info['state'])})",
        *table(["name", "kind", "contents"], [[e["name"], e["kind"], _entry_detail(e)] for e in info["state"]]),
        "",
        f"tensors ({len(info['tensors'])})",
        *table(
            ["key", "dtype", "shape", "chunks", "bytes", "layout"],
            [
                [
                    t["key"],
                    t["dtype"],
                    _shape(t["shape"], t.get("param_shape")),
                    str(t["chunks"]),
                    format_bytes(t["bytes"]),
                    _layout_text(t),
                ]
                for t in info["tensors"]
            ],
            right={3, 4},
        ),
        *_subclass_lines(info.get("subclasses", [])),
        "",
        f"files ({len(info['files'])})",
        *table(
            ["name", "rank", "size"],
            [[f["name"], "" if f["rank"] is None else str(f["rank"]), format_bytes(f["size"])] for f in info["files"]],
            right={1, 2},
        ),
    ]
    if info["referenced_checkpoints"]:
        lines += ["", "chunks stored in sibling checkpoints: " + printable(", ".join(info["referenced_checkpoints"]))]
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
        description="Show a checkpoint's world size, format, creation time, tensors (dtype, global shape, chunks, "
        "bytes), files, "
        "state entries and user metadata. Reads and validates manifest.json and state.json only; use `verify` to check "
        "the data.",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="checkpoint folder (the one holding manifest.json)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print machine-readable JSON instead of tables (sizes in bytes, shapes as lists)",
    )
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check a checkpoint completely (exit 0 when sound, 1 otherwise)",
        description="Check manifest, state file, shard headers and every block hash. Prints one summary line and exits "
        "0 when the "
        "checkpoint is sound; prints `error: <reason>` (naming the file) and exits 1 otherwise.",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="checkpoint folder (the one holding manifest.json)")
    p.set_defaults(func=_cmd_verify)


def _cmd_inspect(args: argparse.Namespace) -> int:
    if is_dcp_folder(args.path):  # a torch.distributed.checkpoint folder: its checked .metadata
        with DcpCheckpoint(args.path, key="") as dcp_ckpt:
            dcp_info = dcp_ckpt.describe()
        print(json.dumps(dcp_info, indent=2) if args.json else format_dcp(dcp_info))
        return 0
    info = describe_checkpoint(args.path)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    summary = verify(args.path)
    # shard and index files, the state file and the manifest, as inspect counts them
    files = summary["files"] + summary.get("indexes", 0) + 2
    print(
        f"ok: {printable(summary['path'])}: {plural(files, 'file')} checked ({plural(summary['files'], 'shard file')}, "
        f"{plural(summary['indexes'], 'index file') + ', ' if summary.get('indexes') else ''}the state file "
        f"and the manifest), {plural(summary['tensors'], 'tensor')}, {format_bytes(summary['bytes_checked'])} hashed; "
        f"world size {summary['world_size']}, format v{summary['format_version']}"
    )
    return 0
