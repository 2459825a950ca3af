"""Power cuts under a real `thinblock serve`: the pool directory, SQLite included,
lives on tests/powercut_fs.py, which keeps every unsynced change in memory; the
cut kills that filesystem (and the server) and only what was synced survives.
Flushed bytes must be intact, no byte may read as another volume's or as stale
freed data, and `pool check` must pass after every cut."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbd
import pytest

from tests.cli import ROOT, thinblock
from tests.nbd_server import Server
from thinblock import Pool

BS = 64 << 10
SECTOR = 4096


class PowerCutRig:
    """A pool on the power-cut filesystem, served over a unix socket outside it."""

    def __init__(self, tmp: Path) -> None:
        self.backing, self.mnt = tmp / "backing", tmp / "mnt"
        self.backing.mkdir()
        self.mnt.mkdir()
        self.tmp = tmp
        self.pool = str(self.mnt / "pool")
        self.socket = str(tmp / "nbd.sock")
        self.fs: subprocess.Popen[bytes] | None = None
        self.server: Server | None = None
        self.owners: dict[str, Server] = {}  # volume -> its server, when served per volume
        self.mount()

    def mount(self) -> None:
        self.fs = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "powercut_fs.py"), str(self.backing), str(self.mnt)],
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mnt):
            assert self.fs.poll() is None, "the power-cut filesystem did not start"
            assert time.monotonic() < deadline, "the power-cut filesystem never mounted"
            time.sleep(0.05)

    def serve(self) -> Server:
        self.server = Server(self.pool, "--socket", self.socket)
        return self.server

    def serve_owner(self, name: str) -> Server:
        """A server owning just this volume (`serve --volume`), beside the others."""
        work = self.tmp / f"owner-{name}"
        work.mkdir(exist_ok=True)
        self.owners[name] = Server(self.pool, "--volume", name, "--socket", str(work / "nbd.sock"), workdir=work)
        return self.owners[name]

    def connect(self, name: str) -> nbd.NBD:
        h = nbd.NBD()
        socket_path = self.owners[name].socket if name in self.owners else self.socket
        h.connect_uri(f"nbd+unix:///{name}?socket={socket_path}")
        return h

    def cut(self, reorder_seed: int | None = None) -> None:
        """The power goes: the filesystem loses what was not synced (all of it, or with
        a seed, a random part of it, as a disk that reorders), the server dies."""
        assert self.fs is not None
        if reorder_seed is not None:
            with contextlib.suppress(OSError), open(self.mnt / ".powercut", "w") as f:
                f.write(f"reorder {reorder_seed}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.fs.wait(10)
        self.fs.send_signal(signal.SIGKILL)
        self.fs.wait()
        for server in [*([self.server] if self.server else []), *self.owners.values()]:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
        self.server = None
        self.owners = {}
        subprocess.run(["umount", "-l", str(self.mnt)], check=False, capture_output=True)

    def restart(self) -> None:
        """Power back: mount again and check the pool."""
        self.mount()
        thinblock("pool", "check", self.pool)

    def close(self) -> None:
        for server in [*([self.server] if self.server else []), *self.owners.values()]:
            server.stop()
        if self.fs is not None and self.fs.poll() is None:
            subprocess.run(["umount", str(self.mnt)], check=False, capture_output=True)
            self.fs.wait(10)


@contextmanager
def rig(tmp_path: Path, volumes: dict[str, str]) -> Iterator[PowerCutRig]:
    r = PowerCutRig(tmp_path)
    try:
        thinblock("pool", "create", r.pool, "--size", "64M")
        for name, size in volumes.items():
            thinblock("volume", "create", r.pool, name, "--size", size)
        yield r
    finally:
        r.close()


def _read(pool: str, name: str, length: int) -> bytes:
    with Pool.open(pool) as p:
        return p.volume(name).read(0, length)


def test_copy_on_write_of_a_shared_block_keeps_flushed_bytes(tmp_path: Path) -> None:
    """A 4 KiB overwrite of snapshot-shared 64 KiB blocks, committed in the background
    and cut before any flush: the 60 KiB copied from the snapshot are the flushed bytes."""
    with rig(tmp_path, {"v": "8M"}) as r:
        r.serve()
        h = r.connect("v")
        h.pwrite(b"A" * (16 * BS), 0)
        h.flush()
        thinblock("snapshot", "create", r.pool, "v", "s")
        for block in range(16):
            h.pwrite(b"B" * SECTOR, block * BS + SECTOR)
        time.sleep(1.6)  # the background commit writes the new mappings
        r.cut()
        r.restart()
        got = _read(r.pool, "v", 16 * BS)
        for block in range(16):
            chunk = got[block * BS : (block + 1) * BS]
            assert chunk[:SECTOR] == b"A" * SECTOR and chunk[2 * SECTOR :] == b"A" * (BS - 2 * SECTOR), block
            assert chunk[SECTOR : 2 * SECTOR] in (b"A" * SECTOR, b"B" * SECTOR), block
        assert _read(r.pool, "s", 16 * BS) == b"A" * (16 * BS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_zeroed_then_rewritten_block_never_shows_old_bytes(tmp_path: Path, seed: int) -> None:
    """A whole-block zero write over DATA, then a 4 KiB rewrite, both committed in the
    background, then a reordering cut: a block reads as one state in order, never the
    rewrite beside the bytes the zero write removed."""
    with rig(tmp_path, {"v": "8M"}) as r:
        r.serve()
        h = r.connect("v")
        h.pwrite(b"A" * (16 * BS), 0)
        h.flush()
        h.pwrite(bytes(16 * BS), 0)  # DATA -> ZEROED, in place
        time.sleep(1.3)
        for block in range(16):
            h.pwrite(b"B" * SECTOR, block * BS)  # ZEROED -> DATA, only 4 KiB written
        time.sleep(1.3)
        r.cut(reorder_seed=seed)
        r.restart()
        got = _read(r.pool, "v", 16 * BS)
        for block in range(16):
            chunk = got[block * BS : (block + 1) * BS]
            assert chunk in (b"A" * BS, bytes(BS), b"B" * SECTOR + bytes(BS - SECTOR)), (block, chunk[:8], chunk[-8:])


def test_freed_blocks_never_show_another_volumes_bytes(tmp_path: Path) -> None:
    with rig(tmp_path, {"x": "16M", "y": "16M"}) as r:
        r.serve()
        hx, hy = r.connect("x"), r.connect("y")
        hx.pwrite(b"S" * (64 * BS), 0)
        hx.flush()
        hx.trim(64 * BS, 0)
        time.sleep(1.2)  # committed: the blocks are free and punched
        for block in range(0, 128, 2):
            hy.pwrite(b"T" * SECTOR, block * BS)  # partial writes into fresh blocks
        time.sleep(1.3)
        r.cut()
        r.restart()
        y = _read(r.pool, "y", 128 * BS)
        assert b"S" not in y, "volume y shows volume x's freed bytes"
        assert set(y) <= {0, ord("T")}
        x = _read(r.pool, "x", 64 * BS)
        for block in range(64):
            assert x[block * BS : (block + 1) * BS] in (b"S" * BS, bytes(BS))


def _allowed(log: list[tuple[int, str, str, int, int, int]], flushed: int, name: str, sector: int) -> set[int]:
    """Values a sector of a volume may hold after the cut: what it held when the last
    completed flush was issued, or what any later request wrote there (0 for trims)."""
    value = 0
    allowed: set[int] = set()
    pos = sector * SECTOR
    for seq, vol, _kind, offset, length, byte in log:
        if vol != name or not offset <= pos < offset + length:
            continue
        if seq < flushed:
            value = byte
        else:
            allowed.add(byte)
    return allowed | {value}


@pytest.mark.parametrize("owners", [False, True], ids=["one-server", "two-owners"])
def test_random_power_cuts(tmp_path: Path, owners: bool) -> None:
    """Random writes, trims, zeroes and flushes on two volumes, cut at a random moment,
    three times over; every 4 KiB sector must hold a value the rules allow. With
    owners, each volume has its own server (`serve --volume`) and a flush makes only
    that server's volume durable."""
    rng = random.Random(2026)
    sectors = (4 << 20) // SECTOR
    with rig(tmp_path, {"a": "4M", "b": "4M"}) as r:
        log: list[tuple[int, str, str, int, int, int]] = []  # seq, volume, kind, offset, length, byte
        # Per volume: every request with a smaller seq was done before its last completed flush.
        flushed = {"a": 0, "b": 0}
        for _round in range(3):
            if owners:
                r.serve_owner("a")
                r.serve_owner("b")
            else:
                r.serve()
            handles = {"a": r.connect("a"), "b": r.connect("b")}
            seed = rng.randrange(1 << 30) if _round % 2 else None
            timer = threading.Timer(rng.uniform(1.0, 3.0), r.cut, args=(seed,))
            timer.start()
            try:
                while True:
                    name = rng.choice("ab")
                    h = handles[name]
                    kind = rng.choice(["write", "write", "write", "trim", "zero", "flush"])
                    first = rng.randrange(sectors)
                    count = rng.randint(1, min(48, sectors - first))
                    seq = len(log)
                    base = 1 if name == "a" else 128
                    byte = base + seq % 120 if kind == "write" else 0
                    if kind == "flush":
                        h.flush()
                        for flushed_name in [name] if owners else ["a", "b"]:
                            flushed[flushed_name] = seq
                        continue
                    log.append((seq, name, kind, first * SECTOR, count * SECTOR, byte))
                    if kind == "write":
                        h.pwrite(bytes([byte]) * (count * SECTOR), first * SECTOR)
                    elif kind == "trim":
                        h.trim(count * SECTOR, first * SECTOR)
                    else:
                        h.zero(count * SECTOR, first * SECTOR)
            except nbd.Error:
                pass  # the power went
            timer.join()
            r.restart()
            for name in "ab":
                data = _read(r.pool, name, sectors * SECTOR)
                for sector in range(sectors):
                    chunk = data[sector * SECTOR : (sector + 1) * SECTOR]
                    assert chunk == bytes([chunk[0]]) * SECTOR, f"{name}: sector {sector} is torn"
                    allowed = _allowed(log, flushed[name], name, sector)
                    assert chunk[0] in allowed, f"{name}: sector {sector} holds {chunk[0]}, allowed {allowed}"
            # What survived is the new truth: replay it as one flushed write per sector.
            log = []
            for name in "ab":
                data = _read(r.pool, name, sectors * SECTOR)
                for sector in range(sectors):
                    log.append((len(log), name, "write", sector * SECTOR, SECTOR, data[sector * SECTOR]))
            flushed = {"a": len(log), "b": len(log)}
