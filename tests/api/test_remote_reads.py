"""The object-store read path, attacked through a real S3 API (moto on 127.0.0.1).

On an object store ``ChunkReader.run`` reads serially, one ranged GET per run of consecutive
blocks of a chunk; an atomic load reads a fresh optimizer's state straight into place in its first
pass, and keeps the first 64 MiB of the blocks it only checked for the second pass. What must hold,
with checkpoints saved with 4 KiB hash blocks (so a small model makes dozens of blocks):

* loads from ``s3://`` (atomic or not, fresh or allocated optimizer) equal the local-folder load
  bit for bit, and download every byte of the checkpoint exactly once (GET bytes counted by
  wrapping s3fs's ``_cat_file``: an instrument around the transport, nothing is replaced), with
  about one request per chunk, not one per block; with the cache off, an atomic load downloads
  a fresh optimizer's state once and only the rest twice;
* one flipped byte in the first, a middle or the partial last block (model, fresh state), a
  truncated and a missing object: ``verify`` and every load raise the same IntegrityError naming
  the object (and the block), an atomic load changes no tensor, a fresh optimizer ends stateless,
  and no object is changed;
* a dedup reference into a sibling checkpoint on S3 loads exactly, and damage in the sibling's
  object is named there;
* 2 -> 3 ranks (FSDP2, gloo): every load equals the local one, each rank's atomic load costs it no
  more GET bytes than its non-atomic one, and a damaged block two ranks share is the same error on
  every rank with nothing changed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
import shardsafe.protocol.block_io as block_io
import shardsafe.protocol.shard_files as shard_files
from dist_utils import (
    assert_optimizer_equal,
    assert_tensors_equal,
    full_model_state,
    full_optimizer_state,
    make_model,
    make_optimizer,
    run_ranks,
    seeded_step,
    shard,
)
from shardsafe.errors import IntegrityError
from shardsafe.storage.remote import RemoteDir
from stored_chunks import stored_chunks, use_small_blocks

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket

BLOCK = 4096
DIMS = (64, 97, 41)  # layers.0.weight: 97 x 64 float32 (6 blocks + 256 bytes at 1 rank; rows 0-48 on rank 0 of 2)


@pytest.fixture
def small_blocks() -> Iterator[None]:
    undo = use_small_blocks(BLOCK)
    yield
    undo()


class GetCounter:
    """Bytes and requests of every GET this process makes through s3fs."""

    def __init__(self) -> None:
        self.bytes = self.gets = 0


@contextmanager
def counting_gets() -> Iterator[GetCounter]:
    import s3fs

    counter = GetCounter()
    original = s3fs.S3FileSystem._cat_file

    async def counted(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        data: bytes = await original(self, path, *args, **kwargs)
        counter.bytes += len(data)
        counter.gets += 1
        return data

    # fsspec binds an instance's sync methods when it is made, and keeps instances: a new one is made
    # (and dropped after) so that every GET of the code under test goes through the wrapper.
    s3fs.S3FileSystem._cat_file = counted
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield counter
    finally:
        s3fs.S3FileSystem._cat_file = original
        s3fs.S3FileSystem.clear_instance_cache()


def _fresh_state(world_size: int, rank: int, fresh: bool) -> tuple[Any, Any]:
    model = make_model(11, DIMS)
    model = shard(model, world_size) if world_size > 1 else model
    optimizer = make_optimizer(model)
    if not fresh:
        seeded_step(model, optimizer, DIMS, rank, 11)
    return model, optimizer


def _snapshot(model: Any, optimizer: Any) -> tuple[Any, ...]:
    return full_model_state(model), full_optimizer_state(model, optimizer), len(optimizer.state)


def _objects(url: str) -> dict[str, bytes]:
    """Every object under ``url`` (recursively) and its bytes."""
    remote = RemoteDir(url)
    return {key: bytes(remote.fs.cat_file(key)) for key in remote.fs.find(remote.root)}


def _copy(src: str, dest: str) -> None:
    remote = RemoteDir(src)
    for key, data in _objects(src).items():
        remote.fs.pipe_file(RemoteDir(dest).root + key[len(remote.root) :], data)


def _damage(url: str, key: str, at: int, chunk: int = 0) -> str:
    """Flip one byte ``at`` bytes into chunk ``chunk`` of tensor ``key`` (uploading the modified
    object); returns the object's URL."""
    c = stored_chunks(url, key)[chunk]
    assert at < c["end"] - c["begin"]
    remote = RemoteDir(url)
    if "checkpoint" in c:
        remote = remote.parent.child(c["checkpoint"])
    data = bytearray(remote.fs.cat_file(remote.key(c["file"])))
    data[c["begin"] + at] ^= 0x20
    remote.write_bytes(c["file"], bytes(data))
    return f"{remote.url}/{c['file']}"


