"""Coverage-guided fuzzing of the DCP reader (the DCP profile of the restricted loader) with atheris (libFuzzer).

    .venv/bin/python tests/fuzz/fuzz_dcp_metadata.py -runs=20000          # what `make stress` runs
    .venv/bin/python tests/fuzz/fuzz_dcp_metadata.py -max_total_time=600  # longer, by hand

The seed is a real folder ``dcp.save`` wrote (no process group): a ``Linear`` module's state dict, its
AdamW optimizer's state keyed by parameter name (the layout ``get_state_dict`` gives), a plain value.
The first input byte picks a target, each fed either the raw remaining bytes or the seed's bytes
spliced with them, so the fuzzer starts from what DCP writes:

0. :func:`scan_pickle` alone on a ``.metadata`` stream, DCP rules;
1. :func:`read_metadata` on the folder with that ``.metadata`` (unpickling into the stand-ins, every
   path, offset, length, chunk and dtype checked against the folder);
2. the same metadata read as ``shardsafe.load`` reads it (:func:`dcp_state_tree`, :func:`dcp_manifest`,
   ``check_state_tree``) and every tensor and value read whole (``convert``'s reads);
3. structured: the seed's metadata unpickled (it is this run's own file), one field (an item's
   offset, length or file, a chunk's offsets or sizes, a tensor's size or dtype, a state-dict path)
   set to a fuzzed value, pickled again and loaded by ``shardsafe.load`` into a live module and
   optimizer: past the opcode scan, into the semantic checks and the in-place reads;
4. the seed's metadata with one ``.distcp`` item's bytes (its ``torch.save`` archive) spliced,
   loaded by ``shardsafe.load``: :func:`locate_tensor`, the CRC-32 check, the positional reads.

Each may return or raise a :class:`ShardsafeError` whose cause (when the load wrapped one from a
rank) is a ShardsafeError too; any other exception is a crash that libFuzzer reports with its input.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import sys
from typing import Any

try:
    import atheris
except ImportError:  # pragma: no cover - atheris is a dev dependency that may not build everywhere
    print("atheris is not installed (pip install atheris); skipping the DCP metadata fuzzing")
    sys.exit(0)

import torch  # not instrumented: only shardsafe's own code is
import torch.distributed.checkpoint as dcp
from fuzz_common import splice, work_folder  # noqa: E402

with atheris.instrument_imports(include=["shardsafe"]):
    from shardsafe.api.load import load
    from shardsafe.core.values import check_state_tree
    from shardsafe.errors import ShardsafeError
    from shardsafe.interop.dcp_convert import dcp_state_tree
    from shardsafe.interop.dcp_metadata import RULES, read_metadata
    from shardsafe.interop.dcp_reader import DcpCheckpoint, dcp_manifest
    from shardsafe.interop.pickle_scan import scan_pickle


def _live() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


def _seed_state() -> dict[str, Any]:
    """What ``get_state_dict`` gives for the live pair: optimizer state and groups keyed by parameter name."""
    model, optim = _live()
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())
    raw = optim.state_dict()
    state = {names[id(params[i])]: dict(s) for i, s in raw["state"].items()}
    groups = [{**g, "params": [names[id(params[i])] for i in g["params"]]} for g in raw["param_groups"]]
    return {"model": model.state_dict(), "optim": {"state": state, "param_groups": groups}, "n": 7}


WORK = work_folder("dcp")
SOUND = WORK / "sound"
dcp.save(_seed_state(), checkpoint_id=str(SOUND), no_dist=True)
SEED_METADATA = (SOUND / ".metadata").read_bytes()
FOLDER = WORK / "folder"
shutil.copytree(SOUND, FOLDER)
DATA_FILES = sorted(p.name for p in SOUND.glob("*.distcp"))
MODEL, OPTIM = _live()


def _int(fdp: atheris.FuzzedDataProvider) -> int:
    """Small, boundary or huge integers, negative ones included."""
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return fdp.ConsumeIntInRange(-2, 64)
    if choice == 1:
        return fdp.ConsumeIntInRange(0, 1 << 20)
    return fdp.ConsumeIntInRange(-(1 << 63), 1 << 63) if choice == 2 else 1 << fdp.ConsumeIntInRange(30, 80)


def _mutated(fdp: atheris.FuzzedDataProvider) -> bytes:
    """The seed's metadata with one field changed (the seed is this run's own file: unpickled here to build the
    variant)."""
    meta = pickle.loads(SEED_METADATA)  # noqa: S301 - this run's own dcp.save output, never an input
    entries, infos = list(meta.state_dict_metadata.items()), list(meta.storage_data.items())
    field = fdp.ConsumeIntInRange(0, 8)
    index, info = infos[fdp.ConsumeIntInRange(0, len(infos) - 1)]
    fqn, entry = entries[fdp.ConsumeIntInRange(0, len(entries) - 1)]
    chunks = getattr(entry, "chunks", None)
    if field == 0:
        info.offset = _int(fdp)
    elif field == 1:
        info.length = _int(fdp)
    elif field == 2:
        info.relative_path = fdp.PickValueInList(
            [*DATA_FILES, ".metadata", "../x.distcp", "a/b.distcp", fdp.ConsumeUnicode(12)]
        )
    elif field == 3 and chunks:
        chunk = chunks[fdp.ConsumeIntInRange(0, len(chunks) - 1)]
        dims = [_int(fdp) if fdp.ConsumeBool() else d for d in chunk.sizes] or [_int(fdp)]
        if fdp.ConsumeBool():
            chunk.sizes = torch.Size([max(d, 0) for d in dims])
        else:
            chunk.offsets = torch.Size([max(d, 0) for d in dims])
    elif field == 4 and chunks:
        entry.size = torch.Size([max(_int(fdp), 0) for _ in range(fdp.ConsumeIntInRange(0, 3))])
    elif field == 5 and chunks:
        entry.properties.dtype = fdp.PickValueInList(
            [torch.float16, torch.int64, torch.bool, torch.float64, torch.uint8]
        )
    elif field == 6:
        meta.planner_data[fqn] = tuple(
            fdp.PickValueInList(["model", "optim", "state", "0", 0, 1, "n", fdp.ConsumeUnicode(6)]) for _ in range(3)
        )
    elif field == 7:
        meta.storage_data[type(index)(fdp.PickValueInList([e[0] for e in entries]), index.offset, index.index)] = info
        if fdp.ConsumeBool():
            del meta.storage_data[index]
    elif field == 8 and chunks:
        chunks.append(chunks[0]) if fdp.ConsumeBool() else chunks.clear()
    return pickle.dumps(meta, protocol=4)


def _read_as_load_does() -> None:
    with DcpCheckpoint(FOLDER, key="") as ckpt:
        keys, tree = dcp_state_tree(ckpt)
        check_state_tree(tree, "fuzz", dcp_manifest(ckpt.meta, keys))
        for fqn in ckpt.meta.tensors:
            ckpt.read_fqn(fqn)


def _load() -> None:
    """``shardsafe.load`` of the folder; a ShardsafeError wrapping anything else (the agreement of ranks does that) is a
    crash."""
    try:
        load(FOLDER, {"model": MODEL, "optim": OPTIM, "n": 0})
    except ShardsafeError as exc:
        if exc.__cause__ is not None and not isinstance(exc.__cause__, ShardsafeError):
            raise exc.__cause__ from None
        raise


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 4)
    spliced = fdp.ConsumeBool()
    data_file = FOLDER / DATA_FILES[0]
    try:
        if target == 3:
            (FOLDER / ".metadata").write_bytes(_mutated(fdp))
            _load()
            return
        if target == 4:
            raw = (SOUND / DATA_FILES[0]).read_bytes()
            at = fdp.ConsumeIntInRange(0, len(raw) - 1)
            data_file.write_bytes(
                raw[:at] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8)).ljust(1, b"\0") + raw[at + 1 :]
            )
            _load()
            return
        stream = splice(SEED_METADATA, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes())
        if target == 0:
            scan_pickle(stream, "fuzz", RULES)
            return
        (FOLDER / ".metadata").write_bytes(stream)
        if target == 1:
            read_metadata(FOLDER)
        else:
            _read_as_load_does()
    except ShardsafeError:
        pass
    finally:
        if target >= 1:
            shutil.copyfile(SOUND / ".metadata", FOLDER / ".metadata")
            shutil.copyfile(SOUND / DATA_FILES[0], data_file)


def main() -> None:
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    _load()  # the sound seed loads (else every input would stop at the same early error)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
