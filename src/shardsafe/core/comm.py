"""The few collectives shardsafe needs, usable with no process group at all.

All traffic is small Python objects (plans, chunk records, status), exchanged with torch's
object collectives. Group rank 0 is the coordinator.

Two primitives carry every "one rank decides, all ranks learn" step, so there is one encoding of
an error and one rule for what every rank raises (:class:`Outcome`):

* :meth:`Comm.on_coordinator` runs a function on the coordinator only and gives every rank its
  result, or makes every rank raise the same error;
* :meth:`Comm.agree` has every rank report its own problem (or None) and makes every rank raise
  the same error if any rank had one.

The rule: every rank raises the class the failing rank raised if it is a
:class:`~shardsafe.errors.ShardsafeError` subclass, else the caller's ``default`` class with the
message prefixed by the rank and the original exception type. The rank that failed chains the
original exception (``raise ... from exc``), so its traceback keeps the cause.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from shardsafe import errors
from shardsafe.errors import ShardsafeError

__all__ = ["Comm", "Outcome", "cpu_transport", "get_comm", "global_ranks", "gloo_copy", "gloo_side"]

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one collective step produced: a value, or the error every rank raises (class name + message)."""

    value: T | None = None
    error: str | None = None
    message: str = ""
    rank: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failure(cls, exc: BaseException, rank: int, default: type[ShardsafeError] = ShardsafeError) -> Outcome[Any]:
        """The one encoding of an error: shardsafe errors keep class and message, others become ``default``."""
        if isinstance(exc, ShardsafeError):
            return cls(error=type(exc).__name__, message=str(exc), rank=rank)
        return cls(error=default.__name__, message=f"rank {rank}: {type(exc).__name__}: {exc}", rank=rank)

    def error_class(self, default: type[ShardsafeError] = ShardsafeError) -> type[ShardsafeError]:
        cls = getattr(errors, self.error or "", None)
        return cls if isinstance(cls, type) and issubclass(cls, ShardsafeError) else default

    def unwrap(self, default: type[ShardsafeError] = ShardsafeError, cause: BaseException | None = None) -> T:
        """The value, or raise the shared error (chained to ``cause`` on the rank that failed)."""
        if self.ok:
            return self.value  # type: ignore[return-value]
        raise self.error_class(default)(self.message) from cause


@dataclass(frozen=True)
class Comm:
    group: Any
    rank: int
    world_size: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def _device(self) -> torch.device | None:
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _coordinator_global(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not dist.GroupMember.WORLD else 0

    def broadcast(self, value: T) -> T:
        """The coordinator's ``value``, on every rank."""
        if not self.distributed:
            return value
        box: list[Any] = [value if self.is_coordinator else None]  # the coordinator's value arrives in it
        dist.broadcast_object_list(box, src=self._coordinator_global(), group=self.group, device=self._device())
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on the coordinator (None elsewhere)."""
        if not self.distributed:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(value, out, dst=self._coordinator_global(), group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            self.broadcast(None)

    def on_coordinator(
        self,
        fn: Callable[[], T],
        *,
        default: type[ShardsafeError] = ShardsafeError,
        on_error: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn`` on the coordinator only; every rank returns its result or raises the same error.

        ``on_error`` runs on the coordinator after ``fn`` failed and before the error is shared
        (cleanup of what ``fn`` half made). Without a process group this is ``fn()`` with the same
        error rule.
        """
        outcome: Outcome[T] = Outcome()
        cause: BaseException | None = None
        if self.is_coordinator:
            try:
                outcome = Outcome(value=fn())
            except Exception as exc:  # shared with every rank below
                cause, outcome = exc, Outcome.failure(exc, self.rank, default)
                if on_error is not None:
                    on_error()
        shared: Outcome[T] = self.broadcast(outcome)
        return shared.unwrap(default, cause)

    def agree(
        self, problem: BaseException | None, *, default: type[ShardsafeError] = ShardsafeError, vote: Any = None
    ) -> list[Any]:
        """Every rank reports its own ``problem`` (or None); if any rank had one, every rank raises.

        The class is the first failing rank's; the message lists each distinct problem once, and
        ranks that did not fail are told which rank reported it. A :class:`~shardsafe.errors.PeerFailedError`
        (a rank that waited on a peer that failed) gives way to the peer's own report.
        Returns every rank's ``vote`` (a small value carried by the same collective), in rank order.
        """
        mine = Outcome.failure(problem, self.rank, default) if problem is not None else Outcome[Any](value=vote)
        reports: list[Outcome[Any]] = self.all_gather(mine)
        failed = [r for r in reports if not r.ok]
        if not failed:
            return [r.value for r in reports]
        causes = [r for r in failed if r.error != errors.PeerFailedError.__name__]
        failed = causes or failed  # a rank that only waited on a failed peer steps aside for the peer's own error
        first = failed[0]
        distinct = sorted({r.message for r in failed})
        message = "\n".join(distinct) if len(distinct) > 1 else first.message
        if first.rank != self.rank and self.distributed:
            message = f"(reported by rank {first.rank}) {message}"
        raise first.error_class(default)(message) from problem


def get_comm(process_group: Any = None) -> Comm:
    """The communicator for ``process_group`` (default: the world), or a single-process one."""
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None, 0, 1)
    group = process_group if process_group is not None else dist.GroupMember.WORLD
    return Comm(group, dist.get_rank(group), dist.get_world_size(group))


