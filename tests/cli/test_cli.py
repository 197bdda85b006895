"""The ``shardsafe`` command line: inspect, verify and the demo, run as a user runs them.

Checkpoints are made in the test (one process, no process group; the demo makes a 2-rank FSDP2
one). The main paths run as ``python -m shardsafe.cli`` in processes of their own (forked in one
batch from an interpreter that imported torch once: test_cli_runner.py), so exit codes, stdout
and stderr and the absence of tracebacks are what a user sees; the rest call ``cli.main`` in
process, because every extra interpreter pays for importing torch.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli_runner import run_forked
from torch import nn

import shardsafe
from shardsafe.cli import main as cli
from shardsafe.core.format import dtype_name
from shardsafe.manager.lease import LEASE_DIR
from shardsafe.protocol.commit import open_checkpoint

SHARD = "shard-00000.safetensors"


def assert_clean_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 1, one ``error:`` message naming what is wrong, no traceback, nothing on stdout."""
    assert result.returncode == 1, result
    assert result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    for needle in needles:
        assert needle in result.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process checkpoint holding every kind of state entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    model[2].to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": shardsafe.RNGState(),
        "step": 7,
        "scale": torch.arange(4),
    }
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    shardsafe.save(path, state, metadata={"loss": 1.25, "note": "from test_cli"})
    return path


