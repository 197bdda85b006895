"""Hugging Face export: save_pretrained from real FSDP2 runs, export_hf / `shardsafe export`, the guard.

One launch of 2 gloo ranks builds a tiny Llama (tied and untied embeddings; some dims split
unevenly over 2 ranks), shards it with FSDP2, takes a training step, and writes:
``gathered-*`` (save_pretrained, bf16, several shards), ``single-*`` (one file, fp32),
``nogather/model`` (gather_16bit=False, watched for weights files by a thread of this process the
whole time) and ``ckpt-*`` (a plain shardsafe checkpoint of model + optimizer). Rank 0 returns the
whole model after the step; the tests compare every output with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from dist_utils import run_ranks
from shardsafe.api.source import TensorInfo
from shardsafe.cli.export import add_parser as add_export_command
from shardsafe.errors import CheckpointExistsError, FormatError, IntegrityError, ModelFolderError
from shardsafe.hf.export import SINGLE_FILE, iter_output, parse_size, plan_shards
from shardsafe.hf.guard import INDEX_FILE, check_model_folder
from stored_chunks import stored_chunks

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

MAX_SHARD = "20KB"
# A weights file in Hugging Face naming (safetensors or pickle), or its index.
HF_WEIGHTS = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$|\.bin$"
)


def llama_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    # intermediate 67 and vocab 131 split unevenly over 2 ranks (34/33, 66/65 rows)
    return LlamaConfig(
        vocab_size=131,
        hidden_size=32,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )


def _rank_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    out = Path(root)
    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world_size,))
    for tie in (True, False):
        torch.manual_seed(1234 + tie)
        model = AutoModelForCausalLM.from_config(llama_config(tie))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        ids = torch.randint(0, 131, (2, 9), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()

        whole = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }
        shardsafe.save_pretrained(model, out / f"gathered-{tie}", max_shard_size=MAX_SHARD)
        # push_to: collective, the coordinator uploads after publishing
        push_to = None if tie else f"file://{out}/pushed"
        shardsafe.save_pretrained(model, out / f"single-{tie}", dtype=None, push_to=push_to)
        if tie:
            shardsafe.save_pretrained(model, out / "nogather" / "model", gather_16bit=False)
        shardsafe.save(out / f"ckpt-{tie}", {"model": model, "optim": optim, "step": 1})
        results[f"tie={tie}"] = whole if rank == 0 else None
    return results


class WeightsWatcher(threading.Thread):
    """Polls ``os.walk(root)`` about every millisecond; records any weights file in Hugging Face naming."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.polls = 0
        self.saw_temp = 0  # polls that caught the save's hidden temporary folder
        self.saw_shards = 0  # polls that caught checkpoint shard files (the save was caught mid-way)

    def run(self) -> None:
        while not self.stop.is_set():
            for folder, _, files in os.walk(self.root):
                if ".shardsafe-tmp-" in folder:
                    self.saw_temp += 1
                if any(f.startswith("shard-") for f in files):
                    self.saw_shards += 1
                self.violations += [os.path.join(folder, f) for f in files if HF_WEIGHTS.search(f)]
            self.polls += 1
            time.sleep(0.001)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("export")
    (root / "nogather").mkdir()
    watcher = WeightsWatcher(root / "nogather")
    watcher.start()
    try:
        results = run_ranks(_rank_job, 2, str(root), work_dir=root / "launch")
    finally:
        watcher.stop.set()
        watcher.join()
    return {"root": root, "whole": results[0], "watcher": watcher}


def expected(whole: dict[str, torch.Tensor], dtype: torch.dtype | None, tie: bool) -> dict[str, torch.Tensor]:
    out = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in whole.items()}
    if tie:
        # written once, under the embedding's name
        assert torch.equal(out.pop("lm_head.weight"), out["model.embed_tokens.weight"])
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}[{name}]: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        )
        assert torch.equal(g, w), f"{what}[{name}]: values differ"


