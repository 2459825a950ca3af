"""Start a real `thinblock serve` process for tests, and stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.cli import ROOT, thinblock

__all__ = ["Server", "thinblock"]


class Server:
    """`thinblock serve POOL ...` as a child process; exports[name] -> URIs."""

    def __init__(self, pool: str, *extra: str) -> None:
        self.pool = pool
        self.log = Path(pool) / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "serve", pool, *extra],
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
        self.uris: list[str] = []
        deadline = time.monotonic() + 30
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited before it was ready: {self.log.read_text()}")
            if line.startswith("export "):
                self.uris.append(line.split(" ", 1)[1].strip())
            if line.startswith("ready"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("server never became ready")
        self.socket = str(Path(pool).resolve() / "nbd.sock")

    def unix_uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.socket}"

    def tcp_uri(self, name: str) -> str:
        return next(u for u in self.uris if u.startswith(("nbd://", "nbds://")) and u.endswith(f"/{name}"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> str:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        out = self.proc.stdout.read() if self.proc.stdout else ""
        return out
