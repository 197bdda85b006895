"""``shardsafe push SRC DEST``: a model folder or checkpoint to the Hub or an fsspec URL, guard first."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardsafe.hf.push import DEFAULT_MESSAGE, push

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``shardsafe push SRC DEST [--revision R] [--private] [--message M] [--no-progress]`` to an argparse
    subparsers object."""
    p = subparsers.add_parser(
        "push",
        help="upload a model folder or checkpoint to the Hugging Face Hub or an object store",
        description="Check SRC with the model-folder guard (an empty, dummy or incomplete model is refused and nothing "
        "is "
        "uploaded), then upload it. To the Hub (hf://owner/name or owner/name): create the repo if needed and upload "
        "every "
        "file in one commit. To an fsspec URL (s3://bucket/prefix, file:///path): upload the data files first and the "
        "commit "
        "marker (manifest.json, model.safetensors.index.json or model.safetensors) last, so a half upload is never a "
        "model. "
        "Prints the commit URL (Hub) or the destination URL.",
    )
    p.add_argument(
        "src", type=Path, metavar="SRC", help="model folder (safetensors weights) or shardsafe checkpoint folder"
    )
    p.add_argument("dest", metavar="DEST", help="hf://owner/name, owner/name, s3://bucket/prefix or another fsspec URL")
    p.add_argument(
        "--revision", metavar="R", default=None, help="Hub branch to commit to, created if missing (default: main)"
    )
    p.add_argument("--private", action="store_true", help="create the Hub repo private (no effect on an existing repo)")
    p.add_argument(
        "--message", "-m", metavar="M", default=None, help=f"Hub commit message (default: {DEFAULT_MESSAGE!r})"
    )
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    url = push(
        args.src,
        args.dest,
        revision=args.revision,
        private=args.private,
        message=args.message,
        progress=not args.no_progress,
    )
    print(f"ok: pushed {Path(args.src).absolute()} to {url}")
    return 0
