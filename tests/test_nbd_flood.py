"""Pre-authentication denial of service and BLOCK_STATUS fairness, against a real
`thinblock serve`: floods of silent sockets, one address or one certificate
holding many connections, and clients mapping a whole volume with block status
while another client reads (issue 21). Every number here is a bound the test
states, and every wait is for a condition with a generous deadline.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, served_pool, thinblock
from tests.test_access import _pki
from thinblock import Pool
from thinblock.frontends.nbd import constants as c
from thinblock.frontends.nbd.limits import Admission, AdmissionLimits, Slot, certificate_identity

KiB, MiB = 1 << 10, 1 << 20

# ----- connection floods -------------------------------------------------------------------


def _tcp(port: int, source: str) -> socket.socket:
    """A TCP connection to the server from a chosen loopback address (127.0.0.x all
    reach the loopback interface on Linux, each a different source address)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


class Flood:
    """`count` TCP sockets that read the greeting and then send nothing, spread over
    `sources`, each reopened as soon as the server drops it, on a thread of its own
    until stopped (at most `max_s` seconds and `max_opens` connections in all)."""

    def __init__(self, port: int, sources: list[str], count: int, *, max_s: float = 60, max_opens: int = 50_000):
        self.port, self.sources, self.count = port, sources, count
        self.max_s, self.max_opens = max_s, max_opens
        self.opens = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()

    def _open(self, i: int) -> socket.socket | None:
        if self.opens >= self.max_opens:
            return None
        self.opens += 1
        with contextlib.suppress(OSError):
            s = _tcp(self.port, self.sources[i % len(self.sources)])
            s.setblocking(False)
            return s
        return None

    def _run(self) -> None:
        socks: dict[int, socket.socket | None] = {i: self._open(i) for i in range(self.count)}
        deadline = time.monotonic() + self.max_s
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                poller = select.poll()
                by_fd = {}
                for i, s in socks.items():
                    if s is None:
                        socks[i] = s = self._open(i)
                    if s is not None:
                        poller.register(s.fileno(), select.POLLIN)
                        by_fd[s.fileno()] = i
                for fd, _ev in poller.poll(50):
                    i = by_fd[fd]
                    s = socks[i]
                    assert s is not None
                    try:
                        alive = bool(s.recv(4096))  # the greeting (kept silent after it), or EOF
                    except BlockingIOError:
                        alive = True
                    except OSError:
                        alive = False
                    if not alive:
                        s.close()
                        socks[i] = None  # dropped: reopened on the next round
        finally:
            for s in socks.values():
                if s is not None:
                    s.close()


def _export_name(s: socket.socket, name: str = "disk") -> bool:
    """A raw newstyle handshake straight to transmission (NBD_OPT_EXPORT_NAME): True
    if the server let this connection in, False if it refused (closed) it."""
    try:
        greeting = _recv_exactly(s, 18)
        if greeting is None:
            return False
        s.sendall(
            struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES)
            + struct.pack(">QII", c.IHAVEOPT, c.OPT_EXPORT_NAME, len(name))
            + name.encode()
        )
        return _recv_exactly(s, 10) is not None  # size and transmission flags
    except OSError:
        return False


