"""The command line against crafted checkpoints, run as a user (or a CI job) runs it.

Each case copies one sound checkpoint into ``root/step-0000000001`` (so the manager commands see
it too), damages it one way (a field of the wrong type, a huge or negative number, non-UTF-8
bytes, deep nesting, an odd state entry, a missing file, a manifest that is a folder or a FIFO, a
symlink to a file outside the folder...), and runs ``python -m shardsafe.cli`` on it in a
subprocess. For every command the output must hold no traceback, no terminal escape and never
the secret planted in files next to the checkpoint (``root/outside/``, where a symlink or a
sibling reference points). Commands a case lists as refusing must exit 1 with one ``error:``
message naming what is wrong and nothing on stdout, never an "internal error". Other commands may
accept the input (exit 0) or refuse it cleanly.

Every run is its own process (``run_forked`` in test_cli_runner.py: forked from one interpreter
that imported torch once, checked there against real interpreters); the tests then read the
results, one test per case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli_runner import run_forked
from torch import nn

import shardsafe
from shardsafe.core.integrity import hash_bytes

SECRET = "SHARDSAFE-SECRET-7d41c9e2"
STEP = "step-0000000001"
SHARD = "shard-00000.safetensors"
OUTSIDE = "outside"  # sibling of the checkpoint folder, holding files a hostile checkpoint points at


@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]  # (checkpoint folder) -> None; the folder's parent is the root
    refused: tuple[str, ...] = ("inspect", "verify")  # must exit 1 with `error:`
    tolerated: tuple[str, ...] = ()  # may succeed; if they fail, cleanly
    accepted: tuple[str, ...] = ()  # must succeed (exit 0)
    argument: Callable[[Path], str | bytes] | None = None  # what to pass instead of the folder


# ----------------------------------------------------------------------------- how to damage


def load_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def edit_manifest(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        manifest = load_json(folder / "manifest.json")
        edit(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))

    return damage


def raw_manifest(data: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / "manifest.json").write_bytes(data)

    return damage


def write_state(folder: Path, data: bytes) -> None:
    """Replace state.json and make the manifest vouch for it, so the parsers behind the hash check see it."""
    (folder / "state.json").write_bytes(data)
    manifest = load_json(folder / "manifest.json")
    manifest["state"].update(size=len(data), hash=hash_bytes(data))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def edit_state(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        state = load_json(folder / "state.json")
        edit(state)
        write_state(folder, json.dumps(state).encode())

    return damage


def raw_state(data: bytes) -> Callable[[Path], None]:
    return lambda folder: write_state(folder, data)


def first_tensor(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["tensors"]["model/0.weight"]


def first_chunk(manifest: dict[str, Any]) -> dict[str, Any]:
    return first_tensor(manifest)["chunks"][0]


def nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"x": value}
    return value


def replace_with_symlink(name: str, target: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to(folder.parent / OUTSIDE / target)

    return damage


def replace_with_dir(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).mkdir()
        (folder / name / "inner.json").write_text("{}")

    return damage


def replace_with_fifo(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        os.mkfifo(folder / name)

    return damage


def remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def patch_shard(offset: int, data: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        with open(folder / SHARD, "r+b") as f:
            f.seek(offset)
            f.write(data)

    return damage


def truncate_shard(folder: Path) -> None:
    with open(folder / SHARD, "r+b") as f:
        f.truncate(os.path.getsize(folder / SHARD) - 5)


def sparse_manifest(folder: Path) -> None:
    with open(folder / "manifest.json", "r+b") as f:
        f.truncate((1 << 30) + 1)  # one byte more than any JSON file shardsafe reads; sparse, so free


def chunk_in_sibling(folder: Path) -> None:
    """The first chunk claims to live in ``../outside/secret.bin`` (a dedup reference to a sibling)."""
    manifest = load_json(folder / "manifest.json")
    chunk = first_chunk(manifest)
    chunk.update(checkpoint=OUTSIDE, file="secret.bin")
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def hostile_names(folder: Path) -> None:
    """Metadata and state entry names made of terminal escapes and a bidi override (accepted, shown escaped)."""
    manifest = load_json(folder / "manifest.json")
    manifest["metadata"] = {"note\x1b]0;owned\x07": "\x1b[31mred\r"}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    state = load_json(folder / "state.json")
    state["\x1b[1;1Hname\r"] = {"kind": "value", "state": "\x1b[5mblink\u202e"}
    state["opts\x1b"] = {"kind": "stateful", "state": {"mode\x1b[2J": "\x1b[0m", "_hidden": 1}}
    write_state(folder, json.dumps(state).encode())


def lone_surrogate_name(folder: Path) -> None:
    """A tensor key holding a lone surrogate: not valid UTF-8, so save refuses it and so do the readers."""
    manifest = load_json(folder / "manifest.json")
    manifest["tensors"]["\x1b[2J\ud800evil"] = dict(first_tensor(manifest))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def engine_entry(state_part: Any, meta: Any) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        state = load_json(folder / "state.json")
        state["engine"] = {"kind": "deepspeed_engine", "state": state_part, "meta": meta}
        write_state(folder, json.dumps(state).encode())

    return damage


def odd_metrics(metrics: Any) -> Callable[[Path], None]:
    """A second checkpoint (step 2) beside the first, both recording ``metrics`` as the manager does."""

    def damage(folder: Path) -> None:
        second = folder.parent / "step-0000000002"
        shutil.copytree(folder, second)
        for f in (folder, second):
            manifest = load_json(f / "manifest.json")
            manifest["metadata"]["shardsafe.manager"] = {
                "step": 1,
                "metrics": metrics,
                "best_metric": "loss",
                "best_mode": "min",
            }
            (f / "manifest.json").write_text(json.dumps(manifest, indent=1))

    return damage


def nothing(folder: Path) -> None:
    pass


def set_(obj_of: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: obj_of(manifest).__setitem__(key, value)


TOP: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m  # noqa: E731
FILE: Callable[[dict[str, Any]], dict[str, Any]] = lambda m: m["files"][SHARD]  # noqa: E731
MODEL_STATE: Callable[[dict[str, Any]], dict[str, Any]] = lambda s: s["model"]["state"]  # noqa: E731


CASES = [
    Case(
        "sound-control",
        nothing,
        refused=(),
        accepted=("inspect", "inspect-json", "verify", "export", "list", "list-json", "gc"),
    ),
    # --- manifest fields of the wrong type, out of range, malformed
    Case(
        "world-size-string",
        edit_manifest(set_(TOP, "world_size", "2")),
        refused=("inspect", "verify", "export"),
        tolerated=("list", "gc"),
    ),
    Case("world-size-zero", edit_manifest(set_(TOP, "world_size", 0))),
    Case("world-size-bool", edit_manifest(set_(TOP, "world_size", True))),
    Case("format-version-float", edit_manifest(set_(TOP, "format_version", 1.0))),
    Case("format-version-future", edit_manifest(set_(TOP, "format_version", 99))),
    Case(
        "created-huge",
        edit_manifest(set_(TOP, "created", 1e300)),
        refused=("inspect",),
        tolerated=("verify", "list"),
    ),
    Case("created-nan", edit_manifest(set_(TOP, "created", float("nan"))), refused=("inspect",), tolerated=("verify",)),
    Case("created-negative", edit_manifest(set_(TOP, "created", -1e18)), refused=("inspect",), tolerated=("verify",)),
    Case(
        "created-huge-integer",
        edit_manifest(set_(TOP, "created", 10**400)),
        refused=("inspect",),
        tolerated=("verify",),
    ),
    Case("created-string", edit_manifest(set_(TOP, "created", "yesterday"))),
    Case(
        "file-size-huge",
        edit_manifest(set_(FILE, "size", 10**400)),
        refused=("inspect", "verify", "export"),
        tolerated=("list",),
    ),
    Case("file-size-negative", edit_manifest(set_(FILE, "size", -1))),
    Case("file-rank-string", edit_manifest(set_(FILE, "rank", "0"))),
    Case("file-entry-string", edit_manifest(lambda m: m["files"].__setitem__(SHARD, "big"))),
    Case(
        "file-name-traversal", edit_manifest(lambda m: m["files"].__setitem__("../secret.bin", {"size": 1, "rank": 0}))
    ),
    Case("files-list", edit_manifest(set_(TOP, "files", [SHARD]))),
    Case("tensors-list", edit_manifest(set_(TOP, "tensors", []))),
    Case("tensor-shape-huge", edit_manifest(set_(first_tensor, "shape", [1 << 40, 1 << 40]))),
    Case("tensor-shape-negative", edit_manifest(set_(first_tensor, "shape", [-1, 3]))),
    Case("tensor-shape-string", edit_manifest(set_(first_tensor, "shape", "2x3"))),
    Case("tensor-dtype-unknown", edit_manifest(set_(first_tensor, "dtype", "float128"))),
    Case("tensor-entry-number", edit_manifest(lambda m: m["tensors"].__setitem__("model/0.weight", 7))),
    Case("chunk-begin-string", edit_manifest(set_(first_chunk, "begin", "272"))),
    Case("chunk-end-huge", edit_manifest(set_(first_chunk, "end", 10**30))),
    Case("chunk-offsets-nested", edit_manifest(set_(first_chunk, "offsets", [[0], [0]]))),
    Case("chunk-hashes-string", edit_manifest(set_(first_chunk, "hashes", "0123456789abcdef"))),
    Case("chunk-file-traversal", edit_manifest(set_(first_chunk, "file", "../outside/secret.bin"))),
    Case("chunk-not-object", edit_manifest(lambda m: first_tensor(m).__setitem__("chunks", [5]))),
    Case("state-file-traversal", edit_manifest(lambda m: m["state"].__setitem__("file", "../outside/state.json"))),
    Case("state-size-huge", edit_manifest(lambda m: m["state"].__setitem__("size", 10**400))),
    Case("metadata-list", edit_manifest(set_(TOP, "metadata", [1, 2]))),
    Case("metadata-deep", edit_manifest(set_(TOP, "metadata", nested(100)))),
    Case(
        "hash-block-size-huge",
        edit_manifest(set_(TOP, "hash_block_size", 1 << 62)),
        refused=("verify",),
        tolerated=("inspect",),
    ),
    Case("hash-block-size-tiny", edit_manifest(set_(TOP, "hash_block_size", 1))),
    # --- the manifest file itself
    Case("manifest-empty", raw_manifest(b""), refused=("inspect", "verify", "export"), tolerated=("list", "gc")),
    Case("manifest-not-json", raw_manifest(b"\x00\x01manifest?"), refused=("inspect", "verify"), tolerated=("list",)),
    Case(
        "manifest-non-utf8",
        raw_manifest(b'{"format": "shardsafe\xff\xfe", "world_size": 1}'),
        refused=("inspect", "verify"),
        tolerated=("list",),
    ),
    Case(
        "manifest-deep-nesting",
        raw_manifest(b"[" * 200_000 + b"]" * 200_000),
        refused=("inspect", "verify"),
        tolerated=("list",),
    ),
    Case("manifest-duplicate-key", raw_manifest(b'{"format": "shardsafe", "format": "shardsafe", "world_size": 1}')),
    Case("manifest-top-level-list", raw_manifest(b'["shardsafe"]')),
    Case("manifest-too-large", sparse_manifest, refused=("inspect", "verify"), tolerated=("list",)),
    Case(
        "manifest-is-directory",
        replace_with_dir("manifest.json"),
        refused=("inspect", "verify", "export"),
        tolerated=("list", "gc"),
    ),
    Case(
        "manifest-is-fifo", replace_with_fifo("manifest.json"), refused=("inspect", "verify"), tolerated=("list", "gc")
    ),
    Case(
        "manifest-missing", remove("manifest.json"), refused=("inspect", "verify", "export"), tolerated=("list", "gc")
    ),
    Case(
        "manifest-symlink-outside",
        replace_with_symlink("manifest.json", "manifest.json"),
        refused=("inspect", "verify", "export"),
        tolerated=("list", "gc"),
    ),
    # --- state.json (the manifest vouches for its size and hash, so its own parser is reached)
    Case("state-missing", remove("state.json")),
    Case("state-symlink-outside", replace_with_symlink("state.json", "state.json")),
    Case("state-is-fifo", replace_with_fifo("state.json")),
    Case(
        "state-hash-mismatch",
        lambda f: (f / "state.json").write_text((f / "state.json").read_text().replace("step", "stop")),
    ),
    Case("state-top-level-list", raw_state(b"[1, 2]"), refused=("inspect", "verify", "export")),
    Case("state-non-utf8", raw_state(b'{"step": {"kind": "value", "state": "\xff\xfe"}}')),
    Case("state-deep-nesting", raw_state(json.dumps({"step": {"kind": "value", "state": nested(200)}}).encode())),
    Case("state-kind-number", edit_state(lambda s: s["step"].__setitem__("kind", 5))),
    Case("state-kind-missing", edit_state(lambda s: s["step"].pop("kind"))),
    Case("state-entry-number", edit_state(lambda s: s.__setitem__("step", 5))),
    Case(
        "state-ranks-number",
        edit_state(lambda s: s["rng"].__setitem__("ranks", 5)),
        refused=("inspect",),
        tolerated=("verify",),
    ),
    Case(
        "state-tensor-ref-number",
        edit_state(set_(MODEL_STATE, "0.weight", {"__tensor__": 7})),
        refused=("inspect", "verify", "export"),
    ),
    Case(
        "state-tensor-ref-unknown",
        edit_state(set_(MODEL_STATE, "0.weight", {"__tensor__": "model/nope"})),
        refused=("inspect", "verify"),
        tolerated=("export",),  # export takes the manifest's tensors under the key; state.json only names the entry
    ),
    Case("state-dtype-tag-unknown", edit_state(set_(MODEL_STATE, "extra", {"__dtype__": "float128"}))),
    Case("state-pairs-malformed", edit_state(set_(MODEL_STATE, "extra", {"__pairs__": [[{"a": 1}, 2]]}))),
    Case(
        "state-engine-sections-list",
        engine_entry({"fp32": [1, 2]}, {"params": {"w": {"group": 0, "shape": [2]}}}),
        refused=("inspect",),
        tolerated=("verify",),
    ),
    Case("state-engine-meta-number", engine_entry({"fp32": {}}, 5), refused=(), tolerated=("inspect", "verify")),
    Case(
        "state-engine-optim-numbers",
        engine_entry(
            {"fp32": {"w": {"__tensor__": "model/0.weight"}}, "optim": [1, 2]},
            {"params": {"w": {"group": 0, "shape": [2, 3]}}},
        ),
        refused=("inspect",),
        tolerated=("verify",),
    ),
    # --- shard files (what verify and export read)
    Case("shard-missing", remove(SHARD), refused=("verify", "export"), tolerated=("inspect",)),
    Case(
        "shard-symlink-outside",
        replace_with_symlink(SHARD, "secret.bin"),
        refused=("verify", "export"),
        tolerated=("inspect",),
    ),
    Case("shard-is-directory", replace_with_dir(SHARD), refused=("verify", "export"), tolerated=("inspect",)),
    Case("shard-is-fifo", replace_with_fifo(SHARD), refused=("verify", "export"), tolerated=("inspect",)),
    Case("shard-truncated", truncate_shard, refused=("verify", "export"), tolerated=("inspect",)),
    Case(
        "shard-header-length-huge",
        patch_shard(0, (1 << 62).to_bytes(8, "little")),
        refused=("verify",),
        tolerated=("inspect",),
    ),
    Case("shard-header-non-utf8", patch_shard(9, b"\xff\xfe\xfd"), refused=("verify",), tolerated=("inspect",)),
    Case(
        "chunk-in-sibling-folder", chunk_in_sibling, refused=("verify", "export"), tolerated=("inspect", "list", "gc")
    ),
    # --- names and text meant for the terminal
    Case("names-with-escapes", hostile_names, refused=(), accepted=("inspect", "inspect-json", "verify", "list")),
    Case("name-lone-surrogate", lone_surrogate_name, refused=("inspect", "inspect-json", "verify", "export")),
    # --- manager roots (list, gc)
    Case(
        "metrics-not-numbers",
        odd_metrics({"loss": {"nested": [1]}}),
        refused=(),
        tolerated=("list", "list-json", "gc"),
    ),
    Case(
        "metrics-escapes",
        odd_metrics({"loss\x1b[2J": 1.0, "\u202eevil": "\x1b[31m"}),
        refused=(),
        tolerated=("list", "gc"),
    ),
    Case("manager-meta-number", odd_metrics(5), refused=(), tolerated=("list",)),
    # --- arguments
    Case(
        "path-non-utf8",
        nothing,
        refused=("inspect", "verify"),
        argument=lambda f: os.fsencode(str(f.parent)) + b"/\xff\xfe-missing",
    ),
    Case(
        "path-with-escapes",
        nothing,
        refused=("inspect", "verify"),
        argument=lambda f: str(f.parent / "x\x1b[2J\u202e-missing"),
    ),
    Case("path-is-a-file", nothing, refused=("inspect", "verify", "export"), argument=lambda f: str(f / "state.json")),
]


# ----------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sound one-process checkpoint: module, optimizer, scheduler, RNG, a value and a tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": shardsafe.RNGState(),
        "step": 7,
        "scale": torch.arange(4),
    }
    shardsafe.save(path, state, metadata={"note": "pristine"})
    return path


def plant_outside(root: Path, pristine: Path) -> None:
    """Files beside the checkpoint that hold the secret, shaped so that a reader that followed a
    link to them would get far (a manifest whose dtype is the secret, a state file, shard-sized bytes)."""
    outside = root / OUTSIDE
    outside.mkdir()
    manifest = load_json(pristine / "manifest.json")
    first_tensor(manifest)["dtype"] = SECRET
    manifest["metadata"] = {"secret": SECRET}
    (outside / "manifest.json").write_text(json.dumps(manifest))
    (outside / "state.json").write_text(json.dumps({SECRET: {"kind": SECRET, "state": SECRET}}))
    size = (pristine / SHARD).stat().st_size
    (outside / "secret.bin").write_bytes((SECRET.encode() * (size // len(SECRET) + 1))[:size])


def argv_for(command: str, target: str | bytes, root: Path, work: Path) -> list[str | bytes]:
    if command == "inspect-json":
        return ["inspect", target, "--json"]
    if command == "export":
        return ["export", target, str(work / "exported"), "--no-progress"]
    if command in ("list", "list-json"):
        return ["list", str(root), *(["--json"] if command == "list-json" else [])]
    if command == "gc":
        return ["gc", str(root), "--dry-run", "--min-age", "0"]
    return [command, target]


def commands_of(case: Case) -> tuple[str, ...]:
    return (*case.refused, *case.tolerated, *case.accepted)


@pytest.fixture(scope="module")
def jobs(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[str | bytes]]:
    """(case, command) -> argv, with every case's damaged checkpoint built."""
    out: dict[tuple[str, str], list[str | bytes]] = {}
    for case in CASES:
        work = tmp_path_factory.mktemp(case.name)
        root = work / "root"
        root.mkdir()
        plant_outside(root, pristine)
        folder = root / STEP
        shutil.copytree(pristine, folder)
        case.damage(folder)
        target = case.argument(folder) if case.argument else str(folder)
        for command in commands_of(case):
            out[case.name, command] = argv_for(command, target, root, work)
    return out


