"""Attacker pass on ShardsafeTrainer's resume from a checkpoint whose ``model.safetensors`` was re-sharded in place
(integrations/transformers/resharded.py): a hostile or broken ``model.safetensors.index.json`` or weights file.

Each attack copies one real one-process ShardsafeTrainer checkpoint (trained once per module, then re-sharded by
huggingface_hub as transformers' tooling does), damages it, and expects a clear shardsafe error naming the file,
no model parameter changed, no view left next to the checkpoint and no file outside it touched.
The attacks the first pass found the code did not withstand (a raw JSON index parse, a NUL in a file name, a
shorter tensor, errors naming the removed view, non-canonical step names) are fixed; their tests stay.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_trainer_utils import small_trainer  # noqa: E402
from shardsafe.errors import FormatError, IntegrityError, ModelFolderError, ShardsafeError  # noqa: E402
from shardsafe.integrations.transformers.resharded import resharded_view  # noqa: E402

INDEX = "model.safetensors.index.json"
PREFIX = "model/"


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A one-process ShardsafeTrainer checkpoint whose model.safetensors was re-sharded in place (2 files + index),
    and the index's weight map."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("resharded") / "out"
    small_trainer(out, max_steps=1).train()
    folder = out / "checkpoint-1"
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_torch_state_dict(weights, folder, max_shard_size="4KB")  # huggingface_hub's own sharding
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2
    return folder, weight_map


def damaged(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path, damage: Callable[[Path, dict[str, Any]], None]
) -> Path:
    """A copy of the re-sharded checkpoint under ``tmp_path/run/``, its index (as a dict) and files changed by
    ``damage(folder, index)``; the index is written back afterwards."""
    folder = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(resharded[0], folder)
    index = json.loads((folder / INDEX).read_text())
    damage(folder, index)
    if not (folder / INDEX).is_symlink():
        (folder / INDEX).write_text(json.dumps(index))
    return folder


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every regular file under ``root`` (not following links): its mode and bytes, to show nothing was touched."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(root))] = (path.stat().st_mode, path.read_bytes())
    return found


def refused(folder: Path, error: type[BaseException], match: str) -> None:
    """``resharded_view(folder)`` raises ``error`` matching ``match``, creates no view, changes no file anywhere
    under the run's parent (the outside files included)."""
    root = folder.parent.parent
    before = snapshot(root)
    with pytest.raises(error, match=match) as caught:
        resharded_view(folder, PREFIX)
    assert isinstance(caught.value, ShardsafeError), f"not a shardsafe error: {caught.value!r}"
    assert not [p.name for p in folder.parent.iterdir() if ".view" in p.name], "no view left behind"
    assert snapshot(root) == before, "a file was changed"


def first(resharded: tuple[Path, dict[str, str]]) -> tuple[str, str]:
    name = sorted(resharded[1])[0]
    return name, resharded[1][name]


def copy_out(folder: Path, file: str) -> Path:
    """A copy of the checkpoint's intact ``file`` outside the checkpoint (next to the run folder)."""
    outside = folder.parent / "outside.safetensors"
    shutil.copy(folder / file, outside)
    return outside


