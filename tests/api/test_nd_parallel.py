"""N-D layouts saved and resharded in every direction (tests/nd_utils.py builds them, torchtitan's names).

A job of ranks in one layout trains two steps and saves model + AdamW; jobs in other layouts (and
world sizes) load into freshly built models whose values differ. Every parameter and optimizer
moment, whole (``full_tensor()``, merged over pipeline stages), must equal the saved one bit for
bit. Each load job loads the same checkpoint into several layouts one after another, so a handful
of launches covers the matrix: 2-D (FSDP2 over TP, ``_StridedShard``) -> 2-D, HSDP, pipeline
stages with and without FSDP, TP only, 1-D FSDP2 at another size, one process; pipeline stages ->
fewer, more, FSDP2; experts (EP) -> more ranks, one process; HSDP -> FSDP2 and back. A pipeline
whose stages are FSDP2 or TP on their slice of the ``(pp, dp)`` / ``(pp, tp)`` world mesh is stored
as layout rules ``["at", stage]`` on pp (no listed chunks), and loads back on its own layout,
FSDP2 and one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import nd_utils
import shardsafe
from dist_utils import assert_tensors_equal, run_ranks
from shardsafe.cli.inspect import describe_checkpoint
from shardsafe.errors import SaveError, ShardsafeError, StateMismatchError


def save_job(rank: int, world_size: int, layout: str, path: str) -> dict[str, Any]:
    model, optimizer = nd_utils.build(layout, rank, world_size)
    for i in range(2):
        nd_utils.step(model, optimizer, i)
    shardsafe.save(path, {"model": model, "optim": optimizer})
    return {"state": nd_utils.whole_state(model, optimizer), "layout": nd_utils.local_layout(model)}


def load_jobs(rank: int, world_size: int, layouts: list[str], path: str) -> dict[str, dict[str, torch.Tensor]]:
    """Load ``path`` into each layout in turn (fresh model and optimizer, other values)."""
    out = {}
    for layout in layouts:
        model, optimizer = nd_utils.build(layout, rank, world_size, seed=99)
        shardsafe.load(path, {"model": model, "optim": optimizer})
        out[layout] = nd_utils.whole_state(model, optimizer)
    return out


def _run(fn: Any, world_size: int, *args: Any, work_dir: Path) -> list[Any]:
    if world_size == 1:
        assert not dist.is_initialized()
        return [fn(0, 1, *args)]
    return run_ranks(fn, world_size, *args, work_dir=work_dir)


def _merged(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors over ranks (pipeline stages each hold their own; replicas must agree)."""
    out: dict[str, torch.Tensor] = {}
    for state in states:
        for key, value in state.items():
            if key in out:
                assert torch.equal(out[key], value), f"{key}: ranks hold different whole values"
            out[key] = value
    return out


# (save layout, save world) -> {load world: [layouts loaded one after another in one job]}
MATRIX = {
    ("2d", 4): {4: ["2d", "hsdp", "pp_fsdp", "pp", "tp"], 2: ["fsdp", "tp", "pp"], 1: ["one"], 3: ["fsdp"]},
    ("pp", 2): {1: ["one"], 4: ["pp", "2d"], 2: ["pp", "fsdp"]},
    ("hsdp", 4): {2: ["fsdp", "tp"], 4: ["hsdp"]},
    ("fsdp", 2): {4: ["2d", "hsdp"]},
    ("pp_fsdp", 4): {4: ["pp_fsdp"], 2: ["pp", "fsdp"], 1: ["one"]},
    ("pp_tp", 4): {1: ["one"]},
    ("ep", 2): {4: ["ep"], 1: ["one_ep"]},
}