@pytest.fixture(scope="module")
def results(
    jobs: dict[tuple[str, str], list[str | bytes]], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], subprocess.CompletedProcess[bytes]]:
    """Every (case, command) run."""
    return dict(zip(jobs, run_forked(list(jobs.values()), tmp_path_factory.mktemp("runs"))))


def check(case: Case, command: str, result: subprocess.CompletedProcess[bytes]) -> list[str]:
    """What is wrong with one run (empty: nothing)."""
    out, err = result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    problems = []
    if "Traceback" in out + err:
        problems.append("a traceback")
    if SECRET in out + err:
        problems.append("the secret from a file outside the folder")
    if any(c in out + err for c in "\x1b\x07\u202e") or "\r" in out:
        problems.append("raw terminal control characters")
    refused = command in case.refused
    if result.returncode not in ((1,) if refused else (0,) if command in case.accepted else (0, 1)):
        problems.append(f"exit status {result.returncode}")
    if result.returncode == 1:
        if not err.startswith("error: "):
            problems.append("stderr does not start with 'error: '")
        if refused and out:
            problems.append("output on stdout besides the error")
        if "internal error" in err:
            problems.append("an internal error instead of a message naming the file and field")
    return [f"{command}: {p}\n  stdout: {out[-600:]!r}\n  stderr: {err[-600:]!r}" for p in problems]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(case: Case, results: dict[tuple[str, str], subprocess.CompletedProcess[bytes]]) -> None:
    problems: list[str] = []
    for command in commands_of(case):
        problems.extend(check(case, command, results[case.name, command]))
    assert not problems, "\n".join(problems)


def test_enough_cases() -> None:
    """The suite aims wide: many shapes of damage, and every command."""
    assert len(CASES) >= 60
    commands = {c for case in CASES for c in commands_of(case)}
    assert commands >= {"inspect", "inspect-json", "verify", "export", "list", "list-json", "gc"}
