"""What must hold in every crash state, one checker per workload (``workloads.py``).

A checker looks at a materialised crash state twice:

* :meth:`Checker.summarise` (the state alone; cached by the state's content hash): what is
  published there and whether it is good, plus the problems the state shows by itself;
* :meth:`Checker.judge` (the state and the markers logged before the cut): what the workload had
  been told was done and is now missing.

Problems are ``(category, message)``: ``broken`` (something published - a shardsafe checkpoint
``list`` shows or whose manifest is there, a DCP folder with ``.metadata``, the Trainer checkpoint
a resume picks, a model folder - that does not load, verify or hold exactly what was written),
``lost`` (a save, commit or export that had returned is gone, or the previous good checkpoint is),
``lease`` (a lease record that does not parse, or an epoch older than a durable checkpoint's),
``gc`` (``collect_garbage`` on the state removed or damaged something a checkpoint needs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Problem = tuple[str, str]


@dataclass
class Verdict:
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


def done(markers: list[str]) -> list[str]:
    return [m[len("done:") :] for m in markers if m.startswith("done:")]


def begun(markers: list[str]) -> list[str]:
    return [m[len("begin:") :] for m in markers if m.startswith("begin:")]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP logs every failed load at ERROR with its traceback: thousands of states would flood the output."""
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def _failure(exc: BaseException) -> bool:
    """A failure of the code under test (DCP's CheckpointException is a BaseException), not an interrupt."""
    return not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:160]}"


def version_state(model: Any, version: str) -> dict[str, Any]:
    return {"model": model, "tag": torch.tensor([ord(c) for c in version]), "meta": {"version": version}}


class Checker:
    library = "shardsafe"

    def summarise(self, root: Path) -> Verdict:
        raise NotImplementedError

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        raise NotImplementedError


# ----------------------------------------------------------------------------- shardsafe.save


def _load_version(path: Path, candidates: list[str]) -> str:
    """Which of ``candidates`` the checkpoint at ``path`` holds exactly (raises if none)."""
    import shardsafe
    from dist_utils import assert_tensors_equal, full_model_state, make_model, seeded_values

    shardsafe.verify(path)
    model = make_model(11)
    state: dict[str, Any] = {"model": model, "tag": torch.zeros(1, dtype=torch.int64), "meta": None}
    shardsafe.load(path, state, strict=False)
    version = (state["meta"] or {}).get("version")
    if version not in candidates:
        raise AssertionError(f"holds version {version!r}, expected one of {candidates}")
    assert state["tag"].tolist() == [ord(c) for c in version]
    assert_tensors_equal(full_model_state(model), seeded_values(model, version, 0), str(path))
    return str(version)


class SaveChecker(Checker):
    """``shardsafe.save`` into new folders and over a checkpoint (``workloads.save_versions``)."""

    def __init__(self) -> None:
        from powerloss.workloads import save_versions

        self.versions = save_versions()
        self.folders = sorted({f for f, _, _ in self.versions})

    def _facts(self, root: Path) -> tuple[dict[str, Any], list[Problem]]:
        facts: dict[str, Any] = {}
        problems: list[Problem] = []
        for folder in self.folders:
            path = root / folder
            if not (path / "manifest.json").exists():
                facts[folder] = None
                continue
            try:
                facts[folder] = _load_version(path, [v for f, v, _ in self.versions if f == folder])
            except Exception as exc:
                facts[folder] = "broken"
                problems.append(("broken", f"{folder}: has a manifest but {_error(exc)}"))
        return facts, problems

    def summarise(self, root: Path) -> Verdict:
        import shardsafe

        facts, problems = self._facts(root)
        if (root / "run").is_dir():
            copy = root.parent / (root.name + "-gc")
            shutil.copytree(root, copy, symlinks=True)
            try:
                shardsafe.collect_garbage(copy / "run")
                after, _ = self._facts(copy)
                if after != facts:
                    problems.append(("gc", f"collect_garbage changed {facts} into {after}"))
            except Exception as exc:
                problems.append(("gc", f"collect_garbage failed: {_error(exc)}"))
            finally:
                shutil.rmtree(copy, ignore_errors=True)
        return Verdict(facts, problems)

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        problems: list[Problem] = []
        finished, started = done(markers), begun(markers)
        for folder in self.folders:
            returned = [d.split(":")[1] for d in finished if d.split(":")[0] == folder]
            if not returned:
                continue
            later = [b.split(":")[1] for b in started if b.split(":")[0] == folder]
            allowed = set(later[later.index(returned[-1]) :])
            if verdict.facts.get(folder) not in allowed:
                problems.append(
                    ("lost", f"{folder}: save of {returned[-1]} had returned; now holds {verdict.facts.get(folder)}")
                )
        return problems


# ----------------------------------------------------------------------------- CheckpointManager


