"""Start a real `thinblock serve` process for tests, and stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import nbd

from tests.cli import ROOT, thinblock

__all__ = ["Server", "connect", "listed_exports", "offered_contexts", "served_pool", "thinblock"]


class Server:
    """`thinblock serve POOL ...` as a child process; exports[name] -> URIs. Its log
    and socket go to workdir (default: the pool directory)."""

    def __init__(
        self,
        pool: str,
        *extra: str,
        workdir: Path | None = None,
        host: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """host: a command prefix that runs the server as on another host (tests/hosts.py,
        tests/netns.py); env: variables set for it beside this process's."""
        self.pool = pool
        work = workdir or Path(pool)
        self.log = work / "serve.log"
        if "--socket" in extra:
            self.socket = str(Path(extra[extra.index("--socket") + 1]).resolve())
        else:
            self.socket = str((work / "nbd.sock").resolve())
            extra = ("--socket", self.socket, *extra)
        self.proc = subprocess.Popen(
            [*(host or []), sys.executable, "-m", "thinblock", "serve", pool, *extra],
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115
            text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT / "src")},
        )
        self.uris: list[str] = []
        self.metrics_url: str | None = None  # with --metrics: where /metrics is served
        deadline = time.monotonic() + 30
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited before it was ready: {self.log.read_text()}")
            if line.startswith("export "):
                self.uris.append(line.split(" ", 1)[1].strip())
            if line.startswith("metrics "):
                self.metrics_url = line.split(" ", 1)[1].strip()
            if line.startswith("ready"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("server never became ready")

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


@contextmanager
def served_pool(
    root: Path, size: str, volumes: dict[str, str], *serve_args: str, check: bool = True, locator: str | None = None
) -> Iterator[Server]:
    """A new pool at root/pool (or at locator) with these volumes (name -> size), served
    until the block ends; the server must stop cleanly without a traceback, and with
    check the pool must pass `pool check` afterwards."""
    pool = locator or str(root / "pool")
    thinblock("pool", "create", pool, "--size", size)
    for name, volume_size in volumes.items():
        thinblock("volume", "create", pool, name, "--size", volume_size)
    server = Server(pool, *serve_args, workdir=root if locator else None)
    try:
        yield server
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text(), server.log.read_text()
        if check:
            thinblock("pool", "check", pool)


def connect(
    server: Server, name: str = "disk", contexts: tuple[str, ...] = ("base:allocation",), *, strict: bool = True
) -> nbd.NBD:
    """A libnbd handle on one export, with these metadata contexts requested."""
    h = nbd.NBD()
    for ctx in contexts:
        h.add_meta_context(ctx)
    if not strict:
        h.set_strict_mode(0)  # let bad requests reach the server
    h.connect_uri(server.unix_uri(name))
    return h


NbdStep = tuple[str, int, bytes | int]


def apply_steps(server: Server, name: str, model: bytearray, steps: list[NbdStep]) -> None:
    """Writes ("w", offset, data), trims ("t", offset, length) and zeroes ("z", offset,
    length) on one export through libnbd, then a flush; model keeps what it must read."""
    h = nbd.NBD()
    h.connect_uri(server.unix_uri(name))
    for kind, off, arg in steps:
        if kind == "w":
            assert isinstance(arg, bytes)
            h.pwrite(arg, off)
            model[off : off + len(arg)] = arg
        else:
            assert isinstance(arg, int) and kind in ("t", "z")
            (h.trim if kind == "t" else h.zero)(arg, off)
            model[off : off + arg] = bytes(arg)
    h.flush()
    h.shutdown()


def listed_exports(server: Server) -> list[tuple[str, str]]:
    """(name, description) of every export NBD_OPT_LIST gives, through libnbd."""
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(server.unix_uri(""))
    listed: list[tuple[str, str]] = []

    def export(name: str, description: str) -> int:
        listed.append((name, description))
        return 0

    assert h.opt_list(export) == len(listed)
    h.opt_abort()
    return listed


def offered_contexts(server: Server, name: str) -> list[str]:
    """The metadata contexts an export offers to an empty LIST_META_CONTEXT query."""
    listing = nbd.NBD()
    listing.set_opt_mode(True)
    listing.connect_uri(server.unix_uri(name))
    offered: list[str] = []

    def offer(context: str) -> int:
        offered.append(context)
        return 0

    listing.opt_list_meta_context(offer)
    listing.opt_abort()
    return offered


def reads_zeros_beside(open_handle: Callable[[], nbd.NBD], timeout_s: float = 90) -> bool:
    """Whether four 2 MiB reads of zeros at 256 MiB (each needs the shared large-request
    memory) complete within timeout_s, on a handle open_handle makes in a thread."""
    done: list[bool] = []

    def reader() -> None:
        h = open_handle()
        for i in range(4):
            assert h.pread(2 << 20, (256 << 20) + i * (2 << 20)) == bytes(2 << 20)
        done.append(True)
        h.shutdown()

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout_s)
    return done == [True]
