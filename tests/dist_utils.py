"""Helpers for the multi-process tests: launching gloo ranks, small sharded models, reference states.

Ranks are started in one of two ways:

* :func:`launch` / :func:`run_ranks` fork them from a ``multiprocessing`` forkserver that has
  already imported torch, FSDP2 and shardsafe (importing torch costs several seconds per process
  on a small machine, forking costs milliseconds). Each rank joins a real gloo process group
  through a fresh ``file://`` store. Like ``torch.distributed.run``, the launcher ends the other
  ranks (SIGTERM, then SIGKILL) as soon as one rank dies, and every wait is bounded.
* :func:`torchrun_command` builds a real ``python -m torch.distributed.run`` command line that runs
  this file as the worker script (see ``__main__`` below), for the tests that need the real
  launcher (several "nodes", a launcher that dies with its job).

A rank function is ``fn(rank, world_size, *args)`` defined at module level in a test module; what
it returns is sent back to the test process (``torch.save``), where the assertions happen.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are on this machine; avoid depending on DNS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

import shardsafe  # noqa: E402,F401

TESTS_DIR = Path(__file__).resolve().parent
# torch._dynamo is what fully_shard imports lazily (seconds); preloaded, forked ranks skip that too.
PRELOAD = [
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "shardsafe",
    "pytest",
]
PG_TIMEOUT_S = 60.0  # a collective waiting on a dead peer fails after this (the launcher kills first)
LAUNCH_TIMEOUT_S = 150.0
TERM_GRACE_S = 5.0

# ----------------------------------------------------------------------------- launching ranks


@dataclass
class LaunchResult:
    world_size: int
    exitcodes: list[int | None]  # None: still running when the deadline passed (then killed)
    results: list[Any]  # what each rank function returned (None when it did not return)
    logs: list[str]  # each rank's stdout/stderr, tracebacks included
    timed_out: bool
    first_failure: int | None  # rank whose death was noticed first

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.exitcodes)

    def describe(self) -> str:
        parts = [
            f"world_size={self.world_size} exitcodes={self.exitcodes} timed_out={self.timed_out} "
            f"first_failure={self.first_failure}"
        ]
        for rank, log in enumerate(self.logs):
            parts.append(f"----- rank {rank} log (last 4000 chars) -----\n{log[-4000:]}")
        return "\n".join(parts)


_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        # The forkserver imports these once and every rank forks from it. (Modules from site-packages
        # only: Python 3.11's forkserver does not apply the parent's sys.path before preloading.)
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, store: str, out_dir: str, args: tuple[Any, ...]
) -> None:
    out = Path(out_dir)
    log = open(out / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log)  # a hung rank gets SIGABRT from the launcher: its stacks land in the log
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, world_size, *args)
        _save_result(out, rank, result)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc(file=log)
        log.flush()
        os._exit(1)
    log.flush()


def _save_result(out: Path, rank: int, result: Any) -> None:
    tmp = out / f"rank{rank}.result.tmp"
    torch.save(result, tmp)
    os.replace(tmp, out / f"rank{rank}.result")


def _load_results(out: Path, world_size: int) -> list[Any]:
    results = []
    for rank in range(world_size):
        path = out / f"rank{rank}.result"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results


def _end(procs: list[Any]) -> None:
    """Stop what is still running the way torch.distributed.run does: SIGTERM, then SIGKILL."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + TERM_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            p.kill()
            p.join(TERM_GRACE_S)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    work_dir: str | os.PathLike[str],
    timeout: float = LAUNCH_TIMEOUT_S,
) -> LaunchResult:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; never raises for rank failures.

    As soon as one rank exits with an error or a signal, the others are terminated, so a rank
    stuck in a collective with a dead peer cannot hang the test. ``timeout`` bounds the whole run.
    """
    ctx = _context()
    out = Path(work_dir) / f"launch-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    store = str(out / "store")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, store, str(out), args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    pending = {p.sentinel: r for r, p in enumerate(procs)}
    first_failure = None
    timed_out = False
    while pending:
        ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            timed_out = True
            break
        for sentinel in ready:
            rank = pending.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0 and first_failure is None:
                first_failure = rank
        if first_failure is not None:
            break
    if timed_out:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGABRT)  # faulthandler writes the stacks into the rank's log
                p.join(TERM_GRACE_S)
    exitcodes_at_end = [p.exitcode for p in procs]
    _end(procs)
    logs = [
        (out / f"rank{r}.log").read_text(errors="replace") if (out / f"rank{r}.log").exists() else ""
        for r in range(world_size)
    ]
    exitcodes = [p.exitcode if not timed_out else exitcodes_at_end[r] for r, p in enumerate(procs)]
    return LaunchResult(world_size, exitcodes, _load_results(out, world_size), logs, timed_out, first_failure)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    work_dir: str | os.PathLike[str],
    timeout: float = LAUNCH_TIMEOUT_S,
) -> list[Any]:
    """Like :func:`launch`, but every rank must succeed; returns the per-rank results."""
    result = launch(fn, world_size, *args, work_dir=work_dir, timeout=timeout)
    if not result.ok:
        raise AssertionError(f"a rank failed\n{result.describe()}")
    return result.results


# DeepSpeed tests need the package (DS_BUILD_OPS=0 pip install deepspeed) and g++ (it compiles an op at first start)
HAVE_DEEPSPEED = (
    importlib.util.find_spec("deepspeed") is not None and shutil.which(os.environ.get("CXX", "g++")) is not None
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(
    fn: Callable[..., Any], out_dir: str | os.PathLike[str], args: tuple[Any, ...], launcher_args: list[str]
) -> list[str]:
    """``python -m torch.distributed.run <launcher_args> tests/dist_utils.py <module:function> <out> <args file>``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args_file = out / f"args-{time.monotonic_ns()}.pt"
    torch.save(args, args_file)
    module_file = getattr(sys.modules.get(fn.__module__), "__file__", None)  # tests live in per-layer folders
    folder = str(Path(module_file).resolve().parent) if module_file else str(TESTS_DIR)
    target = f"{folder}|{fn.__module__}:{fn.__qualname__}"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        str(Path(__file__).resolve()),
        target,
        str(out),
        str(args_file),
    ]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("SHARDSAFE_CRASH_AT", None)
    env.pop("SHARDSAFE_FAIL_AT", None)
    return env


