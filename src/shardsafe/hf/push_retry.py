"""Retries of transient errors, one-line error descriptions, and the bytes progress bar of a push.

A push talks to a remote service that answers 429 or 503 now and then, drops connections and
times out; those are retried with exponential backoff a bounded number of times. Anything else
fails at once with a :class:`~shardsafe.errors.PushError` that names the push, the step and the
underlying error on one line (HTTP errors span several).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from shardsafe.errors import PushError, ShardsafeError
from shardsafe.hf.push_plan import UploadFile

if TYPE_CHECKING:
    from fsspec.callbacks import Callback

__all__ = ["MAX_ATTEMPTS", "Progress", "RETRY_STATUS", "chain", "describe", "transport_error", "with_retries"]

log = logging.getLogger("shardsafe.hf.push")

T = TypeVar("T")

# Retries of transient errors: attempts in all (first try included), first wait, longest wait.
MAX_ATTEMPTS = 5
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_NAMES = frozenset(
    {
        # httpx / httpx2 (huggingface_hub), aiohttp and botocore (s3fs) transport errors
        "TimeoutException",
        "NetworkError",
        "RemoteProtocolError",
        "ConnectError",
        "ReadError",
        "WriteError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
    }
)


def with_retries(action: Callable[[], T], what: str, where: str, transient: Callable[[BaseException], bool]) -> T:
    """``action()``, retried with exponential backoff while it fails transiently, at most MAX_ATTEMPTS times."""
    delay = BACKOFF_S
    attempt = 1
    while True:
        try:
            return action()
        except ShardsafeError as exc:
            if isinstance(exc, PushError) and not str(exc).startswith(where):
                raise PushError(f"{where}: {what} failed: {exc}") from exc
            raise
        except Exception as exc:
            if attempt >= MAX_ATTEMPTS or not transient(exc):
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                raise PushError(f"{where}: {what} failed{tries}: {describe(exc)}") from exc
            log.warning(
                "%s: %s failed (attempt %d of %d), retrying in %.1fs: %s",
                where,
                what,
                attempt,
                MAX_ATTEMPTS,
                delay,
                describe(exc),
            )
        time.sleep(delay)
        delay = min(MAX_BACKOFF_S, delay * 2)
        attempt += 1


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def transport_error(exc: BaseException) -> bool:
    """A connection reset, timeout or the like, from the standard library or an HTTP client."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__)


def describe(exc: BaseException) -> str:
    """One line: the error and what caused it (HTTP errors span several lines)."""
    parts = []
    for e in list(chain(exc))[:3]:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        if len(text) > 400:
            text = text[:397] + "..."
        parts.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)
    return " <- ".join(parts)


class Progress:
    """A bytes progress bar over all files, fed from several threads; each file counts up to its size once."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, leave=True
        )
        self._lock = threading.Lock()
        self._done: dict[str, int] = {}

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def reached(self, f: UploadFile, position: int) -> None:
        with self._lock:
            before = self._done.get(f.name, 0)
            now = max(before, min(int(position), f.size))
            if now > before:
                self._done[f.name] = now
                self._bar.update(now - before)

    def finished(self, f: UploadFile) -> None:
        self.reached(f, f.size)

    def fsspec_callback(self, f: UploadFile) -> Callback:
        from fsspec.callbacks import Callback

        progress = self

        class _FileCallback(Callback):  # type: ignore[misc]
            def call(self, *args: Any, **kwargs: Any) -> None:
                progress.reached(f, self.value)

        return _FileCallback()
