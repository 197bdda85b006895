"""Format parsers on good and hostile input, in one process."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from safetensors import safe_open
from torch import nn

import shardsafe
from shardsafe.core.format import HeaderEntry, build_safetensors_header, parse_manifest, parse_safetensors_header
from shardsafe.core.plan import contiguous_span
from shardsafe.errors import CheckpointNotFoundError, FormatError, IntegrityError


def _saved(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    path = shardsafe.save(tmp_path / "ck", {"model": model, "note": "hi"})
    return path, model


def _rewrite_manifest(path: Path, edit) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    edit(raw)
    (path / "manifest.json").write_text(json.dumps(raw))


def test_shard_files_are_readable_by_safetensors(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    with safe_open(str(path / "shard-00000.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {f"model/{k}" for k in model.state_dict()}
        for key, value in model.state_dict().items():
            assert torch.equal(f.get_tensor(f"model/{key}"), value)


def test_header_round_trip_and_alignment() -> None:
    entries = [
        HeaderEntry("a", torch.float32, (3, 2)),
        HeaderEntry("b", torch.bfloat16, (5,)),
        HeaderEntry("c", torch.int64, ()),
    ]
    prefix, ranges = build_safetensors_header(entries)
    assert len(prefix) % 8 == 0
    size = ranges[-1][1]
    parsed = parse_safetensors_header(prefix, size, "mem")
    assert [parsed[e.name][2:] for e in entries] == ranges
    assert parsed["b"][0] == torch.bfloat16 and parsed["c"][1] == ()


@pytest.mark.parametrize(
    "header, message",
    [
        (struct.pack("<Q", 10**9) + b"{}", "larger than the file"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (struct.pack("<Q", 9) + b'{"a":1,"a', "not valid JSON"),
        (struct.pack("<Q", 54) + b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}', "do not fit"),
    ],
)
def test_hostile_safetensors_headers(header: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        parse_safetensors_header(header, len(header) + 8, "hostile.safetensors")


def _manifest_bytes(tmp_path: Path) -> bytes:
    path, _ = _saved(tmp_path)
    return (path / "manifest.json").read_bytes()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(file="../../etc/passwd"), "unsafe"),
        (lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(file="/etc/passwd"), "unsafe"),
        (lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(end=10**12), "does not hold"),
        (lambda m: m["tensors"]["model/0.weight"].update(shape=[10**9, 10**9]), "absurdly large|elements"),
        (lambda m: m["tensors"]["model/0.weight"].update(dtype="float128"), "unknown dtype"),
        (lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(offsets=[3, 0]), "outside"),
        (lambda m: m.update(format_version=99), "newer than"),
        (lambda m: m.update(format="pickle"), "not a shardsafe manifest"),
        (lambda m: m["files"].update({"x/../y": {"size": 1, "rank": 0}}), "unsafe"),
        (
            lambda m: m["tensors"]["model/0.weight"]["chunks"].append(
                dict(m["tensors"]["model/0.weight"]["chunks"][0])
            ),
            "elements",
        ),
        (lambda m: m.update(hash_block_size=2048), "not a power of two between"),
        (lambda m: m.update(hash_block_size=(1 << 20) + 4096), "not a power of two between"),
        (lambda m: m.update(hash_block_size=1 << 31), "not a power of two between"),
        (
            lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(checkpoint=".step-1.shardsafe-tmp-abc"),
            "hidden folder",
        ),
        (lambda m: m["tensors"]["model/0.weight"]["chunks"][0].update(checkpoint="a/b"), "unsafe"),
        (lambda m: m["tensors"].update({"model/copy": m["tensors"]["model/0.weight"]}), "claim the same bytes"),
        (lambda m: m["tensors"].update({"__metadata__": m["tensors"].pop("model/0.weight")}), "invalid tensor key"),
        (lambda m: m["tensors"].update({"": m["tensors"].pop("model/0.weight")}), "invalid tensor key"),
        # the files section's one-pass checks (core/format._parse_files) refuse what the per-entry checks do
        (lambda m: m["files"].update({"..": {"size": 1, "rank": 0}}), "unsafe"),
        (lambda m: m["files"].update({"~x": {"size": 1, "rank": 0}}), "unsafe"),
        (lambda m: m["files"].update({"a\nb/c": {"size": 1, "rank": 0}}), "unsafe"),
        (lambda m: m["files"].update({"x": {"size": -1, "rank": 0}}), "negative size"),
        (lambda m: m["files"].update({"x": {"size": True, "rank": 0}}), "wrong type"),
        (
            lambda m: m["files"].update(
                {"x": {"size": 1, "rank": 0, "index": {"file": "../x.index.json", "size": 1, "hash": "0"}}}
            ),
            "unsafe",
        ),
        (
            lambda m: m["files"].update(
                {"x": {"size": 1, "rank": 0, "index": {"file": "x.json", "size": 1, "hash": "0"}}}
            ),
            "must be named",
        ),
        (
            lambda m: m["files"].update(
                {"x": {"size": 1, "rank": 0, "index": {"file": "x.index.json", "size": -1, "hash": "0"}}}
            ),
            "must be named",
        ),
        # depth: checked where the manifest keeps free-form values (metadata)
        (
            lambda m: m.update(
                metadata={"deep": __import__("functools").reduce(lambda inner, _: [inner], range(80), [])}
            ),
            "nested deeper",
        ),
    ],
)
def test_hostile_manifests_are_refused(tmp_path: Path, edit, message: str) -> None:
    raw = json.loads(_manifest_bytes(tmp_path))
    edit(raw)
    with pytest.raises(FormatError, match=message):
        parse_manifest(json.dumps(raw).encode())


def test_chunks_overlapping_in_a_file_are_refused(tmp_path: Path) -> None:
    """Two tensors whose byte ranges overlap by one element (not only identical ranges)."""
    raw = json.loads(_manifest_bytes(tmp_path))
    bias = raw["tensors"]["model/0.bias"]["chunks"][0]
    weight = raw["tensors"]["model/0.weight"]["chunks"][0]
    bias.update(begin=weight["end"] - 4, end=weight["end"] - 4 + (bias["end"] - bias["begin"]))
    with pytest.raises(FormatError, match="claim the same bytes"):
        parse_manifest(json.dumps(raw).encode())


def test_safetensors_header_builder_refuses_what_readers_would_misread() -> None:
    """A second entry of the same name (or the reserved one) would silently replace the first in the
    header JSON, leaving its bytes unlisted: refused before a file is written."""
    with pytest.raises(FormatError, match="two entries named"):
        build_safetensors_header([HeaderEntry("a@1,0", torch.float32, (2,)), HeaderEntry("a@1,0", torch.float32, (2,))])
    with pytest.raises(FormatError, match="two entries named"):
        build_safetensors_header([HeaderEntry("__metadata__", torch.float32, (2,))])


def test_duplicate_keys_and_deep_json_are_refused(tmp_path: Path) -> None:
    data = _manifest_bytes(tmp_path)
    duplicated = data.replace(b'"world_size": 1', b'"world_size": 1, "world_size": 2', 1)
    with pytest.raises(FormatError, match="duplicate"):
        parse_manifest(duplicated)
    deep = b'{"format": "shardsafe", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    with pytest.raises(FormatError):
        parse_manifest(deep)


def test_folder_without_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        shardsafe.load(path, {"model": model})
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.verify(tmp_path / "nowhere")


def test_symlinked_shard_is_refused(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    outside = tmp_path / "outside.bin"
    (path / "shard-00000.safetensors").rename(outside)
    (path / "shard-00000.safetensors").symlink_to(outside)
    with pytest.raises(FormatError, match="symbolic link|outside"):
        shardsafe.verify(path)
    with pytest.raises(FormatError, match="symbolic link|outside"):
        shardsafe.load(path, {"model": model})


def test_pickle_in_place_of_shard_is_refused_without_unpickling(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    shard = path / "shard-00000.safetensors"
    size = shard.stat().st_size
    torch.save({"evil": 1}, shard)
    with pytest.raises(IntegrityError):
        shardsafe.verify(path)
    assert shard.stat().st_size != size


def test_state_json_tamper_is_detected(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    (path / "state.json").write_text((path / "state.json").read_text().replace('"hi"', '"ho"'))
    with pytest.raises(IntegrityError, match="state.json"):
        shardsafe.load(path, {"model": model, "note": None})


def test_contiguous_span() -> None:
    assert contiguous_span((2, 0), (3, 4), (0, 0), (10, 4)) == (8, 20)
    assert contiguous_span((2, 1), (1, 2), (0, 0), (10, 4)) == (9, 11)
    assert contiguous_span((2, 1), (2, 2), (0, 0), (10, 4)) is None
    assert contiguous_span((0, 0), (10, 4), (0, 0), (10, 4)) == (0, 40)
    assert contiguous_span((), (), (), ()) == (0, 1)


def test_a_newline_in_a_file_name_is_accepted_as_check_component_accepts_it(tmp_path: Path) -> None:
    """The one-pass name check accepts what check_component accepts (a newline included); deep junk
    in an entry's unknown field is dropped."""
    raw = json.loads(_manifest_bytes(tmp_path))
    raw["files"]["odd\nname"] = {
        "size": 1,
        "rank": 0,
        "junk": __import__("functools").reduce(lambda inner, _: [inner], range(80), []),
    }
    parsed = parse_manifest(json.dumps(raw).encode())
    assert parsed.files["odd\nname"].size == 1 and parsed.files["odd\nname"].index is None


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(st.text(alphabet=st.sampled_from(["a", ".", "~", "/", "\\", "\x00", "\n", "é"]), max_size=6), max_size=4)
)
def test_the_one_pass_name_check_accepts_exactly_what_check_component_accepts(names: list[str]) -> None:
    """core/fields.all_safe_components (the manifest's files section) and check_component are one rule."""
    from shardsafe.core.fields import _SAFE_COMPONENT, all_safe_components

    assert all_safe_components(names) == all(_SAFE_COMPONENT.match(n) is not None for n in names)
