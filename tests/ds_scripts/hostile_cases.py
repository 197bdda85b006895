"""The hostile DeepSpeed folders of tests/interop/test_deepspeed_hostile.py: each breaks one thing of a sound crafted
folder.

``CASES`` maps a case name to (folder kind: ``z3`` or ``z2``, what to break, the expected outcome:
an error class name or ``read``, a regex its message must match). :func:`build` writes one.
Kept apart from the tests so the fuzz target and ad-hoc comparisons (say, against an older reader)
can build the same folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ds_scripts.craft import Call, DSFolder, Forged, raw_pickle, unicode, write_archive, zero2_folder, zero3_folder

SECRET = "s3cr3t-TOKEN-8d1f0c"  # what a file outside the folder holds; no message may show it
OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL0 = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _opt(state: dict[str, Any]) -> dict[str, Any]:
    return state["optimizer_state_dict"]  # type: ignore[no-any-return]


def _set_flat(make: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    """Replace rank 0's fp32 flat group (11 elements) by ``make(flat)``."""

    def change(state: dict[str, Any]) -> None:
        flats = _opt(state)["fp32_flat_groups"]
        flats[0] = make(flats[0])

    return change


def _optim(change: Callable[[dict[str, Any]], None], **archive: Any) -> Callable[[DSFolder], None]:
    return lambda ds: ds.rewrite(OPTIM0, change, **archive) and None


def _model(change: Callable[[dict[str, Any]], None], **archive: Any) -> Callable[[DSFolder], None]:
    return lambda ds: ds.rewrite(MODEL0, change, **archive) and None


def _model_all(change: Callable[[dict[str, Any]], None]) -> Callable[[DSFolder], None]:
    def apply(ds: DSFolder) -> None:
        for name in ds.model:
            ds.rewrite(name, change)

    return apply


def _raw_optim(data: bytes) -> Callable[[DSFolder], None]:
    """Replace rank 0's optimizer file by an archive holding the pickle bytes ``data`` (no records)."""
    return lambda ds: write_archive(ds.tag_folder / OPTIM0, data, {}) and None


def _in_state(value: Any) -> Callable[[DSFolder], None]:
    """Put ``value`` into rank 0's optimizer file, next to the real entries."""

    def change(state: dict[str, Any]) -> None:
        _opt(state)["extra"] = value

    return _optim(change)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def _dag(levels: int) -> Any:
    value: Any = [1]
    for _ in range(levels):
        value = [value, value]
    return value


def _cycle() -> Any:
    a: dict[str, Any] = {}
    b = {"a": a}
    a["b"] = b
    return a


def _self_list() -> Any:
    value: list[Any] = []
    value.append(value)
    return value


