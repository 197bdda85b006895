"""shardsafe.integrations.lightning: real Lightning Trainers (CPU, gloo) save through shardsafe and resume on
other world sizes and layouts bit-exactly; ModelCheckpoint's rotation, "last" and "best" on folders; what is
refused at save; another run's checkpoints are never replaced or deleted."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning_scripts"))

import lit_utils  # noqa: E402

import shardsafe  # noqa: E402
from dist_utils import assert_optimizer_equal, assert_tensors_equal, launch, run_ranks  # noqa: E402

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

EVERY_EPOCH = {"every_n_epochs": 1, "save_top_k": -1, "save_last": True}


def _fit(world: int, root: Path | str, layout: str, epochs: int, work: Path, **opts: Any) -> dict[str, Any]:
    return run_ranks(lit_utils.fit_run, world, str(root), layout, epochs, opts, work_dir=work, timeout=300)[0]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """2 ranks, FSDP2: 2 epochs (4 steps), a checkpoint each epoch and last.ckpt."""
    root = tmp_path_factory.mktemp("lightning-first")
    return root, _fit(2, root, "fsdp", 2, root / "work", checkpoint=EVERY_EPOCH)


def _assert_resumed_exactly(resumed: dict[str, Any], saved: dict[str, Any], what: str) -> None:
    model, optim = resumed["start"]
    assert_tensors_equal(model, saved["end"][0], f"{what}: params")
    assert_optimizer_equal(optim, saved["end"][1], f"{what}: optimizer")


def test_checkpoints_are_shardsafe_folders(first: tuple[Path, dict[str, Any]]) -> None:
    root, result = first
    names = sorted(p.name for p in (root / "ckpts").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    summary = shardsafe.verify(root / "ckpts" / "last.ckpt")
    assert summary["world_size"] == 2
    tree = json.loads((root / "ckpts" / "last.ckpt" / "state.json").read_text())
    assert sorted(tree) == ["lightning", "optimizer_0", "state_dict"]
    rest = tree["lightning"]["state"]
    assert rest["global_step"] == 4 and rest["epoch"] == 1
    assert "loops" in rest and "callbacks" in rest and "lr_schedulers" in rest
    assert rest["hyper_parameters"]["layout"] == "fsdp"
    assert result["last"].endswith("last.ckpt")


def _copy(root: Path, to: Path) -> Path:
    shutil.copytree(root / "ckpts", to / "ckpts", symlinks=True)
    return to


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_resume_on_one_process_plain(first: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """2 FSDP2 ranks -> 1 process, plain module: params and AdamW moments bit-exact; the loop, the LR schedule
    and ModelCheckpoint continue (global step 8, its next checkpoints written next to the old ones)."""
    root, saved = first
    root = _copy(root, tmp_path / "run")
    resumed = _fit(
        1, root, "plain", 4, tmp_path / "work", ckpt_path=str(root / "ckpts" / "last.ckpt"), checkpoint=EVERY_EPOCH
    )
    _assert_resumed_exactly(resumed, saved, "2 ranks -> 1")
    assert resumed["global_step"] == 8 and len(resumed["losses"]) == 4
    assert resumed["lr"] == pytest.approx(0.05 * 0.5**2)  # StepLR(step_size=3) stepped per step: 8 steps
    assert _visible(root / "ckpts") == [
        "epoch=0-step=2.ckpt",
        "epoch=1-step=4.ckpt",
        "epoch=2-step=6.ckpt",
        "epoch=3-step=8.ckpt",
        "last-v1.ckpt",  # ModelCheckpoint restores its paths only in the dirpath it saved from (this is a copy)
        "last.ckpt",
    ]
    assert shardsafe.verify(root / "ckpts" / "last-v1.ckpt")["world_size"] == 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same training uninterrupted: 2 ranks, FSDP2, 4 epochs."""
    root = tmp_path_factory.mktemp("lightning-reference")
    return _fit(2, root, "fsdp", 4, root / "work")


