"""CheckpointManager: when to save, which checkpoints to keep, where to resume from.

One object per training job, used identically on every rank::

    with shardsafe.CheckpointManager("ckpt", keep_last=3, keep_best=1, best_metric="loss",
                                     save_every=100, async_save=True) as manager:
        start = (manager.restore(state) or 0) + 1
        for step in range(start, total + 1):
            loss = train_step()
            manager.save(step, state, metrics={"loss": loss})
            if manager.stop_requested:      # SIGTERM/SIGUSR1 with handle_preemption=True
                break

Checkpoints are ``root/step-0000000100`` folders (:mod:`.naming`), each a normal shardsafe
checkpoint whose manifest metadata records the step and metrics, so retention (:mod:`.retention`)
and ``shardsafe list`` (:mod:`.catalog`) work from the folder alone after a restart.

Async saves block the training loop only while the local state is copied into host staging
buffers (:mod:`.staging`, reused across saves); writing, hashing, the commit and retention run in
a background thread that talks to the other ranks over its own gloo process group, never the
training's.

A run is the root's one writer (:mod:`.lease`) from its first ``restore`` or ``save`` on: it
restores what the root holds at the moment it becomes the writer, never replaces a step another
run committed unless told to (``overwrite=True``), and a save returns on every rank only once the
retention it triggered is done. ``read_only=True`` makes a reader for evaluation jobs: no lease,
no writes, and a step retired under it is passed over for the next newest.

``local_every=K`` adds a local tier (:mod:`.tier`): every K steps a checkpoint in each node's own
folder (host memory by default), which ``restore`` loads when it is newer than the root's newest.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardsafe.api.checkpoint import describe_collectively, load, location, write_checkpoint
from shardsafe.api.load import load_lacking
from shardsafe.core.comm import Comm, get_comm, gloo_copy
from shardsafe.core.faults import crash_point
from shardsafe.errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    LeaseLostError,
    NoLoadableCheckpointError,
    ReadOnlyError,
    SaveError,
    ShardsafeError,
    StateMismatchError,
)
from shardsafe.manager.catalog import (
    META_KEY,
    Catalog,
    DamagedCheckpoint,
    ManifestCache,
    child,
    committed_steps,
    describe_writer,
    has_manifest,
    metric_value,
    refuse_other_runs_step,
    refuse_renamed_step,
    scan,
    warn_damaged,
    where,
)
from shardsafe.manager.lease import DEFAULT_LEASE_TIMEOUT, RootLease
from shardsafe.manager.naming import STEP_NAMING, step_name
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR
from shardsafe.manager.retention import choose_kept, retire
from shardsafe.manager.staging import SaveWorker, Staged, StagingBuffers, copy_all
from shardsafe.manager.tier import LocalTier
from shardsafe.protocol.shard_write import ReuseMap, reuse_map
from shardsafe.state.registry import DescribeCache, SaveView
from shardsafe.storage.remote import RemoteDir

log = logging.getLogger("shardsafe")

_DAMAGE = (IntegrityError, FormatError, CheckpointNotFoundError)  # what makes restore pass a checkpoint over
_LISTED = 10  # committed checkpoints named in a NoLoadableCheckpointError
_REPLACE_REMEDY = (
    "Pass save(..., overwrite=True) to replace it on purpose; to continue that history, restore() first "
    "(it loads the newest step, and this run may then re-save it); or save into another root"
)


def _optional_count(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be None or an integer >= {minimum}, not {value!r}")


class CheckpointManager:
    """Saves on every ``save`` call (or every ``save_every`` steps), keeps the last/best checkpoints,
    resumes, handles preemption.

    ``save_every``: None (default) saves on every :meth:`save` call; N saves only when ``step % N
    == 0`` (``force=True`` always saves). ``keep_last`` / ``keep_best``: None (default) keeps every
    checkpoint. ``async_save``: False (write in the call), True (copy to staging buffers in the
    call, write in the background), or ``"overlap"`` (the copy itself runs in the background during
    the next forward/backward; every optimizer in the saved state waits for it before its
    ``step()``, so the saved state is exactly the state at the save call; do not modify saved
    tensors in place other than through those optimizers until the next ``step()``).
    ``read_only=True``: a reader (evaluation jobs next to a training run): no lease, ``save`` and
    ``apply_retention`` raise :class:`~shardsafe.errors.ReadOnlyError`.

    Args:
        root: the folder (or object-store URL) holding one ``step-<n>`` checkpoint per saved step
            (``step-0000000100``: ten digits).
        keep_last: how many of the newest checkpoints retention keeps (default None: all).
        keep_best: how many of the best checkpoints by ``best_metric`` it also keeps (default None: all).
        best_metric: the ``metrics`` key that ranks checkpoints (needed by ``keep_best``).
        best_mode: "min" (default) or "max": whether a smaller or a larger ``best_metric`` is better.
        save_every: save only steps that are multiples of it (default None: every call).
        async_save: False (default), True or "overlap" (above).
        process_group: the ranks that save together (default: the default group, or this process alone).
        handle_preemption: on one of ``preemption_signals``, save at the next :meth:`save` call
            and set :attr:`stop_requested` (default False).
        preemption_signals: the signals ``handle_preemption`` catches (default SIGTERM and SIGUSR1).
        fsync: make every checkpoint durable before it is published (default True).
        dedup, lease_timeout, read_only, local_every, local_dir, replicas: see :meth:`__init__`
            (defaults: False, 60 s (:data:`.lease.DEFAULT_LEASE_TIMEOUT`), False, None,
            ``/dev/shm/shardsafe-{user}-{node}``, 0).

    Raises:
        ValueError: contradictory or out-of-range options (named in the message).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        save_every: int | None = None,
        async_save: bool | str = False,
        process_group: Any = None,
        handle_preemption: bool = False,
        preemption_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
        fsync: bool = True,
        dedup: bool = False,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        read_only: bool = False,
        local_every: int | None = None,
        local_dir: str | os.PathLike[str] = DEFAULT_LOCAL_DIR,
        replicas: int = 0,
    ) -> None:
        """``dedup``: a chunk whose bytes equal its counterpart in the newest earlier checkpoint is
        referenced rather than written (frozen weights of a fine-tune are stored once); costs one
        extra hash pass over chunks that have a counterpart.

        ``lease_timeout``: before its first restore, save or deletion the manager takes a lease on
        ``root`` (one live run per root, docs/MANAGER.md); a second run waits at most this long for a
        live holder's lease to lapse, then raises :class:`~shardsafe.errors.LeaseHeldError`. A run
        whose lease another run took over (it was paused longer than this) publishes and deletes
        nothing: its saves raise :class:`~shardsafe.errors.LeaseLostError`.

        ``read_only``: never take the lease, never write or delete (``restore`` and the queries
        only), so it can run while another job writes the root; not with ``handle_preemption``
        (whose point is a final save).

        ``local_every``: every K steps also a checkpoint in each node's own folder ``local_dir``
        (``{node}`` in it is replaced by the rank's node id, ``$SHARDSAFE_NODE`` or the hostname;
        default ``/dev/shm/shardsafe-{user}-{node}``, host memory), which :meth:`restore` loads when it is
        newer than the root's newest; ``replicas``: how many other nodes keep a copy of each
        node's files there (docs/MANAGER.md, *Local tier*; :mod:`.tier`)."""
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metrics key to rank checkpoints by)")
        if async_save not in (False, True, "overlap"):
            raise ValueError(f"async_save must be False, True or 'overlap', not {async_save!r}")
        _optional_count("save_every", save_every, 1)
        _optional_count("keep_last", keep_last, 0)
        _optional_count("keep_best", keep_best, 0)
        _optional_count("local_every", local_every, 1)
        _optional_count("replicas", replicas, 0)
        if read_only and local_every is not None:
            raise ValueError("read_only=True saves nothing, so it has no local tier (local_every)")
        if replicas and local_every is None:
            raise ValueError("replicas copies the local tier's steps to other nodes: it needs local_every")
        if read_only and handle_preemption:
            raise ValueError(
                "read_only=True saves nothing, so handle_preemption (a final save on SIGTERM) cannot be honoured"
            )
        self.root = location(root)
        self.read_only = read_only
        self.keep_last, self.keep_best = keep_last, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.save_every = save_every
        self.async_save = async_save
        self.fsync = fsync
        self.dedup = dedup
        self.comm = get_comm(process_group)
        self.lease = RootLease(self.root, self.comm, timeout=lease_timeout)
        self._background_comm = gloo_copy(self.comm) if async_save and not read_only else self.comm
        self._tier = (
            LocalTier(where(self.root), gloo_copy(self.comm), local_every, local_dir, replicas, fsync)
            if local_every
            else None
        )
        self.restored_from: str | None = None  # "local" or "root": where the last restore() loaded from
        self._staging = StagingBuffers()
        # what the previous describe found, reused while the structure is unchanged (local and root saves)
        self._describe_cache = DescribeCache()
        self._manifests = ManifestCache()
        self._reported: set[tuple[str, str]] = set()  # damaged checkpoints already warned about
        self._warned_metric = False
        self._worker = SaveWorker()  # writes async saves; started by the first
        self._tier_worker = SaveWorker("shardsafe-local-tier")  # writes the local tier's saves, in order
        # the local tier's copy of the state (an async root save may hold the other)
        self._tier_staging = StagingBuffers()
        self._at_exit = False
        self._copied = threading.Event()
        self._copied.set()
        self._tier_copied = threading.Event()  # the local tier's copy (overlap mode), as _copied is the root's
        self._tier_copied.set()
        self._error: BaseException | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._preempt_signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.stop_requested = False
        self.skipped: list[tuple[int, str]] = []  # (step, reason) of damaged checkpoints restore passed over
        self.retention_errors: list[str] = []  # retention failures (coordinator; logged, not raised)
        self._restored: set[int] = set()  # steps this run restored: it continues them, so it may save them again
        if handle_preemption:
            self._install_signal_handlers(preemption_signals)

    # ------------------------------------------------------------------ queries

    def step_path(self, step: int) -> Path | RemoteDir:
        return child(self.root, step_name(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending (damaged ones included: only a load can tell)."""
        return committed_steps(self.root)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def save_in_flight(self) -> bool:
        """Whether an async save is still being written (it is committed when this turns False, or at
        the next :meth:`save` / :meth:`wait`, which also raise its error)."""
        return self._worker.busy

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` of ``step`` writes without ``force``: always, unless ``save_every`` is set."""
        return self.save_every is None or step % self.save_every == 0

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, Any] | None = None,
        force: bool = False,
        *,
        overwrite: bool = False,
    ) -> bool:
        """Save ``state`` as ``step``. Collective. Returns True if it saved.

        Saves on every call unless ``save_every`` is set; then only when ``step`` is a multiple of
        it, or with ``force=True``, or when a preemption signal arrived. Raises the error of a
        previous background save, if one failed.

        A committed ``step`` written by another run is not replaced: :class:`CheckpointExistsError`
        names that run, unless ``overwrite=True``. This run's own steps, and the step it restored,
        it may save again (the rule: :func:`~shardsafe.manager.catalog.refuse_other_runs_step`).
        When the save returns (async: when it is committed, at the next ``save``/``wait``), the
        retention it triggered has finished, on every rank.

        Args:
            step: the training step; the checkpoint folder is ``step-<step>`` (ten digits) under the root.
            state: what :func:`shardsafe.save` takes (modules, optimizers, schedulers, values).
            metrics: JSON-able numbers recorded with the step (``best_metric`` ranks by one).
            force: save even when ``save_every`` says not to.
            overwrite: replace a committed ``step`` written by another run.

        Returns:
            True if a checkpoint of ``step`` was saved (or, async, handed to the background writer).

        Raises:
            CheckpointExistsError: ``step`` is another run's committed checkpoint.
            LeaseLostError: another run took over the root; this run publishes nothing.
            ReadOnlyError: the manager is ``read_only``.
            SaveError: this save failed on some rank, or a previous background save did.
        """
        self._check_writable(f"save step {step}")
        self._raise_background_error()
        preempted = self._agree_on_preemption()
        local_due = self._tier is not None and not preempted and self._tier.due(step)
        root_due = force or preempted or self.should_save(step)
        # a step due in both tiers is copied once, into the root's staging buffers, which both write from
        shared_copy = local_due and root_due and self.async_save is True
        if local_due and not shared_copy:
            self._save_local(step, state, metrics)
        if not root_due:
            return False
        self.wait()
        if self._tier is not None:  # a local write of a step saved to both may still read the root's buffers
            self._tier_worker.join()
        self.lease.ensure()
        self._check_best_metric(step, metrics)
        if self.dedup:
            self._check_not_referenced(step)
        metadata = self._metadata(step, metrics)
        view = self._describe_and_check(step, state, overwrite)
        if not self.async_save or preempted:
            self._write(step, view, metadata)
        else:
            staged = self._staging.prepare(view)
            if self.async_save == "overlap":
                self._copied.clear()
                self._hook_optimizers(state)
            else:
                copy_all(staged)
            if shared_copy:
                self._submit_local(step, staged.view, metadata)
            self._worker.submit(partial(self._background, step, metadata, staged))
            if not self._at_exit:
                atexit.register(self._finish_at_exit)
                self._at_exit = True
        if preempted:
            self.stop_requested = True
            log.warning("shardsafe: signal %s received; saved step %d, stop training now", self._preempt_signal, step)
        return True

    def _save_local(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None) -> None:
        """The local tier's save of ``step``: the caller blocks for one agreement on the state and a
        copy of it into the tier's own staging buffers; the tier's thread writes it (every node's
        folder, then the replicas) over the tier's group. The previous local save is finished first
        (with a step time above its write time, it is already).

        With ``async_save="overlap"`` the call does not wait for the copy either: the optimizers
        wait for it in their step pre-hook, and the tier's thread makes it while the next
        forward/backward runs. A state wholly in host memory is not copied at all there: the tier's
        thread writes the node's files straight from the live tensors (no staging buffers, so no
        second copy of the state in memory), and the optimizers wait until those files are written."""
        assert self._tier is not None
        self._tier_worker.join()
        self.lease.ensure()
        view = describe_collectively(state, self.comm, default=SaveError, cache=self._describe_cache)
        metadata = self._metadata(step, metrics)
        if self.async_save != "overlap":
            staged = self._tier_staging.prepare(view)
            copy_all(staged)
            self._submit_local(step, staged.view, metadata)
            return
        self._tier_copied.clear()
        self._hook_optimizers(state)
        if all(chunk.tensor.device.type == "cpu" for chunk in view.chunks):
            self._tier_staging.buffers.clear()
            self._submit_local(step, view, metadata)
        else:
            staged = self._tier_staging.prepare(view)
            self._submit_local(step, staged.view, metadata, pending=staged)

    def _submit_local(self, step: int, view: SaveView, metadata: dict[str, Any], pending: Staged | None = None) -> None:
        """Hand the local tier's write of ``step`` from ``view`` to the tier's thread. Overlap mode:
        ``pending``, the staged copy the thread makes first; without it, ``view`` may be the live
        state, and the optimizers are released (``_tier_copied``, already set in every other case)
        once the node's files are written."""
        tier = self._tier
        assert tier is not None

        def write() -> None:
            if pending is not None:
                _copy_if_pending(pending, self._tier_copied)
            try:
                tier.save(step, view, metadata, written=self._tier_copied.set)
            finally:  # also when the save failed or was skipped: the optimizers never wait forever
                self._tier_copied.set()

        self._tier_worker.submit(write)

    def _metadata(self, step: int, metrics: dict[str, Any] | None) -> dict[str, Any]:
        written_by = self.lease.metadata()
        return {
            META_KEY: {
                "step": step,
                "metrics": dict(metrics or {}),
                "best_metric": self.best_metric,
                "best_mode": self.best_mode,
                **written_by,
            }
        }

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyError(
                f"{where(self.root)}: this CheckpointManager is read-only (read_only=True) and does not {what}; "
                "the job that trains into this root saves with its own (writing) manager"
            )

    def _describe_and_check(self, step: int, state: dict[str, Any], overwrite: bool) -> SaveView:
        """Collective, one agreement: this rank's view of ``state`` and, on the coordinator unless
        ``overwrite``, the refusal of a ``step`` another run committed (decided under the lease)."""

        def refuse() -> None:
            refuse_other_runs_step(
                self.root, step, self.lease.run_id, self._restored, _REPLACE_REMEDY, read=self._manifests
            )

        return describe_collectively(
            state, self.comm, None if overwrite else refuse, default=SaveError, cache=self._describe_cache
        )

    def _check_best_metric(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Warn (once) when a save cannot be ranked: keep_best would silently keep nothing for it."""
        if self.best_metric is None or self._warned_metric or not self.comm.is_coordinator:
            return
        if metric_value(metrics or {}, self.best_metric) is None:
            self._warned_metric = True
            log.warning(
                "shardsafe: save of step %d has no number under best_metric %r in its metrics (%s); it cannot be "
                "ranked "
                "as the best checkpoint (warned once)",
                step,
                self.best_metric,
                sorted(metrics or {}),
            )

    def _write(self, step: int, view: SaveView, metadata: dict[str, Any], comm: Comm | None = None) -> None:
        reuse = self._reuse_map(step) if self.dedup else None
        write_checkpoint(
            self.step_path(step),
            view,
            comm or self.comm,
            overwrite=True,
            metadata=metadata,
            fsync=self.fsync,
            reuse=reuse,
            before_publish=lambda: self.lease.fence(f"publish step {step}"),
        )
        # Every rank waits for the coordinator's retention: when a save returns anywhere, the root is as retention left
        # it.
        (comm or self.comm).on_coordinator(lambda: self._retain_after(step))

    def _retain_after(self, step: int) -> None:
        try:
            self.apply_retention()
        # the save is committed: a retention failure is logged and retried, never a failed save
        except Exception as exc:
            log.warning("shardsafe: retention after saving step %d failed (retried after the next save): %s", step, exc)
            self.retention_errors.append(f"step {step}: {type(exc).__name__}: {exc}")

    def _background(self, step: int, metadata: dict[str, Any], staged: Staged) -> None:
        try:
            _copy_if_pending(staged, self._copied)
            crash_point("async:before-write", self.comm.rank)
            self._write(step, staged.view, metadata, self._background_comm)
        except BaseException as exc:  # surfaced by the next call
            self._error = exc

    def _catalog(self, steps: list[int] | None = None) -> Catalog:
        """The readable checkpoints of the root (manifests cached); damaged ones warned about once each."""
        return scan(self.root, steps, read=self._manifests, warn=self._warn_once)

    def _warn_once(self, damaged: DamagedCheckpoint) -> None:
        key = (str(damaged.path), damaged.reason)
        if key not in self._reported:
            self._reported.add(key)
            warn_damaged(damaged)

    def _reuse_map(self, step: int) -> ReuseMap | None:
        """Chunks of the newest other readable checkpoint, for storing unchanged tensors once.

        Called by every rank (each writes its own chunks); a damaged newest one is passed over.
        """
        for other in reversed([s for s in self.steps() if s != step]):
            catalog = self._catalog([other])
            if other in catalog.manifests:
                return reuse_map(catalog.manifests[other], step_name(other))
        return None

    def _check_not_referenced(self, step: int) -> None:
        name = step_name(step)
        if name in self._catalog([s for s in self.steps() if s != step]).references():
            raise SaveError(
                f"{self.step_path(step)}: other checkpoints store tensors in this folder (dedup); "
                "it cannot be overwritten - delete the later checkpoints first or save under another step"
            )

    def apply_retention(self) -> list[int]:
        """Delete checkpoints outside keep_last/keep_best (coordinator only). Returns deleted steps.

        A damaged checkpoint is neither counted nor deleted (it is warned about once): the newest
        readable one is the latest, the one ``restore`` would load.
        """
        self._check_writable("delete checkpoints")
        if not self.comm.is_coordinator or (self.keep_last is None and self.keep_best is None):
            return []
        catalog = self._catalog()
        infos = catalog.infos()
        kept = choose_kept(infos, self.keep_last, self.keep_best, self.best_metric, self.best_mode)
        doomed = [i.step for i in infos if i.step not in kept.steps]
        if doomed:
            still_needed = catalog.references(sorted(kept.steps))
            for step in doomed:
                self.lease.fence(f"delete step {step}")  # at the last moment: a run taken over deletes nothing
                self._manifests.forget(self.step_path(step))
                retire(self.step_path(step), still_needed.get(step_name(step)))
        return doomed

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed, and the local tier's; raise its error if it failed."""
        self._tier_worker.join()
        self._worker.join()
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            if isinstance(exc, LeaseLostError):  # the run must stop, not retry: keep the class
                raise LeaseLostError(f"background save failed: {exc}") from exc
            if isinstance(exc, ShardsafeError):
                raise SaveError(f"background save failed: {exc}") from exc
            raise SaveError(f"background save failed: {type(exc).__name__}: {exc}") from exc

    def _finish_at_exit(self) -> None:
        """At interpreter exit, finish a save still in flight rather than let the exit kill it silently."""
        if not self._worker.busy:
            return
        log.warning(
            "shardsafe: finishing the save in flight under %s at exit (close the manager, or use it in a with block)",
            self.root,
        )
        try:
            self.wait()
        except SaveError as exc:
            log.error("shardsafe: %s", exc)

    # ------------------------------------------------------------------ overlap mode

    def _hook_optimizers(self, state: dict[str, Any]) -> None:
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked.add(id(value))
                self._hooks.append(value.register_step_pre_hook(self._wait_for_copy))

    def wait_for_copy(self) -> None:
        """Block until the state of the save in flight is copied (overlap mode), not until it is written.

        After this the live tensors may change again: a training loop calls it before whatever
        updates saved state outside ``optimizer.step()`` (whose pre-hook already waits), e.g. a
        trainer's own step hooks. Returns at once when nothing is being copied (every other mode
        copies inside :meth:`save`).
        """
        self._copied.wait()
        self._tier_copied.wait()

    def _wait_for_copy(self, *args: Any, **kwargs: Any) -> None:  # the optimizers' step pre-hook
        self.wait_for_copy()

    # ------------------------------------------------------------------ restore

    def restore(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load the newest committed checkpoint that loads cleanly (or ``step``). Collective.

        A writing manager first takes the root's lease (waiting as a save does), so it loads the
        newest checkpoint as of the moment this run becomes the root's only writer. A damaged
        checkpoint (missing file, hash mismatch, bad manifest) is reported, listed in
        :attr:`skipped` and passed over for the next older one; one that was retired while it was
        being read (a read-only manager next to a writing run) is passed over quietly for the
        newest one left. Returns the step loaded, or None when the root holds no committed
        checkpoint. When it holds some and none loads, raises
        :class:`~shardsafe.errors.NoLoadableCheckpointError` (naming each, and who wrote it)
        rather than let the run start from scratch over that history. With a local tier, a newer
        complete step there is loaded first (:attr:`restored_from` says which tier).

        Args:
            state: the objects to load into, as :func:`shardsafe.load` takes them.
            step: load exactly this step instead of the newest (no fallback to older ones).
            strict: as :func:`shardsafe.load`'s ``strict``.

        Returns:
            The step loaded, or None when the root holds no committed checkpoint (a fresh run).

        Raises:
            NoLoadableCheckpointError: the root holds checkpoints and none of them loads.
            LeaseHeldError: another live run holds the root's lease past ``lease_timeout``.
            StateMismatchError: the state does not fit the checkpoint (the caller's error: no
                fallback to an older step).
        """
        self.wait()
        if not self.read_only:
            self.lease.ensure()
        self.restored_from = None
        tier = "root"
        if step is not None:
            self._load(step, state, strict)
        else:
            found = self._restore_local(state, strict)
            if found is not None:
                tier = "local"
            else:
                found = self._restore_newest(state, strict)
            if found is None:
                return None
            step = found
        self.restored_from = tier
        self._restored.add(step)
        return step

    def _restore_local(self, state: dict[str, Any], strict: bool) -> int | None:
        """The local tier's newest complete step, if it is newer than the root's newest committed one."""
        if self._tier is None:
            return None

        def load_step(folder: Path, lacking: frozenset[str]) -> int:
            step = STEP_NAMING.parse(folder.name)
            assert step is not None  # the tier names its folders with the same naming
            self._refuse_renamed(folder, step)
            # what this node's folder lacks comes from the ranks whose folders hold it, straight into the load
            return load_lacking(folder, state, lacking, process_group=self.comm.group, strict=strict).received_bytes

        return self._tier.restore(self._newest_except({}), load_step)

    def _restore_newest(self, state: dict[str, Any], strict: bool) -> int | None:
        """The newest step that loads, listing again after each failure (a reader's root can change meanwhile)."""
        failed: dict[int, str] = {}
        while (candidate := self._newest_except(failed)) is not None:
            try:
                self._load(candidate, state, strict)
                return candidate
            # the checkpoint does not fit the state: the caller's error, not the checkpoint's
            except StateMismatchError:
                raise
            except (ShardsafeError, OSError) as exc:
                # Whatever a load raises when the folder goes from under it (retention, between the listing and the last
                # read).
                if self.comm.on_coordinator(lambda: not has_manifest(self.step_path(candidate))):
                    log.debug(
                        "shardsafe: %s was retired while it was read; trying the newest one left",
                        self.step_path(candidate),
                    )
                    failed[candidate] = "retired while it was read"
                    continue
                if not isinstance(exc, _DAMAGE):
                    raise
                log.warning("shardsafe: skipping damaged checkpoint %s: %s", self.step_path(candidate), exc)
                self.skipped.append((candidate, str(exc)))
                failed[candidate] = f"{type(exc).__name__}: {exc}"
        problem = self.comm.on_coordinator(lambda: self._nothing_loaded(failed)) if failed else None
        if problem is not None:
            raise NoLoadableCheckpointError(problem)
        return None

    def _newest_except(self, failed: dict[int, str]) -> int | None:
        """The coordinator's newest committed step not yet tried, on every rank."""
        return self.comm.on_coordinator(lambda: max((s for s in self.steps() if s not in failed), default=None))

    def _refuse_renamed(self, folder: Path | RemoteDir, step: int) -> None:
        """Collective, before a restore loads ``folder`` as ``step``: one manifest read, on the coordinator."""
        self.comm.on_coordinator(
            lambda: refuse_renamed_step(self._manifests(folder), step, where(folder)), default=FormatError
        )

    def _load(self, step: int, state: dict[str, Any], strict: bool) -> None:
        self._refuse_renamed(self.step_path(step), step)
        metadata = load(self.step_path(step), state, process_group=self.comm.group, strict=strict)
        written = metadata.get(META_KEY, {}) if isinstance(metadata, dict) else {}
        if self.comm.is_coordinator:
            log.info(
                "shardsafe: restored %s, written by run %s (lease epoch %s)",
                self.step_path(step),
                written.get("run_id", "unknown"),
                written.get("lease_epoch", "unknown"),
            )

    def _nothing_loaded(self, failed: dict[int, str]) -> str | None:
        """Coordinator: what a restore that loaded nothing saw, and what to do (the NoLoadableCheckpointError
        message); None if the root holds no committed checkpoint any more (all were retired: nothing to refuse)."""
        committed = self.steps()
        if not committed:
            return None
        seen = []
        for step in reversed(committed[-_LISTED:]):
            _, who = describe_writer(self.step_path(step), self._manifests)
            seen.append(f"step {step}, written by {who}: {failed.get(step, 'not tried')}")
        more = f" (and {len(committed) - _LISTED} older)" if len(committed) > _LISTED else ""
        return (
            f"{where(self.root)}: restore loaded none of the {len(committed)} committed checkpoints{more}: "
            + "; ".join(seen)
            + ". "
            "Starting from scratch here would silently train over that history. Check them (shardsafe verify / "
            "shardsafe list), "
            "then repair or move the damaged ones away, load one on purpose with restore(state, step=N), or start the "
            "run in "
            "another root; to start from scratch here anyway, catch NoLoadableCheckpointError"
        )

    # ------------------------------------------------------------------ preemption

    def _install_signal_handlers(self, signals: tuple[int, ...]) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            self._preempt_signal = signum

        for sig in signals:
            self._previous_handlers[sig] = signal.signal(sig, on_signal)

    def _agree_on_preemption(self) -> bool:
        if not self._previous_handlers:
            return False
        return any(self.comm.all_gather(self._preempt_signal is not None))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish the save in flight, restore signal handlers, raise any background error."""
        try:
            self.wait()
        finally:
            self._worker.close()
            self._tier_worker.close()
            if self._tier is not None:
                try:
                    self._tier.close(self.latest_step() if self._tier.nodes.is_leader else None)
                except Exception as exc:  # what is left is this node's host memory, not the root: never a failed close
                    log.warning("shardsafe: could not remove the local tier %s: %s", self._tier.folder, exc)
            self.lease.release()
            if self._at_exit:
                atexit.unregister(self._finish_at_exit)
                self._at_exit = False
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._hooked.clear()
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except SaveError as close_error:
                log.error("shardsafe: %s", close_error)


__all__ = ["CheckpointManager"]


def _copy_if_pending(staged: Staged, copied: threading.Event) -> None:
    """Overlap mode, on a background thread: fill ``staged`` if the save call left its copy to this
    thread (``copied`` not set), then release the optimizers waiting in their step pre-hook."""
    if not copied.is_set():
        try:
            copy_all(staged)
        finally:
            copied.set()
