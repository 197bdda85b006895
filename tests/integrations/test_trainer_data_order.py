"""``ShardsafeTrainer`` resumed on another world size continues the data order (``ReshardableSampler``).

Real ``transformers.Trainer`` runs under ``torch.distributed.run`` on CPU (gloo), from
``tests/trainer_scripts/run_trainer.py``: 2 ranks x 3 per device train 10 steps uninterrupted
(checkpoints every 3 steps), then checkpoint-6 is resumed at 3 ranks x 2 and at 1 rank x 3 x 2
accumulation steps (the global batch stays 6). Every rank records the samples of each micro-batch
it trained on; per optimizer step, all ranks together must have taken exactly the uninterrupted
run's samples, and each epoch every sample once.

The same under DeepSpeed ZeRO-3 (``use_cpu=True`` plus a DeepSpeed config; its own module fixture):
2 ranks x 3 train 10 steps uninterrupted, checkpoint-6 is resumed at 3 ranks x 2. The engine's whole
state (fp32 master weights, 16-bit weights, Adam moments and step, counters, scheduler) gathered by
DeepSpeed's own ``safe_get_full_*`` helpers right after checkpoint-6 was saved must equal, bit for bit,
what the 3 ranks hold after the resume loaded it (each rank another partition of it), and steps 7..10
must take the uninterrupted run's samples.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from safetensors.torch import load_file  # noqa: E402

import shardsafe  # noqa: E402
from dist_utils import HAVE_DEEPSPEED, TESTS_DIR, assert_tensors_equal, launch_script, wait_for_scripts  # noqa: E402
from shardsafe.data import ReshardableSampler  # noqa: E402
from shardsafe.hf.export import export_hf, iter_output  # noqa: E402

SCRIPT = TESTS_DIR / "trainer_scripts" / "run_trainer.py"
SAMPLES, GLOBAL_BATCH, STEPS, SEED = 24, 6, 10, 1  # the script's ORDER_* and seed


ENV = {"TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def errors(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in out.glob("*.error"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("order")
    wait_for_scripts(
        [launch_script("order2", SCRIPT, 2, [str(out), "order2"], cwd=out, env=ENV)],
        time.monotonic() + 180,
        "uninterrupted run",
    )
    resumed = [launch_script(f"order{n}", SCRIPT, n, [str(out), f"order{n}"], cwd=out, env=ENV) for n in (3, 1)]
    wait_for_scripts(resumed, time.monotonic() + 240, "resumed runs", lambda _: errors(out))
    return out


@pytest.fixture(scope="module")
def z3_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3: ``z3_order2`` (2 ranks, uninterrupted), then ``z3_order3`` (3 ranks, resumed from its checkpoint-6)."""
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed and g++ are needed")
    out = tmp_path_factory.mktemp("z3order")
    for name, world in (("z3_order2", 2), ("z3_order3", 3)):
        launch = launch_script(name, SCRIPT, world, [str(out), name], cwd=out, env=ENV)
        # DeepSpeed's first start compiles an op: minutes
        wait_for_scripts([launch], time.monotonic() + 600, name, lambda _: errors(out))
    return out


def taken(root: Path, name: str) -> dict[int, list[list[int]]]:
    """Per rank: ``[step, samples]`` for every micro-batch it trained on."""
    return {
        int(p.name.split(".rank")[1].split(".")[0]): json.loads(p.read_text())
        for p in (root / name).glob("taken.rank*.json")
    }


def per_step(by_rank: dict[int, list[list[int]]]) -> dict[int, Counter[int]]:
    steps: dict[int, Counter[int]] = {}
    for records in by_rank.values():
        for step, samples in records:
            steps.setdefault(step, Counter()).update(samples)
    return steps


def result(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / name / "result.json").read_text())


def test_uninterrupted_run_takes_the_global_order_each_rank_its_share(root: Path) -> None:
    by_rank = taken(root, "order2")
    assert sorted(by_rank) == [0, 1] and result(root, "order2")["sampler"] == "ReshardableSampler"
    steps = per_step(by_rank)
    assert sorted(steps) == list(range(1, STEPS + 1))
    order = ReshardableSampler(range(SAMPLES), num_replicas=1, rank=0, seed=SEED)
    per_epoch = SAMPLES // GLOBAL_BATCH
    for step, samples in steps.items():
        epoch, k = divmod(step - 1, per_epoch)
        assert samples == Counter(order.global_order(epoch)[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]), f"step {step}"
        assert all(len(s) == 3 for records in by_rank.values() for t, s in records if t == step)
    # rank r trains on block r of each global batch (as accelerate's BatchSamplerShard deals the plain Trainer's)
    assert [s for _, s in by_rank[1]][0] == order.global_order(0)[3:6]


