"""Run transformers' own Trainer checkpoint tests with ShardsafeTrainer in place of ``Trainer``.

The yardstick of issue 38 (docs/TRAINER.md, "Measured against transformers' own checkpoint tests"). The test
file is transformers' (Apache-2.0), not the project's: fetch it yourself, for the installed
transformers version, with the helper module it imports, keeping the repository's layout
(``tests/__init__.py``, ``tests/trainer/__init__.py``, ``tests/trainer/trainer_test_utils.py``,
``tests/trainer/test_trainer_checkpointing.py``), anywhere outside this repository. This script
downloads nothing. It runs pytest on that file in this process after rebinding
``transformers.Trainer`` to ShardsafeTrainer, so the test module, its helpers and every
``from transformers import Trainer`` inside a test get the substitute; ``--stock`` runs the same
file on the stock Trainer, ``--compare`` runs both (one subprocess each) and lists the tests the
stock Trainer passes and ShardsafeTrainer does not.

    python tools/trainer_yardstick.py /tmp/yardstick/tests/trainer/test_trainer_checkpointing.py --compare
    python tools/trainer_yardstick.py FILE [--stock] [-- -k resume -x]   # extra pytest arguments after --

The Hub is switched off (``HF_HUB_OFFLINE=1``): tests that download a tokenizer or processor fail
for both trainers alike, staging tests skip.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


def _pytest_args(test_file: Path, extra: list[str], junit: str | None) -> list[str]:
    """pytest's arguments: rooted at the folder above ``tests/`` so the relative imports resolve."""
    root = test_file.resolve().parents[2]
    args = [str(test_file), "--rootdir", str(root), "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short"]
    if junit:
        args.append(f"--junitxml={junit}")
    return args + extra


def _substitute() -> None:
    """Make ``from transformers import Trainer`` give ShardsafeTrainer, from now on, in this process.

    transformers swaps its lazy top-level module in ``sys.modules`` while importing (a rebinding on
    the module object one imported first is lost), and a fresh lazy module resolves ``Trainer``
    from ``transformers.trainer``: both get the substitute. ShardsafeTrainer itself subclasses the
    real class, bound when it was imported.
    """
    import transformers.trainer

    from shardsafe.integrations.transformers import ShardsafeTrainer

    transformers.trainer.Trainer = ShardsafeTrainer  # type: ignore[misc]
    sys.modules["transformers"].Trainer = ShardsafeTrainer  # type: ignore[attr-defined]


def run(test_file: Path, stock: bool, extra: list[str], junit: str | None = None) -> int:
    """Run the file in this process, on ShardsafeTrainer unless ``stock``; pytest's exit code."""
    import pytest

    if not stock:
        _substitute()
    from transformers import Trainer

    print(f"yardstick: Trainer = {Trainer.__module__}.{Trainer.__name__}", flush=True)
    return int(pytest.main(_pytest_args(test_file, extra, junit)))


def _outcomes(junit: str) -> dict[str, str]:
    """test id -> passed / failed / skipped, from a junit XML report."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        result[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return result


def compare(test_file: Path, extra: list[str]) -> int:
    """Run stock and ShardsafeTrainer in two subprocesses; print the counts and the regressions."""
    outcomes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("stock", "shardsafe"):
            junit = os.path.join(tmp, f"{label}.xml")
            cmd = [sys.executable, __file__, str(test_file), f"--junit={junit}"]
            cmd += ["--stock"] if label == "stock" else []
            subprocess.run(cmd + (["--", *extra] if extra else []), check=False)
            outcomes[label] = _outcomes(junit)
    for label, result in outcomes.items():
        counts = {k: sum(1 for v in result.values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{label}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    regressions = sorted(
        t for t, v in outcomes["stock"].items() if v == "passed" and outcomes["shardsafe"].get(t) != "passed"
    )
    print(f"passed by the stock Trainer, not by ShardsafeTrainer ({len(regressions)}):")
    for test in regressions:
        print(f"  {test}")
    return 1 if regressions else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="transformers' tests/trainer/test_trainer_checkpointing.py")
    parser.add_argument("--stock", action="store_true", help="run on the stock transformers.Trainer")
    parser.add_argument("--compare", action="store_true", help="run both and list the tests only stock passes")
    parser.add_argument("--junit", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: pytest's own arguments
    if not (args.test_file.parent.parent / "__init__.py").is_file():
        parser.error(f"{args.test_file}: expected inside <root>/tests/<folder>/ with the tests' __init__.py files")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.compare:
        return compare(args.test_file, extra)
    return run(args.test_file, args.stock, extra, args.junit)


if __name__ == "__main__":
    sys.exit(main())
