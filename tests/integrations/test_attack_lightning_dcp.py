"""Attacker pass on resuming from Lightning's own ModelParallelStrategy checkpoints (DCP items + ``meta.pt``) through
:class:`LightningCheckpoints` (integrations/lightning/checkpoints.py), one process.

The folder is written as Lightning writes it (``dcp.save`` of ``state_dict`` / ``optimizer_0``, ``torch.save`` of the
rest as ``meta.pt``), then made hostile: pickles that would run code, globals off the allow-list, truncated or
garbage files, missing or symlinked items, ``.metadata`` pointing out of the folder. Each must raise a shardsafe
error naming the file, run nothing, and leave the model and optimizer as they were.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

pytest.importorskip("lightning")

from shardsafe.errors import CheckpointNotFoundError, FormatError, ShardsafeError  # noqa: E402
from shardsafe.integrations.lightning.checkpoints import LightningCheckpoints  # noqa: E402

MARK = "pwned"  # a file the hostile pickles would create if their code ran


class RunsCode:
    """Pickles as a call of ``func(arg)`` (what a hostile ``meta.pt`` holds)."""

    def __init__(self, func: Any, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.func, (self.arg,)


def trained(seed: int) -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def lightning_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What Lightning's ModelParallelStrategy.save_checkpoint writes (one rank)."""
    folder = tmp_path_factory.mktemp("lightning_dcp") / "last.ckpt"
    model, optimizer = trained(0)
    dcp.save(
        {"state_dict": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=str(folder),
    )
    torch.save({"epoch": 1, "global_step": 3, "loops": {"seen": torch.tensor([1.0])}}, folder / "meta.pt")
    return folder


def attacked(lightning_folder: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    folder = tmp_path / "run" / "last.ckpt"
    shutil.copytree(lightning_folder, folder)
    damage(folder)
    return folder


def load_refused(folder: Path, error: type[BaseException], match: str) -> None:
    """The load raises ``error`` (a shardsafe error) matching ``match``; nothing ran, the model and the optimizer
    are unchanged."""
    model, optimizer = trained(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    with pytest.raises(error, match=match) as caught:
        LightningCheckpoints().load(folder, model, [optimizer])
    assert isinstance(caught.value, ShardsafeError), f"not a shardsafe error: {caught.value!r}"
    assert not (folder.parent / MARK).exists(), "code from the checkpoint ran"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "the model was modified"
    assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in moments.items()), "optimizer modified"


def test_intact_folder_loads(lightning_folder: Path, tmp_path: Path) -> None:
    """The control: the model bit-exact, meta.pt's entries returned."""
    model, optimizer = trained(1)
    rest = LightningCheckpoints().load(attacked(lightning_folder, tmp_path, lambda f: None), model, [optimizer])
    assert torch.equal(model.weight, trained(0)[0].weight)
    assert rest["global_step"] == 3 and torch.equal(rest["loops"]["seen"], torch.tensor([1.0]))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (RunsCode(os.system, f"touch {MARK}"), "global 'posix.system' is not allowed"),
        (RunsCode(eval, f"open('{MARK}', 'w')"), "global '__builtin__.eval' is not allowed"),
        (collections.Counter(a=1), "global 'collections.Counter' is not allowed"),
        (torch.zeros(1).expand(1 << 20), "not a contiguous tensor"),
    ],
    ids=["os.system", "builtins.eval", "not-allowlisted", "broadcast-tensor"],
)
def test_meta_pt_with_a_hostile_pickle_is_refused(
    lightning_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any, match: str
) -> None:
    folder = attacked(lightning_folder, tmp_path, lambda f: torch.save({"epoch": 1, "x": value}, f / "meta.pt"))
    monkeypatch.chdir(folder.parent)  # where MARK would appear
    load_refused(folder, FormatError, rf"meta\.pt: refused pickle: {match}|meta\.pt: .*{match}")


