"""Attacker pass on resuming from torchtitan's DCP manager folders (integrations/torchtitan/dcp_folders.py), one
process: which ``step-<N>`` names are taken for checkpoints, and hostile ``.metadata`` / pickled values / items
inside one. Each refusal must be a shardsafe error naming the file, with nothing run and the model unchanged.
The folder is written as the DCP manager writes it (``dcp.save`` of the flattened model, ``train_state`` and the
pickled ``dataloader``)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

pytest.importorskip("torchtitan")

from shardsafe.errors import CheckpointNotFoundError, FormatError, ShardsafeError  # noqa: E402
from shardsafe.integrations.torchtitan.dcp_folders import dcp_manager_steps, load_dcp_manager_folder  # noqa: E402

MARK = "pwned"


class RunsCode:
    """Pickles as ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))


def write_step(folder: Path, train_state: Any = 4, dataloader: Any = None) -> None:
    """A DCP manager's step folder: the model flattened to the top level, its train_state and dataloader."""
    state: dict[str, Any] = {**model(0).state_dict(), "train_state": {"step": train_state}}
    if dataloader is not None:
        state["dataloader"] = {"dp_rank_0": dataloader}
    dcp.save(state, checkpoint_id=str(folder))


@pytest.fixture(scope="module")
def step_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dcp_manager") / "step-4"
    write_step(folder)
    return folder


def copied(step_folder: Path, tmp_path: Path, damage: Callable[[Path], None] = lambda f: None) -> Path:
    folder = tmp_path / "ckpt" / "step-4"
    shutil.copytree(step_folder, folder)
    damage(folder)
    return folder


def load(folder: Path, seed: int = 1) -> torch.nn.Sequential:
    loaded = model(seed)
    load_dcp_manager_folder(folder, {"model": loaded}, loaded, None)
    return loaded


def load_refused(folder: Path, error: type[BaseException], match: str) -> None:
    target = model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(error, match=match) as caught:
        load_dcp_manager_folder(folder, {"model": target}, target, None)
    assert isinstance(caught.value, ShardsafeError), f"not a shardsafe error: {caught.value!r}"
    assert not (folder.parent / MARK).exists(), "code from the checkpoint ran"
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items()), "the model was modified"


def test_intact_folder_loads(step_folder: Path, tmp_path: Path) -> None:
    assert torch.equal(load(copied(step_folder, tmp_path))[0].weight, model(0)[0].weight)


# ---------------------------------------------------------------------------------------------- step folder names


def _copy_as(step_folder: Path, folder: Path) -> None:
    shutil.copytree(step_folder, folder)


def test_names_that_are_not_steps_are_passed_over(step_folder: Path, tmp_path: Path) -> None:
    """Only ``step-<digits>`` folders holding a DCP checkpoint count; a symlinked step folder (to a checkpoint
    outside) is not followed; a file or an empty folder named as a step is none."""
    root = tmp_path / "ckpt"
    _copy_as(step_folder, root / "step-4")
    for name in ["step-1e9", "step--1", "step-+3", "step-4 ", "step-", "step-0x10", "Step-5", "step-6.bak"]:
        _copy_as(step_folder, root / name)
    _copy_as(step_folder, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "step-99")
    (root / "step-98").write_bytes(b"")
    (root / "step-97").mkdir()
    assert dcp_manager_steps(str(root)) == {4: root / "step-4"}
    assert dcp_manager_steps(str(tmp_path / "missing")) == {} and dcp_manager_steps("s3://bucket/ckpt") == {}


