"""``shardsafe export SRC OUT``: a checkpoint (shardsafe, DeepSpeed ZeRO or DCP) into a Hugging Face model folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardsafe.api.source import DTYPE_CHOICES
from shardsafe.errors import CheckpointExistsError
from shardsafe.hf.export import DEFAULT_MAX_SHARD_SIZE, export_hf, parse_size
from shardsafe.hf.guard import check_model_folder

__all__ = ["add_parser"]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``export SRC OUT [--dtype D] [--max-shard-size S] [--key K] [--config PATH] [--overwrite] [--no-progress]
    [--no-fsync]`` to a ``shardsafe`` parser."""
    p = subparsers.add_parser(
        "export",
        help="consolidate a sharded checkpoint into a Hugging Face model folder (safetensors)",
        description="Write the tensors under KEY of a shardsafe checkpoint (or of a folder saved with "
        "save_pretrained(gather_16bit=False)) as a Hugging Face model folder: model.safetensors, or "
        "model-0000k-of-0000N.safetensors + model.safetensors.index.json, plus config.json / generation_config.json "
        "when "
        "the source has them. One process, one tensor in memory at a time, reading only the chunks it needs. Tensor "
        "names "
        "safetensors cannot store (__metadata__, non-UTF-8, duplicates) are refused before anything is written. OUT is "
        "built "
        "hidden next to itself, checked by the model-folder guard and renamed into place; an existing non-empty OUT is "
        "refused unless --overwrite.",
    )
    p.add_argument(
        "src",
        type=Path,
        metavar="SRC",
        help="checkpoint folder (holding manifest.json), a save_pretrained(gather_16bit=False) folder, or a "
        "DeepSpeed ZeRO or torch DCP checkpoint folder",
    )
    p.add_argument("out", type=Path, metavar="OUT", help="model folder to create")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_CHOICES),
        default=None,
        help="cast floating-point tensors to this dtype (default: the dtype save_pretrained recorded, else as stored)",
    )
    p.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=parse_size(DEFAULT_MAX_SHARD_SIZE),
        metavar="SIZE",
        help="largest weights file, e.g. 5GB, 500MB (decimal units, as Hugging Face; default: 5GB)",
    )
    p.add_argument(
        "--key",
        default="model",
        help="state entry holding the model (default: %(default)s, else the one DeepSpeed engine entry); its prefix is "
        "stripped from names",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help="config.json (or a folder holding one) to write with the weights",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="skip fsync of the output (faster; a crash soon after may lose the files)",
    )
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    try:
        out = export_hf(
            args.src,
            args.out,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            key=args.key,
            config=args.config,
            progress=not args.no_progress,
            overwrite=args.overwrite,
            fsync=not args.no_fsync,
        )
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(f"{args.out}: exists and is not empty; pass --overwrite to replace it") from exc
    summary = check_model_folder(out)
    print(
        f"exported {summary.tensors} tensors ({summary.tensor_bytes} bytes) into {len(summary.files)} file(s) in {out}"
    )
    return 0
