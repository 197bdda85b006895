"""``shardsafe convert SRC OUT``: a DeepSpeed ZeRO or DCP checkpoint into a shardsafe checkpoint, or (``--to dcp``) back
into DCP."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardsafe.api.source import DTYPE_CHOICES
from shardsafe.errors import CheckpointExistsError, ShardsafeError
from shardsafe.interop.dcp_convert import convert_dcp, export_dcp
from shardsafe.interop.dcp_metadata import is_dcp_folder
from shardsafe.interop.deepspeed_convert import convert_deepspeed
from shardsafe.protocol.commit import open_checkpoint

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``convert SRC OUT [--tag T] [--dtype D] [--for-engine] [--to shardsafe|dcp] [--overwrite] [--no-progress]``
    to a ``shardsafe`` parser."""
    p = subparsers.add_parser(
        "convert",
        help="turn a DeepSpeed ZeRO or torch DCP checkpoint into a shardsafe checkpoint (model + optimizer, any world "
        "size), or back to DCP",
        description="Read a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint without DeepSpeed and without running pickled "
        "code, and write "
        "it as a shardsafe checkpoint: model/<name> (fp32 master weights), "
        "optim/state/<name>/{exp_avg,exp_avg_sq,step} and the "
        "param groups, keyed as shardsafe.save keys a module and a torch optimizer, so shardsafe.load({'model': model, "
        "'optim': "
        "AdamW(...)}) resumes on any number of ranks; with --for-engine, in the layout shardsafe.save gives a live "
        "ZeRO-3 engine, so "
        "shardsafe.load({'engine': engine}) resumes a fresh DeepSpeed engine on any number of ranks. A "
        "torch.distributed.checkpoint (DCP) folder "
        "(.metadata + .distcp files) is read the same way, through the restricted unpickler; --to dcp writes a "
        "shardsafe checkpoint "
        "back as a DCP folder with dcp.save. One process, one tensor in memory at a time.",
    )
    p.add_argument(
        "src",
        type=Path,
        metavar="SRC",
        help="the folder engine.save_checkpoint wrote (holding `latest`), a tag folder, a DCP folder, or with --to dcp "
        "a shardsafe checkpoint",
    )
    p.add_argument("out", type=Path, metavar="OUT", help="checkpoint folder to create")
    p.add_argument("--tag", default=None, help="tag folder to read (default: the one `latest` names)")
    p.add_argument(
        "--dtype",
        choices=[*sorted(DTYPE_CHOICES), "keep"],
        default=None,
        help="dtype of the floating model tensors (default: float32; keep: DeepSpeed's, frozen parameters in the model "
        "dtype); not with --for-engine",
    )
    p.add_argument(
        "--for-engine",
        action="store_true",
        help="write the layout of a live ZeRO-3 engine (entry 'engine': fp32 master, optimizer state, frozen "
        "parameters, buffers, "
        "step counts, hyper-parameters, loss scaler, counters) for shardsafe.load(OUT, {'engine': engine}) at any "
        "world size",
    )
    p.add_argument(
        "--to",
        choices=["shardsafe", "dcp"],
        default="shardsafe",
        help="shardsafe (default): SRC is a DeepSpeed or torch.distributed.checkpoint (DCP) folder; dcp: SRC is a "
        "shardsafe checkpoint, "
        "written as a DCP checkpoint with dcp.save",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    if args.to == "dcp" or is_dcp_folder(args.src):
        return _run_dcp(args)
    if args.for_engine and args.dtype is not None:
        raise ShardsafeError(
            "--dtype does not apply with --for-engine (the engine layout keeps fp32 master weights and the engine's "
            "dtypes)"
        )
    try:
        out = convert_deepspeed(
            args.src,
            args.out,
            tag=args.tag,
            dtype=args.dtype or "float32",
            overwrite=args.overwrite,
            progress=not args.no_progress,
            for_engine=args.for_engine,
        )
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(f"{args.out}: exists; pass --overwrite to replace it") from exc
    manifest, _ = open_checkpoint(out)
    meta = manifest.metadata.get("converted_from", {})
    if args.for_engine:
        what = (
            f"{sum(1 for k in manifest.tensors if k.startswith('engine/'))} engine tensors (for shardsafe.load into "
            "a ZeRO-3 engine)"
        )
    else:
        model = sum(1 for k in manifest.tensors if k.startswith("model/"))
        optim = sum(1 for k in manifest.tensors if k.startswith("optim/"))
        what = f"{model} model tensors, {optim} optimizer tensors"
    print(
        f"converted DeepSpeed ZeRO-{meta.get('zero_stage')} checkpoint {meta.get('tag')} ({meta.get('dp_world_size')} "
        "ranks, "
        f"step {meta.get('global_steps')}) into {out}: {what}, {sum(f.size for f in manifest.files.values())} bytes"
    )
    return 0


def _run_dcp(args: argparse.Namespace) -> int:
    """A DCP folder into a shardsafe checkpoint, or with ``--to dcp`` a shardsafe checkpoint into a DCP folder."""
    if args.for_engine or args.dtype is not None or args.tag is not None:
        raise ShardsafeError("--tag, --dtype and --for-engine apply to DeepSpeed checkpoints only")
    try:
        if args.to == "dcp":
            out = export_dcp(args.src, args.out, overwrite=args.overwrite, progress=not args.no_progress)
            print(f"wrote {args.src} as a torch.distributed.checkpoint folder {out} (dcp.load reads it)")
            return 0
        out = convert_dcp(args.src, args.out, overwrite=args.overwrite, progress=not args.no_progress)
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(f"{args.out}: exists; pass --overwrite to replace it") from exc
    manifest, _ = open_checkpoint(out)
    print(
        f"converted DCP checkpoint {args.src} into {out}: {len(manifest.tensors)} tensors, "
        f"{sum(f.size for f in manifest.files.values())} bytes"
    )
    return 0
