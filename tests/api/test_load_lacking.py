"""A load whose ranks' folders each hold only some of the checkpoint's shard files (``load_lacking``:
what a node's folder of the local tier is after a node is lost): what a rank needs of a file its
folder lacks is read, verified, by a rank whose folder holds it and sent to it.

A checkpoint saved by 3 ranks (a 1-D mesh, ``Shard(0)``, with a per-rank RNG state, which each rank
decodes whole from its own shard file) is copied into one folder per rank: rank 0's holds every
file, rank 1's its own shard only, rank 2's none (only the small files). Rank 2's rows and RNG
state then come from rank 0, a rank that needs nothing of that file. Every tensor and RNG state
equals the saved one, rank 2 receives its tensors' bytes and rank 0 receives nothing. A flipped
byte in the only copy of a file another rank needs fails the load on every rank with the reader's
IntegrityError naming that copy (a tensor's bytes or the RNG state's), the tensors untouched; a
file no folder holds fails it naming that file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import launch, run_ranks
from shardsafe.api.load import load_lacking
from shardsafe.errors import ShardsafeError

ROWS, COLS = 96, 64


def _state(seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(seed)
    tensors: dict[str, Any] = {f"w{i}": distribute_tensor(torch.randn(ROWS, COLS), mesh, [Shard(0)]) for i in range(3)}
    return tensors | {"rng": shardsafe.RNGState()}


SHARDS = [f"shard-{r:05d}.safetensors" for r in range(3)]
HELD = {0: set(SHARDS), 1: {SHARDS[1]}, 2: set()}  # each rank's folder: the shard files it holds


def _folders(path: str, rank: int, held: dict[int, set[str]]) -> Path:
    """Rank ``rank``'s own copy of the checkpoint at ``path``, with only the shard files ``held[rank]``."""
    import torch.distributed as dist

    mine = Path(f"{path}-rank{rank}")
    shutil.copytree(path, mine)
    for name in SHARDS:
        if name not in held[rank]:
            (mine / name).unlink()
    dist.barrier()
    return mine


def _save(path: str, rank: int) -> tuple[dict[str, Any], torch.Tensor]:
    torch.manual_seed(100 + rank)  # each rank's generator differs: its own RNG state must come back
    saved = _state(seed=1)
    shardsafe.save(path, saved)
    return saved, torch.rand(4)


def restore_job(rank: int, world_size: int, path: str) -> dict[str, Any]:
    saved, after_save = _save(path, rank)
    mine = _folders(path, rank, HELD)
    fresh = _state(seed=2)
    torch.manual_seed(999)
    loaded = load_lacking(mine, fresh, frozenset(SHARDS) - HELD[rank])
    return {
        "equal": all(torch.equal(fresh[k].to_local(), saved[k].to_local()) for k in ("w0", "w1", "w2")),
        "rng": torch.equal(torch.rand(4), after_save),
        "received": loaded.received_bytes,
        "own bytes": sum(saved[k].to_local().numel() * 4 for k in ("w0", "w1", "w2")),
    }


def test_each_rank_gets_what_its_folder_lacks_from_a_rank_that_holds_it(tmp_path: Path) -> None:
    results = run_ranks(restore_job, 3, str(tmp_path / "ck"), work_dir=tmp_path)
    for rank, got in enumerate(results):
        assert got["equal"] and got["rng"], (rank, got)
    assert results[0]["received"] == 0 and results[1]["received"] == 0  # their folders hold what they read
    # rank 2's rows (through rank 0, which needs nothing of its file) and its RNG state, and no more than
    # a little padding besides
    assert results[2]["own bytes"] < results[2]["received"] < results[2]["own bytes"] + (64 << 10)


def failing_job(rank: int, world_size: int, path: str, how: str) -> str:
    saved, _ = _save(path, rank)
    held = dict(HELD)
    if how == "nobody holds it":
        held = {0: set(SHARDS) - {SHARDS[2]}, 1: {SHARDS[1]}, 2: set()}
    mine = _folders(path, rank, held)
    if how.startswith("damaged") and rank == 0:  # the only copy of rank 2's file
        data = bytearray((mine / SHARDS[2]).read_bytes())
        # its first tensor's bytes (sent in the load's last phase), or its last (the RNG state, decoded whole first)
        at = 8 + int.from_bytes(data[:8], "little") + 10 if how == "damaged tensor" else -10
        data[at] ^= 0xFF
        (mine / SHARDS[2]).write_bytes(bytes(data))
    import torch.distributed as dist

    dist.barrier()
    fresh = _state(seed=2)
    before = {k: fresh[k].to_local().clone() for k in ("w0", "w1", "w2")}
    try:
        load_lacking(mine, fresh, frozenset(SHARDS) - held[rank])
        return "loaded"
    except ShardsafeError as exc:
        untouched = all(torch.equal(before[k], fresh[k].to_local()) for k in before)
        return f"{type(exc).__name__}|{untouched}|{exc}"


@pytest.mark.parametrize("how", ["damaged tensor", "damaged RNG state"])
def test_a_damaged_only_copy_fails_every_rank_with_the_tensors_untouched(tmp_path: Path, how: str) -> None:
    result = launch(failing_job, 3, str(tmp_path / "ck"), how, work_dir=tmp_path, timeout=120)
    assert result.ok, result.describe()
    for outcome in result.results:
        kind, untouched, message = outcome.split("|", 2)
        assert (kind, untouched) == ("IntegrityError", "True"), result.results
        assert f"ck-rank0/{SHARDS[2]}" in message and "hash mismatch" in message, message


def test_a_file_no_folder_holds_fails_naming_it(tmp_path: Path) -> None:
    result = launch(failing_job, 3, str(tmp_path / "ck"), "nobody holds it", work_dir=tmp_path, timeout=120)
    assert result.ok, result.describe()
    assert any(SHARDS[2] in outcome for outcome in result.results), result.results
    for outcome in result.results:
        assert outcome != "loaded" and outcome.split("|")[1] == "True", result.results
