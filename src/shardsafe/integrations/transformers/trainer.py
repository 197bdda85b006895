"""``ShardsafeTrainer``: the ``transformers.Trainer`` methods that write, read or delete checkpoints
and model folders, each doing what the Trainer's does, collectively, through shardsafe.

What a checkpoint holds and how it is listed and rotated is in :mod:`.checkpoints`; model folders
in :mod:`.model_folder`; DeepSpeed ZeRO-3 gathering in :mod:`.zero3`. This class only decides when
each runs, on which ranks, and with which state.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import HubStrategy, SaveStrategy

from shardsafe.api.checkpoint import describe_collectively, load, location, write_checkpoint
from shardsafe.compat.transformers import check_trainer, init_hf_repo, run_output_dir, save_total_limit_hidden
from shardsafe.core.comm import get_comm
from shardsafe.errors import SaveError, ShardsafeError, StateMismatchError
from shardsafe.hf.guard import check_model_folder
from shardsafe.hf.pretrained import save_pretrained, save_pretrained_sharded, save_pretrained_stream, tied_aliases
from shardsafe.hf.push import push
from shardsafe.integrations.transformers.checkpoints import (
    DATA,
    ENGINE,
    FILES,
    META_KEY,
    MODEL,
    OPTIMIZER,
    RNG,
    SCALER,
    SCHEDULER,
    TRAINER_NAMING,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
    WEIGHTS,
    NoValidCheckpointError,
    checkpoint_path,
    checkpoint_steps,
    keep_only_best,
    latest_checkpoint,
    rotate_checkpoints,
    write_trainer_files,
)
from shardsafe.integrations.transformers.data_order import ReshardableDataTrainer
from shardsafe.integrations.transformers.model_folder import hub_token, install_model_folder, new_hidden, stage_upload
from shardsafe.integrations.transformers.model_index import ModelIndexCommit, full_state_tensors, whole_weights
from shardsafe.integrations.transformers.resharded import resharded_view
from shardsafe.integrations.transformers.zero3 import (
    is_zero3_model,
    parameter_count,
    zero3_gathered_tensors,
    zero3_sharded_model,
)
from shardsafe.manager.catalog import refuse_other_runs_step
from shardsafe.manager.lease import DEFAULT_LEASE_TIMEOUT, RootLease
from shardsafe.protocol.commit import LocalCommit, is_committed, open_checkpoint, prepare_save
from shardsafe.state.adapters import unwrap_module
from shardsafe.state.rng import RNGState
from shardsafe.storage.local import fsync_dir, remove_tree, write_small_file

__all__ = ["ShardsafeTrainer"]


def _in_checkpoint(error: ShardsafeError, view: Path, checkpoint: str) -> ShardsafeError:
    """``error`` of a load of the re-sharded view, naming the checkpoint's files rather than the view's (removed
    by the time the user reads it): the view holds hard links to the checkpoint's files under the same names."""
    text = str(error).replace(str(view), checkpoint)
    try:
        return type(error)(text)
    except TypeError:  # an error type with other constructor arguments: keep it as it is
        return error


log = logging.getLogger(__name__)

HF_MAX_SHARD_SIZE = "50GB"  # PreTrainedModel.save_pretrained's default in transformers 5

_UNSUPPORTED_STAGE = (
    "ShardsafeTrainer checkpoints DeepSpeed ZeRO stage 3 (and DDP, one process), not stage {stage}: "
    "use stage 3, or save_strategy='no' (save_model works), or the plain Trainer and `shardsafe convert` for its "
    "checkpoints"
)
_REPLACE_REMEDY = (
    "To continue that run, train(resume_from_checkpoint=True); to replace its checkpoints on purpose, "
    "ShardsafeTrainer(..., overwrite_checkpoints=True); or train into another output_dir"
)


