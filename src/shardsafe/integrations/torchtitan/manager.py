"""``ShardsafeCheckpointManager``: torchtitan's checkpoint seam (``BaseCheckpointManager``) over shardsafe.

torchtitan's Trainer builds its checkpointer from ``Trainer.Config.checkpoint`` (``config.checkpoint.build(
dataloader=..., model_parts=..., optimizers=..., lr_schedulers=..., states=..., sd_adapter=..., base_folder=...)``),
which constructs the class that declares the Config. So one line switches a run to shardsafe::

    checkpoint=ShardsafeCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

This class only translates torchtitan's policy (when to save, what to load, which mode) into calls
of :class:`shardsafe.CheckpointManager`, which does the saving, the retention, the lease, the async
writes and the local tier; the state it hands over is in :mod:`.state`. docs/TORCHTITAN.md compares
every field with torchtitan's DCP manager.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from shardsafe.core.comm import get_comm
from shardsafe.errors import CheckpointNotFoundError, ShardsafeError
from shardsafe.integrations.torchtitan.dcp_folders import dcp_manager_steps, load_dcp_manager_folder
from shardsafe.integrations.torchtitan.state import MODEL, OPTIMIZER, model_part, training_state
from shardsafe.manager.lease import DEFAULT_LEASE_TIMEOUT
from shardsafe.manager.manager import CheckpointManager
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR
from shardsafe.protocol.commit import open_checkpoint

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ShardsafeCheckpointManager"]

log = logging.getLogger(__name__)

ASYNC_MODES: dict[str, bool | str] = {"disabled": False, "async": True, "async_with_pinned_mem": "overlap"}


class ShardsafeCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, kept by a :class:`shardsafe.CheckpointManager`.

    Built by torchtitan's Trainer with the keyword arguments it gives the DCP manager. Every rank
    keeps its model part, the optimizers, the LR schedulers, its data-parallel rank's data position,
    its RNG state and ``states`` (the Trainer's step) in ``<dump_folder>/<folder>/step-<10 digits>``
    folders, written by all ranks and committed atomically, verified by hashes on load, and loadable
    on any other layout and world size.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's shared checkpoint policy (each field as for the DCP manager), ``async_mode`` as
        the DCP manager's, and shardsafe's own: the lease timeout and the local tier."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """disabled: saves write in the call; async: the call copies the state into host staging buffers
        and the writing runs in the background; async_with_pinned_mem: the copy itself runs in the
        background too, and the next optimizer step (``maybe_wait_for_staging``) waits for it."""

        lease_timeout: float = DEFAULT_LEASE_TIMEOUT
        """Seconds a second run waits for the live run's lease on the folder to lapse (one live run per folder)."""

        local_every: int | None = None
        """Every K steps also a checkpoint in each node's host memory (``local_dir``), restored when newer."""

        local_dir: str = DEFAULT_LOCAL_DIR
        """Where the local tier keeps its steps (``{node}`` and ``{user}`` are filled in)."""

        replicas: int = 0
        """How many other nodes hold a copy of each node's local-tier files."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode!r} (one of {sorted(ASYNC_MODES)})")
            self.async_mode = mode  # type: ignore[assignment]
            if self.initial_load_in_hf_quantized:
                raise ValueError(
                    "initial_load_in_hf_quantized is not supported by ShardsafeCheckpointManager (quantized HF "
                    "weights need torchtitan's quantized reader): use torchtitan's CheckpointManager for that load"
                )
            not_yet = [
                name
                for name, value in (
                    ("initial_load_path", self.initial_load_path),
                    ("last_save_in_hf", self.last_save_in_hf),
                    ("export_dtype", self.export_dtype != "float32"),
                )
                if value
            ]
            if not_yet:
                raise ValueError(
                    f"{not_yet} are not supported by ShardsafeCheckpointManager yet (docs/TORCHTITAN.md): export the "
                    "last checkpoint with `shardsafe export CKPT OUT --dtype ...`, and start from another checkpoint "
                    "by placing it in the folder"
                )
            if self.load_only and self.local_every is not None:
                raise ValueError("load_only saves nothing, so it has no local tier (local_every)")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future[None] | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.keep_latest_k = config.keep_latest_k
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.model = model_part(model_parts)
        self.state = training_state(self.model, optimizers, lr_schedulers, dataloader, dict(states))
        unknown = sorted(set(config.exclude_from_loading) - set(self.state))
        if unknown:
            raise ValueError(f"exclude_from_loading names {unknown}, not in the state (it holds {sorted(self.state)})")
        self.manager = CheckpointManager(
            self.folder,
            keep_last=config.keep_latest_k or None,
            async_save=ASYNC_MODES[config.async_mode],
            lease_timeout=config.lease_timeout,
            read_only=config.load_only,
            local_every=config.local_every,
            local_dir=config.local_dir,
            replicas=config.replicas,
        )
        self._open = True
        log.info("shardsafe: checkpoints of this run are loaded from and saved to %s", self.folder)

    def __del__(self) -> None:
        # torchtitan's managers close on garbage collection; a shardsafe close is local (it joins the
        # writer threads and gives the lease up), so it is safe here too
        try:
            self.close()
        except Exception as exc:  # never raise from __del__
            log.warning("shardsafe: closing the torchtitan checkpoint manager: %s", exc)

    # ------------------------------------------------------------------ save

    def should_save(self, curr_step: int, last_step: bool = False) -> bool:
        """The DCP manager's rule: never with ``load_only``; step 1 with ``enable_first_step_checkpoint``;
        the last step; every ``interval`` steps."""
        if self.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.should_save(curr_step, last_step):
            return False
        if last_step:
            self._save_last_step(curr_step)
            return True
        self.manager.save(curr_step, self.state, force=True)
        if self.manager.save_in_flight:
            self.save_future = Future()  # a marker: maybe_wait_for_saving() then waits for the manager
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The final save, synchronous as the DCP manager's: the whole state, or (``last_save_model_only``)
        the model alone in ``export_dtype``, in a shardsafe checkpoint that loads into any layout."""
        if not self.config.last_save_model_only:
            self.manager.save(curr_step, self.state, force=True)
        else:
            self.manager.save(curr_step, {MODEL: self.model}, force=True)
        self.manager.wait()
        self.save_future = None

    def _maybe_wait_for_staging(self) -> None:
        """async: the copy was made inside save(), nothing to wait for. async_with_pinned_mem
        (shardsafe's overlap mode): wait for the background copy. The optimizers in the state also
        wait for it in a step pre-hook, but the Trainer calls this before ``optimizers.step()``,
        whose own pre-hooks (MoE load balancing) may update saved buffers first."""
        if self.config.async_mode == "async_with_pinned_mem":
            self.manager.wait_for_copy()

    def _wait_for_saving(self) -> None:
        try:
            self.manager.wait()
        finally:
            self.save_future = None

    # ------------------------------------------------------------------ load

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if not self.load_only:
            self.manager.lease.ensure()  # list the steps as the folder's one writer
        steps = self.manager.steps()
        if not steps:
            return self._load_dcp_manager_folder(step)
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: {self.folder} holds no committed shardsafe checkpoint of that step "
                f"(it holds {steps[-10:]})"
            )
        target = steps[-1] if step == -1 else step
        if self._model_only(target):
            self.manager.restore({MODEL: self.model}, step=target)
            return True
        loaded = self.manager.restore(self._loadable(), step=None if step == -1 else step)
        log.info("shardsafe: loaded step %s from %s", loaded, self.folder)
        return True

    def _load_dcp_manager_folder(self, step: int) -> bool:
        """No shardsafe checkpoint in the folder: resume from the DCP manager's newest ``step-<N>`` there
        (the run switched managers), read in place and resharded (:mod:`.dcp_folders`); step 0 is its
        seed checkpoint, the model alone."""
        found = dcp_manager_steps(self.folder)
        if step != -1 and step not in found:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: {self.folder} holds no checkpoint of that step "
                f"(shardsafe's: none; the DCP manager's: {sorted(found)[-10:]})"
            )
        if not found:
            log.info("shardsafe: no checkpoint in %s, this is a fresh start", self.folder)
            return False
        target = max(found) if step == -1 else step
        if f"{OPTIMIZER}_1" in self.state:
            raise ShardsafeError(
                f"{found[target]}: resuming several optimizers per model part from the DCP manager's folder is not "
                "supported; convert it with the DCP manager's own run, or start this run fresh"
            )
        model_only = target == 0
        state: dict[str, Any] = {MODEL: self.model} if model_only else self._loadable()
        optimizer: torch.optim.Optimizer | None = None if model_only else state.get(OPTIMIZER)
        log.info("shardsafe: no shardsafe checkpoint in %s; loading the DCP manager's %s", self.folder, found[target])
        load_dcp_manager_folder(found[target], state, self.model, optimizer)
        return True

    def _loadable(self) -> dict[str, Any]:
        return {k: v for k, v in self.state.items() if k not in self.config.exclude_from_loading}

    def _model_only(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` holds the model alone (a seed checkpoint, a final
        ``last_save_model_only`` save): then only the model is loaded, as the DCP manager does for step 0."""
        path = self.manager.step_path(step)
        return bool(get_comm().on_coordinator(lambda: OPTIMIZER not in open_checkpoint(path)[1]))

    # ------------------------------------------------------------------ close

    def _close(self) -> None:
        if getattr(self, "_open", False):  # unset when __init__ raised before building the manager
            self._open = False  # close once (the Trainer closes, then __del__ does)
            self.manager.close()
