"""ShardsafeCheckpointManager built exactly as torchtitan's Trainer builds its checkpointer, on CPU (gloo).

torchtitan's ``Trainer`` itself cannot run here: importing ``torchtitan.trainer`` needs tensorboard and
its metrics/tokenizer/dataset stack (CUDA devices, HF datasets), none of which is installed for the
tests. So each rank reproduces what ``Trainer.__init__`` and ``Trainer.train`` do around the
checkpointer, with torchtitan's own pieces:

* the model: torchtitan's llama3 debugmodel recipe made tiny and parallelised by torchtitan's
  ``parallelize_llama`` (``test_torchtitan.build``: its CPU adaptations, meshes on "cpu", SDPA attention);
* ``OptimizersContainer.Config(...).build(model_parts=...)`` (AdamW, "for-loop"),
  ``LRSchedulersContainer.Config(...).build(optimizers=..., training_steps=...)`` (warmup + linear decay);
* a torchtitan ``ParallelAwareDataloader`` (a torchdata ``StatefulDataLoader``) over a small stateful
  iterable dataset of random token ids split by data-parallel rank (instead of an HF dataset + tokenizer);
* ``states={"train_state": <the step and tokens seen, as Trainer.state_dict gives them>}``;
* ``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=..., states=...,
  sd_adapter=..., base_folder=...)``, then the Trainer's loop: ``checkpointer.load(step=config.load_step)``,
  per step forward/backward, ``maybe_wait_for_staging()``, ``optimizers.step()``, ``lr_schedulers.step()``,
  ``checkpointer.save(step, last_step=step == steps)``, and ``close()``.

A run is killed (``os._exit`` on every rank, no close) after step 5 with ``interval=2``; the next run
resumes from step 4 and must hold the uninterrupted run's state bit for bit and continue its losses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

pytest.importorskip("torchtitan")
pytest.importorskip("torchdata")

from test_torchtitan import BATCH, SEQ, VOCAB, build, tiny_config  # noqa: E402  (the llama3 client, CPU adaptations)
from torchtitan.components.checkpointer import CheckpointManager as TorchtitanDcpManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

import nd_utils  # noqa: E402
import shardsafe  # noqa: E402
from dist_utils import assert_tensors_equal, launch, run_ranks  # noqa: E402
from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager  # noqa: E402

KILLED = 57  # the exit code of a rank killed after its step


class TokenStream(IterableDataset, torch.distributed.checkpoint.stateful.Stateful):
    """Random token ids, one sample per index, the indices of this data-parallel rank only (what
    torchtitan's HF datasets do with ``split_dataset_by_node``); its position is its state."""

    def __init__(self, dp_rank: int, dp_world_size: int) -> None:
        self.dp_rank, self.dp_world_size, self.next_sample = dp_rank, dp_world_size, 0

    def __iter__(self) -> Any:
        while True:
            index = self.next_sample * self.dp_world_size + self.dp_rank
            self.next_sample += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(7000 + index))
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_sample = state["next_sample"]


