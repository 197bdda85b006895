"""Push to the Hugging Face Hub (``hf://owner/name``): every file in one commit.

The Hub applies a commit atomically, so the whole folder goes up in **one** ``create_commit``
(LFS / Xet uploads happen before it and are invisible until it lands). The repo (and branch) is
created if needed; a commit marker of another kind left by an earlier push is deleted in the same
commit, so it cannot shadow the new model. ``huggingface_hub`` is imported only here, when a push
needs it; its private parts only through :mod:`shardsafe.compat.huggingface_hub`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardsafe.errors import PushError
from shardsafe.hf.push_plan import COMMIT_MARKERS, Destination, UploadPlan, where
from shardsafe.hf.push_retry import RETRY_STATUS, Progress, chain, describe, transport_error, with_retries

__all__ = ["DEFAULT_MESSAGE", "push_hub"]

log = logging.getLogger("shardsafe.hf.push")

DEFAULT_MESSAGE = "Upload model with shardsafe"


@dataclass(frozen=True)
class _Hub:
    """The parts of ``huggingface_hub`` a push uses, imported together so a missing package is one clear error."""

    api_class: Any
    delete_class: Any
    bars_disabled: Callable[[], bool]
    disable_bars: Callable[..., Any]
    enable_bars: Callable[..., Any]
    tracked_add_class: Callable[[], Any]
    xet_enabled: Callable[[], bool]


def _import_hub(target: Destination) -> _Hub:
    """``huggingface_hub`` is optional: imported only when a push to the Hub needs it."""
    try:
        from huggingface_hub import CommitOperationDelete, HfApi
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        from shardsafe.compat.huggingface_hub import tracked_add_class, xet_enabled
    except ImportError:
        raise PushError(
            f"{target.url}: pushing to the Hub needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    return _Hub(
        HfApi,
        CommitOperationDelete,
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
        tracked_add_class,
        xet_enabled,
    )


def push_hub(
    plan: UploadPlan, target: Destination, *, revision: str | None, private: bool, message: str | None, progress: bool
) -> str:
    """Upload ``plan`` to the Hub repo ``target`` in one commit; returns the commit URL."""
    hub = _import_hub(target)
    at = where(plan, target)
    api = hub.api_class()
    repo_id = target.repo_id
    _create_repo(api, repo_id, revision, private, at)
    stale = _stale_markers(api, plan, repo_id, revision, at)
    tracked_add = hub.tracked_add_class()
    # Our bar counts the bytes of LFS uploads; huggingface_hub's own bars (files done) would only
    # clutter it. Xet uploads bypass our counting, so there its byte bars stay on when progress is.
    hide_hf_bars = not (progress and hub.xet_enabled())
    hf_bars_were_off = hub.bars_disabled()
    with Progress(plan.total_bytes, f"push {target.url}", progress) as bar:
        operations = _add_operations(plan, tracked_add, bar, at)
        operations += [hub.delete_class(path_in_repo=name) for name in stale]
        if hide_hf_bars:
            hub.disable_bars()
        try:
            info = _commit(api, plan, operations, repo_id, revision, message, at)
        finally:
            if hide_hf_bars and not hf_bars_were_off:
                hub.enable_bars()
        for f in plan.files:
            bar.finished(f)
    url = str(getattr(info, "commit_url", None) or info)
    log.info("pushed %s to %s in one commit: %s", plan.folder, target.url, url)
    return url


def _create_repo(api: Any, repo_id: str, revision: str | None, private: bool, at: str) -> None:
    """The repo, and the branch when it is not ``main``, exist before the commit (both kept if already there)."""
    # private=None (not False) when not asked for: a new repo then follows the namespace's default visibility
    with_retries(
        lambda: api.create_repo(repo_id, private=private or None, exist_ok=True), "creating the repo", at, hub_transient
    )
    if revision is not None and revision != "main":
        with_retries(
            lambda: api.create_branch(repo_id, branch=revision, exist_ok=True),
            f"creating the branch {revision}",
            at,
            hub_transient,
        )


def _stale_markers(api: Any, plan: UploadPlan, repo_id: str, revision: str | None, at: str) -> list[str]:
    """The commit markers of another kind already in the repo, which the commit deletes."""
    # A commit marker of another kind left by an earlier push would shadow this model (transformers
    # prefers model.safetensors to an index): delete it in the same commit.
    existing = set(
        with_retries(lambda: api.list_repo_files(repo_id, revision=revision), "listing the repo", at, hub_transient)
    )
    names = {f.name for f in plan.files}
    return sorted(m for m in COMMIT_MARKERS.values() if m in existing and m not in names)


def _add_operations(plan: UploadPlan, tracked_add: Any, bar: Progress, at: str) -> list[Any]:
    """One add per file, each reporting the bytes read to the progress bar; an unreadable file is refused here,
    before anything is uploaded."""
    operations: list[Any] = []
    for f in plan.files:
        try:
            op = tracked_add(path_in_repo=f.name, path_or_fileobj=str(f.path))
        except (OSError, ValueError) as exc:
            raise PushError(f"{at}: cannot read {f.name}: {describe(exc)}") from exc
        op.on_read = functools.partial(bar.reached, f)
        operations.append(op)
    return operations


def _commit(
    api: Any, plan: UploadPlan, operations: list[Any], repo_id: str, revision: str | None, message: str | None, at: str
) -> Any:
    """The one ``create_commit`` (retried on transient errors) that makes every file visible at once."""
    return with_retries(
        lambda: api.create_commit(repo_id, operations, commit_message=message or DEFAULT_MESSAGE, revision=revision),
        f"committing {len(plan.files)} files "
        f"({', '.join(f.name for f in plan.files[:3])}{', ...' if len(plan.files) > 3 else ''})",
        at,
        hub_transient,
    )


def hub_transient(exc: BaseException) -> bool:
    """Worth retrying on the Hub: HTTP 408/429/5xx answers and transport errors."""
    for e in chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status in RETRY_STATUS
        if transport_error(e):
            return True
    return False