def hf_split(tensors: dict[str, torch.Tensor], max_shard_size: str) -> dict[str, str]:
    """The weight_map huggingface_hub (what transformers' save_pretrained uses) would make."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    return split.tensor_to_filename


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gathered_save_from_fsdp2(runs: dict[str, Any], tie: bool) -> None:
    from transformers import AutoModelForCausalLM

    folder = runs["root"] / f"gathered-{tie}"
    want = expected(runs["whole"][f"tie={tie}"], torch.bfloat16, tie)
    assert_same(dict(iter_output(folder)), want, f"gathered tie={tie}")

    index = json.loads((folder / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["weight_map"] == hf_split(want, MAX_SHARD), "files split as transformers would split them"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*files, INDEX_FILE, "config.json", "generation_config.json"]
    )
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["architectures"] == ["LlamaForCausalLM"]
        and config["dtype"] == "bfloat16"
        and config["tie_word_embeddings"] is tie
    )
    assert not [p for p in folder.parent.iterdir() if ".shardsafe-tmp-" in p.name], "no temporary folder is left behind"
    assert check_model_folder(folder).architecture == "names and shapes of LlamaForCausalLM", (
        "the guard compared it with its config"
    )

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tie
    assert_same({k: v for k, v in model.state_dict().items() if k in want}, want, "from_pretrained")
    assert torch.equal(model.lm_head.weight, want["lm_head.weight" if not tie else "model.embed_tokens.weight"])


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gathered_save_single_file_keeps_dtype(runs: dict[str, Any], tie: bool) -> None:
    folder = runs["root"] / f"single-{tie}"
    assert not (folder / INDEX_FILE).exists() and (folder / SINGLE_FILE).is_file()
    assert_same(dict(iter_output(folder)), expected(runs["whole"][f"tie={tie}"], None, tie), f"single tie={tie}")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    if not tie:
        pushed = runs["root"] / "pushed"
        assert sorted(p.name for p in pushed.iterdir()) == sorted(p.name for p in folder.iterdir())
        assert all((pushed / p.name).read_bytes() == p.read_bytes() for p in folder.iterdir())


def test_no_weights_file_without_gather(runs: dict[str, Any], tmp_path: Path) -> None:
    watcher = runs["watcher"]
    assert watcher.violations == [], (
        f"a weights file appeared during save_pretrained(gather_16bit=False): {sorted(set(watcher.violations))}"
    )
    assert watcher.polls > 100 and watcher.saw_temp > 0 and watcher.saw_shards > 0, (
        "the watcher saw the save in progress"
    )
    folder = runs["root"] / "nogather" / "model"
    assert sorted(p.name for p in folder.iterdir()) == [
        "EXPORT.md",
        "checkpoint",
        "config.json",
        "generation_config.json",
    ]
    assert not [p for p in folder.rglob("*") if HF_WEIGHTS.search(p.name)]
    assert "shardsafe export" in (folder / "EXPORT.md").read_text()
    assert check_model_folder(folder).kind == "shardsafe-checkpoint"

    # exporting it gives exactly what the gathered save wrote (same files, same bytes)
    out = shardsafe.export_hf(folder, tmp_path / "hf", max_shard_size=MAX_SHARD, progress=False)
    gathered = runs["root"] / "gathered-True"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in gathered.iterdir())
    for path in gathered.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), f"{path.name} differs from the gathered save"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_training_checkpoint_in_one_process(runs: dict[str, Any], tmp_path: Path, tie: bool) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = runs["root"] / f"ckpt-{tie}"
    assert shardsafe.verify(ckpt)["world_size"] == 2
    whole = runs["whole"][f"tie={tie}"]
    config = runs["root"] / f"gathered-{tie}" / "config.json"

    out = shardsafe.export_hf(
        ckpt, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="30KB", config=config, progress=False
    )
    # optimizer and step left out
    assert_same(dict(iter_output(out)), expected(whole, torch.bfloat16, tie), "export bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, whole["lm_head.weight"].to(torch.bfloat16))

    # the command line: stored dtype by default, --dtype casts, one file when it fits
    parser = argparse.ArgumentParser(prog="shardsafe")
    add_export_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["export", str(ckpt), str(tmp_path / "cli"), "--dtype", "float16", "--config", str(config), "--no-progress"]
    )
    assert args.func(args) == 0
    assert (tmp_path / "cli" / SINGLE_FILE).is_file() and not (tmp_path / "cli" / INDEX_FILE).exists()
    assert_same(dict(iter_output(tmp_path / "cli")), expected(whole, torch.float16, tie), "export fp16")
    args = parser.parse_args(
        ["export", str(ckpt), str(tmp_path / "nofsync"), "--config", str(config), "--no-progress", "--no-fsync"]
    )
    assert args.no_fsync and args.func(args) == 0  # same files, only not fsynced
    fsynced = shardsafe.export_hf(ckpt, tmp_path / "fsynced", config=config, progress=False)
    assert_same(dict(iter_output(tmp_path / "nofsync")), dict(iter_output(fsynced)), "export --no-fsync")
    with pytest.raises(CheckpointExistsError):
        shardsafe.export_hf(ckpt, tmp_path / "cli", config=config, progress=False)


def test_export_refuses_corrupted_source_atomically(runs: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(runs["root"] / "ckpt-False", src)
    chunk = stored_chunks(src, "model/model.norm.weight")[-1]  # a tensor the export reads last
    shard = src / chunk["file"]
    data = bytearray(shard.read_bytes())
    data[chunk["end"] - 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="hash mismatch"):
        shardsafe.export_hf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "nothing visible and no temporary folder left"


def test_guard_refuses_broken_model_folders(runs: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    gathered = runs["root"] / "gathered-False"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="no weights"):
        check_model_folder(empty)
    dummy = tmp_path / "dummy"
    dummy.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.empty(0), "lm_head.weight": torch.empty(0, 32)}, str(dummy / SINGLE_FILE)
    )
    with pytest.raises(ModelFolderError, match="empty"):
        check_model_folder(dummy)
    (dummy / SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ModelFolderError, match="0 bytes"):
        check_model_folder(dummy)
    truncated = tmp_path / "truncated"
    shutil.copytree(gathered, truncated)
    last = sorted(truncated.glob("model-*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 100)
    with pytest.raises(ModelFolderError):
        check_model_folder(truncated)
    missing = tmp_path / "missing"
    shutil.copytree(gathered, missing)
    sorted(missing.glob("model-*.safetensors"))[0].unlink()
    with pytest.raises(ModelFolderError, match="missing"):
        check_model_folder(missing)
    nogather = tmp_path / "nogather"
    shutil.copytree(runs["root"] / "nogather" / "model", nogather)
    (nogather / "checkpoint" / "shard-00000.safetensors").unlink()
    with pytest.raises(ModelFolderError, match="missing"):
        check_model_folder(nogather)


def test_save_pretrained_one_process_plain_module(tmp_path: Path) -> None:
    """No process group, no transformers: a plain module with a tied weight and a non-persistent buffer."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.steps = torch.nn.Parameter(torch.arange(3.0))
            self.register_buffer("count", torch.tensor([1, 2], dtype=torch.int64))
            self.register_buffer("cache", torch.ones(5), persistent=False)

    net = Net()
    out = shardsafe.save_pretrained(net, tmp_path / "net", dtype=torch.float16)
    got = dict(iter_output(out))
    assert sorted(got) == ["count", "embed.weight", "steps"], (
        "tie written once (first name), non-persistent buffer skipped"
    )
    assert got["embed.weight"].dtype == torch.float16 and torch.equal(
        got["embed.weight"], net.embed.weight.detach().half()
    )
    assert got["count"].dtype == torch.int64, "integer buffers keep their dtype"
    assert sorted(p.name for p in out.iterdir()) == [SINGLE_FILE], "no transformers config: weights only"
    with pytest.raises(CheckpointExistsError):
        shardsafe.save_pretrained(net, out)
    shardsafe.save_pretrained(net, out, dtype=None, overwrite=True, push_to=f"file://{tmp_path}/pushed")
    assert dict(iter_output(out))["steps"].dtype == torch.float32
    assert (tmp_path / "pushed" / SINGLE_FILE).read_bytes() == (out / SINGLE_FILE).read_bytes()

    # without gathering: the pushed folder (config-less here) holds the checkpoint, and exports to the same weights
    shardsafe.save_pretrained(
        net, tmp_path / "sharded", gather_16bit=False, dtype=None, push_to=f"file://{tmp_path}/pushed-sharded"
    )
    assert sorted(p.name for p in (tmp_path / "pushed-sharded").iterdir()) == ["EXPORT.md", "checkpoint"]
    again = shardsafe.export_hf(tmp_path / "pushed-sharded", tmp_path / "again", progress=False)
    assert (again / SINGLE_FILE).read_bytes() == (out / SINGLE_FILE).read_bytes()


