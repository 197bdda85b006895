"""What a push uploads, in which order, and where to: the part of a push every backend shares.

:func:`plan_upload` runs the model-folder guard and lists the folder's files with the **commit
marker** (the one file whose presence makes a folder a model) last; :func:`parse_destination`
tells a Hub repo from an fsspec URL. The backends (:mod:`.push_hub`, :mod:`.push_fsspec`) take
both and upload.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import PushError
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE, check_model_folder

__all__ = ["COMMIT_MARKERS", "Destination", "UploadFile", "UploadPlan", "parse_destination", "plan_upload", "where"]

log = logging.getLogger("shardsafe.hf.push")  # one logger for every part of a push

# The file whose presence makes a folder a model, by the kind the guard recognised. Uploaded last.
COMMIT_MARKERS = {
    "shardsafe-checkpoint": MANIFEST_NAME,
    "sharded-safetensors": INDEX_FILE,
    "safetensors": SINGLE_FILE,
}
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class UploadFile:
    name: str  # path inside the destination, "/"-separated
    path: Path  # local file
    size: int


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    kind: str  # the guard's kind: "safetensors", "sharded-safetensors" or "shardsafe-checkpoint"
    marker: str  # the commit marker (a path inside the folder), always the last of ``files``
    files: tuple[UploadFile, ...]  # upload order: data files, then other marker-named files, then the marker

    @property
    def marker_names(self) -> list[str]:
        """Paths that make a folder a model: the top-level marker names and every marker-named file in the plan."""
        names = set(COMMIT_MARKERS.values()) | {f.name for f in self.files if is_marker_name(f.name)}
        return sorted(names)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def plan_upload(src: str | os.PathLike[str]) -> UploadPlan:
    """Check ``src`` with the model-folder guard and list its files in upload order (marker last).

    Every regular file below ``src`` is included, except names starting with ``.`` (hidden files
    and folders such as shardsafe's temporaries or a ``.cache``). Raises
    :class:`~shardsafe.errors.ModelFolderError` for an empty, dummy or incomplete model.
    """
    folder = Path(src).absolute()
    summary = check_model_folder(folder)
    files: list[UploadFile] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or not path.is_file():
                continue
            files.append(UploadFile(path.relative_to(folder).as_posix(), path, path.stat().st_size))
    # The marker is at the top, or (a checkpoint saved next to its config, as save_pretrained does
    # without gathering) in the one subfolder that holds the checkpoint.
    name = COMMIT_MARKERS[summary.kind]
    found = sorted((f.name.count("/"), f.name) for f in files if f.name == name or f.name.endswith("/" + name))
    if not found:
        raise PushError(f"{folder}: the commit marker {name} is not a regular file in the folder")
    marker = found[0][1]
    # Data first; then marker-named files of nested folders (so each nested model also comes
    # complete before its marker); the commit marker last.
    files.sort(key=lambda f: (f.name == marker, is_marker_name(f.name), f.name))
    return UploadPlan(folder, summary.kind, marker, tuple(files))


def is_marker_name(name: str) -> bool:
    return name.rsplit("/", 1)[-1] in COMMIT_MARKERS.values()


@dataclass(frozen=True)
class Destination:
    kind: str  # "hub" or "fsspec"
    url: str  # canonical form: hf://owner/name, or the fsspec URL without a trailing "/"
    repo_id: str = ""


def parse_destination(dest: str) -> Destination:
    """``hf://owner/name`` or ``owner/name`` (a Hub model repo), or any ``protocol://`` fsspec URL."""
    text = str(dest).strip()
    if text.startswith("hf://"):
        repo_id = text[len("hf://") :].strip("/")
        if repo_id.startswith("models/"):
            repo_id = repo_id[len("models/") :]
        elif repo_id.startswith(("datasets/", "spaces/")):
            raise PushError(f"{dest}: only model repos can be pushed to, not datasets or Spaces")
        if not _HUB_REPO_ID.fullmatch(repo_id):
            raise PushError(f"{dest}: not a Hub model repo; expected hf://owner/name")
        return Destination("hub", f"hf://{repo_id}", repo_id)
    if "://" in text:
        protocol, _, path = text.partition("://")
        if not protocol or not path.strip("/"):
            raise PushError(f"{dest}: the URL names no bucket or folder")
        return Destination("fsspec", f"{protocol}://{path.rstrip('/')}")
    if _HUB_REPO_ID.fullmatch(text):
        return Destination("hub", f"hf://{text}", text)
    raise PushError(
        f"{dest!r}: DEST must be a Hub repo (hf://owner/name or owner/name) or an fsspec URL (s3://bucket/prefix, file:///path)"
    )


def where(plan: UploadPlan, target: Destination) -> str:
    """How every error and log line of a push names it."""
    return f"push {plan.folder} -> {target.url}"