def test_only_names_the_dcp_manager_writes_are_steps(step_folder: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _copy_as(step_folder, root / "step-4")
    _copy_as(step_folder, root / "step-01")
    _copy_as(step_folder, root / "step-\u0661\u0660")
    assert dcp_manager_steps(str(root)) == {4: root / "step-4"}


def test_step_folder_with_a_symlinked_metadata_is_refused(step_folder: Path, tmp_path: Path) -> None:
    def damage(folder: Path) -> None:
        shutil.move(folder / ".metadata", folder.parent / "outside.metadata")
        os.symlink(folder.parent / "outside.metadata", folder / ".metadata")

    load_refused(copied(step_folder, tmp_path, damage), FormatError, r"\.metadata: cannot be opened")


# ------------------------------------------------------------------------------------------- pickled values inside


def test_hostile_train_state_value_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-tensor value (DCP pickles it into the .distcp item) whose pickle would run os.system."""
    folder = tmp_path / "ckpt" / "step-6"
    write_step(folder, train_state=RunsCode(f"touch {MARK}"))
    monkeypatch.chdir(folder.parent)
    load_refused(folder, FormatError, r"__0_0\.distcp \(value 'train_state\.step'\): refused pickle: global 'posix")


def test_hostile_dataloader_state_is_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DCP manager pickles the loader's state; shardsafe never reads it (not even restricted): the rest loads."""
    folder = tmp_path / "ckpt" / "step-6"
    write_step(folder, dataloader=RunsCode(f"touch {MARK}"))
    monkeypatch.chdir(folder.parent)
    loaded = model(1)
    load_dcp_manager_folder(folder, {"model": loaded, "dataloader": object()}, loaded, None)
    assert torch.equal(loaded[0].weight, model(0)[0].weight) and not (folder.parent / MARK).exists()


# ---------------------------------------------------------------------------------------------- .metadata, items


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x00" * 100, r"\.metadata: not a readable pickle stream"),
        (pickle.dumps(RunsCode(f"touch {MARK}")), r"\.metadata: refused pickle: global 'posix.system'"),
        (b"", r"\.metadata: not a readable pickle stream"),
    ],
    ids=["garbage", "os.system", "empty"],
)
def test_metadata_malformed_is_refused(
    step_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, match: str
) -> None:
    folder = copied(step_folder, tmp_path, lambda f: (f / ".metadata").write_bytes(data))
    monkeypatch.chdir(folder.parent)
    load_refused(folder, FormatError, match)


def test_item_missing_is_refused(step_folder: Path, tmp_path: Path) -> None:
    folder = copied(step_folder, tmp_path, lambda f: (f / "__0_0.distcp").unlink())
    load_refused(folder, CheckpointNotFoundError, r"__0_0\.distcp: missing")


def _metadata(folder: Path, change: Callable[[Any], None]) -> None:
    """Rewrite the test's own ``.metadata`` (plain pickle: written by this test)."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - the test's own file
    change(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE", ".metadata", "sub/x.distcp"])
def test_metadata_naming_a_file_out_of_the_folder_is_refused(step_folder: Path, tmp_path: Path, where: str) -> None:
    def damage(folder: Path) -> None:
        outside = folder.parent / "outside.distcp"
        shutil.copy(folder / "__0_0.distcp", outside)
        path = str(outside) if where == "ABSOLUTE" else where

        def change(metadata: Any) -> None:
            metadata.storage_data = {
                k: dataclasses.replace(v, relative_path=path) for k, v in metadata.storage_data.items()
            }

        _metadata(folder, change)

    load_refused(copied(step_folder, tmp_path, damage), FormatError, "not a .distcp file of the folder")


def _huge(metadata: Any, chunk_too: bool) -> None:
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    entry = metadata.state_dict_metadata[key]
    huge = torch.Size([1 << 40, 1 << 20])
    chunks = [dataclasses.replace(entry.chunks[0], sizes=huge)] if chunk_too else entry.chunks
    metadata.state_dict_metadata[key] = dataclasses.replace(entry, size=huge, chunks=chunks)


@pytest.mark.parametrize(
    ("chunk_too", "match"),
    [(False, r"\.metadata: tensor '0\.weight' .*its chunks hold"), (True, r"\.metadata: tensor '0\.weight': a chunk")],
    ids=["tensor", "tensor-and-chunk"],
)
def test_metadata_claiming_a_huge_shape_is_refused_unallocated(
    step_folder: Path, tmp_path: Path, chunk_too: bool, match: str
) -> None:
    folder = copied(step_folder, tmp_path, lambda f: _metadata(f, lambda m: _huge(m, chunk_too)))
    load_refused(folder, FormatError, match)


def test_manager_resume_from_a_hostile_dcp_folder_is_refused(
    step_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the entry point torchtitan calls: ShardsafeCheckpointManager.load finds the DCP manager's newest
    step-<N> (no shardsafe checkpoint in the folder) and refuses its code-running .metadata; nothing ran, the model
    is unchanged, nothing was written into the folder but the run's lease."""
    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

    folder = copied(
        step_folder, tmp_path, lambda f: (f / ".metadata").write_bytes(pickle.dumps(RunsCode("touch pwned")))
    )
    monkeypatch.chdir(folder.parent)
    target = model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    config = ShardsafeCheckpointManager.Config(enable=True, folder="ckpt", interval=1)
    manager = config.build(
        dataloader=None,
        model_parts=[target],
        optimizers=torch.optim.Adam(target.parameters()),
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    try:
        with pytest.raises(FormatError, match=r"step-4/\.metadata: refused pickle: global 'posix.system'"):
            manager.load(step=-1)
    finally:
        manager.close()
    assert not (folder.parent / MARK).exists()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    assert sorted(p.name for p in folder.parent.iterdir() if p.name != ".shardsafe-lease") == ["step-4"]