@pytest.fixture(scope="module")
def runs(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The runs of ``python -m shardsafe.cli`` the tests below look at, made in one batch: each in
    its own process, forked from one interpreter that imported torch once (test_cli_runner.py
    holds those runs equal to fresh interpreters, byte for byte)."""
    import shutil

    scratch = tmp_path_factory.mktemp("cli-runs")
    damaged = scratch / "damaged"
    shutil.copytree(checkpoint, damaged)
    data = bytearray((damaged / SHARD).read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes: the header still parses, a block hash must not match
    (damaged / SHARD).write_bytes(bytes(data))
    argvs: dict[str, list[str | bytes]] = {
        "inspect --json": ["inspect", str(checkpoint), "--json"],
        "verify": ["verify", str(checkpoint)],
        "verify damaged": ["verify", str(damaged)],
        "verify missing": ["verify", str(scratch / "nowhere")],
    }
    done = run_forked(list(argvs.values()), scratch)
    return {
        name: subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode())
        for name, r in zip(argvs, done)
    }


def test_inspect_json_matches_the_manifest(checkpoint: Path, runs: dict[str, Any]) -> None:
    result = runs["inspect --json"]
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    manifest, tree = open_checkpoint(checkpoint)

    assert info["path"] == str(checkpoint)
    assert info["world_size"] == manifest.world_size == 1
    assert info["format_version"] == manifest.format_version
    assert info["writer_version"] == manifest.writer_version == shardsafe.__version__
    assert info["created"] == manifest.created
    assert info["metadata"] == {"loss": 1.25, "note": "from test_cli"}

    writers = {key: sorted({manifest.files[c.file].rank for c in t.chunks}) for key, t in manifest.tensors.items()}
    expected_tensors = {
        key: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "chunks": len(t.chunks), "bytes": t.nbytes}
        | {"layout": "listed chunks", "written_by": writers[key]}
        for key, t in manifest.tensors.items()
    }
    assert {t["key"]: {k: v for k, v in t.items() if k != "key"} for t in info["tensors"]} == expected_tensors
    assert expected_tensors["model/2.weight"]["dtype"] == "bfloat16"
    assert expected_tensors["model/0.weight"] == {
        "dtype": "float32",
        "shape": [5, 6],
        "chunks": 1,
        "bytes": 120,
        "layout": "listed chunks",
        "written_by": [0],
    }

    files = {f["name"]: f["size"] for f in info["files"]}
    assert files == {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    assert info["total_bytes"] == sum(files.values())
    assert info["tensor_bytes"] == sum(t.nbytes for t in manifest.tensors.values())

    state = {e["name"]: e for e in info["state"]}
    assert list(state) == list(tree)
    assert {name: e["kind"] for name, e in state.items()} == {
        "model": "module",
        "optim": "optimizer",
        "sched": "stateful",
        "rng": "per_rank",
        "step": "value",
        "scale": "tensor",
    }
    assert state["model"]["tensors"] == 4
    assert state["rng"]["ranks"] == 1
    assert state["step"]["value"] == 7
    assert state["sched"]["fields"]["last_epoch"] == 0 and state["sched"]["field_count"] == len(tree["sched"]["state"])


def test_inspect_human_output(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    manifest, _ = open_checkpoint(checkpoint)
    assert f"checkpoint    {checkpoint}" in out
    assert "world size    1" in out
    assert f"format v{manifest.format_version}, written by shardsafe {shardsafe.__version__}" in out
    for key in manifest.tensors:
        assert key in out
    rows = [line.split(None, 1)[1] for line in out.splitlines() if line.strip().startswith("model/2.weight ")]
    assert rows and re.fullmatch(r"bfloat16 +\[3, 5\] +1 +30 B +rank 0", rows[0]), rows
    for section in ("state entries (6)", f"tensors ({len(manifest.tensors)})", "files (3)", "metadata"):
        assert section in out
    assert '"note": "from test_cli"' in out
    assert "one entry per rank (1 rank)" in out
    assert "last_epoch=0" in out


def test_verify_sound_checkpoint(checkpoint: Path, runs: dict[str, Any]) -> None:
    result = runs["verify"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ok: {checkpoint}: ")
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr == ""


def test_verify_corrupted_checkpoint_names_the_file(runs: dict[str, Any]) -> None:
    damaged = Path(runs["verify damaged"].args[1])
    assert_clean_error(runs["verify damaged"], str(damaged / SHARD), "hash mismatch")


def test_missing_path_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], runs: dict[str, Any]
) -> None:
    assert_clean_error(runs["verify missing"], runs["verify missing"].args[1])
    missing = tmp_path / "nowhere"
    assert cli.main(["inspect", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and str(missing) in captured.err and not captured.out


def test_inspect_refuses_a_tampered_state_file(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    (damaged / "state.json").write_text((damaged / "state.json").read_text().replace('"step"', '"stap"'))
    assert cli.main(["inspect", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "state.json" in err


def test_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needles in (
        (["--help"], ("inspect", "verify", "demo")),
        (["demo", "--help"], ("--steps", "--save-every", "--out", "--nproc", "--preempt-at", "--crash-after")),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        for needle in needles:
            assert needle in out


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    assert cli.main(["demo", "--out", str(tmp_path)]) == 1
    assert "was not made by `shardsafe demo`" in capsys.readouterr().err
    assert precious.read_text() == "keep me"


def test_demo_rejects_a_schedule_that_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "4", "--save-every", "4", "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "--crash-after" in err and "--preempt-at" in err
    assert (
        cli.main(["demo", "--steps", "12", "--preempt-at", "8", "--crash-after", "6", "--out", str(tmp_path / "d")])
        == 1
    )
    assert "must come before the crash" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def test_demo_end_to_end(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Preempt (SIGTERM), resume, SIGKILL, resume, reshard 2 -> 1, verify; then check the checkpoints ourselves.

    12 steps, a save every 3: run 1 saves step 3 (async) and is preempted after step 5 (final save of 5);
    run 2 resumes at 5, saves 6 (async) and is killed after step 8; run 3 resumes from 6 and saves 9 and 12.
    The orchestrator runs in this process (its three torchrun launches are real subprocesses), which saves
    an interpreter importing torch; capfd also catches what the workers write.
    """
    from shardsafe.cli.demo.model import GPTConfig, TinyGPT, evaluate, split_corpus
    from shardsafe.manager.catalog import committed_steps
    from shardsafe.manager.naming import step_name

    out = tmp_path / "demo"
    code = cli.main(["demo", "--steps", "12", "--save-every", "3", "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 0, f"stdout:\n{captured.out}\nstderr:\n{captured.err}"
    text = " ".join(captured.out.split())  # the summary wraps its paragraphs
    assert "Traceback" not in captured.err
    summary = _summary(out)

    # Preemption: SIGTERM after step 5, every rank saved step 5 at that boundary and exited with 0.
    assert summary["preempt_after"] == summary["preempted_step"] == summary["final_save_step"] == 5
    assert "after step 5 rank 0 sent SIGTERM" in text and "final checkpoint of step 5 synchronously" in text
    assert summary["exit_codes"][0] == 0 and summary["exit_codes"][1] != 0 and summary["exit_codes"][2] == 0
    assert summary["committed_after_preemption"] == [3, 5]
    assert summary["resume1_step"] == 5 and summary["run_steps"][:2] == [[1, 5], [6, 8]]

    # Crash: SIGKILL after step 8; run 3 resumes from the newest committed checkpoint (the async save of
    # step 6, started two steps before the kill; were it still in flight, step 5 would be the newest).
    assert summary["crash_after"] == 8
    resumed = summary["resume2_step"]
    assert resumed == summary["committed_after_crash"][-1] == max(summary["committed_at_kill"])
    assert resumed == 6, summary["committed_after_crash"]
    assert f"restore() loaded step {resumed}, the newest committed checkpoint" in text
    assert summary["run_steps"][2] == [resumed + 1, 12]
    assert summary["replayed_steps"] == list(range(resumed + 1, 9)) and summary["replay_max_abs_diff"] == 0

    # Async saves block the loop for less time than a synchronous save of the same state.
    modes = [(s["step"], s["mode"]) for s in summary["saves"]]
    assert modes == [(3, "async"), (5, "final"), (6, "async"), (9, "async"), (12, "async")]
    assert 0 < summary["async_blocked_median"] < summary["sync_save_seconds"]
    assert "saves blocked the training loop for median" in text

    # Retention: the last 3 plus the best by held-out loss; list_checkpoints agrees with the summary.
    root = out / "ckpt"
    eval_loss = {s["step"]: s["eval_loss"] for s in summary["saves"]}
    best = min(eval_loss, key=lambda step: (eval_loss[step], -step))
    expected = sorted({9, 12, resumed} | {best})
    assert committed_steps(root) == summary["kept_steps"] == expected
    infos = shardsafe.list_checkpoints(root)
    assert [i.step for i in infos] == expected
    assert [i.step for i in infos if i.best] == [best] == [summary["best_step"]]
    assert [i.step for i in infos if i.latest] == [12] == [summary["latest_step"]]
    assert summary["retired_steps"] == sorted(set(eval_loss) - set(expected))
    # nothing half-written or half-deleted left
    assert not [p.name for p in root.iterdir() if p.name.startswith(".") and p.name != LEASE_DIR]

    # The final checkpoint verifies, and as a 2-rank one loads into a plain module, giving the same loss.
    assert summary["verify_passed"] is True and summary["final_checkpoint"] == step_name(12)
    final = root / step_name(12)
    shardsafe.verify(final)
    manifest, _ = open_checkpoint(final)
    assert manifest.world_size == 2
    rule = manifest.tensors["model/blocks.0.mlp.0.weight"].rule  # format 2: a rule over the 2 ranks, no listed chunks
    assert rule is not None and rule.is_v2_split and rule.parts == 2
    model = TinyGPT(GPTConfig())
    state: dict[str, Any] = {"model": model, "step": 0}
    shardsafe.load(final, state)
    assert state["step"] == 12
    assert summary["loss_end"] < summary["loss_start"]
    assert abs(summary["eval_loss_one_process"] - summary["eval_loss_ranks"]) < 1e-4
    assert evaluate(model, split_corpus()[1], model.cfg.seq_len) == pytest.approx(summary["eval_loss_ranks"], abs=1e-4)
    assert evaluate(model, split_corpus()[1], model.cfg.seq_len) == pytest.approx(eval_loss[12], abs=1e-4)

    assert cli.main(["inspect", str(final), "--json"]) == 0
    info = json.loads(capfd.readouterr().out)
    assert info["world_size"] == 2
    assert {e["name"]: e["kind"] for e in info["state"]} == {
        "model": "module",
        "optim": "optimizer",
        "sched": "stateful",
        "rng": "per_rank",
        "step": "value",
    }
    assert info["metadata"]["shardsafe.manager"]["step"] == 12
    assert not (out / "sync-reference").exists()