def test_shard_planning_matches_huggingface() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("20KB") == 20_000
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size(1234) == 1234
    for bad in ("", "5XB", "-1GB", "0MB", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 3000, (60,), generator=gen).tolist() + [9000, 12, 25000, 7]
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.float32 if i % 2 else torch.bfloat16) for i, n in enumerate(sizes)}
    for limit in ("10KB", "20KB", "1MB"):
        plan = plan_shards([TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], limit)
        assert plan.weight_map() == hf_split(tensors, limit), limit


def safetensors_names(folder: Path) -> dict[str, list[str]]:
    """file -> tensor names, as safetensors itself reads them (every weights file of the folder)."""
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = list(f.keys())
            for name in out[path.name]:
                f.get_tensor(name)
    return out


def test_every_folder_export_writes_opens_with_safetensors(runs: dict[str, Any], tmp_path: Path) -> None:
    root = runs["root"]
    config = root / "gathered-True" / "config.json"
    written = {
        "save_pretrained gathered": root / "gathered-True",
        "save_pretrained single": root / "single-False",
        "export of nogather": shardsafe.export_hf(root / "nogather" / "model", tmp_path / "a", progress=False),
        "export bf16 sharded": shardsafe.export_hf(
            root / "ckpt-True", tmp_path / "b", dtype="bfloat16", max_shard_size="8KB", config=config, progress=False
        ),
        "export untied": shardsafe.export_hf(
            root / "ckpt-False", tmp_path / "c", config=root / "gathered-False", progress=False
        ),
        "export without config": shardsafe.export_hf(root / "ckpt-False", tmp_path / "d", progress=False),
    }
    for what, folder in written.items():
        names = safetensors_names(folder)
        assert names and sum(len(v) for v in names.values()) == check_model_folder(folder).tensors, what
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            assert weight_map == {n: file for file, ns in names.items() for n in ns}, what
        how = check_model_folder(folder).architecture
        assert how == (
            "skipped: no config.json" if what == "export without config" else "names and shapes of LlamaForCausalLM"
        ), (what, how)


