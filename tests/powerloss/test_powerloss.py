"""Power cuts under real shardsafe code, through a mounted FUSE file system (``harness``).

Each workload runs once per module on a fresh recording mount (2 gloo ranks for save and the
manager); its log is then cut before every named crash point reached, right after every save
that returned, and at random moments, and every crash state the model allows there is replayed
into a fresh folder and checked (``checks``). shardsafe must show no failing state under either
model; the anchors (DCP, the HF Trainer) are measured, and must show the harness finding what
they are known to lose. ``make test`` runs a sample; ``make stress`` (``-m stress``) every cut.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from powerloss import checks
from powerloss.crashfs import PROFILES, OpLog, materialise
from powerloss.harness import Exploration, explore, record, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"power-loss harness unavailable: {REASON}")

FAST: dict[str, Any] = {"random_cuts": 4, "randoms": 1, "each_point": False}
FULL: dict[str, Any] = {"random_cuts": 24, "randoms": 4, "every": 3}


def _assert_clean(result: Exploration) -> None:
    assert result.states >= result.cuts > 0
    assert result.failing == 0, result.describe()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, OpLog]:
    return {}


def _log(logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, workload: str, arg: str = "") -> OpLog:
    key = f"{workload}:{arg}"
    if key not in logs:
        logs[key] = record(workload, tmp_path_factory.mktemp(workload.replace("-", "_")), arg)
    return logs[key]


def test_harness_finds_an_unsynced_rename(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The harness's own check: a file renamed into place without fsync can come back torn or empty
    after a cut (strict model; under ext4 too, without auto_da_alloc's replace); one written,
    fsynced, renamed and its folder fsynced never does."""
    log = _log(logs, tmp_path_factory, "selftest")
    done = dict((text, pos) for pos, text in log.markers)
    for profile in PROFILES:
        careless: set[bytes] = set()
        for label, chosen in log.crash_states(len(log), profile, random.Random(0), 8):
            folder = tmp_path / f"{profile}-{label}-{len(careless)}"
            materialise(log.replay(len(log), profile, chosen), folder)
            assert (folder / "d" / "careful").read_bytes() == b"y" * 10000, (profile, label)
            careless.add(
                (folder / "d" / "careless").read_bytes() if (folder / "d" / "careless").exists() else b"<absent>"
            )
        assert b"x" * 10000 in careless and len(careless) > 1, (profile, careless)
    assert done["done:careful"] > done["done:careless"]


@pytest.mark.parametrize("profile", PROFILES)
def test_save_survives_power_cuts(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, profile: str
) -> None:
    """shardsafe.save on 2 ranks into a new root, over its checkpoint, and into a new folder: a
    returned save survives every cut (the root folder too: fixed, it was not fsynced into its parent),
    anything with a manifest verifies and loads exactly, gc changes nothing that loads."""
    _assert_clean(
        explore(_log(logs, tmp_path_factory, "save"), checks.SaveChecker(), "save", profile, tmp_path, **FAST)
    )


# The manager's ext4 exploration (~20 s) runs in `make stress`; `make test` keeps the strict model,
# which makes no write durable without an fsync and so explores the states ext4's ordering rules out too.
MANAGER_PROFILES = [pytest.param(p, marks=pytest.mark.stress) if p == "ext4" else p for p in PROFILES]


@pytest.mark.parametrize("profile", MANAGER_PROFILES)
def test_manager_survives_power_cuts(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, profile: str
) -> None:
    """A CheckpointManager (keep_last=2, dedup) on 2 ranks, steps 1-4, then a second run that
    restores, saves step 5 and collects garbage: list shows only checkpoints that load exactly,
    committed steps retention keeps survive, lease records parse and never fall below a durable
    checkpoint's epoch, gc on any crash state keeps every checkpoint."""
    log = _log(logs, tmp_path_factory, "manager", "dedup")
    _assert_clean(explore(log, checks.ManagerChecker(frozen=True), "manager-dedup", profile, tmp_path, **FAST))


@pytest.mark.parametrize("profile", PROFILES)
def test_exports_leave_nothing_or_everything(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, profile: str
) -> None:
    """save -> export_hf -> push to file:// -> export_dcp -> convert_dcp: each leaves nothing
    visible or a complete folder, and one that returned survives."""
    _assert_clean(
        explore(_log(logs, tmp_path_factory, "exports"), checks.ExportsChecker(), "exports", profile, tmp_path, **FAST)
    )


@pytest.mark.parametrize("profile", PROFILES)
def test_anchor_dcp_overwrite(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, profile: str
) -> None:
    """DCP's FileSystemWriter saving over its own checkpoint (the anchor): its files are rewritten in
    place under the old ``.metadata``, so the harness must find states that publish a broken one."""
    result = explore(_log(logs, tmp_path_factory, "dcp"), checks.DcpChecker(), "dcp", profile, tmp_path, **FAST)
    assert result.states > 0 and result.broken > 0, result.describe()


@pytest.mark.stress
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(
    "workload", ["save", "manager:sync", "manager:dedup", "manager:async", "manager:async-dedup", "exports"]
)
def test_full_exploration(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, workload: str, profile: str
) -> None:
    name, _, arg = workload.partition(":")
    checker: checks.Checker = {"save": checks.SaveChecker, "exports": checks.ExportsChecker}.get(
        name, lambda: checks.ManagerChecker("dedup" in arg)
    )()
    _assert_clean(
        explore(_log(logs, tmp_path_factory, name, arg), checker, workload.replace(":", "-"), profile, tmp_path, **FULL)
    )


KILL_POINTS = [
    "save:mid-write@1",
    "save:before-publish",
    "retention:after-rename",
    "retention:mid-delete",
    "async:before-write",
]


@pytest.mark.stress
@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_then_power_cut(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, point: str) -> None:
    """A real SIGKILL at a named point of step 3 (async, dedup), a second run that resumes, saves and
    collects garbage, and power cuts anywhere in between: the same rules hold."""
    log = record("manager-killed", tmp_path_factory.mktemp("killed"), f"async-dedup,{point}")
    for profile in PROFILES:
        result = explore(
            log, checks.ManagerChecker(frozen=True), f"manager-killed-{point}", profile, tmp_path / profile, **FAST
        )
        _assert_clean(result)


@pytest.mark.stress
@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("anchor", ["dcp", "trainer"])
def test_anchor_full(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, anchor: str, profile: str
) -> None:
    log = _log(logs, tmp_path_factory, anchor)
    checker = checks.DcpChecker() if anchor == "dcp" else checks.TrainerChecker(checks.trainer_expected(log))
    result = explore(log, checker, anchor, profile, tmp_path, **FULL)
    assert result.states > 0 and result.failing > 0, result.describe()


@pytest.mark.stress
def test_anchor_trainer_rotation(
    logs: dict[str, OpLog], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The HF Trainer saving a checkpoint per step with save_total_limit=2 (the anchor): it never
    fsyncs, so under the strict model the harness must find the newest checkpoint lost or broken."""
    log = _log(logs, tmp_path_factory, "trainer")
    result = explore(log, checks.TrainerChecker(checks.trainer_expected(log)), "trainer", "strict", tmp_path, **FAST)
    assert result.states > 0 and result.failing > 0, result.describe()