class ManagerChecker(Checker):
    """A CheckpointManager run (retention keep_last, dedup, async), a resume, gc; its lease records."""

    def __init__(self, frozen: bool) -> None:
        self.frozen = frozen

    def _good_steps(self, run: Path) -> tuple[dict[int, int | None], list[Problem]]:
        from fault_utils import assert_step
        from shardsafe.manager.naming import STEP_RE

        good: dict[int, int | None] = {}
        problems: list[Problem] = []
        for name in sorted(os.listdir(run)):
            if not STEP_RE.match(name) or not (run / name / "manifest.json").is_file():
                continue
            step = int(name[len("step-") :])
            try:
                assert_step(run, step, self.frozen)
                good[step] = None
            except Exception as exc:
                problems.append(("broken", f"{name}: has a manifest but {_error(exc)}"))
        return good, problems

    def summarise(self, root: Path) -> Verdict:
        import shardsafe
        from shardsafe.manager.lease import LocalRecords

        run = root / "run"
        if not run.is_dir():
            return Verdict({"good": {}, "epoch": 0})
        good, problems = self._good_steps(run)
        try:
            listed = {info.step: info.lease_epoch for info in shardsafe.list_checkpoints(run)}
        except Exception as exc:
            listed = {}
            problems.append(("broken", f"list failed: {_error(exc)}"))
        for step in sorted(set(listed) - set(good)):
            problems.append(("broken", f"list shows step {step}, which does not load"))
        for step in good:
            good[step] = listed.get(step)
        records = LocalRecords(run)
        epochs = records.epochs()
        for epoch in epochs:
            try:
                records.read(epoch)
            except Exception as exc:
                problems.append(("lease", f"epoch {epoch}: {_error(exc)}"))
        top = max(epochs, default=0)
        for step, epoch in sorted(good.items()):
            if epoch is not None and epoch > top:
                problems.append(
                    ("lease", f"step {step} was committed under lease epoch {epoch}; the highest epoch left is {top}")
                )
        copy = root.parent / (root.name + "-gc")
        shutil.copytree(root, copy, symlinks=True)
        try:
            shardsafe.collect_garbage(copy / "run")
            after, _ = self._good_steps(copy / "run")
            if set(after) != set(good):
                problems.append(("gc", f"collect_garbage left steps {sorted(after)} of {sorted(good)}"))
        except Exception as exc:
            problems.append(("gc", f"collect_garbage failed: {_error(exc)}"))
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        return Verdict({"good": good, "epoch": top}, problems)

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        from powerloss.workloads import KEEP_LAST

        committed = sorted({int(d) for d in done(markers) if d.isdigit()})
        started = sorted({int(b) for b in begun(markers) if b.isdigit()})
        if not committed:
            return []
        floor = started[-KEEP_LAST] if len(started) >= KEEP_LAST else 0
        required = {committed[-1]} | {s for s in committed if s >= floor}
        good = set(verdict.facts["good"])
        # retention may retire a committed step once KEEP_LAST newer ones are committed (an async save
        # commits, and retires, before the workload's next marker says so)
        missing = sorted(s for s in required if s not in good and len([g for g in good if g > s]) < KEEP_LAST)
        if missing:
            return [
                (
                    "lost",
                    f"committed step(s) {missing} gone (committed {committed}, present "
                    f"{sorted(verdict.facts['good'])})",
                )
            ]
        return []


# ----------------------------------------------------------------------------- exports, push, convert