def _block_of(message: str) -> int:
    found = re.search(r"hash mismatch in block (\d+)", message)
    assert found, message
    return int(found.group(1))


def _tensor_bytes(model: Any, optimizer: Any) -> tuple[int, int]:
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return model_bytes, state_bytes


# ----------------------------------------------------------------------------- one process


@pytest.fixture
def saved(s3_bucket: str, tmp_path: Path, small_blocks: None) -> tuple[str, Path, Any, Any]:
    """The same trained model and optimizer saved to S3 and to a local folder."""
    model = make_model(7, DIMS)
    optimizer = make_optimizer(model)
    seeded_step(model, optimizer, DIMS, 0, 7)
    url, local = f"s3://{s3_bucket}/ck", tmp_path / "ck"
    for path in (url, local):
        shardsafe.save(path, {"model": model, "optim": optimizer})
    return url, local, model, optimizer


def test_s3_loads_equal_local_loads_and_download_each_byte_once(
    saved: tuple[str, Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, local, model, optimizer = saved
    total = sum(len(data) for data in _objects(url).values())
    chunks = sum(len(stored_chunks(url, key)) for key in transfer_keys(url))
    model_bytes, state_bytes = _tensor_bytes(model, optimizer)
    # A shard's first read takes HEAD_READ_BYTES (its header, usually whole): the tensor bytes in
    # that read are fetched again by the block reads, at most that much per shard object.
    slack = shard_files.HEAD_READ_BYTES * sum(1 for key in _objects(url) if key.endswith(".safetensors"))
    with counting_gets() as counter:
        shardsafe.verify(url)
    assert total <= counter.bytes <= total + slack, "verify downloads each byte of the checkpoint once"
    assert counter.gets <= chunks + 6, f"{counter.gets} GETs for {chunks} chunks: one request per block, not per chunk"
    once = counter.bytes
    for cache in (block_io.REMOTE_CACHE_BYTES, 0):
        monkeypatch.setattr(block_io, "REMOTE_CACHE_BYTES", cache)
        for atomic in (False, True):
            for fresh in (True, False):
                what = f"cache={cache} atomic={atomic} fresh={fresh}"
                expected = _fresh_state(1, 0, fresh)
                shardsafe.load(local, {"model": expected[0], "optim": expected[1]}, atomic=atomic)
                got = _fresh_state(1, 0, fresh)
                with counting_gets() as counter:
                    shardsafe.load(url, {"model": got[0], "optim": got[1]}, atomic=atomic)
                assert_tensors_equal(full_model_state(got[0]), full_model_state(expected[0]), what)
                assert_optimizer_equal(full_optimizer_state(*got), full_optimizer_state(*expected), what)
                # the cache keeps a small state's second pass off the network; without it the second
                # pass fetches what the first only checked: the model, and an allocated optimizer's state
                again = 0 if cache or not atomic else model_bytes + (0 if fresh else state_bytes)
                assert counter.bytes == once + again, (what, counter.bytes, once, again)
                assert counter.gets <= (2 if again else 1) * chunks + 6, (what, counter.gets, chunks)


def transfer_keys(url: str) -> list[str]:
    from shardsafe.core.format import MANIFEST_NAME, parse_manifest

    return list(parse_manifest(RemoteDir(url).read_bytes(MANIFEST_NAME, 1 << 30)).tensors)


WEIGHT = "model/layers.0.weight"
EXP_AVG = "optim/state/layers.0.weight/exp_avg"
DAMAGE = [  # (tensor, byte inside its chunk, block reported)
    (WEIGHT, 3, 0),
    (WEIGHT, 3 * BLOCK + 77, 3),
    (WEIGHT, 6 * BLOCK + 255, 6),  # the last byte of the partial last block
    (EXP_AVG, 2 * BLOCK + 1, 2),  # a fresh optimizer's state: read into place in the first pass
    ("optim/state/layers.0.weight/step", 0, 0),  # a scalar
]


def _load_failures(url: str) -> list[str]:
    """Every kind of load of damaged ``url``: each must raise and change nothing it must not change."""
    messages = []
    for atomic in (True, False):
        for fresh in (True, False):
            model, optimizer = _fresh_state(1, 0, fresh)
            before = _snapshot(model, optimizer)
            with pytest.raises(IntegrityError) as err:
                shardsafe.load(url, {"model": model, "optim": optimizer}, atomic=atomic)
            messages.append(str(err.value))
            after = _snapshot(model, optimizer)
            if fresh:
                assert after[2] == 0, f"atomic={atomic}: a fresh optimizer kept state after a failed load"
            if atomic:
                assert_tensors_equal(after[0], before[0], f"fresh={fresh}: model after a failed atomic load")
                assert_optimizer_equal(after[1], before[1], f"fresh={fresh}: optimizer after a failed atomic load")
    return messages


@pytest.mark.parametrize(("key", "at", "block"), DAMAGE, ids=[f"{k.rsplit('/', 1)[-1]}-{a}" for k, a, _ in DAMAGE])
def test_a_flipped_byte_in_an_object_is_named_and_changes_nothing(
    saved: tuple[str, Path, Any, Any], key: str, at: int, block: int
) -> None:
    url = saved[0]
    obj = _damage(url, key, at)
    objects = _objects(url)
    with pytest.raises(IntegrityError) as verified:
        shardsafe.verify(url)
    messages = [str(verified.value), *_load_failures(url)]
    for message in messages:
        assert obj in message and f"tensor {key!r}" in message and _block_of(message) == block, message
        assert len(message) < 400, message
    assert len(set(messages[1:])) == 1, messages  # every load reports the same block
    assert _objects(url) == objects, "a load changed an object"


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_a_truncated_or_missing_object(saved: tuple[str, Path, Any, Any], how: str) -> None:
    url = saved[0]
    file = stored_chunks(url, WEIGHT)[0]["file"]
    remote = RemoteDir(url)
    if how == "truncated":
        data = bytes(remote.fs.cat_file(remote.key(file)))
        remote.write_bytes(file, data[: len(data) - 100])
    else:
        remote.remove([file])
    objects = _objects(url)
    pattern = "manifest expects" if how == "truncated" else "shard object is missing"
    with pytest.raises(IntegrityError, match=pattern) as verified:
        shardsafe.verify(url)
    for message in [str(verified.value), *_load_failures(url)]:
        assert f"{url}/{file}" in message and re.search(pattern, message), message
        assert "Traceback" not in message and len(message) < 400, message
    assert _objects(url) == objects


def test_a_dedup_reference_into_a_sibling_on_s3(s3_bucket: str, small_blocks: None) -> None:
    root = f"s3://{s3_bucket}/run"
    model = make_model(7, DIMS)
    optimizer = make_optimizer(model)
    with shardsafe.CheckpointManager(root, dedup=True, keep_last=3) as manager:
        manager.save(1, {"model": model})
        with torch.no_grad():
            model.layers[-1].weight.add_(1.0)  # layers.0 unchanged: step 2 points into step 1's object
        manager.save(2, {"model": model})
        step1, step2 = (RemoteDir(f"{root}/{manager.step_path(step).name}").url for step in (1, 2))
    assert stored_chunks(step2, WEIGHT)[0].get("checkpoint") == RemoteDir(step1).name
    expected = full_model_state(model)
    for atomic in (True, False):
        got = make_model(11, DIMS)
        shardsafe.load(step2, {"model": got}, atomic=atomic)
        assert_tensors_equal(full_model_state(got), expected, f"dedup load atomic={atomic}")
    del optimizer
    obj = _damage(step2, WEIGHT, 4 * BLOCK + 9)
    assert obj.startswith(step1 + "/")
    with pytest.raises(IntegrityError) as verified:
        shardsafe.verify(step2)
    messages = [str(verified.value)]
    for atomic in (True, False):
        got = make_model(11, DIMS)
        before = full_model_state(got)
        with pytest.raises(IntegrityError) as err:
            shardsafe.load(step2, {"model": got}, atomic=atomic)
        messages.append(str(err.value))
        if atomic:
            assert_tensors_equal(full_model_state(got), before, "model after a failed dedup load")
    for message in messages:
        assert obj in message and f"tensor {WEIGHT!r}" in message and _block_of(message) == 4, message


# ----------------------------------------------------------------------------- 2 -> 3 ranks


def save_at_2(rank: int, world_size: int, url: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)  # ranks fork from a server started before the fixture set these
    use_small_blocks(BLOCK)
    model = shard(make_model(7, DIMS), world_size)
    optimizer = make_optimizer(model)
    seeded_step(model, optimizer, DIMS, rank, 7)
    shardsafe.save(url, {"model": model, "optim": optimizer})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


def load_at_3(
    rank: int, world_size: int, url: str, damaged: str, env: dict[str, str], reference: dict[str, Any]
) -> dict[str, Any]:
    """Load at 3 ranks (atomic or not, into a fresh or a stepped optimizer): equal to what 2 ranks saved;
    the damaged copy is refused, every object untouched when atomic."""
    os.environ.update(env)
    out: dict[str, Any] = {"gets": {}, "errors": {}}
    for atomic in (True, False):
        for fresh in (True, False):
            what = f"atomic={atomic} fresh={fresh}"
            got = _fresh_state(world_size, rank, fresh)
            with counting_gets() as counter:
                shardsafe.load(url, {"model": got[0], "optim": got[1]}, atomic=atomic)
            out["gets"][what] = counter.bytes
            assert_tensors_equal(full_model_state(got[0]), reference["model"], f"{what}: model loaded at 3 from S3")
            assert_optimizer_equal(full_optimizer_state(*got), reference["optim"], f"{what}: optimizer loaded at 3")
            model, optimizer = _fresh_state(world_size, rank, fresh)
            before = _snapshot(model, optimizer)
            try:
                shardsafe.load(damaged, {"model": model, "optim": optimizer}, atomic=atomic)
                out["errors"][what] = None
            except IntegrityError as exc:
                out["errors"][what] = re.sub(r"^\(reported by rank \d+\) ", "", str(exc))
            after = _snapshot(model, optimizer)
            if atomic:
                assert_tensors_equal(after[0], before[0], f"{what}: model after a failed load")
                assert_optimizer_equal(after[1], before[1], f"{what}: optimizer after a failed load")
            if fresh:
                assert after[2] == 0, f"{what}: a fresh optimizer kept state after a failed load"
    return out


@pytest.mark.timeout(150)
def test_resharding_2_to_3_from_s3(s3_bucket: str, tmp_path: Path) -> None:
    url, damaged = f"s3://{s3_bucket}/ck", f"s3://{s3_bucket}/damaged"
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    reference = run_ranks(save_at_2, 2, url, env, work_dir=tmp_path)[0]
    _copy(url, damaged)
    # Rows 32-47 of layers.0.weight share block 2 of rank 0's chunk; at 3 ranks rank 0 reads rows
    # 0-32 and rank 1 rows 33-65: both read that block.
    obj = _damage(damaged, WEIGHT, 40 * 256)
    objects = _objects(damaged)
    results = run_ranks(load_at_3, 3, url, damaged, env, reference, work_dir=tmp_path)  # each load checked there
    for r in results:
        for fresh in (True, False):  # small states: the cache keeps the second pass off the network
            assert r["gets"][f"atomic=True fresh={fresh}"] == r["gets"][f"atomic=False fresh={fresh}"], r["gets"]
    messages = {m for r in results for m in r["errors"].values()}
    assert len(messages) == 1 and None not in messages, messages
    message = messages.pop()
    assert obj in message and f"tensor {WEIGHT!r}" in message and _block_of(message) == 2, message
    assert _objects(damaged) == objects, "a load changed an object"
