"""shardsafe.integrations.accelerate save_state/load_state under DeepSpeed ZeRO-3 (real Accelerate, real
DeepSpeed, CPU ranks, gloo).

One module fixture runs ``tests/ds_scripts/accelerate_state.py`` under ``torch.distributed.run``: ``save``
on 2 ranks (train 2 steps, ``save_state`` by shardsafe and by Accelerate, train 2 more: the reference),
then, concurrently, ``resume`` on 2 ranks (a new process group: fresh engines with other initial weights
and RNG load each checkpoint and train the same 2 steps) and ``reshard`` on 1 and on 3 ranks (load the
2-rank shardsafe checkpoint, train a step; Accelerate's own load is tried too). Each with a torch
scheduler (an ``AcceleratedScheduler``, stepped by the loop) and with DeepSpeed's WarmupLR (stepped by
the engine). The ranks return whole tensors gathered by DeepSpeed's ``safe_get_full_*`` helpers and
``GatheredParameters``; this process never imports DeepSpeed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import HAVE_DEEPSPEED, TESTS_DIR, ScriptLaunch, launch_script, wait_for_scripts

pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed) and g++ are needed"
)

SCRIPT = TESTS_DIR / "ds_scripts" / "accelerate_state.py"
SCHEDULERS = ("torch", "ds")
OTHER_WORLDS = (1, 3)
SAVE_AT, MORE, BATCH = 2, 2, 2  # as in the script
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed start on a machine compiles an op (minutes on 2 cores)
SMALL_STATE = ("groups", "scheduler", "counters", "sampler", "counter")


def _launch(root: Path, world: int, phase: str) -> ScriptLaunch:
    return launch_script(f"{phase}-w{world}", SCRIPT, world, [str(root), phase], cwd=root)


def _results(root: Path, phase: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(root / f"{phase}-w{world}.rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """{"root": folder, "save": [per-rank results at W=2], "resume": [...], 1: [...], 3: [...]}."""
    root = tmp_path_factory.mktemp("accelerate_ds")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    wait_for_scripts([_launch(root, 2, "save")], deadline, "Accelerate + DeepSpeed runs")
    wait_for_scripts(
        [_launch(root, 2, "resume"), *(_launch(root, w, "reshard") for w in OTHER_WORLDS)],
        deadline,
        "Accelerate + DeepSpeed runs",
    )
    out: dict[Any, Any] = {"root": root, "save": _results(root, "save", 2), "resume": _results(root, "resume", 2)}
    for w in OTHER_WORLDS:
        out[w] = _results(root, "reshard", w)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_same_snapshot(
    got: dict[str, Any], expected: dict[str, Any], what: str, *, same_world: bool = True, rng: bool = True
) -> None:
    """Bit-equal fp32 master weights, moments and gathered parameters; equal step counts, hyper-parameters,
    scheduler, engine counters, sampler position and registered counter; the rank's torch RNG."""
    assert sorted(got["tensors"]) == sorted(expected["tensors"]), f"{what}: tensor names differ"
    bad = [k for k in expected["tensors"] if not same_bits(got["tensors"][k], expected["tensors"][k])]
    assert not bad, f"{what}: tensors differ: {bad}"
    if same_world:
        assert got["steps"] == expected["steps"], f"{what}: step count per sub-group"
    else:  # other sub-groups at another world size, each with the one saved step count
        assert set(got["steps"]) == set(expected["steps"]) and len(got["steps"]) == got["sub_groups"], (
            f"{what}: step counts"
        )
    for key in SMALL_STATE:
        assert got[key] == expected[key], f"{what}: {key}: {got[key]} vs {expected[key]}"
    if rng:
        assert torch.equal(got["rng"], expected["rng"]), f"{what}: torch RNG state"


def test_accelerate_runs_deepspeed_zero3(runs: dict[Any, Any]) -> None:
    """The runs really are DeepSpeed ZeRO-3 under Accelerate (not DDP): prepare returned an engine, its
    optimizer wrapper and, per scheduler kind, Accelerate's wrapper."""
    for kind, wrapper in (("torch", "AcceleratedScheduler"), ("ds", "DeepSpeedSchedulerWrapper")):
        r = runs["save"][0][kind]
        assert r["distributed_type"] == "DistributedType.DEEPSPEED"
        assert r["types"] == ["DeepSpeedEngine", "DeepSpeedOptimizerWrapper", wrapper]
        assert r["at_save"]["steps"] == [float(SAVE_AT)] and any(
            k.startswith("exp_avg/") for k in r["at_save"]["tensors"]
        )


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_resume_is_bit_identical_and_matches_accelerate(runs: dict[Any, Any], kind: str) -> None:
    """2 -> 2 in a new process group: after shardsafe's load_state the engine, scheduler, sampler,
    registered object and every rank's RNG are exactly as saved; the next steps' losses and final state
    are bit-identical to the uninterrupted run and to the continuation after Accelerate's own load_state."""
    for rank in range(2):
        saved, resumed = runs["save"][rank][kind], runs["resume"][rank][kind]
        assert_same_snapshot(resumed["after_load_ss"], saved["at_save"], f"rank {rank} {kind}: after shardsafe load")
        assert_same_snapshot(
            resumed["after_load_acc"], saved["at_save"], f"rank {rank} {kind}: after Accelerate's load"
        )
        assert resumed["losses_ss"] == saved["losses_ref"] == resumed["losses_acc"], f"rank {rank} {kind}: losses"
        assert all(math.isfinite(x) for x in saved["losses_ref"])
        assert_same_snapshot(resumed["final_ss"], saved["final_ref"], f"rank {rank} {kind}: after {MORE} more steps")
        assert_same_snapshot(
            resumed["final_acc"], resumed["final_ss"], f"rank {rank} {kind}: Accelerate's continuation"
        )
        assert resumed["final_ss"]["counters"] == {
            "global_steps": SAVE_AT + MORE,
            "global_samples": 2 * BATCH * (SAVE_AT + MORE),
            "skipped_steps": 0,
        }
    assert runs["save"][0][kind]["losses_ref"] != runs["save"][1][kind]["losses_ref"]  # the ranks saw different data


