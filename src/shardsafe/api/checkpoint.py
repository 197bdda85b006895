"""The collective entry points: save, load, verify."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardsafe._version import __version__
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.faults import crash_point
from shardsafe.core.format import ChunkEntry, FileEntry, Manifest, TensorEntry, dtype_from_name, dump_json
from shardsafe.core.integrity import HASH_BLOCK_SIZE, BlockHasher
from shardsafe.core.plan import ChunkSpec, LocalChunk, assign_writers, plan_reads
from shardsafe.errors import FormatError, IntegrityError, SaveError, ShardsafeError
from shardsafe.protocol.commit import agree_and_publish, new_manifest, open_checkpoint, prepare_save
from shardsafe.protocol.transfer import ChunkReader, ReuseMap, write_rank_file
from shardsafe.state.adapters import (
    KIND_DEEPSPEED_ENGINE,
    KIND_MODULE,
    KIND_OPTIMIZER,
    KIND_PER_RANK,
    KIND_TENSOR,
    LoadBinding,
    SaveView,
    bind_for_load,
    check_optimizer_groups,
    describe_for_save,
    describe_mismatch,
    owner_module,
    tensor_keys_of,
)
from shardsafe.state.deepspeed_engine import check_engine, fresh_engine_optimizers
from shardsafe.storage.local import safe_child
from shardsafe.storage.remote import RemoteDir, is_url, local_path_of


def save(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
) -> Path | RemoteDir:
    """Save ``state`` as a checkpoint folder at ``path``. Collective: every rank calls it.

    Each rank writes only its own chunks into its own file (a replicated tensor is written once,
    by one rank); the coordinator writes the JSON files and publishes the folder atomically.
    Returns the checkpoint path. Raises :class:`~shardsafe.errors.CheckpointExistsError` if a
    checkpoint is there and ``overwrite`` is False, :class:`~shardsafe.errors.SaveError` if any
    rank failed (nothing is published; earlier checkpoints are untouched).
    """
    comm = get_comm(process_group)
    if metadata is not None:
        dump_json(metadata)  # fail early, on every rank, on metadata that is not JSON
    view = describe_collectively(state, comm)
    return write_checkpoint(location(path), view, comm, overwrite=overwrite, metadata=metadata, fsync=fsync)


def describe_collectively(state: dict[str, Any], comm: Comm) -> SaveView:
    """Describe this rank's state; if any rank cannot, every rank raises (rather than some waiting forever)."""
    problem: Exception | None = None
    view = None
    try:
        view = describe_for_save(state, comm.rank)
    except Exception as exc:
        problem = exc
    comm.agree(problem)
    assert view is not None
    return view


def location(path: str | os.PathLike[str] | RemoteDir) -> Path | RemoteDir:
    """A local folder, or a prefix on an object store for fsspec URLs such as ``s3://bucket/ckpt``."""
    if isinstance(path, RemoteDir):
        return path
    if is_url(path):
        return RemoteDir(str(path))
    return Path(local_path_of(path)).absolute()


def write_checkpoint(
    final: Path | RemoteDir,
    view: SaveView,
    comm: Comm,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
    reuse: ReuseMap | None = None,
    before_publish: Callable[[], None] | None = None,
) -> Path | RemoteDir:
    """Write and commit an already described state (the part an async save runs in the background).

    ``before_publish`` runs on the coordinator right before the commit makes the checkpoint
    visible (the manager's lease fencing check); if it raises, nothing is published."""
    target = prepare_save(comm, final, overwrite, fsync)
    crash_point("save:after-prepare", comm.rank)
    specs = [c.spec() for c in view.chunks]
    try:
        assignment = _plan(comm, specs)
    except SaveError:
        if comm.is_coordinator:
            target.abort()
        raise
    mine = [view.chunks[i] for i in assignment]
    try:
        entries: list[tuple[str, ChunkEntry]] = []
        file_record = None
        if mine:
            name, size, written = write_rank_file(target, comm.rank, mine, HASH_BLOCK_SIZE, reuse)
            crash_point("save:after-write", comm.rank)
            entries = [(c.key, e) for c, e in written]
            file_record = (name, size) if name is not None else None
        result: tuple[Any, ...] = ("ok", file_record, entries, [(s.key, s.dtype, s.global_shape) for s in _specs_of(mine)], view.per_rank)
    except Exception as exc:  # every rank must still reach the agreement step
        result = ("error", f"rank {comm.rank}: {type(exc).__name__}: {exc}")

    def build(results: list[tuple[Any, ...]]) -> tuple[Manifest, bytes]:
        tree = dict(view.tree)
        per_rank_names = sorted({n for r in results for n in r[4]})
        for n in per_rank_names:
            tree[n] = {"kind": KIND_PER_RANK, "ranks": [r[4].get(n) for r in results]}
        state_bytes = dump_json(tree)
        files = {r[1][0]: FileEntry(r[1][1], rank) for rank, r in enumerate(results) if r[1] is not None}
        manifest = new_manifest(comm.world_size, files, state_bytes, metadata, __version__)
        manifest.tensors = _tensor_entries(results)
        return manifest, state_bytes

    agree_and_publish(comm, target, result, build, before_publish)
    return final


