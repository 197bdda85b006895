"""``shardsafe.hub.push`` against a local S3 (moto) and a local Hugging Face Hub, on 1 and 2 ranks.

Nothing leaves 127.0.0.1: the fixtures of ``servers.fixtures`` start a ``moto.server`` subprocess
and an in-process Hub server and point boto3 / s3fs / huggingface_hub at them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.core.format import MANIFEST_NAME
from shardsafe.errors import ModelFolderError, PushError, ShardsafeError
from shardsafe.hf import push as hubmod
from shardsafe.hf import push_fsspec, push_retry
from shardsafe.hf.guard import INDEX_FILE, SINGLE_FILE

pytest_plugins = ["servers.fixtures"]  # moto_server, s3_bucket, hub_server, hub
# huggingface_hub 2.4 hands LFS files to httpx2 as `data=`, which httpx2 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny transformers model saved single-file and sharded, and a shardsafe checkpoint of a small module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="10KB")
    assert (root / "single" / SINGLE_FILE).is_file() and (root / "sharded" / INDEX_FILE).is_file()
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 1
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "reference.pt")

    module = small_module(seed=1)
    shardsafe.save(root / "ckpt", {"model": module, "step": 7}, metadata={"note": "push test"})
    return {
        "single": root / "single",
        "sharded": root / "sharded",
        "ckpt": root / "ckpt",
        "reference": root / "reference.pt",
    }


def small_module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def s3fs_client() -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def bucket_files(bucket: str, prefix: str = "") -> dict[str, bytes]:
    fs = s3fs_client()
    base = f"{bucket}/{prefix}".rstrip("/")
    if not fs.exists(base):
        return {}
    return {path[len(base) + 1 :]: fs.cat_file(path) for path in sorted(fs.find(base))}


def uploaded_order(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.args[0] for r in caplog.records if r.name == "shardsafe.hf.push" and r.msg.startswith("uploaded ")]  # type: ignore[index]


# ----------------------------------------------------------------------------- no server


def test_plan_puts_the_commit_marker_last_and_skips_hidden_files(models: dict[str, Path], tmp_path: Path) -> None:
    for name, marker in (("single", SINGLE_FILE), ("sharded", INDEX_FILE), ("ckpt", MANIFEST_NAME)):
        folder = tmp_path / name
        shutil.copytree(models[name], folder)
        (folder / ".cache").mkdir()
        (folder / ".cache" / "junk").write_text("x")
        (folder / ".DS_Store").write_text("x")
        (folder / "docs").mkdir()
        (folder / "docs" / "README.md").write_text("hello")
        plan = hubmod.plan_upload(folder)
        names = [f.name for f in plan.files]
        assert plan.marker == marker and names[-1] == marker and names.count(marker) == 1
        assert sorted(names) == sorted(n for n in local_files(folder) if not n.startswith("."))
        assert names[:-1] == sorted(names[:-1]) and "docs/README.md" in names
        assert plan.total_bytes == sum(f.size for f in plan.files)

    # a config next to a checkpoint subfolder (save_pretrained without gathering): the nested manifest is the marker
    nested = tmp_path / "nested"
    shutil.copytree(models["ckpt"], nested / "checkpoint")
    shutil.copy(models["single"] / "config.json", nested)
    names = [f.name for f in hubmod.plan_upload(nested).files]
    assert names[-1] == "checkpoint/manifest.json" and names[0] == "checkpoint/shard-00000.safetensors", names
    assert sorted(names) == sorted(local_files(nested))


def test_destinations() -> None:
    assert hubmod.parse_destination("hf://owner/name") == hubmod.Destination("hub", "hf://owner/name", "owner/name")
    assert hubmod.parse_destination("hf://models/owner/name/").repo_id == "owner/name"
    assert hubmod.parse_destination("owner/name").url == "hf://owner/name"
    assert hubmod.parse_destination("s3://bucket/some/prefix/") == hubmod.Destination(
        "fsspec", "s3://bucket/some/prefix"
    )
    assert hubmod.parse_destination("file:///tmp/x").kind == "fsspec"
    for bad in ("just-a-name", "a/b/c", "hf://datasets/owner/name", "hf://owner", "s3://", "/abs/path"):
        with pytest.raises(PushError):
            hubmod.parse_destination(bad)


def test_push_to_a_local_folder_url(models: dict[str, Path], tmp_path: Path) -> None:
    dest = tmp_path / "out" / "model"
    assert shardsafe.push(models["sharded"], f"file://{dest}", progress=False) == f"file://{dest}"
    assert local_files(dest) == local_files(models["sharded"])  # no temporary left behind
    with pytest.raises(PushError, match="only applies to Hub destinations"):
        shardsafe.push(models["sharded"], f"file://{dest}", private=True)


def test_a_push_stopped_before_its_marker_publishes_nothing(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``push:before-marker`` fault point (core/faults.py): every file is up, the commit marker is not."""
    dest = tmp_path / "stopped"
    monkeypatch.setenv("SHARDSAFE_FAIL_AT", "push:before-marker")
    with pytest.raises(PushError, match="injected I/O error at push:before-marker"):
        shardsafe.push(models["sharded"], f"file://{dest}", progress=False)
    monkeypatch.delenv("SHARDSAFE_FAIL_AT")
    expected = local_files(models["sharded"])
    assert set(local_files(dest)) == set(expected) - {INDEX_FILE}, "everything but the commit marker"