def _recv_exactly(s: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            return None
        out += got
    return out


def _tcp_size(uri: str) -> int:
    h = nbd.NBD()
    h.connect_uri(uri)
    size = int(h.get_size())
    h.shutdown()
    return size


def _threads_and_rss(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) * KiB


def test_silent_flood_does_not_lock_out_real_clients(tmp_path: Path) -> None:
    """300 silent sockets from 20 addresses (more than the 256 slots) plus 20 from the
    client's own address, reopened when dropped: 30 real clients in a row all get in."""
    with served_pool(tmp_path, "64M", {"disk": "16M"}, "--listen", "0", "--insecure") as server:
        uri = server.tcp_uri("disk")
        port = int(uri.rsplit(":", 1)[1].split("/")[0])
        others = [f"127.0.0.{i}" for i in range(2, 22)]
        with Flood(port, others, 300) as flood, Flood(port, ["127.0.0.1"], 20) as own:
            deadline = time.monotonic() + 30
            while flood.opens < 300 and time.monotonic() < deadline:
                time.sleep(0.05)  # wait until the flood is all there
            time.sleep(1)
            got_in = 0
            peak_threads = peak_rss = 0
            for _ in range(30):
                with contextlib.suppress(nbd.Error):
                    got_in += _tcp_size(uri) == 16 * MiB
                threads, rss = _threads_and_rss(server.proc.pid)
                peak_threads, peak_rss = max(peak_threads, threads), max(peak_rss, rss)
            opened = flood.opens + own.opens
        assert server.alive()
        print(
            f"real clients in: {got_in} of 30; flood connections opened: {opened}; "
            f"server peak {peak_threads} threads, {peak_rss >> 20} MiB RSS"
        )
        assert got_in == 30
        # Bounded: a reader thread per slot (256), a writer per connection in
        # transmission, 16 refusers, the workers; never a thread per flood connection.
        assert peak_threads < 600 and peak_rss < 512 * MiB
        assert opened > 320  # the flood really was dropped and reopened
    log = server.log.read_text()
    assert "displaced by a newer connection" in log


def test_one_address_cannot_hold_every_slot(tmp_path: Path) -> None:
    """One address opening 256 connections (the whole cap) gets its 64 and no more:
    clients from other addresses still get in; past the limit it is told why."""
    with served_pool(tmp_path, "64M", {"disk": "16M"}, "--listen", "0", "--insecure") as server:
        uri = server.tcp_uri("disk")
        port = int(uri.rsplit(":", 1)[1].split("/")[0])
        hog: list[socket.socket] = []
        admitted = 0
        try:
            for _ in range(256):
                s = _tcp(port, "127.0.0.2")
                hog.append(s)
                admitted += _export_name(s)
            assert admitted == 64  # --max-connections-per-address's default
            other = _tcp(port, "127.0.0.3")
            hog.append(other)
            assert _export_name(other)
            assert _tcp_size(uri) == 16 * MiB  # from 127.0.0.1, with libnbd
            # Past the limit, a client with options is told why (NBD_REP_ERR_POLICY).
            refused = _tcp(port, "127.0.0.2")
            hog.append(refused)
            assert _recv_exactly(refused, 18)
            refused.sendall(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE) + struct.pack(">QII", c.IHAVEOPT, c.OPT_LIST, 0))
            magic, option, reply, length = struct.unpack(">QIII", _recv_exactly(refused, 20) or bytes(20))
            assert (magic, option, reply) == (c.OPTION_REPLY_MAGIC, c.OPT_LIST, c.REP_ERR_POLICY)
            assert b"--max-connections-per-address" in (_recv_exactly(refused, length) or b"")
        finally:
            for s in hog:
                s.close()
        assert server.alive()
    assert "the limit (--max-connections-per-address)" in server.log.read_text()


def test_one_certificate_cannot_hold_every_slot(tmp_path: Path) -> None:
    """With --max-connections-per-identity 3, a fourth connection with the same client
    certificate is refused with the reason; another certificate still gets in."""
    pki, clients = _pki(tmp_path / "pki")
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "disk", "--size", "16M")
    server = Server(
        pool, "--listen", "0", "--tls-cert", str(pki / "server-cert.pem"), "--tls-key", str(pki / "server-key.pem"),
        "--tls-ca", str(pki / "ca-cert.pem"), "--max-connections-per-identity", "3",
    )  # fmt: skip
    handles: list[nbd.NBD] = []
    try:
        port = server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0]

        def handle(name: str) -> nbd.NBD:
            h = nbd.NBD()
            h.set_tls(nbd.TLS_REQUIRE)
            h.set_tls_certificates(str(clients[name]))
            h.connect_uri(f"nbds://localhost:{port}/disk")
            handles.append(h)
            return h

        for _ in range(3):
            assert handle("admin").get_size() == 16 * MiB
        with pytest.raises(nbd.Error, match="server policy prevents"):
            handle("admin")
        assert handle("backup").get_size() == 16 * MiB
        handles.pop(0).shutdown()  # one of admin's goes: admin may connect again
        assert handle("admin").get_size() == 16 * MiB
        assert server.alive()
    finally:
        for h in handles:
            with contextlib.suppress(nbd.Error):
                h.shutdown()
        server.stop()
    log = server.log.read_text()
    assert "the limit (--max-connections-per-identity)" in log and "Traceback" not in log


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
        # The bound was 20 ms (measured here 1-2 ms; the main of then gave 8 reads in
        # 5 s, p99 1.27 s). The test allows five times that, so that a loaded 2-core machine
        # cannot fail it by scheduling alone, and still fails the old behaviour by 12x; the
        # figure itself is printed above and measured by bench/.
        assert len(loaded) >= 200
        assert p99(loaded) < 0.100
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


# ----- the admission rules alone ------------------------------------------------------------