def test_checkpoint_holds_the_engine_value_and_no_pickle(runs: dict[Any, Any]) -> None:
    """One shardsafe checkpoint: the engine is the existing ``deepspeed_engine`` value (its optimizer and
    no separate optimizer entry), one shard per rank, verifiable; Accelerate's own folder has pickles."""
    for kind in SCHEDULERS:
        path = runs["root"] / f"ss_{kind}"
        shardsafe.verify(path)
        state = json.loads((path / "state.json").read_text())
        assert sorted(state) == ["accelerator_step", "custom_0", "custom_1", "model", "rng", "scheduler"]
        assert state["model"]["kind"] == "deepspeed_engine" and state["model"]["meta"]["world_size"] == 2
        assert sorted(state["model"]["state"]["optim"]) == ["exp_avg", "exp_avg_sq"]
        assert len(list(path.glob("*.safetensors"))) == 2
        assert not [p for p in path.rglob("*") if p.suffix in (".pkl", ".pt", ".bin")]
    assert list((runs["root"] / "acc_torch").glob("*.pkl"))


@pytest.mark.parametrize("world", OTHER_WORLDS)
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_load_at_other_world_size(runs: dict[Any, Any], kind: str, world: int) -> None:
    """2 -> 1 and 2 -> 3: every rank's new partitions hold the saved fp32 master, moments and parameters
    bit for bit (the optimizer sub-groups are re-cut at W=1), the step count, hyper-parameters, scheduler,
    counters, the sampler's global position and the registered object are as saved, the RNG of ranks
    that existed is restored; then a step trains, and the sampler goes on from the global position."""
    saved = [r[kind]["at_save"] for r in runs["save"]]
    for rank, result in enumerate(runs[world]):
        r = result[kind]
        assert_same_snapshot(
            r["after_load"], saved[min(rank, 1)], f"W={world} rank {rank} {kind}", same_world=False, rng=rank < 2
        )
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0])
        assert r["after_step"]["steps"] and set(r["after_step"]["steps"]) == {float(SAVE_AT + 1)}
        assert r["after_step"]["sampler"]["consumed"] == 2 * BATCH * SAVE_AT + BATCH * world
        changed = [
            k
            for k in saved[0]["tensors"]
            if k.startswith("fp32/") and not same_bits(r["after_step"]["tensors"][k], saved[0]["tensors"][k])
        ]
        assert changed, "the step did not update the fp32 master weights"
    if world == 1:
        assert runs[world][0][kind]["after_load"]["sub_groups"] != saved[0]["sub_groups"]


@pytest.mark.parametrize("world", OTHER_WORLDS)
def test_accelerates_own_load_refuses_another_world_size(runs: dict[Any, Any], world: int) -> None:
    """What shardsafe adds: Accelerate's load_state of its DeepSpeed checkpoint (engine.load_checkpoint)
    refuses a new world size on the ranks that have a partition file."""
    error = runs[world][0]["accelerate_error"]
    assert (
        error is not None
        and error[0] == "ZeRORuntimeException"
        and f"world size of 2 but the current world size is {world}" in error[1]
    )


def test_zero2_is_refused_with_a_pointer_to_what_works(runs: dict[Any, Any]) -> None:
    """A ZeRO-2 engine (Accelerate's second DeepSpeed plugin selected): save_state and load_state raise a
    ShardsafeError naming the stage before anything is written or changed; Accelerate's own checkpoint of
    it converts with ``shardsafe convert`` (the error's advice), holding the engine's fp32 master weights."""
    from shardsafe.cli.main import main as shardsafe_cli

    r = runs[1][0]
    assert r["zero2_stage"] == 2
    for key in ("zero2_save_error", "zero2_load_error"):
        assert (
            r[key] is not None
            and r[key][0] == "ShardsafeError"
            and "ZeRO stage 2" in r[key][1]
            and "accelerator.save_state" in r[key][1]
        )
    assert not r["zero2_folder_exists"]
    converted = runs["root"] / "conv_zero2"
    assert shardsafe_cli(["convert", str(runs["root"] / "acc_zero2"), str(converted), "--no-progress"]) == 0
    from ds_scripts.accelerate_state import Net

    model = Net()
    shardsafe.load(converted, {"model": model}, strict=False)  # the model only (the optimizer state is there too)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(r["zero2_fp32"])
    for name, value in r["zero2_fp32"].items():
        assert same_bits(got[name].detach(), value), name