@pytest.mark.parametrize(("name", "world"), [("order3", 3), ("order1", 1)])
def test_resume_on_another_world_size_continues_the_data_order(root: Path, name: str, world: int) -> None:
    reference = per_step(taken(root, "order2"))
    resumed = taken(root, name)
    assert sorted(resumed) == list(range(world)) and result(root, name)["world_size"] == world
    steps = per_step(resumed)
    assert sorted(steps) == list(range(7, STEPS + 1)), "the resumed run trains steps 7.. and skips nothing"
    for step in steps:
        assert steps[step] == reference[step], (
            f"{name} step {step}: {sorted(steps[step].elements())} vs {sorted(reference[step].elements())}"
        )
    # epoch 1 (steps 5-8) split by the resume at step 6: every sample exactly once
    epoch1 = sum((reference[s] for s in (5, 6)), Counter()) + sum((steps[s] for s in (7, 8)), Counter())
    assert epoch1 == Counter(range(SAMPLES))
    summary = shardsafe.verify(root / name / "train" / "checkpoint-9")
    assert "data" in summary["state_entries"] and summary["world_size"] == world


def test_a_changed_global_batch_continues_in_samples_and_an_iterable_dataset_keeps_the_trainers_sampler(
    root: Path,
) -> None:
    """Resumed from a 2 ranks x 3 checkpoint (step 6, 12 samples into epoch 1) on 1 rank x 3: accepted, as the Trainer
    accepts it; steps 7-10 take 3 samples each, the rest of epoch 1's order, so epoch 1 has every sample once."""
    one = result(root, "order1")
    other = one["other_batch"]
    assert isinstance(other, list), other
    steps = per_step({0: other})
    assert sorted(steps) == [7, 8, 9, 10] and all(sum(c.values()) == 3 for c in steps.values())
    reference = per_step(taken(root, "order2"))
    epoch1 = sum((reference[s] for s in (5, 6)), Counter()) + sum(steps.values(), Counter())
    assert epoch1 == Counter(range(SAMPLES)), "no sample of the epoch skipped or repeated"
    assert one["iterable_keeps_the_trainers_sampler"]


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3


def test_zero3_resume_on_3_ranks_loads_the_2_rank_engine_state_exactly(z3_root: Path, tmp_path: Path) -> None:
    saved, loaded = (
        load_file(z3_root / "z3_order2" / "state6.safetensors"),
        load_file(z3_root / "z3_order3" / "loaded.safetensors"),
    )
    assert {k.split("/")[0] for k in saved} == {"w16", "w32", "exp_avg", "exp_avg_sq"}
    assert (
        saved["w16/transformer.wte.weight"].dtype == torch.bfloat16
        and saved["exp_avg/transformer.wte.weight"].dtype == torch.float32
    )
    assert_tensors_equal(loaded, saved, "engine state: 3 ranks after the load vs 2 ranks at checkpoint-6")
    counters = json.loads((z3_root / "z3_order2" / "state6.json").read_text())
    assert (
        counters["adam_steps"] == [6.0]
        and counters["engine"]["global_steps"] == 6
        and counters["scheduler"]["last_epoch"] == 6
    )
    assert json.loads((z3_root / "z3_order3" / "loaded.json").read_text()) == counters, (
        "optimizer step, hyper-parameters, engine counters, scheduler"
    )
    checkpoint = z3_root / "z3_order2" / "train" / "checkpoint-6"
    assert shardsafe.verify(checkpoint)["world_size"] == 2
    # `shardsafe export`: the checkpoint's fp32 master weights
    exported = export_hf(checkpoint, tmp_path / "exported", progress=False)
    master = {k.split("/", 1)[1]: v for k, v in loaded.items() if k.startswith("w32/")}
    assert_tensors_equal(
        dict(iter_output(exported)), master, "exported checkpoint-6 vs the fp32 master weights loaded on 3 ranks"
    )


def test_zero3_resume_on_3_ranks_continues_the_data_order(z3_root: Path) -> None:
    by_rank = taken(z3_root, "z3_order2")
    assert sorted(by_rank) == [0, 1] and result(z3_root, "z3_order2")["sampler"] == "ReshardableSampler"
    reference = per_step(by_rank)
    order = ReshardableSampler(range(SAMPLES), num_replicas=1, rank=0, seed=SEED)
    for step, samples in reference.items():  # the uninterrupted ZeRO-3 run takes the global order, as under DDP
        epoch, k = divmod(step - 1, SAMPLES // GLOBAL_BATCH)
        assert samples == Counter(order.global_order(epoch)[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]), f"step {step}"
    resumed = taken(z3_root, "z3_order3")
    assert sorted(resumed) == [0, 1, 2] and result(z3_root, "z3_order3")["world_size"] == 3
    assert all(len(s) == 2 for records in resumed.values() for _, s in records)
    steps = per_step(resumed)
    assert sorted(steps) == list(range(7, STEPS + 1)), "the resumed run trains steps 7.. and skips nothing"
    for step in steps:
        assert steps[step] == reference[step], (
            f"step {step}: {sorted(steps[step].elements())} vs {sorted(reference[step].elements())}"
        )
    epoch1 = sum((reference[s] for s in (5, 6)), Counter()) + sum((steps[s] for s in (7, 8)), Counter())
    assert epoch1 == Counter(range(SAMPLES)), "epoch 1, split by the resume at step 6: every sample exactly once"
    summary = shardsafe.verify(z3_root / "z3_order3" / "train" / "checkpoint-9")
    assert summary["world_size"] == 3 and {"data", "engine"} <= set(summary["state_entries"])
