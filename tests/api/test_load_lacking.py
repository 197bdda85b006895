"""A load whose ranks' folders each hold only some of the checkpoint's shard files (``load_lacking``:
what a node's folder of the local tier is after a node is lost): what a rank needs of a file its
folder lacks is read by a rank whose folder holds it, sent to it, and verified where it lands.

A checkpoint saved by 3 ranks (an FSDP2 model and its AdamW, and a per-rank RNG state, which each
rank decodes whole from its own shard file) is copied into one folder per rank: rank 0's holds
every file, rank 1's its own shard only, rank 2's none (only the small files). Rank 2's
parameters, optimizer state and RNG state then come from rank 0, a rank that needs nothing of
that file; with small chunks packed into one message, and with chunks received straight into
the optimizer state the load makes (and held whole for the live parameters). Every tensor and RNG
state equals the saved one, rank 2 receives its tensors' bytes and rank 0 receives nothing. A flipped
byte in each tensor (or in the RNG state) of the only copy of a file another rank needs fails the
load on every rank with the IntegrityError of the rank that received it, naming that copy, the
parameters untouched and the optimizer as stateless as before; a file no folder holds fails it
naming that file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import DIMS, launch, make_model, make_optimizer, run_ranks, shard
from shardsafe.api.load import load_lacking
from shardsafe.errors import ShardsafeError


def _trained(seed: int, train: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model over the 3 ranks and its AdamW, after one step (``train``) or with no state yet."""
    model = shard(make_model(seed), 3)
    optimizer = make_optimizer(model)
    if train:
        torch.manual_seed(seed)
        model(torch.randn(4, DIMS[0])).sum().backward()
        optimizer.step()
    return model, optimizer


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state, as local tensors."""
    out = {f"param {n}": p.to_local().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        for k, v in state.items():
            out[f"optim {i} {k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


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


def restore_job(rank: int, world_size: int, path: str, direct_bytes: int | None) -> dict[str, Any]:
    from shardsafe.protocol import shared_read

    if direct_bytes is not None:  # chunks this large are received straight into their tensors (or held whole)
        shared_read.DIRECT_BYTES = direct_bytes
    model, optimizer = _trained(1, train=True)
    torch.manual_seed(100 + rank)  # each rank's generator differs: its own RNG state must come back
    shardsafe.save(path, {"model": model, "optim": optimizer, "rng": shardsafe.RNGState()})
    after_save = torch.rand(4)
    mine = _folders(path, rank, HELD)
    fresh_model, fresh_optimizer = _trained(2, train=False)  # the optimizer's state is made by the load
    torch.manual_seed(999)
    state = {"model": fresh_model, "optim": fresh_optimizer, "rng": shardsafe.RNGState()}
    loaded = load_lacking(mine, state, frozenset(SHARDS) - HELD[rank])
    expected, got = _tensors(model, optimizer), _tensors(fresh_model, fresh_optimizer)
    return {
        "equal": sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected),
        "rng": torch.equal(torch.rand(4), after_save),
        "received": loaded.received_bytes,
        "own bytes": sum(t.numel() * t.element_size() for t in expected.values()),
        "keys": len(expected),
    }


@pytest.mark.parametrize("direct_bytes", [None, 256], ids=["small chunks in one message", "chunks straight into place"])
def test_each_rank_gets_what_its_folder_lacks_from_a_rank_that_holds_it(
    tmp_path: Path, direct_bytes: int | None
) -> None:
    results = run_ranks(restore_job, 3, str(tmp_path / "ck"), direct_bytes, work_dir=tmp_path)
    for rank, got in enumerate(results):
        assert got["equal"] and got["rng"] and got["keys"] > 10, (rank, got)
    assert results[0]["received"] == 0  # its folder holds every file
    # rank 1's folder holds its own rows; the optimizer's step scalars it reads are saved in rank 0's file
    assert 0 < results[1]["received"] < 1024
    # rank 2's parameters and optimizer state (through rank 0, which needs nothing of its file) and its RNG state,
    # and no more than a little padding besides
    assert results[2]["own bytes"] < results[2]["received"] < results[2]["own bytes"] + (64 << 10)


def failing_job(rank: int, world_size: int, path: str, how: str, direct_bytes: int | None = None) -> str:
    from shardsafe.protocol import shared_read

    if direct_bytes is not None:
        shared_read.DIRECT_BYTES = direct_bytes
    model, optimizer = _trained(1, train=True)
    shardsafe.save(path, {"model": model, "optim": optimizer, "rng": shardsafe.RNGState()})
    held = dict(HELD)
    if how == "nobody holds it":
        held = {0: set(SHARDS) - {SHARDS[2]}, 1: {SHARDS[1]}, 2: set()}
    mine = _folders(path, rank, held)
    if how.startswith("damaged") and rank == 0:  # the only copy of rank 2's file
        data = bytearray((mine / SHARDS[2]).read_bytes())
        # a byte of each tensor's (sent in the load's first pass), or its last (the RNG state, decoded whole first)
        header = 8 + int.from_bytes(data[:8], "little")
        for at in range(header + 10, len(data) - 64, 64) if how == "damaged tensors" else [-10]:
            data[at] ^= 0xFF
        (mine / SHARDS[2]).write_bytes(bytes(data))
    import torch.distributed as dist

    dist.barrier()
    fresh_model, fresh_optimizer = _trained(2, train=False)
    before = _tensors(fresh_model, fresh_optimizer)
    try:
        load_lacking(
            mine,
            {"model": fresh_model, "optim": fresh_optimizer, "rng": shardsafe.RNGState()},
            frozenset(SHARDS) - held[rank],
        )
        return "loaded"
    except ShardsafeError as exc:
        after = _tensors(fresh_model, fresh_optimizer)  # the optimizer's state the load made is dropped again
        untouched = sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)
        return f"{type(exc).__name__}|{untouched}|{exc}"


@pytest.mark.parametrize("direct_bytes", [None, 256], ids=["one message", "straight into place"])
@pytest.mark.parametrize("how", ["damaged tensors", "damaged RNG state"])
def test_a_damaged_only_copy_fails_every_rank_with_the_tensors_untouched(
    tmp_path: Path, how: str, direct_bytes: int | None
) -> None:
    result = launch(failing_job, 3, str(tmp_path / "ck"), how, direct_bytes, work_dir=tmp_path, timeout=120)
    assert result.ok, result.describe()
    for outcome in result.results:
        kind, untouched, message = outcome.split("|", 2)
        assert (kind, untouched) == ("IntegrityError", "True"), result.results
        # verified where it is received (rank 2), naming the copy rank 0 read
        assert f"{SHARDS[2]} as rank 0 read it" in message and "hash mismatch" in message, message


def test_a_file_no_folder_holds_fails_naming_it(tmp_path: Path) -> None:
    result = launch(failing_job, 3, str(tmp_path / "ck"), "nobody holds it", work_dir=tmp_path, timeout=120)
    assert result.ok, result.describe()
    assert any(SHARDS[2] in outcome for outcome in result.results), result.results
    for outcome in result.results:
        assert outcome != "loaded" and outcome.split("|")[1] == "True", result.results