def test_resume_last_same_layout_continues_bit_exactly(
    first: tuple[Path, dict[str, Any]], reference: dict[str, Any], tmp_path: Path
) -> None:
    root = _copy(first[0], tmp_path / "run")
    resumed = _fit(2, root, "fsdp", 4, tmp_path / "work", ckpt_path="last", checkpoint=EVERY_EPOCH)
    _assert_resumed_exactly(resumed, first[1], "last")
    assert resumed["losses"] == reference["losses"][4:]
    assert_tensors_equal(resumed["end"][0], reference["end"][0], "params after the resumed run")
    assert_optimizer_equal(resumed["end"][1], reference["end"][1], "optimizer after the resumed run")


@pytest.mark.stress
def test_resume_one_process_losses_continue(
    first: tuple[Path, dict[str, Any]], reference: dict[str, Any], tmp_path: Path
) -> None:
    root = _copy(first[0], tmp_path / "run")
    resumed = _fit(1, root, "plain", 4, tmp_path / "work", ckpt_path=str(root / "ckpts" / "last.ckpt"))
    assert resumed["losses"] == pytest.approx(reference["losses"][4:], rel=1e-5)
    assert resumed["lr"] == reference["lr"]


def test_resume_fsdp_as_tensor_parallel(
    first: tuple[Path, dict[str, Any]], reference: dict[str, Any], tmp_path: Path
) -> None:
    """FSDP2 (dp=2) -> tensor parallel (tp=2): the same values, resharded."""
    root = _copy(first[0], tmp_path / "run")
    resumed = _fit(2, root, "tp", 4, tmp_path / "work", ckpt_path=str(root / "ckpts" / "epoch=1-step=4.ckpt"))
    _assert_resumed_exactly(resumed, first[1], "FSDP2 -> TP")
    assert resumed["losses"] == pytest.approx(reference["losses"][4:], rel=1e-5)


def test_rotation_top_k_best_and_validate(tmp_path: Path) -> None:
    """save_top_k=2 by train_loss every step, save_last: only the 2 best and last.ckpt stay (retired ones leave
    nothing behind); trainer.validate(ckpt_path="best") loads the best one's params exactly."""
    checkpoint = {"monitor": "train_loss", "mode": "min", "save_top_k": 2, "every_n_train_steps": 1, "save_last": True}
    result = _fit(2, tmp_path, "fsdp", 4, tmp_path / "work", checkpoint=checkpoint, validate="best")
    ckpts = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert len(names) == 3 and "last.ckpt" in names, names  # nothing hidden left either
    losses = result["losses"]
    best_two = sorted(range(len(losses)), key=lambda i: losses[i])[:2]
    assert sorted(int(n.split("step=")[1].split(".")[0]) for n in names if n != "last.ckpt") == sorted(
        i + 1 for i in best_two
    )
    best_step = int(Path(result["best"]).name.split("step=")[1].split(".")[0])
    assert best_step == best_two[0] + 1
    assert_tensors_equal(result["validated"], result["steps"][best_step], "validate(ckpt_path='best')")
    for name in names:
        shardsafe.verify(ckpts / name)


def test_new_run_never_deletes_previous_runs_checkpoints(tmp_path: Path) -> None:
    """Lightning #21813: a second run in the same dirpath resumes from the first run's checkpoint with
    save_top_k=2 and save_last; its restored best_k_models name the first run's folders, and it deletes none
    of them; the restored last_model_path names the first run's last.ckpt, which it does not resume from:
    it saves last-v1.ckpt beside it (from the start, not failing after an epoch) and leaves last.ckpt at step 4;
    its own rotated checkpoints do go."""
    checkpoint = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 1, "save_last": True}
    first = _fit(2, tmp_path, "fsdp", 2, tmp_path / "work1", checkpoint=checkpoint)
    before = _visible(tmp_path / "ckpts")
    assert len(before) == 3 and "epoch=1-step=4.ckpt" in before and "last.ckpt" in before, before
    ckpt = str(tmp_path / "ckpts" / "epoch=1-step=4.ckpt")
    second = _fit(2, tmp_path, "fsdp", 4, tmp_path / "work2", ckpt_path=ckpt, checkpoint=checkpoint)
    losses = first["losses"] + second["losses"]
    assert sorted(losses[4:])[1] < min(losses[:4]), losses  # the second run's rotation did try to drop both
    after = _visible(tmp_path / "ckpts")
    for name in before:
        assert name in after, (before, after)
        shardsafe.verify(tmp_path / "ckpts" / name)
    assert _step_of(tmp_path / "ckpts" / "last.ckpt") == 4
    assert _step_of(tmp_path / "ckpts" / "last-v1.ckpt") == 8 and second["last"].endswith("last-v1.ckpt")
    best_two = sorted(range(4, 8), key=lambda i: losses[i])[:2]
    assert sorted(n for n in after if n not in before) == sorted(
        ["last-v1.ckpt", *(f"epoch={i // 2}-step={i + 1}.ckpt" for i in best_two)]
    ), (losses, after)


