"""A checkpoint folder that is also a Hugging Face model folder, with the weights written once.

``checkpoint-N/`` is one shardsafe checkpoint. Users also run ``from_pretrained("out/checkpoint-N")``,
``pipeline(...)`` and pushes on it, as on a plain Trainer's checkpoint. Rather than writing the
model a second time as ``model.safetensors``, the save writes each rank's whole model tensors into a
file of their own, ``model-RRRRR.safetensors`` next to its ``shard-RRRRR.safetensors``, named by the
model's own names (``write_checkpoint(plain_names=...)``: shardsafe reads chunks by byte range,
never by name; the manifest lists and hashes those files like the shards), and a
``model.safetensors.index.json`` maps each name to the file holding it. A model loader reads those
files and sees nothing but the weights. Both the index and the trainer files (``config.json`` ...)
are written into the save's hidden folder before the manifest, so they appear with the checkpoint in its one rename
(:class:`ModelIndexCommit`).

Which tensors: the ``model`` entry itself when every rank holds it whole (one process, DDP); else
a ``weights`` entry of whole tensors, each gathered by every rank and kept by one
(:func:`whole_weights`): the 16-bit model under ZeRO-3 with
``stage3_gather_16bit_weights_on_model_save`` (what the Trainer would write as
``model.safetensors``), the model under FSDP2 with a full state dict. Under ZeRO-3 without the
16-bit gather, or FSDP with a sharded state dict, the plain Trainer's checkpoint is no model
folder either, and no index is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardsafe.api.source import TensorInfo
from shardsafe.core.comm import Comm
from shardsafe.core.dtypes import output_dtype
from shardsafe.core.format import Manifest
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE
from shardsafe.hf.pretrained import tied_aliases
from shardsafe.protocol.commit import CommitTarget, LocalCommit
from shardsafe.storage.local import safe_child, write_small_file

__all__ = ["ModelIndexCommit", "full_state_tensors", "model_index", "whole_weights"]

log = logging.getLogger(__name__)


def model_index(manifest: Manifest, prefix: str) -> dict[str, Any] | None:
    """The ``model.safetensors.index.json`` of a checkpoint whose tensors under ``prefix`` are each stored whole in
    one of its own shard files (None if any is not, or there are none)."""
    weight_map: dict[str, str] = {}
    total = 0
    for key, entry in manifest.tensors.items():
        if not key.startswith(prefix):
            continue
        chunks = entry.chunks
        if entry.rule is not None or len(chunks) != 1:
            return None
        chunk = chunks[0]
        if chunk.checkpoint is not None or chunk.shape != entry.shape or any(chunk.offsets):
            return None
        weight_map[key[len(prefix) :]] = chunk.file
        total += chunk.end - chunk.begin
    if not weight_map:
        return None
    return {
        "metadata": {"total_size": total, "format": "shardsafe-checkpoint"},
        "weight_map": dict(sorted(weight_map.items())),
    }


class ModelIndexCommit(CommitTarget):
    """A local save's commit that first writes the model index and the trainer files into the hidden folder, so
    they are published with the checkpoint, in its one rename (every call but :meth:`plain_name` and :meth:`commit`
    is the inner target's).

    With ``single_file`` (one process: one rank holds the whole model) the model's file is named
    ``model.safetensors`` and no index is written: the folder is then laid out as the plain Trainer's
    one-process checkpoint, so scripts that open ``checkpoint-N/model.safetensors`` directly (and not
    through ``from_pretrained``) work too.
    """

    def __init__(
        self, inner: LocalCommit, prefix: str | None, files: dict[str, str], *, single_file: bool = False
    ) -> None:
        self.inner = inner
        self.prefix = prefix
        self.files = files
        self.single_file = single_file

    def shard_name(self, rank: int) -> str:
        return self.inner.shard_name(rank)

    def plain_name(self, rank: int) -> str:
        return SINGLE_FILE if self.single_file else self.inner.plain_name(rank)

    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]:
        return self.inner.write_shard(name, prefix, tensors, block_size, rank)

    def write_index(self, rank: int, data: bytes) -> str:
        return self.inner.write_index(rank, data)

    def state_name(self) -> str:
        return self.inner.state_name()

    def commit(self, state_bytes: bytes, manifest: Manifest, rank: int) -> None:
        own = {manifest.state_file, *manifest.files}
        for name, text in self.files.items():
            if name.startswith(".") or name in own or name == INDEX_FILE:
                continue  # never one of the checkpoint's own files
            write_small_file(safe_child(self.inner.tmp, name), text.encode(), self.inner.fsync)
        index = model_index(manifest, self.prefix) if self.prefix else None
        single = index is not None and set(index["weight_map"].values()) == {SINGLE_FILE}  # needs no index
        if index is not None and not single:
            data = (json.dumps(index, indent=2) + "\n").encode()
            write_small_file(self.inner.tmp / INDEX_FILE, data, self.inner.fsync)
        elif index is None and self.prefix:
            log.warning("shardsafe: the model in this checkpoint is not stored whole; no %s written", INDEX_FILE)
        self.inner.commit(state_bytes, manifest, rank)

    def abort(self) -> None:
        self.inner.abort()


def owners(infos: list[TensorInfo], world_size: int) -> dict[str, int]:
    """Which rank keeps each whole tensor: largest first, each to the least loaded rank (the same on every rank)."""
    load = [0] * world_size
    out: dict[str, int] = {}
    for info in sorted(infos, key=lambda i: (-i.nbytes, i.name)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[info.name] = rank
        load[rank] += info.nbytes
    return out


def whole_weights(
    infos: list[TensorInfo], stream: Iterator[tuple[str, torch.Tensor]], comm: Comm
) -> dict[str, torch.Tensor]:
    """This rank's share of the model as whole tensors: every rank runs ``stream`` to its end (each step may be a
    collective gather), and keeps a copy of the tensors :func:`owners` gives it, so the save writes each once and a
    rank holds about 1/world of the model."""
    mine = owners(infos, comm.world_size)
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in stream:
        if mine.get(name) == comm.rank:
            kept[name] = tensor.detach().to("cpu", copy=True)
    return kept


def full_state_tensors(
    module: nn.Module, dtype: torch.dtype | None = None
) -> tuple[list[TensorInfo], Iterator[tuple[str, torch.Tensor]]]:
    """The state dict of an FSDP2 (or other DTensor-sharded) ``module`` as whole tensors, for :func:`whole_weights`:
    the tensor list (tied aliases left out, as transformers saves) and a generator every rank must run to its end
    (``DTensor.full_tensor`` is a collective), one tensor gathered at a time."""
    from torch.distributed.tensor import DTensor

    state = module.state_dict()
    aliases = tied_aliases(module, list(state))
    names = [n for n in state if n not in aliases]
    infos = [TensorInfo(n, output_dtype(state[n].dtype, dtype), tuple(state[n].shape)) for n in names]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.to(output_dtype(full.dtype, dtype))

    return infos, stream()