# ----------------------------------------------------------------------------- S3


def test_push_to_s3_round_trip(
    s3_bucket: str, models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="shardsafe.hf.push")
    for name, marker in (("single", SINGLE_FILE), ("sharded", INDEX_FILE), ("ckpt", MANIFEST_NAME)):
        caplog.clear()
        url = shardsafe.push(models[name], f"s3://{s3_bucket}/models/{name}", progress=False)
        assert url == f"s3://{s3_bucket}/models/{name}"
        assert bucket_files(s3_bucket, f"models/{name}") == local_files(models[name])
        order = uploaded_order(caplog)
        assert order[-1] == marker and sorted(order) == sorted(local_files(models[name])), order

    # the checkpoint, downloaded again, verifies and loads
    fs = s3fs_client()
    back = tmp_path / "ckpt-back"
    fs.get(f"{s3_bucket}/models/ckpt/", str(back), recursive=True)
    assert shardsafe.verify(back)["tensors"] == 4
    restored = {"model": small_module(seed=2), "step": 0}
    shardsafe.load(back, restored)
    assert restored["step"] == 7
    for key, value in small_module(seed=1).state_dict().items():
        assert torch.equal(restored["model"].state_dict()[key], value), key


def test_s3_push_failing_midway_leaves_no_model(
    s3_bucket: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = f"s3://{s3_bucket}/m"
    shardsafe.push(models["sharded"], dest, progress=False)  # an earlier, complete model at the destination
    assert INDEX_FILE in bucket_files(s3_bucket, "m")

    real_put = push_fsspec._put_one
    calls: list[str] = []

    def failing_put(fs: Any, root: str, f: hubmod.UploadFile, local: bool, bar: Any) -> None:
        calls.append(f.name)
        if len(calls) == 3:
            raise PermissionError(f"injected: access denied to {f.name}")
        real_put(fs, root, f, local, bar)

    monkeypatch.setattr(push_fsspec, "_put_one", failing_put)
    with pytest.raises(PushError) as info:
        shardsafe.push(models["sharded"], dest, progress=False)
    message = str(info.value)
    assert dest in message and f"uploading {calls[2]} failed" in message and "PermissionError" in message, message
    assert len(calls) == 3  # a permanent error is not retried
    stored = bucket_files(s3_bucket, "m")
    assert INDEX_FILE not in stored, "the old commit marker must be gone and the new one never uploaded"
    assert set(calls[:2]) <= set(stored)


def test_s3_push_retries_transient_errors(
    s3_bucket: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(push_retry, "BACKOFF_S", 0.01)
    real_put = push_fsspec._put_one
    failures: list[str] = []

    def flaky_put(fs: Any, root: str, f: hubmod.UploadFile, local: bool, bar: Any) -> None:
        if f.name not in failures:
            failures.append(f.name)
            raise ConnectionResetError(f"injected: connection reset while sending {f.name}")
        real_put(fs, root, f, local, bar)

    monkeypatch.setattr(push_fsspec, "_put_one", flaky_put)
    shardsafe.push(models["single"], f"s3://{s3_bucket}/flaky", progress=False)
    assert bucket_files(s3_bucket, "flaky") == local_files(models["single"])
    assert sorted(failures) == sorted(local_files(models["single"]))
    assert any("retrying" in r.getMessage() for r in caplog.records if r.name == "shardsafe.hf.push")

    # bounded: a file that never goes up fails after MAX_ATTEMPTS tries
    monkeypatch.setattr(push_fsspec, "_put_one", lambda *a: (_ for _ in ()).throw(TimeoutError("injected: timed out")))
    with pytest.raises(PushError, match=f"after {push_retry.MAX_ATTEMPTS} attempts"):
        shardsafe.push(models["single"], f"s3://{s3_bucket}/never", progress=False)
    assert bucket_files(s3_bucket, "never") == {}


# ----------------------------------------------------------------------------- refusals


SEED_FAILURE = "holds no tensors: looks like a ZeRO-3 save without gathered weights"


def zero3_dummy(models: dict[str, Path], root: Path) -> Path:
    """What a ZeRO-3 save without gathering leaves: config.json next to an empty state dict saved as safetensors."""
    from safetensors.torch import save_file

    folder = root / "zero3-dummy"
    folder.mkdir(parents=True)
    shutil.copy(models["single"] / "config.json", folder)
    save_file({}, str(folder / SINGLE_FILE))
    assert (folder / SINGLE_FILE).stat().st_size == 16
    return folder


def dummy_models(models: dict[str, Path], root: Path) -> dict[str, Path]:
    from safetensors.torch import save_file

    out = {"empty folder": root / "empty", "no tensors (the ZeRO-3 dummy)": zero3_dummy(models, root)}
    out["empty folder"].mkdir(parents=True)
    zero = root / "zero-tensors"
    zero.mkdir()
    shutil.copy(models["single"] / "config.json", zero)
    save_file({"model.embed_tokens.weight": torch.zeros(0), "lm_head.weight": torch.zeros(0)}, zero / SINGLE_FILE)
    out["tensors of shape (0,)"] = zero
    missing = root / "missing-shard"
    shutil.copytree(models["sharded"], missing)
    next(iter(sorted(missing.glob("model-*.safetensors")))).unlink()
    out["a shard listed in the index is missing"] = missing
    return out


def test_push_refuses_empty_or_dummy_models(
    s3_bucket: str, hub: Any, models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardsafe.cli import main as cli

    for what, folder in dummy_models(models, tmp_path).items():
        for dest in (f"s3://{s3_bucket}/dummy", "hf://owner/dummy"):
            with pytest.raises(ModelFolderError):
                shardsafe.push(folder, dest, progress=False)
        assert cli.main(["push", str(folder), "owner/dummy-cli", "--no-progress"]) == 1, what
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(folder) in err, err
    assert bucket_files(s3_bucket) == {}
    assert hub.repo_ids() == [] and hub.requests == [], "nothing may reach the Hub"


def test_the_zero3_dummy_is_refused_on_every_path(
    s3_bucket: str, hub: Any, models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The seed failure: `shardsafe push dummy DEST` (and the API) refuse it, in its own words, and upload nothing."""
    from shardsafe.cli import main as cli

    dummy = zero3_dummy(models, tmp_path)
    expected = f"{dummy / SINGLE_FILE} {SEED_FAILURE}"
    folder = tmp_path / "dest" / "model"
    for dest in (f"file://{folder}", f"s3://{s3_bucket}/dummy", "hf://owner/dummy", "owner/dummy"):
        assert cli.main(["push", str(dummy), dest, "--no-progress"]) == 1, dest
        err = capsys.readouterr().err
        assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
        with pytest.raises(ModelFolderError) as info:
            shardsafe.push(dummy, dest, progress=False)
        assert str(info.value).startswith(expected), str(info.value)
    assert not (tmp_path / "dest").exists(), "nothing may be written to a file:// destination"
    assert bucket_files(s3_bucket) == {}, "nothing may be written to the bucket"
    assert hub.repo_ids() == [] and hub.requests == [], "nothing may reach the Hub"


# ----------------------------------------------------------------------------- Hub

FROM_PRETRAINED = """
import json, sys, torch
from transformers import AutoModelForCausalLM
reference = torch.load(sys.argv[1])
out = {}
for repo in sys.argv[2:]:
    state = AutoModelForCausalLM.from_pretrained(repo).state_dict()
    out[repo] = sorted(state) == sorted(reference) and all(torch.equal(state[k], reference[k]) for k in reference)
print("RESULT " + json.dumps(out))
"""


def test_push_to_hub_then_from_pretrained(
    hub: Any,
    models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shardsafe.cli import main as cli

    single, sharded = local_files(models["single"]), local_files(models["sharded"])
    url = shardsafe.push(models["single"], "hf://owner/tiny", private=True, message="first upload", progress=False)
    assert url.startswith(f"{hub.url}/owner/tiny/commit/")
    assert [c.title for c in hub.commits("owner/tiny")] == ["first upload", "initial commit"]
    assert url.endswith(hub.commits("owner/tiny")[0].oid) and hub.repo("owner/tiny").private
    assert {k: v for k, v in hub.files("owner/tiny").items() if k != ".gitattributes"} == single

    # a transient failure of the commit call is retried; all files still land in one commit
    monkeypatch.setattr(push_retry, "BACKOFF_S", 0.01)
    hub.fail_next("POST", r"^/api/models/owner/tiny-sharded/commit/main$", status=503)
    shardsafe.push(models["sharded"], "owner/tiny-sharded", progress=False)
    assert [s for m, p, s in hub.requests if m == "POST" and p.endswith("/tiny-sharded/commit/main")] == [503, 200]
    assert len(hub.commits("owner/tiny-sharded")) == 2
    assert {k: v for k, v in hub.files("owner/tiny-sharded").items() if k != ".gitattributes"} == sharded

    # re-pushing another kind of model removes the old commit marker in the same commit
    shardsafe.push(models["sharded"], "hf://owner/tiny", revision="dev", progress=False)
    assert SINGLE_FILE not in hub.files("owner/tiny", "dev") and INDEX_FILE in hub.files("owner/tiny", "dev")
    assert SINGLE_FILE in hub.files("owner/tiny")  # main is untouched by a push to another branch
    shardsafe.push(models["sharded"], "hf://owner/tiny", message="now sharded", progress=False)
    assert SINGLE_FILE not in hub.files("owner/tiny") and INDEX_FILE in hub.files("owner/tiny")
    assert len(hub.commits("owner/tiny")) == 3

    assert (
        cli.main(["push", str(models["single"]), "owner/tiny-cli", "--message", "from the CLI", "--no-progress"]) == 0
    )
    assert f"{hub.url}/owner/tiny-cli/commit/" in capsys.readouterr().out
    assert hub.commits("owner/tiny-cli")[0].title == "from the CLI"

    # a permanent error (403: the token may not write) fails at once, without retries
    hub.fail_next("POST", r"/preupload/", status=403)
    with pytest.raises(PushError, match=r"hf://owner/tiny-cli: committing .* failed: .*403"):
        shardsafe.push(models["single"], "owner/tiny-cli", progress=False)

    env = {**os.environ, **hub.client_env(tmp_path / "hf-home-download")}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FROM_PRETRAINED,
            str(models["reference"]),
            "owner/tiny",
            "owner/tiny-sharded",
            "owner/tiny-cli",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    log = proc.stdout.decode(errors="replace")
    results = [line for line in log.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, log[-5000:]
    assert json.loads(results[-1][len("RESULT ") :]) == {
        "owner/tiny": True,
        "owner/tiny-sharded": True,
        "owner/tiny-cli": True,
    }


# ----------------------------------------------------------------------------- two ranks


def push_on_ranks(rank: int, world_size: int, src: str, good: str, bad: str, dummy: str) -> list[Any]:
    """Rank function: only rank 0 has ``src``; every push must give the same result on both ranks."""
    mine = src if rank == 0 else f"{src}-does-not-exist-on-rank-{rank}"
    out: list[Any] = [shardsafe.push(mine, good, progress=False)]
    for dest, folder in ((bad, mine), (good, dummy if rank == 0 else mine)):
        try:
            shardsafe.push(folder, dest, progress=False)
            out.append(("no error",))
        except ShardsafeError as exc:
            out.append((type(exc).__name__, str(exc)))
    return out


def test_push_is_collective(s3_bucket: str, models: dict[str, Path], tmp_path: Path) -> None:
    from dist_utils import load_results, torchrun_command, torchrun_env

    dummy = zero3_dummy(models, tmp_path / "dummies")
    good, bad = f"s3://{s3_bucket}/collective", f"s3://no-such-bucket-{s3_bucket}/x"
    out = tmp_path / "out"
    cmd = torchrun_command(
        push_on_ranks, out, (str(models["ckpt"]), good, bad, str(dummy)), ["--standalone", "--nproc_per_node", "2"]
    )
    proc = subprocess.Popen(
        cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log = proc.communicate(timeout=240)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == 0, log[-5000:]
    results = load_results(out, 2)
    assert results[0] == results[1], results
    url, missing_bucket, refused = results[0]
    assert url == good and bucket_files(s3_bucket, "collective") == local_files(models["ckpt"])
    assert missing_bucket[0] == "PushError" and bad in missing_bucket[1] and "does not exist" in missing_bucket[1], (
        missing_bucket
    )
    assert refused[0] == "ModelFolderError" and SEED_FAILURE in refused[1], refused