class ExportsChecker(Checker):
    """save -> export_hf -> push file:// -> export_dcp -> convert_dcp: each nothing or complete."""

    def __init__(self) -> None:
        from powerloss.workloads import tiny_gpt2

        self.expected = {k: v.clone() for k, v in tiny_gpt2().state_dict().items()}

    def _check_model(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        assert tensors, f"{what}: no tensors"
        for name, t in tensors.items():
            key = name[len("model/") :] if name.startswith("model/") else name
            assert key in self.expected, f"{what}: unexpected tensor {name}"
            assert torch.equal(t, self.expected[key]), f"{what}: {name} differs"

    def _ckpt(self, path: Path) -> None:
        import shardsafe
        from shardsafe.api.source import CheckpointSource

        shardsafe.verify(path)
        source = CheckpointSource(path, key="")
        try:
            self._check_model({t.name: source.read(t.name) for t in source.tensors()}, str(path))
        finally:
            source.close()

    def _hf(self, path: Path) -> None:
        from shardsafe.hf.export import iter_output
        from shardsafe.hf.guard import check_model_folder

        check_model_folder(path)
        self._check_model(dict(iter_output(path)), str(path))

    def _dcp(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        state = {k: torch.zeros_like(v) for k, v in self.expected.items()}
        with _quiet():
            dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
        self._check_model({k: v for k, v in state.items() if k in self.expected}, str(path))

    def summarise(self, root: Path) -> Verdict:
        run = root / "run"
        checks: dict[str, tuple[Callable[[Path], None], str]] = {
            "ckpt": (self._ckpt, "manifest.json"),
            "hf": (self._hf, ""),
            "pushed": (self._hf, "model.safetensors"),  # the commit marker a push writes last
            "dcp": (self._dcp, ""),
            "fromdcp": (self._ckpt, "manifest.json"),
        }
        facts: dict[str, Any] = {}
        problems: list[Problem] = []
        for name, (check, marker_file) in checks.items():
            path = run / name
            visible = path.is_dir() and (not marker_file or (path / marker_file).exists())
            if not visible:
                facts[name] = None
                continue
            try:
                check(path)
                facts[name] = "good"
            except BaseException as exc:
                if not _failure(exc):
                    raise
                facts[name] = "broken"
                problems.append(("broken", f"{name}: visible but {_error(exc)}"))
        return Verdict(facts, problems)

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        return [
            ("lost", f"{name} had returned; now {verdict.facts.get(name)}")
            for name in done(markers)
            if verdict.facts.get(name) != "good"
        ]


# ----------------------------------------------------------------------------- anchors


class DcpChecker(Checker):
    """torch.distributed.checkpoint ``FileSystemWriter`` saves over one folder (``workloads.DCP_VERSIONS``)."""

    library = "DCP"

    def summarise(self, root: Path) -> Verdict:
        import torch.distributed.checkpoint as dcp

        from powerloss.workloads import DCP_VERSIONS, dcp_state

        path = root / "dcp" / "ckpt"
        if not (path / ".metadata").exists():
            return Verdict({"version": None})
        state = {"model": {k: torch.zeros_like(v) for k, v in dcp_state("A")["model"].items()}, "step": torch.tensor(0)}
        try:
            with _quiet():
                dcp.load(state, checkpoint_id=str(path), no_dist=True)
        except BaseException as exc:
            if not _failure(exc):
                raise
            return Verdict({"version": "broken"}, [("broken", f".metadata present, dcp.load fails: {_error(exc)}")])
        for version in DCP_VERSIONS:
            want = dcp_state(version)
            if int(state["step"]) == int(want["step"]) and all(
                torch.equal(state["model"][k], want["model"][k]) for k in want["model"]
            ):
                return Verdict({"version": version})
        return Verdict(
            {"version": "broken"},
            [("broken", f".metadata present, dcp.load returns step {int(state['step'])} with other tensors")],
        )

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        finished, started = done(markers), begun(markers)
        if not finished:
            return []
        allowed = set(started[started.index(finished[-1]) :])
        if verdict.facts["version"] not in allowed:
            return [
                (
                    "lost",
                    f"save {finished[-1]} had returned (or was the previous good one); the folder now holds "
                    f"{verdict.facts['version']}",
                )
            ]
        return []


def trainer_expected(log: Any) -> dict[int, dict[str, bytes]]:
    """{step: {file: bytes}} of each Trainer checkpoint as it stood when its ``on_save`` ran (the live view)."""
    from powerloss.crashfs import walk

    expected: dict[int, dict[str, bytes]] = {}
    everything = frozenset(range(len(log.micro)))
    for pos, text in log.marker_positions("done:"):
        step = int(text[len("done:") :])
        prefix = f"out/checkpoint-{step}/"
        nodes = log.replay(pos + 1, "strict", everything)
        expected[step] = {
            path[len(prefix) :]: bytes(n.data)
            for path, _, n in walk(nodes)
            if path.startswith(prefix) and n.kind == "f"
        }
    return expected


class TrainerChecker(Checker):
    """transformers ``Trainer`` checkpoints with rotation: intact means every file it wrote, byte for byte.

    ``expected`` maps a step to {file: bytes} as the Trainer had written them when its ``on_save``
    callback ran (the live view at that moment, from the log)."""

    library = "HF Trainer"

    def __init__(self, expected: dict[int, dict[str, bytes]]) -> None:
        self.expected = expected

    def summarise(self, root: Path) -> Verdict:
        from transformers.trainer_utils import get_last_checkpoint

        out = root / "out"
        intact: dict[int, bool] = {}
        if out.is_dir():
            for name in os.listdir(out):
                if name.startswith("checkpoint-") and (out / name).is_dir():
                    step = int(name.split("-")[1])
                    files = self.expected.get(step, {})
                    folder = out / name
                    intact[step] = bool(files) and all(
                        (folder / f).is_file() and (folder / f).read_bytes() == data for f, data in files.items()
                    )
        last = get_last_checkpoint(str(out)) if out.is_dir() else None
        problems: list[Problem] = []
        if last is not None and not intact[int(last.rsplit("-", 1)[1])]:
            problems.append(("broken", f"resume would pick {os.path.basename(last)}, which is incomplete"))
        return Verdict({"intact": intact}, problems)

    def judge(self, verdict: Verdict, markers: list[str]) -> list[Problem]:
        finished = [int(d) for d in done(markers)]
        if not finished:
            return []
        if not any(ok and step >= finished[-1] for step, ok in verdict.facts["intact"].items()):
            return [("lost", f"checkpoint-{finished[-1]} had been saved; no intact checkpoint that new is left")]
        return []