class ShardsafeTrainer(ReshardableDataTrainer):
    """``transformers.Trainer`` with checkpoints, ``save_model``, rotation, resume and push through shardsafe.

    Same constructor as ``Trainer``, plus two optional keywords for ``save_model``: ``save_dtype``
    (cast floating-point weights to it; default None keeps the model's dtype, as the Trainer does)
    and ``max_shard_size`` (largest weights file, default ``"50GB"`` as ``save_pretrained``). Every
    method here is collective where the Trainer's is called on every process (it is): all ranks
    take part, only the coordinator (global rank 0) creates, writes or deletes shared paths.

    Each ``train()`` call is one *run* holding the lease on ``output_dir`` (``lease_timeout``, as
    the CheckpointManager's), taken before a resume reads the checkpoint, so
    ``resume_from_checkpoint=True`` resumes what the previous run last committed. A checkpoint
    another run committed at a step this run saves is not replaced
    (:class:`~shardsafe.errors.CheckpointExistsError` names the run) unless
    ``overwrite_checkpoints=True``; the checkpoint this run resumed from it may save again.
    """

    def __init__(
        self,
        *args: Any,
        save_dtype: torch.dtype | None = None,
        max_shard_size: int | str = HF_MAX_SHARD_SIZE,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        overwrite_checkpoints: bool = False,
        keep_later_checkpoints: bool = False,
        **kwargs: Any,
    ) -> None:
        self.save_dtype = save_dtype
        self.max_shard_size = max_shard_size
        self.lease_timeout = lease_timeout
        self.overwrite_checkpoints = overwrite_checkpoints
        self.keep_later_checkpoints = keep_later_checkpoints
        self._leases: dict[str, RootLease] = {}  # run dir -> this run's lease on it (one live run per output_dir)
        # run dir -> the steps this run may save again there: the one it resumed from and the later ones it replaces
        self._resumed: dict[str, set[int]] = {}
        self._resuming_from: str | None = None
        check_trainer()  # every private Trainer method overridden here exists (else an override would silently not run)
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints: save

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """One collective, atomic shardsafe save of everything the Trainer writes into ``checkpoint-<step>``.

        Same bookkeeping as the Trainer (floating-point operation count, best checkpoint, stateful
        callbacks, push, rotation), but the trainer state is saved inside the checkpoint, so it is
        updated before the save rather than written after it.
        """
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = run_output_dir(self, trial)
        output_dir = str(checkpoint_path(run_dir, self.state.global_step))
        if (
            self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            and self.state.best_global_step
        ):
            best = str(checkpoint_path(run_dir, self.state.best_global_step))
            if best == output_dir or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:  # as the Trainer: record the stateful callbacks where it writes the state
            self._record_callback_states()
        comm = get_comm()
        lease = self._lease(run_dir)
        if not self.overwrite_checkpoints:
            self._refuse_other_runs_checkpoint(run_dir, lease)
        state = self._checkpoint_state(model_only=self.args.save_only_model)
        plain = self._add_model_folder_weights(state)
        metadata = self._checkpoint_metadata()
        metadata[META_KEY] = {**metadata.get(META_KEY, {}), **lease.metadata()}
        view = describe_collectively(state, comm)
        where = location(output_dir)
        target = prepare_save(comm, where, overwrite=True)
        published_with_files = isinstance(target, LocalCommit)
        if isinstance(target, LocalCommit):  # the index and trainer files go into the hidden folder, before the rename
            target = ModelIndexCommit(target, plain, state.get(FILES, {}), single_file=comm.world_size == 1)
        try:
            write_checkpoint(
                where,
                view,
                comm,
                overwrite=True,
                metadata=metadata,
                before_publish=lambda: lease.fence(f"publish {output_dir}"),
                target=target,
                plain_names=plain,
            )
        except BaseException:
            target.abort()  # what a failure before the agreement left (nothing once published; never raises)
            raise
        if comm.is_coordinator and not published_with_files:
            try:
                write_trainer_files(Path(output_dir))
            except Exception as exc:  # the checkpoint is committed and holds them: a resume writes them again
                log.warning(
                    "shardsafe: writing the trainer files next to %s failed (a resume writes them again): %s",
                    output_dir,
                    exc,
                )
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)

        def rotate() -> None:
            try:
                rotate_checkpoints(
                    Path(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint, fence=lease.fence
                )
            # the checkpoint is committed: a rotation failure is logged and retried, never a failed save
            except Exception as exc:
                log.warning(
                    "shardsafe: rotating the checkpoints in %s failed (retried after the next save): %s", run_dir, exc
                )

        comm.on_coordinator(rotate)  # every rank returns once the rotation is done, as a manager's save does

    def _refuse_other_runs_checkpoint(self, run_dir: str, lease: RootLease) -> None:
        """Collective: every rank raises the same CheckpointExistsError if ``checkpoint-<step>`` is another run's (the
        manager's rule)."""
        step, key = self.state.global_step, str(Path(run_dir).absolute())
        resumed = self._resumed.get(key, set())

        def check() -> None:
            refuse_other_runs_step(
                Path(run_dir), step, lease.run_id, resumed, _REPLACE_REMEDY, naming=TRAINER_NAMING, key=META_KEY
            )

        get_comm().on_coordinator(check, default=SaveError)

    def _record_callback_states(self) -> None:
        from transformers.trainer_callback import ExportableState

        recorded: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]  # a dict once training started
        for callback in [
            cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)
        ]:
            name = callback.__class__.__name__
            if isinstance(recorded[name], list):
                recorded[name].append(callback.state())
            else:
                recorded[name] = callback.state()

    def _checkpoint_state(self, *, model_only: bool) -> dict[str, Any]:
        """What a checkpoint holds (the same entries on every rank)."""
        state: dict[str, Any] = {}
        engine = self._zero3_engine()
        if engine is not None:
            if model_only:
                state[MODEL] = zero3_sharded_model(self._module(), engine)
            else:
                state[ENGINE] = engine
        else:
            state[MODEL] = self.model_wrapped
            if not model_only:
                state[OPTIMIZER] = _inner_optimizer(self.optimizer)
        if not model_only:
            if self.lr_scheduler is not None:
                state[SCHEDULER] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state[SCALER] = scaler
            state[RNG] = RNGState()
            if self._data is not None:
                state[DATA] = self._data
        # the Trainer's state differs between ranks (logs, timings): the main process's is the run's
        if get_comm().is_coordinator:
            state[FILES] = self._trainer_files()
        return state

    def _add_model_folder_weights(self, state: dict[str, Any]) -> str | None:
        """Make the checkpoint a ``from_pretrained`` folder where the Trainer's would be one (:mod:`.model_index`).

        Returns the key prefix whose whole tensors the shard files name by the model's own names:
        ``model/`` when every rank holds the model whole (one process, DDP); ``weights/`` after
        adding a ``weights`` entry of whole tensors gathered from a ZeRO-3 (16-bit, with
        ``stage3_gather_16bit_weights_on_model_save``) or FSDP (full state dict) model; None where
        the Trainer writes no weights file (ZeRO-3 without the gather, FSDP sharded state dict).
        """
        module = self._module()
        if MODEL in state and state[MODEL] is self.model_wrapped and not _has_dtensors(module):
            return f"{MODEL}/"
        comm = get_comm()
        if is_zero3_model(module):
            if not self._gather_16bit_on_save():
                return None
            infos, stream = zero3_gathered_tensors(module, self._deepspeed_engine())
        elif self.is_fsdp_enabled and "FULL_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type):
            infos, stream = full_state_tensors(module)
        else:
            return None
        state[WEIGHTS] = whole_weights(infos, stream, comm)
        return f"{WEIGHTS}/"

    def _trainer_files(self) -> dict[str, str]:
        """The files written next to each checkpoint (see the module docstring), as text."""
        files = {TRAINER_STATE_NAME: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"}
        files[TRAINING_ARGS_NAME] = self.args.to_json_string()
        module = self._module()
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            config = copy.deepcopy(config)
            config.architectures = [type(module).__name__]
            files["config.json"] = config.to_json_string(use_diff=True)
            generation = getattr(module, "generation_config", None)
            can_generate = getattr(module, "can_generate", None)
            if (
                generation is not None
                and hasattr(generation, "to_json_string")
                and (can_generate is None or can_generate())
            ):
                files["generation_config.json"] = generation.to_json_string(use_diff=True)
        return files

    def _checkpoint_metadata(self) -> dict[str, Any]:
        from shardsafe.api.source import EXPORT_META

        step = self.state.global_step
        metrics = {
            k: v
            for entry in self.state.log_history
            if entry.get("step") == step
            for k, v in entry.items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and k not in ("step", "epoch")
        }
        meta: dict[str, Any] = {
            META_KEY: {
                "step": step,
                "epoch": self.state.epoch,
                "metrics": metrics,
                "best_model_checkpoint": self.state.best_model_checkpoint,
            }
        }
        # the model is saved under "model" with its state-dict names: record what export needs
        if self._deepspeed_engine() is None:
            module = self._module()
            names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
            meta[EXPORT_META] = {
                "key": MODEL,
                "dtype": None,
                "aliases": tied_aliases(module, names),
                "total_parameters": parameter_count(module),
            }
        return meta

    # ------------------------------------------------------------------ checkpoints: resume

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed shardsafe checkpoint in
        ``output_dir``.

        Before the Trainer reads ``trainer_state.json`` from the checkpoint (every rank reads it),
        the coordinator writes it, and the other trainer files, from the checkpoint's own
        ``state.json`` if they are missing (a crash right after the commit leaves them missing).
        """
        self._check_checkpointable()
        try:
            path = self._resume_path(resume_from_checkpoint)
            self._resuming_from = path
            return super().train(resume_from_checkpoint=path, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        finally:
            self._resuming_from = None
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()
            self._resumed.clear()

    def _resume_path(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint to resume from (collective), chosen under this run's lease on ``output_dir``.

        With ``True`` (or a checkpoint inside ``output_dir``) the lease is taken first, waiting for a
        previous run still saving there, so the newest checkpoint is the one it last committed.
        """
        comm = get_comm()
        if resume_from_checkpoint in (None, False):
            return None
        out = self._output_dir()
        inside = resume_from_checkpoint is True or Path(str(resume_from_checkpoint)).absolute().parent == out
        if inside and self.args.save_strategy != SaveStrategy.NO:
            self._lease(str(out))
        if resume_from_checkpoint is True:
            found = comm.broadcast(latest_checkpoint(out) if comm.is_coordinator else None)
            if found is None:
                raise NoValidCheckpointError(
                    f"No valid checkpoint found in output directory ({out}): no committed shardsafe checkpoint to "
                    "resume from"
                )
            path = str(found)
        else:
            path = str(resume_from_checkpoint)
            local = "://" not in path  # an object-store checkpoint is checked by the load
            if local and not comm.broadcast(is_committed(Path(path)) if comm.is_coordinator else None):
                raise NoValidCheckpointError(
                    f"Can't find a valid checkpoint at {path}: no committed shardsafe checkpoint (manifest.json) there"
                )
        step = TRAINER_NAMING.parse(Path(path).name)
        if inside and step is not None:
            self._resumed[str(out)] = {step, *comm.on_coordinator(lambda: self._later_checkpoints(out, step))}
        comm.on_coordinator(lambda: write_trainer_files(Path(path), only_missing=True))
        return path

    def _later_checkpoints(self, out: Path, step: int) -> list[int]:
        """Coordinator, at ``train()`` start, under the lease: the committed checkpoints of ``out`` after ``step``.

        Resuming from an older checkpoint (a loss spike, a bad data shard) continues from there as
        the Trainer does: the later checkpoints are named in a warning now, before any step runs,
        and each is replaced, atomically, when the run saves that step again. With
        ``keep_later_checkpoints=True`` they are first moved aside, each renamed (one rename) to
        ``checkpoint-N.superseded-<time>`` (no longer a checkpoint of this run: never resumed, never
        rotated), and kept. Returns the steps the run may replace.
        """
        later = [s for s in checkpoint_steps(out) if s > step]
        if not later:
            return []
        names = ", ".join(TRAINER_NAMING.name(s) for s in later)
        if self.keep_later_checkpoints:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in later:
                os.rename(checkpoint_path(out, s), out / f"{TRAINER_NAMING.name(s)}.superseded-{stamp}")
            fsync_dir(out)
            log.warning(
                "shardsafe: resuming %s from step %d; the later checkpoints %s were moved aside (*.superseded-%s)",
                out,
                step,
                names,
                stamp,
            )
            return []
        log.warning(
            "shardsafe: resuming %s from step %d; the later checkpoints %s will be replaced as this run saves those "
            "steps (ShardsafeTrainer(..., keep_later_checkpoints=True) moves them aside instead)",
            out,
            step,
            names,
        )
        return later

    def _lease(self, run_dir: str) -> RootLease:
        """This run's lease on ``run_dir``, taken (collectively) before the first checkpoint goes there."""
        key = str(Path(run_dir).absolute())
        if key not in self._leases:
            self._leases[key] = RootLease(Path(key), get_comm(), timeout=self.lease_timeout)
        lease = self._leases[key]
        lease.ensure()
        return lease

    def _check_checkpointable(self) -> None:
        """Refuse, before training, a DeepSpeed setup whose checkpoints shardsafe cannot write (rather than at the first
        save)."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None or self.args.save_strategy == SaveStrategy.NO:
            return
        if plugin.zero_stage != 3:
            raise ShardsafeError(_UNSUPPORTED_STAGE.format(stage=plugin.zero_stage))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load only the model weights of a shardsafe checkpoint (collective).

        ``train()`` calls this before ``accelerator.prepare``; the model is then restored after
        it, together with the optimizer, in one read (:meth:`_prepare_for_training`), so that call
        does nothing.
        """
        if model is None and self._resuming_from is not None:
            return
        engine = self._zero3_engine()
        # the weights are the engine's partitions (with the optimizer state, as DeepSpeed loads them)
        if engine is not None:
            load(resume_from_checkpoint, {ENGINE: engine})
        else:
            load(resume_from_checkpoint, {MODEL: model if model is not None else self.model})

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        """The Trainer's preparation, then (resuming) one collective load of model, optimizer, scheduler and scaler.

        The Trainer would load DeepSpeed's own checkpoint format here (``deepspeed_load_checkpoint``)
        or its pickled optimizer and scheduler files; everything else it does is kept.
        """
        prepared = super()._prepare_for_training(max_steps, train_dataloader, None)
        if resume_from_checkpoint is not None:
            self._restore_training_state(resume_from_checkpoint)
        return prepared

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's, then (resuming) the data position, checked and restored before the Trainer decides where
        its epoch loop starts: after a resume from another global batch the saved epoch, skipping nothing."""
        epochs, steps = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None:
            return epochs, steps
        path = resume_from_checkpoint
        saved = get_comm().on_coordinator(lambda: sorted(open_checkpoint(Path(path))[1]))
        self._restore_data_order(path, DATA in saved)
        decided = self._data.resumed_epoch() if self._data is not None else None
        if decided is not None:
            return decided
        if self._data is not None:
            self._data.trainer_skips(epochs, steps)
        return epochs, steps

    def _restore_training_state(self, path: str) -> None:
        comm = get_comm()
        saved = comm.on_coordinator(lambda: sorted(open_checkpoint(Path(path))[1]))
        engine = self._zero3_engine()
        state: dict[str, Any] = {}
        if engine is not None:
            if ENGINE not in saved:
                raise StateMismatchError(
                    f"{path}: holds {saved}, no DeepSpeed engine state; a ZeRO-3 run resumes only from a ZeRO-3 "
                    "checkpoint"
                )
            state[ENGINE] = engine
        else:
            if MODEL not in saved:
                raise StateMismatchError(
                    f"{path}: holds {saved}, no {MODEL!r}; it was not saved by ShardsafeTrainer without DeepSpeed"
                )
            state[MODEL] = self.model_wrapped
            if OPTIMIZER in saved:
                state[OPTIMIZER] = _inner_optimizer(self.optimizer)
            else:
                log.warning("%s holds no optimizer state (save_only_model?): the optimizer starts fresh", path)
        if SCHEDULER in saved and self.lr_scheduler is not None:
            state[SCHEDULER] = self.lr_scheduler
        scaler = getattr(self.accelerator, "scaler", None)
        if SCALER in saved and scaler is not None:
            state[SCALER] = scaler
        view = self._resharded_view(path) if MODEL in state else None
        try:
            load(str(view) if view is not None else path, state)
        except ShardsafeError as error:
            if view is None:
                raise
            named = _in_checkpoint(error, view, path)
            if named is error:
                raise
            raise named from error
        finally:
            if view is not None:
                remove_tree(view)

    def _resharded_view(self, path: str) -> Path | None:
        """One process: a verified view of a checkpoint whose model.safetensors was re-sharded in place, as the Trainer
        resumes from one (:mod:`.resharded`); None otherwise."""
        if get_comm().world_size != 1 or "://" in path:
            return None
        view = resharded_view(Path(path), f"{MODEL}/")
        if view is not None:
            log.warning(
                "%s: its model weights file is gone, re-sharded as model.safetensors.index.json says; loading the "
                "weights from there, each block checked against the checkpoint's hashes",
                path,
            )
        return view

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restore this rank's RNG state from the checkpoint, where the Trainer restores its own (collective)."""
        if checkpoint is None:
            return
        comm = get_comm()
        if RNG not in comm.on_coordinator(lambda: sorted(open_checkpoint(Path(checkpoint))[1])):
            log.info("%s holds no RNG state; reproducibility of the resumed run is not guaranteed", checkpoint)
            return
        load(checkpoint, {RNG: RNGState()})

    def _load_best_model(self) -> None:
        """Load the best checkpoint's model (under ZeRO-3, like DeepSpeed, its engine state: weights and optimizer)."""
        best = self.state.best_model_checkpoint
        if best is None:
            return
        log.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self._load_from_checkpoint(best, self.model_wrapped)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """The Trainer's, with its end-of-training deletion done by shardsafe.

        With ``save_total_limit=1`` and a best checkpoint, the Trainer deletes every other
        checkpoint here, the newest included, with ``rmtree`` on each saving process (a crash
        leaves half a folder). The limit is hidden from it meanwhile, and the coordinator deletes
        the same checkpoints as rotation does (one rename each, under the run's lease, committed
        shardsafe checkpoints only) before the Trainer's ``on_train_end``.
        """
        if not (self.args.save_total_limit == 1 and self.state.best_model_checkpoint is not None):
            return super()._finalize_training(trial, num_train_samples, start_time)
        run_dir = run_output_dir(self, trial)
        key = str(Path(run_dir).absolute())
        lease = self._leases.get(key)
        best = self.state.best_model_checkpoint

        def delete() -> None:
            try:
                keep_only_best(Path(run_dir), best, fence=lease.fence if lease is not None else None)
            except Exception as exc:  # training is done and its checkpoints committed: logged, as rotation
                log.warning("shardsafe: deleting the checkpoints of %s but the best failed: %s", run_dir, exc)

        get_comm().on_coordinator(delete)  # every rank waits for it
        with save_total_limit_hidden(self.args):
            return super()._finalize_training(trial, num_train_samples, start_time)

    # ------------------------------------------------------------------ model folders

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model as a Hugging Face model folder into ``output_dir`` (default ``args.output_dir``). Collective.

        Under DDP (or one process) the whole model, in its dtype (or ``save_dtype``); under ZeRO-3
        the 16-bit weights gathered a module at a time, or, with
        ``stage3_gather_16bit_weights_on_model_save: false``, no weights file but a sharded
        shardsafe checkpoint in ``checkpoint/`` (config.json and EXPORT.md next to it). Plus the
        tokenizer / processor and ``training_args.json``. The folder is built hidden inside
        ``output_dir`` and its files moved in with the weights marker last, so other contents of
        ``output_dir`` (checkpoints) stay and a reader never sees a marker without its weights.
        """
        out = Path(output_dir).absolute() if output_dir is not None else self._output_dir()
        comm = get_comm()
        staging = Path(comm.on_coordinator(lambda: str(new_hidden(out, "model"))))
        try:
            self._write_model_folder(staging)
            comm.on_coordinator(lambda: self._finish_model_folder(staging, out))
        finally:
            if comm.is_coordinator:
                remove_tree(staging)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_model_folder(self, folder: Path) -> None:
        """Collective: the model's weights (and config) as a new model folder at ``folder``."""
        module = self._module()
        if not is_zero3_model(module):  # whole on every rank (DDP, ZeRO-1/2) or FSDP2: save_pretrained gathers
            save_pretrained(module, folder, dtype=self.save_dtype, max_shard_size=self.max_shard_size)
            return
        total = parameter_count(module)
        if self._gather_16bit_on_save():
            infos, stream = zero3_gathered_tensors(module, self._deepspeed_engine(), dtype=self.save_dtype)
            save_pretrained_stream(
                module, folder, infos, stream, total_parameters=total, max_shard_size=self.max_shard_size
            )
        else:
            sharded = zero3_sharded_model(module, self._deepspeed_engine())
            save_pretrained_sharded(module, folder, sharded, total_parameters=total, dtype=self.save_dtype)

    def _finish_model_folder(self, staging: Path, out: Path) -> None:
        """Coordinator: the Trainer's extra files into the staged folder, then the folder into ``out``."""
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(staging))
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(str(staging))  # type: ignore[union-attr, operator]
        write_small_file(staging / TRAINING_ARGS_NAME, self.args.to_json_string().encode())
        check_model_folder(staging)  # the guard once more on what becomes visible: never a dummy model in output_dir
        install_model_folder(staging, out)

    def _gather_16bit_on_save(self) -> bool:
        engine = self._deepspeed_engine()
        if engine is not None:
            return bool(engine.zero_gather_16bit_weights_on_model_save())
        config = getattr(getattr(self.args, "hf_deepspeed_config", None), "config", None) or {}
        return bool(config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save", False))

    def _module(self) -> nn.Module:
        """The model itself (not its DDP / DeepSpeed wrapper)."""
        if self.model is None:
            raise ShardsafeError("the Trainer has no model")
        return unwrap_module(self.model)

    def _output_dir(self) -> Path:
        if self.args.output_dir is None:
            raise ShardsafeError("TrainingArguments.output_dir is not set")
        return Path(self.args.output_dir).absolute()

    def _deepspeed_engine(self) -> Any:
        """The DeepSpeed engine, once training prepared it (None without DeepSpeed or before)."""
        if not getattr(self, "is_deepspeed_enabled", False):
            return None
        engine: Any = self.model_wrapped
        return engine if hasattr(engine, "zero_optimization_stage") else None

    def _zero3_engine(self) -> Any:
        """The DeepSpeed engine for checkpoints: ZeRO stage 3 only (its partitions are what shardsafe saves)."""
        engine = self._deepspeed_engine()
        if engine is not None and int(engine.zero_optimization_stage()) != 3:
            raise ShardsafeError(_UNSUPPORTED_STAGE.format(stage=engine.zero_optimization_stage()))
        return engine

    # ------------------------------------------------------------------ the Hub

    def push_to_hub(  # type: ignore[override]  # returns the commit URL (the Trainer: a CommitInfo)
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """``save_model``, the model card, then one Hub commit through :func:`shardsafe.push`. Collective.

        The upload holds what the Trainer uploads (``output_dir`` without ``checkpoint-*`` and
        ``_*``), and shardsafe's guard refuses it first if its weights are missing, empty or a
        dummy. Returns the commit URL on every rank. ``blocking=False`` is not supported: the push
        finishes before this returns. The token is ``token``, else ``args.hub_token``, else the
        usual huggingface_hub login.
        """
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None and self.args.should_save:
            model_name = (
                self._output_dir().name if self.args.hub_model_id is None else self.args.hub_model_id.split("/")[-1]
            )
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            init_hf_repo(self, token, private)
        self.save_model(_internal_call=True)
        comm = get_comm()
        repo_id = comm.broadcast(getattr(self, "hub_model_id", None))
        out = self._output_dir()

        def card_and_stage() -> str:
            tags = kwargs.get("tags")
            model_tags = getattr(self.model, "model_tags", None)
            if model_tags is not None:
                tags = [tags] if isinstance(tags, str) else list(tags or [])
                kwargs["tags"] = tags + [t for t in model_tags if t not in tags]
            self.create_model_card(model_name=model_name, **kwargs)
            return str(stage_upload(out))

        stage = Path(comm.on_coordinator(card_and_stage))
        private = private if private is not None else self.args.hub_private_repo
        try:
            with hub_token(token if comm.is_coordinator else None):
                return push(
                    stage,
                    f"hf://{repo_id}",
                    revision=revision or self.args.hub_revision,
                    private=bool(private),
                    message=commit_message,
                    progress=False,
                )
        finally:
            if comm.is_coordinator:
                remove_tree(stage)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """At a checkpoint with ``push_to_hub`` (``hub_strategy`` other than ``end``): push the model as of now.
        Collective.

        The Trainer copies the model files out of the checkpoint folder and uploads in the
        background; a shardsafe checkpoint holds shards, not a model folder, so the model is
        written (as ``save_model`` writes it) into a hidden folder and pushed from there, before
        training goes on. The checkpoint folder itself is not uploaded (``hub_strategy``
        ``checkpoint`` / ``all_checkpoints`` push the model only).
        """
        if self.args.hub_strategy == HubStrategy.END:
            return
        if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            log.warning(
                "ShardsafeTrainer pushes the model at each save; the checkpoint folder %s is not uploaded",
                checkpoint_folder,
            )
        comm = get_comm()
        repo_id = comm.broadcast(getattr(self, "hub_model_id", None))
        staging = Path(comm.on_coordinator(lambda: str(new_hidden(self._output_dir(), "push"))))
        if self.args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.state.epoch or 0)}"
        try:
            self._write_model_folder(staging)

            def extras() -> None:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(str(staging))
                write_small_file(staging / TRAINING_ARGS_NAME, self.args.to_json_string().encode())

            comm.on_coordinator(extras)
            with hub_token(self.args.hub_token if comm.is_coordinator else None):
                push(staging, f"hf://{repo_id}", revision=self.args.hub_revision, message=message, progress=False)
        finally:
            if comm.is_coordinator:
                remove_tree(staging)


def _has_dtensors(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2, tensor parallel): its shards are no model folder."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its state is keyed by the model's
    parameters)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ShardsafeError(
            f"the Trainer's optimizer is a {type(inner).__name__}, not a torch.optim.Optimizer; shardsafe cannot save "
            "it"
        )
    return inner
