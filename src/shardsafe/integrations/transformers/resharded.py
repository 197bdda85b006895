"""Resuming a checkpoint whose ``model.safetensors`` was re-sharded in place, with every byte still verified.

A one-process ShardsafeTrainer checkpoint keeps the model in ``model.safetensors``, a file of the
checkpoint (listed and hashed by its manifest). transformers' tooling may rewrite such a file as
``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json`` and delete it (its own tests
do, and the Trainer resumes from the result). The tensors are the same bytes, elsewhere: a plain
load fails on the missing file. Here a *view* of the checkpoint is built next to it, hidden: hard
links to its files and a manifest whose model chunks point at the byte ranges the index's files
hold them at, with the committed block hashes. Loading the view reads those files and checks every
block against what the save committed, exactly as a normal load would (a changed byte fails it);
the checkpoint itself is not modified. No view when the checkpoint is not in that state.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, FileEntry, Manifest, TensorEntry, parse_json
from shardsafe.errors import IntegrityError
from shardsafe.hf.guard import INDEX_FILE
from shardsafe.hf.weights_file import read_weights_file
from shardsafe.integrations.transformers.model_folder import new_hidden
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.storage.local import read_small_file, remove_tree, safe_child, write_small_file

__all__ = ["resharded_view"]


def resharded_view(checkpoint: Path, prefix: str) -> Path | None:
    """A hidden view of ``checkpoint`` (next to it) that loads the tensors under ``prefix`` from the files
    ``model.safetensors.index.json`` names, if the checkpoint's own files of those tensors are missing; else None.

    Raises :class:`IntegrityError` if the index does not account for a moved tensor. The caller loads
    the view (verified against the committed hashes) and removes it (:func:`remove_tree`).
    """
    manifest, _ = open_checkpoint(checkpoint)
    moved = _moved_tensors(checkpoint, manifest, prefix)
    if not moved:
        return None
    index_path = safe_child(checkpoint, INDEX_FILE)
    index = parse_json(read_small_file(index_path, MAX_JSON_BYTES), str(index_path))  # bounded, no duplicate keys
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise IntegrityError(f"{checkpoint / INDEX_FILE}: no weight_map")
    tensors = dict(manifest.tensors)
    files = {name: entry for name, entry in manifest.files.items() if (checkpoint / name).exists()}
    headers = {}
    for key, entry in moved.items():
        name = key[len(prefix) :]
        file = weight_map.get(name)
        if not isinstance(file, str):
            raise IntegrityError(
                f"{checkpoint}: {entry.chunks[0].file} is missing and {INDEX_FILE} does not map {name}"
            )
        if file not in headers:
            headers[file] = read_weights_file(safe_child(checkpoint, file))
            files[file] = FileEntry(size=headers[file].size, rank=0)
        found = headers[file].tensors.get(name)
        if found is None:
            raise IntegrityError(f"{checkpoint / file}: holds no {name}, which {INDEX_FILE} places there")
        committed = entry.chunks[0]
        if (found.dtype, found.shape, found.end - found.begin) != (
            entry.dtype,
            entry.shape,
            committed.end - committed.begin,
        ):
            raise IntegrityError(
                f"{checkpoint / file}: {name} is {found.dtype} {list(found.shape)} there, but the checkpoint committed "
                f"{entry.dtype} {list(entry.shape)}; restore the checkpoint's original {committed.file}"
            )
        chunk = replace(committed, file=file, begin=found.begin, end=found.end)
        tensors[key] = replace(entry, chunks=(chunk,))
    return _write_view(checkpoint, replace(manifest, tensors=tensors, files=files))


def _moved_tensors(checkpoint: Path, manifest: Manifest, prefix: str) -> dict[str, TensorEntry]:
    """The whole tensors under ``prefix`` whose file is missing, if that is the checkpoint's only damage
    and an index is there ({} otherwise: a plain load reports what is wrong)."""
    if manifest.world_size != 1 or not (checkpoint / INDEX_FILE).is_file():
        return {}
    missing = {name for name in manifest.files if not (checkpoint / name).exists()}
    if not missing:
        return {}
    moved = {}
    for key, entry in manifest.tensors.items():
        stored_in = {c.file for c in entry.chunks}
        if not stored_in & missing:
            continue
        whole = entry.rule is None and len(entry.chunks) == 1 and entry.chunks[0].checkpoint is None
        if not key.startswith(prefix) or not whole:
            return {}  # something else than the model's weights is gone
        moved[key] = entry
    return moved


def _write_view(checkpoint: Path, manifest: Manifest) -> Path:
    """Hard links to the files ``manifest`` names (and the state file, the shard indexes) plus the manifest, in a
    hidden folder next to ``checkpoint``."""
    view = new_hidden(checkpoint.parent, f"{checkpoint.name}.view")
    view.mkdir()
    try:
        names = [manifest.state_file, *manifest.files]
        names += [f.index.file for f in manifest.files.values() if f.index is not None]
        for name in names:
            os.link(safe_child(checkpoint, name), view / name)
        write_small_file(view / MANIFEST_NAME, manifest.to_bytes(), fsync=False)
    except BaseException:
        remove_tree(view)
        raise
    return view