def _specs_of(chunks: list[LocalChunk]) -> list[ChunkSpec]:
    return [c.spec() for c in chunks]


def _plan(comm: Comm, specs: list[ChunkSpec]) -> list[int]:
    """Every rank's chunk specs to the coordinator, which picks one writer per chunk; each rank learns its own."""
    gathered = comm.gather(specs)
    plan = comm.on_coordinator(lambda: assign_writers(gathered or []), default=SaveError)
    return list(plan[comm.rank])


def _tensor_entries(results: list[tuple[Any, ...]]) -> dict[str, TensorEntry]:
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    chunks: dict[str, list[ChunkEntry]] = {}
    for r in results:
        for key, dtype, global_shape in r[3]:
            meta[key] = (dtype, global_shape)
        for key, entry in r[2]:
            chunks.setdefault(key, []).append(entry)
    out = {}
    for key in sorted(meta):
        dtype, shape = meta[key]
        ordered = sorted(chunks[key], key=lambda c: c.offsets)
        out[key] = TensorEntry(dtype_from_name(dtype.removeprefix("torch."), key), tuple(shape), tuple(ordered))
    return out


@dataclass
class _Loaded:
    manifest: Manifest
    tree: dict[str, Any]
    binding: LoadBinding


def load(
    path: str | os.PathLike[str] | RemoteDir,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    atomic: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``state`` in place. Collective: every rank calls it.

    Works across world sizes: each rank reads only the stored byte ranges that overlap what it
    owns, straight into its tensors. All problems (missing/unexpected keys, shape or dtype
    mismatches) are collected and raised together, on every rank, before anything is modified.
    JSON-able values are replaced in ``state``. ``verify`` checks block hashes of what is read.
    Returns the checkpoint's user metadata.

    ``atomic`` (default): a load that fails on damaged or missing stored data leaves ``state``
    exactly as it was. Every rank first checks the byte ranges it will read (files opened and
    sized; with ``verify``, each hash block touched is read into one block-sized scratch buffer
    and hashed), the ranks agree, and only then is anything written. The cost is a second read
    of this rank's share: from the page cache on a local or shared filesystem when it fits in
    free memory (the second pass reuses the open files and skips hashing); on an object store the
    first 64 MiB of verified blocks are kept in memory and the rest is downloaded again and
    re-verified. ``atomic=False`` reads once, straight into the destinations:
    faster, but a hash mismatch found midway leaves the tensors read before it overwritten.
    """
    comm = get_comm(process_group)
    folder = location(path)
    loaded: _Loaded | None = None
    problem: Exception | None = None
    # Binding gives a fresh optimizer its state (so there are tensors to read into); a load that
    # fails before reading must take that back, or the next step would differ (step count 1).
    fresh = [v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state]
    fresh += fresh_engine_optimizers(state.values())
    try:
        manifest, tree = open_checkpoint(folder)
        binding = bind_for_load(state, comm.rank, tree, _layout_of(manifest))
        problems = _compare(manifest, tree, binding, state, strict)
        if problems:
            raise describe_mismatch(problems)
        loaded = _Loaded(manifest, tree, binding)
    except Exception as exc:  # shared with every rank below, so none waits alone
        problem = exc
    _agree(comm, problem, reset=fresh)
    assert loaded is not None
    problem = None
    with ChunkReader(folder, loaded.manifest, verify) as reader:
        if atomic:  # check everything this rank will read, agree, and only then write
            try:
                _check_sources(reader, loaded, comm.rank)
            except Exception as exc:
                problem = exc
            _agree(comm, problem, reset=fresh)
            # The blocks are verified; local re-reads go through the same open files (page cache).
            reader.verify = verify and reader.remote
        try:
            _read_targets(reader, loaded)
            lookup = _lazy_lookup(reader, loaded.manifest)
            for finish in loaded.binding.finalizers:
                finish(loaded.tree, lookup)
        except Exception as exc:
            problem = exc
    _agree(comm, problem)
    return loaded.manifest.metadata


def _layout_of(manifest: Manifest) -> Any:
    def layout(key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        entry = manifest.tensors.get(key)
        return None if entry is None else (tuple(entry.shape), entry.dtype)

    return layout


def _agree(comm: Comm, problem: Exception | None, reset: Sequence[torch.optim.Optimizer] = ()) -> None:
    """:meth:`Comm.agree`, and on failure empty ``reset`` (optimizers whose state the load created),
    so a failed load leaves a fresh optimizer fresh."""
    try:
        comm.agree(problem)
    except ShardsafeError:
        for optimizer in reset:
            optimizer.state.clear()
        raise


def _compare(manifest: Manifest, tree: dict[str, Any], binding: LoadBinding, state: dict[str, Any], strict: bool) -> list[str]:
    problems: list[str] = []
    for name, kind in binding.names.items():
        if name not in tree:
            problems.append(f"{name!r}: not in the checkpoint (it holds {sorted(tree)})")
            continue
        saved_kind = tree[name].get("kind") if isinstance(tree[name], dict) else None
        if saved_kind != kind and not (kind == KIND_TENSOR and saved_kind == KIND_TENSOR):
            problems.append(f"{name!r}: saved as {saved_kind}, loading into a {kind}")
            continue
        if kind in (KIND_MODULE, KIND_OPTIMIZER, KIND_TENSOR, KIND_DEEPSPEED_ENGINE):
            saved = set(tensor_keys_of(tree[name]["state"]))
            bound = {k for k in binding.targets if k == name or k.startswith(name + "/")}
            missing, unexpected = sorted(bound - saved), sorted(saved - bound)
            if strict:
                problems += [f"missing in checkpoint: {k}" for k in missing]
                problems += [f"unexpected in checkpoint: {k}" for k in unexpected]
            for key in sorted(bound & saved):
                problems += _compare_tensor(key, manifest, binding, strict)
        if kind == KIND_OPTIMIZER:
            optimizer = state[name]
            problems += check_optimizer_groups(name, owner_module(state, optimizer, name), optimizer, tree[name]["state"])
        if kind == KIND_DEEPSPEED_ENGINE:
            problems += check_engine(name, state[name], tree[name])
    for key in (k for entry in tree.values() if isinstance(entry, dict) for k in tensor_keys_of(entry.get("state", entry.get("ranks")))):
        if key not in manifest.tensors:
            raise FormatError(f"state.json refers to tensor {key!r}, which the manifest does not list")
    return problems


def _compare_tensor(key: str, manifest: Manifest, binding: LoadBinding, strict: bool) -> list[str]:
    entry = manifest.tensors.get(key)
    target = binding.targets[key]
    if entry is None:
        return [f"{key}: referenced by state.json but not in the manifest"]
    if entry.shape != target.global_shape:
        return [f"shape mismatch for {key}: checkpoint {list(entry.shape)}, model {list(target.global_shape)}"]
    if entry.dtype != target.tensor.dtype and strict:
        return [f"dtype mismatch for {key}: checkpoint {entry.dtype}, model {target.tensor.dtype} (strict=False casts)"]
    return []


def _read_targets(reader: ChunkReader, loaded: _Loaded) -> None:
    with torch.no_grad():
        for key, target in loaded.binding.targets.items():
            entry = loaded.manifest.tensors.get(key)
            if entry is None:
                continue
            for op in plan_reads(entry, target.offsets, tuple(target.tensor.shape)):
                reader.read_into(key, op, entry.dtype, target.tensor, target.offsets)


def _check_sources(reader: ChunkReader, loaded: _Loaded, rank: int) -> None:
    """The first pass of an atomic load: everything the second pass will read, checked, nothing written."""
    for key, target in loaded.binding.targets.items():
        entry = loaded.manifest.tensors.get(key)
        if entry is None:
            continue
        for op in plan_reads(entry, target.offsets, tuple(target.tensor.shape)):
            reader.check_read(key, op, entry.dtype)
    for key in _finalizer_keys(loaded, rank):
        entry = loaded.manifest.tensors.get(key)
        if entry is None:
            raise FormatError(f"state.json refers to tensor {key!r}, which the manifest does not list")
        for op in plan_reads(entry, (0,) * len(entry.shape), entry.shape):
            reader.check_read(key, op, entry.dtype)


def _finalizer_keys(loaded: _Loaded, rank: int) -> list[str]:
    """Tensors the finalizers will look up (stateful objects, values, this rank's per-rank entry);
    decoding their trees here also surfaces a malformed state.json before anything is modified."""
    keys: list[str] = []
    for name, kind in loaded.binding.names.items():
        entry = loaded.tree[name]
        if kind == KIND_PER_RANK:
            ranks = entry.get("ranks")
            if not isinstance(ranks, list) or not ranks:
                raise FormatError(f"state.json: {name!r} has no per-rank entries")
            keys += tensor_keys_of(ranks[rank % len(ranks)])
        elif kind == KIND_OPTIMIZER:
            tensor_keys_of(entry.get("state"))  # read in place; decoded only to check it
        elif kind not in (KIND_MODULE, KIND_TENSOR, KIND_DEEPSPEED_ENGINE):  # those are read in place
            keys += tensor_keys_of(entry.get("state"))
    return keys


def _lazy_lookup(reader: ChunkReader, manifest: Manifest) -> Any:
    def lookup(key: str) -> torch.Tensor:
        entry = manifest.tensors.get(key)
        if entry is None:
            raise FormatError(f"state.json refers to tensor {key!r}, which the manifest does not list")
        return reader.read_tensor(key, entry)

    return lookup


def verify(path: str | os.PathLike[str] | RemoteDir) -> dict[str, Any]:
    """Check a checkpoint completely: manifest, state file, shard headers and every block hash.

    Raises a :class:`~shardsafe.errors.ShardsafeError` naming the file and tensor on the first
    problem; returns a summary otherwise. Reads with a single block-sized buffer.
    """
    folder = location(path)
    manifest, tree = open_checkpoint(folder)
    _check_tree(manifest, tree, str(folder.url if isinstance(folder, RemoteDir) else folder))
    _check_headers(folder, manifest)
    block = manifest.hash_block_size
    buffer = memoryview(bytearray(block))
    checked = 0
    with ChunkReader(folder, manifest, verify=True) as reader:
        for key, entry in manifest.tensors.items():
            for chunk in entry.chunks:
                where = f"{reader.path_of(chunk)} (tensor {key!r}, chunk at {list(chunk.offsets)})"
                size = chunk.end - chunk.begin
                for i, start in enumerate(range(0, max(size, 1), block)):
                    piece = buffer[: min(block, size - start)]
                    reader.read_raw(chunk, [piece], chunk.begin + start, where)
                    hasher = BlockHasher(block)
                    hasher.update(piece)
                    if hasher.finish()[0] != chunk.hashes[i]:
                        raise IntegrityError(f"{where}: hash mismatch in block {i}; the file is corrupted")
                    checked += len(piece)
    return {
        "path": folder.url if isinstance(folder, RemoteDir) else str(folder),
        "format_version": manifest.format_version,
        "world_size": manifest.world_size,
        "tensors": len(manifest.tensors),
        "files": len(manifest.files),
        "bytes_checked": checked,
        "state_entries": sorted(tree),
        "metadata": manifest.metadata,
    }


def _check_tree(manifest: Manifest, tree: dict[str, Any], where: str) -> None:
    """state.json decodes (tags well formed) and every tensor it refers to is in the manifest."""
    for name, entry in tree.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
            raise FormatError(f"{where}/state.json: entry {name!r} has no kind")
        for key in tensor_keys_of(entry.get("state", entry.get("ranks"))):
            if key not in manifest.tensors:
                raise FormatError(f"{where}/state.json: {name!r} refers to tensor {key!r}, which the manifest does not list")


def _check_headers(folder: Path | RemoteDir, manifest: Manifest) -> None:
    from shardsafe.core.format import parse_safetensors_header

    if isinstance(folder, RemoteDir):
        for name, entry in manifest.files.items():
            size = folder.size(name) if folder.exists(name) else -1
            if size != entry.size:
                raise IntegrityError(f"{folder.url}/{name}: {'missing' if size < 0 else f'{size} bytes'}, the manifest expects {entry.size}")
        return
    for name, entry in manifest.files.items():
        path = safe_child(folder, name)
        if not path.is_file():
            raise IntegrityError(f"{path}: shard file is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise IntegrityError(f"{path}: file is {size} bytes, the manifest expects {entry.size} (truncated or altered)")
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            if 8 + length > size:
                raise IntegrityError(f"{path}: safetensors header length {length} runs past the end of the file")
            head += f.read(length)
        header = parse_safetensors_header(head, size, str(path))
        _check_header_matches(manifest, name, header, str(path))


def _check_header_matches(manifest: Manifest, file: str, header: dict[str, Any], where: str) -> None:
    """Every chunk the manifest places in ``file`` has a header entry with the same range, dtype and shape
    (so a safetensors reader of the shard file sees what shardsafe loads)."""
    by_range = {(begin, end): (dtype, shape) for dtype, shape, begin, end in header.values()}
    for key, entry in manifest.tensors.items():
        for chunk in entry.chunks:
            if chunk.checkpoint is not None or chunk.file != file:
                continue
            found = by_range.get((chunk.begin, chunk.end))
            if found is None or found[0] != entry.dtype or tuple(found[1]) != chunk.shape:
                shown = "no entry" if found is None else f"{found[0]} {list(found[1])}"
                raise FormatError(
                    f"{where}: the safetensors header disagrees with the manifest for tensor {key!r} chunk at {list(chunk.offsets)} "
                    f"(bytes [{chunk.begin}, {chunk.end}): manifest {entry.dtype} {list(chunk.shape)}, header {shown})"
                )
