"""``ShardsafeTrainer`` against the real ``transformers.Trainer``, on 2 CPU ranks: DDP and DeepSpeed ZeRO-3.

One module fixture launches ``tests/trainer_scripts/run_trainer.py`` twice under
``torch.distributed.run`` (2 ranks each, concurrently): the DDP scenarios (plain Trainer, ShardsafeTrainer
with checkpoints and ``save_model``, two resumes, two rotations, a push to the local Hub server of
``servers.fixtures``) and the ZeRO-3 ones (plain Trainer, ShardsafeTrainer with checkpoints through the
engine adapter, a resume, ``save_model`` with and without ``stage3_gather_16bit_weights_on_model_save``).
The ranks write losses, folder listings and final weights; the tests compare them here.
Skipped without transformers/accelerate; the ZeRO-3 part also without DeepSpeed or a C++ compiler.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from safetensors.torch import load_file  # noqa: E402

import shardsafe  # noqa: E402
from dist_utils import HAVE_DEEPSPEED, TESTS_DIR, ScriptLaunch, assert_tensors_equal, launch_script, wait_for_scripts  # noqa: E402
from shardsafe.api.source import CheckpointSource  # noqa: E402
from shardsafe.errors import CheckpointNotFoundError, ModelFolderError  # noqa: E402
from shardsafe.hf.export import export_hf, iter_output  # noqa: E402
from shardsafe.manager.lease import LEASE_DIR

pytest_plugins = ["servers.fixtures"]  # hub_server, hub
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

SCRIPT = TESTS_DIR / "trainer_scripts" / "run_trainer.py"
DDP_SCENARIOS = ["plain", "main", "resume_mid", "resume_last", "rotation1", "rotation2", "push", "model_only"]
Z3_SCENARIOS = ["z3_plain", "z3_main", "z3_resume", "z3_nogather"]
LAUNCH_TIMEOUT_S = 600  # DeepSpeed's first start on a machine compiles an op (minutes on 2 cores)
REPO = "owner/trained"


@dataclass
class Runs:
    root: Path
    hub_files: dict[str, bytes]
    hub_commits: list[str]
    hub_url: str
    zero3: bool

    def result(self, name: str) -> dict[str, Any]:
        return json.loads((self.root / name / "result.json").read_text())

    def weights(self, name: str, file: str = "final") -> dict[str, torch.Tensor]:
        return load_file(self.root / name / f"{file}.safetensors")

    def train_dir(self, name: str) -> Path:
        return self.root / name / "train"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, hub_server: Any) -> Runs:
    root = tmp_path_factory.mktemp("trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_OFFLINE="1")
    env.update(hub_server.client_env(root / "hf-home"))
    env.pop("SHARDSAFE_CRASH_AT", None)
    env.pop("SHARDSAFE_FAIL_AT", None)
    hub_server.reset()
    launches = {"ddp": DDP_SCENARIOS}
    if HAVE_DEEPSPEED:
        launches["z3"] = Z3_SCENARIOS
    started = [
        launch_script(name, SCRIPT, 2, [str(root), *scenarios], cwd=root, env=env)
        for name, scenarios in launches.items()
    ]

    def errors(launch: ScriptLaunch) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(root.glob("*.error")))

    wait_for_scripts(started, time.monotonic() + LAUNCH_TIMEOUT_S, "trainer runs", errors)
    files = hub_server.files(REPO)  # kept now: other tests reset the server
    commits = [c.title for c in hub_server.commits(REPO)]
    return Runs(root, files, commits, hub_server.url, HAVE_DEEPSPEED)


def after(losses: dict[str, float], step: int) -> dict[str, float]:
    return {s: v for s, v in losses.items() if int(s) > step}


def no_leftovers(folder: Path) -> None:
    """No hidden temporaries (staging folders, interrupted saves) anywhere under ``folder``."""
    hidden = [p for p in folder.rglob(".*") if LEASE_DIR not in p.parts]  # the run's lease record is not a leftover
    assert hidden == [], hidden


def checkpoint_model(folder: Path) -> dict[str, torch.Tensor]:
    """The model a checkpoint holds, as export reads it (the tied head written once)."""
    with CheckpointSource(folder) as source:
        return {t.name: source.read(t.name) for t in source.tensors()}


def assert_same_model(stored: dict[str, torch.Tensor], final: dict[str, torch.Tensor], what: str) -> None:
    assert set(final) - set(stored) == {"lm_head.weight"}, what
    assert_tensors_equal(stored, {k: final[k] for k in stored}, what)


# ----------------------------------------------------------------------------- DDP


def test_ddp_final_weights_equal_the_plain_trainer_and_checkpoints_are_shardsafe(runs: Runs) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    main = runs.result("main")
    assert main["losses"] == runs.result("plain")["losses"]
    assert len(main["losses"]) == 6
    assert_tensors_equal(runs.weights("main"), runs.weights("plain"), "ShardsafeTrainer vs Trainer")
    train = runs.train_dir("main")
    assert main["after_train"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert get_last_checkpoint(str(train)) == str(train / "checkpoint-6")
    for step in (2, 4, 6):
        summary = shardsafe.verify(train / f"checkpoint-{step}")
        assert summary["world_size"] == 2
        assert summary["state_entries"] == ["data", "model", "optimizer", "rng", "scheduler", "trainer_files"]
        assert summary["metadata"]["shardsafe.trainer"]["step"] == step
    # the files the Trainer and exporters read, written next to the committed checkpoint; the model's own files are
    # those of the ranks the save gave model tensors to (the planner decides: small tensors may all go to rank 0)
    model_files = [name for name in main["checkpoint_2"] if name.startswith("model-0000")]
    assert [name for name in main["checkpoint_2"] if name not in model_files] == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors.index.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "state.json",
        "trainer_state.json",
        "training_args.json",
    ]
    index = json.loads((train / "checkpoint-2" / "model.safetensors.index.json").read_text())
    assert model_files and set(index["weight_map"].values()) == set(model_files) <= {
        "model-00000.safetensors",
        "model-00001.safetensors",
    }
    state = json.loads((train / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and [h["step"] for h in state["log_history"]] == [1, 2, 3, 4]
    # the last checkpoint holds the final model; export makes a from_pretrained folder of it
    final = runs.weights("main")
    assert_same_model(checkpoint_model(train / "checkpoint-6"), final, "checkpoint-6")
    no_leftovers(train)
    # every checkpoint is a from_pretrained folder: the model's tensors, written by both ranks, in model-0000r files
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(train / "checkpoint-6")
    assert_tensors_equal(
        {k: v.detach() for k, v in loaded.state_dict().items()}, final, "from_pretrained(checkpoint-6)"
    )


def test_resume_from_a_middle_checkpoint_and_from_the_newest(runs: Runs) -> None:
    main = runs.result("main")
    final = runs.weights("main")
    mid = runs.result("resume_mid")  # checkpoint-2: mid-epoch (batches skipped, then the RNG restored)
    assert after(mid["losses"], 2) == after(main["losses"], 2) and len(after(mid["losses"], 2)) == 4
    assert_tensors_equal(runs.weights("resume_mid"), final, "resumed at step 2")
    last = runs.result("resume_last")  # resume_from_checkpoint=True: checkpoint-4, the end of epoch 1
    assert after(last["losses"], 4) == after(main["losses"], 4) and len(after(last["losses"], 4)) == 2
    assert last["regenerated"], "trainer_state.json, deleted from checkpoint-4, was written again from its state.json"
    assert_tensors_equal(runs.weights("resume_last"), final, "resumed at step 4")
    assert sorted(p.name for p in runs.train_dir("resume_last").iterdir() if p.name != LEASE_DIR) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]


def test_rotation_keeps_the_best_and_the_newest(runs: Runs) -> None:
    one = runs.result("rotation1")
    assert one["after_each_save"] == [
        ["checkpoint-2"],
        ["checkpoint-2", "checkpoint-4"],
        ["checkpoint-2", "checkpoint-6"],
    ]
    assert one["final"] == ["checkpoint-2"], "as the Trainer: save_total_limit=1 leaves the best only at the end"
    assert Path(one["best"]).name == "checkpoint-2"
    two = runs.result("rotation2")
    assert two["after_each_save"][-1] == ["checkpoint-2", "checkpoint-8"] and two["final"] == [
        "checkpoint-2",
        "checkpoint-8",
    ]
    for name in ("rotation1", "rotation2"):
        train = runs.train_dir(name)
        # load_best_model_at_end loaded checkpoint-2's model
        final = runs.weights(name)
        assert_same_model(checkpoint_model(train / "checkpoint-2"), final, f"{name}: best model")
        for folder in train.iterdir():
            if folder.name != LEASE_DIR:
                shardsafe.verify(folder)
        no_leftovers(train)


def test_interrupted_rotation_leaves_no_half_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from shardsafe.integrations.transformers import checkpoint_steps, latest_checkpoint, rotate_checkpoints

    for step in (2, 4, 6):
        shardsafe.save(tmp_path / f"checkpoint-{step}", {"w": torch.full((3,), float(step))})
    (tmp_path / "checkpoint-8").mkdir()  # not written by shardsafe (no manifest): never deleted, never resumed from
    monkeypatch.setenv("SHARDSAFE_FAIL_AT", "retention:mid-delete")  # the disk fails after the manifest went
    with pytest.raises(OSError):
        rotate_checkpoints(tmp_path, 1, str(tmp_path / "checkpoint-4"))
    monkeypatch.delenv("SHARDSAFE_FAIL_AT")
    assert checkpoint_steps(tmp_path) == [4, 6], "checkpoint-2 stopped being a checkpoint in one rename"
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-6"
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-8"), (
        "transformers' choice: the highest number"
    )
    assert rotate_checkpoints(tmp_path, 1, str(tmp_path / "checkpoint-4")) == [], "the best and the newest stay"
    removed = shardsafe.collect_garbage(tmp_path)
    assert [Path(p).name.split(".shardsafe-deleting-")[0] for p in removed] == [".checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]


def test_save_model_ddp_writes_the_full_model_next_to_the_checkpoints(runs: Runs, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    main = runs.result("main")
    assert main["after_sharded_save"] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "config.json",
        "generation_config.json",
        *[f"model-0000{i}-of-00007.safetensors" for i in range(1, 8)],
        "model.safetensors.index.json",
        "training_args.json",
    ]
    # the next save (one file) replaced the sharded model: no stale shards or index remain
    assert main["after_single_save"] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "training_args.json",
    ]
    final = runs.weights("main")
    for folder in (runs.train_dir("main"), runs.root / "main" / "saved_again"):
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        assert loaded.dtype == torch.float32
        assert_tensors_equal(
            {k: v.detach() for k, v in loaded.state_dict().items()}, final, f"from_pretrained({folder.name})"
        )
        assert "lm_head.weight" not in dict(iter_output(folder)), "tied weights are written once, as transformers does"
    # a checkpoint exports to a from_pretrained folder (config.json is next to it)
    exported = export_hf(runs.train_dir("main") / "checkpoint-6", tmp_path / "exported", progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    assert_tensors_equal({k: v.detach() for k, v in loaded.state_dict().items()}, final, "exported checkpoint-6")


def test_save_only_model_checkpoints_hold_the_model_and_trainer_files(runs: Runs) -> None:
    folder = runs.train_dir("model_only") / "checkpoint-2"
    summary = shardsafe.verify(folder)
    assert summary["state_entries"] == ["model", "trainer_files"], "no optimizer, scheduler or RNG state"
    assert "trainer_state.json" in runs.result("model_only")["checkpoint_2"]
    assert_same_model(checkpoint_model(folder), runs.weights("model_only"), "save_only_model checkpoint-2")


def test_push_to_hub_pushes_the_trained_model(runs: Runs) -> None:
    assert runs.hub_commits == [
        "End of training",
        "Training in progress, step 4",
        "Training in progress, step 2",
        "initial commit",
    ]
    files = runs.hub_files
    assert not any(name.startswith("checkpoint-") for name in files), sorted(files)
    assert {"config.json", "model.safetensors", "training_args.json", "README.md"} <= set(files)
    from safetensors.torch import load as load_bytes

    pushed = load_bytes(files["model.safetensors"])
    final = runs.weights("push")
    assert_tensors_equal(pushed, {k: v for k, v in final.items() if k != "lm_head.weight"}, "pushed model")
    assert runs.result("push")["url"].startswith(f"{runs.hub_url}/{REPO}/commit/")


def test_push_to_hub_refuses_a_dummy_model(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ZeRO-3 save without gathering used to leave behind: the guard stops it before any upload."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardsafe.integrations.transformers import ShardsafeTrainer

    def dummy(self: Any, folder: Path) -> None:
        folder.mkdir()
        save_file({"transformer.wte.weight": torch.zeros(0)}, str(folder / "model.safetensors"))

    monkeypatch.setattr(ShardsafeTrainer, "_write_model_folder", dummy)
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], hub_model_id="owner/dummy")
    trainer = ShardsafeTrainer(
        model=GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=8, n_layer=1, n_head=2, n_positions=8)), args=args
    )
    with pytest.raises(ModelFolderError, match="empty"):
        trainer.push_to_hub()
    assert [c.title for c in hub.commits("owner/dummy")] == ["initial commit"], "nothing may be committed"
    assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")] == [], (
        "the staging folder is removed"
    )
    with pytest.raises(CheckpointNotFoundError, match="no committed shardsafe checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_save_model_refuses_the_zero3_dummy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed failure: config.json and a model.safetensors holding no tensors never lands in output_dir."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardsafe.integrations.transformers import ShardsafeTrainer

    config = GPT2Config(vocab_size=64, n_embd=8, n_layer=1, n_head=2, n_positions=8)

    def dummy(self: Any, folder: Path) -> None:
        folder.mkdir()
        config.save_pretrained(folder)
        save_file({}, str(folder / "model.safetensors"))  # an empty state dict saved as safetensors: 16 bytes

    monkeypatch.setattr(ShardsafeTrainer, "_write_model_folder", dummy)
    out = tmp_path / "out"
    trainer = ShardsafeTrainer(
        model=GPT2LMHeadModel(config), args=TrainingArguments(str(out), use_cpu=True, report_to=[])
    )
    with pytest.raises(ModelFolderError, match="holds no tensors: looks like a ZeRO-3 save without gathered weights"):
        trainer.save_model()
    assert not (out / "model.safetensors").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [] if out.exists() else True


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3


def zero3(runs: Runs) -> None:
    if not runs.zero3:
        pytest.skip("DeepSpeed and g++ are needed")


def test_zero3_checkpoints_resume_and_match_the_plain_trainer(runs: Runs, tmp_path: Path) -> None:
    zero3(runs)
    from transformers import AutoModelForCausalLM

    main = runs.result("z3_main")
    assert main["losses"] == runs.result("z3_plain")["losses"] and len(main["losses"]) == 6
    final = runs.weights("z3_main")
    assert {k.split("/")[0] for k in final} == {"w16", "w32"} and final[
        "w16/transformer.wte.weight"
    ].dtype == torch.bfloat16
    assert_tensors_equal(
        final, runs.weights("z3_plain"), "ShardsafeTrainer vs Trainer under ZeRO-3 (16-bit and fp32 master)"
    )
    train = runs.train_dir("z3_main")
    for step in (2, 4, 6):
        summary = shardsafe.verify(train / f"checkpoint-{step}")
        assert summary["state_entries"] == ["data", "engine", "rng", "scheduler", "trainer_files", "weights"]
        assert (train / f"checkpoint-{step}" / "trainer_state.json").is_file()
    # with stage3_gather_16bit_weights_on_model_save the checkpoint is a from_pretrained folder of the 16-bit model
    final16 = {k.split("/", 1)[1]: v for k, v in final.items() if k.startswith("w16/")}
    loaded16 = AutoModelForCausalLM.from_pretrained(train / "checkpoint-6", dtype=torch.bfloat16)
    assert_tensors_equal(
        {k: v.detach() for k, v in loaded16.state_dict().items()}, final16, "from_pretrained(ZeRO-3 checkpoint-6)"
    )
    resumed = runs.result("z3_resume")
    assert after(resumed["losses"], 2) == after(main["losses"], 2) and len(after(resumed["losses"], 2)) == 4
    assert_tensors_equal(runs.weights("z3_resume"), final, "ZeRO-3 resumed at step 2")
    no_leftovers(train)
    # `shardsafe export checkpoint-6`: the engine's flat fp32 master weights, reshaped, next to its config.json
    exported = export_hf(train / "checkpoint-6", tmp_path / "exported", progress=False)
    master = {k.split("/", 1)[1]: v for k, v in final.items() if k.startswith("w32/")}
    assert_tensors_equal(dict(iter_output(exported)), master, "exported ZeRO-3 checkpoint-6 vs the fp32 master weights")
    assert AutoModelForCausalLM.from_pretrained(exported).dtype == torch.float32


def test_zero3_save_model_gathered_equals_deepspeeds_16bit_model(runs: Runs) -> None:
    zero3(runs)
    from transformers import AutoModelForCausalLM

    main = runs.result("z3_main")
    train = runs.train_dir("z3_main")
    assert {"model.safetensors", "config.json", "training_args.json"} <= set(main["after_save"])
    ours = dict(iter_output(train))
    ds16 = runs.weights("z3_main", "ds16")  # engine.save_16bit_model, same trained state
    assert set(ds16) - set(ours) == {"lm_head.weight"}, (
        "DeepSpeed writes the tied head again; transformers and shardsafe once"
    )
    assert_tensors_equal(ours, {k: ds16[k] for k in ours}, "save_model vs save_16bit_model")
    assert ours["transformer.wte.weight"].dtype == torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(train)
    final16 = {k.split("/", 1)[1]: v for k, v in runs.weights("z3_main").items() if k.startswith("w16/")}
    assert_tensors_equal(
        {k: v.detach() for k, v in loaded.state_dict().items()},
        final16,
        "from_pretrained vs the engine's 16-bit weights",
    )


def test_zero3_save_model_without_gathering_writes_a_sharded_checkpoint(runs: Runs, tmp_path: Path) -> None:
    zero3(runs)
    from transformers import AutoModelForCausalLM

    result = runs.result("z3_nogather")
    train = runs.train_dir("z3_nogather")
    assert result["after_save"] == [
        "EXPORT.md",
        "checkpoint",
        "config.json",
        "generation_config.json",
        "training_args.json",
    ]
    assert not any(name.endswith((".safetensors", ".bin")) for name in result["after_save"]), (
        "no weights file, no dummy"
    )
    assert result["checkpoint_dir"] == [
        "manifest.json",
        "shard-00000.index.json",
        "shard-00000.safetensors",
        "shard-00001.index.json",
        "shard-00001.safetensors",
        "state.json",
    ]
    assert shardsafe.verify(train / "checkpoint")["world_size"] == 2
    master = {k.split("/", 1)[1]: v for k, v in runs.weights("z3_nogather").items() if k.startswith("w32/")}
    exported = export_hf(train, tmp_path / "exported", progress=False)  # what `shardsafe export` does
    assert_tensors_equal(dict(iter_output(exported)), master, "exported vs the fp32 master weights")
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, master["transformer.wte.weight"])
    # loadable as it is into a model, on one process
    model = AutoModelForCausalLM.from_config(loaded.config)
    shardsafe.load(train / "checkpoint", {"model": model})
    assert_tensors_equal({k: v.detach() for k, v in model.named_parameters()}, master, "loaded into a model")