class TrainState:
    """What ``Trainer.state_dict`` / ``load_state_dict`` save: the step and the tokens seen."""

    def __init__(self) -> None:
        self.step = self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def run(
    rank: int,
    world_size: int,
    layout: str,
    base: str,
    steps: int,
    checkpoint: dict[str, Any],
    kill_after: int | None = None,
    record_at: tuple[int, ...] = (),
    seed: int = 0,
    dcp_manager: bool = False,
    hf_assets: str | None = None,
) -> dict[str, Any]:
    """One torchtitan training job (the Trainer's calls around its checkpointer); see the module docstring.
    A resumed run is built from another ``seed``, so what it holds after the load came from the checkpoint.
    The ``sd_adapter`` is torchtitan's llama3 one, with ``hf_assets`` as its ``hf_assets_path``."""
    model, _, dp_mesh = build(layout, world_size, seed=seed)
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
            )
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    dataloader = ParallelAwareDataloader(
        TokenStream(dp_rank, dp_size), dp_rank=dp_rank, dp_world_size=dp_size, batch_size=BATCH // dp_size
    )
    train_state = TrainState()
    config = (TorchtitanDcpManager if dcp_manager else ShardsafeCheckpointManager).Config(**checkpoint)
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=Llama3StateDictAdapter(tiny_config(), hf_assets),
        base_folder=base,
    )
    if config.create_seed_checkpoint:  # torchtitan's train.py: this save instead of training
        checkpointer.save(curr_step=0, last_step=True)
        checkpointer.close()
        return {"seed": whole(model, optimizers)}
    checkpointer.load(step=config.load_step)
    loaded_at = train_state.step
    loaded = whole(model, optimizers) if checkpoint.get("enable") else None
    losses, recorded = {}, {}
    batches = iter(dataloader)
    while train_state.step < steps:
        train_state.step += 1
        inputs, labels = next(batches)
        logits = model(inputs["input"])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (BATCH * SEQ)
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += labels.numel()
        total = loss.detach().clone()
        if dp_mesh is not None:
            dist.all_reduce(total, group=dp_mesh.get_group())
        losses[train_state.step] = float(total.item())
        checkpointer.save(train_state.step, last_step=train_state.step == steps)
        if train_state.step in record_at:
            recorded[train_state.step] = {
                "state": whole(model, optimizers),
                "lr_epoch": lr_schedulers.state_dict()["last_epoch"],
                "next_sample": dataloader.dataset.next_sample,
            }
        if train_state.step == kill_after:
            checkpointer.maybe_wait_for_saving()  # a killed rank's in-flight write may or may not land: not tested here
            os._exit(KILLED)
    checkpointer.close()
    return {
        "losses": losses,
        "loaded_at": loaded_at,
        "loaded": loaded,
        "recorded": recorded,
        "lr_epoch": lr_schedulers.state_dict()["last_epoch"],
    }


