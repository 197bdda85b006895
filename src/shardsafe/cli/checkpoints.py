"""``shardsafe list ROOT`` and ``shardsafe gc ROOT``: the checkpoints of a manager root."""

from __future__ import annotations

import json
import time
from typing import Any

from shardsafe.cli.formatting import format_bytes
from shardsafe.errors import ShardsafeError
from shardsafe.manager.catalog import list_root, where
from shardsafe.manager.gc import collect, collect_local
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    """``shardsafe list ROOT`` and ``shardsafe gc ROOT``."""
    p = sub.add_parser(
        "list",
        help="list the checkpoints of a manager root",
        description="Show the committed step checkpoints under ROOT (a folder or an fsspec URL) with sizes, metrics, "
        "and which is the latest and the best.",
    )
    p.add_argument("root", metavar="ROOT", help="the CheckpointManager root")
    p.add_argument(
        "--metric", default=None, help="metric that ranks checkpoints (default: the one the manager recorded)"
    )
    p.add_argument(
        "--mode", choices=("min", "max"), default=None, help="whether smaller or larger is better (default: recorded)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser(
        "gc",
        help="remove what interrupted saves and deletions left under a root",
        description="Remove hidden temporary, old and deleting folders and step folders without a manifest (keeping "
        "data "
        "that committed checkpoints still reference). Do not run it on a root another job is saving into: entries "
        "younger "
        "than --min-age are left alone.",
    )
    p.add_argument("root", metavar="ROOT", help="the CheckpointManager root (or any folder checkpoints are saved into)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument(
        "--min-age",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="leave younger entries alone (default: %(default)s)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="instead, remove this node's local-tier steps of ROOT (what a job that died left in host memory; run it "
        "on each node)",
    )
    p.add_argument(
        "--local-dir",
        default=DEFAULT_LOCAL_DIR,
        metavar="DIR",
        help="the manager's local_dir, {node} and {user} included (default: %(default)s)",
    )
    p.set_defaults(func=_cmd_gc)


def _cmd_list(args: Any) -> int:
    listing = list_root(args.root, args.metric, args.mode)
    infos = listing.checkpoints
    if args.json:
        rows: list[dict[str, Any]] = [
            {
                "step": i.step,
                "path": str(i.path),
                "bytes": i.size,
                "metrics": i.metrics,
                "best": i.best,
                "latest": i.latest,
                "run_id": i.run_id,
                "lease_epoch": i.lease_epoch,
                "damaged": None,
            }
            for i in infos
        ]
        rows += [
            {
                "step": d.step,
                "path": where(d.path),
                "bytes": None,
                "metrics": {},
                "best": False,
                "latest": False,
                "damaged": d.reason,
            }
            for d in listing.damaged
        ]
        print(json.dumps(sorted(rows, key=lambda r: r["step"]), indent=2))
        return 0
    if not infos and not listing.damaged:
        print(f"no committed checkpoints under {args.root}")
        return 0
    print(f"{'step':>12}  {'size':>10}  {'created':19}  {'written by':22}  flags        metrics")
    lines = []
    for i in infos:
        flags = ",".join(f for f, on in (("latest", i.latest), ("best", i.best)) if on)
        created = _when(i.created)
        metrics = " ".join(f"{k}={v}" for k, v in i.metrics.items())
        writer = f"{i.run_id} (epoch {i.lease_epoch})" if i.run_id else "-"
        lines.append(
            (i.step, f"{i.step:>12}  {format_bytes(i.size):>10}  {created}  {writer:22}  {flags:11}  {metrics}")
        )
    lines += [
        (d.step, f"{d.step:>12}  {'-':>10}  {'-':19}  {'-':22}  {'damaged':11}  skipped: {d.reason}")
        for d in listing.damaged
    ]
    for _, line in sorted(lines):
        print(line)
    if listing.damaged:
        print(
            f"note: {len(listing.damaged)} damaged checkpoint(s) skipped (not loadable; retention and gc leave them in "
            "place)"
        )
    return 0


def _when(created: float) -> str:
    """A manifest's creation time as local time, or '?' when it is not a time this machine can show."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    except (OverflowError, OSError, ValueError):
        return "?"


def _cmd_gc(args: Any) -> int:
    verb = "would remove" if args.dry_run else "removed"
    if args.local:
        try:
            local = collect_local(args.root, args.local_dir, dry_run=args.dry_run, min_age=args.min_age)
        except ValueError as exc:  # an unusable SHARDSAFE_NODE: the user's setting, named in the message
            raise ShardsafeError(f"gc --local: {exc}") from None
        for entry in local:
            print(f"{verb} {entry}")
        print(f"{verb} {len(local)} local-tier entries of {args.root} on this node")
        return 0
    report = collect(args.root, dry_run=args.dry_run, min_age=args.min_age)
    for path in report.removed:
        print(f"{verb} {path}")
    for damaged in report.damaged:
        print(f"left damaged checkpoint {where(damaged.path)}: {damaged.reason}")
    for path in report.left:
        print(f"left {path}: a damaged checkpoint may reference its files")
    print(f"{verb} {len(report.removed)} entries under {args.root}")
    if report.damaged:
        print(
            f"note: {len(report.damaged)} damaged checkpoint(s) left in place; repair or delete them, then run gc again"
        )
    return 0
