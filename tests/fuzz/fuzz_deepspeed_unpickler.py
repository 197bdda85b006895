"""Coverage-guided fuzzing of the DeepSpeed reader's restricted unpickler with atheris (libFuzzer).

    .venv/bin/python tests/fuzz/fuzz_deepspeed_unpickler.py -runs=20000          # what `make stress` may run
    .venv/bin/python tests/fuzz/fuzz_deepspeed_unpickler.py -max_total_time=600  # longer, by hand

The first input byte picks a target, each fed either the raw remaining bytes or a real seed (the
pickle or the whole archive of a sound ZeRO-3 optimizer file written by ``ds_scripts/craft.py``)
spliced with them, so the fuzzer starts from what DeepSpeed writes:

0. :func:`scan_pickle` alone on a pickle stream (seed: the optimizer file's pickle);
1. :func:`load_file` on an archive holding that pickle and the seed's records (scan, unpickle,
   tensor checks, value graph);
2. :func:`load_file` on mutated archive bytes (zip directory, local headers, records, CRC);
3. and 4. an archive of the mutated optimizer (3) or model (4) pickle, with the seed's records, as
   rank 0's file of a sound two-rank folder, read through :class:`DeepSpeedCheckpoint` (every
   tensor, every optimizer state entry, the param groups): the reader's own checks on values.

Each may return or raise :class:`ShardsafeError` (FormatError, CheckpointNotFoundError); any other
exception is a crash that libFuzzer reports with its input; a segfault stops the run.
"""

from __future__ import annotations

import io
import logging
import shutil
import sys
import zipfile
from pathlib import Path

try:
    import atheris
except ImportError:  # pragma: no cover - atheris is a dev dependency that may not build everywhere
    print("atheris is not installed (pip install atheris); skipping the DeepSpeed unpickler fuzzing")
    sys.exit(0)

import torch  # not instrumented: only shardsafe's own code is
from fuzz_common import splice, work_folder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ds_scripts
from ds_scripts.craft import write_archive, zero3_folder  # noqa: E402

with atheris.instrument_imports(include=["shardsafe"]):
    from shardsafe.errors import ShardsafeError
    from shardsafe.interop.deepspeed_reader import DeepSpeedCheckpoint
    from shardsafe.interop.pickle_scan import scan_pickle
    from shardsafe.interop.unpickler import RULES, load_file

WORK = work_folder("ds")
SOUND = zero3_folder(WORK / "sound")
OPTIM, MODEL = "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"
SEED_ARCHIVE = (SOUND.tag_folder / OPTIM).read_bytes()


def _parts(name: str) -> tuple[bytes, dict[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO((SOUND.tag_folder / name).read_bytes())) as z:
        return z.read("archive/data.pkl"), {n.split("/data/", 1)[1]: z.read(n) for n in z.namelist() if "/data/" in n}


SEEDS = {OPTIM: _parts(OPTIM), MODEL: _parts(MODEL)}
FOLDER = WORK / "folder"
shutil.copytree(SOUND.root, FOLDER)
SCRATCH = WORK / "one.pt"


def _read_all() -> None:
    with DeepSpeedCheckpoint(FOLDER) as ckpt:
        for name in ckpt.names():
            ckpt.read(name)
        for name in ckpt.trainable:
            for key in ckpt.optimizer_state_spec(name):
                ckpt.optimizer_state(name, key)
        ckpt.param_groups()
        ckpt.flat_groups()


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 4)
    spliced = fdp.ConsumeBool()
    name = MODEL if target == 4 else OPTIM
    seed_pickle, records = SEEDS[name]
    try:
        if target == 2:
            SCRATCH.write_bytes(splice(SEED_ARCHIVE, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes()))
            load_file(SCRATCH, mmap=fdp.ConsumeBool())
            return
        mmap = fdp.ConsumeBool()
        stream = splice(seed_pickle, fdp) if spliced else fdp.ConsumeBytes(fdp.remaining_bytes())
        if target == 0:
            scan_pickle(stream, "fuzz", RULES)
        elif target == 1:
            load_file(write_archive(SCRATCH, stream, records), mmap=mmap)
        else:
            target_file = FOLDER / SOUND.tag_folder.name / name
            write_archive(target_file, stream, records)
            try:
                _read_all()
            finally:
                write_archive(target_file, seed_pickle, records)
    except ShardsafeError:
        pass


def main() -> None:
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the reader's warnings about entries it leaves out, once per input
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
