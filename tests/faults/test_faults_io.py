"""Failing storage: I/O errors (EIO) at every step of a save, a disk that fills up (ENOSPC), and an S3
endpoint that drops connections and truncates responses.

After each fault: the error is a clear ShardsafeError naming the rank and the file or object,
every earlier checkpoint loads bit for bit, nothing partial is visible, and ``collect_garbage``
leaves the root clean.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_crash import assert_checkpoint_is
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardsafe
from dist_utils import make_model, run_ranks, seeded_values, set_model_values, shard
from fault_utils import assert_step, check_root_after_fault, manager_job, step_state, step_values
from reliability import record
from servers.flaky_proxy import FlakyProxy
from shardsafe.errors import CheckpointNotFoundError, SaveError, ShardsafeError
from shardsafe.manager.catalog import committed_steps
from shardsafe.manager.naming import step_name
from shardsafe.storage.remote import RemoteDir

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

WORLD = 2

# ----------------------------------------------------------------------------- EIO at each step

# (point, rank that fails, whether the new checkpoint is published anyway)
EIO_CASES = [
    ("save:mid-write", 0, False),  # EIO from write(2)
    ("save:mid-write", 1, False),
    ("save:before-fsync", 0, False),  # EIO from fsync(2)
    ("save:before-fsync", 1, False),
    ("save:after-write", 1, False),
    ("save:before-manifest", 0, False),
    ("save:before-publish", 0, False),
    ("save:after-publish", 0, True),  # after the swap: an error is reported, the new checkpoint is complete
]


def _ab_state(model: Any, version: str) -> dict[str, Any]:
    return {"model": model, "tag": torch.tensor([ord(c) for c in version]), "meta": {"version": version}}


def eio_job(rank: int, world_size: int, root: str, cases: list[tuple[str, int, bool]]) -> list[str | None]:
    """For each case: save A, then save B over it (and to a new path) with the fault armed; report the errors."""
    model = shard(make_model(0), world_size)
    errors: list[str | None] = []
    for i, (point, fail_rank, _) in enumerate(cases):
        folder = Path(root) / f"case-{i}"
        set_model_values(model, seeded_values(model, "A", 0))
        shardsafe.save(folder / "ckpt", _ab_state(model, "A"))
        set_model_values(model, seeded_values(model, "B", 0))
        for target, overwrite in (("ckpt", True), ("new", False)):
            os.environ["SHARDSAFE_FAIL_AT"] = f"{point}@{fail_rank}"
            try:
                shardsafe.save(folder / target, _ab_state(model, "B"), overwrite=overwrite)
            except SaveError as exc:
                errors.append(str(exc))
            else:
                errors.append(None)
            finally:
                del os.environ["SHARDSAFE_FAIL_AT"]
        dist.barrier()
    return errors


def test_io_errors_at_every_save_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    reports = run_ranks(eio_job, WORLD, str(root), EIO_CASES, work_dir=tmp_path)
    checked = 0
    for i, (point, fail_rank, published) in enumerate(EIO_CASES):
        folder = root / f"case-{i}"
        for j, target in enumerate(("ckpt", "new")):
            for rank in range(WORLD):  # every rank raises the same clear error
                message = reports[rank][2 * i + j]
                assert message is not None, f"{point}@{fail_rank} -> {target}: rank {rank} did not raise"
                assert f"rank {fail_rank}" in message and "injected I/O error" in message and point in message, message
        assert_checkpoint_is(folder / "ckpt", "B" if published else "A")
        if published:
            assert_checkpoint_is(folder / "new", "B")
        else:
            with pytest.raises(CheckpointNotFoundError):
                shardsafe.load(folder / "new", {"model": make_model(1)})
        assert sorted(p.name for p in folder.iterdir()) == (["ckpt", "new"] if published else ["ckpt"]), (
            "a failed save left something behind"
        )
        assert shardsafe.collect_garbage(folder) == []
        checked += 1
    record(
        "EIO (SHARDSAFE_FAIL_AT) at each step of a save, 2 ranks",
        cases=2 * len(EIO_CASES),
        faults=2 * len(EIO_CASES),
        checked=checked,
    )


def test_io_errors_in_retention(tmp_path: Path) -> None:
    """Retention failing on the coordinator (after the save committed) is logged and retried later,
    never raised on that rank alone, which would leave the other ranks waiting in the next collective."""
    cases = (
        ("retention:before-rename@0", [1, 2, 3]),
        ("retention:after-rename@0", [2, 3]),
        ("retention:mid-delete@0", [2, 3]),
    )
    for i, (spec, expected) in enumerate(cases):
        root = tmp_path / f"ckpt-{i}"
        results = run_ranks(
            manager_job,
            WORLD,
            str(root),
            {"async_save": True},
            ("SHARDSAFE_FAIL_AT", spec),
            3,
            False,
            {},
            work_dir=tmp_path,
        )
        assert results == ["survived", "survived"]
        check_root_after_fault(str(root), expected, False)
    record("EIO in manager retention (coordinator)", cases=len(cases), faults=len(cases), checked=7)


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (root only); skipped where it cannot be mounted."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_full_disk_single_process(small_disk: Path) -> None:
    model = make_model(0)
    set_model_values(model, seeded_values(model, "A", 0))
    shardsafe.save(small_disk / "ckpt", _ab_state(model, "A"))
    free_before = _free(small_disk)
    big = {"model": model, "big": torch.randn(3 << 20)}  # 12 MiB, on 8 MiB
    with pytest.raises(SaveError) as error:
        shardsafe.save(small_disk / "big", big)
    message = str(error.value)
    assert "No space left on device" in message and "rank 0" in message and "shard-00000.safetensors" in message, (
        message
    )
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt"], "the failed save left files on the full disk"
    assert _free(small_disk) == free_before
    assert_checkpoint_is(small_disk / "ckpt", "A")
    assert shardsafe.collect_garbage(small_disk) == []
    set_model_values(model, seeded_values(model, "B", 0))
    shardsafe.save(small_disk / "ckpt", _ab_state(model, "B"), overwrite=True)  # the space came back
    assert_checkpoint_is(small_disk / "ckpt", "B")
    record("ENOSPC: a checkpoint larger than the disk (8 MiB tmpfs)", faults=1, checked=1)


def full_disk_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Manager (async) on a small disk: step 1 fits, step 2 (with a 12 MiB tensor sharded over the ranks) cannot."""
    model = shard(make_model(0), world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    big = distribute_tensor(torch.randn(3 << 20, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)])
    out: dict[str, Any] = {}
    with shardsafe.CheckpointManager(root, save_every=1, async_save=True) as manager:
        set_model_values(model, step_values(model, 1, False))
        manager.save(1, step_state(model, 1))
        set_model_values(model, step_values(model, 2, False))
        manager.save(2, {**step_state(model, 2), "big": big})
        set_model_values(model, step_values(model, 3, False))
        try:
            manager.save(3, step_state(model, 3))
        except SaveError as exc:
            out["error"] = str(exc)
        manager.save(3, step_state(model, 3))  # the failed save freed its space
    return out