def worker_pids(out_dir: str | os.PathLike[str]) -> list[int]:
    """Pids of the ranks a torchrun launch started (each writes its own on start)."""
    return [int(p.read_text()) for p in sorted(Path(out_dir).glob("pid-rank*"))]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a running (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def kill_leftover_workers(out_dir: str | os.PathLike[str]) -> list[int]:
    """SIGKILL any rank of a torchrun launch into ``out_dir`` that is still running; returns their pids."""
    killed = []
    for pid in worker_pids(out_dir):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if pid_alive(pid) and str(out_dir) in cmdline:  # the pid is still ours, not a reused one
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def load_results(out_dir: str | os.PathLike[str], world_size: int) -> list[Any]:
    return _load_results(Path(out_dir), world_size)


def _torchrun_worker(target: str, out_dir: str, args_file: str) -> None:
    """Entry point of a rank started by torch.distributed.run (environment rendezvous)."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(TESTS_DIR))
    folder, _, target = target.rpartition("|")
    if folder:
        sys.path.insert(0, folder)
    module_name, _, qualname = target.partition(":")
    fn = importlib.import_module(module_name)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    args = torch.load(args_file, weights_only=False)
    (Path(out_dir) / f"pid-rank{os.environ['RANK']}").write_text(str(os.getpid()))
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = fn(rank, world_size, *args)  # type: ignore[operator]
    _save_result(Path(out_dir), rank, result)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- models and states

DIMS = (5, 7, 13, 5, 2)  # dim 0 of the weights: 7, 13, 5, 2 - uneven over 2 and 3 ranks, and 2 < 3 ranks


class Net(nn.Module):
    """A small MLP whose weights split unevenly over 2 and 3 ranks; dropout makes training use the RNG."""

    scale: torch.Tensor

    def __init__(self, dims: tuple[int, ...] = DIMS, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.drop = nn.Dropout(dropout)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dims[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.drop(torch.tanh(x))
        return x * self.scale


def make_model(seed: int, dims: tuple[int, ...] = DIMS) -> Net:
    torch.manual_seed(seed)
    return Net(dims)


def shard(model: nn.Module, world_size: int) -> nn.Module:
    """Apply FSDP2 (``fully_shard``) to every layer and to the root, over all ranks."""
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module, lr: float = 0.02) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of the whole tensor (gathered when it is a DTensor; collective then)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole."""
    out = {name: full(p) for name, p in model.named_parameters()}
    out.update({name: full(b) for name, b in model.named_buffers()})
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name with whole tensors, plus the param groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    for param, entries in optimizer.state.items():
        state[names[id(param)]] = {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def set_model_values(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put whole tensors into a (possibly sharded) model: each rank keeps its own part."""
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            value = values[name].to(t.dtype)
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(value, t.device_mesh, t.placements).to_local())
            else:
                t.copy_(value)


def seeded_values(model: nn.Module, tag: str, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic whole-tensor values for every parameter/buffer, a function of (tag, seed, name)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{seed}/{name}".encode()))
        out[name] = torch.randn(tuple(t.shape), generator=gen).to(t.dtype)
    return out


def assert_tensors_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """Same keys, and every tensor bit-equal (dtype and shape included)."""
    assert sorted(got) == sorted(expected), f"{what}: keys differ: {sorted(got)} vs {sorted(expected)}"
    for key in expected:
        g, e = got[key], expected[key]
        assert g.dtype == e.dtype and g.shape == e.shape, (
            f"{what}[{key}]: {g.dtype}{list(g.shape)} vs {e.dtype}{list(e.shape)}"
        )
        assert torch.equal(
            g.view(-1).view(torch.uint8) if g.numel() else g, e.view(-1).view(torch.uint8) if e.numel() else e
        ), f"{what}[{key}]: values differ (max abs diff {(g.double() - e.double()).abs().max().item()})"


def assert_optimizer_equal(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert sorted(got["state"]) == sorted(expected["state"]), f"{what}: optimizer state keys differ"
    for name, entries in expected["state"].items():
        tensors = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        assert_tensors_equal(
            {k: v for k, v in got["state"][name].items() if isinstance(v, torch.Tensor)},
            tensors,
            f"{what} state[{name}]",
        )
        others = {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}
        assert {k: v for k, v in got["state"][name].items() if not isinstance(v, torch.Tensor)} == others
    assert typed(got["param_groups"]) == typed(expected["param_groups"]), f"{what}: param groups differ"


def typed(value: Any) -> Any:
    """``value`` with every container and scalar tagged by its type, so 1 != 1.0 and (1,) != [1]."""
    if isinstance(value, dict):
        return ("dict", sorted(((typed(k), typed(v)) for k, v in value.items()), key=repr))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().reshape(-1).tolist())
    return (type(value).__name__, value)


def rank_batch(rank: int, step: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch drawn from the global RNGs (torch, python, numpy), so resuming needs their exact state."""
    import random

    import numpy as np

    x = torch.randn(size, DIMS[0]) * (1.0 + random.random()) + float(np.random.rand())
    y = torch.randn(size, DIMS[-1])
    return x, y


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, scheduler: Any = None
) -> float:
    loss = (model(x) - y).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def seeded_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, dims: tuple[int, ...], rank: int, seed: int
) -> float:
    """One step on a batch of 6 drawn from its own generator (``seed``, ``rank``), for a model of ``dims``:
    the same data whatever the global RNGs hold."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x, y = torch.randn(6, dims[0], generator=g), torch.randn(6, dims[-1], generator=g)
    return train_step(model, optimizer, x, y)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int = 0, seed: int = 0) -> list[float]:
    """A few steps on rank-specific data (fills the optimizer state)."""
    torch.manual_seed(seed * 1000 + rank)
    return [train_step(model, optimizer, *rank_batch(rank, s)) for s in range(steps)]


def visible_entries(root: Path) -> list[str]:
    """What a user listing ``root`` sees: names not hidden (shardsafe's temporaries are dot-folders)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def crc(name: str) -> int:
    return zlib.crc32(name.encode())


def save_trained(rank: int, world_size: int, path: str, seed: int) -> dict[str, Any]:
    """A rank job: train the test model 2 steps (FSDP2 over the world), save model + AdamW; returns the whole states."""
    model = make_model(seed)
    if world_size > 1:
        shard(model, world_size)
    optimizer = make_optimizer(model)
    train(model, optimizer, steps=2, rank=rank, seed=seed)
    shardsafe.save(path, {"model": model, "optim": optimizer})
    return {"model": full_model_state(model), "optim": full_optimizer_state(model, optimizer)}


# ----------------------------------------------------------------------------- script launches


@dataclass
class ScriptLaunch:
    """A real ``python -m torch.distributed.run`` of a test script, logging to ``log``."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def launch_script(
    name: str, script: Path, nproc: int, args: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> ScriptLaunch:
    """Start ``script args...`` on ``nproc`` CPU ranks under torchrun (its own session, so a hang can be killed
    whole)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for variable in ("SHARDSAFE_CRASH_AT", "SHARDSAFE_FAIL_AT"):
        full_env.pop(variable, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(script), *args]
    log = cwd / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True
        )
    return ScriptLaunch(name, proc, log)


def wait_for_scripts(
    launches: list[ScriptLaunch], deadline: float, what: str, detail: Callable[[ScriptLaunch], str] | None = None
) -> None:
    """Wait for every launch until ``deadline`` (monotonic); kill what hangs; fail the test naming each failed
    launch."""
    failures = []
    for launch in launches:
        try:
            launch.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(launch.proc.pid, signal.SIGKILL)
            launch.proc.wait()
        if launch.proc.returncode != 0:
            text = (detail(launch) if detail is not None else "") or launch.log.read_text()[-6000:]
            failures.append(f"--- {launch.name}: exit {launch.proc.returncode}\n{text}")
    if failures:
        import pytest

        pytest.fail(f"{what} failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    _torchrun_worker(*sys.argv[1:4])
