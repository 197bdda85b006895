"""``save_pretrained``: a collective save of a (sharded) model as a Hugging Face model folder.

Every rank calls it. With ``gather_16bit=True`` the tensors of ``get_model_state_dict(model)``
are gathered one at a time (``DTensor.full_tensor()``, after casting the local shard), in the
same order on every rank, and the coordinator streams each into the weights file whose header it
wrote up front; the other ranks drop their copy. So the coordinator's extra memory is bounded by
the largest tensor, not the model. With ``gather_16bit=False`` no weights file is written at
all: the folder gets the config, a shardsafe checkpoint of the model in ``checkpoint/`` and a
note (``EXPORT.md``) saying how to export it later (:func:`shardsafe.export_hf`).

Like :func:`shardsafe.save`, the folder is built hidden next to ``out_dir`` (the coordinator
creates it), checked by the model-folder guard and renamed into place; only the coordinator
writes shared files.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardsafe.api.checkpoint import save
from shardsafe.api.source import CHECKPOINT_DIR, EXPORT_META, TensorInfo
from shardsafe.core.comm import Comm, Outcome, get_comm
from shardsafe.core.dtypes import output_dtype
from shardsafe.core.format import dtype_name, dump_json
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import DistributedError, SaveError, ShardsafeError
from shardsafe.hf.export import (
    DEFAULT_MAX_SHARD_SIZE,
    SafetensorsStreamWriter,
    ShardPlan,
    plan_shards,
    write_index,
)
from shardsafe.hf.guard import check_model_folder
from shardsafe.protocol.commit import prepare
from shardsafe.state.adapters import unwrap_module
from shardsafe.storage.local import write_small_file

__all__ = ["NOTE_FILE", "save_pretrained", "save_pretrained_sharded", "save_pretrained_stream", "tied_aliases"]

NOTE_FILE = "EXPORT.md"
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def save_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    gather_16bit: bool = True,
    dtype: torch.dtype | None = torch.bfloat16,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    push_to: str | None = None,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    fsync: bool = True,
    progress: bool = False,
) -> Path:
    """Save ``model`` (plain, DDP or FSDP2) as a Hugging Face model folder at ``out_dir``. Collective.

    ``gather_16bit=True``: ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors`` +
    ``model.safetensors.index.json``, split by ``max_shard_size``) holding the whole model, with
    floating-point tensors cast to ``dtype`` (None keeps them), tied weights written once as
    transformers does, non-persistent buffers skipped; plus ``config.json`` and
    ``generation_config.json`` when the model has a transformers config.
    ``gather_16bit=False``: no weights file; the config, ``checkpoint/`` (a shardsafe checkpoint
    of the model, full precision, any world size can load or export it) and ``EXPORT.md``.
    ``push_to`` (a Hub repo or object-store URL) then uploads the folder with
    :func:`shardsafe.push` (which runs the guard again on the published folder). The folder is
    checked by the model-folder guard (:func:`~shardsafe.hf.guard.check_model_folder`: real
    tensors that fit the architecture in its config.json) before it is published. Raises
    :class:`~shardsafe.errors.CheckpointExistsError` when
    ``out_dir`` is a non-empty folder and ``overwrite`` is False; on any failure nothing is
    published and every rank raises the same error. Returns ``out_dir``.

    Args:
        model: the model (plain, DDP-wrapped or FSDP2-sharded) every rank holds its part of.
        out_dir: the model folder to create.
        gather_16bit: write the whole model's weights (above); False writes a sharded checkpoint.
        dtype: the floating-point dtype of the weights file (default ``torch.bfloat16``; None: as the
            parameters are); with ``gather_16bit=False``, the dtype ``export_hf`` writes by default.
        max_shard_size: split the weights into files of at most this size (``"5GB"`` or bytes; default ``"5GB"``).
        push_to, revision, private, commit_message: upload the folder after publishing (see
            :func:`shardsafe.push`).
        process_group: the ranks that hold the model (default: the default group, or this process alone).
        overwrite: replace a non-empty ``out_dir`` (default False).
        fsync: make the folder durable before it is renamed into place (default True).
        progress: a bytes progress bar on the coordinator (default False).

    Returns:
        ``out_dir`` as an absolute :class:`~pathlib.Path`.

    Raises:
        CheckpointExistsError: ``out_dir`` is a non-empty folder and ``overwrite`` is False.
        ModelFolderError: the guard refuses the folder (empty, dummy or incomplete weights).
        PushError: the upload failed (the local folder stays published).
        SaveError: a rank failed; nothing is published.
    """
    comm = get_comm(process_group)
    final = Path(out_dir).absolute()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    module = unwrap_module(model)
    state: dict[str, Any] = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    aliases = tied_aliases(module, list(state))
    infos = [
        TensorInfo(name, output_dtype(t.dtype, dtype), tuple(t.shape))
        for name, t in state.items()
        if name not in aliases
    ]
    plan = plan_shards(infos, max_shard_size, where=f"save_pretrained {final}")
    _check_same_plan(comm, plan, aliases)
    total_parameters = sum(p.numel() for p in module.parameters())

    def write(tmp: Path) -> None:
        if gather_16bit:
            _gather_and_write(comm, tmp, state, plan, fsync, progress)
        else:
            _save_checkpoint_dir(tmp, model, _export_meta(dtype, aliases, total_parameters), process_group, fsync)

    def complete(tmp: Path) -> None:
        _write_config(module, tmp, dtype, fsync)
        if gather_16bit:
            write_index(tmp, plan, total_parameters, fsync)
            check_model_folder(tmp)
        else:
            _complete_sharded(tmp, final, dtype, comm.world_size, fsync)

    _build_model_folder(comm, final, overwrite, fsync, write, complete)
    if push_to is not None:
        from shardsafe.hf.push import push  # type: ignore[import-not-found, unused-ignore]

        push(final, push_to, revision=revision, private=private, message=commit_message, process_group=process_group)
    return final


def save_pretrained_stream(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    tensors: list[TensorInfo],
    stream: Iterable[tuple[str, torch.Tensor]],
    *,
    total_parameters: int | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    process_group: Any = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> Path:
    """:func:`save_pretrained` (gathered) for a model whose whole tensors exist one at a time. Collective.

    For models :func:`save_pretrained` cannot gather itself, e.g. DeepSpeed ZeRO-3 parameters,
    which only ``deepspeed.zero.GatheredParameters`` makes whole, a module at a time. ``tensors``
    lists the name, dtype and shape of every tensor to write, in the order ``stream`` yields
    ``(name, tensor)`` (tied aliases already left out); shapes must be known up front because each
    file's header is written first. Every rank iterates ``stream`` to its end, so the collectives
    inside it stay in lock-step on all ranks; the coordinator streams each tensor into its file
    (cast to the listed dtype) and the other ranks drop theirs, so no rank holds more than one
    whole tensor (or whatever one step of ``stream`` gathers). ``module`` provides
    ``config.json`` / ``generation_config.json``; its tensors are not read. The folder is built
    hidden, checked by the model-folder guard and renamed into place, as by
    :func:`save_pretrained`. Returns ``out_dir``.
    """
    comm = get_comm(process_group)
    final = Path(out_dir).absolute()
    plan = plan_shards(tensors, max_shard_size, where=f"save_pretrained {final}")
    _check_same_plan(comm, plan, {})

    def complete(tmp: Path) -> None:
        floating = {t.dtype for t in plan.tensors if t.dtype.is_floating_point}
        _write_config(module, tmp, floating.pop() if len(floating) == 1 else None, fsync)  # None: the model's own dtype
        write_index(tmp, plan, total_parameters, fsync)
        check_model_folder(tmp)

    _build_model_folder(
        comm, final, overwrite, fsync, lambda tmp: _write_stream(comm, tmp, plan, iter(stream), fsync), complete
    )
    return final


def _write_stream(
    comm: Comm,
    tmp: Path,
    plan: ShardPlan,
    stream: Iterator[tuple[str, torch.Tensor | None]],
    fsync: bool,
    bar: Any = None,
) -> None:
    """Every rank consumes ``stream`` in plan order; the coordinator writes each tensor into its file."""
    for file, infos in plan.files:
        failure: Outcome[None] = Outcome()  # the coordinator's first failed write of this file, if any
        writer = None
        if comm.is_coordinator:
            try:
                writer = SafetensorsStreamWriter(tmp / file, infos, write_behind=fsync)
            except Exception as exc:
                failure = _file_failure(tmp / file, exc, comm.rank)
        try:
            for info in infos:
                name, value = next(stream, (None, None))
                if name != info.name or (value is None and writer is not None):
                    # the same on every rank (each iterates the same model), so raising here splits no one
                    raise ShardsafeError(
                        f"save_pretrained_stream: expected tensor {info.name!r} next, the stream gave {name!r}"
                    )
                if writer is not None and value is not None and failure.ok:
                    try:
                        with torch.no_grad():
                            writer.write(value.detach().to(info.dtype))
                    except Exception as exc:
                        failure = _file_failure(tmp / file, exc, comm.rank)
                del value
                if bar is not None:
                    bar.update(info.nbytes)
            if writer is not None and failure.ok:
                try:
                    writer.close(fsync)
                except Exception as exc:
                    failure = _file_failure(tmp / file, exc, comm.rank)
        finally:
            if writer is not None:
                writer.abort()
        failure = comm.broadcast(failure)  # stop every rank at the first failed file
        if not failure.ok:
            raise SaveError(f"save_pretrained failed, nothing was published: {failure.message}")
    extra = next(stream, None)
    if extra is not None:
        raise ShardsafeError(
            f"save_pretrained_stream: the stream gave {extra[0]!r}, which the tensor list does not have"
        )


def _file_failure(path: Path, exc: Exception, rank: int) -> Outcome[None]:
    """A failed write of the weights file ``path``, as every rank raises it (``SaveError``, naming the file)."""
    return Outcome(error=SaveError.__name__, message=f"{path}: {type(exc).__name__}: {exc}", rank=rank)


def save_pretrained_sharded(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    sharded: nn.Module,
    *,
    total_parameters: int,
    dtype: torch.dtype | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    fsync: bool = True,
) -> Path:
    """:func:`save_pretrained` with ``gather_16bit=False`` for a model shardsafe cannot describe itself. Collective.

    ``sharded`` holds the model's tensors under its state-dict names, each rank its own part
    (DTensors; whole tensors are written once): e.g. a stand-in module built from DeepSpeed ZeRO-3
    partitions. ``module`` is the real model: its config, generation config and declared tied
    weights (recorded so the export writes them once). The folder gets ``config.json``,
    ``checkpoint/`` (a shardsafe checkpoint of ``{"model": sharded}``, loadable into the real
    model on any number of ranks, exportable with ``shardsafe export``) and ``EXPORT.md``; no
    weights file. ``dtype`` is the export's default dtype (None keeps the stored ones).
    ``total_parameters`` is the model's parameter count (a partitioned model cannot count its own).
    """
    comm = get_comm(process_group)
    final = Path(out_dir).absolute()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    names = list(get_model_state_dict(sharded))
    stored = next((p.dtype for p in sharded.parameters() if p.is_floating_point()), None)
    meta = _export_meta(dtype, tied_aliases(unwrap_module(module), names), total_parameters)

    def complete(tmp: Path) -> None:
        _write_config(unwrap_module(module), tmp, dtype or stored, fsync)
        _complete_sharded(tmp, final, dtype, comm.world_size, fsync)

    _build_model_folder(
        comm,
        final,
        overwrite,
        fsync,
        lambda tmp: _save_checkpoint_dir(tmp, sharded, meta, process_group, fsync),
        complete,
    )
    return final


def _build_model_folder(
    comm: Comm,
    final: Path,
    overwrite: bool,
    fsync: bool,
    write: Callable[[Path], None],
    complete: Callable[[Path], None],
) -> None:
    """The steps every model-folder writer shares: a hidden folder next to ``final``; ``write``
    (collective) fills it, ``complete`` (coordinator) adds the small files and runs the guard; then
    it is fsynced and renamed into place. Any failure removes the hidden folder on every path (the
    coordinator's :class:`TemporaryPath` removes it; the other ranks' handles own nothing)."""
    with prepare(comm, final, overwrite, fsync) as temp:

        def finish() -> None:
            complete(temp.path)
            temp.publish()

        write(temp.path)
        # removed before the error reaches the other ranks: when they raise, nothing is left
        comm.on_coordinator(finish, default=SaveError, on_error=temp.remove)


def _export_meta(dtype: torch.dtype | None, aliases: dict[str, str], total_parameters: int) -> dict[str, Any]:
    """What ``export_hf`` needs to know about a ``gather_16bit=False`` folder's checkpoint."""
    return {
        "key": "model",
        "dtype": dtype_name(dtype) if dtype is not None else None,
        "aliases": aliases,
        "total_parameters": total_parameters,
    }


