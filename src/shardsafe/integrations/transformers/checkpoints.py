"""The Trainer's checkpoint folders: names, listing, the trainer files next to them, rotation.

``output_dir/checkpoint-<step>`` is the Trainer's name (``get_last_checkpoint`` finds it); each is
an ordinary shardsafe checkpoint. Listing and rotation are the manager's catalog and retention
(:mod:`shardsafe.manager.catalog`, :mod:`shardsafe.manager.retention`) with the Trainer's folder
naming: only the counting rule of ``save_total_limit`` is the Trainer's own.

*Trainer files.* The Trainer reads ``trainer_state.json`` from the checkpoint folder on resume,
before anything else, and export reads ``config.json`` next to the weights. A shardsafe checkpoint
is committed atomically with exactly the files the save wrote, so these cannot be part of the
commit itself. They are stored instead *inside* the checkpoint, as text in its ``state.json``
(``trainer_files``: hashed and committed with the tensors, the source of truth), and written out
next to it as ordinary files by the coordinator after the commit (:func:`write_trainer_files`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from shardsafe.core.format import MANIFEST_NAME
from shardsafe.core.values import decode_value
from shardsafe.errors import CheckpointNotFoundError
from shardsafe.manager.catalog import CheckpointInfo, committed_steps
from shardsafe.manager.naming import StepNaming
from shardsafe.manager.retention import choose_kept, retire
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.temppath import hidden_sibling
from shardsafe.storage.local import fsync_dir, safe_child, write_small_file

__all__ = [
    "DATA",
    "ENGINE",
    "FILES",
    "META_KEY",
    "MODEL",
    "NoValidCheckpointError",
    "OPTIMIZER",
    "RNG",
    "SCALER",
    "SCHEDULER",
    "TRAINER_NAMING",
    "TRAINER_STATE_NAME",
    "TRAINING_ARGS_NAME",
    "WEIGHTS",
    "checkpoint_path",
    "checkpoint_steps",
    "keep_only_best",
    "latest_checkpoint",
    "rotate_checkpoints",
    "write_trainer_files",
]

TRAINER_NAMING = StepNaming(f"{PREFIX_CHECKPOINT_DIR}-")  # checkpoint-<step>, no padding
TRAINER_STATE_NAME = "trainer_state.json"  # what transformers.Trainer reads on resume
TRAINING_ARGS_NAME = "training_args.json"  # the arguments as JSON (the Trainer pickles them to training_args.bin)
META_KEY = "shardsafe.trainer"  # checkpoint metadata: step, epoch, metrics, best checkpoint

# Names of the entries of a checkpoint's state.
MODEL, OPTIMIZER, SCHEDULER, SCALER, RNG, ENGINE, FILES = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "rng",
    "engine",
    "trainer_files",
)
DATA = "data"  # the train sampler's global position (shardsafe.integrations.transformers.data_order)
WEIGHTS = "weights"  # the model as whole tensors, where "model" is not (ZeRO-3 16-bit, FSDP2): see .model_index


class NoValidCheckpointError(CheckpointNotFoundError, ValueError):
    """No checkpoint to resume from: a :class:`~shardsafe.errors.CheckpointNotFoundError` that is also the
    ``ValueError`` the Trainer raises there (``Can't find a valid checkpoint at ...``, ``No valid checkpoint found
    in output directory``), so code that catches either keeps working."""


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """``run_dir/checkpoint-<step>``."""
    return Path(run_dir) / TRAINER_NAMING.name(step)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the committed shardsafe checkpoints ``run_dir/checkpoint-<step>``, ascending."""
    return committed_steps(Path(run_dir), TRAINER_NAMING)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in ``run_dir`` (what ``resume_from_checkpoint=True`` resumes)."""
    steps = checkpoint_steps(Path(run_dir))
    return checkpoint_path(run_dir, steps[-1]) if steps else None


def write_trainer_files(checkpoint: Path, *, only_missing: bool = False) -> list[str]:
    """Write the trainer files a checkpoint's ``state.json`` holds next to it (coordinator). Returns the names written.

    Each file is written under a hidden temporary name, fsynced and renamed into place, so it is
    either absent or complete; ``only_missing`` leaves present ones alone (they were written from
    this same ``state.json``). A crash between the commit and these writes leaves a complete
    checkpoint without them, so before a resume the coordinator calls this again.
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
        tmp = hidden_sibling(target)
        write_small_file(tmp, text.encode())
        os.replace(tmp, target)
        written.append(name)
    if written:
        fsync_dir(checkpoint)
    return written


def rotate_checkpoints(
    run_dir: Path, limit: int | None, best: str | None, fence: Callable[[str], None] | None = None
) -> list[int]:
    """Delete the oldest checkpoints beyond ``limit`` (coordinator), never the newest or ``best``. Returns the steps
    deleted.

    Counts as transformers does (at most ``limit`` checkpoints, more only to keep both the newest
    and the best), using the manager's retention rule and deleter
    (:func:`~shardsafe.manager.retention.choose_kept`: the latest and the best are always kept;
    :func:`~shardsafe.manager.retention.retire`: gone in one rename before any data is deleted)
    on committed shardsafe checkpoints only: folders this class did not write are never deleted.
    """
    if limit is None or limit <= 0:
        return []
    run_dir = Path(run_dir)
    steps = checkpoint_steps(run_dir)
    best_step = None
    if best is not None and Path(best).absolute().parent == run_dir.absolute():
        best_step = TRAINER_NAMING.parse(Path(best).name)
    keep_last = limit if best_step is None or best_step in steps[-limit:] else limit - 1
    kept = choose_kept([CheckpointInfo(s, checkpoint_path(run_dir, s), 0) for s in steps], keep_last, best=best_step)
    return _retire_steps(run_dir, [s for s in steps if s not in kept.steps], fence)


def keep_only_best(run_dir: Path, best: str | None, fence: Callable[[str], None] | None = None) -> list[int]:
    """The Trainer's end of training with ``save_total_limit=1`` (coordinator): every committed checkpoint of
    ``run_dir`` but ``best`` is deleted, the newest included (nothing if ``best`` is not one of them). Returns the
    steps deleted; each goes as :func:`rotate_checkpoints` deletes."""
    if best is None or Path(best).absolute().parent != Path(run_dir).absolute():
        return []
    steps = checkpoint_steps(Path(run_dir))
    best_step = TRAINER_NAMING.parse(Path(best).name)
    if best_step not in steps:
        return []
    return _retire_steps(Path(run_dir), [s for s in steps if s != best_step], fence)


def _retire_steps(run_dir: Path, steps: list[int], fence: Callable[[str], None] | None) -> list[int]:
    for step in steps:
        if fence is not None:
            fence(f"delete checkpoint-{step}")  # the lease check, at the last moment
        retire(checkpoint_path(run_dir, step))
    return steps
