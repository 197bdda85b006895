"""A live DeepSpeed ZeRO-3 engine as a ``state`` value of shardsafe.save / shardsafe.load.

Real DeepSpeed on CPU ranks (gloo): one module fixture runs ``tests/ds_scripts/engine_state.py``
under ``torch.distributed.run`` three times: ``save`` on 2 ranks, then ``reshard`` on 3 ranks and
on 1 rank concurrently (they load what the 2 ranks saved, and DeepSpeed's own checkpoint of the same
step after ``shardsafe convert --for-engine``, which runs here in between). The model (``train_zero.Tiny``) has odd
sizes, a 1-element parameter, a frozen layer, a tied weight, float and integer persistent buffers,
a non-persistent buffer and two param groups; bf16 (every parameter persistent), fp32 (every
parameter partitioned) and bf16 with optimizer and parameters offloaded to the CPU; several
optimizer sub-groups whose boundaries change with the world size.
The ranks return whole tensors gathered by DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` / ``GatheredParameters``; this process never imports DeepSpeed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import HAVE_DEEPSPEED, TESTS_DIR, ScriptLaunch, launch_script, wait_for_scripts
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.transfer import ChunkReader

SCRIPT = TESTS_DIR / "ds_scripts" / "engine_state.py"
PRECISIONS = ("bf16", "fp32", "bf16-offload")
OTHER_WORLDS = (1, 3)
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed start on a machine compiles an op (minutes on 2 cores)

pytestmark = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed) and g++ are needed"
)


def _launch(root: Path, world: int, phase: str) -> ScriptLaunch:
    return launch_script(f"{phase}-w{world}", SCRIPT, world, [str(root), phase], cwd=root)


def _wait(launches: list[ScriptLaunch], deadline: float) -> None:
    wait_for_scripts(launches, deadline, "DeepSpeed runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{"root": folder, "save": [per-rank results at W=2], 1: [...], 3: [...]}."""
    root = tmp_path_factory.mktemp("ds_engine")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    _wait([_launch(root, 2, "save")], deadline)
    from shardsafe.cli.main import main as shardsafe_cli

    for precision in PRECISIONS:  # DeepSpeed's own checkpoints (engine.save_checkpoint), for the reshard launches
        assert (
            shardsafe_cli(
                [
                    "convert",
                    str(root / f"ds_{precision}"),
                    str(root / f"conv_{precision}"),
                    "--for-engine",
                    "--no-progress",
                ]
            )
            == 0
        )
    _wait([_launch(root, w, "reshard") for w in OTHER_WORLDS], deadline)
    out: dict[Any, Any] = {
        "root": root,
        "save": [torch.load(root / f"save-w2.rank{r}.pt", weights_only=False) for r in range(2)],
    }
    for w in OTHER_WORLDS:
        out[w] = [torch.load(root / f"reshard-w{w}.rank{r}.pt", weights_only=False) for r in range(w)]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), f"{what}: keys differ: {sorted(set(got) ^ set(expected))}"
    bad = [k for k in expected if not same_bits(got[k], expected[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def assert_same_snapshot(
    got: dict[str, Any],
    expected: dict[str, Any],
    what: str,
    *,
    same_sub_groups: bool = True,
    skip: tuple[str, ...] = (),
) -> None:  # noqa: E501
    """Bit-equal tensors (fp32 master, moments, gathered 16-bit parameters, buffers) and equal small state."""
    assert_same_tensors(got["tensors"], expected["tensors"], what)
    if same_sub_groups:
        assert [s.item() for s in got["steps"]] == [s.item() for s in expected["steps"]], f"{what}: step per sub-group"
    else:  # other sub-groups at another world size, each with the one saved step count
        assert {s.item() for s in got["steps"]} == {s.item() for s in expected["steps"]} and len(got["steps"]) == got[
            "sub_groups"
        ]
        assert all(s.dtype == torch.float32 and s.shape == () for s in got["steps"])
    for key in ("groups", "scaler", "counters", "scheduler"):
        if key not in skip:
            assert got[key] == expected[key], f"{what}: {key}: {got[key]} vs {expected[key]}"


def read_all(path: Path) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    manifest, tree = open_checkpoint(path)
    with ChunkReader(path, manifest) as reader:
        tensors = {key: reader.read_tensor(key, entry) for key, entry in manifest.tensors.items()}
    return manifest, tree, tensors


# ----------------------------------------------------------------------------- same world size


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_at_same_world_size_is_bit_exact(runs: dict[str, Any], precision: str) -> None:
    """2 -> 2: a fresh engine (other initial weights) loads the step-2 checkpoint and trains on exactly
    like the uninterrupted run: same losses, same fp32 master, moments, 16-bit weights, step counts."""
    for rank, result in enumerate(runs["save"]):
        r = result[precision]
        at_save = r["at_save"]
        assert any(k.startswith("exp_avg/") for k in at_save["tensors"]) and at_save["sub_groups"] > 1
        assert {s.item() for s in at_save["steps"]} == {2.0}
        assert_same_snapshot(r["after_load"], at_save, f"rank {rank} {precision} after load")
        assert r["step_value"] == 2
        assert r["losses_ss"] == r["losses_ref"] and all(math.isfinite(x) for x in r["losses_ref"])
        assert_same_snapshot(r["final_ss"], r["final_ref"], f"rank {rank} {precision} after 2 more steps")
        assert r["final_ss"]["counters"] == {
            "global_steps": 4,
            "global_samples": 16,
            "skipped_steps": 0,
            "micro_steps": 4,
        }
    assert_same_tensors(
        runs["save"][1][precision]["final_ss"]["tensors"],
        runs["save"][0][precision]["final_ss"]["tensors"],
        "rank 1 vs rank 0",
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_result_as_deepspeeds_own_checkpoint(runs: dict[str, Any], precision: str) -> None:
    """engine.save_checkpoint / load_checkpoint from the same step gives the same losses and state
    (DeepSpeed does not restore micro_steps; shardsafe does)."""
    r = runs["save"][0][precision]
    assert r["losses_ds"] == r["losses_ref"] == r["losses_ss"]
    assert_same_snapshot(r["after_ds_load"], r["after_load"], "DeepSpeed's load vs shardsafe's", skip=("counters",))
    assert_same_snapshot(
        r["final_ds"], r["final_ss"], "after DeepSpeed's load vs after shardsafe's", skip=("counters",)
    )
    assert r["after_ds_load"]["counters"] == dict(r["after_load"]["counters"], micro_steps=0)


# ----------------------------------------------------------------------------- other world sizes


@pytest.mark.parametrize("world", OTHER_WORLDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_load_at_other_world_size(runs: dict[str, Any], precision: str, world: int) -> None:
    """2 -> 1 and 2 -> 3 (which engine.load_checkpoint refuses): every rank's new partitions hold the
    saved values bit for bit, the step count reaches every (re-cut) sub-group, and training goes on."""
    at_save = runs["save"][0][precision]["at_save"]
    for rank, result in enumerate(runs[world]):
        r = result[precision]
        assert r["after_load"]["sub_groups"] != at_save["sub_groups"]  # the sub-group boundaries moved
        assert_same_snapshot(r["after_load"], at_save, f"W={world} rank {rank} {precision}", same_sub_groups=False)
        assert r["step_value"] == 2
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0])
        assert r["after_step"]["counters"] == {
            "global_steps": 3,
            "global_samples": 8 + 2 * world,
            "skipped_steps": 0,
            "micro_steps": 3,
        }
        assert {s.item() for s in r["after_step"]["steps"]} == {3.0}
        changed = [
            k
            for k in at_save["tensors"]
            if k.startswith("fp32/") and not same_bits(r["after_step"]["tensors"][k], at_save["tensors"][k])
        ]
        assert changed, "the step did not update the fp32 master weights"
    if world == 1:  # one rank sees the same data as rank 0 of the 2-rank run, but a mean over fewer ranks
        assert runs[world][0][precision]["losses"] == runs["save"][0][precision]["losses_ref"][:1]


def test_load_from_one_rank_into_three(runs: dict[str, Any]) -> None:
    """1 -> 3: the checkpoint the 1-rank engine saved (one file, every tensor one chunk) loads into 3 ranks."""
    at_save = runs["save"][0]["bf16"]["at_save"]
    for rank, result in enumerate(runs[3]):
        # (the 1-rank launch saved the engine alone: the scheduler is not in that checkpoint)
        assert_same_snapshot(
            result["from_w1"], at_save, f"1 -> 3, rank {rank}", same_sub_groups=False, skip=("scheduler",)
        )


@pytest.mark.parametrize("world", OTHER_WORLDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_resave_at_other_world_size_is_identical(runs: dict[str, Any], precision: str, world: int) -> None:
    """What the 1- and 3-rank engines save right after loading is, tensor for tensor, the 2-rank checkpoint
    (every rank wrote its own file)."""
    root = runs["root"]
    _, tree2, tensors2 = read_all(root / f"ss_{precision}")
    manifest, tree, tensors = read_all(root / f"ss_{precision}_w{world}")
    assert sorted(tensors) == sorted(tensors2)
    assert [k for k in tensors if not same_bits(tensors[k], tensors2[k])] == []
    assert sorted(entry.rank for entry in manifest.files.values()) == list(range(world))
    meta, meta2 = tree["engine"]["meta"], tree2["engine"]["meta"]
    assert meta["world_size"] == world and meta2["world_size"] == 2
    assert {k: v for k, v in meta.items() if k not in ("world_size", "optimizer_scalars")} == {
        k: v for k, v in meta2.items() if k not in ("world_size", "optimizer_scalars")
    }


# ----------------------------------------------------------------------------- DeepSpeed's checkpoint, converted for an
# engine


@pytest.mark.parametrize("world", OTHER_WORLDS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_converted_deepspeed_checkpoint_resumes_engine_at_other_world_size(
    runs: dict[str, Any], precision: str, world: int
) -> None:
    """``engine.save_checkpoint`` at 2 ranks, ``shardsafe convert --for-engine``, a fresh engine at 1 or 3
    ranks loads it: fp32 master, moments, 16-bit weights, buffers, step counts, lr and the other
    hyper-parameters, the LR scheduler and DeepSpeed's counters are the saving run's, bit for bit;
    then a training step runs. DeepSpeed does not save ``micro_steps``: it stays 0."""
    at_save = runs["save"][0][precision]["at_save"]
    for rank, result in enumerate(runs[world]):
        r = result[precision]
        assert r["conv_step_value"] == 2
        what = f"converted, W={world} rank {rank} {precision}"
        assert_same_snapshot(r["conv_after_load"], at_save, what, same_sub_groups=False, skip=("counters",))
        assert r["conv_after_load"]["counters"] == dict(at_save["counters"], micro_steps=0)
        assert r["conv_after_load"]["groups"][1]["lr"] == pytest.approx(3e-3 * 0.7**2)
        assert len(r["conv_losses"]) == 1 and math.isfinite(r["conv_losses"][0])
        assert r["conv_after_step"]["counters"]["global_steps"] == 3 and {
            s.item() for s in r["conv_after_step"]["steps"]
        } == {3.0}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_converted_deepspeed_checkpoint_is_the_engine_layout(runs: dict[str, Any], precision: str) -> None:
    """The converted checkpoint (one file, every tensor one chunk) holds, tensor for tensor and bit for bit,
    what ``shardsafe.save`` of the live engine wrote at the same step, and the same meta (sub-groups and
    step counts of the 2-rank run; no micro_steps, which DeepSpeed does not save)."""
    root = runs["root"]
    path = root / f"conv_{precision}"
    summary = shardsafe.verify(path)
    assert summary["world_size"] == 1 and summary["state_entries"] == ["engine", "sched", "step"]
    manifest, tree, tensors = read_all(path)
    _, tree_ss, tensors_ss = read_all(root / f"ss_{precision}")
    assert sorted(tensors) == sorted(tensors_ss)
    assert [k for k in tensors if not same_bits(tensors[k], tensors_ss[k])] == []
    assert all(len(entry.chunks) == 1 for entry in manifest.tensors.values())
    meta, meta_ss = tree["engine"]["meta"], tree_ss["engine"]["meta"]
    assert meta["counters"] == {k: v for k, v in meta_ss["counters"].items() if k != "micro_steps"}
    assert {k: v for k, v in meta.items() if k != "counters"} == {k: v for k, v in meta_ss.items() if k != "counters"}
    assert tree["engine"]["state"] == tree_ss["engine"]["state"] and tree["step"] == tree_ss["step"] == {
        "kind": "value",
        "state": 2,
    }
    assert (
        manifest.metadata["converted_from"]["zero_stage"] == 3
        and manifest.metadata["converted_from"]["dp_world_size"] == 2
    )


# ----------------------------------------------------------------------------- refusals, scaler, layout


def test_different_model_is_refused_before_anything_is_modified(runs: dict[str, Any]) -> None:
    for result in runs["save"]:
        r = result["bf16"]
        cls, message = r["mismatch_error"]
        assert cls == "StateMismatchError"
        assert "shape mismatch for engine/fp32/l3.weight: checkpoint [143], model [165]" in message
        assert "parameter 'l3.weight' has shape [13, 11] in the checkpoint, [15, 11] in the engine" in message
        assert "missing in checkpoint: engine/fp32/extra" in message
        assert "optimizer param groups differ" in message
        assert "step counts" not in message  # parameters the checkpoint lacks are not reported twice
        assert_same_snapshot(r["mismatch_after"], r["mismatch_before"], "engine after the refused load")
        assert r["mismatch_state_empty"], "the refused load left optimizer state in a fresh engine"


def test_zero2_engine_is_refused(runs: dict[str, Any]) -> None:
    cls, message = runs["save"][0]["bf16"]["zero2_error"]
    assert cls == "ShardsafeError"
    assert "state['engine'] (a DeepSpeed engine) uses ZeRO stage 2; only ZeRO stage 3" in message


def test_loss_scaler_state_round_trip(runs: dict[str, Any]) -> None:
    """fp16's DynamicLossScaler (cur_scale, cur_iter, hysteresis, ...) comes back exactly."""
    for result in runs["save"]:
        r = result["bf16"]
        assert r["scaler_loaded"] == r["scaler_saved"]
        assert r["scaler_saved"]["cur_scale"] == 1024.0 and r["scaler_saved"]["cur_iter"] == 17
        assert r["dynamic_loaded"] is True


def stored_boxes(manifest: Any, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, shape, writing rank) of every stored box of ``key``, in offset order: the listed chunks,
    or, for a rule-described tensor (format 2's dim-0 split), each part's boxes and the rank that writes it."""
    entry = manifest.tensors[key]
    if entry.rule is None:
        boxes = [(c.offsets, c.shape, manifest.files[c.file].rank) for c in entry.chunks]
    else:
        rule = entry.rule
        boxes = [
            (box.offsets, box.shape, rule.writer_of(part))
            for part in range(rule.parts)
            for box in rule.boxes(entry.shape, part)
        ]
    return sorted(boxes)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_verify_files_and_layout(runs: dict[str, Any], precision: str) -> None:
    root = runs["root"]
    path = root / f"ss_{precision}"
    summary = shardsafe.verify(path)
    assert summary["world_size"] == 2 and summary["state_entries"] == ["engine", "sched", "step"]
    manifest, tree, tensors = read_all(path)
    assert {name: entry.rank for name, entry in manifest.files.items()} == {
        "shard-00000.safetensors": 0,
        "shard-00001.safetensors": 1,
    }
    assert manifest.metadata == {"precision": precision}

    # one 1-D tensor of numel elements per parameter, each rank's share a chunk at rank * ceil(numel / 2)
    entry = manifest.tensors["engine/fp32/l2.weight"]
    assert entry.shape == (493,) and entry.dtype == torch.float32
    assert stored_boxes(manifest, "engine/fp32/l2.weight") == [((0,), (247,), 0), ((247,), (246,), 1)]
    assert [b[0] for b in stored_boxes(manifest, "engine/optim/exp_avg_sq/l2.weight")] == [(0,), (247,)]
    # rank 1 holds padding only
    assert stored_boxes(manifest, "engine/fp32/temperature") == [((0,), (1,), 0)]
    frozen = manifest.tensors["engine/frozen/frozen.weight"]
    assert (
        frozen.shape == (187,)
        and frozen.dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
        and len(stored_boxes(manifest, "engine/frozen/frozen.weight")) == 2
    )
    # replicated: written once
    for name, dtype, shape in (("scale", torch.float32, (13,)), ("counts", torch.int64, (5,))):
        buf = manifest.tensors[f"engine/buffers/{name}"]
        assert (buf.dtype, buf.shape, len(stored_boxes(manifest, f"engine/buffers/{name}"))) == (dtype, shape, 1)
    assert not any("scratch" in k or "head.weight" in k for k in manifest.tensors)  # non-persistent buffer, tied alias

    at_save = runs["save"][0][precision]["at_save"]["tensors"]
    for name in ("l2.weight", "temperature", "embed.weight"):
        assert same_bits(tensors[f"engine/fp32/{name}"], at_save[f"fp32/{name}"].reshape(-1))
        assert same_bits(tensors[f"engine/optim/exp_avg/{name}"], at_save[f"exp_avg/{name}"].reshape(-1))
    assert same_bits(tensors["engine/frozen/frozen.weight"], at_save["lp/frozen.weight"].reshape(-1))

    engine = tree["engine"]
    assert engine["kind"] == "deepspeed_engine" and set(engine["state"]) == {"fp32", "optim", "frozen", "buffers"}
    meta = engine["meta"]
    assert meta["zero_stage"] == 3 and meta["world_size"] == 2 and meta["aliases"] == {"head.weight": "embed.weight"}
    assert meta["params"]["l2.weight"] == {
        "shape": [17, 29],
        "dtype": "float32" if precision == "fp32" else "bfloat16",
        "group": 0,
    }
    assert meta["params"]["frozen.weight"]["group"] is None
    assert [len(g["params"]) for g in meta["param_groups"]] == [4, 6]
    assert meta["param_groups"][1]["hyper"]["lr"] == pytest.approx(3e-3 * 0.7**2)
    assert {e["state"]["step"]["tensor"]["value"] for e in meta["optimizer_scalars"]} == {2.0}
    assert meta["counters"] == {"global_steps": 2, "global_samples": 8, "skipped_steps": 0, "micro_steps": 2}
    assert tree["sched"]["kind"] == "stateful" and tree["step"] == {"kind": "value", "state": 2}

    # `shardsafe inspect` shows each flat tensor's parameter shape
    from shardsafe.cli.inspect import describe_checkpoint, format_inspection

    info = describe_checkpoint(path)
    shown = {t["key"]: t.get("param_shape") for t in info["tensors"]}
    assert shown["engine/fp32/l2.weight"] == shown["engine/optim/exp_avg/l2.weight"] == [17, 29]
    assert shown["engine/buffers/scale"] is None
    assert "[493] of [17, 29]" in format_inspection(info)


@pytest.mark.parametrize("precision", ("bf16", "fp32"))
def test_export_of_an_engine_checkpoint(runs: dict[str, Any], precision: str, tmp_path: Path) -> None:
    """`shardsafe export` of a checkpoint saved from an engine: the default key finds the engine entry,
    parameters get their shapes back (fp32 master weights, as zero_to_fp32 gives; frozen ones in their
    own dtype), buffers come as stored and the tied alias is written once."""
    from shardsafe.hf.export import iter_output

    out = shardsafe.export_hf(runs["root"] / f"ss_{precision}", tmp_path / "hf", progress=False)
    got = dict(iter_output(out))
    at_save = runs["save"][0][precision]["at_save"]["tensors"]
    masters = {k.split("/", 1)[1]: v for k, v in at_save.items() if k.startswith("fp32/")}
    frozen = {
        k.split("/", 1)[1]: v for k, v in at_save.items() if k.startswith("lp/") and k.split("/", 1)[1] not in masters
    }
    assert masters and all(same_bits(got[name], value) for name, value in masters.items())
    assert "frozen.weight" in frozen and all(same_bits(got[name], value) for name, value in frozen.items())
    assert (got["scale"].dtype, got["scale"].shape, got["counts"].dtype) == (torch.float32, (13,), torch.int64)
    assert sorted(got) == sorted([*masters, *frozen, "scale", "counts"])  # no head.weight (tied), no scratch