def test_intact_resharded_checkpoint_gives_a_view(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """The control: the untouched copy yields a view (hard links + manifest), the checkpoint itself unchanged."""
    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    before = snapshot(folder)
    view = resharded_view(folder, PREFIX)
    assert view is not None and view.parent == folder.parent and view.name.startswith(".")
    assert sorted(p.name for p in view.iterdir()) == sorted(
        ["manifest.json", "state.json", "shard-00000.safetensors", *set(resharded[1].values())]
    )
    assert snapshot(folder) == before


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_index_naming_a_file_outside_is_refused(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path, how: str
) -> None:
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        outside = copy_out(folder, file)
        index["weight_map"][name] = "../outside.safetensors" if how == "relative" else str(outside)

    refused(damaged(resharded, tmp_path, damage), FormatError, "outside the checkpoint folder")


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_weights_file_that_is_a_symlink_is_refused(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path, target: str
) -> None:
    """A shard replaced by a symlink, to a copy outside the checkpoint or to another name inside it."""
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        real = copy_out(folder, file) if target == "outside" else folder / "copy.bin"
        if target == "inside":
            shutil.copy(folder / file, real)
        (folder / file).unlink()
        os.symlink(real if target == "outside" else real.name, folder / file)

    match = "outside the checkpoint folder" if target == "outside" else "symbolic link"
    refused(damaged(resharded, tmp_path, damage), FormatError, match)


def test_index_that_is_a_symlink_outside_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    def damage(folder: Path, index: dict[str, Any]) -> None:
        outside = folder.parent / "index.json"
        outside.write_text(json.dumps(index))
        (folder / INDEX).unlink()
        os.symlink(outside, folder / INDEX)

    refused(damaged(resharded, tmp_path, damage), FormatError, "outside the checkpoint folder")


@pytest.mark.parametrize(
    ("file", "error", "match"),
    [
        ("manifest.json", ModelFolderError, r"manifest\.json: not a safetensors file"),
        ("state.json", ModelFolderError, r"state\.json: not a safetensors file"),
        ("shard-00000.safetensors", IntegrityError, r"shard-00000\.safetensors: holds no "),
        (".", ModelFolderError, "not a regular file"),
        ("", ModelFolderError, "not a regular file"),
        ("a" * 5000 + ".safetensors", ModelFolderError, "cannot read the weights file"),
        ("model.safetensors", ModelFolderError, "weights file is missing"),
    ],
    ids=["manifest", "state", "own-shard", "dot", "empty", "long", "the-missing-file"],
)
def test_index_naming_a_file_that_is_no_weights_file_is_refused(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path, file: str, error: type[Exception], match: str
) -> None:
    name, _ = first(resharded)
    refused(
        damaged(resharded, tmp_path, lambda folder, index: index["weight_map"].__setitem__(name, file)), error, match
    )


def test_index_naming_a_fifo_does_not_hang(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    name, _ = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        os.mkfifo(folder / "fifo.safetensors")
        index["weight_map"][name] = "fifo.safetensors"

    refused(damaged(resharded, tmp_path, damage), ModelFolderError, "not a regular file")


def test_index_not_mapping_a_moved_tensor_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    name, _ = first(resharded)
    folder = damaged(resharded, tmp_path, lambda folder, index: index["weight_map"].pop(name))
    refused(folder, IntegrityError, rf"does not map {name}")


def test_index_without_weight_map_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    (folder / INDEX).write_text("[1, 2]")
    refused(folder, IntegrityError, rf"{INDEX}: no weight_map")


def test_index_that_is_not_json_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    (folder / INDEX).write_text("{not json")
    refused(folder, FormatError, INDEX)


def test_index_nested_too_deep_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    (folder / INDEX).write_text("[" * 100_000 + "]" * 100_000)
    refused(folder, FormatError, INDEX)


def test_index_with_duplicate_keys_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    name, _ = first(resharded)
    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    text = (folder / INDEX).read_text().replace('"weight_map": {', f'"weight_map": {{"{name}": "../x.safetensors", ')
    (folder / INDEX).write_text(text)
    refused(folder, FormatError, INDEX)


def test_index_naming_a_file_with_a_nul_byte_is_refused(resharded: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    name, _ = first(resharded)
    folder = damaged(resharded, tmp_path, lambda f, index: index["weight_map"].__setitem__(name, "a\x00b.safetensors"))
    refused(folder, FormatError, "null|NUL|a.b.safetensors")


@pytest.mark.stress
def test_index_larger_than_the_json_limit_is_refused_unread(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    from shardsafe.core.jsonsafe import MAX_JSON_BYTES

    folder = damaged(resharded, tmp_path, lambda folder, index: None)
    (folder / INDEX).unlink()
    with open(folder / INDEX, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    refused(folder, FormatError, "more than")


def test_a_weight_map_of_200000_names_is_parsed_within_its_bytes(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """Names of tensors the checkpoint does not hold are not looked at: only the moved tensors are resolved."""
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        index["weight_map"].update({f"junk.{i}.weight": "../outside.safetensors" for i in range(200_000)})

    folder = damaged(resharded, tmp_path, damage)
    view = resharded_view(folder, PREFIX)
    assert view is not None and (view / file).is_file() and not (view / "outside.safetensors").exists()


def _rewrite_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_weights_header_claiming_a_huge_shape_is_refused(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        _rewrite_header(folder / file, lambda header: header[name].__setitem__("shape", [1 << 40, 1 << 20]))

    refused(damaged(resharded, tmp_path, damage), ModelFolderError, rf"{file}.*do not fit its shape")


# ---------------------------------------------------------------- through the Trainer: the view is loaded and checked


def resume_refused(folder: Path, error: type[BaseException], match: str) -> None:
    """A new ShardsafeTrainer's resume from ``folder`` raises ``error``: no parameter changed, the view removed,
    the checkpoint's files unchanged."""
    trainer = small_trainer(folder.parent, max_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    files = snapshot(folder)
    with pytest.raises(error, match=match):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in before.items()), "nothing loaded"
    assert not [p.name for p in folder.parent.iterdir() if ".view" in p.name], "the view is removed"
    assert snapshot(folder) == files


def _replace_tensor(path: Path, name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors[name] = make(tensors[name])
    save_file(tensors, path)


def test_resume_refuses_another_tensor_of_the_same_name_in_the_other_file(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The same tensor name in both weights files (zeros in the second) and the index pointing there: the
    committed hashes refuse it."""
    name, file = first(resharded)
    other = next(f for f in set(resharded[1].values()) if f != file)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / other)
        tensors[name] = torch.zeros_like(load_file(folder / file)[name])
        save_file(tensors, folder / other)
        index["weight_map"][name] = other

    resume_refused(damaged(resharded, tmp_path, damage), IntegrityError, "hash mismatch")


def test_resume_refuses_the_same_bytes_under_another_dtype(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        _replace_tensor(folder / file, name, lambda t: t.view(torch.int32).clone())

    # refused before the view is built, naming the file, both dtypes and the remedy
    resume_refused(damaged(resharded, tmp_path, damage), IntegrityError, rf"checkpoint-1/{file}: .*int32.*restore")


def test_resume_refuses_a_shorter_tensor_naming_the_file(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        _replace_tensor(folder / file, name, lambda t: t.flatten()[:2].clone())

    resume_refused(damaged(resharded, tmp_path, damage), ShardsafeError, rf"checkpoint-1/{file}")


def test_resume_refuses_a_changed_byte_naming_the_checkpoints_file(
    resharded: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    name, file = first(resharded)

    def damage(folder: Path, index: dict[str, Any]) -> None:
        data = bytearray((folder / file).read_bytes())
        data[-1] ^= 0xFF
        (folder / file).write_bytes(bytes(data))

    resume_refused(damaged(resharded, tmp_path, damage), IntegrityError, rf"/checkpoint-1/{file}")
