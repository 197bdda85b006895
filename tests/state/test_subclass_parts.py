"""Quantized tensor subclasses stored by their parts (docs/FORMAT.md, "Tensor subclasses"), with
torchao's real NF4Tensor and MXTensor: inner tensors stored as ordinary tensors plus a JSON record,
read back in place (bit-exact) or rebuilt through the allowlist; a class not allowlisted, an
unknown name in a checkpoint, a context JSON cannot hold and a plain model are refused with the
remedy; QLoRA-style FSDP2 (NF4 base weights under fully_shard, 2 gloo ranks) round-trips and
reshards to 3 ranks and to and from one process."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.cli.inspect import describe_checkpoint
from shardsafe.errors import FormatError, ShardsafeError, StateMismatchError

logging.getLogger("torchao").setLevel(logging.ERROR)
torchao = pytest.importorskip("torchao")

from dist_utils import run_ranks  # noqa: E402

NF4_INNER = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")


def _nf4(seed: int, rows: int = 64) -> torch.Tensor:
    from torchao.quantization import to_nf4

    torch.manual_seed(seed)
    return to_nf4(torch.randn(rows, 64, dtype=torch.bfloat16), 64, 16)


def _mx(seed: int) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    torch.manual_seed(seed)
    return MXTensor.to_mx(torch.randn(32, 64, dtype=torch.bfloat16), torch.float8_e4m3fn, 32)


class QLoRA(nn.Module):
    """A frozen NF4 base weight with a trainable low-rank update (torchtune's LoRALinear, small).
    96 rows, scaler blocks of 8: every inner tensor FSDP2 splits divides by 2 and by 3 ranks."""

    def __init__(self, seed: int, cols: int) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        torch.manual_seed(seed)
        self.weight = nn.Parameter(to_nf4(torch.randn(96, cols, dtype=torch.bfloat16), 64, 8), requires_grad=False)
        self.lora_a = nn.Linear(cols, 4, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(4, 96, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class Hooked(nn.Module):
    """An NF4 base weight in a module with its own _load_from_state_dict (loaded through its code)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_nf4(seed), requires_grad=False)
        self.calls = 0

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.calls += 1
        super()._load_from_state_dict(state_dict, prefix, *args)


