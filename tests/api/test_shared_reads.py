"""Bytes several ranks need are read from storage once per job (protocol/shared_read.py).

An HSDP checkpoint (mesh ``(replicate=2, shard=2)``) restored on the same 4 ranks: with sharing,
the bytes the ranks read from the shard files (counted at the ``os.preadv`` system call every
local read goes through, page cache or not: what ranks on separate nodes would each fetch from
storage; ``/proc/self/io`` cannot tell files from gloo's sockets) add up to the checkpoint's
shard bytes once; with ``share_reads=False``, to twice that (one read per replica, what DCP
does). The default shares when the ranks span nodes: the 4 ranks as 2 nodes (``SHARDSAFE_NODE``,
replicas on different nodes) read 1x; as one node (local files, one page cache) each replica
reads its own, 2x. Every parameter equals the saved one every way. A chunk damaged on disk is refused on
every rank (atomic and not), with nothing left waiting, and an atomic load leaves the tensors as
they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import shardsafe
from dist_utils import launch, run_ranks
from shardsafe.errors import ShardsafeError

ROWS, COLS = 512, 256  # 512 KiB per tensor: the metadata a load reads is noise beside it


def _state(seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    return {f"w{i}": distribute_tensor(torch.randn(ROWS, COLS), mesh, [Replicate(), Shard(0)]) for i in range(4)}


class FileReads:
    """Tensor bytes ``os.preadv`` returns from the shard files of ``folder`` while counting (the
    call itself runs; bytes before a file's data, its safetensors header, are metadata and not counted)."""

    def __init__(self, folder: str) -> None:
        import os

        self.folder, self.bytes, self._real = str(Path(folder).resolve()), 0, os.preadv
        data_start: dict[str, int] = {}

        def counted(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            got = self._real(fd, buffers, offset, *flags)
            name = os.path.realpath(f"/proc/self/fd/{fd}")
            if name.startswith(self.folder) and name.endswith(".safetensors"):
                if name not in data_start:
                    with open(name, "rb") as f:
                        data_start[name] = 8 + int.from_bytes(f.read(8), "little")
                self.bytes += max(0, offset + got - max(offset, data_start[name]))
            return got

        os.preadv = counted

    def close(self) -> None:
        import os

        os.preadv = self._real


WAYS: dict[str, tuple[bool | None, str | None]] = {  # name: (share_reads, SHARDSAFE_NODE of rank r, "{half}" = r // 2)
    "True": (True, None),
    "False": (False, None),
    "default, one node": (None, "same"),
    "default, two nodes": (None, "node-{half}"),  # ranks 0, 1 (one replica) and 2, 3 (the other): HSDP across nodes
}


def restore_job(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Save, then restore twice each way (the first of each a warm-up: imports and first-use reads)."""
    import os

    saved = _state(seed=1)
    shardsafe.save(path, saved)
    out: dict[str, Any] = {}
    for way, (share, node) in WAYS.items():
        if node is not None:
            os.environ["SHARDSAFE_NODE"] = node.format(half=rank // 2)
        for _ in range(2):
            fresh = _state(seed=2)
            counter = FileReads(path)
            try:
                shardsafe.load(path, fresh, atomic=False, share_reads=share)
            finally:
                counter.close()
        out[f"read {way}"] = counter.bytes
        out[f"equal {way}"] = all(torch.equal(fresh[k].to_local(), saved[k].to_local()) for k in saved)
    return out


def test_hsdp_restore_reads_each_byte_once(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    results = run_ranks(restore_job, 4, str(path), work_dir=tmp_path)
    shard_bytes = 0  # tensor bytes of the shard files: each file's size past its safetensors header
    for shard in path.glob("shard-*.safetensors"):
        with shard.open("rb") as f:
            shard_bytes += shard.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    # 1: once per job; 2: per replica
    expected = {"True": 1.0, "False": 2.0, "default, one node": 2.0, "default, two nodes": 1.0}
    for way in WAYS:
        assert all(r[f"equal {way}"] for r in results)
        assert sum(r[f"read {way}"] for r in results) / shard_bytes == expected[way], (way, results)


def damaged_job(rank: int, world_size: int, path: str) -> list[str]:
    import torch.distributed as dist

    saved = _state(seed=1)
    shardsafe.save(path, saved)
    if rank == 0:
        shard = sorted(Path(path).glob("shard-*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-100] ^= 0xFF  # a byte of the last chunk of that file
        shard.write_bytes(bytes(data))
    dist.barrier()
    outcomes = []
    for atomic in (True, False):
        fresh = _state(seed=2)
        before = {k: v.to_local().clone() for k, v in fresh.items()}
        try:
            shardsafe.load(path, fresh, atomic=atomic, share_reads=True)
            outcomes.append("loaded")
        except ShardsafeError as exc:
            untouched = all(torch.equal(before[k], fresh[k].to_local()) for k in fresh)
            outcomes.append(f"{type(exc).__name__}|{untouched}")
    return outcomes


def test_a_damaged_shared_chunk_fails_on_every_rank(tmp_path: Path) -> None:
    result = launch(damaged_job, 4, str(tmp_path / "ck"), work_dir=tmp_path, timeout=120)
    assert result.ok, result.describe()
    for atomic_outcome, plain_outcome in result.results:
        # the reader's own error on every rank (not a stand-in PeerFailedError)
        assert atomic_outcome.startswith("IntegrityError|") and plain_outcome.startswith("IntegrityError|"), (
            result.results
        )
        assert atomic_outcome.endswith("|True"), result.results  # verified before anything is written


def _not_gloo_group(world_size: int) -> Any:
    """A group whose backend is not called gloo (as NCCL's is not), with its ranks in reverse order
    (group rank r is global rank world_size - 1 - r). Underneath it is gloo, so this CPU machine can
    run it: a stand-in for a backend that does not send CPU tensors, known to shardsafe only by name."""
    import torch.distributed as dist

    if getattr(dist.Backend, "NOTGLOO", None) is None:
        dist.Backend.register_backend(
            "notgloo",
            lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
            devices=["cpu"],
        )
    return dist.new_group(ranks=list(range(world_size))[::-1], backend="notgloo", sort_ranks=False)


def side_group_job(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """HSDP restore over a group that is not gloo (its ranks reversed): the shared bytes go over a gloo side
    group of the same processes, made once, addressed by global rank."""
    import torch.distributed as dist

    from shardsafe.core.comm import cpu_transport, get_comm, global_ranks, gloo_side

    group = _not_gloo_group(world_size)
    saved = _state(seed=1)
    shardsafe.save(path, saved, process_group=group)
    out: dict[str, Any] = {}
    for attempt in range(2):
        fresh = _state(seed=2)
        counter = FileReads(path)
        try:
            shardsafe.load(path, fresh, atomic=attempt == 1, share_reads=True, process_group=group)
        finally:
            counter.close()
        out[f"read {attempt}"] = counter.bytes
        out[f"equal {attempt}"] = all(torch.equal(fresh[k].to_local(), saved[k].to_local()) for k in saved)
    comm = get_comm(group)
    side = cpu_transport(comm)
    out["backend"] = str(dist.get_backend(group))
    out["side backend"] = str(dist.get_backend(side))
    # the same processes (the side group numbers them by global rank; the exchange addresses them so)
    out["same numbering"] = (
        sorted(dist.get_process_group_ranks(side)) == sorted(global_ranks(comm)) == list(range(world_size))
        and global_ranks(comm) == list(range(world_size))[::-1]
        and comm.rank == world_size - 1 - rank
    )
    mixed = get_comm(dist.new_group(backend="cpu:gloo"))  # CPU tensors on gloo (as "cpu:gloo,cuda:nccl"): used as is
    out["made once"] = side is gloo_side(comm) and cpu_transport(get_comm()) is get_comm().group  # the world: gloo
    out["mixed as is"] = str(dist.get_backend(mixed.group)) == "cpu:gloo" and cpu_transport(mixed) is mixed.group
    return out


def test_shared_reads_over_a_group_that_does_not_send_cpu_tensors(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    results = run_ranks(side_group_job, 4, str(path), work_dir=tmp_path)
    shard_bytes = sum(
        shard.stat().st_size - 8 - int.from_bytes(shard.open("rb").read(8), "little")
        for shard in path.glob("shard-*.safetensors")
    )
    for r in results:
        assert (r["backend"], r["side backend"], r["same numbering"]) == ("notgloo", "gloo", True)
        assert r["made once"] and r["mixed as is"], r
    # atomic=False: each byte read once per job; atomic: once to check, once into place (per replica: 2x and 4x)
    for attempt, expected in ((0, 1.0), (1, 2.0)):
        assert all(r[f"equal {attempt}"] for r in results), results
        assert sum(r[f"read {attempt}"] for r in results) / shard_bytes == expected, (attempt, results)
