"""Model folders in ``output_dir``: built hidden, moved in marker-last; and the folder staged for an upload.

``output_dir`` holds the Trainer's checkpoints next to the model folder ``save_model`` writes, so
a model cannot be published by renaming a whole folder into place: its files are moved in one by
one (:func:`install_model_folder`), in an order that never shows a weights marker without its
weights.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from shardsafe.api.source import CHECKPOINT_DIR
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE
from shardsafe.hf.pretrained import NOTE_FILE
from shardsafe.protocol.temppath import TMP_MARK, hidden_sibling, retire_folder
from shardsafe.storage.local import fsync_dir, remove_tree

__all__ = ["hub_token", "install_model_folder", "new_hidden", "stage_upload"]

SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def new_hidden(parent: Path, what: str) -> Path:
    """A fresh hidden temporary path inside ``parent`` (created if needed); ``shardsafe gc`` removes leftovers."""
    parent.mkdir(parents=True, exist_ok=True)
    return hidden_sibling(parent / what, TMP_MARK)


def install_model_folder(staging: Path, out: Path, fsync: bool = True) -> None:
    """Move the files of the complete model folder ``staging`` into ``out``, keeping what else ``out`` holds.

    Order makes it safe to read ``out`` at any moment: the markers of the model there now (the
    index, ``checkpoint/``, a ``model.safetensors`` the new model does not replace) go first, then
    the new data and other files, then the new markers (``model.safetensors`` replaces the old one
    in one rename), then the files of the old model nothing refers to any more (shards, EXPORT.md).
    """
    out.mkdir(parents=True, exist_ok=True)
    new = {entry.name for entry in os.scandir(staging)}
    for name in (INDEX_FILE, CHECKPOINT_DIR, SINGLE_FILE):
        old = out / name
        replaced_in_one_rename = name == SINGLE_FILE and name in new
        if replaced_in_one_rename or not (old.exists() or old.is_symlink()):
            continue
        if old.is_dir() and not old.is_symlink():
            retire_folder(old, fsync=False)  # fsynced once, below
        else:
            old.unlink()
    if fsync:
        fsync_dir(out)
    markers = [n for n in (CHECKPOINT_DIR, INDEX_FILE, SINGLE_FILE) if n in new]
    for name in [*sorted(new - set(markers)), *markers]:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            remove_tree(target)
        os.replace(staging / name, target)
    for entry in os.scandir(out):
        stale_shard = SHARD_RE.match(entry.name) is not None and entry.name not in new
        if stale_shard or (entry.name == NOTE_FILE and NOTE_FILE not in new):
            os.unlink(entry.path)
    if fsync:
        fsync_dir(out)


def stage_upload(out: Path) -> Path:
    """A hidden folder holding (hard links to) what the Trainer uploads from ``out``: all but ``checkpoint-*``, ``_*``
    and hidden names."""
    stage = new_hidden(out, "push")
    stage.mkdir()
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        if entry.name.startswith((".", "_", f"{PREFIX_CHECKPOINT_DIR}-")):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, stage / entry.name, copy_function=_link_or_copy)
        elif entry.is_file(follow_symlinks=False):
            _link_or_copy(entry.path, str(stage / entry.name))
    return stage


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


@contextmanager
def hub_token(token: str | None) -> Iterator[None]:
    """Use ``token`` for the Hub calls inside (huggingface_hub reads ``HF_TOKEN`` on each call)."""
    if token is None:
        yield
        return
    before = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = before
