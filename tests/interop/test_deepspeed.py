"""DeepSpeed ZeRO checkpoints: read without DeepSpeed, export to Hugging Face, convert, resume elsewhere.

The checkpoints are real: one session fixture launches ``tests/ds_scripts/train_zero.py`` under
``torch.distributed.run`` twice (2 and 3 CPU ranks, concurrently), which trains tiny models under
DeepSpeed (gloo, CPU accelerator), saves with ``engine.save_checkpoint`` and records DeepSpeed's own
answers: ``get_fp32_state_dict_from_zero_checkpoint`` and ``safe_get_full_optimizer_state``. This
process never imports DeepSpeed. Skipped when DeepSpeed or a C++ compiler is missing (DeepSpeed
builds a small op with g++ on its first start, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardsafe
from dist_utils import (
    HAVE_DEEPSPEED,
    TESTS_DIR,
    full_model_state,
    full_optimizer_state,
    launch_script,
    run_ranks,
    wait_for_scripts,
)
from ds_scripts.train_zero import VOCAB, Tiny, param_groups
from shardsafe.api.source import CheckpointSource
from shardsafe.cli.convert import add_parser as add_convert_command
from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.hf.export import export_hf, iter_output
from shardsafe.interop.deepspeed_convert import convert_deepspeed
from shardsafe.interop.deepspeed_files import is_deepspeed_checkpoint
from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint, open_source
from shardsafe.interop.unpickler import STAND_INS, load_pt
from shardsafe.protocol.commit import open_checkpoint
from shardsafe.protocol.transfer import ChunkReader

SCRIPT = TESTS_DIR / "ds_scripts" / "train_zero.py"
LAUNCHES = {  # world size -> variants trained in one launch
    2: ["tiny_bf16_z3", "tiny_fp16synth_z3", "llama_bf16_z3", "tiny_fp32_z2"],
    3: ["tiny_fp32_z3", "tiny_bf16_z1"],
}
RUNS = [f"{v}-w{w}" for w, variants in LAUNCHES.items() for v in variants]
TINY_RUNS = [r for r in RUNS if r.startswith("tiny")]
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed start on a machine compiles an op (minutes on 2 cores)

needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed) and g++ are needed"
)


@dataclass
class Run:
    """One DeepSpeed checkpoint and what DeepSpeed says it holds."""

    name: str
    folder: Path  # the folder engine.save_checkpoint wrote (holds `latest`)
    fp32: dict[str, torch.Tensor]  # get_fp32_state_dict_from_zero_checkpoint
    # <param>/fp32, <param>/exp_avg, <param>/exp_avg_sq, __step__, <param>/frozen (ZeRO-1/2)
    optim: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def tied(self) -> dict[str, str]:
        return (
            {"head.weight": "embed.weight"}
            if self.meta["kind"] == "tiny"
            else {"lm_head.weight": "model.embed_tokens.weight"}
        )


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    if not HAVE_DEEPSPEED:
        pytest.skip("DeepSpeed and g++ are needed")
    root = tmp_path_factory.mktemp("deepspeed")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    launches = []
    for world, variants in LAUNCHES.items():
        out = root / f"w{world}"
        out.mkdir()
        launches.append(launch_script(f"w{world}", SCRIPT, world, [str(out), *variants], cwd=root, env=env))
    wait_for_scripts(launches, time.monotonic() + LAUNCH_TIMEOUT_S, "DeepSpeed runs")
    runs = {}
    for world, variants in LAUNCHES.items():
        out = root / f"w{world}"
        for variant in variants:
            meta = json.loads((out / f"{variant}.ref.json").read_text())
            assert meta["world_size"] == world
            runs[f"{variant}-w{world}"] = Run(
                f"{variant}-w{world}",
                out / variant,
                load_file(out / f"{variant}.ref_fp32.safetensors"),
                load_file(out / f"{variant}.ref_optim.safetensors"),
                meta,
            )
    return runs


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bytes."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (
        f"{what}: {got.dtype}{list(got.shape)} vs {expected.dtype}{list(expected.shape)}"
    )
    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), (
        f"{what}: values differ"
    )


# ----------------------------------------------------------------------------- reading


@needs_deepspeed
@pytest.mark.parametrize("name", RUNS)
def test_reader_is_bit_exact_with_zero_to_fp32(ds_runs: dict[str, Run], name: str) -> None:
    run = ds_runs[name]
    with DeepSpeedCheckpoint(run.folder) as ckpt:
        assert ckpt.stage == run.meta["stage"] and ckpt.world_size == run.meta["world_size"]
        assert ckpt.aliases == run.tied
        names = ckpt.names()
        assert [t.name for t in ckpt.tensors()] == names
        # every tensor DeepSpeed's consolidation returns, bit for bit and in its dtype; tied aliases read their source
        assert set(run.fp32) - set(names) == set(run.tied)
        for key, expected in run.fp32.items():
            assert_same(ckpt.read(key), expected, f"{name}: {key}")
            assert_same(ckpt.read(key), expected, f"{name}: {key}, read again")  # after its pages were unmapped
            if key in names:
                assert ckpt.dtype(key) == expected.dtype and ckpt.shape(key) == tuple(expected.shape)
        # ZeRO-1 with bf16 records no frozen parameters and zero_to_fp32 drops them; the model file has them whole
        extra = set(names) - set(run.fp32)
        assert extra == ({"frozen.weight", "frozen.bias"} if run.name.startswith("tiny_bf16_z1") else set())
        for key in extra:
            assert_same(ckpt.read(key), run.optim[f"{key}/frozen"], f"{name}: {key}")
        if run.meta["kind"] == "tiny":  # the model's state-dict order
            assert [k for k in Tiny().state_dict() if k in names] == names


@needs_deepspeed
@pytest.mark.parametrize("name", RUNS)
def test_reader_optimizer_state_matches_deepspeed(ds_runs: dict[str, Run], name: str) -> None:
    run = ds_runs[name]
    with DeepSpeedCheckpoint(run.folder) as ckpt:
        groups = ckpt.param_groups()
        assert [g["params"] for g in groups] == [g["params"] for g in run.meta["param_groups"]]
        for got, expected in zip(groups, run.meta["param_groups"]):
            for key in ("lr", "eps", "weight_decay"):
                assert got[key] == expected[key]
            assert tuple(got["betas"]) == tuple(expected["betas"])
        assert ckpt.trainable == [n for g in groups for n in g["params"]]
        for param in ckpt.trainable:
            assert_same(ckpt.read(param), run.optim[f"{param}/fp32"], f"{name}: {param} (safe_get_full_fp32_param)")
            assert set(ckpt.optimizer_state_spec(param)) == {"step", "exp_avg", "exp_avg_sq"}
            for key in ("exp_avg", "exp_avg_sq"):
                assert_same(ckpt.optimizer_state(param, key), run.optim[f"{param}/{key}"], f"{name}: {param}/{key}")
            step = ckpt.optimizer_state(param, "step")
            assert (
                step.dtype == torch.float32 and step.shape == () and float(step) == float(run.optim["__step__"]) == 2.0
            )


@needs_deepspeed
def test_tag_folder_tag_argument_and_broken_checkpoints(ds_runs: dict[str, Run], tmp_path: Path) -> None:
    run = ds_runs["tiny_bf16_z3-w2"]
    tag = (run.folder / "latest").read_text().strip()
    expected = run.fp32["l2.weight"]
    assert is_deepspeed_checkpoint(run.folder) and is_deepspeed_checkpoint(run.folder / tag)
    for ckpt in (DeepSpeedCheckpoint(run.folder / tag), DeepSpeedCheckpoint(run.folder, tag=tag)):
        assert ckpt.tag == tag and ckpt.model_folder == run.folder
        assert_same(ckpt.read("l2.weight"), expected, "by tag")

    broken = tmp_path / "broken"
    shutil.copytree(run.folder, broken)
    (broken / "latest").write_text("../../etc")
    with pytest.raises(FormatError, match="bad checkpoint tag"):
        DeepSpeedCheckpoint(broken)
    (broken / "latest").unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"tag folders \\['{tag}'\\]"):
        DeepSpeedCheckpoint(broken)
    (broken / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(FormatError, match="1 optimizer state files, but the checkpoint was saved by 2"):
        DeepSpeedCheckpoint(broken, tag=tag)
    with pytest.raises(CheckpointNotFoundError):
        DeepSpeedCheckpoint(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- restricted unpickling


class _Payload:
    """Creates ``marker`` when unpickled by an unrestricted unpickler."""

    def __init__(self, marker: Path, how: str) -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> Any:
        if self.how == "os.system":
            return (os.system, (f"touch {self.marker}",))
        if self.how == "subprocess":
            return (subprocess.call, (["touch", str(self.marker)],))
        return (_stub_module().Exploit, (str(self.marker),))  # a global outside every allow-list


def _stub_module() -> Any:
    module = sys.modules.get("shardsafe_test_evil")
    if module is None:
        module = types.ModuleType("shardsafe_test_evil")

        class Exploit:
            def __init__(self, path: str) -> None:
                Path(path).touch()

        Exploit.__module__, Exploit.__qualname__ = module.__name__, "Exploit"
        module.Exploit = Exploit  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
    return module


@pytest.mark.parametrize("how", ["os.system", "subprocess", "unknown-class"])
def test_restricted_loader_refuses_code(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "x": [torch.zeros(3), _Payload(marker, how)]}}, path)
    before = set(torch.serialization.get_safe_globals())
    with pytest.raises(FormatError, match="refused"):
        load_pt(path)
    assert not marker.exists(), "the restricted loader ran pickled code"
    assert set(torch.serialization.get_safe_globals()) == before, "the DeepSpeed stand-ins must not stay allowed"
    if how != "unknown-class":  # the payload is live: an unrestricted load runs it
        torch.load(path, weights_only=False)
        assert marker.exists()


def test_stand_ins_are_plain() -> None:
    for cls, name in STAND_INS:
        assert name.startswith("deepspeed.") and not cls.__module__.startswith("deepspeed")
        assert [k for k in vars(cls) if not k.startswith("__") and callable(vars(cls)[k])] == []


@needs_deepspeed
@pytest.mark.parametrize("which", ["optim", "model"])
def test_checkpoint_with_malicious_pickle_is_refused(ds_runs: dict[str, Run], tmp_path: Path, which: str) -> None:
    run = ds_runs["tiny_bf16_z3-w2"]
    folder = tmp_path / "evil"
    shutil.copytree(run.folder, folder)
    tag = (folder / "latest").read_text().strip()
    name = (
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        if which == "optim"
        else "zero_pp_rank_1_mp_rank_00_model_states.pt"
    )
    target = folder / tag / name
    state = load_pt(target, mmap=False)
    if which == "optim":  # back to plain values, so that the payload is the only foreign global
        inner = state["optimizer_state_dict"]
        inner["loss_scaler"], inner["zero_stage"] = dict(vars(inner["loss_scaler"])), int(inner["zero_stage"])
    marker = tmp_path / "marker"
    state["extra"] = _Payload(marker, "os.system")
    target.unlink()
    torch.save(state, target)
    with pytest.raises(FormatError, match=name):
        with DeepSpeedCheckpoint(folder) as ckpt:  # model files are opened when a frozen parameter is read
            for key in ckpt.names():
                ckpt.read(key)
    with pytest.raises(FormatError, match=name):
        convert_deepspeed(folder, tmp_path / "converted")
    assert not marker.exists()
    assert not (tmp_path / "converted").exists()


# ----------------------------------------------------------------------------- export


@needs_deepspeed
def test_export_cli_llama_loads_in_transformers(ds_runs: dict[str, Run], tmp_path: Path) -> None:
    from shardsafe.cli.main import main

    run = ds_runs["llama_bf16_z3-w2"]
    out = tmp_path / "hf"
    assert main(["export", str(run.folder), str(out), "--no-progress"]) == 0
    written = dict(iter_output(out))
    assert "lm_head.weight" not in written  # tied: written once, as transformers does
    assert set(written) == set(run.fp32) - {"lm_head.weight"}
    for key, tensor in written.items():
        assert_same(tensor, run.fp32[key], f"export {key}")
    config = json.loads((out / "config.json").read_text())  # copied from next to `latest`
    assert config["hidden_size"] == 24

    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    for key, expected in run.fp32.items():
        assert torch.equal(state[key], expected), key

    bf16 = tmp_path / "hf-bf16"
    assert (
        main(["export", str(run.folder), str(bf16), "--dtype", "bfloat16", "--max-shard-size", "8KB", "--no-progress"])
        == 0
    )
    assert (bf16 / "model.safetensors.index.json").is_file()
    for key, tensor in iter_output(bf16):
        assert_same(tensor, run.fp32[key].to(torch.bfloat16), f"bf16 export {key}")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"


@needs_deepspeed
@pytest.mark.parametrize("name", ["tiny_bf16_z3-w2", "tiny_fp32_z3-w3", "tiny_bf16_z1-w3"])
def test_export_keeps_deepspeed_dtypes(ds_runs: dict[str, Run], tmp_path: Path, name: str) -> None:
    run = ds_runs[name]
    tag_folder = run.folder / (run.folder / "latest").read_text().strip()
    out = export_hf(tag_folder, tmp_path / "hf", progress=False)
    written = dict(iter_output(out))
    assert "head.weight" not in written
    for key, tensor in written.items():
        expected = run.fp32[key] if key in run.fp32 else run.optim[f"{key}/frozen"]
        # frozen parameters stay in the run's dtype, as DeepSpeed returns them
        assert_same(tensor, expected, f"export {key}")
    assert set(written) | {"head.weight"} == set(Tiny().state_dict())
    assert isinstance(open_source(run.folder), DeepSpeedCheckpoint)


# ----------------------------------------------------------------------------- convert and resume


def _load_plain(path: Path, with_scheduler: bool = False) -> dict[str, Any]:
    model = Tiny()
    # hyper-parameters come from the checkpoint
    optim = torch.optim.AdamW(param_groups(model), lr=0.5, betas=(0.5, 0.5), eps=0.1)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    if with_scheduler:
        state["sched"] = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    shardsafe.load(path, state)
    return {"model": model, "optim": optim, "step": state["step"], "sched": state.get("sched")}


def _check_resumed(run: Run, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """Model values (fp32, frozen parameters upcast from the run's dtype), optimizer state and groups as DeepSpeed holds
    them."""
    for key, expected in run.fp32.items():
        if key != "head.weight":  # named_parameters lists a tied parameter once
            assert_same(
                model_state[key], expected.float() if expected.is_floating_point() else expected, f"model {key}"
            )
    for key in ("frozen.weight", "frozen.bias"):
        frozen = run.fp32[key] if key in run.fp32 else run.optim[f"{key}/frozen"]
        assert_same(model_state[key], frozen.float(), f"model {key}")
    trainable = [n for g in run.meta["param_groups"] for n in g["params"]]
    assert sorted(optim_state["state"]) == sorted(trainable)
    for param in trainable:
        entries = optim_state["state"][param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same(entries[key], run.optim[f"{param}/{key}"], f"{param}/{key}")
        assert_same(entries["step"], torch.tensor(2.0), f"{param}/step")
    for got, expected in zip(optim_state["param_groups"], run.meta["param_groups"]):
        assert got["params"] == expected["params"]
        assert (got["lr"], got["betas"], got["eps"], got["weight_decay"]) == (
            expected["lr"],
            tuple(expected["betas"]),
            expected["eps"],
            expected["weight_decay"],
        )


@needs_deepspeed
@pytest.mark.parametrize("name", TINY_RUNS)
def test_convert_then_resume_in_one_process(ds_runs: dict[str, Run], tmp_path: Path, name: str) -> None:
    run = ds_runs[name]
    out = convert_deepspeed(run.folder, tmp_path / "converted")
    summary = shardsafe.verify(out)
    assert summary["metadata"]["converted_from"]["zero_stage"] == run.meta["stage"]
    assert summary["metadata"]["converted_from"]["dp_world_size"] == run.meta["world_size"]
    loaded = _load_plain(out, with_scheduler=True)
    assert loaded["step"] == 2
    model, optim = loaded["model"], loaded["optim"]
    _check_resumed(run, full_model_state(model), full_optimizer_state(model, optim))
    sched = loaded["sched"].state_dict()  # the LR scheduler DeepSpeed stepped comes back too
    assert (
        sched["last_epoch"] == run.meta["lr_scheduler"]["last_epoch"] == 2
        and sched["_last_lr"] == run.meta["lr_scheduler"]["_last_lr"]
    )
    assert model.head.weight is model.embed.weight
    # training continues
    tokens = torch.randint(0, VOCAB, (2, 7))
    torch.nn.functional.cross_entropy(model(tokens)[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    optim.step()
    assert float(optim.state[model.l1.weight]["step"]) == 3.0


def resume_fsdp2(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model.l1, model.l2, model.l3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(param_groups(model), lr=0.5)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    shardsafe.load(path, state)
    result = {"model": full_model_state(model), "optim": full_optimizer_state(model, optim), "step": state["step"]}
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().sum().backward()
    optim.step()
    return result


@needs_deepspeed
def test_convert_then_resume_on_fsdp2_two_ranks(ds_runs: dict[str, Run], tmp_path: Path) -> None:
    run = ds_runs["tiny_fp32_z3-w3"]  # saved by 3 DeepSpeed ranks, resumed on 2 FSDP2 ranks
    out = convert_deepspeed(run.folder, tmp_path / "converted")
    results = run_ranks(resume_fsdp2, 2, str(out), work_dir=tmp_path / "ranks")
    for result in results:
        assert result["step"] == 2
        _check_resumed(run, result["model"], result["optim"])


@needs_deepspeed
def test_convert_command(ds_runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ds_runs["tiny_bf16_z3-w2"]
    parser = argparse.ArgumentParser(prog="shardsafe")
    add_convert_command(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "converted"
    args = parser.parse_args(["convert", str(run.folder), str(out), "--dtype", "keep", "--no-progress"])
    assert args.func(args) == 0
    assert "ZeRO-3" in capsys.readouterr().out
    with CheckpointSource(out) as source:  # --dtype keep: the frozen layer stays bf16, the rest fp32
        dtypes = {t.name: t.dtype for t in source.tensors()}
    assert (
        dtypes["frozen.weight"] == torch.bfloat16
        and dtypes["l1.weight"] == torch.float32
        and dtypes["counts"] == torch.int64
    )
    args = parser.parse_args(["convert", str(run.folder), str(out), "--no-progress"])
    with pytest.raises(shardsafe.CheckpointExistsError):
        args.func(args)
    args = parser.parse_args(["convert", str(run.folder), str(out), "--overwrite", "--no-progress"])
    assert args.func(args) == 0
    # 15 model entries (tied alias included), 10 trained parameters x 3
    assert shardsafe.verify(out)["tensors"] == 15 + 10 * 3
    args = parser.parse_args(["convert", str(run.folder), str(tmp_path / "engine"), "--for-engine", "--dtype", "keep"])
    with pytest.raises(shardsafe.ShardsafeError, match="--dtype does not apply with --for-engine"):
        args.func(args)
    args = parser.parse_args(["convert", str(run.folder), str(tmp_path / "engine"), "--for-engine", "--no-progress"])
    assert args.func(args) == 0
    assert "engine tensors" in capsys.readouterr().out
    assert shardsafe.verify(tmp_path / "engine")["state_entries"] == ["engine", "sched", "step"]


@needs_deepspeed
@pytest.mark.parametrize("name", ["tiny_fp32_z2-w2", "tiny_bf16_z1-w3"])
def test_convert_for_engine_from_zero12(ds_runs: dict[str, Run], tmp_path: Path, name: str) -> None:
    """A ZeRO-1/2 source converts to the ZeRO-3 engine layout too: whole 1-D parameters and moments (bit for
    bit what DeepSpeed's safe_get_full_* report), frozen parameters as stored, the step count of every
    trained parameter, param groups. (Loading such a conversion into a live engine is tested from ZeRO-3
    sources in tests/interop/test_deepspeed_engine.py; the layout is the same.)"""
    run = ds_runs[name]
    out = convert_deepspeed(run.folder, tmp_path / "engine", for_engine=True)
    assert shardsafe.verify(out)["state_entries"] == ["engine", "sched", "step"]
    manifest, tree = open_checkpoint(out)
    meta = tree["engine"]["meta"]
    assert meta["zero_stage"] == 3 and meta["aliases"] == run.tied
    assert [g["params"] for g in meta["param_groups"]] == [g["params"] for g in run.meta["param_groups"]]
    trained = [n for g in meta["param_groups"] for n in g["params"]]
    assert sorted(n for e in meta["optimizer_scalars"] for n in e["params"]) == sorted(trained)
    assert {e["state"]["step"]["tensor"]["value"] for e in meta["optimizer_scalars"]} == {2.0}
    with ChunkReader(out, manifest) as reader:
        for param in trained:
            for key, stored in (
                (f"{param}/fp32", "fp32"),
                (f"{param}/exp_avg", "optim/exp_avg"),
                (f"{param}/exp_avg_sq", "optim/exp_avg_sq"),
            ):
                got = reader.read_tensor(f"engine/{stored}/{param}", manifest.tensors[f"engine/{stored}/{param}"])
                assert_same(got, run.optim[key].reshape(-1), f"{name}: {key}")
        frozen = reader.read_tensor("engine/frozen/frozen.weight", manifest.tensors["engine/frozen/frozen.weight"])
    assert meta["params"]["frozen.weight"]["group"] is None and frozen.numel() == math.prod(
        meta["params"]["frozen.weight"]["shape"]
    )


# ----------------------------------------------------------------------------- without DeepSpeed


def test_tied_weights_optimizer_roundtrip(tmp_path: Path) -> None:
    """A tied parameter's optimizer state is keyed by its first name on save and on load (adapters._param_names)."""
    model = Tiny()
    optim = torch.optim.AdamW(param_groups(model))
    model(torch.randint(0, VOCAB, (2, 5))).sum().backward()
    optim.step()
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": optim, "step": 1})
    loaded = _load_plain(tmp_path / "ckpt")
    assert torch.equal(
        loaded["optim"].state[loaded["model"].embed.weight]["exp_avg"], optim.state[model.embed.weight]["exp_avg"]
    )


def test_open_source_and_detection(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "ckpt", {"model": Tiny()})
    assert not is_deepspeed_checkpoint(tmp_path / "ckpt")
    assert isinstance(open_source(tmp_path / "ckpt"), CheckpointSource)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("global_step9")
    assert is_deepspeed_checkpoint(tmp_path / "ds")
    with pytest.raises(CheckpointNotFoundError, match="global_step9"):
        open_source(tmp_path / "ds")


@needs_deepspeed
def test_convert_reassembles_each_tensor_once(
    ds_runs: dict[str, Run], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ZeRO parameter and moment is reassembled exactly once (the writer takes sizes from the
    header, not from a first pass over the tensors), and the progress bar ends at 100%."""
    import shardsafe.interop.deepspeed_convert as convert_module

    calls: dict[str, int] = {}
    original = convert_module.write_planned

    def counting(final: Any, planned: list[Any], *args: Any, **kwargs: Any) -> Any:
        counted = []
        for item in planned:

            def produce(produce: Any = item.produce, key: str = item.key) -> Any:
                calls[key] = calls.get(key, 0) + 1
                return produce()

            counted.append(dataclasses.replace(item, produce=produce))
        return original(final, counted, *args, **kwargs)

    monkeypatch.setattr(convert_module, "write_planned", counting)
    out = convert_deepspeed(ds_runs[TINY_RUNS[0]].folder, tmp_path / "converted")
    assert calls and set(calls.values()) == {1}, {k: n for k, n in calls.items() if n != 1}
    assert len(calls) == shardsafe.verify(out)["tensors"]  # one call per stored tensor
