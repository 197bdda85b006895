"""The GPU path on a real GPU: saves and loads of CUDA state through the reused pinned buffers and the side stream.

Skipped without CUDA (the CPU build of dev/CI); the host-side logic of the same code is tested on any
machine in ``test_pinned_pool.py``. What is checked here:

- a CUDA module, its AdamW state, a tensor larger than one pinned buffer and a non-contiguous one
  round-trip bit for bit, and the checkpoint holds exactly the bytes a CPU save of the same values holds;
- copies are ordered after the caller's stream: work queued (behind a long GPU sleep) before a
  save is in the checkpoint, and a destination a queued kernel still writes is overwritten by the load;
- an async manager save holds the values at the call, though the state changes right after it
  returns (``async_save=True``) or the next optimizer step runs (``"overlap"``);
- a checkpoint saved by 2 FSDP2 ranks (CPU, gloo) loads into a CUDA model, also cast to bf16;
- pinned host memory does not grow over 5 saves and loads (the pool's counters and torch's host allocator's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import make_model, make_optimizer, run_ranks, save_trained
from shardsafe.core.format import MANIFEST_NAME, parse_manifest
from shardsafe.storage.pinned import pinned_pool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the host side is tested in test_pinned_pool.py)"
)

# torch.cuda._sleep: a few hundred milliseconds of GPU spinning queued ahead of the work under test
SLEEP_CYCLES = 500_000_000


def _cuda_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed).cuda()
    optimizer = make_optimizer(model)
    for _ in range(2):
        x, y = torch.randn(6, 5, device="cuda"), torch.randn(6, 2, device="cuda")
        (model(x) - y).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _cpu(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in values.items()}


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, f"{what}: {key}"
        assert torch.equal(got[key].cpu(), value.cpu()), f"{what}: {key} differs"


def _hashes(path: Path) -> dict[str, list[tuple[str, ...]]]:
    manifest = parse_manifest((path / MANIFEST_NAME).read_bytes())
    return {key: [c.hashes for c in entry.chunks] for key, entry in manifest.tensors.items()}


def test_cuda_state_round_trips_and_is_stored_as_a_cpu_save_stores_it(tmp_path: Path) -> None:
    model, optimizer = _cuda_model(0)
    big = torch.randn(5000, 4000, device="cuda")  # 80 MB: more than one 64 MiB pinned buffer
    wide = torch.randn(300, 700, device="cuda", dtype=torch.bfloat16)
    state: dict[str, Any] = {"model": model, "optim": optimizer, "big": big, "view": wide.t(), "step": 3}
    shardsafe.save(tmp_path / "gpu", state)
    shardsafe.verify(tmp_path / "gpu")
    cpu_model = make_model(0)
    cpu_model.load_state_dict(_cpu(model.state_dict()))
    shardsafe.save(tmp_path / "cpu", {"model": cpu_model, "big": big.cpu(), "view": wide.t().cpu()})
    gpu_hashes, cpu_hashes = _hashes(tmp_path / "gpu"), _hashes(tmp_path / "cpu")
    assert cpu_hashes and all(gpu_hashes[key] == cpu_hashes[key] for key in cpu_hashes), "the same bytes as a CPU save"

    fresh = make_model(1).cuda()
    fresh_optimizer = make_optimizer(fresh)
    into_view = torch.zeros(300, 700, device="cuda", dtype=torch.bfloat16).t()  # a non-contiguous destination
    loaded: dict[str, Any] = {
        "model": fresh,
        "optim": fresh_optimizer,
        "big": torch.zeros_like(big),
        "view": into_view,
        "step": 0,
    }
    shardsafe.load(tmp_path / "gpu", loaded)
    _assert_equal(fresh.state_dict(), model.state_dict(), "model")
    _assert_equal({"big": loaded["big"], "view": loaded["view"]}, {"big": big, "view": wide.t()}, "tensors")
    for param, expected in zip(fresh.parameters(), model.parameters()):
        _assert_equal(fresh_optimizer.state[param], optimizer.state[expected], "optimizer state")
    assert loaded["step"] == 3


def test_copies_are_ordered_after_the_callers_stream(tmp_path: Path) -> None:
    t = torch.ones(4096, 4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.mul_(3)  # still queued when the save starts copying
        shardsafe.save(tmp_path / "ckpt", {"t": t})
        dest = torch.zeros_like(t)
        torch.cuda._sleep(SLEEP_CYCLES)
        dest.fill_(7.0)  # queued on the caller's stream: the load must land after it
        shardsafe.load(tmp_path / "ckpt", {"t": dest})
        seen = dest.clone()  # queued after the load: must see the loaded values
    torch.cuda.synchronize()
    assert bool((seen == 3).all()), "the save saw the queued update and the load landed after the queued fill"


@pytest.mark.parametrize("mode", [True, "overlap"])
def test_async_save_holds_the_values_at_the_call(tmp_path: Path, mode: Any) -> None:
    model, optimizer = _cuda_model(0)
    with shardsafe.CheckpointManager(tmp_path / "ckpt", async_save=mode) as manager:
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # queued before the call: part of the checkpoint
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(1, {"model": model, "optim": optimizer})
        if mode is True:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.0).add_(-5.0)  # right after the call returns
        x, y = torch.randn(6, 5, device="cuda"), torch.randn(6, 2, device="cuda")
        (model(x) - y).square().mean().backward()
        optimizer.step()  # overlap: waits for the copy in its pre-hook
        manager.wait()
        fresh = make_model(1).cuda()
        assert manager.restore({"model": fresh, "optim": make_optimizer(fresh)}) == 1
    _assert_equal(fresh.state_dict(), expected, f"async_save={mode!r}")


def test_a_checkpoint_of_two_fsdp_ranks_loads_into_a_cuda_model(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    reference = run_ranks(save_trained, 2, str(path), 5, work_dir=tmp_path)[0]["model"]
    model = make_model(9).cuda()
    optimizer = make_optimizer(model)
    shardsafe.load(path, {"model": model, "optim": optimizer})
    _assert_equal(dict(model.state_dict()), reference, "resharded 2 -> 1 onto the GPU")
    half = make_model(9).cuda().to(torch.bfloat16)
    shardsafe.load(path, {"model": half}, strict=False)  # cast on the device
    _assert_equal(dict(half.state_dict()), {k: v.to(torch.bfloat16) for k, v in reference.items()}, "cast to bf16")


def test_pinned_memory_does_not_grow_over_saves_and_loads(tmp_path: Path) -> None:
    model, optimizer = _cuda_model(0)
    big = torch.randn(6000, 4000, device="cuda")
    state: dict[str, Any] = {"model": model, "optim": optimizer, "big": big}

    def host_allocs() -> int:  # torch's pinned allocator: blocks created (torch >= 2.7; else only the pool's counters)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        return int(stats().get("num_host_alloc", 0)) if stats is not None else 0

    with shardsafe.CheckpointManager(tmp_path / "async", async_save=True) as manager:
        counts = []
        for step in range(1, 6):
            shardsafe.save(tmp_path / f"sync-{step}", state)
            manager.save(step, state)
            manager.wait()
            shardsafe.load(tmp_path / f"sync-{step}", state)
            counts.append((pinned_pool().stats().allocated, host_allocs()))
    assert len(set(counts)) == 1, f"pinned buffers and host allocations after each of 5 saves: {counts}"
    stats = pinned_pool().stats()
    assert stats.allocated <= stats.limit and stats.in_use == 0 and stats.overflows == 0