def _bits(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every inner tensor of a subclass tensor, as raw bytes (float8 NaNs compare as bits)."""
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return {n: getattr(t, n).reshape(-1).contiguous().view(torch.uint8).clone() for n in names}


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    left, right = _bits(a), _bits(b)
    assert left.keys() == right.keys()
    for n in left:
        assert torch.equal(left[n], right[n]), n


def test_nf4_and_mx_in_place_bit_exact_and_inspected(tmp_path: Path) -> None:
    model = nn.ParameterDict({"nf4": nn.Parameter(_nf4(0), False), "mx": nn.Parameter(_mx(0), False)})
    shardsafe.save(tmp_path / "ck", {"model": model})
    record = json.loads((tmp_path / "ck" / "state.json").read_text())["model"]["state"]["nf4"]["__subclass__"]
    assert record["inner"]["quantized_data"] == {"__tensor__": "model/nf4/quantized_data"}
    assert record["shape"] == [64, 64] and record["context"]["block_size"] == 64

    other = nn.ParameterDict({"nf4": nn.Parameter(_nf4(1), False), "mx": nn.Parameter(_mx(1), False)})
    inner_before = other["nf4"].quantized_data
    shardsafe.load(tmp_path / "ck", {"model": other})
    assert other["nf4"].quantized_data is inner_before  # read in place, into the live inner tensors
    _assert_same_bits(other["nf4"], model["nf4"])
    _assert_same_bits(other["mx"], model["mx"])
    assert torch.equal(other["nf4"].get_original_weight(), model["nf4"].get_original_weight())

    info = describe_checkpoint(tmp_path / "ck")
    shown = {t["key"]: t.get("subclass") for t in info["tensors"]}
    assert shown["model/nf4/quantized_data"].endswith("NF4Tensor")
    assert shown["model/mx/scale"].endswith("MXTensor")
    assert {s["key"]: s["class"].rsplit(".", 1)[1] for s in info["subclasses"]} == {
        "model/nf4": "NF4Tensor",
        "model/mx": "MXTensor",
    }
    assert shardsafe.verify(tmp_path / "ck")["tensors"] == 7
    with pytest.raises(ShardsafeError, match=r"export: 2 tensor\(s\) of 'model' are tensor subclasses .*NF4"):
        shardsafe.export_hf(tmp_path / "ck", tmp_path / "hf", config={"model_type": "llama"}, progress=False)
    assert not (tmp_path / "hf").exists()


def test_rebuilt_in_values_and_custom_modules(tmp_path: Path) -> None:
    """Where nothing live holds the tensor (a plain value, a module's own load_state_dict), it is
    rebuilt through __tensor_unflatten__."""
    weight = _nf4(2)
    shardsafe.save(tmp_path / "ck", {"extra": {"base": weight, "step": 3}})
    state: dict[str, Any] = {"extra": None}
    shardsafe.load(tmp_path / "ck", state)
    _assert_same_bits(state["extra"]["base"], weight)
    assert state["extra"]["step"] == 3

    saved = nn.Sequential(Hooked(0), nn.Linear(4, 4))
    shardsafe.save(tmp_path / "module", {"model": saved})
    model = nn.Sequential(Hooked(1), nn.Linear(4, 4))
    shardsafe.load(tmp_path / "module", {"model": model})
    assert model[0].calls == 1 and type(model[0].weight).__name__ == "NF4Tensor"
    _assert_same_bits(model[0].weight, saved[0].weight)


@pytest.mark.parametrize(
    "into, message",
    [
        (
            lambda: nn.ParameterDict({"w": nn.Parameter(torch.zeros(64, 64))}),
            r"\(1 problems\):\n  model/w: the checkpoint holds a .*NF4",
        ),
        (
            lambda: nn.ParameterDict({"w": nn.Parameter(_nf4(0, rows=32), False)}),
            r"model/w: the checkpoint's .*NF4Tensor was made with .* same settings",
        ),
        (
            lambda: nn.ParameterDict({"w": nn.Parameter(_mx(0), False)}),
            r"model/w: a .*NF4Tensor in the checkpoint, a .*MXTensor here",
        ),
    ],
    ids=["plain-model", "other-shape", "other-class"],
)
def test_mismatches_refused_model_untouched(tmp_path: Path, into: Any, message: str) -> None:
    shardsafe.save(tmp_path / "ck", {"model": nn.ParameterDict({"w": nn.Parameter(_nf4(0), False)})})
    model = into()
    before = {k: v.clone() for k, v in model.state_dict().items() if type(v) is torch.Tensor}
    with pytest.raises(StateMismatchError, match=message):
        shardsafe.load(tmp_path / "ck", {"model": model})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


class Refusing:
    """A stateful object whose load_state_dict refuses: the load fails after the module's step ran."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("refused on purpose")


def test_other_block_size_rebuilt_and_assigned_undone_on_failure(tmp_path: Path) -> None:
    """A live NF4 weight of another block size cannot take the parts in place: the checkpoint's is
    rebuilt and assigned (the parameter object changes, requires_grad kept); a later failure puts
    the old parameter back."""
    from torchao.quantization import to_nf4

    saved = nn.ParameterDict({"w": nn.Parameter(_nf4(0), False)})
    shardsafe.save(tmp_path / "ck", {"model": saved, "other": Refusing()})
    model = nn.ParameterDict({"w": nn.Parameter(to_nf4(torch.randn(64, 64, dtype=torch.bfloat16), 32, 8), False)})
    old = model["w"]
    with pytest.raises(StateMismatchError, match="refused on purpose"):
        shardsafe.load(tmp_path / "ck", {"model": model, "other": Refusing()})
    assert model["w"] is old and old.block_size == 32
    shardsafe.load(tmp_path / "ck", {"model": model})
    assert model["w"] is not old and model["w"].block_size == 64 and not model["w"].requires_grad
    _assert_same_bits(model["w"], saved["w"])


def test_plain_checkpoint_into_quantized_model_refused(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "ck", {"model": nn.ParameterDict({"w": nn.Parameter(torch.zeros(64, 64))})})
    one = r"\(1 problems\):\n  model/w: a plain tensor in the checkpoint, a .*NF4Tensor here"
    with pytest.raises(StateMismatchError, match=one):
        shardsafe.load(tmp_path / "ck", {"model": nn.ParameterDict({"w": nn.Parameter(_nf4(0), False)})})


# ----------------------------------------------------------------------------- the allowlist


class Packed(torch.Tensor):
    """A user's quantized subclass: int8 codes and one scale; context holds an Enum and a dataclass."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, meta: Any) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, meta: Any) -> None:
        self.codes, self.scale, self.meta = codes, scale, meta

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["codes", "scale"], {"meta": self.meta}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> Packed:
        return Packed(inner["codes"], inner["scale"], ctx["meta"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(func)


@dataclass(frozen=True)
class Meta:
    bits: int
    note: str


def test_user_class_allowlisted_unknown_name_and_context_refused(tmp_path: Path) -> None:
    value = Packed(torch.arange(6, dtype=torch.int8), torch.tensor(0.5), Meta(8, "x"))
    with pytest.raises(FormatError, match=r"'t/w': a .*Packed is a tensor subclass .*register_tensor_subclass"):
        shardsafe.save(tmp_path / "refused", {"t": {"w": value}})
    assert not (tmp_path / "refused").exists()
    try:
        shardsafe.register_tensor_subclass(Packed)  # Meta not listed: the context cannot be stored
        with pytest.raises(FormatError, match=r"'t/w': its .*Packed: context\['meta'\] is a .*Meta.*context_types"):
            shardsafe.save(tmp_path / "refused", {"t": {"w": value}})
        assert not (tmp_path / "refused").exists()
        shardsafe.register_tensor_subclass(Packed, context_types=[Meta])
        shardsafe.save(tmp_path / "ck", {"t": {"w": value}})
        state: dict[str, Any] = {"t": None}
        shardsafe.load(tmp_path / "ck", state)
        got = state["t"]["w"]
        assert type(got) is Packed and got.meta == Meta(8, "x") and torch.equal(got.codes, value.codes)
    finally:
        shardsafe.unregister_tensor_subclass(Packed)
    state = {"t": None}
    with pytest.raises(FormatError, match=r"'t/w': .*Packed', a tensor subclass .*register_tensor_subclass"):
        shardsafe.load(tmp_path / "ck", state)
    assert state == {"t": None}


# ----------------------------------------------------------------------------- FSDP2, 2 gloo ranks


def _qlora_job(rank: int, world_size: int, load_from: str, save_to: str, seed: int) -> dict[str, Any]:
    """Build the QLoRA model (FSDP2 on more than one rank), train it two steps or load it, save it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(seed)
    model = nn.Sequential(QLoRA(seed, 64), QLoRA(seed + 1, 96))
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if load_from:
        shardsafe.load(load_from, {"model": model, "optim": optim})
    else:
        for _ in range(2):
            model(torch.randn(3, 64, dtype=torch.bfloat16)).float().sum().backward()
            optim.step()
            optim.zero_grad()
    if save_to:
        shardsafe.save(save_to, {"model": model, "optim": optim})
    if save_to and world_size > 1:  # a class registered without sharded_inner: its parts cannot be placed
        from torch.distributed.tensor import Shard

        split = DTensor.from_local(_mx(rank), mesh, [Shard(0)], run_check=False)
        with pytest.raises(FormatError, match=r"'mx': its .*MXTensor is split over ranks .*sharded_inner"):
            shardsafe.save(save_to + "-mx", {"mx": split})
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = _bits(local) if hasattr(local, "__tensor_flatten__") else _whole(p)
    out["y"] = model(torch.ones(2, 64, dtype=torch.bfloat16)).detach().float()
    return out


def _whole(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _whole_nf4(parts: list[dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    """The whole NF4 tensor's inner bytes from the ranks' parts (sharded ones concatenated)."""
    sharded = {"quantized_scalers", "quantization_factor", "quantized_data"}  # torchao's FSDP2 split
    first = parts[0][name]
    return {n: torch.cat([p[name][n] for p in parts]) if n in sharded else first[n] for n in first}


def _assert_results(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, dict):
            assert all(torch.equal(value[n], got[name][n]) for n in value), name
        else:
            assert torch.equal(value, got[name]), name


def test_qlora_fsdp2_round_trip_and_reshard(tmp_path: Path) -> None:
    """Saved by 2 ranks (trained LoRA weights, AdamW state, NF4 base weights as DTensors of NF4
    parts), loaded by 3 ranks (other parts of every inner tensor) and by one process (every NF4
    tensor whole, bit-exact), saved again there and loaded by 2 ranks: each rank's NF4 parts, LoRA
    weights and the output equal the first run's."""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    saved = run_ranks(_qlora_job, 2, "", two, 0, work_dir=tmp_path)
    three = run_ranks(_qlora_job, 3, two, "", 3, work_dir=tmp_path)
    single = _qlora_job(0, 1, two, one, 9)
    assert torch.equal(single["y"], saved[0]["y"]) and all(torch.equal(r["y"], saved[0]["y"]) for r in three)
    for name in ("0.weight", "1.weight"):
        _assert_results(single[name], _whole_nf4(saved, name))
        _assert_results(_whole_nf4(three, name), _whole_nf4(saved, name))
    back = run_ranks(_qlora_job, 2, one, "", 5, work_dir=tmp_path)
    for before, after in zip(saved, back):
        _assert_results(after, before)


def _edit_record(path: Path, edit: Any, entry: str = "t") -> None:
    """Edit the '<entry>/w' record in state.json and make the manifest vouch for it, as an attacker can."""
    import xxhash

    state = path / "state.json"
    tree = json.loads(state.read_text())
    edit(tree[entry]["state"]["w"]["__subclass__"])
    state.write_text(json.dumps(tree))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["state"] |= {"size": state.stat().st_size, "hash": xxhash.xxh3_64_hexdigest(state.read_bytes())}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _meta(record: dict[str, Any]) -> dict[str, Any]:
    return record["context"]["tensor_meta"]["__object__"][1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update({"class": "os.system"}), r"'t/w': .*stores it as a 'os.system'.*never imported"),
        (lambda r: r.pop("stride"), r"a tensor subclass record needs exactly the fields"),
        (lambda r: r.update({"shape": [64, -1]}), r"record's shape is not a list of at most 16 sizes"),
        (lambda r: r.update({"stride": [1]}), r"stride \[1\] does not fit its shape"),
        (lambda r: r["inner"].update({"nf4": {"__tensor__": "t/w/quantized_data"}}), r"inner tensor 'nf4' is not a"),
        (lambda r: r.update({"inner": {}}), r"record has no inner tensors"),
        (lambda r: r["context"].update({"block_size": {"__enum__": ["os.system", "x"]}}), r"holds a 'os.system'"),
        (lambda r: _meta(r).update({"dtype": {"__dtype__": "pickle"}}), r"dtype"),
        (lambda r: _meta(r).update({"evil": 1}), r"SubclassTensorArgs.* does not take its stored fields"),
        (lambda r: _meta(r).update({"original_shape": {"__size__": [1, "x"]}}), r"malformed __size__"),
        (
            lambda r: _meta(r).update({"original_shape": {"__size__": [8, 8]}}),
            r"'t/w': .*NF4Tensor rebuilt from its parts is not a tensor of shape \[64, 64\]",
        ),
    ],
    ids=[
        "class-to-import",
        "missing-field",
        "negative-size",
        "stride-rank",
        "inner-elsewhere",
        "no-inner",
        "enum-not-listed",
        "bad-dtype",
        "extra-field",
        "bad-size",
        "lying-context",
    ],
)
def test_hostile_records_refused(tmp_path: Path, edit: Any, message: str) -> None:
    """A record from a file is checked field by field; nothing is imported; each is a FormatError."""
    shardsafe.save(tmp_path / "ck", {"t": {"w": _nf4(0)}})
    _edit_record(tmp_path / "ck", edit)
    state: dict[str, Any] = {"t": None}
    with pytest.raises(FormatError, match=message):
        shardsafe.load(tmp_path / "ck", state)
    assert state == {"t": None}


def test_torchao_class_taken_off_the_allowlist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """unregister_tensor_subclass takes torchao's classes off too: save refuses, load names the remedy."""
    from shardsafe.state import subclasses

    monkeypatch.setattr(subclasses, "_REGISTERED", dict(subclasses._REGISTERED))  # restored after the test
    monkeypatch.setattr(subclasses, "_REMOVED", set(subclasses._REMOVED))
    weight = _nf4(0)
    shardsafe.save(tmp_path / "ck", {"t": {"w": weight}})
    shardsafe.unregister_tensor_subclass(type(weight))
    with pytest.raises(FormatError, match=r"'t/w': a .*NF4Tensor is a tensor subclass .*not allowlisted"):
        shardsafe.save(tmp_path / "refused", {"t": {"w": weight}})
    with pytest.raises(FormatError, match=r"'t/w': .*NF4Tensor', a tensor subclass .*register_tensor_subclass"):
        shardsafe.load(tmp_path / "ck", {"t": None})
    assert not (tmp_path / "refused").exists()


def _hsdp_job(rank: int, world_size: int, save_to: str) -> dict[str, Any]:
    """The QLoRA model under HSDP (2 replicas x 2 shards): trained two steps and saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(QLoRA(0, 64), QLoRA(1, 96))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 64, dtype=torch.bfloat16)).float().sum().backward()
        optim.step()
        optim.zero_grad()
    shardsafe.save(save_to, {"model": model, "optim": optim})
    return {"y": model(torch.ones(2, 64, dtype=torch.bfloat16)).detach().float()}


def test_qlora_hsdp_to_one_process(tmp_path: Path) -> None:
    """HSDP (Replicate x Shard(0)) NF4 weights: the inner tensors are stored once per part, and one
    process loads the model with the saving run's output."""
    saved = run_ranks(_hsdp_job, 4, str(tmp_path / "hsdp"), work_dir=tmp_path)
    single = _qlora_job(0, 1, str(tmp_path / "hsdp"), "", 9)
    assert all(torch.equal(r["y"], saved[0]["y"]) for r in saved)
    assert torch.equal(single["y"], saved[0]["y"])


def test_class_recorded_under_an_older_name(tmp_path: Path) -> None:
    """A class that moved (NF4Tensor was torchao.dtypes.nf4tensor.NF4Tensor in older torchao; a
    user's class registered with aliases=) loads from checkpoints that recorded the old name."""
    weight = _nf4(0)
    shardsafe.save(tmp_path / "ck", {"t": {"w": weight}})
    _edit_record(tmp_path / "ck", lambda r: r.update({"class": "torchao.dtypes.nf4tensor.NF4Tensor"}))
    state: dict[str, Any] = {"t": None}
    shardsafe.load(tmp_path / "ck", state)
    _assert_same_bits(state["t"]["w"], weight)
    shardsafe.save(tmp_path / "model", {"model": nn.ParameterDict({"w": nn.Parameter(weight, False)})})
    _edit_record(tmp_path / "model", lambda r: r.update({"class": "torchao.dtypes.nf4tensor.NF4Tensor"}), "model")
    model = nn.ParameterDict({"w": nn.Parameter(_nf4(1), False)})
    inner = model["w"].quantized_data
    shardsafe.load(tmp_path / "model", {"model": model})  # in place: one class under both names
    assert model["w"].quantized_data is inner
    _assert_same_bits(model["w"], weight)

    value = Packed(torch.arange(6, dtype=torch.int8), torch.tensor(0.5), Meta(8, "x"))
    try:
        shardsafe.register_tensor_subclass(Packed, context_types=[Meta], aliases=["oldpkg.quant.Packed"])
        shardsafe.save(tmp_path / "user", {"t": {"w": value}})
        _edit_record(tmp_path / "user", lambda r: r.update({"class": "oldpkg.quant.Packed"}))
        state = {"t": None}
        shardsafe.load(tmp_path / "user", state)
        assert type(state["t"]["w"]) is Packed and torch.equal(state["t"]["w"].codes, value.codes)
    finally:
        shardsafe.unregister_tensor_subclass(Packed)
    with pytest.raises(FormatError, match=r"'oldpkg.quant.Packed', a tensor subclass"):
        shardsafe.load(tmp_path / "user", {"t": None})