def _serves_cpu_with_gloo(backend: str) -> bool:
    """Whether a group's backend string (``gloo``, ``cpu:gloo,cuda:nccl``, ``nccl``...) sends CPU tensors over gloo."""
    return backend == "gloo" or "cpu:gloo" in backend.replace(" ", "").split(",")


_GLOO_SIDES: dict[Any, Any] = {}  # the job's group object -> its gloo side group (the process's lifetime)


def global_ranks(comm: Comm) -> list[int]:
    """The global rank of each of ``comm``'s group ranks, in group rank order."""
    if comm.group is dist.GroupMember.WORLD:
        return list(range(comm.world_size))
    return [dist.get_global_rank(comm.group, r) for r in range(comm.world_size)]


def gloo_side(comm: Comm) -> Any:
    """A gloo process group over the same processes as ``comm``, made on first use and kept for the
    life of the process. Its own numbering follows the global ranks (``new_group`` sorts them), which
    may differ from ``comm``'s: address its members by global rank (:func:`global_ranks`).

    Collective among ``comm``'s ranks on the first call only (``use_local_synchronization``: ranks
    outside ``comm`` take no part, so a subgroup's load does not involve the rest of the job); every
    rank of ``comm`` must make its first call at the same point of the same collective sequence, as
    for any collective. The key is the group object itself, so a process group destroyed and made
    anew never finds the old side group."""
    found = _GLOO_SIDES.get(comm.group)
    if found is None:
        found = dist.new_group(ranks=sorted(global_ranks(comm)), backend="gloo", use_local_synchronization=True)
        _GLOO_SIDES[comm.group] = found
    return found


def gloo_copy(comm: Comm) -> Comm:
    """A new gloo group over ``comm``'s processes, numbered as ``comm`` (each process has the same
    rank in both), for a background thread's collectives: they never queue behind the training's.
    Collective over the whole job (``new_group``), once per call.

    ``new_group`` sorts the ranks it is given, so for a group whose global ranks are not ascending
    the copy is made with ``sort_ranks=False`` (torch 2.11+); the results of its collectives are
    indexed by ``comm``'s ranks either way. Without that argument such a group is refused
    (``ValueError``), never numbered differently."""
    if not comm.distributed:
        return comm
    ranks = global_ranks(comm)
    if ranks == sorted(ranks):
        group = dist.new_group(ranks=ranks, backend="gloo")
    elif "sort_ranks" in inspect.signature(dist.new_group).parameters:
        group = dist.new_group(ranks=ranks, backend="gloo", sort_ranks=False)
    else:
        raise ValueError(
            f"process_group: its ranks are global ranks {ranks}, not in ascending order; a background gloo group "
            "numbered the same needs torch >= 2.11 (new_group(sort_ranks=False)): pass a group made by new_group "
            "(ascending), or upgrade torch"
        )
    return Comm(group, comm.rank, comm.world_size)


def cpu_transport(comm: Comm) -> Any:
    """The process group CPU tensors travel on between ``comm``'s ranks (address them by global rank):
    ``comm``'s own group when it sends CPU tensors over gloo (``gloo``, ``cpu:gloo,...``), else (NCCL,
    which takes only GPU tensors) :func:`gloo_side`. Collective on a first call that makes the side group."""
    if not comm.distributed or _serves_cpu_with_gloo(str(dist.get_backend(comm.group))):
        return comm.group
    return gloo_side(comm)
