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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from shardsafe.api.load import load
from shardsafe.api.location import location, shown
from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, STATE_NAME, dtype_from_name, dtype_name, parse_json
from shardsafe.errors import CheckpointNotFoundError, FormatError, IntegrityError, ShardsafeError
from shardsafe.integrations.torchtitan.dcp_folders import dcp_manager_steps, load_dcp_manager_folder
from shardsafe.integrations.torchtitan.hf_weights import TensorHolder, export_hf_folder, load_hf_weights
from shardsafe.integrations.torchtitan.state import EXPORT_DTYPE, MODEL, OPTIMIZER, model_part, training_state
from shardsafe.interop.dcp_metadata import is_dcp_folder
from shardsafe.manager.lease import DEFAULT_LEASE_TIMEOUT
from shardsafe.manager.manager import CheckpointManager
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.state.adapters import model_state
from shardsafe.storage.location import as_location
from shardsafe.storage.remote import RemoteDir

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
        self._replaceable: set[int] = set()  # later steps than the one resumed: this run saves them anew
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
        self.manager.save(curr_step, self.state, force=True, overwrite=curr_step in self._replaceable)
        if self.manager.save_in_flight:
            self.save_future = Future()  # a marker: maybe_wait_for_saving() then waits for the manager
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The final save, synchronous as the DCP manager's: the whole state, or (``last_save_model_only``)
        the model alone in ``export_dtype``, in a shardsafe checkpoint that loads into any layout; with
        ``last_save_in_hf`` that checkpoint is also exported through ``sd_adapter`` as a Hugging Face
        model folder ``<folder>/step-<N>``, where the DCP manager writes it."""
        out = Path(self.folder) / f"step-{curr_step}"
        if self.config.last_save_in_hf and is_dcp_folder(out):  # before anything is written
            raise ShardsafeError(
                f"{out} is a DCP manager checkpoint; last_save_in_hf would replace it with the Hugging Face export. "
                "Move it away, or save the last step without last_save_in_hf"
            )
        state = self.state if not self.config.last_save_model_only else self._final_model_state()
        self.manager.save(curr_step, state, force=True, overwrite=curr_step in self._replaceable)
        self.manager.wait()
        self.save_future = None
        if self.config.last_save_in_hf:
            checkpoint = self.manager.step_path(curr_step)
            assert isinstance(checkpoint, Path)  # the Config refuses last_save_in_hf with an object-store folder
            self.manager.comm.on_coordinator(
                lambda: export_hf_folder(checkpoint, out, self.sd_adapter, self.export_dtype)
            )
            log.info("shardsafe: the last step's model, in Hugging Face format: %s", out)

    def _final_model_state(self) -> dict[str, Any]:
        """The model in ``export_dtype``: the module itself when it is in that dtype already, else its
        state dict cast (DTensors stay sharded) under the module's names, plus a note of the dtype
        that a later model-only load reads (:meth:`_load_model`)."""
        native = model_state(self.model)
        if all(not t.is_floating_point() or t.dtype == self.export_dtype for t in native.values()):
            return {MODEL: self.model}
        cast = {k: v.to(self.export_dtype) if v.is_floating_point() else v for k, v in native.items()}
        return {MODEL: TensorHolder(cast), EXPORT_DTYPE: dtype_name(self.export_dtype)}

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
        try:
            model_only, export_dtype = self._saved_as(self.manager.step_path(target))
        except (FormatError, IntegrityError, OSError):
            if step != -1:
                raise
            # the newest one's state.json is damaged: the restore below passes it over (and says so), as any
            # damaged newest checkpoint, for the newest one that loads
            model_only, export_dtype = False, None
        if model_only or target == 0:
            self._load_model(lambda state: self.manager.restore(state, step=target), export_dtype)
            loaded: int | None = target
        else:
            loaded = self.manager.restore(self._loadable(), step=None if step == -1 else step)
        log.info("shardsafe: loaded step %s from %s", loaded, self.folder)
        self._replace_later(steps, loaded)
        return True

    def _replace_later(self, steps: list[int], loaded: int | None) -> None:
        """The run continues from ``loaded``; the folder's later checkpoints (damaged ones the restore passed
        over, or newer than an explicit ``load_step``) belong to the history it abandons. As the DCP manager
        does, this run writes those steps anew: each is replaced (atomically) when the run saves it, not
        before, and a warning names them now. shardsafe refuses to replace another run's step otherwise."""
        later = [s for s in steps if loaded is not None and s > loaded]
        self._replaceable = set(later)
        if later:
            log.warning(
                "shardsafe: resumed step %s of %s, which also holds the later checkpoints %s (damaged, or newer than "
                "load_step); each is replaced when this run saves that step",
                loaded,
                self.folder,
                later[-10:],
            )

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
            return self._initial_load()
        target = max(found) if step == -1 else step
        log.info("shardsafe: no shardsafe checkpoint in %s; loading the DCP manager's %s", self.folder, found[target])
        self._load_dcp(found[target], model_only=target == 0)
        return True

    def _load_dcp(self, folder: Path, model_only: bool) -> None:
        """A DCP manager's ``step-<N>`` folder, read in place and resharded: the model alone, or everything
        this run loads but the data position (pickled there)."""
        if not model_only and f"{OPTIMIZER}_1" in self.state:
            raise ShardsafeError(
                f"{folder}: resuming several optimizers per model part from the DCP manager's folder is not "
                "supported; load the model only (initial_load_model_only), or convert it with the DCP manager's "
                "own run"
            )
        state: dict[str, Any] = {MODEL: self.model} if model_only else self._loadable()
        optimizer: torch.optim.Optimizer | None = None if model_only else state.get(OPTIMIZER)
        load_dcp_manager_folder(folder, state, self.model, optimizer)

    def _initial_load(self) -> bool:
        """The folder holds no checkpoint: start from ``initial_load_path`` as the DCP manager does (the model
        alone unless ``initial_load_model_only=False``): a Hugging Face folder (``initial_load_in_hf``; the
        adapter's ``hf_assets_path`` when no path is given), a DCP manager ``step-<N>`` folder, or a
        shardsafe checkpoint (this manager's ``step-<10 digits>``). Later runs resume from ``folder``."""
        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf:
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ValueError(
                    "checkpoint.initial_load_in_hf: no checkpoint.initial_load_path, and the sd_adapter has no "
                    "hf_assets_path to load the Hugging Face weights from"
                )
        if not path:
            log.info("shardsafe: no checkpoint in %s, this is a fresh start", self.folder)
            return False
        log.info("shardsafe: no checkpoint in %s; initial load from %s", self.folder, path)
        local = Path(path)
        if config.initial_load_in_hf:
            if not local.is_dir():
                raise ValueError(f"checkpoint.initial_load_path is not a Hugging Face model folder: {path}")
            load_hf_weights(self.model, path, self.sd_adapter, self.manager.comm.group)
        elif "://" not in path and is_dcp_folder(local):
            self._load_dcp(local, model_only=config.initial_load_model_only)
        else:
            self._initial_load_shardsafe(path)
        return True

    def _initial_load_shardsafe(self, path: str) -> None:
        """``initial_load_path`` as a shardsafe checkpoint (local or an object-store URL)."""
        group = self.manager.comm.group
        try:
            model_only, export_dtype = self._saved_as(location(path))
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"checkpoint.initial_load_path={path}: {exc}. It must name one checkpoint: a shardsafe "
                "step-<10 digits> folder, a DCP manager step-<N> folder, or a Hugging Face model folder with "
                "checkpoint.initial_load_in_hf=True"
            ) from exc
        if self.config.initial_load_model_only or model_only:
            self._load_model(lambda state: load(path, state, process_group=group), export_dtype)
        else:
            load(path, self._loadable(), process_group=group)

    def _loadable(self) -> dict[str, Any]:
        return {k: v for k, v in self.state.items() if k not in self.config.exclude_from_loading}

    def _saved_as(self, path: Path | RemoteDir) -> tuple[bool, str | None]:
        """Whether the checkpoint at ``path`` holds the model alone (a seed checkpoint, a final
        ``last_save_model_only`` save: then only the model is loaded, as the DCP manager does for step 0),
        and the dtype it was cast to (``export_dtype``), if any."""

        def read() -> tuple[bool, str | None]:
            # The top-level entries of state.json decide, so the whole manifest is not parsed here (a tenth of
            # a resume at 255 MB); the load itself then checks everything, state.json's hash included.
            folder = as_location(path)
            if folder.exists(MANIFEST_NAME) and folder.exists(STATE_NAME):
                tree = parse_json(folder.read_bytes(STATE_NAME, MAX_JSON_BYTES), f"{shown(path)}/{STATE_NAME}")
            else:  # not committed, or another state file name: what opening the checkpoint says
                tree = open_checkpoint(path)[1]
            if not isinstance(tree, dict):
                raise FormatError(f"{shown(path)}/{STATE_NAME}: not a JSON object")
            note = tree.get(EXPORT_DTYPE)
            dtype = note.get("state") if isinstance(note, dict) else None
            return OPTIMIZER not in tree, dtype if isinstance(dtype, str) else None

        return self.manager.comm.on_coordinator(read)

    def _load_model(self, load_into: Callable[[dict[str, Any]], Any], export_dtype: str | None) -> None:
        """Load the model alone with ``load_into``; a model saved in another ``export_dtype`` is read
        strictly (every name, shape and that dtype) into tensors of the model's layout in that dtype,
        then copied into the model, cast (the load stays all-or-nothing)."""
        if export_dtype is None:
            load_into({MODEL: self.model})
            return
        dtype = dtype_from_name(export_dtype, f"{EXPORT_DTYPE} entry")
        native = model_state(self.model)
        holder = TensorHolder(
            {
                k: torch.empty_like(v, dtype=dtype) if v.is_floating_point() else torch.empty_like(v)
                for k, v in native.items()
            }
        )
        load_into({MODEL: holder})
        self.model.load_state_dict(dict(holder.named_buffers()), strict=True)

    # ------------------------------------------------------------------ close

    def _close(self) -> None:
        if getattr(self, "_open", False):  # unset when __init__ raised before building the manager
            self._open = False  # close once (the Trainer closes, then __del__ does)
            self.manager.close()
