"""Many ``python -m shardsafe.cli`` runs, fast: :func:`run_forked`, and the check that it is what a
fresh interpreter does.

One interpreter imports torch and the CLI once, then forks one child per run, which points fd 1
and 2 at files and runs the ``shardsafe.cli`` module as ``-m`` would (``sys.exit(main())``; an
uncaught exception prints its traceback and exits 1, as the interpreter does; a run that hangs
is killed by SIGALRM). Each run is still a process of its own, with nothing carried over from
another; only the second or so of importing torch is shared, which makes the hostile suite's two
hundred runs take seconds instead of minutes.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

import shardsafe

TIMEOUT = 120.0  # seconds per run

RUNNER = """
import base64, json, os, runpy, signal, sys, traceback
import torch, shardsafe.cli.main, shardsafe.hf.export, shardsafe.manager.manager
jobs = json.load(open(sys.argv[1]))
codes = []
for job in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(int(job["timeout"]))
            for fd, path in ((1, job["out"]), (2, job["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            sys.argv = ["shardsafe"] + [os.fsdecode(base64.b64decode(a)) for a in job["argv"]]
            try:
                runpy.run_module("shardsafe.cli", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
json.dump(codes, open(sys.argv[2], "w"))
"""


def cli_env() -> dict[str, str]:
    """The environment of a CLI run: this checkout's shardsafe first, no debug switch."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(shardsafe.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("SHARDSAFE_DEBUG", None)
    return env


def run_forked(
    argvs: list[list[str | bytes]], scratch: Path, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[bytes]]:
    """``python -m shardsafe.cli`` for each argv, each in its own (forked) process; files go in ``scratch``."""
    jobs = [
        {
            "argv": [base64.b64encode(os.fsencode(a)).decode() for a in argv],
            "out": str(scratch / f"{i}.out"),
            "err": str(scratch / f"{i}.err"),
            "timeout": TIMEOUT,
        }
        for i, argv in enumerate(argvs)
    ]
    (scratch / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run(
        [sys.executable, "-c", RUNNER, str(scratch / "jobs.json"), str(scratch / "codes.json")],
        check=True,
        env=cli_env() if env is None else env,
        timeout=60 + TIMEOUT * len(jobs),
    )
    codes = json.loads((scratch / "codes.json").read_text())
    return [
        subprocess.CompletedProcess(argv, code, Path(job["out"]).read_bytes(), Path(job["err"]).read_bytes())
        for argv, code, job in zip(argvs, codes, jobs)
    ]


def run_real(argv: list[str | bytes]) -> subprocess.CompletedProcess[bytes]:
    """``python -m shardsafe.cli ARGV`` in a fresh interpreter, exactly as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "shardsafe.cli", *argv], capture_output=True, timeout=TIMEOUT, env=cli_env()
    )


def test_forked_runs_match_real_interpreters(tmp_path: Path) -> None:
    """Same exit status, stdout and stderr as a fresh ``python -m shardsafe.cli``: success, JSON,
    an error naming a path that is not UTF-8 or holds escapes, a malformed field, usage errors."""
    ckpt = tmp_path / "root" / "step-0000000002"
    shardsafe.save(ckpt, {"model": nn.Linear(2, 2), "t": torch.arange(3)})
    bad = tmp_path / "bad"
    bad.mkdir()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "world_size": "two"}))
    argvs: list[list[str | bytes]] = [
        ["--version"],
        ["inspect", str(ckpt)],
        ["inspect", str(ckpt), "--json"],
        ["verify", str(ckpt)],
        ["list", str(tmp_path / "root")],
        ["inspect", str(bad)],
        ["verify", os.fsencode(str(tmp_path)) + b"/\xff-missing"],
        ["inspect", str(tmp_path / "x\x1b[2J\u202e")],
        ["demo", "--steps", "0"],
        ["nonsense"],
    ]
    forked = run_forked(argvs, tmp_path)
    assert [r.returncode for r in forked] == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    with ThreadPoolExecutor(2) as pool:  # the fresh interpreters, two at a time (each mostly imports torch)
        reals = list(pool.map(run_real, argvs))
    for argv, got, real in zip(argvs, forked, reals):
        assert (got.returncode, got.stdout, got.stderr) == (real.returncode, real.stdout, real.stderr), argv


def test_an_uncaught_exception_shows_as_the_interpreter_shows_it(tmp_path: Path) -> None:
    """What the hostile suite looks for (a traceback, exit 1) is what a crash gives under the runner."""
    argv: list[str | bytes] = ["inspect", str(tmp_path / "missing")]
    debug_env = dict(cli_env(), SHARDSAFE_DEBUG="1")
    (got,) = run_forked([argv], tmp_path, env=debug_env)
    real = subprocess.run(
        [sys.executable, "-m", "shardsafe.cli", *argv], capture_output=True, timeout=TIMEOUT, env=debug_env
    )
    assert got.returncode == real.returncode == 1
    assert b"Traceback (most recent call last)" in got.stderr and b"CheckpointNotFoundError" in got.stderr
    assert got.stderr.splitlines()[-1] == real.stderr.splitlines()[-1]
