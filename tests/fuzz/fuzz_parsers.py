"""Coverage-guided fuzzing of the format parsers with atheris (libFuzzer).

    .venv/bin/python tests/fuzz/fuzz_parsers.py -runs=20000          # what `make stress` runs
    .venv/bin/python tests/fuzz/fuzz_parsers.py -max_total_time=600  # longer, by hand

The first input byte picks a target, each fed either the raw remaining bytes or a valid seed (a
real manifest, a real header, a real state file) spliced with them, so the fuzzer gets past the
JSON syntax quickly:

* the format parsers: ``parse_json``, ``parse_manifest``, ``parse_safetensors_header``,
  ``decode_value``; each may return or raise FormatError;
* the CLI's parsers: the ``shardsafe`` argument parser (``build_parser().parse_args`` on fuzzed
  argv: it may exit, as argparse does on bad usage, and nothing is run), and ``shardsafe
  inspect``'s reader (``describe_checkpoint`` and ``format_inspection``) on a real checkpoint
  whose manifest.json, or whose state.json (with the manifest vouching for its size and hash, so
  the state parser is reached), holds the fuzzed bytes; it may raise a ShardsafeError (the CLI
  prints its message), and what it prints must hold no terminal control character.

Any other exception is a crash that libFuzzer reports with the input that caused it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

try:
    import atheris
except ImportError:  # pragma: no cover - atheris is a dev dependency that may not build everywhere
    print("atheris is not installed (pip install atheris); skipping the parser fuzzing")
    sys.exit(0)

import torch  # not instrumented: only shardsafe's own code is
from fuzz_common import splice, work_folder  # noqa: E402

with atheris.instrument_imports(include=["shardsafe"]):
    from shardsafe.api.checkpoint import save
    from shardsafe.cli.inspect import describe_checkpoint, format_inspection
    from shardsafe.cli.main import build_parser
    from shardsafe.core.format import (
        ChunkEntry,
        FileEntry,
        HeaderEntry,
        Manifest,
        TensorEntry,
        build_safetensors_header,
        parse_json,
        parse_manifest,
        parse_safetensors_header,
    )
    from shardsafe.core.integrity import hash_bytes
    from shardsafe.core.values import decode_value
    from shardsafe.errors import FormatError, ShardsafeError
    from shardsafe.state.rng import RNGState


def _seed_manifest() -> bytes:
    chunk = ChunkEntry((0, 0), (2, 5), "shard-00000.safetensors", 64, 104, ("0123456789abcdef",))
    rest = ChunkEntry((2, 0), (1, 5), "shard-00001.safetensors", 64, 84, ("fedcba9876543210",), None)
    manifest = Manifest(
        world_size=2,
        tensors={"model/w": TensorEntry(torch.float32, (3, 5), (chunk, rest))},
        files={"shard-00000.safetensors": FileEntry(104, 0), "shard-00001.safetensors": FileEntry(84, 1)},
        state_size=2,
        state_hash="00",
        metadata={"step": 1},
        hash_block_size=4096,
    )
    return manifest.to_bytes()


SEED_MANIFEST = _seed_manifest()
SEED_HEADER, _ = build_safetensors_header(
    [HeaderEntry("a", torch.float32, (3, 2)), HeaderEntry("b@2,0", torch.bfloat16, (5,))]
)
SEED_STATE = json.dumps(
    {"x": {"__pairs__": [[1, {"__tuple__": [1, {"__dtype__": "float32"}]}]]}, "t": {"__tensor__": "k"}}
).encode()


def _seed_checkpoint() -> Path:
    """A real checkpoint (module, optimizer, RNG, a value) for the inspect targets to damage."""
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    folder = work_folder("cli") / "ckpt"
    save(folder, {"model": model, "optim": optim, "rng": RNGState(), "step": 3, "names": {"a": [1, 2.5, None]}})
    return folder


CHECKPOINT = _seed_checkpoint()
SEED_CKPT_MANIFEST = (CHECKPOINT / "manifest.json").read_bytes()
SEED_CKPT_STATE = (CHECKPOINT / "state.json").read_bytes()
ARGV_WORDS = (
    "inspect verify list gc export convert push demo --json --dry-run --min-age --steps --save-every --nproc --timeout "
)
ARGV_WORDS += "--max-shard-size --dtype --key --tag --for-engine --revision -m --help --version 5GB 0 -1 nan 1e309 x"
WORDS = ARGV_WORDS.split()
# What must never reach a terminal from a checkpoint: controls (newline aside), unpaired surrogates, bidi overrides.
UNSAFE_OUTPUT = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), *range(0xD800, 0xE000), 0x61C, 0x200E, 0x200F]} - {
    "\n"
}
UNSAFE_OUTPUT |= {chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]}


def _fuzz_argv(fdp: atheris.FuzzedDataProvider) -> None:
    """Parse (never run) a fuzzed ``shardsafe`` command line; argparse may exit on bad usage."""
    argv = [
        fdp.PickValueInList(WORDS) if fdp.ConsumeBool() else fdp.ConsumeUnicode(12)
        for _ in range(fdp.ConsumeIntInRange(0, 8))
    ]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pass


def _fuzz_inspect(manifest: bytes, state: bytes | None) -> None:
    """``shardsafe inspect`` on the seed checkpoint with this manifest (or this state file)."""
    if state is not None:
        raw = json.loads(SEED_CKPT_MANIFEST)
        raw["state"].update(size=len(state), hash=hash_bytes(state))
        manifest = json.dumps(raw).encode()
    (CHECKPOINT / "manifest.json").write_bytes(manifest)
    (CHECKPOINT / "state.json").write_bytes(SEED_CKPT_STATE if state is None else state)
    try:
        info = describe_checkpoint(CHECKPOINT)
    except ShardsafeError:
        return
    text = format_inspection(info) + json.dumps(info)
    if UNSAFE_OUTPUT & set(text):
        raise AssertionError(f"inspect prints a control character: {sorted(UNSAFE_OUTPUT & set(text))!r}")


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 6)
    spliced = fdp.ConsumeBool()
    try:
        if target == 0:
            parse_json(splice(SEED_STATE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
        elif target == 1:
            parse_manifest(splice(SEED_MANIFEST, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
        elif target == 2:
            size = fdp.ConsumeIntInRange(0, 1 << 20)
            parse_safetensors_header(
                splice(SEED_HEADER, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), size, "fuzz"
            )
        elif target == 3:
            value = parse_json(splice(SEED_STATE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
            decode_value(value, lambda key: key)
        elif target == 4:
            _fuzz_argv(fdp)
        elif target == 5:
            _fuzz_inspect(splice(SEED_CKPT_MANIFEST, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), None)
        else:
            _fuzz_inspect(b"", splice(SEED_CKPT_STATE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()))
    except FormatError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
