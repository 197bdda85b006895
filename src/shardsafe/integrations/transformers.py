"""``ShardsafeTrainer``: a ``transformers.Trainer`` whose checkpoints, ``save_model``, rotation, resume and
``push_to_hub`` go through shardsafe, under DDP and under DeepSpeed ZeRO-3.

Change one line of a training script (``Trainer`` -> ``ShardsafeTrainer``); the constructor and
``TrainingArguments`` are the Trainer's. The training math is not touched (the same seed gives the
same weights, bit for bit): only the methods that write, read or delete checkpoints and model
folders are overridden, and each does what the Trainer's does, collectively:

* ``output_dir/checkpoint-<step>`` is one shardsafe checkpoint (:func:`shardsafe.save`, committed
  atomically by the coordinator; every rank writes its own shard): the model (or, under ZeRO-3, the
  engine's partitions), optimizer, LR scheduler, grad scaler, every rank's RNG state, and the small
  files the Trainer reads back (see *trainer files* below). ``get_last_checkpoint`` and ``shardsafe
  inspect/verify/export`` work on these folders.
* Resume (``train(resume_from_checkpoint=True | path)``) restores all of that after
  ``accelerator.prepare``, in one read, and each rank's RNG state at the moment the Trainer
  restores its own (after skipping the batches already trained), so the following losses equal an
  uninterrupted run's.
* Rotation (``save_total_limit``) is done by the coordinator alone and never deletes the newest or
  the best checkpoint (also not at the end of training, where the Trainer would delete the newest
  when ``save_total_limit=1``); a checkpoint disappears by an atomic rename before its data is
  deleted, so a crash mid-deletion leaves no half checkpoint (``shardsafe gc`` removes the rest).
* ``save_model`` writes a Hugging Face model folder into ``output_dir`` (which may also hold
  checkpoints): the whole model, gathered one tensor at a time (under ZeRO-3 one module at a time),
  in the model's dtype; or, under ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save: false``,
  no weights file at all but the model as a sharded shardsafe checkpoint in ``checkpoint/`` (fp32
  master weights; ``shardsafe export`` makes a weights file of it later). The new files appear with
  the weights marker (``model.safetensors`` / the index / ``checkpoint/``) last.
* ``push_to_hub`` uploads through :func:`shardsafe.push`, whose guard refuses missing, empty or
  dummy weights before anything is sent, in one Hub commit.

*Trainer files.* The Trainer reads ``trainer_state.json`` from the checkpoint folder on resume,
before anything else, and export reads ``config.json`` next to the weights. A shardsafe checkpoint
is committed atomically with exactly the files the save wrote, so these cannot be part of the
commit itself. They are stored instead *inside* the checkpoint, as text in its ``state.json``
(``trainer_files``: hashed and committed with the tensors, the source of truth), and written out
next to it as ordinary files by the coordinator after the commit (each atomically: temporary name,
fsync, rename). A crash between the commit and those writes leaves a complete checkpoint without
them, so before a resume the coordinator writes any that are missing from ``state.json`` again,
then every rank reads them. Nothing else reads them, so they can never disagree with the tensors
in a way that matters: a present file was written from the same ``state.json``.

DeepSpeed ZeRO-3 checkpoints go through ``shardsafe.deepspeed_engine`` (a live engine as a state value);
ZeRO-1/2 engines are refused with a clear error. Without a process group everything works on one
process.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy

from shardsafe.api.checkpoint import load, save
from shardsafe.api.source import CHECKPOINT_DIR, TensorInfo
from shardsafe.core.comm import Comm, get_comm
from shardsafe.core.faults import crash_point
from shardsafe.core.format import MANIFEST_NAME
from shardsafe.core.values import decode_value
from shardsafe.errors import CheckpointNotFoundError, ShardsafeError, StateMismatchError
from shardsafe.hf.export import output_dtype
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE
from shardsafe.hf.pretrained import NOTE_FILE, save_pretrained, save_pretrained_sharded, save_pretrained_stream, tied_aliases
from shardsafe.hf.push import push
from shardsafe.manager.manager import CheckpointInfo, choose_kept
from shardsafe.protocol.commit import is_committed, open_checkpoint
from shardsafe.protocol.temppath import DELETING_MARK, TMP_MARK
from shardsafe.state.adapters import unwrap_module
from shardsafe.state.rng import RNGState
from shardsafe.storage.local import fsync_dir, remove_tree, safe_child, write_small_file

log = logging.getLogger(__name__)

T = TypeVar("T")

TRAINER_STATE_NAME = "trainer_state.json"  # what transformers.Trainer reads on resume
TRAINING_ARGS_NAME = "training_args.json"  # the arguments as JSON (the Trainer pickles them to training_args.bin)
META_KEY = "shardsafe.trainer"  # checkpoint metadata: step, epoch, metrics, best checkpoint
CHECKPOINT_RE = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
HF_MAX_SHARD_SIZE = "50GB"  # PreTrainedModel.save_pretrained's default in transformers 5

_UNSUPPORTED_STAGE = (
    "ShardsafeTrainer checkpoints DeepSpeed ZeRO stage 3 (and DDP, one process), not stage {stage}: "
    "use stage 3, or save_strategy='no' (save_model works), or the plain Trainer and `shardsafe convert` for its checkpoints"
)

# Names of the entries of a checkpoint's state.
MODEL, OPTIMIZER, SCHEDULER, SCALER, RNG, ENGINE, FILES = "model", "optimizer", "scheduler", "scaler", "rng", "engine", "trainer_files"


class ShardsafeTrainer(Trainer):
    """``transformers.Trainer`` with checkpoints, ``save_model``, rotation, resume and push through shardsafe.

    Same constructor as ``Trainer``, plus two optional keywords for ``save_model``: ``save_dtype``
    (cast floating-point weights to it; default None keeps the model's dtype, as the Trainer does)
    and ``max_shard_size`` (largest weights file, default ``"50GB"`` as ``save_pretrained``). Every
    method here is collective where the Trainer's is called on every process (it is): all ranks
    take part, only the coordinator (global rank 0) creates, writes or deletes shared paths.
    """

    def __init__(self, *args: Any, save_dtype: torch.dtype | None = None, max_shard_size: int | str = HF_MAX_SHARD_SIZE, **kwargs: Any) -> None:
        self.save_dtype = save_dtype
        self.max_shard_size = max_shard_size
        self._resuming_from: str | None = None
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
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if best == output_dir or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:  # as the Trainer: record the stateful callbacks where it writes the state
            self._record_callback_states()
        comm = get_comm()
        state = self._checkpoint_state(model_only=self.args.save_only_model)
        save(output_dir, state, overwrite=True, metadata=self._checkpoint_metadata())
        if comm.is_coordinator:
            try:
                write_trainer_files(Path(output_dir))
            except Exception as exc:  # the checkpoint is committed and holds them: a resume writes them again
                log.warning("shardsafe: writing the trainer files next to %s failed (a resume writes them again): %s", output_dir, exc)
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if comm.is_coordinator:
            try:
                rotate_checkpoints(Path(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint)
            except Exception as exc:  # the checkpoint is committed; failing here, on one rank, would split the ranks
                log.warning("shardsafe: rotating the checkpoints in %s failed (retried after the next save): %s", run_dir, exc)

    def _record_callback_states(self) -> None:
        from transformers.trainer_callback import ExportableState

        recorded: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]  # a dict once training started
        for callback in [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]:
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
        state[FILES] = self._trainer_files()
        return state

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
            if generation is not None and hasattr(generation, "to_json_string") and (can_generate is None or can_generate()):
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
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k not in ("step", "epoch")
        }
        meta: dict[str, Any] = {
            META_KEY: {"step": step, "epoch": self.state.epoch, "metrics": metrics, "best_model_checkpoint": self.state.best_model_checkpoint}
        }
        if self._deepspeed_engine() is None:  # the model is saved under "model" with its state-dict names: record what export needs
            module = self._module()
            names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
            meta[EXPORT_META] = {"key": MODEL, "dtype": None, "aliases": tied_aliases(module, names), "total_parameters": _parameter_count(module)}
        return meta

    # ------------------------------------------------------------------ checkpoints: resume

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval: list[str] | None = None) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed shardsafe checkpoint in ``output_dir``.

        Before the Trainer reads ``trainer_state.json`` from the checkpoint (every rank reads it),
        the coordinator writes it, and the other trainer files, from the checkpoint's own
        ``state.json`` if they are missing (a crash right after the commit leaves them missing).
        """
        self._check_checkpointable()
        comm = get_comm()
        path: str | None = None
        if resume_from_checkpoint is True:
            found = comm.broadcast(latest_checkpoint(self._output_dir()) if comm.is_coordinator else None)
            if found is None:
                raise CheckpointNotFoundError(f"{self._output_dir()}: no committed shardsafe checkpoint to resume from")
            path = str(found)
        elif resume_from_checkpoint not in (None, False):
            path = str(resume_from_checkpoint)
        if path is not None:
            comm.on_coordinator(lambda: write_trainer_files(Path(path), only_missing=True))
        self._resuming_from = path
        try:
            return super().train(resume_from_checkpoint=path, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        finally:
            self._resuming_from = None

    def _check_checkpointable(self) -> None:
        """Refuse, before training, a DeepSpeed setup whose checkpoints shardsafe cannot write (rather than at the first save)."""
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
        if engine is not None:  # the weights are the engine's partitions (with the optimizer state, as DeepSpeed loads them)
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

    def _restore_training_state(self, path: str) -> None:
        comm = get_comm()
        saved = comm.on_coordinator(lambda: sorted(open_checkpoint(Path(path))[1]))
        engine = self._zero3_engine()
        state: dict[str, Any] = {}
        if engine is not None:
            if ENGINE not in saved:
                raise StateMismatchError(f"{path}: holds {saved}, no DeepSpeed engine state; a ZeRO-3 run resumes only from a ZeRO-3 checkpoint")
            state[ENGINE] = engine
        else:
            if MODEL not in saved:
                raise StateMismatchError(f"{path}: holds {saved}, no {MODEL!r}; it was not saved by ShardsafeTrainer without DeepSpeed")
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
        load(path, state)

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
        """The Trainer's, except that it keeps the newest checkpoint.

        With ``save_total_limit=1`` and a best checkpoint, the Trainer deletes every other
        checkpoint here, the newest included (on each saving process, with ``rmtree``); rotation
        already kept exactly the best and the newest, so the limit is hidden from it meanwhile.
        """
        limit = self.args.save_total_limit
        if limit == 1 and self.state.best_model_checkpoint is not None:
            self.args.save_total_limit = None
            try:
                return super()._finalize_training(trial, num_train_samples, start_time)
            finally:
                self.args.save_total_limit = limit
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
        staging = Path(comm.on_coordinator(lambda: str(_new_hidden(out, "model"))))
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
        total = _parameter_count(module)
        if self._gather_16bit_on_save():
            infos, stream = zero3_gathered_tensors(module, self._deepspeed_engine(), dtype=self.save_dtype)
            save_pretrained_stream(module, folder, infos, stream, total_parameters=total, max_shard_size=self.max_shard_size)
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
            model_name = self._output_dir().name if self.args.hub_model_id is None else self.args.hub_model_id.split("/")[-1]
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
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
            with _hub_token(token if comm.is_coordinator else None):
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
        """At a checkpoint with ``push_to_hub`` (``hub_strategy`` other than ``end``): push the model as of now. Collective.

        The Trainer copies the model files out of the checkpoint folder and uploads in the
        background; a shardsafe checkpoint holds shards, not a model folder, so the model is
        written (as ``save_model`` writes it) into a hidden folder and pushed from there, before
        training goes on. The checkpoint folder itself is not uploaded (``hub_strategy``
        ``checkpoint`` / ``all_checkpoints`` push the model only).
        """
        if self.args.hub_strategy == HubStrategy.END:
            return
        if self.args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            log.warning("ShardsafeTrainer pushes the model at each save; the checkpoint folder %s is not uploaded", checkpoint_folder)
        comm = get_comm()
        repo_id = comm.broadcast(getattr(self, "hub_model_id", None))
        staging = Path(comm.on_coordinator(lambda: str(_new_hidden(self._output_dir(), "push"))))
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
            with _hub_token(self.args.hub_token if comm.is_coordinator else None):
                push(staging, f"hf://{repo_id}", revision=self.args.hub_revision, message=message, progress=False)
        finally:
            if comm.is_coordinator:
                remove_tree(staging)


# ----------------------------------------------------------------------------- checkpoint folders


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the committed shardsafe checkpoints ``run_dir/checkpoint-<step>``, ascending."""
    if not run_dir.is_dir():
        return []
    found = []
    for entry in os.scandir(run_dir):
        match = CHECKPOINT_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and is_committed(Path(entry.path)):
            found.append(int(match.group(1)))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in ``run_dir`` (what ``resume_from_checkpoint=True`` resumes)."""
    steps = checkpoint_steps(Path(run_dir))
    return Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{steps[-1]}" if steps else None


def write_trainer_files(checkpoint: Path, *, only_missing: bool = False) -> list[str]:
    """Write the trainer files a checkpoint's ``state.json`` holds next to it (coordinator). Returns the names written.

    Each file is written under a hidden temporary name, fsynced and renamed into place, so it is
    either absent or complete; ``only_missing`` leaves present ones alone (they were written from
    this same ``state.json``).
    """
    manifest, tree = open_checkpoint(checkpoint)
    entry = tree.get(FILES)
    files = decode_value(entry.get("state"), lambda key: None) if isinstance(entry, dict) else None
    if not isinstance(files, dict):
        return []
    own = {MANIFEST_NAME, manifest.state_file, *manifest.files}
    written = []
    for name, text in files.items():
        if not isinstance(name, str) or not isinstance(text, str) or name.startswith(".") or name in own:
            continue  # never one of the checkpoint's own files
        target = safe_child(checkpoint, name)
        if only_missing and target.exists():
            continue
        tmp = checkpoint / f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        write_small_file(tmp, text.encode())
        os.replace(tmp, target)
        written.append(name)
    if written:
        fsync_dir(checkpoint)
    return written


def rotate_checkpoints(run_dir: Path, limit: int | None, best: str | None) -> list[int]:
    """Delete the oldest checkpoints beyond ``limit`` (coordinator), never the newest or ``best``. Returns the steps deleted.

    Counts as transformers does (at most ``limit`` checkpoints, more only to keep both the newest
    and the best), using shardsafe's retention rule (:func:`shardsafe.manager.choose_kept`: the
    latest is always kept) on committed shardsafe checkpoints only: folders this class did not
    write are never deleted.
    """
    if limit is None or limit <= 0:
        return []
    steps = checkpoint_steps(run_dir)
    best_step = None
    if best is not None:
        match = CHECKPOINT_RE.match(Path(best).name)
        if match and Path(best).absolute().parent == run_dir.absolute():
            best_step = int(match.group(1))
    keep_last = limit if best_step is None or best_step in steps[-limit:] else limit - 1
    keep, _ = choose_kept([CheckpointInfo(s, run_dir / f"{PREFIX_CHECKPOINT_DIR}-{s}", 0) for s in steps], keep_last, None, None, "min")
    if best_step is not None:
        keep.add(best_step)
    doomed = [s for s in steps if s not in keep]
    for step in doomed:
        retire_checkpoint(run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}")
    return doomed


def retire_checkpoint(folder: Path) -> None:
    """Make a checkpoint disappear atomically, then delete it (as :func:`shardsafe.manager.retire`).

    Renamed to a hidden name first (one atomic step: it is either a checkpoint or gone), the
    manifest removed next (no part of it can pass for a checkpoint again), then the rest; a crash
    in between leaves only a hidden folder, which ``shardsafe gc`` removes.
    """
    crash_point("retention:before-rename", 0)
    hidden = folder.parent / f".{folder.name}{DELETING_MARK}{uuid.uuid4().hex[:12]}"
    os.rename(folder, hidden)
    fsync_dir(folder.parent)
    crash_point("retention:after-rename", 0)
    (hidden / MANIFEST_NAME).unlink(missing_ok=True)
    crash_point("retention:mid-delete", 0)
    remove_tree(hidden)


# ----------------------------------------------------------------------------- model folders


def _new_hidden(parent: Path, what: str) -> Path:
    """A fresh hidden path inside ``parent`` (created if needed); ``shardsafe gc`` removes leftovers."""
    parent.mkdir(parents=True, exist_ok=True)
    return parent / f".{what}{TMP_MARK}{uuid.uuid4().hex[:12]}"


def install_model_folder(staging: Path, out: Path, fsync: bool = True) -> None:
    """Move the files of the complete model folder ``staging`` into ``out``, keeping what else ``out`` holds.

    Order makes it safe to read ``out`` at any moment: the markers of the model there now (the
    index, ``checkpoint/``, a ``model.safetensors`` the new model does not replace) go first, then
    the new data and other files, then the new markers (``model.safetensors`` replaces the old one
    in one rename), then the files of the old model nothing refers to any more (shards, EXPORT.md).
    """
    out.mkdir(parents=True, exist_ok=True)
    new = {entry.name for entry in os.scandir(staging)}
    for name in (INDEX_FILE, CHECKPOINT_DIR, SINGLE_FILE):
        old = out / name
        replaced_in_one_rename = name == SINGLE_FILE and name in new
        if replaced_in_one_rename or not (old.exists() or old.is_symlink()):
            continue
        if old.is_dir() and not old.is_symlink():
            hidden = out / f".{name}{DELETING_MARK}{uuid.uuid4().hex[:12]}"
            os.rename(old, hidden)
            remove_tree(hidden)
        else:
            old.unlink()
    if fsync:
        fsync_dir(out)
    markers = [n for n in (CHECKPOINT_DIR, INDEX_FILE, SINGLE_FILE) if n in new]
    for name in [*sorted(new - set(markers)), *markers]:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            remove_tree(target)
        os.replace(staging / name, target)
    for entry in os.scandir(out):
        stale_shard = SHARD_RE.match(entry.name) is not None and entry.name not in new
        if stale_shard or (entry.name == NOTE_FILE and NOTE_FILE not in new):
            os.unlink(entry.path)
    if fsync:
        fsync_dir(out)


def stage_upload(out: Path) -> Path:
    """A hidden folder holding (hard links to) what the Trainer uploads from ``out``: all but ``checkpoint-*``, ``_*`` and hidden names."""
    stage = _new_hidden(out, "push")
    stage.mkdir()
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        if entry.name.startswith((".", "_", f"{PREFIX_CHECKPOINT_DIR}-")):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, stage / entry.name, copy_function=_link_or_copy)
        elif entry.is_file(follow_symlinks=False):
            _link_or_copy(entry.path, str(stage / entry.name))
    return stage


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3 models


def is_zero3_model(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DeepSpeed ZeRO-3 partitions (``ds_id`` set by ``deepspeed.zero.Init`` or the engine)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _state_entries(module: nn.Module) -> list[tuple[str, nn.Module, str, bool]]:
    """(state-dict name, owning module, attribute, is a parameter) in ``nn.Module.state_dict`` order."""
    entries = []
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        entries += [(dot + name, owner, name, True) for name, p in owner._parameters.items() if p is not None]
        skip = owner._non_persistent_buffers_set
        entries += [(dot + name, owner, name, False) for name, b in owner._buffers.items() if b is not None and name not in skip]
    return entries


def _parameter_count(module: nn.Module) -> int:
    """Parameters of the model, each tied one once (ZeRO-3 partitions count whole)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


@contextmanager
def _checkpoint_event(engine: Any) -> Iterator[None]:
    """Around whole-model gathers: partition everything first, re-gather the persistent parameters after (as DeepSpeed does)."""
    optimizer: Any = getattr(engine, "optimizer", None) if engine is not None else None
    if hasattr(optimizer, "checkpoint_event_prologue"):
        optimizer.checkpoint_event_prologue()
    try:
        yield
    finally:
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()


def zero3_gathered_tensors(
    module: nn.Module, engine: Any = None, dtype: torch.dtype | None = None
) -> tuple[list[TensorInfo], Iterator[tuple[str, torch.Tensor]]]:
    """The 16-bit model of a ZeRO-3 ``module`` for :func:`~shardsafe.pretrained.save_pretrained_stream`.

    Returns the tensor list (state-dict order, tied aliases left out as transformers does) and a
    generator every rank must run to its end: it gathers one module's parameters at a time
    (``deepspeed.zero.GatheredParameters``, a collective) and yields each whole tensor while it is
    gathered, so memory is bounded by the largest module. The values are DeepSpeed's own
    (``engine.save_16bit_model`` gathers the same way); ``dtype`` casts the floating-point ones.
    """
    entries = _state_entries(module)
    aliases = tied_aliases(module, [name for name, *_ in entries])
    wanted = [(name, owner, attr, is_param) for name, owner, attr, is_param in entries if name not in aliases]
    infos = []
    for name, owner, attr, is_param in wanted:
        tensor = getattr(owner, attr)
        shape = tuple(int(d) for d in (tensor.ds_shape if is_param and hasattr(tensor, "ds_shape") else tensor.shape))
        infos.append(TensorInfo(name, output_dtype(tensor.dtype, dtype), shape))

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        with _checkpoint_event(engine):
            for _, entries_of_module in itertools.groupby(wanted, key=lambda item: id(item[1])):
                group = list(entries_of_module)
                params = [getattr(owner, attr) for _, owner, attr, is_param in group if is_param]
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    for name, owner, attr, _ in group:
                        yield name, getattr(owner, attr).detach()

    return infos, stream()


def zero3_sharded_model(module: nn.Module, engine: Any = None) -> nn.Module:
    """A stand-in for a ZeRO-3 ``module`` that shardsafe can save: each rank holds its dim-0 slice of every tensor.

    Same state-dict names and order as ``module``. Trainable parameters come from the optimizer's
    fp32 master weights (``deepspeed.utils.safe_get_full_fp32_param``; what ``zero_to_fp32``
    recovers), frozen ones in their own dtype, gathered one parameter at a time; each rank keeps
    only its ``torch.chunk`` slice along dim 0, as a DTensor ``Shard(0)`` over all ranks, so a rank
    holds about 1/world of the fp32 model. Buffers (not partitioned) are kept whole and saved once.
    Tied parameters stay tied (one stand-in parameter under both names).
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from torch.distributed.tensor import DTensor, Shard

    comm = get_comm()
    mesh = _cpu_mesh(comm)
    root = nn.Module()
    mirrors: dict[str, nn.Module] = {"": root}
    made: dict[int, nn.Parameter] = {}
    with _checkpoint_event(engine):
        for name, owner, attr, is_param in _state_entries(module):
            prefix, _, leaf = name.rpartition(".")
            holder = _mirror(mirrors, prefix)
            tensor = getattr(owner, attr)
            if not is_param:
                holder.register_buffer(leaf, tensor.detach())
                continue
            if id(tensor) not in made:
                _check_partition_group(tensor, comm, name)
                full = safe_get_full_fp32_param(tensor) if tensor.requires_grad and hasattr(tensor, "_z3_optimizer") else None
                if full is None:
                    with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                        full = tensor.detach().clone()
                if full.dim() == 0 or mesh is None:  # whole on every rank: saved once
                    local = full.cpu().clone()
                else:
                    pieces = full.chunk(comm.world_size, dim=0)
                    mine = pieces[comm.rank] if comm.rank < len(pieces) else full[full.shape[0] :]
                    local = DTensor.from_local(mine.cpu().clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
                del full
                made[id(tensor)] = nn.Parameter(local, requires_grad=False)
            holder.register_parameter(leaf, made[id(tensor)])
    return root


def _mirror(mirrors: dict[str, nn.Module], prefix: str) -> nn.Module:
    if prefix not in mirrors:
        parent, _, leaf = prefix.rpartition(".")
        holder = nn.Module()
        _mirror(mirrors, parent).add_module(leaf, holder)
        mirrors[prefix] = holder
    return mirrors[prefix]


def _cpu_mesh(comm: Comm) -> Any:
    """A 1-D CPU device mesh over every rank (the stand-in's slices live in host memory); None on one process."""
    if not comm.distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (comm.world_size,))


def _check_partition_group(param: Any, comm: Comm, name: str) -> None:
    group = getattr(param, "ds_process_group", None)
    if group is not None and comm.distributed:
        import torch.distributed as dist

        if dist.get_world_size(group) != comm.world_size:
            raise ShardsafeError(f"{name}: partitioned over {dist.get_world_size(group)} of {comm.world_size} ranks (ZeRO++ / MiCS); not supported")


# ----------------------------------------------------------------------------- small helpers


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its state is keyed by the model's parameters)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ShardsafeError(f"the Trainer's optimizer is a {type(inner).__name__}, not a torch.optim.Optimizer; shardsafe cannot save it")
    return inner


@contextmanager
def _hub_token(token: str | None) -> Iterator[None]:
    """Use ``token`` for the Hub calls inside (huggingface_hub reads ``HF_TOKEN`` on each call)."""
    if token is None:
        yield
        return
    before = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = before


__all__ = [
    "ShardsafeTrainer",
    "checkpoint_steps",
    "install_model_folder",
    "latest_checkpoint",
    "rotate_checkpoints",
    "write_trainer_files",
    "zero3_gathered_tensors",
    "zero3_sharded_model",
]
