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

import logging
import os
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from shardsafe.errors import SaveError
from shardsafe.integrations.lightning.background import BackgroundSaves, background_saves
from shardsafe.integrations.lightning.checkpoints import LightningCheckpoints

__all__ = ["ShardsafeDDPStrategy", "ShardsafeModelParallelStrategy"]

log = logging.getLogger(__name__)


def _refuse_storage_options(strategy: Any, storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            f"{type(strategy).__name__}.save_checkpoint(..., storage_options=...) is not supported: checkpoints go "
            "through shardsafe, not the CheckpointIO plugin (for s3:// and other fsspec URLs pass the URL as the path)"
        )


def _link_last(strategy: _ShardsafeCheckpointing, trainer: Any, filepath: str, linkpath: str) -> None:
    """ModelCheckpoint._link_checkpoint for folders (called on every rank): rank 0 links, or copies where no
    symlink can be made (Lightning's fallback copies a file, and makes neither on an object store), once
    ``filepath`` is committed (checkpoints.LightningCheckpoints.link)."""
    if trainer.is_global_zero and os.fspath(filepath) != os.fspath(linkpath):
        source, link = os.fspath(filepath), os.fspath(linkpath)
        strategy._after_commit(lambda: strategy._shardsafe.link(source, link))
    trainer.strategy.barrier()


def _remove_logged(checkpoints: LightningCheckpoints, path: str) -> None:
    """A removal that failed is logged, not raised: the save it follows is committed (as the manager's retention)."""
    try:
        checkpoints.remove(path)
    except OSError as exc:
        log.warning("shardsafe: could not remove %s (ModelCheckpoint rotation): %s", path, exc)


class _ShardsafeCheckpointing:
    """The checkpoint methods both strategies share (a mixin before Lightning's class in the bases)."""

    _shardsafe: LightningCheckpoints
    _background: BackgroundSaves | None
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
        rest = self._shardsafe.load(path, self.model, list(self.optimizers), strict=strict)
        self._shardsafe.release_other_runs_last(rest)
        return rest

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's rotation: rank 0 retires the folder if this run wrote it (never another run's)."""
        if self.is_global_zero:
            path = os.fspath(filepath)
            self._after_commit(lambda: _remove_logged(self._shardsafe, path))

    def _after_commit(self, job: Callable[[], object]) -> None:
        """Run ``job`` now, or (async) once the save in flight has committed, and not at all if it failed."""
        if self._background is None:
            job()
        else:
            self._background.after_commit(job)

    def setup(self, trainer: Any) -> None:
        """Lightning's setup; then every ModelCheckpoint makes ``save_last="link"`` through this strategy."""
        super().setup(trainer)  # type: ignore[misc]
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                callback._link_checkpoint = partial(_link_last, self)  # type: ignore[method-assign]

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save (``async_save=True``) is still being written and committed."""
        return self._background is not None and self._background.in_flight

    def wait_for_save(self) -> None:
        """Block until the async save in flight (if any) is committed; raise its error (``SaveError``)."""
        if self._background is not None:
            self._background.wait()

    def teardown(self) -> None:
        """Lightning's teardown, after the save in flight has committed. Its error is raised, unless the run
        is already ending on another exception (then it is logged, so it does not hide that one)."""
        try:
            self.wait_for_save()
        except SaveError:
            if sys.exc_info()[0] is None:
                super().teardown()  # type: ignore[misc]
                raise
            log.exception("shardsafe: the async checkpoint save in flight failed while the run ended on an error")
        super().teardown()  # type: ignore[misc]

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
    and loading shardsafe checkpoints. Same arguments, and ``async_save=True``: a save returns once the state
    is copied to host memory and commits in the background (background.py: the manager's guarantees)."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._background = background_saves(async_save)
        self._shardsafe = LightningCheckpoints(background=self._background)


class ShardsafeDDPStrategy(_ShardsafeCheckpointing, DDPStrategy):
    """Lightning's ``DDPStrategy``, saving and loading shardsafe checkpoints (every rank takes part; the
    replicated weights are written once). Same arguments, and ``async_save`` as for the model-parallel one."""

    def __init__(self, *args: Any, async_save: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._background = background_saves(async_save)
        self._shardsafe = LightningCheckpoints(background=self._background)
