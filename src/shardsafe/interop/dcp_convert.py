"""DCP checkpoints in and out: a ``torch.distributed.checkpoint`` folder into a shardsafe checkpoint, and back.

:func:`convert_dcp` reads through :class:`~shardsafe.interop.dcp_reader.DcpCheckpoint` (restricted
loading, sizes checked; one whole tensor in memory at a time) and writes each state-dict entry as
``shardsafe.save`` keys it: ``model`` (a module's state dict) as ``model/<name>``, ``optim`` (what
``get_state_dict`` / ``get_optimizer_state_dict`` give: state keyed by parameter FQN, param groups
with FQNs) as ``optim/state/<name>/<key>`` + the groups, any other top-level entry as a plain value.
So ``shardsafe.load(out, {"model": m, "optim": o})`` reshards it onto any world size.

:func:`export_dcp` writes a shardsafe checkpoint as a DCP checkpoint with DCP's own ``dcp.save``
(single process, plain whole tensors), so a run can go back to DCP.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

from shardsafe.core.dtypes import element_size
from shardsafe.core.fields import numel
from shardsafe.core.values import decode_value, encode_value
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.interop.dcp_metadata import METADATA_NAME
from shardsafe.interop.dcp_reader import DcpCheckpoint
from shardsafe.interop.deepspeed_convert import Planned, write_planned

__all__ = ["convert_dcp", "dcp_state_tree", "export_dcp"]

log = logging.getLogger(__name__)

_KINDS = {"model": "module", "optim": "optimizer"}


def _insert(tree: dict[Any, Any], path: tuple[str | int, ...], value: Any, limit: int, where: str) -> None:
    """Put ``value`` at ``path`` of the nested state dict ``tree``: an int part indexes a list (below ``limit``, the
    number
    of entries, so a path cannot make a huge list), any other a dict; two paths that conflict are refused."""
    node: Any = tree
    for i, part in enumerate(path):
        nxt: Any = value if i == len(path) - 1 else ([] if isinstance(path[i + 1], int) else {})
        if isinstance(node, list):
            if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < limit:
                raise FormatError(
                    f"{where}: a state-dict path {list(path)[:8]!r:.200} indexes a list with {part!r:.40}"
                )
            node.extend([None] * (part + 1 - len(node)))
            current = node[part]
            if current is None:
                node[part] = current = nxt
        else:
            current = node.setdefault(part, nxt)
        if i == len(path) - 1:
            if current is not value:
                raise FormatError(f"{where}: two entries have the state-dict path {list(path)[:8]!r:.200}")
        elif not isinstance(current, (dict, list)):
            raise FormatError(f"{where}: the state-dict path {list(path)[:8]!r:.200} runs through another entry")
        node = current


def dcp_state_tree(ckpt: DcpCheckpoint) -> tuple[dict[str, str], dict[str, Any]]:
    """(flattened DCP key -> shardsafe tensor key, the state tree): what :func:`convert_dcp` writes and
    ``shardsafe.load`` of the folder reads. ``model`` and ``optim`` become a module and an optimizer
    entry, any other top-level entry a plain value; the non-tensor values are read (restricted) here."""
    where = str(ckpt.folder / METADATA_NAME)
    nested: dict[Any, Any] = {}
    keys: dict[str, str] = {}
    key_of: dict[int, str] = {}
    placeholders = []  # kept alive, so no id is reused while the tree is encoded
    for fqn in ckpt.meta.tensors:
        path = ckpt.meta.paths[fqn]
        key = keys[fqn] = "/".join(str(p) for p in path)
        placeholder = torch.empty(0)
        placeholders.append(placeholder)
        key_of[id(placeholder)] = key
        _insert(nested, path, placeholder, len(ckpt.meta.paths), where)
    if len(set(keys.values())) != len(keys):
        raise FormatError(f"{where}: two tensors have the same state-dict path")
    for fqn in ckpt.meta.values:
        _insert(nested, ckpt.meta.paths[fqn], ckpt.value(fqn), len(ckpt.meta.paths), where)
    tree: dict[str, Any] = {}
    for name, value in nested.items():
        if not isinstance(name, str):
            raise FormatError(f"{ckpt.folder}: a top-level state-dict key {name!r} that is not a string")

        def ref(path: str, tensor: torch.Tensor) -> str:
            if id(tensor) not in key_of:
                raise FormatError(
                    f"{ckpt.folder}: value {path!r} holds a tensor saved as a value; only plain values are converted"
                )
            return key_of[id(tensor)]

        kind = _KINDS.get(name, "value") if isinstance(value, dict) else "value"
        tree[name] = {"kind": kind, "state": encode_value(value, name, ref)}
    return keys, tree


def convert_dcp(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    fsync: bool = True,
    progress: bool = False,
) -> Path:
    """Turn the DCP checkpoint folder ``src`` into a shardsafe checkpoint at ``out``, in this process. Returns
    ``out``."""
    from shardsafe.api.checkpoint import location

    final = location(out)
    with DcpCheckpoint(src, key="") as ckpt:
        if isinstance(final, Path) and final == ckpt.folder:
            raise ShardsafeError(f"{final}: the output folder must not be the source")
        keys, tree = dcp_state_tree(ckpt)
        planned = [
            Planned(keys[fqn], entry.dtype, entry.shape, functools.partial(ckpt.read_fqn, fqn))
            for fqn, entry in ckpt.meta.tensors.items()
        ]
        planned.sort(key=lambda p: p.key)
        info = {"format": "torch.distributed.checkpoint", "version": ckpt.meta.version, "folder": str(ckpt.folder)}
        write_planned(
            final, planned, tree, {"converted_from": info}, overwrite=overwrite, fsync=fsync, progress=progress
        )
    return Path(final) if isinstance(final, Path) else Path(str(out))


def export_dcp(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, overwrite: bool = False, progress: bool = False
) -> Path:
    """Write the shardsafe checkpoint ``src`` as a DCP checkpoint at ``out`` with ``dcp.save`` (one process, whole
    tensors).

    The folder is built hidden next to ``out`` and renamed into place, so a failure leaves no half DCP folder.
    ``progress``: a bar over the bytes read (verified) from ``src``; ``dcp.save`` then writes them.
    """
    import torch.distributed.checkpoint as dcp
    from tqdm.auto import tqdm

    from shardsafe.api.source import CheckpointSource
    from shardsafe.protocol.commit import open_checkpoint, prepare

    final = Path(out).absolute()
    source = CheckpointSource(src, key="")
    try:
        if final in (source.folder, source.model_folder):
            raise ShardsafeError(f"{final}: the output folder must not be the source")
        manifest, tree = open_checkpoint(source.folder)
        total = sum(numel(entry.shape) * element_size(entry.dtype) for entry in manifest.tensors.values())
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="read", disable=not progress) as bar:

            def lookup(key: str) -> torch.Tensor:
                tensor = source.read(key)
                bar.update(tensor.numel() * tensor.element_size())
                return tensor

            state = {
                name: decode_value(entry.get("state"), lookup, f"{source.folder}/{manifest.state_file}")
                for name, entry in tree.items()
            }
    finally:
        source.close()
    from shardsafe.core.comm import Comm

    with prepare(Comm(None, 0, 1), final, overwrite) as temp:  # removed unless published
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(temp.path)), no_dist=True)
        temp.publish()  # DCP fsyncs its files but not the folder: publish fsyncs it, so their names are durable first
    return final
