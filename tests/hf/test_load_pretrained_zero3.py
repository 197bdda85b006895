"""shardsafe.load_pretrained into DeepSpeed ZeRO-3 models: real DeepSpeed on 2 and 3 CPU ranks (gloo).

One module fixture writes three tiny Llama folders (test_load_pretrained's helpers: a tied fp32 one,
an untied bf16 one sharded with an index, one whose config does not fit) and runs
``tests/ds_scripts/load_pretrained.py`` under ``torch.distributed.run`` at 2 and at 3 ranks
concurrently (at 3 ranks only the cases that depend on where partitions end). The partitions are
uneven and end inside rows: the 131x32 embedding splits 2096/2096 and 1398/1398/1396 elements. The
ranks return whole tensors gathered by DeepSpeed itself; this process compares them with
``from_pretrained`` and never imports DeepSpeed.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export import llama_config
from test_load_pretrained import assert_equal, make_folder, reference_state

from dist_utils import HAVE_DEEPSPEED, TESTS_DIR, launch_script, wait_for_scripts

SCRIPT = TESTS_DIR / "ds_scripts" / "load_pretrained.py"
WORLDS = (2, 3)
# at 3 ranks, the cases whose partitions split rows differently
CASES = {2: "all", 3: "init,fp32_module,bf16_into_fp32"}
LAUNCH_TIMEOUT_S = 600  # the first DeepSpeed start on a machine compiles an op (minutes on 2 cores)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed) and g++ are needed"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{"folders": {...}, 2: [per-rank results], 3: [...]}."""
    root = tmp_path_factory.mktemp("lp_zero3")
    folders = {
        "tied": make_folder(root / "tied", tie=True),
        "untied_bf16": make_folder(root / "untied_bf16", tie=False, dtype=torch.bfloat16, shard_size="20KB"),
    }
    other = llama_config(True)
    other.intermediate_size, other.num_hidden_layers = 70, 3  # other MLP shapes and a layer the folder lacks
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(other).save_pretrained(root / "other")
    folders["other"] = root / "other"
    args = [str(root), *(str(folders[k]) for k in ("tied", "untied_bf16", "other"))]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    launches = [launch_script(f"w{w}", SCRIPT, w, [*args, CASES[w]], cwd=root) for w in WORLDS]
    wait_for_scripts(launches, deadline, "DeepSpeed load_pretrained runs")
    out: dict[Any, Any] = {"folders": folders}
    for w in WORLDS:
        out[w] = [torch.load(root / f"w{w}.rank{r}.pt", weights_only=False) for r in range(w)]
    return out


def tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in a model folder's safetensors files (headers excluded), from their headers."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(
            end - begin
            for key, entry in header.items()
            if key != "__metadata__"
            for begin, end in [entry["data_offsets"]]
        )
    return total


def untied_names(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 master is per parameter: a tied weight once, under its first name."""
    return {k: v for k, v in expected.items() if k != "lm_head.weight"}


def each_byte_once(results: list[dict[str, Any]], case: str, folder: Path) -> list[int]:
    per_rank = [r[case]["bytes_read"] for r in results]
    # the ranks' flat partitions tile every tensor: each byte read exactly once
    assert sum(per_rank) == tensor_bytes(folder)
    # about 1/W each (a part is rounded up per tensor)
    assert max(per_rank) <= tensor_bytes(folder) / len(results) + 1024
    return per_rank


@pytest.mark.parametrize("world", WORLDS)
def test_zero_init_model_then_initialize(runs: dict[str, Any], world: int) -> None:
    """A model built under deepspeed.zero.Init loads into its ds_tensors; the engine then made from it
    holds from_pretrained's weights, and its fp32 master is them too."""
    tied = runs["folders"]["tied"]
    r = runs[world][0]["init"]
    expected = reference_state(tied)
    assert_equal(r["weights"], expected)
    assert_equal(r["masters"], untied_names(expected))
    each_byte_once(runs[world], "init", tied)


@pytest.mark.parametrize("world", WORLDS)
def test_engine_module_equals_from_pretrained_and_trains_the_same(runs: dict[str, Any], world: int) -> None:
    """engine.module of a fresh fp32 engine: the 16-bit (here fp32) partitions and the optimizer's fp32
    master both hold the folder's weights, so two steps give the losses and weights of an engine built
    from from_pretrained (writing ds_tensor alone would be undone by the first step)."""
    tied = runs["folders"]["tied"]
    r = runs[world][0]
    expected = reference_state(tied)
    assert_equal(r["fp32_module"]["weights"], expected)
    assert_equal(r["fp32_module"]["masters"], untied_names(expected))
    assert r["fp32_module"]["loss"] == r["reference"]["loss"]
    assert_equal(r["fp32_module"]["after_step"], r["reference"]["after_step"])
    per_rank = each_byte_once(runs[world], "fp32_module", tied)
    assert per_rank == [rank["init"]["bytes_read"] for rank in runs[world]]


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_folder_into_a_stepped_fp32_engine(runs: dict[str, Any], world: int) -> None:
    """The engine itself, mid-training, from a sharded bf16 folder: upcast exactly as from_pretrained does."""
    folder = runs["folders"]["untied_bf16"]
    r = runs[world][0]["bf16_into_fp32"]
    expected = reference_state(folder, dtype=torch.float32)
    assert_equal(r["weights"], expected)
    assert_equal(r["masters"], expected)
    each_byte_once(runs[world], "bf16_into_fp32", folder)


@pytest.mark.parametrize("world", [2])
def test_bf16_engine_with_gathered_persistent_parameters(runs: dict[str, Any], world: int) -> None:
    """A bf16 engine whose persistent parameters are gathered: they are released by the load and the
    next forward gathers the new values; the fp32 master keeps the file's fp32 values exactly."""
    tied = runs["folders"]["tied"]
    for r in runs[world]:
        assert r["bf16_engine"]["gathered_before"] > 0 and r["bf16_engine"]["gathered_after_load"] == 0
    r = runs[world][0]["bf16_engine"]
    # the fp32 values rounded as .to(bfloat16) does
    assert_equal(r["weights"], reference_state(tied, dtype=torch.bfloat16))
    assert_equal(r["masters"], untied_names(reference_state(tied)))


@pytest.mark.parametrize("world", [2])
def test_mismatch_is_reported_together_and_nothing_is_written(runs: dict[str, Any], world: int) -> None:
    for r in runs[world]:
        kind, message = r["mismatch"]["error"]
        assert kind == "StateMismatchError"
        assert "model.layers.0.mlp.gate_proj.weight: the model has shape [70, 32]" in message
        assert "missing in the model folder: model.layers.2.self_attn.q_proj.weight" in message
        assert r["mismatch"]["unchanged"]  # 16-bit partitions and fp32 master as they were, on every rank
