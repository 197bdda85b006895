"""A ShardsafeTrainer ``checkpoint-N/`` is a model folder too (issue 38): ``from_pretrained``, ``pipeline`` and
``shardsafe push`` take it as it is, holding the real weights, written once (one process, in this process on
CPU; DDP and ZeRO-3 are checked in test_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import shardsafe  # noqa: E402
from hf_trainer_utils import OrderRecorder, small_trainer  # noqa: E402
from shardsafe.hf.guard import check_model_folder  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("model_folder") / "out"
    trainer = small_trainer(out, max_steps=2)
    trainer.train()
    return out, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_checkpoint_loads_with_from_pretrained_and_pipeline(
    trained: tuple[Path, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, pipeline

    out, final = trained
    folder = out / "checkpoint-2"
    # one process: laid out as the Trainer's checkpoint, the weights in model.safetensors (no index needed)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "shard-00000.safetensors",
        "state.json",
        "trainer_state.json",
        "training_args.json",
    ]
    summary = shardsafe.verify(folder)  # the weights file is the checkpoint's own, hashed by its manifest
    assert summary["state_entries"] == ["data", "model", "optimizer", "rng", "scheduler", "trainer_files"]
    opened = load_file(folder / "model.safetensors")  # what scripts do with a Trainer checkpoint, by hand
    assert sorted(opened) == sorted(final) and all(torch.equal(opened[k], final[k]) for k in final)
    with caplog.at_level("WARNING"):
        loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert "UNEXPECTED" not in caplog.text and "MISSING" not in caplog.text, "the weights file holds the model only"
    for name, tensor in final.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    generator = pipeline("text-generation", model=str(folder), tokenizer=None, device="cpu")
    assert generator.model.transformer.wte.weight.data_ptr() != 0
    assert torch.equal(generator.model.transformer.wte.weight, final["transformer.wte.weight"])
    assert check_model_folder(folder).architecture == "names and shapes of GPT2LMHeadModel"


def test_checkpoint_pushes_as_a_model_and_resumes(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out, final = trained
    url = shardsafe.push(out / "checkpoint-2", f"file://{tmp_path / 'pushed'}", progress=False)
    assert url.endswith("pushed")
    pushed = AutoModelForCausalLM.from_pretrained(tmp_path / "pushed")
    assert torch.equal(pushed.lm_head.weight, final["lm_head.weight"])
    resumed = small_trainer(out, max_steps=3)
    resumed.train(resume_from_checkpoint=True)  # the checkpoint still resumes
    assert resumed.state.global_step == 3
    assert (out / "checkpoint-3" / "model.safetensors").is_file()


def test_a_damaged_weights_file_is_refused(trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """The weights file is part of the checkpoint: verify and the guard see a truncated one."""
    import shutil

    from shardsafe.errors import IntegrityError, ModelFolderError, ShardsafeError

    out, _ = trained
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", copy)
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises((IntegrityError, ShardsafeError)):
        shardsafe.verify(copy)
    with open(copy / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with pytest.raises(ModelFolderError):
        check_model_folder(copy)


def test_no_checkpoint_is_the_trainers_value_error(tmp_path: Path) -> None:
    """Where the Trainer raises ValueError, so does ShardsafeTrainer (a CheckpointNotFoundError too), with its
    message's key phrase."""
    from shardsafe.errors import CheckpointNotFoundError

    trainer = small_trainer(tmp_path / "out", max_steps=1)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory") as info:
        trainer.train(resume_from_checkpoint=True)
    assert isinstance(info.value, CheckpointNotFoundError)
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)  # a folder, but no committed checkpoint
    for path in (tmp_path / "out" / "checkpoint-7", tmp_path / "nowhere"):
        with pytest.raises(ValueError, match=f"Can't find a valid checkpoint at {path}"):
            trainer.train(resume_from_checkpoint=str(path))


def test_resume_from_an_older_checkpoint_replaces_or_keeps_the_later_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As the Trainer: resuming checkpoint-1 while checkpoint-2/-3 exist continues from step 1; the later ones are
    named in a warning at train() start, then replaced as the run saves those steps (or moved aside on request)."""
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    first = small_trainer(out, max_steps=3)
    first.train()
    old = {s: shardsafe.verify(out / f"checkpoint-{s}")["metadata"]["shardsafe.trainer"]["run_id"] for s in (1, 2, 3)}
    with caplog.at_level("WARNING"):
        again = small_trainer(out, max_steps=3)
        again.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert "the later checkpoints checkpoint-2, checkpoint-3 will be replaced" in caplog.text
    new = {s: shardsafe.verify(out / f"checkpoint-{s}")["metadata"]["shardsafe.trainer"]["run_id"] for s in (1, 2, 3)}
    assert new[1] == old[1] and new[2] == new[3] != old[2], "steps 2 and 3 are this run's now"
    assert (out / "checkpoint-3" / "model.safetensors").is_file()

    kept = small_trainer(out, max_steps=2, keep_later_checkpoints=True)
    kept.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    aside = sorted(p.name.split(".superseded-")[0] for p in out.iterdir() if ".superseded-" in p.name)
    assert aside == ["checkpoint-2", "checkpoint-3"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2"), "moved aside: no longer a checkpoint of the run"
    superseded = next(p for p in out.iterdir() if p.name.startswith("checkpoint-3.superseded-"))
    assert shardsafe.verify(superseded)["metadata"]["shardsafe.trainer"]["run_id"] == new[3], "kept intact"


def test_resume_reproduces_the_batch_order_of_a_module_with_its_own_load_code(tmp_path: Path) -> None:
    def trainer(out: Path) -> Any:
        return small_trainer(out, max_steps=6, model=OrderRecorder, save_steps=2)

    full = trainer(tmp_path / "full")
    full.train()
    resumed = trainer(tmp_path / "full")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    assert resumed.model.data_order.tolist() == full.model.data_order.tolist()
    assert len(full.model.data_order) == 12


def test_a_checkpoint_resharded_in_place_resumes_verified(tmp_path: Path) -> None:
    """transformers' tools may rewrite a checkpoint's model.safetensors as model-0000k-of-0000N files + an index (the
    Trainer resumes from that): the resume reads the weights there, each block checked against the checkpoint's
    committed hashes; a changed byte is refused before anything is loaded."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from shardsafe.errors import IntegrityError, ShardsafeError

    out = tmp_path / "out"
    uninterrupted = small_trainer(out, max_steps=2)
    uninterrupted.train()
    folder = out / "checkpoint-1"
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_torch_state_dict(weights, folder, max_shard_size="4KB")  # huggingface_hub's own sharding
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()

    resumed = small_trainer(out, max_steps=2)
    resumed.train(resume_from_checkpoint=str(folder))
    for name, tensor in uninterrupted.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and "view" in p.name], "the view is removed"

    last = folder / shards[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF  # one byte of a weight
    last.write_bytes(bytes(data))
    damaged = small_trainer(out, max_steps=2)
    before = {k: v.clone() for k, v in damaged.model.state_dict().items()}
    with pytest.raises(IntegrityError):
        damaged.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(damaged.model.state_dict()[k], v) for k, v in before.items()), "nothing loaded"

    # an index naming a file outside the checkpoint (a copy of an intact shard) is refused, not followed
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, file = next((n, f) for n, f in index["weight_map"].items() if f == shards[0])
    (out / "outside.safetensors").write_bytes((folder / file).read_bytes())
    index["weight_map"][name] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardsafeError, match="outside the checkpoint folder"):
        small_trainer(out, max_steps=2).train(resume_from_checkpoint=str(folder))
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and "view" in p.name]
