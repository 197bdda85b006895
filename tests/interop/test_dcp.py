"""DCP checkpoints in and out: ``dcp.save`` at 2 FSDP2 ranks, converted and loaded at 1 and 3 ranks exactly as
``dcp.load``
gives; export to a folder ``from_pretrained`` loads; ``--to dcp`` round trip; hostile ``.metadata`` refused without
running code."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.dist_utils import DIMS, full_model_state, full_optimizer_state, make_model, make_optimizer, run_ranks, shard

import shardsafe
from shardsafe.cli.main import main as cli_main
from shardsafe.errors import FormatError
from shardsafe.interop.dcp_metadata import read_metadata
from shardsafe.interop.dcp_reader import DcpCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _trained(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard(make_model(seed), world_size)
    optim = make_optimizer(model)
    torch.manual_seed(100)
    model(torch.randn(4, DIMS[0])).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _save_dcp(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _trained(0, world_size)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def _load_both(rank: int, world_size: int, dcp_folder: str, converted: str) -> dict[str, Any]:
    """dcp.load into one fresh FSDP2 model + AdamW, shardsafe.load of the conversion into another, shardsafe.load of the
    DCP folder itself into a third; all whole."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref_model, ref_optim = _trained(7, world_size)
    msd, osd = get_state_dict(ref_model, ref_optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=dcp_folder)
    set_state_dict(ref_model, ref_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model, optim = _trained(9, world_size)
    shardsafe.load(converted, {"model": model, "optim": optim})
    direct_model, direct_optim = _trained(11, world_size)
    shardsafe.load(dcp_folder, {"model": direct_model, "optim": direct_optim})
    return {
        "ref": (full_model_state(ref_model), full_optimizer_state(ref_model, ref_optim)),
        "got": (full_model_state(model), full_optimizer_state(model, optim)),
        "direct": (full_model_state(direct_model), full_optimizer_state(direct_model, direct_optim)),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_fsdp2_dcp_checkpoint_converts_and_reshards_like_dcp_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "dcp"
    run_ranks(_save_dcp, 2, str(folder), work_dir=tmp_path)
    with pytest.raises(FormatError, match="DCP.*no hashes"):
        shardsafe.verify(folder)
    converted = shardsafe.convert_dcp(folder, tmp_path / "converted")
    for world_size in (1, 3):
        results = run_ranks(_load_both, world_size, str(folder), str(converted), work_dir=tmp_path)
        for result in results:
            assert _same(result["ref"], result["got"]), world_size
            assert _same(result["ref"], result["direct"]), world_size
    # and back: --to dcp, then dcp.load of it equals the shardsafe checkpoint
    capsys.readouterr()
    assert cli_main(["convert", str(converted), str(tmp_path / "back"), "--to", "dcp"]) == 0
    assert "read: 100%" in capsys.readouterr().err  # a progress bar over the bytes read, unless --no-progress
    assert cli_main(["convert", str(converted), str(tmp_path / "quiet"), "--to", "dcp", "--no-progress"]) == 0
    assert "read" not in capsys.readouterr().err
    back = DcpCheckpoint(tmp_path / "back", key="")
    source = DcpCheckpoint(folder, key="")
    assert set(back.meta.tensors) == set(source.meta.tensors)
    for fqn in source.meta.tensors:
        assert torch.equal(back.read_fqn(fqn), source.read_fqn(fqn)), fqn
    plain = {"model": {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in full_model_state(make_model(0)).items()}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for name, tensor in plain["model"].items():
        assert torch.equal(tensor, source.read_fqn(f"model.{name}")), name


def test_export_of_a_dcp_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=131,
        hidden_size=32,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path / "dcp"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    config.save_pretrained(folder)
    assert cli_main(["inspect", str(folder)]) == 0
    assert cli_main(["export", str(folder), str(tmp_path / "hf")]) == 0
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# ----------------------------------------------------------------------------- hostile .metadata


def _small(folder: Path) -> Any:
    dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}, "n": 7}, checkpoint_id=str(folder), no_dist=True)
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file: trusted here, to build hostile variants


def _rewrite(folder: Path, meta: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _hostile(kind: str, folder: Path, marker: Path) -> None:
    meta = _small(folder)
    index = next(i for i in meta.storage_data if i.fqn == "model.w")
    if kind == "reduce":
        _rewrite(folder, _Evil(marker))
    elif kind == "nested_reduce":
        meta.planner_data = {"model.w": _Evil(marker)}
        _rewrite(folder, meta)
    elif kind == "global":
        import datetime

        meta.planner_data = datetime.date(2020, 1, 1)
        _rewrite(folder, meta)
    elif kind == "offset":
        meta.storage_data[index].offset = 1 << 50
        _rewrite(folder, meta)
    elif kind == "size":
        entry = meta.state_dict_metadata["model.w"]
        entry.size = torch.Size([1 << 40, 1 << 20])
        entry.chunks[0].sizes = torch.Size([1 << 40, 1 << 20])
        _rewrite(folder, meta)
    elif kind == "path":
        meta.storage_data[index].relative_path = "../outside.distcp"
        _rewrite(folder, meta)
    elif kind == "truncated":
        (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes()[:-40])


KINDS = ["reduce", "nested_reduce", "global", "offset", "size", "path", "truncated"]


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_metadata_is_refused_without_running_code(tmp_path: Path, kind: str) -> None:
    folder, marker = tmp_path / "dcp", tmp_path / "pwned"
    _hostile(kind, folder, marker)
    with pytest.raises(FormatError, match=r"\.metadata"):
        read_metadata(folder)
    with pytest.raises(FormatError):
        shardsafe.convert_dcp(folder, tmp_path / "out")
    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FormatError, match=r"\.metadata"):
        shardsafe.load(folder, {"model": model})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "export", "convert"])
