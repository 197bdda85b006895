"""Start and stop a local S3 (``python -m moto.server``) on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 90.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """A ``moto.server`` subprocess; :attr:`url` is its endpoint once :meth:`start` returns."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_path = Path(log_dir) / "moto-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables that point boto3 / s3fs at this server."""
        return {"AWS_ENDPOINT_URL_S3": self.url, "AWS_ENDPOINT_URL": self.url, **CREDENTIALS}

    def start(self, attempts: int = 3) -> MotoServer:
        error = ""
        for _ in range(attempts):  # the free port may be taken between choosing and binding it
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            error = self._wait_ready()
            if not error:
                return self
            self.stop()
        raise RuntimeError(f"moto server did not start: {error}\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def _wait_ready(self) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with status {self.proc.returncode}"
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    return ""
            except urllib.error.HTTPError:
                return ""  # it answers
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        return f"no answer on {self.url} within {START_TIMEOUT_S:.0f}s"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
