"""Shared pieces of the benchmark: the model, cache dropping, memory probes, fingerprints.

Kept free of process-group code so the single-process (2->1) worker and the orchestrator can
import it cheaply.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

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
    """Evict the (clean) page-cache pages of every file under ``folder``; returns bytes still cached.

    ``echo 3 > /proc/sys/vm/drop_caches`` needs a privilege containers usually lack;
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` works for any file we can open, and all files here are
    fsynced (clean), so it evicts them completely. This only covers the guest's cache: a
    virtualised disk may still be cached by the host.
    """
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
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True, text=True, check=True)
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


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per-key float64 (sum, sum of |x|) of the (local) tensors; over shards they add up to the full tensor's."""
    out = {}
    with torch.no_grad():
        for key, t in tensors.items():
            local = t.to_local() if hasattr(t, "to_local") else t
            wide = local.detach().to(torch.float64)
            out[key] = [float(wide.sum()), float(wide.abs().sum())]
    return out


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model parameters and AdamW moments by parameter name (step counters left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p
        for k in ("exp_avg", "exp_avg_sq"):
            if k in optim.state.get(p, {}):
                out[f"optim/{name}/{k}"] = optim.state[p][k]
    return out


def fingerprints_match(a: dict[str, list[float]], b: dict[str, list[float]], rel: float = 1e-9) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        scale = max(abs(a[key][1]), abs(b[key][1]), 1e-300)
        if abs(a[key][0] - b[key][0]) > rel * scale or abs(a[key][1] - b[key][1]) > rel * scale:
            return False
    return True


def merge_fingerprints(parts: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Add up per-rank fingerprints of shards into the full tensors' fingerprints."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, (s, a) in part.items():
            prev = out.setdefault(key, [0.0, 0.0])
            prev[0] += s
            prev[1] += a
    return out
