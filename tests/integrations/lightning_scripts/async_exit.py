"""A one-process Lightning run that calls ``trainer.save_checkpoint`` with ``async_save=True`` after ``fit``
(the strategy already torn down) and exits at once, its background fsyncs slowed: the save in flight must be
finished at interpreter exit, not dropped with the daemon thread. ``python async_exit.py <folder>``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: dist_utils

import lightning.pytorch as L  # noqa: E402
import lit_utils  # noqa: E402

from shardsafe.integrations.lightning import ShardsafeModelParallelStrategy  # noqa: E402


def main(root: str) -> None:
    strategy = ShardsafeModelParallelStrategy(process_group_backend="gloo", async_save=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit_utils.make_module("plain"), train_dataloaders=lit_utils._data(1))
    lit_utils._slow_background_fsync(0.2)
    trainer.save_checkpoint(os.path.join(root, "after-fit.ckpt"))
    print("in flight at exit:", strategy.save_in_flight, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
