"""torchtitan: ``ShardsafeCheckpointManager``, selected by torchtitan's config (docs/TORCHTITAN.md)::

    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager
    config.checkpoint = ShardsafeCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

Importing this package imports torchtitan (and torchdata, which torchtitan's dataloader needs).
"""

from shardsafe.integrations.torchtitan.manager import ShardsafeCheckpointManager

__all__ = ["ShardsafeCheckpointManager"]
