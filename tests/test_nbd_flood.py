"""Pre-authentication denial of service and BLOCK_STATUS fairness, against a real
`thinblock serve`: floods of silent sockets, one address or one certificate
holding many connections, and clients mapping a whole volume with block status
while another client reads (issue 21). Every number here is a bound the test
states, and every wait is for a condition with a generous deadline.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, thinblock
from thinblock import BlockState, Pool
from thinblock.frontends.nbd import constants as c

KiB, MiB = 1 << 10, 1 << 20

# ----- BLOCK_STATUS fairness ------------------------------------------------------------

BLOCK = 4 * KiB
STATUS_BLOCKS = 65536  # a 256 MiB volume of 4K blocks, alternating ZEROED and UNMAPPED: 65,536 extents


def _striped_pool(root: Path) -> str:
    """A pool whose volume `disk` has STATUS_BLOCKS extents (every other block ZEROED),
    made through the library before the server starts (no data I/O: fast), plus a
    data block at 0 for the reader."""
    pool = str(root / "pool")
    thinblock("pool", "create", pool, "--size", "1G", "--block-size", "4K")
    thinblock("volume", "create", pool, "disk", "--size", f"{STATUS_BLOCKS * BLOCK}")
    with Pool.open(pool) as p:
        vol = p.volume("disk")
        vol.write(0, b"r" * BLOCK)
        for i in range(2, STATUS_BLOCKS, 2):
            vol.write_zeroes(i * BLOCK, BLOCK, no_hole=True)
        vol.flush()
    return pool


def _mapper(server: Server, stop: threading.Event, seen: list[int], errors: list[str]) -> None:
    """Whole-volume BLOCK_STATUS, 16 in flight, until stop: each request asks for the
    whole volume from 0 (what the issue measured); the extents must be a valid prefix."""
    h = connect(server, "disk")
    size = h.get_size()
    replies = [0]

    def check(metacontext: str, offset: int, entries: list[int], err: int) -> int:
        total = sum(entries[0::2])
        if err or offset != 0 or not entries or total > size or entries[1] != 0:
            errors.append(f"bad reply at {offset}: {entries[:4]} (err {err})")
        replies[0] += 1
        return 0

    try:
        while not stop.is_set():
            cookies = [h.aio_block_status(size, 0, check) for _ in range(16)]
            for cookie in cookies:
                while not h.aio_command_completed(cookie):
                    h.poll(-1)
    finally:
        seen.append(replies[0])
        h.shutdown()


def _read_latencies(server: Server, seconds: float) -> list[float]:
    """Synchronous 4 KiB reads for `seconds`: each one's latency in seconds."""
    h = connect(server, "disk", ())
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.perf_counter()
        assert h.pread(BLOCK, 0) == b"r" * BLOCK
        out.append(time.perf_counter() - t)
    h.shutdown()
    return out


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[int(len(ordered) * 0.99)]


def test_block_status_does_not_starve_reads(tmp_path: Path) -> None:
    pool = _striped_pool(tmp_path)
    server = Server(pool, "--read-only")
    try:
        # A client repeating block status maps the whole volume, in valid shorter replies.
        h = connect(server, "disk")
        size = h.get_size()
        pos, requests = 0, 0
        extents: list[tuple[int, int]] = []
        while pos < size:

            def got(metacontext: str, offset: int, entries: list[int], err: int, start: int = pos) -> int:
                assert offset == start and not err and entries
                extents.extend(zip(entries[0::2], entries[1::2], strict=True))
                return 0

            h.block_status(size - pos, pos, got)
            covered = sum(n for n, _ in extents) - pos
            assert 0 < covered <= size - pos
            pos += covered
            requests += 1
        assert requests > 1  # bounded: the reply covered less than was asked
        want = [(BLOCK, 0)] + [
            (BLOCK, c.STATE_ZERO if i % 2 == 0 else c.STATE_HOLE | c.STATE_ZERO) for i in range(1, STATUS_BLOCKS)
        ]
        assert _merged(extents) == want
        # With REQ_ONE, one extent.
        one: list[int] = []

        def first(metacontext: str, offset: int, entries: list[int], err: int) -> int:
            one.extend(entries)
            return 0

        h.block_status(size - BLOCK, BLOCK, first, nbd.CMD_FLAG_REQ_ONE)
        assert one == [BLOCK, c.STATE_HOLE | c.STATE_ZERO]
        h.shutdown()

        alone = _read_latencies(server, 2)
        stop = threading.Event()
        seen: list[int] = []
        errors: list[str] = []
        mappers = [threading.Thread(target=_mapper, args=(server, stop, seen, errors)) for _ in range(2)]
        for t in mappers:
            t.start()
        try:
            time.sleep(0.5)  # both mappers have their 16 requests in flight
            loaded = _read_latencies(server, 5)
        finally:
            stop.set()
            for t in mappers:
                t.join(60)
        print(
            f"4 KiB reads alone: {len(alone)} in 2 s, p99 {p99(alone) * 1e3:.2f} ms; "
            f"beside two block-status mappers: {len(loaded)} in 5 s, p99 {p99(loaded) * 1e3:.2f} ms; "
            f"block status replies {seen}"
        )
        assert not errors, errors[:3]
        assert all(n > 0 for n in seen)  # the mappers were served too
        assert len(loaded) >= 1000
        # The bound: 20 ms (measured here about 2 ms; today's main gave 8 reads in 5 s, p99 1.27 s).
        assert p99(loaded) < 0.020
        assert server.alive()
    finally:
        server.stop()
    assert "Traceback" not in server.log.read_text()


def _merged(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for n, flags in extents:
        if out and out[-1][1] == flags:
            out[-1][0] += n
        else:
            out.append([n, flags])
    return [(n, f) for n, f in out]
