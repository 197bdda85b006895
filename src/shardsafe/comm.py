"""The few collectives shardsafe needs, usable with no process group at all.

All traffic is small Python objects (plans, chunk records, status), exchanged with torch's
object collectives. Group rank 0 is the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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

    def broadcast(self, value: Any) -> Any:
        """The coordinator's ``value``, on every rank."""
        if not self.distributed:
            return value
        box = [value if self.is_coordinator else None]
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


def get_comm(process_group: Any = None) -> Comm:
    """The communicator for ``process_group`` (default: the world), or a single-process one."""
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None, 0, 1)
    group = process_group if process_group is not None else dist.GroupMember.WORLD
    return Comm(group, dist.get_rank(group), dist.get_world_size(group))
