"""A small TCP proxy on 127.0.0.1 that, when armed, breaks HTTP responses (for S3 fault tests).

It sits between an S3 client (boto3 / s3fs, pointed at :attr:`FlakyProxy.url`) and a real S3
API (moto). Every request is forwarded with ``Connection: close`` (one request per connection,
so responses are easy to delimit); the response comes back untouched unless an armed rule
matches the request, in which case the proxy injects one of these faults:

* ``drop``: the upstream has processed the request (a PUT is stored), but the client gets no
  response at all: the connection is reset. The client cannot tell whether the request landed.
* ``cut``: the status line, the headers and half of the body, then a reset.
* ``truncate``: the headers (with the true ``Content-Length``) and half of the body, then a
  normal close: the body is shorter than announced.
* ``lie``: a lying endpoint: ``Content-Length`` rewritten to half the body and only that half
  sent. The HTTP framing is consistent, so only the reader's own checks can notice.

Bounded and self-stopping: at most ``max_connections`` connections are served at once, every
socket operation times out, and the proxy stops by itself after ``lifetime`` seconds (or when
:meth:`stop` is called or its ``with`` block ends).
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

MODES = ("drop", "cut", "truncate", "lie")
HEAD_LIMIT = 64 * 1024
SOCKET_TIMEOUT_S = 30.0


@dataclass
class Rule:
    mode: str
    methods: tuple[str, ...]
    path: re.Pattern[str] | None
    remaining: int | None  # None: every matching request
    min_body: int = 0


@dataclass
class Record:
    method: str
    path: str
    status: int
    fault: str | None


@dataclass
class FlakyProxy:
    upstream: tuple[str, int]
    lifetime: float = 600.0
    max_connections: int = 64
    records: list[Record] = field(default_factory=list)
    injected: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._thread: threading.Thread | None = None
        self._deadline = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ control

    def arm(
        self,
        mode: str,
        count: int | None = 1,
        methods: tuple[str, ...] = ("GET",),
        path: str | None = None,
        min_body: int = 0,
    ) -> None:
        """Break the next ``count`` responses (every one when None) to requests matching the rule."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        with self._lock:
            self._rules.append(
                Rule(mode, tuple(m.upper() for m in methods), re.compile(path) if path else None, count, min_body)
            )

    def disarm(self) -> None:
        with self._lock:
            self._rules.clear()

    def faults_of(self, mode: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self.records if r.fault is not None and (mode is None or r.fault == mode)]

    def _take(self, method: str, path: str, body: int) -> str | None:
        with self._lock:
            for rule in self._rules:
                if method in rule.methods and (rule.path is None or rule.path.search(path)) and body >= rule.min_body:
                    if rule.remaining is not None:
                        if rule.remaining <= 0:
                            continue
                        rule.remaining -= 1
                    self.injected += 1
                    return rule.mode
        return None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FlakyProxy:
        self._deadline = time.monotonic() + self.lifetime
        self._thread = threading.Thread(target=self._serve, name="flaky-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._listener.close()

    def __enter__(self) -> FlakyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if not self._slots.acquire(timeout=SOCKET_TIMEOUT_S):
                client.close()
                continue
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()
        self._stop.set()

    # ------------------------------------------------------------------ one request

    def _connection(self, client: socket.socket) -> None:
        upstream = None
        try:
            client.settimeout(SOCKET_TIMEOUT_S)
            head, rest = _read_head(client)
            if head is None:
                return
            method, path = _request_line(head)
            upstream = socket.create_connection(self.upstream, timeout=SOCKET_TIMEOUT_S)
            upstream.sendall(_with_connection_close(head) + rest)
            pump = threading.Thread(target=_pump, args=(client, upstream), daemon=True)  # the request body, if any
            pump.start()
            reset = self._respond(client, upstream, method, path)
            _close(client, pump, reset)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
            self._slots.release()

    def _respond(self, client: socket.socket, upstream: socket.socket, method: str, path: str) -> bool:
        """Forward (or break) the response; True when the client connection must be reset."""
        while True:
            head, rest = _read_head(upstream)
            if head is None:
                return False
            status = int(head.split(b" ", 2)[1])
            if 100 <= status < 200:  # 100 Continue: pass it on and read the real response
                client.sendall(head)
                continue
            break
        length = _content_length(head)
        no_body = method == "HEAD" or status in (204, 304)
        body = b"" if no_body else _read_body(upstream, rest, length)
        fault = self._take(method, path, len(body))
        with self._lock:
            self.records.append(Record(method, path, status, fault))
        if fault is None:
            client.sendall(head + body)
        elif fault == "cut":
            client.sendall(head + body[: len(body) // 2])
        elif fault == "truncate":
            client.sendall(head + body[: len(body) // 2])
        elif fault == "lie":
            half = body[: len(body) // 2]
            client.sendall(_set_content_length(head, len(half)) + half)
        return fault in ("drop", "cut")


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > HEAD_LIMIT:
            raise OSError("HTTP head too large")
        piece = sock.recv(65536)
        if not piece:
            return None, b""
        data += piece
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    return parts[0].decode("latin-1").upper(), (parts[1].decode("latin-1") if len(parts) > 1 else "")


def _headers(head: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            name, value = line.split(b":", 1)
            out.append((name.strip().lower(), value.strip()))
    return out


def _content_length(head: bytes) -> int | None:
    for name, value in _headers(head):
        if name == b"content-length":
            return int(value)
    return None


def _with_connection_close(head: bytes) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]] + [
        line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"


def _set_content_length(head: bytes, length: int) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [line for line in lines if line.split(b":", 1)[0].strip().lower() != b"content-length"]
    return b"\r\n".join([*kept, b"Content-Length: %d" % length]) + b"\r\n\r\n"


def _read_body(sock: socket.socket, rest: bytes, length: int | None) -> bytes:
    chunks = [rest]
    got = len(rest)
    while length is None or got < length:
        piece = sock.recv(1 << 20)
        if not piece:
            break
        chunks.append(piece)
        got += len(piece)
    return b"".join(chunks)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            piece = src.recv(1 << 20)
            if not piece:
                return
            dst.sendall(piece)
    except OSError:
        return


def _close(sock: socket.socket, pump: threading.Thread, reset: bool) -> None:
    """Close the client side once the request pump has let go of it: orderly, or with a TCP reset."""
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)  # wakes the pump; sends nothing
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    pump.join(SOCKET_TIMEOUT_S)
    sock.close()  # the last reference: with SO_LINGER 0 this sends the reset
