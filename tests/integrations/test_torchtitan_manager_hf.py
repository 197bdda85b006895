"""ShardsafeCheckpointManager's starts and ends: ``initial_load_*``, the final save (``last_save_model_only``,
``export_dtype``, ``last_save_in_hf``) and torchtitan's seed checkpoint.

The jobs are test_torchtitan_manager's ``run`` (the Trainer's calls around a checkpointer built as the Trainer
builds it, with torchtitan's llama3 ``sd_adapter``). Where the layout does not matter (the final export is one
process's work, a shardsafe or DCP initial load is resharded like any load) the job runs in this process on the
unparallelised model ("one"); the loads whose per-rank reads are the point run on 2 gloo ranks (FSDP2), and on 4
(dp_shard=2 x tp=2) under ``stress``. The Hugging Face folder is checked with ``transformers`` itself: a
``LlamaForCausalLM`` of the matching config loads it and gives the torchtitan model's logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("torchdata")
transformers = pytest.importorskip("transformers")

from test_torchtitan import DIM, HEADS, LAYERS, SEQ, VOCAB, build, tiny_config  # noqa: E402
from test_torchtitan_manager import run, steps_in  # noqa: E402
from torchtitan.models.common import compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

import shardsafe  # noqa: E402
from dist_utils import assert_tensors_equal, run_ranks  # noqa: E402
from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager  # noqa: E402

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

# transformers' LlamaConfig of test_torchtitan's tiny llama3 (its RoPE: theta 500000, llama3 scaling)
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": DIM,
    "intermediate_size": compute_ffn_hidden_dim(DIM, multiple_of=64),
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def in_process(base: Path | str, steps: int, checkpoint: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``run`` on one process, the model not parallelised (rank 0 of 1, no process group)."""
    args = {"kill_after": None, "record_at": (), "seed": 0, "dcp_manager": False, "hf_assets": None, **kwargs}
    return run(0, 1, "one", str(base), steps, checkpoint, **args)


def model_part_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("optim/")}


def rounded(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).float() for k, v in model_part_of(state).items()}


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    """torchtitan's ``hf_assets_path``: where the model's Hugging Face config.json lives."""
    folder = tmp_path / "assets"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    return folder


def test_final_save_in_hf_loads_in_transformers_and_starts_a_2_rank_run(tmp_path: Path, assets: Path) -> None:
    """last_save_in_hf with export_dtype=bfloat16: <folder>/step-3 is a Hugging Face folder (written through
    the llama3 sd_adapter: renamed keys, Q/K rows permuted) that transformers loads, giving the torchtitan model's
    logits; beside it the model-only shardsafe checkpoint in bfloat16. A new 2-rank FSDP2 run with
    initial_load_in_hf starts from that folder: each rank reads its rows through the adapter."""
    checkpoint = {
        "enable": True,
        "folder": "ckpt",
        "interval": 2,
        "keep_latest_k": 0,
        "last_save_in_hf": True,
        "export_dtype": "bfloat16",
    }
    saved = in_process(tmp_path, 3, checkpoint, record_at=(3,), hf_assets=str(assets))
    expected = rounded(saved["recorded"][3]["state"], torch.bfloat16)
    assert steps_in(tmp_path / "ckpt") == [2, 3]
    final = json.loads((tmp_path / "ckpt" / "step-0000000003" / "state.json").read_text())
    assert set(final) == {"model", "export_dtype"} and final["export_dtype"]["state"] == "bfloat16"
    assert shardsafe.verify(tmp_path / "ckpt" / "step-0000000003")["tensors"] == len(expected)

    folder = tmp_path / "ckpt" / "step-3"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapter = Llama3StateDictAdapter(tiny_config(), None)
    assert_tensors_equal(adapter.from_hf(dict(hf_model.state_dict())), expected, "from_pretrained")
    native, _, _ = build("one", 1, seed=5)
    native.load_state_dict(expected)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, native(tokens), rtol=1e-5, atol=1e-5)

    start = {"enable": True, "folder": "next", "initial_load_path": str(folder), "initial_load_in_hf": True}
    started = run_ranks(run, 2, "fsdp", str(tmp_path), 1, start, None, (), 99, work_dir=tmp_path / "w")
    for rank, result in enumerate(started):
        assert result["loaded_at"] == 0  # the model alone: the step and the optimizer start afresh
        assert_tensors_equal(result["loaded"], expected, f"initial HF load, rank {rank}")
    assert steps_in(tmp_path / "next") == [1]