class NamedTensors:
    """A :class:`TensorSource` whose names are given: what another checkpoint reader could hand export_hf."""

    default_dtype = None

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.reads = 0

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(n, torch.float32, (2,)) for n in self.names]

    def read(self, name: str) -> torch.Tensor:
        self.reads += 1
        return torch.ones(2)

    def config_files(self) -> dict[str, Path]:
        return {}

    def close(self) -> None:
        pass


def test_export_refuses_names_safetensors_cannot_store(tmp_path: Path) -> None:
    """Refused with a FormatError before anything is read or written; a name safetensors stores is fine."""
    cases = {
        "__metadata__": ["a", "__metadata__"],
        "not valid UTF-8 (a lone surrogate)": ["a", "b\udc80"],
        "two tensors would both be named 'a'": ["a", "b", "a"],
        "is not a non-empty string": [""],
    }
    for fragment, names in cases.items():
        source = NamedTensors(names)
        with pytest.raises(FormatError, match=re.escape(fragment)):
            shardsafe.export_hf(source, tmp_path / "out", progress=False)
        assert source.reads == 0 and sorted(p.name for p in tmp_path.iterdir()) == [], fragment
    out = shardsafe.export_hf(NamedTensors(["a", "ü.weight", "with space", "nul\x00"]), tmp_path / "ok", progress=False)
    assert {k: sorted(v) for k, v in safetensors_names(out).items()} == {
        SINGLE_FILE: sorted(["a", "ü.weight", "with space", "nul\x00"])
    }

    # through a real checkpoint: a module whose parameter is called __metadata__ (save accepts it, export refuses it)
    module = torch.nn.Module()
    module.register_parameter("__metadata__", torch.nn.Parameter(torch.ones(2)))
    shardsafe.save(tmp_path / "ckpt", {"model": module})
    with pytest.raises(
        FormatError, match=f"export {tmp_path / 'ckpt'} -> {tmp_path / 'bad'}: a tensor is named '__metadata__'"
    ):
        shardsafe.export_hf(tmp_path / "ckpt", tmp_path / "bad", progress=False)
    with pytest.raises(FormatError, match=f"save_pretrained {tmp_path / 'bad'}: a tensor is named '__metadata__'"):
        shardsafe.save_pretrained(module, tmp_path / "bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ok"], "nothing written, no temporary left"


def test_export_names_a_dtype_argument_it_does_not_know(tmp_path: Path) -> None:
    """``dtype="bf16"`` is the caller's own argument: the error names it and the names to use, and
    writes nothing; a manifest dtype name beyond the CLI's three still casts."""
    shardsafe.save(tmp_path / "ck", {"model": torch.nn.Linear(4, 3)})
    with pytest.raises(shardsafe.ShardsafeError, match=r"export_hf\(dtype='bf16'\): not a dtype name; use one of"):
        shardsafe.export_hf(tmp_path / "ck", tmp_path / "bad", dtype="bf16")
    assert not (tmp_path / "bad").exists()
    shardsafe.export_hf(tmp_path / "ck", tmp_path / "f64", dtype="float64")
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "f64" / SINGLE_FILE).values()} == {torch.float64}
