"""Lightning Trainer strategies whose checkpoints are shardsafe checkpoint folders.

``ShardsafeModelParallelStrategy`` and ``ShardsafeDDPStrategy`` take the arguments of Lightning's
``ModelParallelStrategy`` and ``DDPStrategy`` and train exactly as they do; only ``save_checkpoint``,
``load_checkpoint`` and ``remove_checkpoint`` change (checkpoints.py says how). Lightning's sharded
path bypasses its ``CheckpointIO`` plugin (``ModelParallelStrategy.save_checkpoint`` calls DCP and
``torch.save``s ``meta.pt`` itself), so the strategy is where a checkpoint format plugs in.

Both restore after ``setup`` (the model wrapped or sharded, the optimizers made) and load the model
and optimizers in place themselves, so Lightning's ``load_model_state_dict`` /
``load_optimizer_state_dict`` have nothing left to do, as with ``ModelParallelStrategy``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from shardsafe.integrations.lightning.checkpoints import LightningCheckpoints

__all__ = ["ShardsafeDDPStrategy", "ShardsafeModelParallelStrategy"]


def _refuse_storage_options(strategy: Any, storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            f"{type(strategy).__name__}.save_checkpoint(..., storage_options=...) is not supported: checkpoints go "
            "through shardsafe, not the CheckpointIO plugin (for s3:// and other fsspec URLs pass the URL as the path)"
        )


class _ShardsafeCheckpointing:
    """The checkpoint methods both strategies share (a mixin before Lightning's class in the bases)."""

    _shardsafe: LightningCheckpoints
    model: Any
    optimizers: list[Any]
    lightning_module: Any
    is_global_zero: bool

    if TYPE_CHECKING:

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...  # Lightning's strategy provides it

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Collective (every rank: ``trainer.save_checkpoint`` and ModelCheckpoint call it on all): one atomic
        shardsafe checkpoint folder at ``filepath`` (rank 0's choice)."""
        _refuse_storage_options(self, storage_options)
        path = self.broadcast(os.fspath(filepath))
        self._shardsafe.save(path, checkpoint, self.model, list(self.optimizers))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: the model and optimizers loaded in place (any world size and layout); returns the rest of
        Lightning's checkpoint dict (loops, callbacks, schedulers, ...), as ``ModelParallelStrategy`` does."""
        path = self.broadcast(os.fspath(checkpoint_path))
        strict = bool(getattr(self.lightning_module, "strict_loading", True))
        return self._shardsafe.load(path, self.model, list(self.optimizers), strict=strict)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's rotation: rank 0 retires the folder if this run wrote it (never another run's)."""
        if self.is_global_zero:
            self._shardsafe.remove(os.fspath(filepath))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing left to do: :meth:`load_checkpoint` loaded the model in place."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing left to do: :meth:`load_checkpoint` loaded the optimizers in place."""


class ShardsafeModelParallelStrategy(_ShardsafeCheckpointing, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel applied in ``configure_model``), saving
    and loading shardsafe checkpoints. Same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shardsafe = LightningCheckpoints()


class ShardsafeDDPStrategy(_ShardsafeCheckpointing, DDPStrategy):
    """Lightning's ``DDPStrategy``, saving and loading shardsafe checkpoints (every rank takes part; the
    replicated weights are written once). Same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shardsafe = LightningCheckpoints()