def test_cli_on_a_hostile_folder_prints_error_and_exits_1(tmp_path: Path, command: str) -> None:
    folder, marker = tmp_path / "dcp", tmp_path / "pwned"
    _hostile("reduce", folder, marker)
    args = [str(folder)] + ([str(tmp_path / "out")] if command != "inspect" else [])
    env = {**os.environ, "PYTHONPATH": str(Path(shardsafe.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "shardsafe.cli", command, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert "error:" in proc.stderr and ".metadata" in proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("fqn", ["model.w", "n"])
def test_hostile_item_pickle_is_refused_without_running_code(tmp_path: Path, fqn: str) -> None:
    """An item's own torch.save archive naming os.system (a tensor chunk, a value) is refused, naming the .distcp
    file."""
    import io

    folder, marker = tmp_path / "dcp", tmp_path / "pwned"
    meta = _small(folder)
    evil = io.BytesIO()
    torch.save(_Evil(marker), evil)
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data[index]
    data_file = folder / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(evil.getvalue())
    with open(data_file, "ab") as f:
        f.write(evil.getvalue())
    _rewrite(folder, meta)
    with pytest.raises(FormatError, match=r"\.distcp.*not allowed"):
        shardsafe.convert_dcp(folder, tmp_path / "out")
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.full((3, 4), -1.0))
    # read in place: the item is located (restricted) before any byte is written
    with pytest.raises(FormatError, match=r"\.distcp"):
        shardsafe.load(folder, {"model": holder, "n": 0})
    assert torch.equal(holder.w.detach(), torch.full((3, 4), -1.0))
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_damaged_item_bytes_fail_the_crc_before_anything_is_written(tmp_path: Path) -> None:
    """A flipped byte inside a tensor's record: the atomic load's check pass finds it (the record's CRC-32) and leaves
    the
    model as it was; verify=False reads it in place as stored."""
    import io
    import zipfile

    folder = tmp_path / "dcp"
    meta = _small(folder)
    info = meta.storage_data[next(i for i in meta.storage_data if i.fqn == "model.w")]
    data_file = folder / info.relative_path
    raw = bytearray(data_file.read_bytes())
    item = bytes(raw[info.offset : info.offset + info.length])
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        record = next(e for e in z.infolist() if "/data/" in e.filename)
    local = info.offset + record.header_offset
    start = (
        local
        + 30
        + int.from_bytes(raw[local + 26 : local + 28], "little")
        + int.from_bytes(raw[local + 28 : local + 30], "little")
    )
    raw[start + 4] ^= 0x40  # a bit of element 1
    data_file.write_bytes(bytes(raw))
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.full((3, 4), -1.0))
    with pytest.raises(shardsafe.IntegrityError, match=r"\.distcp.*model/w.*CRC-32"):
        shardsafe.load(folder, {"model": holder, "n": 0})
    assert torch.equal(holder.w.detach(), torch.full((3, 4), -1.0))
    # atomic=False: the CRC-32 is carried over the bytes as they are read into place, and fails the same
    with pytest.raises(shardsafe.IntegrityError, match=r"\.distcp.*model/w.*CRC-32"):
        shardsafe.load(folder, {"model": holder, "n": 0}, atomic=False)
    state = {"model": holder, "n": 0}
    shardsafe.load(folder, state, verify=False)
    expected = torch.arange(12.0).reshape(3, 4)
    assert (
        state["n"] == 7
        and torch.equal(holder.w.detach()[0, 2:], expected[0, 2:])
        and not torch.equal(holder.w.detach(), expected)
    )


def test_a_dcp_tensor_read_whole_into_place_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its record's CRC-32 is computed over the bytes as they land (not read once to check, once into place): an
    atomic=False load reads each tensor byte once; an atomic one reads the live parameters twice (checked first,
    nothing written before every rank agrees) and a fresh optimizer's state once."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        return model, torch.optim.AdamW(model.parameters())

    model, optimizer = model_and_optimizer(0)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    folder = tmp_path / "dcp"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    read = [0]
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        got = real(fd, buffers, offset, *flags)
        if os.path.realpath(f"/proc/self/fd/{fd}").endswith(".distcp"):
            read[0] += got
        return got

    monkeypatch.setattr(os, "preadv", counted)
    tensor_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # parameters + 2 moments
    for atomic, expected in ((False, 1.0), (True, 4 / 3)):
        fresh, fresh_optimizer = model_and_optimizer(1)
        read[0] = 0
        shardsafe.load(folder, {"model": fresh, "optim": fresh_optimizer}, atomic=atomic)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
        assert expected <= read[0] / tensor_bytes < expected + 0.02, (atomic, read[0] / tensor_bytes)
