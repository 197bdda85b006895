"""CheckpointManager with an S3 root (a real S3 API served by moto on 127.0.0.1), 2 FSDP2 ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

import shardsafe
from dist_utils import full_model_state, make_model, make_optimizer, rank_batch, run_ranks, shard, train_step
from shardsafe.manager.catalog import committed_steps
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.manager.naming import step_name
from shardsafe.storage.remote import RemoteDir

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket


def _s3_job(rank: int, world_size: int, root: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)  # ranks fork from a server started before the fixture set these
    model = shard(make_model(0), world_size)
    optimizer = make_optimizer(model)
    state = {"model": model, "optim": optimizer, "step": 0}
    torch.manual_seed(rank)
    with shardsafe.CheckpointManager(root, save_every=1, keep_last=2, async_save=True) as manager:
        for step in range(1, 5):
            train_step(model, optimizer, *rank_batch(rank, step))
            state["step"] = step
            manager.save(step, state)
    return {"final": full_model_state(model)}


def test_manager_on_s3_root(s3_bucket: str, tmp_path: Path) -> None:
    root = f"s3://{s3_bucket}/run"
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    results = run_ranks(_s3_job, 2, root, env, work_dir=tmp_path)
    remote = RemoteDir(root)
    assert committed_steps(remote) == [3, 4]
    # retired steps are gone entirely
    assert sorted(n for n in remote.list() if n != LEASE_DIR) == [step_name(3), step_name(4)]
    shardsafe.verify(f"{root}/{step_name(4)}")

    # an interrupted save: objects under a step prefix but no manifest -> invisible, then collected
    orphan = remote.child(step_name(5))
    orphan.write_bytes("shard-00000-deadbeef0000.safetensors", b"partial")
    manager = shardsafe.CheckpointManager(root)
    assert manager.steps() == [3, 4] and manager.latest_step() == 4
    model = make_model(1)
    state = {"model": model, "optim": make_optimizer(model), "step": None}
    assert manager.restore(state) == 4 and state["step"] == 4
    for key, value in results[0]["final"].items():
        assert torch.equal(model.state_dict()[key], value), key
    # a young object may belong to a save in progress elsewhere: min_age leaves it alone
    stamp = orphan.modified("shard-00000-deadbeef0000.safetensors")
    assert stamp is not None and abs(stamp - time.time()) < 300  # moto's LastModified, to the second
    assert shardsafe.collect_garbage(root, min_age=600) == []
    assert orphan.exists("shard-00000-deadbeef0000.safetensors")
    removed = shardsafe.collect_garbage(root)
    assert removed == [f"{orphan.url}/shard-00000-deadbeef0000.safetensors"]
    assert step_name(5) not in remote.list()


def test_damaged_checkpoint_on_s3_is_skipped_by_retention_list_and_gc(s3_bucket: str) -> None:
    """On an object store, too: a bad manifest is passed over by retention and list, and gc leaves
    it and (since it may reference them) the manifest-less step prefixes."""
    from shardsafe.manager.catalog import list_root
    from shardsafe.manager.gc import collect

    root = f"s3://{s3_bucket}/damaged"
    remote = RemoteDir(root)
    model = torch.nn.Linear(8, 4)
    with shardsafe.CheckpointManager(root, keep_last=2) as manager:
        manager.save(1, {"model": model})
        manager.save(2, {"model": model})
        remote.child(step_name(1)).write_bytes("manifest.json", b'{"format": "shardsafe", "truncat')
        manager.save(3, {"model": model})
        manager.save(4, {"model": model})
        assert manager.retention_errors == []
    assert committed_steps(remote) == [1, 3, 4]
    listing = list_root(root)
    assert [i.step for i in listing.checkpoints] == [3, 4] and [d.step for d in listing.damaged] == [1]
    orphan = remote.child(step_name(5))
    orphan.write_bytes("shard-00000-deadbeef0000.safetensors", b"partial")
    report = collect(root)
    assert report.removed == [] and report.left == [orphan.url] and [d.step for d in report.damaged] == [1]
    assert orphan.exists("shard-00000-deadbeef0000.safetensors") and remote.child(step_name(1)).exists("manifest.json")


def test_listing_sees_what_other_processes_wrote_since(s3_bucket: str) -> None:
    """fsspec caches a folder's listing per process: a manager that listed once would not see a checkpoint
    another process committed (or removed) afterwards. RemoteDir.list asks the store every time."""
    import boto3

    root = f"s3://{s3_bucket}/run"
    remote = RemoteDir(root)
    remote.child("step-0000000001").write_bytes("manifest.json", b"{}")
    assert remote.list() == ["step-0000000001"]  # the listing is cached from here on
    client = boto3.client("s3", region_name="us-east-1")  # another writer: not this process's s3fs
    client.put_object(Bucket=s3_bucket, Key="run/step-0000000002/manifest.json", Body=b"{}")
    assert remote.list() == ["step-0000000001", "step-0000000002"]
    client.delete_object(Bucket=s3_bucket, Key="run/step-0000000001/manifest.json")
    assert remote.list() == ["step-0000000002"]
