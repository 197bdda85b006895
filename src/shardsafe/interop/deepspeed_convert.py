"""A DeepSpeed ZeRO checkpoint rewritten as a shardsafe checkpoint: what to write (the plan) and writing it in one
process.

:func:`convert_deepspeed` reads through :class:`~shardsafe.interop.deepspeed_reader.DeepSpeedCheckpoint`
(restricted, memory-safe loading; one tensor in memory at a time) and writes either a module + torch
optimizer layout, which ``shardsafe.load({"model": model, "optim": AdamW(...)})`` restores on any world
size, or with ``for_engine=True`` the layout of :mod:`shardsafe.state.deepspeed_engine`, which
``shardsafe.load({"engine": engine})`` restores into a fresh ZeRO-3 engine on any world size. The
shard is committed like :func:`shardsafe.save` commits (temporary folder, manifest last, atomic publish).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardsafe._version import __version__
from shardsafe.api.source import DTYPE_CHOICES
from shardsafe.core.comm import Comm, Outcome
from shardsafe.core.dtypes import output_dtype
from shardsafe.core.format import (
    ChunkEntry,
    FileEntry,
    HeaderEntry,
    TensorEntry,
    build_safetensors_header,
    dump_json,
    numel,
)
from shardsafe.core.integrity import HASH_BLOCK_SIZE
from shardsafe.core.values import TENSOR_REF, encode_value
from shardsafe.errors import FormatError, ShardsafeError
from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint
from shardsafe.protocol.commit import agree_and_publish, new_manifest, prepare_save
from shardsafe.state.deepspeed_engine import KIND_DEEPSPEED_ENGINE, SECTIONS, engine_meta, tensor_key

__all__ = ["Planned", "convert_deepspeed", "write_planned"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Planned:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


class _Produced:
    """The planned tensors, each computed only when the file writer reaches it."""

    def __init__(self, planned: list[Planned], progress: Any) -> None:
        self.planned, self.progress = planned, progress

    def __len__(self) -> int:
        return len(self.planned)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for item in self.planned:
            tensor = item.produce()
            if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
                raise ShardsafeError(
                    f"{item.key}: produced {tensor.dtype} {list(tensor.shape)}, planned {item.dtype} {list(item.shape)}"
                )
            yield tensor.contiguous()
            if self.progress is not None:
                self.progress.update(tensor.numel() * tensor.element_size())
            del tensor


def convert_deepspeed(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | str | None = torch.float32,
    model_key: str = "model",
    optim_key: str = "optim",
    overwrite: bool = False,
    fsync: bool = True,
    progress: bool = False,
    for_engine: bool = False,
    engine_key: str = "engine",
) -> Path:
    """Turn a DeepSpeed ZeRO checkpoint into a shardsafe checkpoint at ``out``, in this process.

    Written: ``model/<name>`` for every entry of the model's state dict (fp32 master weights of
    trained parameters, frozen parameters and buffers cast to ``dtype`` when floating, None keeps
    DeepSpeed's dtypes; tied aliases as copies), ``optim/state/<param name>/<key>`` (``exp_avg``,
    ``exp_avg_sq``, ``step`` as a 0-dim float32 tensor, ...) and the param groups with parameter
    names, keyed exactly as :func:`shardsafe.save` keys a module and a torch optimizer, plus
    ``step`` (DeepSpeed's global step) and, when DeepSpeed saved one, ``sched`` (the LR scheduler's
    state). So ``shardsafe.load(out, {"model": model, "optim": AdamW(groups)})`` resumes on any
    world size (plain, DDP or FSDP2) when ``groups`` hold the same parameters in the same order as
    the DeepSpeed run's. One tensor is in memory at a time. Returns ``out``.

    ``for_engine=True`` writes instead what ``shardsafe.save({engine_key: engine})`` writes for a live
    ZeRO-3 engine (see :mod:`shardsafe.state.deepspeed_engine`; ``dtype`` does not apply), so that
    ``shardsafe.load(out, {"engine": engine})`` resumes in a fresh ZeRO-3 engine of the same model on any
    number of ranks, which ``engine.load_checkpoint`` refuses; ``step`` and ``sched`` as above.
    """
    from shardsafe.api.checkpoint import location

    if isinstance(dtype, str):
        dtype = None if dtype in ("keep", "none") else DTYPE_CHOICES[dtype]
    final = location(out)
    with DeepSpeedCheckpoint(src, tag) as ckpt:
        if isinstance(final, Path) and final in (ckpt.model_folder, ckpt.folder):
            raise ShardsafeError(f"{final}: the output folder must not be the source")
        if for_engine:
            planned, tree = _plan_engine(ckpt, engine_key)
        else:
            planned, tree = _plan_module(ckpt, dtype, model_key, optim_key)
        info = ckpt.describe()
        if isinstance(info["global_steps"], int):
            tree["step"] = {"kind": "value", "state": info["global_steps"]}
        scheduler = ckpt.lr_scheduler_state()
        if scheduler is not None:
            try:
                tree["sched"] = {"kind": "stateful", "state": encode_value(scheduler, "sched", _no_tensors)}
            except ShardsafeError as exc:
                log.warning("the LR scheduler state is not stored (%s)", exc)
        planned.sort(key=lambda p: p.key)  # the manifest lists tensors by key; files follow the same order
        write_planned(
            final, planned, tree, {"converted_from": info}, overwrite=overwrite, fsync=fsync, progress=progress
        )
    return Path(final) if isinstance(final, Path) else Path(str(out))


def _plan_module(
    ckpt: DeepSpeedCheckpoint, dtype: torch.dtype | None, model_key: str, optim_key: str
) -> tuple[list[Planned], dict[str, Any]]:
    """The tensors and state entries of a module + torch optimizer (``convert_deepspeed`` without ``for_engine``)."""
    planned: list[Planned] = []

    def ref(path: str, tensor: torch.Tensor) -> str:
        return path

    model_tree: dict[str, Any] = {}
    for name in [*ckpt.names(), *ckpt.aliases]:
        stored = ckpt.dtype(name)
        target = output_dtype(stored, dtype)
        planned.append(
            Planned(f"{model_key}/{name}", target, ckpt.shape(name), functools.partial(_read_as, ckpt, name, target))
        )
        model_tree[name] = torch.empty(0)
    order = {name: i for i, name in enumerate(ckpt.state_dict_order())}
    model_tree = dict(sorted(model_tree.items(), key=lambda kv: order.get(kv[0], len(order))))

    optim_tree: dict[str, Any] = {"state": {}, "param_groups": ckpt.param_groups()}
    for name in ckpt.trainable:
        entries: dict[str, Any] = {}
        for key, (state_dtype, shape) in ckpt.optimizer_state_spec(name).items():
            planned.append(
                Planned(
                    f"{optim_key}/state/{name}/{key}",
                    state_dtype,
                    shape,
                    functools.partial(ckpt.optimizer_state, name, key),
                )
            )
            entries[key] = torch.empty(0)
        if entries:
            optim_tree["state"][name] = entries
    return planned, {
        model_key: {"kind": "module", "state": encode_value(model_tree, model_key, ref)},
        optim_key: {"kind": "optimizer", "state": encode_value(optim_tree, optim_key, ref)},
    }


def _plan_engine(ckpt: DeepSpeedCheckpoint, name: str) -> tuple[list[Planned], dict[str, Any]]:
    """The tensors and state entry a live ZeRO-3 engine's ``shardsafe.save`` would write, from the checkpoint.

    Each tensor is the whole 1-D parameter (one chunk), so any world size reads its partition from it;
    the meta comes from :func:`~shardsafe.state.deepspeed_engine.engine_meta`, the live save's own builder.
    Sub-groups and their step counts are the DeepSpeed run's (the load re-cuts them at its world size).
    """
    planned: list[Planned] = []
    state: dict[str, Any] = {section: {} for section in SECTIONS}

    def plan(
        section: str, pname: str, dtype: torch.dtype, produce: Callable[[], torch.Tensor], sub: str | None = None
    ) -> None:
        key = tensor_key(name, section, *([sub] if sub else []), pname)
        shape = ckpt.shape(pname) if section == "buffers" else (numel(ckpt.shape(pname)),)
        planned.append(Planned(key, dtype, shape, produce))
        node = state[section].setdefault(sub, {}) if sub else state[section]
        node[pname] = {TENSOR_REF: key}

    groups = ckpt.param_groups()
    group_of = {pname: g for g, group in enumerate(groups) for pname in group["params"]}
    params: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {}
    scalars: list[tuple[list[str], dict[str, Any]]] = []
    for names, flat_scalars, elementwise in ckpt.flat_groups():
        for pname in names:
            plan("fp32", pname, ckpt.dtype(pname), functools.partial(_read_flat, ckpt.read, pname))
            params[pname] = (ckpt.shape(pname), ckpt.stored_dtype(pname), group_of[pname])
            spec = ckpt.optimizer_state_spec(pname)
            for key in elementwise:
                plan(
                    "optim",
                    pname,
                    spec[key][0],
                    functools.partial(_read_flat, functools.partial(ckpt.optimizer_state, key=key), pname),
                    key,
                )
        if flat_scalars:
            scalars.append((names, flat_scalars))
    for pname in ckpt.names():
        if pname in group_of:
            continue
        if pname in ckpt.buffers:
            dtype = ckpt.stored_dtype(pname)
            plan("buffers", pname, dtype, functools.partial(_read_as, ckpt, pname, dtype))
        else:  # frozen: as stored (the 16-bit partitions a ZeRO-3 engine keeps)
            plan("frozen", pname, ckpt.dtype(pname), functools.partial(_read_flat, ckpt.read, pname))
            params[pname] = (ckpt.shape(pname), ckpt.dtype(pname), None)
    scaling = ckpt.loss_scaling()
    info = ckpt.describe()
    meta = engine_meta(
        name,
        world_size=ckpt.world_size,
        deepspeed_version=ckpt.ds_version,
        params=params,
        aliases={a: s for a, s in ckpt.aliases.items() if s in params},
        param_groups=[(group.pop("params"), group) for group in groups],
        optimizer_scalars=scalars,
        loss_scaler=scaling.scaler,
        dynamic_loss_scale=scaling.dynamic,
        overflow=scaling.overflow,
        counters={c: info[c] for c in ("global_steps", "global_samples", "skipped_steps") if isinstance(info[c], int)},
    )
    return planned, {name: {"kind": KIND_DEEPSPEED_ENGINE, "state": state, "meta": meta}}


def _read_flat(read: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    return read(name).reshape(-1)


def _read_as(ckpt: DeepSpeedCheckpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    return ckpt.read(name).to(dtype)


def _no_tensors(path: str, tensor: torch.Tensor) -> str:
    raise FormatError(f"{path}: holds a tensor")


def write_planned(
    final: Any,
    planned: list[Planned],
    tree: dict[str, Any],
    metadata: dict[str, Any],
    *,
    overwrite: bool,
    fsync: bool,
    progress: bool,
) -> None:
    """Stream ``planned`` into one shard file and commit it like :func:`shardsafe.save` (temp folder, manifest last,
    atomic publish)."""
    comm = Comm(None, 0, 1)
    target = prepare_save(comm, final, overwrite, fsync)
    try:
        name = target.shard_name(0)
        prefix, ranges = build_safetensors_header([HeaderEntry(p.key, p.dtype, p.shape) for p in planned])
        from tqdm.auto import tqdm

        total = sum(numel(p.shape) * p.dtype.itemsize for p in planned)
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress
        ) as bar:
            size, digests = target.write_shard(name, prefix, _Produced(planned, bar), HASH_BLOCK_SIZE, 0)
    except BaseException:
        target.abort()
        raise
    state_bytes = dump_json(tree)

    def build(results: list[Any]) -> tuple[Any, bytes]:
        tensors = {
            p.key: TensorEntry(
                p.dtype, p.shape, (ChunkEntry((0,) * len(p.shape), p.shape, name, begin, end, tuple(d)),)
            )
            for p, (begin, end), d in zip(planned, ranges, digests)
        }
        files = {name: FileEntry(size, 0)}
        return new_manifest(
            1, files, state_bytes, metadata, __version__, tensors=tensors, state_file=target.state_name()
        ), state_bytes

    agree_and_publish(comm, target, Outcome(), build)
