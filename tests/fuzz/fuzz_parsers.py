"""Coverage-guided fuzzing of the format parsers with atheris (libFuzzer).

    .venv/bin/python tests/fuzz/fuzz_parsers.py -runs=20000          # what `make stress` runs
    .venv/bin/python tests/fuzz/fuzz_parsers.py -max_total_time=600  # longer, by hand

The first input byte picks a target: ``parse_json``, ``parse_manifest``,
``parse_safetensors_header`` or ``decode_value``, each fed either the raw remaining bytes or a
valid seed (a real manifest, a real header) spliced with them, so the fuzzer gets past the JSON
syntax quickly. Each target may return or raise FormatError; any other exception is a crash that
libFuzzer reports with the input that caused it.
"""

from __future__ import annotations

import json
import sys

try:
    import atheris
except ImportError:  # pragma: no cover - atheris is a dev dependency that may not build everywhere
    print("atheris is not installed (pip install atheris); skipping the parser fuzzing")
    sys.exit(0)

import torch  # not instrumented: only shardsafe's own code is

with atheris.instrument_imports(include=["shardsafe"]):
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
    from shardsafe.core.values import decode_value
    from shardsafe.errors import FormatError


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
SEED_HEADER, _ = build_safetensors_header([HeaderEntry("a", torch.float32, (3, 2)), HeaderEntry("b@2,0", torch.bfloat16, (5,))])
SEED_STATE = json.dumps({"x": {"__pairs__": [[1, {"__tuple__": [1, {"__dtype__": "float32"}]}]]}, "t": {"__tensor__": "k"}}).encode()


def _splice(seed: bytes, fdp: atheris.FuzzedDataProvider) -> bytes:
    at = fdp.ConsumeIntInRange(0, len(seed))
    cut = fdp.ConsumeIntInRange(0, 64)
    return seed[:at] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) + seed[at + cut :]


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 3)
    spliced = fdp.ConsumeBool()
    try:
        if target == 0:
            parse_json(_splice(SEED_STATE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
        elif target == 1:
            parse_manifest(_splice(SEED_MANIFEST, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
        elif target == 2:
            size = fdp.ConsumeIntInRange(0, 1 << 20)
            parse_safetensors_header(_splice(SEED_HEADER, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), size, "fuzz")
        else:
            value = parse_json(_splice(SEED_STATE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()), "fuzz")
            decode_value(value, lambda key: key)
    except FormatError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