def _save_checkpoint_dir(tmp: Path, model: nn.Module, meta: dict[str, Any], process_group: Any, fsync: bool) -> None:
    save(tmp / CHECKPOINT_DIR, {"model": model}, process_group=process_group, metadata={EXPORT_META: meta}, fsync=fsync)


def _complete_sharded(tmp: Path, final: Path, dtype: torch.dtype | None, world_size: int, fsync: bool) -> None:
    """A ``gather_16bit=False`` folder's note on how to export it, then the guard over its checkpoint."""
    write_small_file(tmp / NOTE_FILE, _note(final, dtype, world_size).encode(), fsync)
    check_model_folder(tmp / CHECKPOINT_DIR)


def _check_same_plan(comm: Comm, plan: ShardPlan, aliases: dict[str, str]) -> None:
    """Every rank must gather the same tensors in the same order, or the collectives would cross."""
    digest = hash_bytes(dump_json([plan.describe(), sorted(aliases.items())]))
    digests = comm.all_gather(digest)
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise DistributedError(
            f"ranks {differ} see a different model (names, shapes or dtypes) than rank 0; every rank must pass the "
            "same model"
        )


def _gather_and_write(
    comm: Comm, tmp: Path, state: dict[str, Any], plan: ShardPlan, fsync: bool, progress: bool
) -> None:
    """All ranks gather each tensor in plan order; the coordinator streams it into its file."""
    bar = None
    if comm.is_coordinator and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, unit_divisor=1024, desc="save_pretrained")
    try:
        _write_stream(comm, tmp, plan, _gathered(comm, state, plan), fsync, bar)
    finally:
        if bar is not None:
            bar.close()


