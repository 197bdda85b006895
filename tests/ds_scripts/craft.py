"""Hand-made ``torch.save`` archives and DeepSpeed ZeRO folders, sound or hostile, for the reader's hostile tests and
fuzzing.

:func:`save_crafted` writes what ``torch.save`` writes (a zip of ``archive/data.pkl``, a protocol-2
pickle, and one stored record per tensor storage, aligned to 64 bytes), but every tensor may be a
:class:`Forged` one: any storage id (device label, element count, key, storage type) and any
``_rebuild_tensor_v2`` arguments (offset, size, stride, hooks), and any value may be a
:class:`Call` (a REDUCE of any global). :func:`write_archive` takes the pickle bytes and records as
they are (misaligned, compressed, with extra folders, ...). :func:`raw_pickle` builds a pickle from
opcode bytes, for opcodes no pickler emits.

:func:`zero3_folder` and :func:`zero2_folder` write small but complete DeepSpeed ZeRO checkpoints
(``latest``, tag folder, one optimizer file per rank, model files) with the layout DeepSpeed's own
``save_checkpoint`` gives, plus the full tensors they hold, so a test can check that the sound folder
reads exactly and then break one thing at a time.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STORAGE_TYPES: dict[torch.dtype, Any] = {
    torch.float32: torch.FloatStorage,
    torch.bfloat16: torch.BFloat16Storage,
    torch.float16: torch.HalfStorage,
    torch.float64: torch.DoubleStorage,
    torch.int64: torch.LongStorage,
    torch.int32: torch.IntStorage,
    torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage,
}


class Call:
    """Pickles as ``REDUCE(func, args)`` (then ``BUILD(state)`` when given): whatever global ``func`` is, with any
    arguments."""

    def __init__(self, func: Any, *args: Any, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


@dataclass
class Pid:
    """A persistent id as it stands in the pickle (``('storage', type, key, location, numel)`` for torch)."""

    pid: Any


@dataclass
class Forged:
    """A tensor pickled with chosen storage-id fields and rebuild arguments (None: what torch.save would write)."""

    tensor: torch.Tensor
    location: str = "cpu"
    numel: int | None = None  # elements the storage id claims
    key: str | None = None
    stype: Any = None
    offset: Any = 0
    size: Any = None
    stride: Any = None
    hooks: Any = None
    pid: Any = None  # the whole persistent id, as is
    rebuild: Any = torch._utils._rebuild_tensor_v2


def crafted_pickle(value: Any) -> tuple[bytes, dict[str, bytes]]:
    """(data.pkl bytes, records) for ``value``; tensors and :class:`Forged` tensors become storage ids plus records."""
    records: dict[str, bytes] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return obj.pid if isinstance(obj, Pid) else None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                obj = Forged(obj)
            if not isinstance(obj, Forged):
                return NotImplemented
            tensor = obj.tensor.detach().contiguous()
            key = obj.key if obj.key is not None else str(len(records))
            if key not in records:
                records[key] = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            count = obj.numel if obj.numel is not None else tensor.numel()
            pid = (
                obj.pid
                if obj.pid is not None
                else ("storage", obj.stype or STORAGE_TYPES[tensor.dtype], key, obj.location, count)
            )
            size = obj.size if obj.size is not None else tuple(tensor.shape)
            stride = obj.stride if obj.stride is not None else tuple(tensor.stride())
            hooks = obj.hooks if obj.hooks is not None else OrderedDict()
            return (obj.rebuild, (Pid(pid), obj.offset, size, stride, False, hooks))

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(value)
    return buf.getvalue(), records


def write_archive(
    path: Path,
    data_pkl: bytes,
    records: dict[str, bytes],
    *,
    misalign: bool = False,
    compress: bool = False,
    prefix: str = "archive",
    extra: dict[str, bytes] | None = None,
    byteorder: bytes = b"little",
) -> Path:
    """A torch.save-style zip: ``prefix/data.pkl``, ``prefix/data/<key>`` (64-byte aligned unless ``misalign``),
    version, byteorder."""
    entries = [
        ("data.pkl", data_pkl),
        *((f"data/{k}", v) for k, v in records.items()),
        ("version", b"3\n"),
        ("byteorder", byteorder),
    ]
    # extra: full names, as given
    named = [(f"{prefix}/{name}", data) for name, data in entries] + list((extra or {}).items())
    with open(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for name, data in named:
            record = name.startswith(f"{prefix}/data/")
            info = zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if compress and record else zipfile.ZIP_STORED
            header = f.tell() + 30 + len(info.filename.encode()) + 4
            pad = (-header) % 64 + (1 if misalign and record else 0)
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a duplicate name, when a test asks for one
                z.writestr(info, data)
    return path


def save_crafted(value: Any, path: Path, **archive: Any) -> Path:
    """``torch.save(value, path)`` as a crafted archive (see :func:`crafted_pickle`, :func:`write_archive`)."""
    data, records = crafted_pickle(value)
    return write_archive(path, data, records, **archive)


def raw_pickle(*ops: bytes) -> bytes:
    """A protocol-2 pickle of the given opcode bytes (PROTO 2 first, STOP last)."""
    return b"\x80\x02" + b"".join(ops) + b"."


def unicode(text: str) -> bytes:
    """A BINUNICODE opcode."""
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


# ----------------------------------------------------------------------------- DeepSpeed folders


@dataclass
class DSFolder:
    """A written DeepSpeed checkpoint: its root folder, tag folder, file names, and the full tensors it holds."""

    root: Path
    tag_folder: Path
    optim: list[str]
    model: list[str]
    expected: dict[str, torch.Tensor]
    states: dict[str, dict[str, Any]]  # file name -> the value written (mutate and rewrite with `rewrite`)

    def rewrite(self, name: str, change: Callable[[dict[str, Any]], None] | None = None, **archive: Any) -> Path:
        """Apply ``change`` to a copy of file ``name``'s value and write it again (crafted, so Forged/Call values are
        allowed)."""
        state = _copy(self.states[name])
        if change is not None:
            change(state)
        return save_crafted(state, self.tag_folder / name, **archive)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return type(value)((k, _copy(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _split(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    """ZeRO-3's partition of one parameter: ceil(n / world) elements per rank, the last padded with zeros."""
    part = math.ceil(full.numel() / world)
    flat = torch.cat([full.reshape(-1), full.new_zeros(part * world - full.numel())])
    return [flat[r * part : (r + 1) * part] for r in range(world)]


