"""A small LightningModule and a Trainer run for the Lightning integration tests (imported by the ranks).

``fit_run`` trains on the ranks that call it (already in a gloo process group: dist_utils.run_ranks),
with FSDP2 (``layout="fsdp"``), tensor parallel (``"tp"``), both (``"fsdp-tp"``: tp=2), a plain
module (``"plain"``) under ``ShardsafeModelParallelStrategy``, or DDP (``"ddp"``) under
``ShardsafeDDPStrategy`` (``"ddp-native"`` / ``"mp-native"``: Lightning's own strategies). It returns
what the tests compare: the global loss of every step, and the whole model and optimizer state at the
start (after a resume) and at the end.
The global batch is 8 (``global_batch``: 12 for 3 ranks) at any world size and an epoch is 2 steps, so
runs on any number of ranks see the same samples per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import full_model_state, full_optimizer_state

GLOBAL_BATCH = 8


def _lightning() -> Any:
    import lightning.pytorch as L

    return L


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_module(layout: str, **hparams: Any) -> Any:
    L = _lightning()

    class TinyModule(L.LightningModule):
        def __init__(self, layout: str, lr: float = 0.05, **extra: Any) -> None:
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = Tiny()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            if isinstance(self.net.fc1.weight, DTensor):
                return  # configured already (trainer.validate after trainer.fit)
            if self.hparams.layout == "fsdp":
                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net.fc1, mesh=mesh)
                fully_shard(self.net, mesh=mesh)
            elif self.hparams.layout == "tp":
                mesh = self.device_mesh["tensor_parallel"]
                parallelize_module(self.net, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            elif self.hparams.layout == "fsdp-tp":  # 2-D: tensor parallel inside, FSDP2 over the data-parallel dim
                tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
                parallelize_module(self.net, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
                fully_shard(self.net.fc1, mesh=dp)
                fully_shard(self.net, mesh=dp)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyModule(layout, **hparams)


def _data(data_parallel: int, global_batch: int = GLOBAL_BATCH) -> DataLoader:
    """Two steps an epoch of ``global_batch`` samples, split over the ``data_parallel`` ranks."""
    gen = torch.Generator().manual_seed(1)
    samples = 2 * global_batch
    x, y = torch.randn(samples, 8, generator=gen), torch.randn(samples, 1, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=global_batch // data_parallel, shuffle=False)


def _record(optim_steps: bool = False, fail_from: tuple[int, str] | None = None) -> Any:
    L = _lightning()

    class Record(L.Callback):
        """Global losses per step, whole states at the start and the end of the fit."""

        def __init__(self, optim_steps: bool = False, fail_from: tuple[int, str] | None = None) -> None:
            self.fail_from = fail_from  # (global step, SHARDSAFE_FAIL_AT): saves fail from that step on
            self.optim_steps = optim_steps  # also the whole optimizer state after each step (in ``steps``)
            self.in_flight: list[bool] = []  # at each step's start: was an async save still committing?
            self.losses: list[float] = []
            self.start: Any = None
            self.end: Any = None
            self.steps: dict[int, Any] = {}  # global step -> whole params after it

        def _state(self, trainer: Any, module: Any) -> Any:
            opts = trainer.optimizers
            return full_model_state(module), full_optimizer_state(module, opts[0]) if opts else None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.start = self._state(trainer, module)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.end = self._state(trainer, module)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.in_flight.append(bool(getattr(trainer.strategy, "save_in_flight", False)))
            if self.fail_from and trainer.global_step == self.fail_from[0]:
                trainer.strategy.wait_for_save()  # the saves before this step are unaffected
                os.environ["SHARDSAFE_FAIL_AT"] = self.fail_from[1]

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"].detach().clone()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(loss)
                loss /= dist.get_world_size()
            self.losses.append(float(loss))
            self.steps[trainer.global_step] = (
                self._state(trainer, module) if self.optim_steps else full_model_state(module)
            )

    return Record(optim_steps, fail_from)


def _mesh(layout: str, world_size: int) -> tuple[int, int]:
    """(data parallel, tensor parallel) sizes of ``layout`` on ``world_size`` ranks."""
    if layout == "tp":
        return 1, world_size
    if layout == "fsdp-tp":
        return world_size // 2, 2
    return world_size, 1


def strategy_for(layout: str, world_size: int, **kwargs: Any) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from shardsafe.integrations.lightning import ShardsafeDDPStrategy, ShardsafeModelParallelStrategy

    if layout in ("ddp", "ddp-native"):
        cls = ShardsafeDDPStrategy if layout == "ddp" else DDPStrategy
        return cls(process_group_backend="gloo", **kwargs)
    cls = ModelParallelStrategy if layout == "mp-native" else ShardsafeModelParallelStrategy
    dp, tp = _mesh(layout, world_size)
    return cls(data_parallel_size=dp, tensor_parallel_size=tp, process_group_backend="gloo", **kwargs)


def _slow_background_fsync(seconds: float) -> None:
    """Every fsync of the async save's thread takes ``seconds`` longer (a slow disk), so training visibly
    runs on while a save commits; the training thread's own calls are not slowed."""
    import threading

    real = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name == "shardsafe-lightning-save":
            time.sleep(seconds)
        real(fd)

    os.fsync = fsync  # type: ignore[assignment]


