"""Shared pieces of the benchmark: the model, cache dropping, memory probes, fingerprints.

Kept free of process-group code so the single-process (2->1) worker and the orchestrator can
import it cheaply.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor

# Model sizes: (layers, width). 16 x Linear(4096, 4096) with bias = 268.5 M fp32 params = 1.0002 GiB.
FULL = (16, 4096)
QUICK = (4, 2048)  # 16.8 M params, 64 MiB


def build_model(layers: int, width: int, device: str | torch.device = "cpu") -> nn.Sequential:
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def param_bytes(layers: int, width: int) -> int:
    return layers * (width * width + width) * 4


# ----------------------------------------------------------------------------- page cache


def drop_file_cache(folder: Path) -> int:
    """Evict the page-cache pages of every file under ``folder``; returns bytes still cached.

    As root, ``sync; echo 3 > /proc/sys/vm/drop_caches`` empties the whole cache (what a job
    restarting on a node sees). Without that privilege, ``posix_fadvise(POSIX_FADV_DONTNEED)``
    works for any file we can open, and all files here are fsynced (clean), so it evicts them
    completely. Either way only the guest's cache: a virtualised disk may be cached by the host.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return cached_bytes(folder)
    except OSError:
        pass
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return cached_bytes(folder)


def cached_bytes(folder: Path) -> int:
    """Bytes of ``folder``'s files resident in the page cache (via fincore), -1 if unknown."""
    files = [str(p) for p in folder.rglob("*") if p.is_file()]
    if not files or shutil.which("fincore") is None:
        return -1
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return -1
    return sum(int(line.split()[0]) for line in out.stdout.splitlines() if line.strip())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


class PeakMemory:
    """Peak RSS growth of this process over a region, in bytes.

    Preferred: reset the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and read
    ``VmHWM`` afterwards: exact, no sampling gaps. Fallback: a thread sampling RSS every 5 ms.
    """

    def __init__(self) -> None:
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        self.baseline = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled RSS every 5 ms"
            self.peak = self.baseline
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())
        else:
            self.peak = _status_kib("VmHWM") * 1024

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)


@contextmanager
def timed() -> Iterator[list[float]]:
    box = [0.0]
    start = time.perf_counter()
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - start


# ----------------------------------------------------------------------------- correctness


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return xxhash.xxh3_64(memoryview(array)).hexdigest() if flat.numel() else "empty"


def fingerprint(tensors: dict[str, torch.Tensor], parts: int = 1) -> dict[str, list[str]]:
    """Exact per-key fingerprint: xxh3 of the local bytes of a sharded tensor (one part), or of each
    of the ``parts`` dim-0 chunks of a whole tensor, which are exactly FSDP2's even Shard(0) pieces."""
    out = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            out[key] = [_digest(t.to_local())]
        else:
            out[key] = [_digest(piece) for piece in torch.chunk(t, parts, dim=0)]
    return out


def merge_fingerprints(per_rank: list[dict[str, list[str]]]) -> dict[str, list[str]]:
    """Per-rank fingerprints of Shard(0) pieces, in rank order, as the fingerprint of the whole tensors."""
    return {key: [h for part in per_rank for h in part[key]] for key in per_rank[0]}


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model parameters and AdamW moments by parameter name (step counters left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p
        for k in ("exp_avg", "exp_avg_sq"):
            if k in optim.state.get(p, {}):
                out[f"optim/{name}/{k}"] = optim.state[p][k]
    return out


def zero_state(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Zero the parameters and every optimizer state tensor, so a load has to restore them all."""
    with torch.no_grad():
        tensors = [
            *model.parameters(),
            *(v for per_param in optim.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)),
        ]
        for t in tensors:
            local(t).zero_()


def allocate_optimizer_state(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with torch's own helper (a dummy step), outside any timing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, optim)


NOTES_MARK = "<!-- notes -->"  # benchmarks/run.py rewrites everything above this line of BENCHMARKS.md


def write_section(md: Path, heading: str, text: str) -> None:
    """Put ``text`` as the ``heading`` section of ``md``: replace an earlier one, else append.

    Appended below the ``<!-- notes -->`` line, which ``benchmarks/run.py`` keeps when it rewrites
    the part above it (a new file gets that line first).
    """
    old = md.read_text() if md.exists() else ""
    if NOTES_MARK not in old:
        old = old.rstrip("\n") + ("\n\n" if old else "# Benchmarks\n\n") + NOTES_MARK + "\n"
    if heading + "\n" in old:
        before, rest = old.split(heading + "\n", 1)
        after = rest.split("\n## ", 1)
        tail = "\n## " + after[1] if len(after) > 1 else ""
        new = before + text + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text
    md.write_text(new if new.endswith("\n") else new + "\n")


def load_average() -> str:
    """The 1/5/15-minute load averages, for the record of how busy the shared machine was."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def was_busy(load: str) -> bool:
    """Whether a :func:`load_average` text taken before a run says other work held more than the cores (its
    1-minute value above the CPU count); True when it is unknown. Taken before, since a benchmark's own
    processes raise the value at its end."""
    try:
        return float(load.split("/")[0]) > (os.cpu_count() or 1)
    except ValueError:
        return True


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the ``*.safetensors`` file of ``folder`` that holds it (headers only)."""
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            out.update({k: f for k in s.keys()})  # noqa: SIM118
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for a job's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