def whole(model: torch.nn.Module, optimizers: OptimizersContainer) -> dict[str, torch.Tensor]:
    (optimizer,) = optimizers.optimizers
    return nd_utils.whole_state(model, optimizer)


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / "manifest.json").is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted 2-rank FSDP2 run of 6 steps, checkpointing disabled (the manager does nothing then)."""
    work = tmp_path_factory.mktemp("reference")
    return run_ranks(run, 2, "fsdp", str(work), 6, {"enable": False}, None, (2, 4), work_dir=work)[0]


def test_killed_and_resumed_bit_exact(tmp_path: Path, reference: dict[str, Any]) -> None:
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 2, "lease_timeout": 3.0}
    killed = launch(run, 2, "fsdp", str(tmp_path), 6, checkpoint, 5, work_dir=tmp_path / "w1")
    assert not killed.ok and "57" in killed.describe(), killed.describe()
    folder = tmp_path / "ckpt"
    assert steps_in(folder) == [2, 4]
    assert shardsafe.verify(folder / "step-0000000004")["world_size"] == 2

    resumed = run_ranks(run, 2, "fsdp", str(tmp_path), 6, checkpoint, None, (), 99, work_dir=tmp_path / "w2")
    for rank, result in enumerate(resumed):
        assert result["loaded_at"] == 4, result["loaded_at"]
        assert_tensors_equal(result["loaded"], reference["recorded"][4]["state"], f"resumed rank {rank}")
    assert resumed[0]["losses"] == {5: reference["losses"][5], 6: reference["losses"][6]}  # bit for bit
    assert resumed[0]["lr_epoch"] == reference["lr_epoch"]
    # step 6 is the last: a model-only save (last_save_model_only defaults to True); keep_latest_k=2 keeps 4 and 6
    assert steps_in(folder) == [4, 6]
    listed = shardsafe.CheckpointManager(folder, read_only=True)
    assert listed.steps() == [4, 6]
    final = (folder / "step-0000000006" / "state.json").read_text()
    assert '"model"' in final and '"optimizer"' not in final and '"rng"' not in final


def test_resumes_from_the_dcp_managers_folder(tmp_path: Path, reference: dict[str, Any]) -> None:
    """A run of torchtitan's own DCP manager (4 steps, interval 2) switched to shardsafe by its Config line:
    the next run loads the DCP manager's step-4 folder in place, bit for bit (the data position excepted:
    torchtitan pickles it), then saves shardsafe checkpoints beside it."""
    dcp_config = {"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}
    saved = run_ranks(run, 2, "fsdp", str(tmp_path), 4, dcp_config, None, (4,), 0, True, work_dir=tmp_path / "w1")
    assert (tmp_path / "ckpt" / "step-4" / ".metadata").is_file()
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 0}
    resumed = run_ranks(run, 2, "fsdp", str(tmp_path), 6, checkpoint, None, (), 99, work_dir=tmp_path / "w2")
    for rank, result in enumerate(resumed):
        assert result["loaded_at"] == 4
        assert_tensors_equal(result["loaded"], saved[0]["recorded"][4]["state"], f"DCP step-4 -> rank {rank}")
    assert resumed[0]["lr_epoch"] == reference["lr_epoch"]  # the LR schedule continued from the DCP step
    assert steps_in(tmp_path / "ckpt") == [6]  # shardsafe's own, next to the DCP manager's step-2 and step-4


@pytest.mark.stress
def test_2d_at_4_async_resumed_at_fsdp_2(tmp_path: Path, reference: dict[str, Any]) -> None:
    """torchtitan's dp_shard=2 x tp=2 layout at 4 ranks, saving with async_with_pinned_mem (the copy in the
    background, waited for by maybe_wait_for_staging), killed after step 3; resumed by FSDP2 at 2 ranks."""
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 2, "async_mode": "async_with_pinned_mem"}
    checkpoint["lease_timeout"] = 3.0
    killed = launch(run, 4, "2d", str(tmp_path), 6, checkpoint, 3, work_dir=tmp_path / "w1")
    assert not killed.ok and "57" in killed.describe(), killed.describe()
    assert steps_in(tmp_path / "ckpt") == [2]
    assert shardsafe.verify(tmp_path / "ckpt" / "step-0000000002")["world_size"] == 4
    resumed = run_ranks(run, 2, "fsdp", str(tmp_path), 4, checkpoint, None, (), 99, work_dir=tmp_path / "w2")
    expected = reference["recorded"][2]["state"]
    for rank, result in enumerate(resumed):
        assert result["loaded_at"] == 2
        assert result["loaded"].keys() == expected.keys()
        for key, tensor in expected.items():  # 2-D and FSDP2 reduce in another order: equal to float rounding
            torch.testing.assert_close(result["loaded"][key], tensor, rtol=1e-5, atol=1e-6, msg=f"{key} rank {rank}")
    losses = resumed[0]["losses"]
    assert [losses[3], losses[4]] == pytest.approx([reference["losses"][3], reference["losses"][4]], rel=1e-4)


def test_config_refusals(tmp_path: Path) -> None:
    """What the Config and the constructor refuse, before anything is built or written."""
    with pytest.raises(ValueError, match="async_mode"):
        ShardsafeCheckpointManager.Config(enable=True, async_mode="sometimes")
    with pytest.raises(ValueError, match="quantized"):
        ShardsafeCheckpointManager.Config(
            enable=True, initial_load_path="/x", initial_load_in_hf=True, initial_load_in_hf_quantized=True
        )
    with pytest.raises(ValueError, match="absolute"):  # torchtitan's shared check, kept
        ShardsafeCheckpointManager.Config(enable=True, initial_load_path="relative/step-4")
    with pytest.raises(ValueError, match="keep_latest_k"):  # torchtitan's shared check, kept
        ShardsafeCheckpointManager.Config(enable=True, keep_latest_k=-1)
    model = torch.nn.Linear(2, 2)
    optimizers = torch.optim.AdamW(model.parameters())
    kwargs = {"dataloader": None, "optimizers": optimizers, "lr_schedulers": None, "states": {}, "sd_adapter": None}
    config = ShardsafeCheckpointManager.Config(enable=True, exclude_from_loading=["optimzer"])
    with pytest.raises(ValueError, match="optimzer"):
        config.build(model_parts=[model], base_folder=str(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="sd_adapter"):  # as the DCP manager refuses it
        ShardsafeCheckpointManager.Config(enable=True, last_save_in_hf=True).build(
            model_parts=[model], base_folder=str(tmp_path), **kwargs
        )
    with pytest.raises(shardsafe.ShardsafeError, match="model parts"):
        ShardsafeCheckpointManager.Config(enable=True).build(
            model_parts=[model, torch.nn.Linear(2, 2)], base_folder=str(tmp_path), **kwargs
        )
    disabled = ShardsafeCheckpointManager.Config(enable=False).build(model_parts=[model], **kwargs)
    assert disabled.save(2) is False and disabled.load() is False
    assert not list(tmp_path.iterdir())  # nothing written by any of these