def seed_checkpoint(base: Path, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What torchtitan's train.py does with create_seed_checkpoint: one process, the model built and
    initialised but not parallelised, the checkpointer built as usual, ``save(curr_step=0, last_step=True)``."""
    return in_process(base, 0, {**checkpoint, "create_seed_checkpoint": True})["seed"]


def test_seed_checkpoint_on_one_process_starts_a_2_rank_run(tmp_path: Path) -> None:
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 2}
    seed = seed_checkpoint(tmp_path, checkpoint)
    assert steps_in(tmp_path / "ckpt") == [0]
    state = json.loads((tmp_path / "ckpt" / "step-0000000000" / "state.json").read_text())
    assert set(state) == {"model"}  # model only (last_save_model_only), float32
    assert shardsafe.verify(tmp_path / "ckpt" / "step-0000000000")["world_size"] == 1

    resumed = run_ranks(run, 2, "fsdp", str(tmp_path), 2, checkpoint, None, (), 99, work_dir=tmp_path / "w")
    for rank, result in enumerate(resumed):
        assert result["loaded_at"] == 0
        assert_tensors_equal(result["loaded"], model_part_of(seed), f"seed -> FSDP2 rank {rank}")
    assert steps_in(tmp_path / "ckpt") == [0, 2]


def test_initial_load_from_dcp_and_shardsafe_checkpoints(tmp_path: Path) -> None:
    """initial_load_path as the DCP manager reads it, when ``folder`` is empty: a DCP manager step folder (model
    only, the default), a shardsafe checkpoint in full (initial_load_model_only=False: the step continues); a
    final model-only save in bfloat16 resumed from its folder; bad paths refused with the model untouched."""
    dcp = {"enable": True, "folder": "dcp", "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}
    in_process(tmp_path, 2, dcp, dcp_manager=True)
    dcp_step = tmp_path / "dcp" / "step-2"
    assert (dcp_step / ".metadata").is_file()
    full = {"enable": True, "folder": "a", "interval": 2, "last_save_model_only": False}
    from_dcp = in_process(tmp_path, 2, {**full, "initial_load_path": str(dcp_step)}, seed=99, record_at=(2,))
    reference = in_process(tmp_path / "ref", 2, {"enable": True, "folder": "r", "interval": 2}, record_at=(2,))
    assert from_dcp["loaded_at"] == 0
    assert_tensors_equal(from_dcp["loaded"], model_part_of(reference["recorded"][2]["state"]), "DCP model-only")

    step = str(tmp_path / "a" / "step-0000000002")
    resume = {"enable": True, "folder": "b", "initial_load_path": step, "initial_load_model_only": False}
    again = in_process(tmp_path, 3, resume, seed=7)
    assert again["loaded_at"] == 2  # train_state loaded too
    assert_tensors_equal(again["loaded"], from_dcp["recorded"][2]["state"], "shardsafe full initial load")

    ended = in_process(tmp_path, 2, {"enable": True, "folder": "c", "export_dtype": "bfloat16"}, record_at=(2,))
    later = in_process(tmp_path, 3, {"enable": True, "folder": "c", "interval": 10}, seed=7)
    assert later["loaded_at"] == 0  # a model-only checkpoint: the model alone, cast back to float32
    assert_tensors_equal(later["loaded"], rounded(ended["recorded"][2]["state"], torch.bfloat16), "bf16 final")

    # the DCP manager's checkpoint of the last step in the folder: last_save_in_hf would replace it; refused first
    shutil.copytree(dcp_step, tmp_path / "e" / "step-3")
    with pytest.raises(shardsafe.ShardsafeError, match="is a DCP manager checkpoint"):
        in_process(tmp_path, 3, {"enable": True, "folder": "e", "last_save_in_hf": True}, seed=7)
    assert steps_in(tmp_path / "e") == [] and (tmp_path / "e" / "step-3" / ".metadata").is_file()

    for bad, match in (
        ({"initial_load_path": str(tmp_path / "a")}, "must name one checkpoint"),  # the manager folder, not a step
        ({"initial_load_path": str(dcp_step), "initial_load_in_hf": True}, "safetensors"),
    ):
        with pytest.raises(shardsafe.ShardsafeError, match=match):
            in_process(tmp_path, 1, {"enable": True, "folder": "d", **bad}, seed=7)


def test_initial_load_in_hf_refusals(tmp_path: Path, assets: Path) -> None:
    """initial_load_in_hf without a path needs the adapter's hf_assets_path (as the DCP manager asserts); a folder
    whose tensors do not fit the model (a shape, a missing tensor) is refused naming the tensor."""
    with pytest.raises(ValueError, match="hf_assets_path"):
        in_process(tmp_path, 1, {"enable": True, "folder": "d", "initial_load_in_hf": True})
    from safetensors.torch import save_file

    model, _, _ = build("one", 1, seed=0)
    weights = Llama3StateDictAdapter(tiny_config(), None).to_hf(dict(model.state_dict()))
    weights = {k: v.detach().contiguous() for k, v in weights.items()}
    for bad, match in (
        ({**weights, "model.norm.weight": torch.ones(DIM - 1)}, "model.norm.weight"),
        ({k: v for k, v in weights.items() if k != "lm_head.weight"}, "lm_head.weight"),
    ):
        save_file(bad, str(assets / "model.safetensors"))
        start = {"enable": True, "folder": "d", "initial_load_path": str(assets), "initial_load_in_hf": True}
        with pytest.raises(shardsafe.ShardsafeError, match=match):
            in_process(tmp_path, 1, start)
    with pytest.raises(ValueError, match="initial_load_in_hf requires initial_load_model_only"):
        ShardsafeCheckpointManager.Config(enable=True, initial_load_in_hf=True, initial_load_model_only=False)


@pytest.mark.stress
def test_initial_load_in_hf_at_2d(tmp_path: Path, assets: Path) -> None:
    """The Hugging Face initial load into torchtitan's dp_shard=2 x tp=2 layout at 4 ranks (Q/K permuted
    through the adapter on FSDP-over-TP DTensors), from the hf_assets_path alone (no initial_load_path)."""
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 5, "last_save_in_hf": True}
    saved = in_process(tmp_path, 2, checkpoint, record_at=(2,), hf_assets=str(assets))
    for name in ("model.safetensors", "config.json"):
        (assets / name).write_bytes((tmp_path / "ckpt" / "step-2" / name).read_bytes())
    start = {"enable": True, "folder": "next", "initial_load_in_hf": True}
    started = run_ranks(
        run, 4, "2d", str(tmp_path), 1, start, None, (), 99, False, str(assets), work_dir=tmp_path / "w"
    )
    for rank, result in enumerate(started):
        assert_tensors_equal(result["loaded"], model_part_of(saved["recorded"][2]["state"]), f"2-D rank {rank}")


@pytest.mark.stress
def test_bf16_final_save_at_2_ranks_exported_and_resumed(tmp_path: Path, assets: Path) -> None:
    """The cast final save from FSDP2 DTensors (2 ranks): exported to Hugging Face format and loaded back
    model-only by the next 2-rank run from the folder (bfloat16 read strictly, cast into the float32 model)."""
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 5, "last_save_in_hf": True, "export_dtype": "bfloat16"}
    args = (checkpoint, None, (2,), 0, False, str(assets))
    saved = run_ranks(run, 2, "fsdp", str(tmp_path), 2, *args, work_dir=tmp_path / "w1")
    expected = rounded(saved[0]["recorded"][2]["state"], torch.bfloat16)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt" / "step-2", dtype=torch.float32)
    adapter = Llama3StateDictAdapter(tiny_config(), None)
    assert_tensors_equal(adapter.from_hf(dict(hf_model.state_dict())), expected, "from_pretrained")
    resumed = run_ranks(run, 2, "fsdp", str(tmp_path), 3, checkpoint, None, (), 99, work_dir=tmp_path / "w2")
    for rank, result in enumerate(resumed):
        assert result["loaded_at"] == 0
        assert_tensors_equal(result["loaded"], expected, f"bf16 model-only -> FSDP2 rank {rank}")


def test_newest_state_json_damaged_resumes_the_one_before(tmp_path: Path) -> None:
    """load_step=-1 loads the newest checkpoint that loads: a damaged state.json of the newest one (read first to
    tell a model-only checkpoint) is passed over like any other damage, for the one before it; the run then
    writes that step anew (replacing the damaged one), as the DCP manager would."""
    checkpoint = {"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}
    saved = in_process(tmp_path, 4, checkpoint, record_at=(2,))
    (tmp_path / "ckpt" / "step-0000000004" / "state.json").write_text('{"model": ')
    resumed = in_process(tmp_path, 5, checkpoint, seed=7)
    assert resumed["loaded_at"] == 2
    assert_tensors_equal(resumed["loaded"], saved["recorded"][2]["state"], "the step before the damaged one")
    assert steps_in(tmp_path / "ckpt") == [2, 4, 5]  # the damaged step 4 replaced when this run saved step 4
    assert shardsafe.verify(tmp_path / "ckpt" / "step-0000000004")["world_size"] == 1
    # load_step older than the newest: the run goes on from it and writes steps 4 and 5 anew
    again = in_process(tmp_path, 5, {**checkpoint, "load_step": 2}, seed=8)
    assert again["loaded_at"] == 2 and again["losses"] == resumed["losses"]
    assert steps_in(tmp_path / "ckpt") == [2, 4, 5]


def test_initial_load_from_an_object_store_checkpoint(tmp_path: Path, s3_bucket: str) -> None:
    """initial_load_path as an object-store URL (a local S3 server): the checkpoint a run saved there starts a run
    in a local folder, the model alone."""
    saved = in_process(f"s3://{s3_bucket}", 2, {"enable": True, "folder": "run", "interval": 2}, record_at=(2,))
    start = {"enable": True, "folder": "local", "initial_load_path": f"s3://{s3_bucket}/run/step-0000000002"}
    started = in_process(tmp_path, 1, start, seed=7)
    assert started["loaded_at"] == 0
    assert_tensors_equal(started["loaded"], model_part_of(saved["recorded"][2]["state"]), "from s3")