def _no_symlinks() -> None:
    """os.symlink fails as on a filesystem without symlinks (ModelCheckpoint's save_last="link" falls back)."""
    import errno

    def symlink(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, "symlinks are not supported here (test)")

    os.symlink = symlink


def fit_run(rank: int, world_size: int, root: str, layout: str, epochs: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Fit ``epochs`` epochs. ``opts``:

    - ``ckpt_path`` (resume), ``checkpoint`` (ModelCheckpoint arguments; it saves into root/ckpts),
    - ``hparams`` (more LightningModule arguments), ``module_layout`` (the model's layout when the
      strategy's name says otherwise), ``global_batch`` (default 8; 12 for runs on 3 ranks),
    - ``crash_at`` (SHARDSAFE_CRASH_AT in this rank), ``fail_from`` ((global step, SHARDSAFE_FAIL_AT):
      the saves made from that step on fail there), ``env`` (environment variables to set first),
    - ``validate`` (a ckpt_path for trainer.validate after the fit: the loaded state is returned),
    - ``strategy`` (more strategy arguments: ``async_save``), ``optim_steps`` (``steps`` holds (params,
      optimizer) after each step), ``slow_background_fsync`` (seconds added to each fsync of the async
      save's thread), ``no_symlinks`` (os.symlink fails, as on a filesystem without them)."""
    L = _lightning()
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.setdefault("NODE_RANK", "0")
    os.environ.update(opts.get("env", {}))  # the S3 endpoint: ranks fork from a server started before the fixture
    if opts.get("crash_at"):
        os.environ["SHARDSAFE_CRASH_AT"] = opts["crash_at"]
    if opts.get("no_symlinks"):
        _no_symlinks()
    if opts.get("slow_background_fsync"):
        _slow_background_fsync(float(opts["slow_background_fsync"]))
    record = _record(bool(opts.get("optim_steps")), opts.get("fail_from"))
    callbacks: list[Any] = [record]
    mc = None
    if opts.get("checkpoint") is not None:
        dirpath = f"{root}/ckpts" if "://" in root else str(Path(root) / "ckpts")
        mc = ModelCheckpoint(dirpath=dirpath, **opts["checkpoint"])
        callbacks.append(mc)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy_for(layout, world_size, **opts.get("strategy", {})),
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=mc is not None,
        default_root_dir=root,
        deterministic=True,
        num_sanity_val_steps=0,
    )
    module_layout = opts.get("module_layout") or layout.replace("-native", "").replace("mp", "fsdp")
    module = make_module(module_layout, **opts.get("hparams", {}))
    # the tensor-parallel ranks of one data-parallel group all see its whole batch
    data = _data(_mesh(layout, world_size)[0], opts.get("global_batch", GLOBAL_BATCH))
    trainer.fit(module, train_dataloaders=data, ckpt_path=opts.get("ckpt_path"))
    out: dict[str, Any] = {
        "losses": record.losses,
        "start": record.start,
        "end": record.end,
        "steps": record.steps,
        "best": mc.best_model_path if mc else None,
        "last": mc.last_model_path if mc else None,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "placements": [str(p) for p in getattr(module.net.fc1.weight, "placements", ())],
        "in_flight": record.in_flight,
        "in_flight_after_fit": bool(getattr(trainer.strategy, "save_in_flight", False)),
    }
    if opts.get("validate"):
        trainer.validate(module, dataloaders=data, ckpt_path=opts["validate"], verbose=False)
        out["validated"] = full_model_state(module)
    return out


def fabric_run(
    rank: int, world_size: int, path: str, mode: str, native: bool = False, async_save: bool = False
) -> dict[str, Any]:
    """Fabric, FSDP2 on ``world_size`` ranks (plain on 1): ``mode="save"`` trains 3 steps and saves
    {model, optimizer, step, note} (``async_save``: then trains 2 more steps while it commits, and returns
    the state at the save); ``"load"`` loads into a fresh model/optimizer and returns the whole state."""
    import lightning.fabric as LF
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from shardsafe.integrations.lightning import ShardsafeFabricModelParallelStrategy

    os.environ.setdefault("NODE_RANK", "0")

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        if world_size > 1:
            fully_shard(model.fc1, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"])
        return model

    cls = ModelParallelStrategy if native else ShardsafeFabricModelParallelStrategy
    extra = {"async_save": True} if async_save else {}
    strategy = cls(
        parallelize, data_parallel_size=world_size, tensor_parallel_size=1, process_group_backend="gloo", **extra
    )
    fabric = LF.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Tiny())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if mode == "save":
        gen = torch.Generator().manual_seed(7 + rank)
        for step in range(3):
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step + 1
        fabric.save(path, {**state, "note": {"text": "hello", "values": [1, 2.5]}})
        remainder: Any = None
        if async_save:
            inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
            at_save = {"model": full_model_state(model), "optimizer": full_optimizer_state(model, inner)}
            for _ in range(2):  # the model and moments change while the save commits
                fabric.backward(model(torch.randn(4, 8, generator=gen)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            fabric.strategy.wait_for_save()
            return {**at_save, "step": state["step"], "remainder": None}
    else:
        remainder = fabric.load(path, state)
    return {
        "model": full_model_state(model),
        "optimizer": full_optimizer_state(model, optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer),
        "step": state["step"],
        "remainder": remainder,
    }