@pytest.mark.parametrize("saved", list(MATRIX), ids=lambda s: f"{s[0]}{s[1]}")
def test_reshard_every_direction(tmp_path: Path, saved: tuple[str, int]) -> None:
    layout, world = saved
    path = tmp_path / "ck"
    results = _run(save_job, world, layout, str(path), work_dir=tmp_path)
    reference = _merged([r["state"] for r in results])
    placements = results[0]["layout"]
    if layout == "2d":  # the layout really is FSDP2 over TP: colwise weights strided, rowwise 2-D boxes
        assert placements["layers.0.w1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["layers.0.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in reference)
    # param + exp_avg, exp_avg_sq, step
    assert len(reference) == len([k for k in reference if not k.startswith("optim/")]) * 4
    assert shardsafe.verify(path)["world_size"] == world
    if layout == "pp_fsdp":
        _assert_stage_rules(path)
    if layout == "pp_tp":  # colwise / rowwise on each stage's tp slice: rules at the stage
        tensors = json.loads((path / "manifest.json").read_text())["tensors"]
        assert tensors["model/layers.3.w1.weight"]["layout"]["placements"] == [["at", 1], ["shard", 0]]
        assert tensors["model/layers.0.w2.weight"]["layout"]["placements"] == [["at", 0], ["shard", 1]]
        assert "chunks" not in tensors["optim/state/layers.0.w2.weight/exp_avg"]
    for load_world, layouts in MATRIX[saved].items():
        loaded = _run(load_jobs, load_world, layouts, str(path), work_dir=tmp_path)
        for name in layouts:
            got = _merged([r[name] for r in loaded])
            assert_tensors_equal(got, reference, f"{layout}@{world} -> {name}@{load_world}")


def _assert_stage_rules(path: Path) -> None:
    """Each stage's FSDP2 tensors (on its slice ``mesh["dp"]`` of the ``(pp, dp)`` world mesh) are
    described by a rule held at the stage's pp coordinate, not by listed chunks: the manifest does
    not grow with the ranks per stage."""
    tensors = json.loads((path / "manifest.json").read_text())["tensors"]
    staged = {k: t for k, t in tensors.items() if not k.endswith("/step")}
    assert staged and all("chunks" not in t for t in staged.values())
    stages = {k: t["layout"]["placements"][0] for k, t in staged.items()}
    assert all(t["layout"]["mesh"] == [2, 2] and t["layout"]["placements"][1] == ["shard", 0] for t in staged.values())
    assert stages["model/layers.0.w1.weight"] == ["at", 0] and stages["model/layers.3.w1.weight"] == ["at", 1]
    assert stages["model/output.weight"] == ["at", 1] and set(map(tuple, stages.values())) == {("at", 0), ("at", 1)}
    shown = {t["key"]: t["layout"] for t in describe_checkpoint(path)["tensors"]}  # what `shardsafe inspect` prints
    assert shown["model/layers.3.w1.weight"] == "mesh [2, 2], (At(1), Shard(dim=0))"


