"""What the CLI prints: one size formatter, counts that agree between commands, natural key order,
plural forms, escaped names, and the error boundary's rule for unexpected exceptions.

In process (``cli.main`` with pytest's capture); test_cli.py and test_cli_hostile.py run the same
commands in subprocesses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.cli import main as cli
from shardsafe.cli.formatting import format_bytes, natural_key, plural, printable, table
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import CheckpointNotFoundError, FormatError
from shardsafe.protocol.commit import open_checkpoint


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve layers (keys model/0 .. model/11) and an entry holding one tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(12)))
    path = tmp_path_factory.mktemp("out") / "layered"
    shardsafe.save(path, {"model": model, "one": torch.ones(3)})
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_lists_keys_in_natural_order(layered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["inspect", str(layered)], capsys)
    assert code == 0
    shown = [line.split()[0] for line in out.splitlines() if line.strip().startswith("model/")]
    assert shown == [f"model/{i}.weight" for i in range(12)]
    code, out, _ = run(["inspect", str(layered), "--json"], capsys)
    keys = [t["key"] for t in json.loads(out)["tensors"]]
    assert keys == [
        "model/0.weight",
        "model/1.weight",
        "model/2.weight",
        *[f"model/{i}.weight" for i in range(3, 12)],
        "one",
    ]


def test_inspect_and_verify_count_files_alike(layered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both say 3 files, one of them a shard file (the one verify hashes); no "1 files" anywhere."""
    _, inspected, _ = run(["inspect", str(layered)], capsys)
    _, verified, _ = run(["verify", str(layered)], capsys)
    manifest, _ = open_checkpoint(layered)
    assert f"in 3 files: 1 shard file ({format_bytes(manifest.total_bytes)}), state.json, manifest.json (" in inspected
    assert "files (3)" in inspected
    assert ": 3 files checked (1 shard file, the state file and the manifest), 13 tensors, " in verified
    assert "1 tensor, 12 B" in inspected  # the entry "one"; and "12 tensors" for the model
    assert "12 tensors, 192 B" in inspected
    for text in (inspected, verified):
        assert not re.search(r"\b1 (files|tensors|ranks|fields|shard files)\b", text), text
    info = json.loads(run(["inspect", str(layered), "--json"], capsys)[1])
    assert [f["kind"] for f in info["files"]] == ["shard", "state", "manifest"] and info["shard_files"] == 1


def test_list_and_inspect_print_sizes_with_one_formatter(
    layered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    import shutil

    shutil.copytree(layered, root / "step-0000000003")
    manifest, _ = open_checkpoint(layered)
    _, listed, _ = run(["list", str(root)], capsys)
    _, inspected, _ = run(["inspect", str(layered)], capsys)
    shard = next(iter(manifest.files))
    assert f"  {format_bytes(manifest.total_bytes)}  " in listed
    # the size list gives, shown by inspect too
    assert f"1 shard file ({format_bytes(manifest.total_bytes)})" in inspected
    assert re.search(rf"{re.escape(shard)} +0 +{re.escape(format_bytes(manifest.files[shard].size))}$", inspected, re.M)


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1, 999, 1000, 1_234_567, 10**18)] == [
        "0 B",
        "1 B",
        "999 B",
        "1.0 kB",
        "1.2 MB",
        "1.0 EB",
    ]
    # Sizes read from a hostile manifest: beyond a float's range, negative, not finite; never an exception.
    assert format_bytes(10**400) == "~1e400 B"
    assert format_bytes(-(10**30)) == "-~1e30 B"
    assert format_bytes(-5) == "-5 B"
    assert format_bytes(float("nan")) == "nan B" and format_bytes(float("inf")) == "inf B"


def test_plural_and_natural_key() -> None:
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    names = ["layer.10.w", "layer.2.w", "b", "layer.1", "a10", "a9", "10", "9", "a"]
    assert sorted(names, key=natural_key) == ["9", "10", "a", "a9", "a10", "b", "layer.1", "layer.2.w", "layer.10.w"]


def test_printable_escapes_what_acts_on_a_terminal() -> None:
    hostile = "a\x1b[2J\u202eb\ud800\r\x07c\x9b"
    assert printable(hostile) == "a\\x1b[2J\\u202eb\\ud800\\x0d\\x07c\\x9b"
    assert printable("one\n\ttwo") == "one\\x0a\\x09two"
    assert printable("one\n\ttwo", newlines=True) == "one\n\ttwo"
    assert printable("ünïcödé 名前 🙂") == "ünïcödé 名前 🙂"
    assert table(["k"], [["x\x1b"]]) == ["  k", "  x\\x1b"]


def test_stdout_of_every_command_is_escaped(layered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The boundary escapes what a command prints even where the command itself does not (list's metrics)."""
    import shutil

    root = tmp_path / "root"
    folder = root / "step-0000000001"
    shutil.copytree(layered, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["metadata"] = {"shardsafe.manager": {"step": 1, "metrics": {"loss\x1b[2J\r": 0.5}}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = run(["list", str(root)], capsys)
    assert code == 0 and "loss\\x1b[2J\\x0d=0.5" in out and "\x1b" not in out and "\r" not in out


def test_state_entry_names_and_values_are_escaped(
    layered: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(layered, folder)
    state = json.loads((folder / "state.json").read_text())
    state["\x1b]0;title\x07"] = {"kind": "value", "state": "\u202e\x1b[31m"}
    data = json.dumps(state).encode()
    (folder / "state.json").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["state"].update(size=len(data), hash=hash_bytes(data))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = run(["inspect", str(folder)], capsys)
    assert code == 0
    assert "\\x1b]0;title\\x07  value" in out and '"\\u202e\\u001b[31m"' in out
    assert not set(out) & {"\x1b", "\x07", "\u202e"}


def test_error_boundary_rule(tmp_path: Path) -> None:
    """Shardsafe and OS errors print their message; anything else is an internal error naming the place."""
    assert cli.describe_error(
        FormatError("x/manifest.json: field 'world_size' has the wrong type (str)"), "inspect"
    ) == ("x/manifest.json: field 'world_size' has the wrong type (str)")
    try:
        open(tmp_path / "missing")
    except OSError as exc:
        assert cli.describe_error(exc, "verify") == f"[Errno 2] No such file or directory: '{tmp_path / 'missing'}'"
    try:
        format_bytes("12")  # type: ignore[arg-type]
    except TypeError as exc:
        text = cli.describe_error(exc, "list")
    assert text.startswith("list: internal error TypeError: ")
    assert re.search(
        r"\(at shardsafe/cli/formatting\.py:\d+\); please report it \(SHARDSAFE_DEBUG=1 shows the traceback\)$", text
    ), text
    long = ValueError("line one\nline two \x1b[2J " + "x" * 500)
    text = cli.describe_error(long, "inspect")
    assert "line one line two \\x1b[2J xxx" in text and "\n" not in text and len(text) < 300


def test_debug_switch_re_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    assert cli.main(["inspect", str(missing)]) == 1
    assert capsys.readouterr().err == f"error: {missing}: no such checkpoint folder\n"
    monkeypatch.setenv("SHARDSAFE_DEBUG", "1")
    with pytest.raises(CheckpointNotFoundError):
        cli.main(["inspect", str(missing)])
    monkeypatch.setenv("SHARDSAFE_DEBUG", "0")
    assert cli.main(["inspect", str(missing)]) == 1


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect"], ["nonsense"], ["demo", "--steps", "0"], ["demo", "--nproc", "x" * 5000]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert "error:" in capsys.readouterr().err
