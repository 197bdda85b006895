"""PyTorch Lightning: Trainer and Fabric strategies whose checkpoints are shardsafe folders.

Switch by passing the strategy (docs/LIGHTNING.md)::

    from shardsafe.integrations.lightning import ShardsafeModelParallelStrategy
    trainer = L.Trainer(strategy=ShardsafeModelParallelStrategy(), callbacks=[ModelCheckpoint(...)])

Every ``trainer.save_checkpoint`` / ``ModelCheckpoint`` save is then one atomic shardsafe checkpoint
written by all ranks, and ``trainer.fit(ckpt_path=...)`` resumes on any number of ranks and layout.
Imports ``lightning`` (``pip install "shardsafe[lightning]"``).
"""

from shardsafe.integrations.lightning.checkpoints import LightningCheckpoints
from shardsafe.integrations.lightning.fabric import ShardsafeFabricDDPStrategy, ShardsafeFabricModelParallelStrategy
from shardsafe.integrations.lightning.strategies import ShardsafeDDPStrategy, ShardsafeModelParallelStrategy

__all__ = [
    "LightningCheckpoints",
    "ShardsafeDDPStrategy",
    "ShardsafeFabricDDPStrategy",
    "ShardsafeFabricModelParallelStrategy",
    "ShardsafeModelParallelStrategy",
]
