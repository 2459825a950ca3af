"""Bounded memory against real hostile clients (docs/architecture.md: bytes in flight have a
budget; a client that does not read its replies is not read from)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from pathlib import Path

from tests.nbd_server import Server, connect, reads_zeros_beside, served_pool
from thinblock.frontends.nbd import constants as c

MiB = 1 << 20
FLAGS = struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES)


def _go(name: bytes) -> bytes:
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    return struct.pack(">QII", c.IHAVEOPT, c.OPT_GO, len(data)) + data


def _req(cmd: int, offset: int, length: int, cookie: int = 1) -> bytes:
    return struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, cmd, cookie, offset, length)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _raw(server: Server) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.socket)
    s.settimeout(5)
    return s


def test_hostile_clients_stay_within_the_memory_budget(tmp_path: Path) -> None:
    """Two clients that never read 64 x 32 MiB READs, eight half-sent 32 MiB WRITEs and a
    burst of 200 connections: server RSS stays under 512 MiB, no connection is refused,
    and another client's 4 KiB read takes under a second."""
    with served_pool(tmp_path, "1G", {"disk": "512M"}) as server:
        pid = server.proc.pid
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes(pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        hostile: list[socket.socket] = []
        burst: list[socket.socket] = []
        try:
            # Plain (not structured) replies: each READ's reply carries all 32 MiB.
            for _ in range(2):
                s = _raw(server)
                s.sendall(FLAGS + _go(b"disk") + b"".join(_req(c.CMD_READ, 0, 32 * MiB, i) for i in range(64)))
                hostile.append(s)
            for i in range(8):
                s = _raw(server)
                # A timeout means the server stopped reading it: that is the budget at work.
                with contextlib.suppress(TimeoutError):
                    s.sendall(FLAGS + _go(b"disk") + _req(c.CMD_WRITE, i * 32 * MiB, 32 * MiB) + os.urandom(MiB))
                hostile.append(s)
            # A real burst: non-blocking connects, so a full listen backlog is a refusal
            # (EAGAIN), not a wait.
            refused = 0
            for _ in range(200):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(server.socket)
                except BlockingIOError:
                    refused += 1
                    s.close()
                    continue
                burst.append(s)
            assert refused == 0, f"{refused} of 200 connections were refused"
            for s in burst:
                s.settimeout(10)
            greeted = sum(1 for s in burst if len(s.recv(18, socket.MSG_WAITALL)) == 18)
            assert greeted == 200, f"{200 - greeted} of 200 connections got no greeting"
            time.sleep(2)  # let the server take in whatever it will
            h = connect(server)
            start = time.monotonic()
            h.pread(4096, 0)
            latency = time.monotonic() - start
            h.shutdown()
            assert server.alive()
        finally:
            done.set()
            sampler.join()
            for s in hostile + burst:
                s.close()
        print(f"peak RSS {peak[0] / MiB:.0f} MiB, 4 KiB read {latency * 1000:.1f} ms")
        assert peak[0] < 512 * MiB, f"server RSS reached {peak[0] / MiB:.0f} MiB"
        assert latency < 1.0, f"a 4 KiB read took {latency:.2f} s"


def test_largest_requests_of_the_reference_client(tmp_path: Path) -> None:
    """nbd-tester-client's integrityhuge trace sends requests up to 47.5 MiB: reads and
    writes up to 64 MiB work, larger reads get EINVAL/EOVERFLOW and the connection lives."""
    with served_pool(tmp_path, "256M", {"disk": "128M"}) as server:
        h = connect(server)
        data = os.urandom(47 * MiB + MiB // 2)
        h.pwrite(data, 3 * MiB)
        assert h.pread(len(data), 3 * MiB) == data
        h.pwrite(data[: 64 * MiB], 0)
        assert len(h.pread(64 * MiB, 0)) == 64 * MiB
        h.shutdown()
        # libnbd will not send more than 64 MiB; a raw client does, and gets EINVAL.
        s = _raw(server)
        s.recv(18, socket.MSG_WAITALL)
        s.sendall(FLAGS + struct.pack(">QII", c.IHAVEOPT, c.OPT_EXPORT_NAME, 4) + b"disk")
        assert len(s.recv(10, socket.MSG_WAITALL)) == 10  # size and flags
        s.sendall(_req(c.CMD_READ, 0, 64 * MiB + 4096, 5) + _req(c.CMD_READ, 3 * MiB, 4096, 6))
        magic, error, cookie = struct.unpack(">IIQ", s.recv(16, socket.MSG_WAITALL))
        assert (magic, error, cookie) == (c.SIMPLE_REPLY_MAGIC, c.EINVAL, 5)
        magic, error, cookie = struct.unpack(">IIQ", s.recv(16, socket.MSG_WAITALL))
        assert (error, cookie) == (0, 6) and s.recv(4096, socket.MSG_WAITALL) == data[3 * MiB : 3 * MiB + 4096]
        s.close()


def test_a_write_payload_that_stalls_half_way_is_cut_off_when_others_wait(tmp_path: Path) -> None:
    """Six clients that announce 32 MiB writes, send 10 bytes and stop hold all the memory
    large requests share. While nobody waits for it they may stay silent (a frozen
    client finishes its write later); once another client's 2 MiB writes wait, a sender
    silent for --payload-timeout seconds is cut off, and those writes go through."""
    with served_pool(tmp_path, "1G", {"disk": "512M"}, "--payload-timeout", "1") as server:
        stalled = []
        for i in range(6):
            s = _raw(server)
            s.settimeout(60)  # the test's own bound: far beyond the server's second
            s.recv(18, socket.MSG_WAITALL)
            s.sendall(FLAGS + struct.pack(">QII", c.IHAVEOPT, c.OPT_EXPORT_NAME, 4) + b"disk")
            assert len(s.recv(10, socket.MSG_WAITALL)) == 10
            s.sendall(_req(c.CMD_WRITE, i * 32 * MiB, 32 * MiB, i) + b"x" * 10)
            stalled.append(s)
        time.sleep(3)  # three payload timeouts, with nobody waiting: nobody is cut off
        assert not select.select(stalled, [], [], 0)[0]
        first = stalled[0]
        first.sendall(b"y" * (32 * MiB - 10))  # the frozen client wakes up and finishes
        assert struct.unpack(">IIQ", first.recv(16, socket.MSG_WAITALL)) == (c.SIMPLE_REPLY_MAGIC, 0, 0)
        first.sendall(_req(c.CMD_WRITE, 0, 32 * MiB, 9) + b"x" * 10)  # and stalls again
        data = os.urandom(2 * MiB)
        done: list[bool] = []

        def victim() -> None:
            h = connect(server)
            for i in range(4):
                h.pwrite(data, 256 * MiB + i * len(data))
            done.append(h.pread(len(data), 256 * MiB) == data)
            h.shutdown()

        writer = threading.Thread(target=victim)
        writer.start()
        writer.join(60)
        assert done == [True]
        # The server gives a cut session's memory back before it closes its socket: wait
        # for a close to show, however slow the machine.
        select.select(stalled, [], [], 30)
        cut = [s for s in stalled if select.select([s], [], [], 0)[0] and s.recv(1) == b""]
        assert cut  # at least one sender was cut off for the victim
        for s in stalled:
            s.close()
    assert server.log.read_text().count("closed (its write's payload stalled") >= len(cut)


def test_a_client_that_reads_no_replies_is_cut_off_when_others_wait(tmp_path: Path) -> None:
    """Clients that send 32 MiB READs and never read the replies hold the memory large
    requests share. While nobody waits they keep their connections (a frozen client
    reads later); once another client's 2 MiB reads wait, the silent readers are cut
    off after --payload-timeout seconds, and those reads go through."""
    with served_pool(tmp_path, "1G", {"disk": "512M"}, "--payload-timeout", "1") as server:
        silent = []
        for i in range(6):  # 6 x 32 MiB: the whole large-request budget, nobody waits yet
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(server.socket)
            s.settimeout(60)
            s.recv(18, socket.MSG_WAITALL)
            s.sendall(FLAGS + struct.pack(">QII", c.IHAVEOPT, c.OPT_EXPORT_NAME, 4) + b"disk")
            assert len(s.recv(10, socket.MSG_WAITALL)) == 10
            s.sendall(_req(c.CMD_READ, i * 32 * MiB, 32 * MiB, 1))
            silent.append(s)
        time.sleep(3)  # three timeouts with nobody waiting: nobody is cut off
        log = server.log.read_text()
        assert "reading its replies stalled" not in log, log
        assert reads_zeros_beside(lambda: connect(server))
        for s in silent:
            s.close()
    assert "reading its replies stalled" in server.log.read_text()
