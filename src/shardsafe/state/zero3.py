"""The layout of a live DeepSpeed ZeRO-3 engine: which parameter's share this rank holds, where.

Why this layout is stored as it is: ZeRO-3 gives rank r elements ``[r*part, (r+1)*part)`` of each
flattened parameter (``part = ceil(numel / W)``, the last rank's slice padded). Stored as a 1-D
tensor of ``numel`` elements per parameter (padding never stored), that slice is a contiguous
chunk at offset ``r*part``; at another world size each rank's new slice is a contiguous range of
the same tensor, so the normal resharding reader (``plan.plan_reads``) serves it with one
``preadv`` per stored chunk it overlaps, straight into a view of the flat partition. Keying by
parameter name (not by DeepSpeed's sub-group index, whose boundaries depend on W) is what makes
the load independent of the world size.

Internals relied on (DeepSpeed 0.19.8, ``deepspeed/runtime/zero/stage3.py``): the optimizer's
``fp32_partitioned_groups_flat`` / ``fp16_partitioned_groups_flat`` (one flat tensor per sub-group),
``fp16_groups`` (the parameters of each sub-group, in flat order), ``sub_group_to_group_id``,
``grad_position[param_id] = (sub_group, offset, partition numel)`` and ``get_param_id``, the inner
torch optimizer's ``state`` keyed by the fp32 flat tensors; per parameter ``ds_tensor``,
``ds_shape``, ``ds_numel``, ``partition_numel()`` and ``ds_process_group``. DeepSpeed itself is not
imported here (only deepspeed_engine.py imports it); its underscore names are reached through
:mod:`shardsafe.compat.deepspeed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.compat.deepspeed import unflatten_partitions, z3_optimizer
from shardsafe.errors import ShardsafeError

__all__ = [
    "COUNTERS",
    "SECTIONS",
    "Zero3Layout",
    "Zero3Targets",
    "ZeroParam",
    "is_zero3_param",
    "refresh_16bit_partitions",
    "tensor_key",
]

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
SECTIONS = ("fp32", "optim", "frozen", "buffers")


@dataclass(frozen=True)
class ZeroParam:
    """One parameter of the engine and this rank's share of it."""

    name: str
    param: Any  # a ZeRO-3 parameter (torch.nn.Parameter with ds_* attributes)
    numel: int
    shape: tuple[int, ...]
    part: int  # elements per rank (ceil(numel / W)); the last ranks' shares are padded
    rank: int  # this rank's index in the parameter's partition group
    sub_group: int = -1  # trainable only: index of its flat sub-group
    flat_offset: int = 0  # trainable only: where its partition starts in the flat sub-group

    @property
    def start(self) -> int:
        """Global element offset of this rank's share (clipped, so an empty share still has a valid offset)."""
        return min(self.rank * self.part, self.numel)

    @property
    def count(self) -> int:
        """Elements of this rank's share that belong to the parameter (padding excluded)."""
        return max(0, min(self.numel, (self.rank + 1) * self.part) - self.rank * self.part)


def is_zero3_param(tensor: Any) -> bool:
    """Whether ``tensor`` is a parameter partitioned by ZeRO-3 (``deepspeed.zero.Init`` or an engine set
    ``ds_tensor``)."""
    return hasattr(tensor, "ds_tensor") and hasattr(tensor, "ds_numel") and hasattr(tensor, "ds_shape")