def test_full_disk_two_ranks_async(small_disk: Path, tmp_path: Path) -> None:
    root = small_disk / "ckpt"
    results = run_ranks(full_disk_job, WORLD, str(root), work_dir=tmp_path)
    for rank, result in enumerate(results):
        message = result.get("error", "")
        assert "background save failed" in message and "No space left on device" in message, f"rank {rank}: {message!r}"
        assert "shard-0000" in message and "rank " in message, message
    checked = check_root_after_fault(str(root), [1, 3], False)
    record("ENOSPC: an async manager save on a full disk, 2 ranks", faults=1, checked=checked)


# ----------------------------------------------------------------------------- a flaky S3 endpoint


@pytest.fixture
def flaky_s3(s3_bucket: str, moto_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FlakyProxy, str]]:
    """The bucket of ``s3_bucket``, reached through a FlakyProxy (this process only)."""
    import s3fs

    with FlakyProxy(("127.0.0.1", moto_server.port), lifetime=300) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        # Fewer retries than the defaults (5 x 5 attempts), so a persistent fault fails in seconds;
        # still enough that one dropped response is retried.
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
        s3fs.S3FileSystem.clear_instance_cache()  # cached clients would still talk to moto directly
        try:
            yield proxy, s3_bucket
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def _remote_state(version: int) -> dict[str, Any]:
    model = make_model(0)
    set_model_values(model, step_values(model, version, False))
    return step_state(model, version)


MANIFEST_PATH = r"/manifest\.json$"  # the object, not a listing that mentions it
# (mode, methods, path pattern, count): count None = every matching request fails
ALL_SAVE_FAULTS = [
    (mode, methods, path, count)
    for mode in ("drop", "cut", "truncate")
    for methods, path in ((("PUT",), r"shard-"), (("PUT",), MANIFEST_PATH), (("HEAD", "GET"), None))
    for count in (1, None)
] + [("drop", ("PUT", "GET"), MANIFEST_PATH, None), ("drop", ("PUT", "GET", "HEAD", "DELETE"), None, None)]
SAVE_FAULTS = [
    ("drop", ("PUT",), r"shard-", 1),  # retried: saved
    ("drop", ("PUT",), r"shard-", None),  # fails: nothing visible
    ("drop", ("PUT",), MANIFEST_PATH, None),  # stored, answer lost: the read-back finds it committed
    ("drop", ("PUT", "GET"), MANIFEST_PATH, None),  # stored, cannot tell: error, but complete and visible
    ("cut", ("HEAD", "GET"), None, 1),
    ("truncate", ("HEAD", "GET"), None, None),
    ("drop", ("PUT", "GET", "HEAD", "DELETE"), None, None),  # even the clean-up fails: gc collects it
]
SAVE_FAULTS_STRESS = [f for f in ALL_SAVE_FAULTS if f not in SAVE_FAULTS]
# What must happen, where it is determined: (raised, committed)
EXPECTED_SAVE = {
    ("drop", ("PUT",), r"shard-", 1): (False, True),
    ("drop", ("PUT",), r"shard-", None): (True, False),
    ("drop", ("PUT",), MANIFEST_PATH, None): (False, True),
    ("drop", ("PUT", "GET"), MANIFEST_PATH, None): (True, True),
    ("drop", ("PUT", "GET", "HEAD", "DELETE"), None, None): (True, False),
}