def _file_op(how: str) -> Callable[[DSFolder], None]:
    def apply(ds: DSFolder) -> None:
        target = ds.tag_folder / OPTIM0
        data = target.read_bytes()
        if how == "truncate":
            target.write_bytes(data[: len(data) // 2])
        elif how == "empty":
            target.write_bytes(b"")
        elif how == "crc":
            with zipfile.ZipFile(target) as z:
                info = z.getinfo("archive/data.pkl")
            at = info.header_offset + 30 + len(info.filename) + len(info.extra) + 10
            target.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
        elif how == "legacy":
            torch.save(torch.load(target, weights_only=True), target, _use_new_zipfile_serialization=False)
        elif how == "symlink":
            outside = ds.root.parent / "outside.pt"
            shutil.copy(target, outside)
            target.unlink()
            target.symlink_to(outside)
        elif how == "fifo":
            target.unlink()
            os.mkfifo(target)

    return apply


def _latest(how: str) -> Callable[[DSFolder], None]:
    def apply(ds: DSFolder) -> None:
        latest = ds.root / "latest"
        outside = ds.root.parent / "outside"
        outside.mkdir(exist_ok=True)
        secret = outside / "secret.txt"
        secret.write_text(SECRET + "\n")
        latest.unlink()
        if how == "symlink_passwd":
            latest.symlink_to("/etc/passwd")
        elif how == "symlink_secret":
            latest.symlink_to(secret)
        elif how == "hardlink_secret":
            os.link(secret, latest)
        elif how == "secret_content":
            latest.write_text(SECRET)
        elif how == "secret_multiline":
            latest.write_text(f"global_step2\n{SECRET}\n")
        elif how == "oversized":
            latest.write_text("a" * (1 << 20))
        elif how == "fifo":
            os.mkfifo(latest)
        elif how == "binary":
            latest.write_bytes(b"\xff\xfe" + SECRET.encode())
        elif how == "directory":
            latest.mkdir()
        elif how == "tag_symlink_outside":  # `latest` names a tag folder that is a symlink to a copy outside
            latest.write_text("global_step2")
            shutil.move(str(ds.tag_folder), outside / "global_step2")
            ds.tag_folder.symlink_to(outside / "global_step2")
        elif how == "secret_tag_symlink":
            latest.write_text(SECRET)
            shutil.move(str(ds.tag_folder), outside / "elsewhere")
            (ds.root / SECRET).symlink_to(outside / "elsewhere")
        else:  # the text itself
            latest.write_bytes(how.encode("utf-8", "surrogateescape"))

    return apply


_GLOBAL = b"c%s\n%s\n"
FLAT = 11  # elements of each rank's flat group in the ZeRO-3 folder
# (folder kind, break it, outcome or error class, message regex)
Case = tuple[str, Callable[[DSFolder], None], str, str]

CASES: dict[str, Case] = {
    # --- globals and opcodes, refused by the pre-scan before anything is unpickled
    "eval": (
        "z3",
        _raw_optim(
            raw_pickle(_GLOBAL % (b"builtins", b"eval"), unicode("__import__('os').system('touch MARKER')"), b"\x85R")
        ),
        "FormatError",
        "global 'builtins.eval' is not allowed",
    ),
    "os_system": (
        "z3",
        _in_state(Call(os.system, "touch MARKER")),
        "FormatError",
        r"global '(posix|os)\.system' is not allowed",
    ),
    "subprocess": (
        "z3",
        _in_state(Call(subprocess.call, ["touch", "MARKER"])),
        "FormatError",
        r"global '(subprocess|commands)\.call' is not allowed",
    ),
    "getattr": (
        "z3",
        _in_state(Call(getattr, "os", "system")),
        "FormatError",
        "global '(__builtin__|builtins).getattr' is not allowed",
    ),
    "bytearray_bomb": (
        "z3",
        _raw_optim(
            raw_pickle(_GLOBAL % (b"builtins", b"bytearray"), b"\x8a\x05" + (10**11).to_bytes(5, "little"), b"\x85R")
        ),
        "FormatError",
        "global 'builtins.bytearray' is not allowed",
    ),
    "meta_tensor_global": (
        "z3",
        _optim(
            _set_flat(lambda f: Call(torch._utils._rebuild_meta_tensor_no_storage, torch.float32, (FLAT,), (1,), False))
        ),
        "FormatError",
        "_rebuild_meta_tensor_no_storage' is not allowed",
    ),
    "cuda_wrapper_subclass": (
        "z3",
        _optim(
            _set_flat(
                lambda f: Call(
                    torch._utils._rebuild_wrapper_subclass,
                    torch.Tensor,
                    torch.float32,
                    (FLAT,),
                    (1,),
                    0,
                    None,
                    torch.device("cuda"),
                    False,
                )
            )
        ),
        "FormatError",
        "_rebuild_wrapper_subclass' is not allowed",
    ),
    "device_global": ("z3", _in_state(torch.device("cuda", 0)), "FormatError", "global 'torch.device' is not allowed"),
    "parameter_global": (
        "z3",
        _optim(_set_flat(lambda f: Call(torch._utils._rebuild_parameter, Forged(f), False, OrderedDict()))),
        "FormatError",
        "_rebuild_parameter' is not allowed",
    ),
    "tensor_type_called": (
        "z3",
        _raw_optim(raw_pickle(_GLOBAL % (b"torch", b"Tensor"), b")R")),
        "FormatError",
        "REDUCE calls torch.Tensor, which is not an allowed callable",
    ),
    "stand_in_called": (
        "z3",
        _raw_optim(raw_pickle(_GLOBAL % (b"deepspeed.runtime.fp16.loss_scaler", b"LossScaler"), b")R")),
        "FormatError",
        "REDUCE calls deepspeed.runtime.fp16.loss_scaler.LossScaler",
    ),
    "newobj_ordereddict": (
        "z3",
        _raw_optim(raw_pickle(_GLOBAL % (b"collections", b"OrderedDict"), b")\x81")),
        "FormatError",
        "NEWOBJ of collections.OrderedDict, which is not an allowed class",
    ),
    "newobj_with_args": (
        "z3",
        _raw_optim(raw_pickle(_GLOBAL % (b"deepspeed.runtime.fp16.loss_scaler", b"LossScaler"), b"K\x01\x85\x81")),
        "FormatError",
        "NEWOBJ of .*LossScaler with arguments",
    ),
    "build_on_tensor": (
        "z3",
        _optim(
            _set_flat(
                lambda f: Call(
                    torch._utils._rebuild_tensor_v2,
                    Forged(f),
                    0,
                    (FLAT,),
                    (1,),
                    False,
                    OrderedDict(),
                    state={"data": 1},
                )
            )
        ),
        "FormatError",
        "BUILD of the result of torch._utils._rebuild_tensor_v2",
    ),
    "build_dict_methods": (
        "z3",
        _in_state(Call(OrderedDict, state={"items": 1})),
        "FormatError",
        "attributes other than a state dict's _metadata",
    ),
    "build_dunder": (
        "z3",
        _raw_optim(
            raw_pickle(
                _GLOBAL % (b"deepspeed.runtime.fp16.loss_scaler", b"LossScaler"),
                b")\x81}",
                unicode("__class__"),
                _GLOBAL % (b"collections", b"OrderedDict"),
                b"sb",
            )
        ),
        "FormatError",
        "attribute named '__class__'",
    ),
    "build_leaf_state": (
        "z3",
        _raw_optim(raw_pickle(_GLOBAL % (b"deepspeed.runtime.fp16.loss_scaler", b"LossScaler"), b")\x81Nb")),
        "FormatError",
        "BUILD of .*LossScaler with a leaf state",
    ),
    "rebuild_from_type_parameter": (
        "z3",
        _optim(
            _set_flat(
                lambda f: Call(
                    torch._tensor._rebuild_from_type_v2, torch._utils._rebuild_tensor_v2, torch.nn.Parameter, (), {}
                )
            )
        ),
        "FormatError",
        "torch.nn.parameter.Parameter' is not allowed",
    ),
    "rebuild_from_type_other_func": (
        "z3",
        _optim(_set_flat(lambda f: Call(torch._tensor._rebuild_from_type_v2, OrderedDict, torch.Tensor, (), None))),
        "FormatError",
        "rebuilt by anything but torch's own tensor rebuild",
    ),
    "opcode_inst": (
        "z3",
        _raw_optim(raw_pickle(b"(", unicode("1"), b"ibuiltins\neval\n")),
        "FormatError",
        "opcode INST is not allowed",
    ),
    "opcode_obj": (
        "z3",
        _raw_optim(raw_pickle(b"(", _GLOBAL % (b"collections", b"OrderedDict"), b"o")),
        "FormatError",
        "opcode OBJ is not allowed",
    ),
    "opcode_ext1": ("z3", _raw_optim(raw_pickle(b"\x82\x01")), "FormatError", "opcode EXT1 is not allowed"),
    "opcode_stack_global": (
        "z3",
        _raw_optim(raw_pickle(unicode("builtins"), unicode("eval"), b"\x93")),
        "FormatError",
        "opcode STACK_GLOBAL is not allowed",
    ),
    "opcode_persid": ("z3", _raw_optim(raw_pickle(b"P0\n")), "FormatError", "opcode PERSID is not allowed"),
    "opcode_bytearray8": (
        "z3",
        _raw_optim(raw_pickle(b"\x96" + (4).to_bytes(8, "little") + b"abcd")),
        "FormatError",
        "opcode BYTEARRAY8 is not allowed",
    ),
    "opcode_long4": (
        "z3",
        _raw_optim(raw_pickle(b"\x8b" + (4).to_bytes(4, "little") + b"\xff" * 4)),
        "FormatError",
        "opcode LONG4 is not allowed",
    ),
    "opcode_pop_dup": ("z3", _raw_optim(raw_pickle(b"N2")), "FormatError", "opcode DUP is not allowed"),
    "protocol_5": ("z3", _raw_optim(b"\x80\x05N."), "FormatError", "pickle protocol 5"),
    "int_wider_than_64_bits": ("z3", _in_state(1 << 70), "FormatError", "an integer wider than 64 bits"),
    "memo_bomb": (
        "z3",
        _raw_optim(raw_pickle(b"]r\xff\xff\xff\xff")),
        "FormatError",
        "memo index 4294967295 out of sequence",
    ),
    "memo_never_stored": ("z3", _raw_optim(raw_pickle(b"h\x05")), "FormatError", "memo index 5 was never stored"),
    "surrogate_string": ("z3", _raw_optim(raw_pickle(unicode("\udc80"))), "FormatError", "not valid UTF-8"),
    "bytes_after_stop": ("z3", _raw_optim(raw_pickle(b"N") + b"N."), "FormatError", "bytes after STOP"),
    "no_stop": ("z3", _raw_optim(b"\x80\x02N"), "FormatError", "not a readable pickle stream|no STOP"),
    "values_left": ("z3", _raw_optim(raw_pickle(b"NN")), "FormatError", "2 values left at STOP"),
    "append_on_dict": ("z3", _raw_optim(raw_pickle(b"}Na")), "FormatError", "APPEND on a dict, not a list"),
    "setitems_odd": ("z3", _raw_optim(raw_pickle(b"}(Nu")), "FormatError", "SETITEMS with a key and no value"),
    "persid_not_5_tuple": (
        "z3",
        _raw_optim(raw_pickle(b"NNN\x87Q")),
        "FormatError",
        "persistent id that is not a 5-tuple",
    ),
    "mark_depth": ("z3", _raw_optim(raw_pickle(b"(" * 100)), "FormatError", "MARKs nested more than 64 deep"),
    "nested_lists": ("z3", _in_state(_nested(200)), "FormatError", "nested more than 64 deep"),
    "self_containing_list": ("z3", _in_state(_self_list()), "FormatError", "a container holding itself"),
    "indirect_cycle": ("z3", _in_state(_cycle()), "FormatError", "a value that contains itself"),
    "expansion_bomb": ("z3", _in_state(_dag(40)), "FormatError", "shared values expand to more than"),
    # --- storages and tensors: every one a memmove/madvise candidate in a reader that trusted them
    "meta_location": ("z3", _optim(_set_flat(lambda f: Forged(f, location="meta"))), "FormatError", "on device 'meta'"),
    "unknown_location": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, location="file:/etc/passwd"))),
        "FormatError",
        "on device 'file:/etc/passwd'",
    ),
    "stride_zero_broadcast": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f[:1], size=(FLAT,), stride=(0,)))),
        "FormatError",
        "is not a contiguous tensor",
    ),
    "negative_stride": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, offset=FLAT - 1, stride=(-1,)))),
        "FormatError",
        "negative or mismatched",
    ),
    "negative_size": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, size=(-1,)))),
        "FormatError",
        "negative or mismatched",
    ),
    "size_stride_mismatch": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, stride=(1, 1)))),
        "FormatError",
        "negative or mismatched",
    ),
    "too_many_dims": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, size=(1,) * 100, stride=(1,) * 100))),
        "FormatError",
        "not a tuple of at most 64",
    ),
    "offset_not_int": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, offset=0.5))),
        "FormatError",
        "the storage offset is a float",
    ),
    "offset_past_end": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, offset=10**6))),
        "FormatError",
        "extends past its 44-byte record",
    ),
    "extent_past_end": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f[:4], size=(FLAT,)))),
        "FormatError",
        "extends past its 16-byte record",
    ),
    "numel_overflow": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, size=(1 << 31, 1 << 31, 1 << 31), stride=(1 << 62, 1 << 31, 1)))),
        "FormatError",
        "extends past",
    ),
    "storage_larger_than_file": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, numel=1 << 40))),
        "FormatError",
        "claims 4398046511104 bytes; its record holds 44",
    ),
    "storage_into_next_record": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, numel=FLAT + 8, size=(FLAT + 8,)))),
        "FormatError",
        "claims 76 bytes; its record holds 44",
    ),
    "missing_record": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, pid=("storage", torch.FloatStorage, "777", "cpu", FLAT)))),
        "FormatError",
        "no record data/777",
    ),
    "traversing_key": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, pid=("storage", torch.FloatStorage, "../../etc/passwd", "cpu", FLAT)))),
        "FormatError",
        "unknown storage type or key",
    ),
    "not_a_storage_pid": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, pid=("module", torch.FloatStorage, "0", "cpu", FLAT)))),
        "FormatError",
        "not a torch storage",
    ),
    "quantized_storage": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, stype=torch.QInt8Storage))),
        "FormatError",
        "QInt8Storage' is not allowed",
    ),
    "storage_named_twice": (
        "z3",
        _optim(_set_flat(lambda f: [Forged(f, key="0"), Forged(f.view(torch.int32), key="0")])),
        "FormatError",
        "storage 0: named twice with different types or sizes",
    ),
    "backward_hooks": (
        "z3",
        _optim(_set_flat(lambda f: Forged(f, hooks=OrderedDict(hook=1)))),
        "FormatError",
        "backward hooks or metadata",
    ),
    "misaligned_record": (
        "z3",
        _optim(lambda s: None, misalign=True),
        "FormatError",
        "not aligned to its 4-byte elements",
    ),
    "compressed_record": ("z3", _optim(lambda s: None, compress=True), "FormatError", "is compressed or encrypted"),
    "two_folders": (
        "z3",
        _optim(lambda s: None, extra={"other/data.pkl": b""}),
        "FormatError",
        "not a torch.save archive",
    ),
    "big_endian": ("z3", _optim(lambda s: None, byteorder=b"big"), "FormatError", "saved on a big-endian machine"),
    "duplicate_names": (
        "z3",
        _optim(lambda s: None, extra={"archive/version": b"4\n"}),
        "FormatError",
        "no duplicate names",
    ),
    "damaged_pickle": ("z3", _file_op("crc"), "FormatError", "CRC does not match"),
    "truncated_file": ("z3", _file_op("truncate"), "FormatError", "not a readable zip archive|past the end"),
    "empty_file": ("z3", _file_op("empty"), "FormatError", "not in torch's zip format"),
    "legacy_format": ("z3", _file_op("legacy"), "FormatError", "legacy format"),
    "rank_file_symlink": (
        "z3",
        _file_op("symlink"),
        "FormatError",
        "symbolic link|leads outside the checkpoint folder",
    ),
    "rank_file_fifo": ("z3", _file_op("fifo"), "FormatError", "not a regular file"),
    "meta_frozen_fragment": (
        "z3",
        _model(
            lambda s: s["frozen_param_fragments"].update(f=Forged(s["frozen_param_fragments"]["f"], location="meta"))
        ),
        "FormatError",
        "on device 'meta'",
    ),
    # --- DeepSpeed layout: shapes checked against the bytes the ranks hold before any allocation
    "frozen_shape_bomb": (
        "z3",
        _model_all(lambda s: s["frozen_param_shapes"].update(f=torch.Size([10**12]))),
        "FormatError",
        "frozen parameter 'f' has 4 of its 1000000000000 elements",
    ),
    "frozen_shape_2gb": (
        "z3",
        _model_all(lambda s: s["frozen_param_shapes"].update(f=torch.Size([10**9]))),
        "FormatError",
        "frozen parameter 'f' has 4 of its 1000000000 elements",
    ),
    "frozen_wrong_dtype": (
        "z3",
        _model(lambda s: s["frozen_param_fragments"].update(f=torch.zeros(2))),
        "FormatError",
        "no torch.float32 fragment of frozen parameter 'f'",
    ),
    "param_shape_bomb": (
        "z3",
        _model_all(lambda s: s["param_shapes"][0].update(w=torch.Size([10**6, 10**6]))),
        "FormatError",
        "flat sub-group 0 holds 11 elements, but its parameters need",
    ),
    "shape_negative": (
        "z3",
        _model_all(lambda s: s["param_shapes"][0].update(w=torch.Size([-3, 5]))),
        "FormatError",
        "bad shape",
    ),
    "shape_bools": ("z3", _model_all(lambda s: s["param_shapes"][0].update(w=(True, 5))), "FormatError", "bad shape"),
    "shape_huge_dims": (
        "z3",
        _model_all(lambda s: s["frozen_param_shapes"].update(f=(1 << 40, 1 << 40))),
        "FormatError",
        "bad shape",
    ),
    "z2_uncovered_elements": (
        "z2",
        lambda ds: _z2_short(ds),
        "FormatError",
        "param group 0 needs 16 elements, the ranks hold 14",
    ),
    "zero_stage_7": ("z3", _optim(lambda s: _opt(s).update(zero_stage=7)), "FormatError", "unknown ZeRO stage 7"),
    "zero_stage_str": ("z3", _optim(lambda s: _opt(s).update(zero_stage="3")), "FormatError", "'zero_stage' is a str"),
    "zero_stage_2_63": (
        "z3",
        _optim(lambda s: _opt(s).update(zero_stage=(1 << 63) + 3)),
        "FormatError",
        "unknown ZeRO stage",
    ),
    "module_not_dict": ("z3", _model(lambda s: s.update(module=[1, 2])), "FormatError", "'module' is a list"),
    "param_groups_not_list": (
        "z3",
        _optim(lambda s: _opt(s)["optimizer_state_dict"].update(param_groups="x")),
        "FormatError",
        "param_groups are not a list of dicts",
    ),
    "long_world_size": (
        "z3",
        _model(lambda s: s.update(mp_world_size="A" * 100_000)),
        "FormatError",
        r"mp_world_size='AAAA.*\.\.\.\) are not supported",
    ),
    "hyper_parameter_tensor": (
        "z3",
        _optim(lambda s: _opt(s)["optimizer_state_dict"]["param_groups"][0].update(lr=torch.zeros(5))),
        "FormatError",
        "hyper-parameter that is a Tensor",
    ),
    "state_wrong_length": (
        "z3",
        _optim(lambda s: _opt(s)["optimizer_state_dict"]["state"][0].update(exp_avg=torch.zeros(3))),
        "FormatError",
        "exp_avg",
    ),
    "counters_not_ints": (
        "z3",
        _model(lambda s: s.update(global_steps={"x": [1]}, global_samples=(1 << 64) - 1)),
        "read",
        "",
    ),
    "cuda_location_is_read_on_cpu": ("z3", _optim(_set_flat(lambda f: Forged(f, location="cuda:0"))), "read", ""),
    # --- `latest`: a small regular file inside the folder, never echoed
    "latest_symlink_passwd": ("z3", _latest("symlink_passwd"), "FormatError", "latest: is a symbolic link"),
    "latest_symlink_secret": ("z3", _latest("symlink_secret"), "FormatError", "latest: is a symbolic link"),
    "latest_hardlink_secret": (
        "z3",
        _latest("hardlink_secret"),
        "CheckpointNotFoundError",
        "the tag folder 'latest' names: tag folder is missing",
    ),
    "latest_secret_content": (
        "z3",
        _latest("secret_content"),
        "CheckpointNotFoundError",
        "the tag folder 'latest' names: tag folder is missing",
    ),
    "latest_secret_multiline": (
        "z3",
        _latest("secret_multiline"),
        "FormatError",
        "latest: bad checkpoint tag: not a valid tag name",
    ),
    "latest_binary": ("z3", _latest("binary"), "FormatError", "not a valid tag name \\(not UTF-8 text\\)"),
    "latest_traversal": ("z3", _latest("../x"), "FormatError", "latest: bad checkpoint tag: not a valid tag name"),
    "latest_absolute": ("z3", _latest("/etc"), "FormatError", "not a valid tag name"),
    "latest_dotdot": ("z3", _latest(".."), "FormatError", "not a valid tag name"),
    "latest_nul": ("z3", _latest("global_step2\x00x"), "FormatError", "not a valid tag name"),
    "latest_empty": ("z3", _latest(""), "FormatError", "not a valid tag name"),
    "latest_oversized": ("z3", _latest("oversized"), "FormatError", "latest: 1048576 bytes"),
    "latest_fifo": ("z3", _latest("fifo"), "FormatError", "latest: not a regular file"),
    "latest_directory": ("z3", _latest("directory"), "FormatError", "latest: not a regular file"),
    "tag_folder_symlink": (
        "z3",
        _latest("tag_symlink_outside"),
        "FormatError",
        "global_step2: is a symbolic link or leads outside",
    ),
    "secret_tag_folder_symlink": (
        "z3",
        _latest("secret_tag_symlink"),
        "FormatError",
        "the tag folder 'latest' names: is a symbolic link or leads outside",
    ),
}
SECRET_CASES = {name for name in CASES if "secret" in name or "passwd" in name or name.startswith("latest_")}


def _z2_short(ds: DSFolder) -> None:
    """ZeRO-2 ranks holding 7 + 7 elements for a 16-element parameter: zero_to_fp32's rounding check passes, 2 elements
    are nowhere."""
    for r, name in enumerate(ds.optim):

        def change(state: dict[str, Any], r: int = r) -> None:
            opt = _opt(state)
            opt["single_partition_of_fp32_groups"] = [torch.ones(7) * (r + 1)]
            opt["base_optimizer_state"]["state"][0]["exp_avg"] = torch.ones(7)
            opt.update(param_alignment_paddings=[[0]], group_paddings=[0, 0])

        ds.rewrite(name, change)
    ds.rewrite(ds.model[0], lambda s: s["param_shapes"][0].update(w=torch.Size([16])))


def build(root: Path, name: str) -> DSFolder:
    """Write case ``name`` under ``root / name``: a sound folder, then broken."""
    kind, breaker, _, _ = CASES[name]
    ds = (zero3_folder if kind == "z3" else zero2_folder)(root / name / "ds")
    breaker(ds)
    return ds