class _Occupant:
    def __init__(self, readable: bool = False) -> None:
        self.pending = readable
        self.displaced = False

    def readable(self) -> bool:
        return self.pending

    def displace(self) -> None:
        self.displaced = True


def test_admission_rules_alone() -> None:
    rules = Admission(AdmissionLimits(4, 2, 3, 1))
    a1, a2 = _Occupant(), _Occupant(readable=True)  # a2's first byte is waiting, unread
    s1, s2 = rules.admit("a", a1), rules.admit("a", a2)
    assert isinstance(s1, Slot) and isinstance(s2, Slot)
    # A third negotiating from "a" displaces the oldest silent one of "a": s1, not s2.
    s3 = rules.admit("a", _Occupant())
    assert isinstance(s3, Slot) and a1.displaced and not a2.displaced
    assert not rules.heard(s1)  # the displaced one must close
    assert rules.heard(s2) and rules.heard(s3)
    # Nobody silent left at "a": refused, with the reason.
    refused = rules.admit("a", _Occupant())
    assert isinstance(refused, str) and "--max-negotiating-per-address" in refused
    rules.serving(s2)
    rules.serving(s3)
    s4 = rules.admit("a", _Occupant())
    assert isinstance(s4, Slot)  # two negotiating at most: s2, s3 are serving now
    rules.heard(s4)
    total = rules.admit("a", _Occupant())
    assert isinstance(total, str) and "--max-connections-per-address" in total
    # Other addresses fill the server; the global cap displaces a silent one anywhere.
    b = _Occupant()
    assert isinstance(rules.admit("b", b), Slot)
    assert len(rules) == 4
    assert isinstance(rules.admit(None, _Occupant()), Slot) and b.displaced
    # One certificate, one connection (the limit here).
    assert rules.claim_identity(s2, "CN=admin") is None
    assert "--max-connections-per-identity" in (rules.claim_identity(s3, "CN=admin") or "")
    rules.release(s2)
    assert rules.claim_identity(s3, "CN=admin") is None
    assert certificate_identity({"subject": ((("commonName", "a"),), (("organizationName", "o"),))}) == (
        "commonName=a,organizationName=o"
    )


# ----- the status thread's turns and REQ_ONE's walk, alone ---------------------------------


def test_status_queue_takes_connections_in_turn() -> None:
    """One connection's queued walks delay another's by one walk each, not all of them."""
    from thinblock.frontends.nbd.status import StatusQueue

    queue = StatusQueue()
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def job(name: str, hold: bool = False) -> None:
        if hold:
            started.set()
            release.wait(30)
        ran.append(name)

    a, b = object(), object()
    queue.submit(a, lambda: job("a0", hold=True))
    assert started.wait(30)  # a0 runs; everything below queues behind it
    for name in ("a1", "a2", "a3"):
        queue.submit(a, lambda name=name: job(name))  # type: ignore[misc]
    queue.submit(b, lambda: job("b1"))
    release.set()
    queue.shutdown()
    assert ran == ["a0", "a1", "b1", "a2", "a3"]


def test_req_one_walks_only_as_far_as_the_first_extent(tmp_path: Path) -> None:
    """qemu sets REQ_ONE on every block status: the walk must stop near the first
    extent's end, not cover a whole mapping page (4.6 ms a request before)."""
    from thinblock.frontends.nbd.status import REQ_ONE_BLOCKS, bounded_status

    pool = Pool.create(str(tmp_path / "pool"), 64 * MiB, block_size=BLOCK)
    try:
        vol = pool.create_volume("disk", 32 * MiB)
        for i in range(0, 2048, 2):  # one mapping page full of alternating extents
            vol.write(i * BLOCK, b"d" * BLOCK)
        asked: list[int] = []

        def walk(name: str, offset: int, length: int) -> list[tuple[int, int]]:
            asked.append(length)
            return [(n, 0 if state.name == "DATA" else 3) for n, state in vol.block_status(offset, length)]

        got = bounded_status(walk, {1: "base:allocation"}, [vol], 0, vol.size_bytes, req_one=True, pace=False)
        assert got == [(1, [(BLOCK, 0)])]
        assert sum(asked) <= REQ_ONE_BLOCKS * BLOCK
        whole = bounded_status(walk, {1: "base:allocation"}, [vol], 0, vol.size_bytes, pace=False)
        assert whole[0][1][:3] == [(BLOCK, 0), (BLOCK, 3), (BLOCK, 0)]  # without REQ_ONE: every extent
    finally:
        pool.close()