def zero3_partition(name: str, p: Any, where: str, sub_group: int = -1, flat_offset: int = 0) -> ZeroParam:
    """This rank's share of the ZeRO-3 parameter ``p``, checked against the layout shardsafe relies on
    (``ceil(numel / W)`` elements per rank, not quantized, not on NVMe)."""
    if not hasattr(p, "ds_tensor") or p.ds_tensor is None:
        raise ShardsafeError(f"{where}: parameter {name!r} is not partitioned by ZeRO-3 (no ds_tensor)")
    if getattr(p.ds_tensor, "ds_quant_scale", None) is not None:
        raise ShardsafeError(
            f"{where}: parameter {name!r} is stored quantized (zero_quantized_nontrainable_weights); shardsafe does "
            "not support that"
        )
    if getattr(getattr(p.ds_tensor, "final_location", None), "name", "") == "nvme":
        raise ShardsafeError(f"{where}: parameter {name!r} is offloaded to NVMe, which shardsafe does not support")
    import torch.distributed as dist

    group = getattr(p, "ds_process_group", None)
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    numel, part = int(p.ds_numel), int(p.partition_numel())
    if part * world < numel or (numel and part != -(-numel // world)) or p.ds_tensor.numel() != part:
        raise ShardsafeError(
            f"{where}: parameter {name!r} ({numel} elements) is partitioned unexpectedly over {world} ranks "
            f"({part} per rank, local partition {p.ds_tensor.numel()}); this DeepSpeed version's ZeRO-3 layout is not "
            "supported"
        )
    return ZeroParam(name, p, numel, tuple(int(d) for d in p.ds_shape), part, rank, sub_group, flat_offset)


def partition_view(p: ZeroParam) -> torch.Tensor:
    """This rank's share of ``p`` in ``param.ds_tensor`` (the 16-bit partition; padding excluded), a view."""
    return p.param.ds_tensor.data.view(-1).narrow(0, 0, p.count)


def check_zero3_optimizer(opt: Any, where: str) -> None:
    """Refuse ZeRO-3 optimizers whose master weights do not all live in ``fp32_partitioned_groups_flat``."""
    if getattr(opt, "swap_optimizer", False) or any(flat is None for flat in opt.fp16_partitioned_groups_flat):
        raise ShardsafeError(
            f"{where} offloads parameters or optimizer state to NVMe, which shardsafe does not support for engines"
        )
    if getattr(opt, "offload_optimizer", False) and getattr(opt, "partial_offload", 1.0) != 1.0:
        # part of the sub-groups would keep their state in opt.backup_optimizer
        raise ShardsafeError(
            f"{where} offloads only part of the optimizer (offload_optimizer.ratio < 1), which shardsafe does not "
            "support"
        )


def master_positions(opt: Any, where: str) -> list[tuple[Any, int, int]]:
    """(parameter, sub-group, offset of its partition in the flat fp32 sub-group) of every trainable
    parameter of a ZeRO-3 optimizer, in flat order; DeepSpeed's ``grad_position`` must agree."""
    out = []
    for sub_group, params in enumerate(opt.fp16_groups):
        for p in params:
            sub, offset, _ = opt.grad_position[opt.get_param_id(p)]
            if int(sub) != sub_group:
                raise ShardsafeError(
                    f"{where}: a parameter of shape {list(p.ds_shape)} is in sub-group {sub_group} but DeepSpeed "
                    f"places it in {sub}"
                )
            out.append((p, sub_group, int(offset)))
    return out


def refresh_16bit_partitions(opt: Any, sub_groups: Any) -> None:
    """The 16-bit partitions (``param.ds_tensor``, views of ``fp16_partitioned_groups_flat``) of
    ``sub_groups`` from the fp32 master, exactly as DeepSpeed's ``_rigid_load_state_dict`` and its
    optimizer step do; ZeRO++ secondary copies are dropped (rebuilt from the partitions)."""
    with torch.no_grad():
        for sub_group in sub_groups:
            flat32, flat16 = opt.fp32_partitioned_groups_flat[sub_group], opt.fp16_partitioned_groups_flat[sub_group]
            if flat32.numel() and flat32.data_ptr() != flat16.data_ptr():
                flat16.data.copy_(flat32.data)
            unflatten_partitions(opt, sub_group)
    if hasattr(opt, "invalidate_secondary_tensor"):
        opt.invalidate_secondary_tensor()


class Zero3Targets:
    """Where this rank writes new whole-tensor values of ZeRO-3 parameters, and what to refresh after.

    A trainable parameter of an engine's ZeRO-3 optimizer is written into its fp32 master partition
    (``fp32_partitioned_groups_flat``; that is what the next step updates and copies back, so writing
    only ``ds_tensor`` would be undone), and its 16-bit partition is refreshed from it afterwards.
    Any other partitioned parameter (built under ``deepspeed.zero.Init`` before ``deepspeed.initialize``,
    frozen, or in an engine without optimizer) is written into ``param.ds_tensor`` in its own dtype.
    The optimizer is the engine's (``engine_optimizer``) or the one DeepSpeed links to each parameter
    (``param._z3_optimizer``), so ``engine.module`` alone is enough.
    """

    def __init__(self, where: str, engine_optimizer: Any = None) -> None:
        self.where = where
        self.engine_optimizer = engine_optimizer
        self._positions: dict[int, dict[int, tuple[int, int]]] = {}
        self._optimizers: dict[int, Any] = {}
        self._touched: dict[int, set[int]] = {}
        self._params: list[Any] = []

    def _master_position(self, opt: Any, p: Any) -> tuple[int, int] | None:
        if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
            return None
        if id(opt) not in self._positions:
            check_zero3_optimizer(opt, self.where)
            self._positions[id(opt)] = {id(q): (sub, offset) for q, sub, offset in master_positions(opt, self.where)}
            self._optimizers[id(opt)] = opt
        return self._positions[id(opt)].get(id(p))

    def destination(self, name: str, p: Any) -> tuple[ZeroParam, torch.Tensor]:
        """This rank's share of ``p`` and the 1-D tensor (a view) its new values go into; checks first."""
        zp = zero3_partition(name, p, self.where)
        status = getattr(getattr(p, "ds_status", None), "name", "NOT_AVAILABLE")
        if status not in ("NOT_AVAILABLE", "AVAILABLE") or getattr(p, "ds_active_sub_modules", None):
            raise ShardsafeError(
                f"{self.where}: parameter {name!r} is being gathered or used by a running forward; load outside of it"
            )
        self._params.append(p)
        opt = z3_optimizer(p) or self.engine_optimizer
        position = self._master_position(opt, p)
        if position is None:
            return zp, partition_view(zp)
        sub_group, offset = position
        self._touched.setdefault(id(opt), set()).add(sub_group)
        return zp, opt.fp32_partitioned_groups_flat[sub_group].narrow(0, offset, zp.count)

    def finish(self) -> None:
        """After writing: 16-bit partitions from the fp32 master, then the gathered copies (persistent
        parameters, leftovers) dropped locally, so the next forward gathers the new values. No collective."""
        for key, sub_groups in self._touched.items():
            refresh_16bit_partitions(self._optimizers[key], sorted(sub_groups))
        released: dict[int, Any] = {
            id(opt): opt for opt in [*self._optimizers.values(), self.engine_optimizer] if opt is not None
        }
        for opt in released.values():
            if hasattr(opt, "checkpoint_event_prologue"):  # through DeepSpeed's coordinator, as engine.load_checkpoint
                opt.checkpoint_event_prologue()
            elif hasattr(opt, "partition_all_parameters"):  # an engine without optimizer (DeepSpeedZeRoOffload)
                opt.partition_all_parameters()
        for p in self._params:
            if p.ds_status.name == "AVAILABLE":
                p.partition()


class Zero3Layout:
    """The parts of a ZeRO-3 engine that hold training state, found once and checked."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name
        where = f"state[{name!r}] (a DeepSpeed engine)"
        stage = int(engine.zero_optimization_stage())
        if stage != 3:
            raise ShardsafeError(
                f"{where} uses ZeRO stage {stage}; only ZeRO stage 3 engines can be saved and loaded as a state value. "
                "Use engine.save_checkpoint for stages 0-2 (shardsafe.convert_deepspeed converts those checkpoints)"
            )
        opt = engine.optimizer
        if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat") or not hasattr(opt, "optimizer"):
            raise ShardsafeError(
                f"{where} has no ZeRO-3 optimizer (was it initialised without one?); save engine.module instead"
            )
        if (
            getattr(engine, "mp_world_size", 1) != 1
            or getattr(engine, "pipeline_parallelism", False)
            or getattr(engine, "has_moe_layers", False)
        ):
            raise ShardsafeError(
                f"{where} uses tensor, pipeline or expert parallelism, which shardsafe does not support for engines"
            )
        check_zero3_optimizer(opt, where)
        self.opt = opt
        self.inner: torch.optim.Optimizer = opt.optimizer
        self.flats: list[torch.Tensor] = list(opt.fp32_partitioned_groups_flat)
        self.group_of_sub: list[int] = [int(opt.sub_group_to_group_id[i]) for i in range(len(self.flats))]

        names: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for pname, p in engine.module.named_parameters(remove_duplicate=False):
            if id(p) in names:
                aliases[pname] = names[id(p)]
            else:
                names[id(p)] = pname
        self.aliases = aliases
        self.trainable: list[ZeroParam] = []
        seen: set[int] = set()
        for p, sub_group, offset in master_positions(opt, where):
            if id(p) not in names:
                raise ShardsafeError(
                    f"{where}: an optimizer parameter (shape {list(p.ds_shape)}) is not a parameter of engine.module"
                )
            self.trainable.append(self._describe(names[id(p)], p, sub_group=sub_group, flat_offset=offset))
            seen.add(id(p))
        self.frozen = [self._describe(n, p) for n, p in engine.module.named_parameters() if id(p) not in seen]
        self.buffers: dict[str, torch.Tensor] = {}
        for module_name, module in engine.module.named_modules():
            for bname, buf in module.named_buffers(recurse=False):
                if buf is not None and bname not in module._non_persistent_buffers_set:
                    self.buffers.setdefault(f"{module_name}.{bname}" if module_name else bname, buf)

    def _describe(self, name: str, p: Any, sub_group: int = -1, flat_offset: int = 0) -> ZeroParam:
        return zero3_partition(name, p, f"state[{self.name!r}]", sub_group, flat_offset)

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group=getattr(self.opt, "dp_process_group", None))

    def fp32_view(self, p: ZeroParam) -> torch.Tensor:
        """This rank's share of ``p`` in the fp32 master partition (a view: reading into it loads it)."""
        return self.flats[p.sub_group].narrow(0, p.flat_offset, p.count)

    def frozen_view(self, p: ZeroParam) -> torch.Tensor:
        return partition_view(p)

    def sub_group_state(self, sub_group: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(per-element state tensors, scalar state) of a sub-group's inner optimizer state.

        Per-element tensors (``exp_avg``) are as long as the flat sub-group; scalars (``step``, a 0-dim
        tensor in torch's AdamW) are shared by the sub-group's parameters. Anything else has no
        meaning per parameter and is refused.
        """
        flat = self.flats[sub_group]
        elementwise: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for key, value in self.inner.state.get(flat, {}).items():
            if not isinstance(key, str):
                raise ShardsafeError(
                    f"state[{self.name!r}]: optimizer state key {key!r} of sub-group {sub_group} is not a string"
                )
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == flat.shape:
                elementwise[key] = value
            elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1:
                scalars[key] = value
            elif value is None or isinstance(value, (bool, int, float)):
                scalars[key] = value
            else:
                shown = (
                    f"a tensor of shape {list(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise ShardsafeError(
                    f"state[{self.name!r}]: optimizer state {key!r} of sub-group {sub_group} is {shown}, neither one "
                    "value per "
                    f"element of the flat partition ({flat.numel()}) nor a scalar; shardsafe cannot reshard it"
                )
        return elementwise, scalars

    def group_params(self) -> list[list[str]]:
        """Trainable parameter names of each optimizer param group, in flat order."""
        groups: list[list[str]] = [[] for _ in self.inner.param_groups]
        for p in self.trainable:
            groups[self.group_of_sub[p.sub_group]].append(p.name)
        return groups


def tensor_key(name: str, section: str, *rest: str) -> str:
    """The stored key of an engine tensor: ``<name>/<section>/[<state key>/]<fqn>``."""
    return "/".join((name, section, *rest))