def _rewrite_pickle(path: Path, change: Callable[[bytes], bytes]) -> None:
    """``path`` (a torch.save archive) with its data.pkl replaced by ``change(data.pkl)``, the rest kept."""
    with zipfile.ZipFile(path) as archive:
        records = {name: archive.read(name) for name in archive.namelist()}
    name = next(n for n in records if n.endswith("data.pkl"))
    records[name] = change(records[name])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for key, data in records.items():
            archive.writestr(key, data)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), r"meta\.pt: not a readable zip archive"),
        (lambda p: _rewrite_pickle(p, lambda d: d[: len(d) // 2]), r"meta\.pt: not a readable pickle stream"),
        (lambda p: p.write_bytes(pickle.dumps({"epoch": 1})), r"meta\.pt: not in torch's zip format"),
        (
            lambda p: _rewrite_pickle(p, lambda d: b"\x80\x02}X\x01\x00\x00\x00a" + b"]" * 5000 + b"a" * 4999 + b"s."),
            r"meta\.pt: refused pickle: values nested more than",
        ),
        (lambda p: torch.save([1, 2], p), r"meta\.pt: not a dict"),
    ],
    ids=["truncated-archive", "truncated-pickle", "plain-pickle", "nested-5000-deep", "not-a-dict"],
)
def test_meta_pt_malformed_is_refused(
    lightning_folder: Path, tmp_path: Path, damage: Callable[[Path], None], match: str
) -> None:
    load_refused(attacked(lightning_folder, tmp_path, lambda f: damage(f / "meta.pt")), FormatError, match)


def test_meta_pt_whose_shared_values_expand_beyond_the_limit_is_refused(lightning_folder: Path, tmp_path: Path) -> None:
    """A 1.4 kB pickle of a list holding itself twice, 60 levels down (2**60 values when walked)."""
    bomb: list[Any] = []
    for _ in range(60):
        bomb = [bomb, bomb]
    folder = attacked(lightning_folder, tmp_path, lambda f: torch.save({"x": bomb}, f / "meta.pt"))
    load_refused(folder, FormatError, r"meta\.pt: refused pickle: shared values expand")


def test_meta_pt_symlink_is_refused(lightning_folder: Path, tmp_path: Path) -> None:
    def damage(folder: Path) -> None:
        outside = folder.parent / "outside.pt"
        shutil.move(folder / "meta.pt", outside)
        os.symlink(outside, folder / "meta.pt")

    load_refused(attacked(lightning_folder, tmp_path, damage), FormatError, r"meta\.pt: is a symbolic link")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes(range(256)) * 2, r"\.metadata: (refused pickle|not a readable pickle stream)"),
        (pickle.dumps(RunsCode(os.system, f"touch {MARK}")), r"\.metadata: refused pickle: global 'posix.system'"),
        (b"", r"\.metadata: not a readable pickle stream"),
    ],
    ids=["garbage", "os.system", "empty"],
)
def test_dcp_metadata_malformed_is_refused(lightning_folder: Path, tmp_path: Path, data: bytes, match: str) -> None:
    folder = attacked(lightning_folder, tmp_path, lambda f: (f / ".metadata").write_bytes(data))
    load_refused(folder, FormatError, match)


def test_dcp_item_missing_is_refused(lightning_folder: Path, tmp_path: Path) -> None:
    folder = attacked(lightning_folder, tmp_path, lambda f: (f / "__0_0.distcp").unlink())
    load_refused(folder, CheckpointNotFoundError, r"__0_0\.distcp: missing \(named by .*\.metadata\)")


def test_dcp_item_truncated_is_refused(lightning_folder: Path, tmp_path: Path) -> None:
    def damage(folder: Path) -> None:
        item = folder / "__0_0.distcp"
        item.write_bytes(item.read_bytes()[:-10])

    load_refused(attacked(lightning_folder, tmp_path, damage), FormatError, r"__0_0\.distcp, which holds")


def test_dcp_item_symlink_is_refused(lightning_folder: Path, tmp_path: Path) -> None:
    def damage(folder: Path) -> None:
        outside = folder.parent / "outside.distcp"
        shutil.move(folder / "__0_0.distcp", outside)
        os.symlink(outside, folder / "__0_0.distcp")

    load_refused(attacked(lightning_folder, tmp_path, damage), FormatError, r"__0_0\.distcp: not a regular file")


def _storage_paths(folder: Path, path: str) -> None:
    """``.metadata`` rewritten so every item is read from ``path`` (written by this test, so plain pickle is fine)."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - the test's own file
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=path) for k, v in metadata.storage_data.items()}
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE", ".metadata", "sub/x.distcp"])
def test_dcp_metadata_naming_a_file_out_of_the_folder_is_refused(
    lightning_folder: Path, tmp_path: Path, where: str
) -> None:
    def damage(folder: Path) -> None:
        shutil.copy(folder / "__0_0.distcp", folder.parent / "outside.distcp")
        _storage_paths(folder, str(folder.parent / "outside.distcp") if where == "ABSOLUTE" else where)

    load_refused(attacked(lightning_folder, tmp_path, damage), FormatError, "not a .distcp file of the folder")