def test_kill_mid_save_leaves_previous_loadable(first: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """SIGKILL of rank 1 while it writes its shard of the next checkpoint: the earlier checkpoints stay and
    verify, the partial one is invisible (hidden temp folder), and "last" resumes from the old last.ckpt."""
    root = _copy(first[0], tmp_path / "run")
    before = _visible(root / "ckpts")
    opts = {"ckpt_path": str(root / "ckpts" / "last.ckpt"), "checkpoint": EVERY_EPOCH, "crash_at": "save:mid-write@1"}
    result = launch(lit_utils.fit_run, 2, str(root), "fsdp", 4, opts, work_dir=tmp_path / "work", timeout=300)
    assert not result.ok and result.exitcodes[1] == -9, result.describe()
    assert _visible(root / "ckpts") == before
    for name in before:
        shardsafe.verify(root / "ckpts" / name)
    resumed = _fit(1, root, "plain", 3, tmp_path / "work2", ckpt_path="last", checkpoint=EVERY_EPOCH)
    _assert_resumed_exactly(resumed, first[1], "after the kill")


def test_unstorable_hyper_parameter_refused_before_writing(tmp_path: Path) -> None:
    """A hyper-parameter JSON cannot hold: FormatError naming the entry and the remedy; nothing at the path."""
    result = launch(
        lit_utils.fit_run,
        1,
        str(tmp_path),
        "plain",
        1,
        {"checkpoint": EVERY_EPOCH, "hparams": {"act": torch.nn.ReLU()}},
        work_dir=tmp_path / "work",
        timeout=300,
    )
    assert not result.ok
    log = result.logs[0]
    assert "FormatError" in log and "'hyper_parameters'" in log and "save_hyperparameters(ignore=" in log, log[-3000:]
    assert not (tmp_path / "ckpts").exists() or _visible(tmp_path / "ckpts") == []


def test_ddp_checkpoint_resumes_under_model_parallel(tmp_path: Path) -> None:
    """ShardsafeDDPStrategy on 2 ranks (the replicated weights written once) -> ShardsafeModelParallelStrategy on
    1 process: the same parameter names, params and moments bit-exact."""
    saved = _fit(2, tmp_path, "ddp", 2, tmp_path / "work", checkpoint=EVERY_EPOCH, module_layout="plain")
    manifest = json.loads((tmp_path / "ckpts" / "last.ckpt" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    resumed = _fit(1, tmp_path, "plain", 3, tmp_path / "work2", ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    _assert_resumed_exactly(resumed, saved, "DDP -> 1 process")


def test_fabric_save_load_other_world_size(tmp_path: Path) -> None:
    """fabric.save (async_save=True: training goes on 2 steps while it commits) on 2 FSDP2 ranks -> fabric.load
    on 1 process: model and AdamW state bit-exact as at the save, the plain value replaced in place, what the
    state did not ask for returned."""
    path = str(tmp_path / "fabric.ckpt")
    saved = run_ranks(lit_utils.fabric_run, 2, path, "save", False, True, work_dir=tmp_path / "w1", timeout=300)[0]
    shardsafe.verify(path)
    loaded = run_ranks(lit_utils.fabric_run, 1, path, "load", work_dir=tmp_path / "w2", timeout=300)[0]
    assert_tensors_equal(loaded["model"], saved["model"], "fabric model")
    assert_optimizer_equal(loaded["optimizer"], saved["optimizer"], "fabric optimizer")
    assert loaded["step"] == 3
    assert loaded["remainder"] == {"note": {"text": "hello", "values": [1, 2.5]}}


def test_resume_from_lightnings_own_model_parallel_checkpoint(tmp_path: Path) -> None:
    """A run switches mid-way: Lightning's own ModelParallelStrategy (DCP items + meta.pt) on 2 ranks, then
    ShardsafeModelParallelStrategy on 1 process: params and moments bit-exact, meta.pt read through the
    restricted unpickler (loops continue: global step 6 after one more epoch), new checkpoints are shardsafe's."""
    native = _fit(2, tmp_path, "mp-native", 2, tmp_path / "w1", checkpoint=EVERY_EPOCH)
    last = tmp_path / "ckpts" / "last.ckpt"
    assert (last / "meta.pt").is_file() and not (last / "manifest.json").exists()
    resumed = _fit(1, tmp_path, "plain", 3, tmp_path / "w2", ckpt_path=str(last), checkpoint=EVERY_EPOCH)
    _assert_resumed_exactly(resumed, native, "Lightning's DCP -> shardsafe")
    assert resumed["global_step"] == 6
    shardsafe.verify(tmp_path / "ckpts" / "epoch=2-step=6.ckpt")


def _load_whole(path: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A Lightning checkpoint of the strategies loaded here, in one process, into a plain module and AdamW."""
    module = lit_utils.make_module("plain")
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)
    shardsafe.load(path, {"state_dict": module, "optimizer_0": optimizer}, strict=False)
    return lit_utils.full_model_state(module), lit_utils.full_optimizer_state(module, optimizer)


def test_async_save_commits_while_training_continues(tmp_path: Path) -> None:
    """async_save=True on 2 FSDP2 ranks, a save every step (top-2 by loss and last.ckpt), each fsync of the
    save's thread slowed by 20 ms: training starts the next steps while a save is still committing; every
    kept checkpoint equals the state at its save bit for bit though the model changed since; rotation
    removed only after the commit (2 best + last, nothing hidden left); after fit (teardown waited) the
    final last.ckpt is committed."""
    checkpoint = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 1, "save_last": True}
    opts = {
        "checkpoint": checkpoint,
        "strategy": {"async_save": True},
        "optim_steps": True,
        "slow_background_fsync": 0.02,
    }
    result = _fit(2, tmp_path, "fsdp", 2, tmp_path / "work", **opts)
    assert any(result["in_flight"][1:]), result["in_flight"]  # a step began while a save was committing
    assert not result["in_flight_after_fit"]
    ckpts = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert len(names) == 3 and "last.ckpt" in names, names  # nothing hidden left behind either
    losses = result["losses"]
    best_two = sorted(range(len(losses)), key=lambda i: losses[i])[:2]
    assert sorted(n for n in names if n != "last.ckpt") == sorted(f"epoch={i // 2}-step={i + 1}.ckpt" for i in best_two)
    for name in names:
        shardsafe.verify(ckpts / name)
        step = 4 if name == "last.ckpt" else int(name.split("step=")[1].split(".")[0])
        params, optim = _load_whole(ckpts / name)
        assert_tensors_equal(params, result["steps"][step][0], f"{name} vs the state at its save")
        assert_optimizer_equal(optim, result["steps"][step][1], f"{name} vs the optimizer at its save")


def test_async_save_failure_is_raised_by_the_next_save_and_keeps_the_previous(tmp_path: Path) -> None:
    """The save of step 3 fails in the background on rank 1 (EIO after its shard is written): the next save
    raises SaveError on every rank, nothing of step 3 is visible, and ModelCheckpoint's removal of step 2,
    queued behind the failed save, never ran: the last good checkpoint stays loadable."""
    opts = {
        "checkpoint": {"every_n_train_steps": 1, "save_top_k": 1},
        "strategy": {"async_save": True},
        "fail_from": (2, "save:after-write@1"),
    }
    result = launch(lit_utils.fit_run, 2, str(tmp_path), "fsdp", 2, opts, work_dir=tmp_path / "work", timeout=300)
    assert not result.ok
    for log in result.logs:
        assert "SaveError: background save failed" in log and "injected I/O error" in log, log[-3000:]
    assert _visible(tmp_path / "ckpts") == ["epoch=0-step=2.ckpt"]
    shardsafe.verify(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")


def test_rotation_on_s3_and_a_new_run_never_deletes_the_previous_runs(s3_bucket: str, tmp_path: Path) -> None:
    """ModelCheckpoint with an s3:// dirpath (a real S3 API, moto on 127.0.0.1), 2 FSDP2 ranks: save_top_k=2 by
    loss every step and save_last leave the 2 best and last.ckpt (verified below), no retired prefix left. A second
    run in the same dirpath resumes from the first run's last.ckpt (step 4: params and moments bit-exact): its
    restored best_k_models name the first run's checkpoints, and it deletes none of them (Lightning #21813);
    its own checkpoints do rotate (the 2 best of its steps stay)."""
    from shardsafe.storage.remote import RemoteDir

    root = f"s3://{s3_bucket}/run"
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    checkpoint = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 1, "save_last": True}
    first = _fit(2, root, "fsdp", 2, tmp_path / "w1", checkpoint=checkpoint, env=env, optim_steps=True)
    ckpts = RemoteDir(f"{root}/ckpts")
    before = sorted(ckpts.list())
    losses = first["losses"]
    best_two = sorted(range(4), key=lambda i: losses[i])[:2]
    assert before == sorted(["last.ckpt", *(f"epoch={i // 2}-step={i + 1}.ckpt" for i in best_two)]), before
    resume_from = f"{root}/ckpts/last.ckpt"
    checkpoint = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 1}
    second = _fit(2, root, "fsdp", 4, tmp_path / "w2", checkpoint=checkpoint, env=env, ckpt_path=resume_from)
    model, optim = second["start"]
    assert_tensors_equal(model, first["steps"][4][0], "s3 resume: params")
    assert_optimizer_equal(optim, first["steps"][4][1], "s3 resume: optimizer")
    losses = first["losses"] + second["losses"]
    assert sorted(losses[4:])[1] < min(losses[:4]), losses  # the second run's rotation did try to drop both
    ckpts.fs.invalidate_cache()  # s3fs keeps this process's earlier listing; the ranks wrote since
    after = sorted(ckpts.list())
    for name in before:
        assert name in after, (before, after)
        shardsafe.verify(f"{root}/ckpts/{name}")
    best_two = sorted(range(4, 8), key=lambda i: losses[i])[:2]
    assert sorted(n for n in after if n not in before) == sorted(
        f"epoch={i // 2}-step={i + 1}.ckpt" for i in best_two
    ), (losses, after)


@pytest.fixture(scope="module")
def first12(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """2 FSDP2 ranks, a global batch of 12 (so 3 ranks split it evenly): 2 epochs with a checkpoint each, and
    the same training uninterrupted for 4 epochs (the reference)."""
    root = tmp_path_factory.mktemp("lightning-first12")
    saved = _fit(2, root, "fsdp", 2, root / "work", checkpoint=EVERY_EPOCH, global_batch=12)
    reference = _fit(2, root / "reference", "fsdp", 4, root / "work-ref", global_batch=12)
    return root, saved, reference


@pytest.mark.stress
@pytest.mark.parametrize(("world", "layout"), [(3, "fsdp"), (4, "fsdp-tp")])
def test_resume_on_other_ranks_and_2d_layout(
    first12: tuple[Path, dict[str, Any], dict[str, Any]], world: int, layout: str, tmp_path: Path
) -> None:
    """2 FSDP2 ranks -> 3 FSDP2 ranks (uneven shards), and -> FSDP2 x TP on 4 ranks (dp=2, tp=2: fc1 column-wise,
    fc2 row-wise, each then sharded over dp): params and AdamW moments bit-exact at the start, and the continued
    losses equal the uninterrupted 2-rank run's (to float rounding: 3 ranks or a TP matmul sum in another order)."""
    root, saved, reference = first12
    root = _copy(root, tmp_path / "run")
    ckpt = str(root / "ckpts" / "last.ckpt")
    resumed = _fit(world, root, layout, 4, tmp_path / "work", ckpt_path=ckpt, global_batch=12)
    # fc1.weight: a 2-D DTensor (dp: FSDP2's strided shard of TP's shard, tp: Shard(0)) / 1-D (dp: Shard(0))
    assert len(resumed["placements"]) == (2 if layout == "fsdp-tp" else 1), resumed["placements"]
    _assert_resumed_exactly(resumed, saved, f"2 FSDP2 ranks -> {world} ranks {layout}")
    assert resumed["global_step"] == 8
    assert resumed["losses"] == pytest.approx(reference["losses"][4:], rel=1e-5)
    assert resumed["lr"] == reference["lr"]


def _step_of(path: Path | str) -> int:
    """The global step a checkpoint of the strategies holds (its manifest's metadata)."""
    from shardsafe.api.checkpoint import location
    from shardsafe.integrations.lightning.checkpoints import META_KEY
    from shardsafe.manager.catalog import read_manifest

    return int(read_manifest(location(str(path))).metadata[META_KEY]["global_step"])


@pytest.mark.parametrize("symlinks", [pytest.param(True, marks=pytest.mark.stress), False])  # True: Lightning's own
def test_save_last_link_on_folders(tmp_path: Path, symlinks: bool) -> None:
    """save_last="link" with top-2 rotation every step, 2 FSDP2 ranks. With symlinks, last.ckpt is a relative
    symlink to the newest saved checkpoint; where os.symlink fails (Lightning then calls shutil.copy, which
    cannot copy a folder) it is a copy of it, published whole (a hidden folder renamed into place, replaced
    atomically at each new link). Either way last.ckpt loads bit-exact as that step's params and moments, and
    nothing hidden is left."""
    checkpoint = {"monitor": "train_loss", "save_top_k": 2, "every_n_train_steps": 1, "save_last": "link"}
    result = _fit(
        2, tmp_path, "fsdp", 2, tmp_path / "work", checkpoint=checkpoint, optim_steps=True, no_symlinks=not symlinks
    )
    ckpts = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpts.iterdir())
    assert len(names) == 3 and "last.ckpt" in names, names
    last = ckpts / "last.ckpt"
    step = _step_of(last)
    losses = result["losses"]
    top = [i + 1 for i in range(4) if sorted(losses[: i + 1]).index(losses[i]) < 2]  # the steps top-2 saved
    assert step == top[-1], (step, losses)
    if symlinks:
        assert last.is_symlink() and os.readlink(last) == f"epoch={(step - 1) // 2}-step={step}.ckpt"
    else:
        assert not last.is_symlink() and last.is_dir()
    shardsafe.verify(last)
    params, optim = _load_whole(last)
    assert_tensors_equal(params, result["steps"][step][0], "last.ckpt params")
    assert_optimizer_equal(optim, result["steps"][step][1], "last.ckpt optimizer")


@pytest.mark.stress  # retire() itself is tested under kills in tests/manager (test_kill_during_rotation_...)
def test_kill_mid_removal_leaves_nothing_that_looks_loadable(tmp_path: Path) -> None:
    """ModelCheckpoint(save_top_k=1) every step; rank 0 is SIGKILLed while it deletes step 1 (renamed hidden, its
    manifest gone, data files left): only step 2 is visible and it verifies; the half-deleted folder is hidden,
    fails verification, and `shardsafe gc` removes it."""
    opts = {"checkpoint": {"every_n_train_steps": 1, "save_top_k": 1}, "crash_at": "retention:mid-delete@0"}
    result = launch(lit_utils.fit_run, 2, str(tmp_path), "fsdp", 2, opts, work_dir=tmp_path / "work", timeout=300)
    assert not result.ok and result.exitcodes[0] == -9, result.describe()
    ckpts = tmp_path / "ckpts"
    assert _visible(ckpts) == ["epoch=0-step=2.ckpt"]
    shardsafe.verify(ckpts / "epoch=0-step=2.ckpt")
    hidden = [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and "deleting" in hidden[0].name and any(hidden[0].iterdir()), hidden
    with pytest.raises(shardsafe.ShardsafeError):
        shardsafe.verify(hidden[0])
    assert shardsafe.collect_garbage(ckpts) == hidden


@pytest.mark.stress  # a fresh interpreter (imports torch and Lightning: ~10 s)
def test_async_save_in_flight_at_exit_is_finished(tmp_path: Path) -> None:
    """trainer.save_checkpoint after fit with async_save=True, then the interpreter exits at once: the save still
    in flight is finished at exit (with a warning), committed and verifying."""
    import subprocess

    script = Path(__file__).resolve().parent / "lightning_scripts" / "async_exit.py"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in flight at exit: True" in done.stdout and "finishing the Lightning checkpoint save" in done.stderr
    assert shardsafe.verify(tmp_path / "after-fit.ckpt")["world_size"] == 1