def zero3_folder(root: Path, world: int = 2, tag: str = "global_step2") -> DSFolder:
    """A ZeRO-3 checkpoint of a trained ``w`` [3, 5] and ``b`` [5] (fp32 master, Adam state), a frozen bf16 ``f`` [4], a
    buffer ``buf``."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    avg = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    frozen = torch.randn(4, generator=gen).to(torch.bfloat16)
    buf = torch.arange(2, dtype=torch.float32)
    folder = root / tag
    folder.mkdir(parents=True)
    (root / "latest").write_text(tag)
    out = DSFolder(root, folder, [], [], {**params, "f": frozen, "buf": buf}, {})
    for r in range(world):
        flat = torch.cat([_split(params[k], world)[r] for k in ("w", "b")])
        exp_avg = torch.cat([_split(avg[k], world)[r] for k in ("w", "b")])
        optim = {
            "optimizer_state_dict": {
                "zero_stage": 3,
                "loss_scaler": None,
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": world,
                "fp32_flat_groups": [flat],
                "optimizer_state_dict": {
                    "state": {0: {"step": torch.tensor(2.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg.abs()}},
                    "param_groups": [
                        {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}
                    ],
                },
            }
        }
        model = {
            "module": OrderedDict(
                [
                    ("w", torch.empty(0, dtype=torch.bfloat16)),
                    ("b", torch.empty(0, dtype=torch.bfloat16)),
                    ("f", torch.empty(0, dtype=torch.bfloat16)),
                    ("buf", buf),
                ]
            ),
            "buffer_names": ["buf"],
            "param_shapes": [OrderedDict([("w", torch.Size([3, 5])), ("b", torch.Size([5]))])],
            "frozen_param_shapes": OrderedDict([("f", torch.Size([4]))]),
            "frozen_param_fragments": {"f": _split(frozen, world)[r].clone()},
            "shared_params": {},
            "lr_scheduler": None,
            "dp_world_size": world,
            "mp_world_size": 1,
            "ds_version": "0.19.8",
            "global_steps": 2,
            "global_samples": 4,
            "skipped_steps": 0,
        }
        names = (f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        for name, state in zip(names, (optim, model)):
            out.states[name] = state
            save_crafted(state, folder / name)
        out.optim.append(names[0])
        out.model.append(names[1])
    return out


def zero2_folder(root: Path, world: int = 2, tag: str = "global_step2") -> DSFolder:
    """A ZeRO-2 checkpoint of one trained ``w`` [3, 5] (15 elements + 1 alignment padding, cut into 8 per rank) and its
    model file."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, generator=gen)
    concat = torch.cat([w.reshape(-1), torch.zeros(1)])
    folder = root / tag
    folder.mkdir(parents=True)
    (root / "latest").write_text(tag)
    out = DSFolder(root, folder, [], ["mp_rank_00_model_states.pt"], {"w": w}, {})
    for r in range(world):
        part = concat[r * 8 : (r + 1) * 8].clone()
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        out.states[name] = {
            "optimizer_state_dict": {
                "zero_stage": 2,
                "partition_count": [world],
                "single_partition_of_fp32_groups": [part],
                "base_optimizer_state": {
                    "state": {0: {"step": torch.tensor(2.0), "exp_avg": part * 2}},
                    "param_groups": [{"lr": 0.1, "params": [0]}],
                },
                "param_alignment_paddings": [[1]],
                "group_paddings": [0] * (world - 1) + [1],
            }
        }
        save_crafted(out.states[name], folder / name)
        out.optim.append(name)
    model = {
        "module": OrderedDict([("w", w.to(torch.bfloat16))]),
        "buffer_names": [],
        "param_shapes": [OrderedDict([("w", torch.Size([3, 5]))])],
        "frozen_param_shapes": None,
        "shared_params": {},
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_version": "0.19.8",
        "global_steps": 2,
    }
    out.states["mp_rank_00_model_states.pt"] = model
    save_crafted(model, folder / "mp_rank_00_model_states.pt")
    return out
