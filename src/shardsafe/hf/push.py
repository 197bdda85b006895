"""Publish a model folder or checkpoint: ``push`` to the Hugging Face Hub or an fsspec object store.

``push(src, dest)`` first runs the model-folder guard (:func:`shardsafe.hf.guard.check_model_folder`),
so an empty, dummy, incomplete or mismatched model is refused before a single byte leaves the
machine. Then:

* **Hub** (``hf://owner/name`` or ``owner/name``): the repo (and branch) is created if needed and
  every file goes up in **one commit** (``HfApi.create_commit``), which the Hub applies atomically
  (:mod:`.push_hub`).
* **Object stores** (``s3://bucket/prefix``, ``file:///path``, any fsspec URL): there is no
  commit, so order is the protocol. The destination's old commit markers are deleted first, then
  every data file is uploaded, then the **commit marker** last: ``manifest.json`` for a shardsafe
  checkpoint, ``model.safetensors.index.json`` for a sharded Hugging Face folder,
  ``model.safetensors`` for a single-file one (``checkpoint/manifest.json`` for a config next to a
  checkpoint subfolder). A reader that finds the marker finds a complete model; an interrupted
  push leaves no marker, so it is never taken for a model (:mod:`.push_fsspec`).

Collective: with a process group, only the coordinator (group rank 0) reads ``src`` and uploads;
the other ranks wait for its result and return the same URL or raise the same error. Transient
errors (HTTP 408/429/5xx, connection resets, timeouts) are retried with exponential backoff, a
bounded number of times (:mod:`.push_retry`); anything else fails at once with a
:class:`~shardsafe.errors.PushError` naming the destination and the file. What goes up, in which
order, is :func:`plan_upload` (:mod:`.push_plan`). See docs/PUSH.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shardsafe.core.comm import get_comm
from shardsafe.errors import PushError, ShardsafeError
from shardsafe.hf.push_fsspec import push_fsspec
from shardsafe.hf.push_hub import DEFAULT_MESSAGE, push_hub
from shardsafe.hf.push_plan import (
    COMMIT_MARKERS,
    Destination,
    UploadFile,
    UploadPlan,
    parse_destination,
    plan_upload,
    where,
)
from shardsafe.hf.push_retry import describe

log = logging.getLogger("shardsafe.hf.push")

__all__ = [
    "COMMIT_MARKERS",
    "DEFAULT_MESSAGE",
    "Destination",
    "UploadFile",
    "UploadPlan",
    "parse_destination",
    "plan_upload",
    "push",
]


def push(
    src: str | os.PathLike[str],
    dest: str,
    *,
    revision: str | None = None,
    private: bool = False,
    message: str | None = None,
    process_group: Any = None,
    progress: bool = True,
) -> str:
    """Upload the model folder or checkpoint ``src`` to ``dest``; returns the commit URL (Hub) or ``dest``'s URL.

    Collective when a process group is initialised: every rank calls it, only the coordinator
    reads ``src`` and uploads, and all ranks return the same value or raise the same error
    (:class:`~shardsafe.errors.ModelFolderError` for a folder the guard refuses,
    :class:`~shardsafe.errors.PushError` for anything else). ``revision`` (a branch, created if
    missing), ``private`` (applies when the repo is created) and ``message`` (the commit summary)
    are for Hub destinations. ``progress`` shows a bytes progress bar on the coordinator.

    Args:
        src: a model folder or a shardsafe checkpoint folder.
        dest: ``hf://owner/name`` or ``owner/name`` (a Hub model repo), or an fsspec URL
            (``s3://bucket/prefix``, ``file:///path``).
        revision: the Hub branch to commit to (created if missing; default None: ``main``).
        private: create the Hub repo private (only when it is created; default False).
        message: the Hub commit summary (default None: ``"Upload model with shardsafe"``).
        process_group: the ranks calling (default: the default group, or this process alone).
        progress: a bytes progress bar on the coordinator (default True).

    Returns:
        The Hub commit URL, or the object-store URL of ``dest``.

    Raises:
        ModelFolderError: the guard refuses ``src`` (empty, dummy or incomplete weights); nothing is
            uploaded.
        PushError: anything else (the destination, the network, an option that does not apply).
    """
    comm = get_comm(process_group)
    if not comm.distributed:
        return _push_here(src, dest, revision=revision, private=private, message=message, progress=progress)
    return comm.on_coordinator(
        lambda: _push_here(src, dest, revision=revision, private=private, message=message, progress=progress),
        default=PushError,
    )


def _push_here(
    src: str | os.PathLike[str], dest: str, *, revision: str | None, private: bool, message: str | None, progress: bool
) -> str:
    """The coordinator's part (or the whole push without a process group): guard, plan, then one backend."""
    target = parse_destination(dest)
    if target.kind != "hub" and (revision is not None or private):
        option = "revision" if revision is not None else "private"
        raise PushError(f"{target.url}: `{option}` only applies to Hub destinations (hf://owner/name)")
    plan = plan_upload(src)
    log.info(
        "pushing %s (%s, %d files, %d bytes) to %s",
        plan.folder,
        plan.kind,
        len(plan.files),
        plan.total_bytes,
        target.url,
    )
    try:
        if target.kind == "hub":
            return push_hub(plan, target, revision=revision, private=private, message=message, progress=progress)
        if message is not None:
            log.debug("%s: no commits on an object store; the message is not used", target.url)
        return push_fsspec(plan, target, progress=progress)
    except ShardsafeError:
        raise
    except Exception as exc:
        raise PushError(f"{where(plan, target)}: {describe(exc)}") from exc