def strided_bytes_job(rank: int, world_size: int, path: str) -> int:
    model, optimizer = nd_utils.build("2d", rank, world_size)
    nd_utils.step(model, optimizer, 0)
    shardsafe.save(path, {"model": model, "optim": optimizer})
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_2d_writes_each_byte_once(tmp_path: Path) -> None:
    """FSDP2 x TP: the shard files hold every parameter and moment byte exactly once (no replica
    written twice, nothing dropped), spread over all four ranks."""
    path = tmp_path / "ck"
    run_ranks(strided_bytes_job, 4, str(path), work_dir=tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    model, _ = nd_utils.build("one", 0, 1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    chunk_bytes = sum(c["end"] - c["begin"] for t in manifest["tensors"].values() for c in t.get("chunks", []))
    for f in manifest["files"].values():  # the parts of layout rules: in their writers' indexes
        index = json.loads((path / f["index"]["file"]).read_text()) if "index" in f else {"chunks": {}}
        boxes = [b for v in index["chunks"].values() for b in (v if isinstance(v, list) else [v])]
        chunk_bytes += sum(b["end"] - b["begin"] for b in boxes)
    assert sum("layout" in t for t in manifest["tensors"].values()) >= 3 * len(list(model.parameters())) - 2
    steps = len([k for k in manifest["tensors"] if k.endswith("/step")])
    assert chunk_bytes == 3 * param_bytes + steps * 4, (chunk_bytes, param_bytes)
    assert len(manifest["files"]) == 4
    assert {f["rank"] for f in manifest["files"].values()} == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- training continues


def continue_job(rank: int, world_size: int, layout: str, path: str, load: bool, steps: list[int]) -> dict[str, Any]:
    model, optimizer = nd_utils.build(layout, rank, world_size, seed=99 if load else 0)
    if load:
        shardsafe.load(path, {"model": model, "optim": optimizer})
    losses = [nd_utils.step(model, optimizer, i) for i in steps]
    if not load:
        shardsafe.save(path, {"model": model, "optim": optimizer})
    return {"losses": losses, "state": nd_utils.whole_state(model, optimizer)}


@pytest.mark.parametrize(
    ("saved", "resumed"), [(("2d", 4), ("fsdp", 2)), (("fsdp", 3), ("2d", 4))], ids=["2d4-fsdp2", "fsdp3-2d4"]
)
def test_training_continues_on_another_layout(tmp_path: Path, saved: tuple[str, int], resumed: tuple[str, int]) -> None:
    """Three steps in one layout, a save, three more after loading into another: the losses and the
    final state are those of one uninterrupted run in one process (up to the reduction order of
    the parallel layouts: 1e-5)."""
    path = str(tmp_path / "ck")
    uninterrupted = continue_job(0, 1, "one", str(tmp_path / "ref"), False, list(range(6)))
    first = run_ranks(continue_job, saved[1], saved[0], path, False, [0, 1, 2], work_dir=tmp_path)
    second = run_ranks(continue_job, resumed[1], resumed[0], path, True, [3, 4, 5], work_dir=tmp_path)
    losses = first[0]["losses"] + second[0]["losses"]
    assert losses == pytest.approx(uninterrupted["losses"], rel=1e-5, abs=1e-6)
    final = _merged([r["state"] for r in second])
    for key, value in uninterrupted["state"].items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


# ----------------------------------------------------------------------------- ranks that hold different state


class StageCounter:
    """A per-stage value saved under one shared name (what a pipeline's per-stage scheduler is)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def disagree_job(rank: int, world_size: int, path: str, what: str) -> str:
    model, optimizer = nd_utils.build("pp", rank, world_size)
    nd_utils.step(model, optimizer, 0)
    state: dict[str, Any] = {"model": model, "optim": optimizer}
    if what == "counter":
        state["sched"] = StageCounter(10 + rank)
    elif what == "lr":
        optimizer.param_groups[0]["lr"] = 0.1 * (rank + 1)
    elif what == "shape":  # the same key with another shape on each stage
        state["extra"] = torch.zeros(rank + 2)
    try:
        shardsafe.save(path, state)
    except SaveError as exc:
        return str(exc)
    return "saved"


@pytest.mark.parametrize("what", ["counter", "lr", "shape"])
def test_ranks_that_disagree_are_refused_before_writing(tmp_path: Path, what: str) -> None:
    path = tmp_path / "ck"
    messages = run_ranks(disagree_job, 2, str(path), what, work_dir=tmp_path)
    assert all(m != "saved" for m in messages), messages
    assert all(("rank 0" in m and "rank 1" in m) for m in messages), messages
    expected = {"counter": "state['sched']/state/value", "lr": "param group 0/lr", "shape": "tensor 'extra'"}[what]
    assert expected in messages[0], messages[0]
    assert not path.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ck")], sorted(
        p.name for p in tmp_path.iterdir()
    )


def stage_values_job(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Pipeline stages, each with its own counter under its own name and a shared one that agrees."""
    model, optimizer = nd_utils.build("pp", rank, world_size)
    nd_utils.step(model, optimizer, 0)
    shardsafe.save(
        path, {"model": model, "optim": optimizer, f"counter{rank}": StageCounter(rank + 5), "shared": StageCounter(3)}
    )
    fresh, fresh_optimizer = nd_utils.build("pp", rank, world_size, seed=7)
    mine, shared = StageCounter(0), StageCounter(0)
    shardsafe.load(path, {"model": fresh, "optim": fresh_optimizer, f"counter{rank}": mine, "shared": shared})
    return {"mine": mine.value, "shared": shared.value, "groups": len(fresh_optimizer.param_groups[0]["params"])}


def test_per_stage_values_merge(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    results = run_ranks(stage_values_job, 2, str(path), work_dir=tmp_path)
    assert [r["mine"] for r in results] == [5, 6] and [r["shared"] for r in results] == [3, 3]
    tree = __import__("json").loads((path / "state.json").read_text())
    assert {"counter0", "counter1", "shared", "model", "optim"} <= set(tree)
    saved_params = tree["optim"]["state"]["param_groups"][0]["params"]
    model, _ = nd_utils.build("one", 0, 1)
    assert sorted(saved_params) == sorted(n for n, _ in model.named_parameters())  # every stage's parameters, once


def strict_job(rank: int, world_size: int, path: str, case: str) -> str:
    if case == "nobody":  # both ranks are stage 0 of a 2-stage split: stage 1's layers are loaded by no rank
        model, optimizer = nd_utils.build("one", 0, 1, seed=3)
        nd_utils._keep_stage(model, 0, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    else:  # "missing": rank 1 asks for a tensor the checkpoint lacks
        model, optimizer = nd_utils.build("pp", rank, world_size, seed=3)
        if rank == 1:
            model.register_buffer("extra", torch.zeros(2))
    results = []
    for strict in (True, False):
        try:
            shardsafe.load(path, {"model": model}, strict=strict)
            results.append("loaded")
        except StateMismatchError as exc:
            results.append(str(exc))
    return "\n###\n".join(results)


def test_strict_reports_keys_nobody_loads_and_keys_missing(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    run_ranks(save_job, 2, "pp", str(path), work_dir=tmp_path)
    nobody = run_ranks(strict_job, 2, str(path), "nobody", work_dir=tmp_path)
    for message in nobody:
        strict, relaxed = message.split("\n###\n")
        assert "unexpected in checkpoint: model/layers.2.w1.weight (no rank loads it" in strict, strict
        assert "layers.0" not in strict and relaxed == "loaded"
    missing = run_ranks(strict_job, 2, str(path), "missing", work_dir=tmp_path)
    for message in missing:
        strict, relaxed = message.split("\n###\n")
        assert "missing in checkpoint: model/extra" in strict and "unexpected" not in strict, strict
        assert relaxed == "loaded"


def partial_job(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world_size,))
    pending = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        shardsafe.save(path, {"t": pending})
    except ShardsafeError as exc:
        return str(exc)
    return "saved"


def test_partial_is_refused_with_the_remedy(tmp_path: Path) -> None:
    messages = run_ranks(partial_job, 2, str(tmp_path / "ck"), work_dir=tmp_path)
    assert all("Partial" in m and "redistribute" in m and "Replicate()" in m for m in messages), messages
    assert not (tmp_path / "ck").exists()


# ----------------------------------------------------------------------------- the rest of the stack


def stack_job(rank: int, world_size: int, root: str, out: str) -> dict[str, Any]:
    """FSDP2 x TP through the manager (async saves, retention) and into a Hugging Face weights file."""
    from safetensors.torch import load_file

    model, optimizer = nd_utils.build("2d", rank, world_size)
    manager = shardsafe.CheckpointManager(root, keep_last=1, async_save=True)
    for i in range(3):
        nd_utils.step(model, optimizer, i)
        manager.save(i + 1, {"model": model, "optim": optimizer})
    manager.wait()
    saved = nd_utils.whole_state(model, optimizer)
    restored_into, fresh_optimizer = nd_utils.build("hsdp", rank, world_size, seed=5)
    step = manager.restore({"model": restored_into, "optim": fresh_optimizer})
    manager.close()
    shardsafe.save_pretrained(model, out, dtype=None)
    weights = load_file(str(Path(out) / "model.safetensors")) if rank == 0 else {}
    return {
        "saved": saved,
        "restored": nd_utils.whole_state(restored_into, fresh_optimizer),
        "step": step,
        "weights": weights,
    }


def test_manager_and_save_pretrained_take_an_nd_model(tmp_path: Path) -> None:
    results = run_ranks(stack_job, 4, str(tmp_path / "run"), str(tmp_path / "hf"), work_dir=tmp_path)
    assert all(r["step"] == 3 for r in results)
    saved = _merged([r["saved"] for r in results])
    assert_tensors_equal(_merged([r["restored"] for r in results]), saved, "2d@4 async manager save -> hsdp@4 restore")
    # keep_last=1
    assert [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")] == ["step-0000000003"]
    weights = results[0]["weights"]
    params = {k: v for k, v in saved.items() if not k.startswith("optim/")}
    assert_tensors_equal(weights, params, "save_pretrained of a 2d model")


def strided_save_job(rank: int, world_size: int, path: str) -> list[int]:
    """A 1-D ``_StridedShard(0, sf=2)`` DTensor: each rank's local tensor is two separate row blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world_size,))
    placement = _StridedShard(0, split_factor=2)

    def strided(whole: torch.Tensor) -> DTensor:  # torch's own split: rank r keeps part r of each half
        local = placement._split_tensor(whole, world_size, with_padding=False)[0][rank].clone()
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=whole.shape, stride=whole.stride())

    whole = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    shardsafe.save(path, {"t": strided(whole), "m": {"x": strided(whole * 2)}})
    back = strided(torch.zeros(11, 3))
    state: dict[str, Any] = {"t": back, "m": {"x": None}}
    shardsafe.load(path, state)  # "t" in place, box by box; "m" (a plain value) replaced, its tensor read whole
    assert torch.equal(back.to_local(), strided(whole).to_local())
    assert torch.equal(state["m"]["x"], whole * 2)
    return [int(n) for n in back.to_local().shape]


def sharded_load_job(rank: int, world_size: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    t = distribute_tensor(torch.zeros(11, 3), mesh, [Shard(1)])
    shardsafe.load(path, {"t": t}, strict=False)
    return bool(torch.equal(t.full_tensor(), torch.arange(33, dtype=torch.float32).reshape(11, 3)))


def test_a_local_tensor_of_several_boxes_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shapes = run_ranks(strided_save_job, 2, str(path), work_dir=tmp_path)
    assert shapes == [[6, 3], [5, 3]]
    manifest = json.loads((path / "manifest.json").read_text())
    # Stored by its rule (format 3), no chunk list; each rank's index holds its two boxes.
    assert manifest["format_version"] == 3 and "chunks" not in manifest["tensors"]["t"]
    assert manifest["tensors"]["t"]["layout"] == {"mesh": [2], "placements": [["strided", 0, 2]], "writer": 0}
    for rank in range(2):
        index = json.loads((path / f"shard-{rank:05d}.index.json").read_text())
        assert [box["shape"] for box in index["chunks"]["t"]] == ([[3, 3], [3, 3]] if rank == 0 else [[3, 3], [2, 3]])
    one = torch.zeros(11, 3)
    shardsafe.load(path, {"t": one}, strict=False)
    assert torch.equal(one, torch.arange(33, dtype=torch.float32).reshape(11, 3))
    assert run_ranks(sharded_load_job, 3, str(path), work_dir=tmp_path) == [True, True, True]