def _save_through_faults(
    proxy: FlakyProxy, bucket: str, faults: list[tuple[str, tuple[str, ...], str | None, int | None]]
) -> None:
    root = f"s3://{bucket}/run"
    shardsafe.save(f"{root}/{step_name(1)}", _remote_state(1))
    committed = [1]
    for i, (mode, methods, path, count) in enumerate(faults):
        step = i + 2
        before = proxy.injected
        proxy.arm(mode, count=count, methods=methods, path=path)
        raised = False
        try:
            shardsafe.save(f"{root}/{step_name(step)}", _remote_state(step))
        except SaveError as exc:
            raised = True
            assert "rank 0" in str(exc) and bucket in str(exc), f"unclear error: {exc}"
        finally:
            proxy.disarm()
        assert proxy.injected > before, f"{mode} {methods} {path}: no fault was injected"
        # Whatever happened, the step is either a complete checkpoint or not a checkpoint at all.
        visible = step in committed_steps(RemoteDir(root))
        if visible:
            committed.append(step)  # loaded bit for bit below
        else:
            with pytest.raises(CheckpointNotFoundError):
                shardsafe.load(f"{root}/{step_name(step)}", {"model": make_model(1)})
        expected = EXPECTED_SAVE.get((mode, methods, path, count))
        assert expected is None or (raised, visible) == expected, (
            f"{mode} {methods} {path} {count}: raised={raised} committed={visible}"
        )
    checked = check_root_after_fault(root, committed, False)
    record(
        "S3 save through a proxy that drops or cuts connections",
        cases=len(faults),
        faults=proxy.injected,
        checked=checked,
    )


def test_s3_save_through_a_flaky_endpoint(flaky_s3: tuple[FlakyProxy, str]) -> None:
    _save_through_faults(*flaky_s3, SAVE_FAULTS)


@pytest.mark.stress
def test_s3_save_through_a_flaky_endpoint_sweep(flaky_s3: tuple[FlakyProxy, str]) -> None:
    _save_through_faults(*flaky_s3, SAVE_FAULTS_STRESS)


ALL_LOAD_FAULTS = [
    (mode, path, count)
    for mode in ("drop", "cut", "truncate", "lie")
    for path in (r"shard-", MANIFEST_PATH, r"state-")
    for count in (1, None)
]
LOAD_FAULTS = [
    ("drop", r"shard-", 1),  # retried: loads exactly
    ("cut", r"shard-", None),  # fails: nothing modified
    ("truncate", r"shard-", 1),
    ("truncate", MANIFEST_PATH, None),
    ("lie", r"shard-", None),  # a consistent but short body: only shardsafe's own checks see it
    ("lie", MANIFEST_PATH, None),
    ("lie", r"state-", None),
    ("drop", r"state-", 1),
]
LOAD_FAULTS_STRESS = [f for f in ALL_LOAD_FAULTS if f not in LOAD_FAULTS]


def _load_through_faults(proxy: FlakyProxy, bucket: str, faults: list[tuple[str, str, int | None]]) -> None:
    path = f"s3://{bucket}/run/{step_name(1)}"
    shardsafe.save(path, _remote_state(1))
    expected = step_values(make_model(0), 1, False)
    for mode, pattern, count in faults:
        model = make_model(5)
        set_model_values(model, seeded_values(model, "before", 0))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state = {"model": model, "tag": torch.zeros(2, dtype=torch.int64), "meta": None}
        proxy.arm(mode, count=count, methods=("GET",), path=pattern)
        injected = proxy.injected
        try:
            shardsafe.load(path, state)
        except ShardsafeError as exc:
            assert bucket in str(exc) or "rank 0" in str(exc), f"unclear error: {exc}"
            for key, value in model.state_dict().items():  # a failed load changes nothing
                assert torch.equal(value, before[key]), f"{mode} {pattern}: the failed load modified {key}"
        else:
            assert state["meta"] == {"step": 1}
            for key, value in model.state_dict().items():
                assert torch.equal(value, expected[key]), f"{mode} {pattern}: the load returned wrong data for {key}"
        finally:
            proxy.disarm()
        assert proxy.injected > injected, f"{mode} {pattern}: no fault was injected"
    assert_step(f"s3://{bucket}/run", 1, False)
    record(
        "S3 load through a proxy that drops, cuts or truncates responses",
        cases=len(faults),
        faults=proxy.injected,
        checked=1,
    )


def test_s3_load_through_a_flaky_endpoint(flaky_s3: tuple[FlakyProxy, str]) -> None:
    _load_through_faults(*flaky_s3, LOAD_FAULTS)


@pytest.mark.stress
def test_s3_load_through_a_flaky_endpoint_sweep(flaky_s3: tuple[FlakyProxy, str]) -> None:
    _load_through_faults(*flaky_s3, LOAD_FAULTS_STRESS)