def _gathered(comm: Comm, state: dict[str, Any], plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Whole tensors in plan order (None on ranks that do not write); gathering a DTensor is a
    collective, run in the same order on every rank."""
    from torch.distributed.tensor import DTensor

    for info in plan.tensors:
        with torch.no_grad():
            value: torch.Tensor | None = state[info.name].detach().to(info.dtype)  # cast the shard first: less to send
            if isinstance(value, DTensor):
                if value.device.type != value.device_mesh.device_type:  # CPU-offloaded shards of a GPU mesh
                    value = value.to(value.device_mesh.device_type)
                value = _gather_to_coordinator(comm, value)
        yield info.name, value
        del value  # before gathering the next one: one whole tensor at a time


def _gather_to_coordinator(comm: Comm, value: Any) -> torch.Tensor | None:
    """The whole tensor on the coordinator, None elsewhere.

    An FSDP2 parameter (``Shard(0)`` on a 1-D mesh of the same ranks) is gathered to the
    coordinator alone, so the other ranks never hold more than their own shard (``full_tensor``,
    an all-gather, would give every rank the whole tensor). Each shard is padded to the
    ``torch.chunk`` size FSDP2 uses and received straight into its rows of one buffer. Any other
    layout falls back to ``full_tensor``.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh = value.device_mesh
    fsdp_layout = (
        mesh.ndim == 1 and tuple(value.placements) == (Shard(0),) and value.dim() > 0 and comm.group is not None
    )
    group = mesh.get_group() if fsdp_layout else None
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    # shard i must live on mesh position i = group rank i, and the group be the save's ranks
    if (
        not ranks
        or mesh.mesh.flatten().tolist() != ranks
        or sorted(ranks) != sorted(dist.get_process_group_ranks(comm.group))
    ):
        whole = value.full_tensor()
        return whole if comm.is_coordinator else None
    coordinator = dist.get_global_rank(comm.group, 0)
    local = value.to_local()
    rows, world = value.shape[0], len(ranks)
    per_rank = -(-rows // world)
    padded = torch.zeros((per_rank, *value.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    buffer, pieces = None, None
    if comm.is_coordinator:
        buffer = torch.empty((per_rank * world, *value.shape[1:]), dtype=local.dtype, device=local.device)
        pieces = list(buffer.split(per_rank))
    dist.gather(padded, pieces, dst=coordinator, group=group)
    return buffer[:rows] if buffer is not None else None


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def declared_tied_keys(module: nn.Module) -> list[str]:
    """The tied-weight patterns transformers models declare (``_tied_weights_keys``), prefixed by submodule."""
    out: list[str] = []
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or {}
        for key in declared.keys() if isinstance(declared, dict) else declared:
            out.append(f"{prefix}.{key}" if prefix else str(key))
    return out


def tied_aliases(module: nn.Module, names: list[str]) -> dict[str, str]:
    """{alias: kept name} for state-dict entries that are the same tensor object (tied weights).

    The one kept is the one transformers keeps (``remove_tied_weights_from_state_dict``): names
    matching a declared tied-weight key are dropped, in sorted order, while another remains. A tie
    no model declares keeps the first name in state-dict order.
    """
    wanted = {_clean_name(n): n for n in names}
    groups: dict[int, list[str]] = {}
    members = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for raw, tensor in members:
        name = wanted.get(_clean_name(raw))
        if name is not None and name not in groups.setdefault(id(tensor), []):
            groups[id(tensor)].append(name)
    patterns = declared_tied_keys(module)
    order = {n: i for i, n in enumerate(names)}
    aliases: dict[str, str] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        declared = [n for n in sorted(group) if any(re.search(p, n) for p in patterns)]
        others = sorted((n for n in group if n not in declared), key=order.__getitem__)
        keep = others[0] if others else declared[-1]
        for name in group:
            if name != keep:
                aliases[name] = keep
    return aliases


def _write_config(module: nn.Module, folder: Path, dtype: torch.dtype | None, fsync: bool) -> None:
    """config.json (with architectures and dtype, as transformers writes them) and generation_config.json."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    if dtype is None:
        first = next((p for p in module.parameters() if p.is_floating_point()), None)
        dtype = first.dtype if first is not None else None
    if dtype is not None:
        field = "dtype" if hasattr(config, "dtype") or not hasattr(config, "torch_dtype") else "torch_dtype"
        setattr(config, field, dtype_name(dtype))
    write_small_file(folder / "config.json", config.to_json_string(use_diff=True).encode(), fsync)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and hasattr(generation, "to_json_string") and (can_generate is None or can_generate()):
        write_small_file(folder / "generation_config.json", generation.to_json_string(use_diff=True).encode(), fsync)


def _note(final: Path, dtype: torch.dtype | None, world_size: int) -> str:
    cast = (
        f"in {dtype_name(dtype)} (recorded; `--dtype float32` keeps full precision)"
        if dtype is not None
        else "in the stored dtypes"
    )
    return f"""# No weights file here yet

This folder was written by `shardsafe.save_pretrained(..., gather_16bit=False)` on {world_size} rank(s).
It holds the model's config and the model itself as a sharded shardsafe checkpoint in
`{CHECKPOINT_DIR}/` (full precision), not a `model.safetensors`. To get a Hugging Face model folder,
consolidate it in one process (one tensor in memory at a time), {cast}:

```bash
shardsafe export {final} {final}-hf [--dtype bfloat16] [--max-shard-size 5GB]
```

or in Python:

```python
import shardsafe
shardsafe.export_hf("{final}", "{final}-hf")
```

To resume from it on any number of ranks: `shardsafe.load("{final}/{CHECKPOINT_DIR}", {{"model": model}})`.
"""
