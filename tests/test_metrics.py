"""`serve --metrics`: a real server scraped over HTTP, real NBD clients (qemu-io,
libnbd) doing the requests, and prometheus_client's own parser reading the text."""

from __future__ import annotations

import json
import mmap
import os
import re
import select
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

import nbd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import new_rados_locator
from tests.nbd_server import Server, connect, served_pool, thinblock
from tests.nbd_tls_client import PKI
from tests.test_attach import env  # noqa: F401 (the fixture: a private runtime dir, cleaned up after)
from thinblock.frontends.metrics import MAX_SCRAPES, parse_address
from thinblock.frontends.nbd.limits import Admission, AdmissionLimits, Refusal, Slot
from thinblock.stats import LATENCY_BUCKETS_S, ExportStats, Histogram

MiB = 1 << 20
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(server: Server) -> tuple[Samples, dict[str, Any]]:
    """Every sample of one scrape, by (name, labels), and the families by name."""
    assert server.metrics_url is not None, "the server printed no metrics line"
    assert server.metrics_url.startswith("http://127.0.0.1:")  # localhost by default
    with urllib.request.urlopen(server.metrics_url, timeout=30) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, families


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def qemu_io(uri: str, *commands: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    proc = subprocess.run([*args, uri], capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0 and "failed" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    with served_pool(tmp_path, "64M", {"disk": "32M"}, "--metrics", "127.0.0.1:0") as server:
        yield server


def check_histogram(samples: Samples, name: str, **labels: str) -> None:
    """Buckets for every bound and +Inf, cumulative (never falling), +Inf equal to _count."""
    counts = [value(samples, f"{name}_bucket", **labels, le=repr(b)) for b in LATENCY_BUCKETS_S]
    keys = {k for k in samples if k[0] == f"{name}_bucket" and frozenset(labels.items()) <= k[1]}
    assert len(keys) == len(LATENCY_BUCKETS_S) + 1, sorted(keys)
    infinite = value(samples, f"{name}_bucket", **labels, le="+Inf")
    assert counts == sorted(counts) and counts[-1] <= infinite
    assert infinite == value(samples, f"{name}_count", **labels) > 0
    assert value(samples, f"{name}_sum", **labels) > 0


def test_writes_through_nbd_are_counted(served: Server) -> None:
    """1 MiB written by qemu-io in 16 requests: the write bytes counter grows by at
    least that, the ops by 16, the latency histogram is whole and cumulative, and
    the pool's figures are those `pool status --json` gives."""
    pool = served.pool
    before, _ = scrape(served)
    key = {"pool": pool, "export": "disk", "op": "write"}
    writes = [f"write -P 0x{i + 1:02x} {i * 64}k 64k" for i in range(16)]
    qemu_io(served.unix_uri("disk"), *writes, "read -P 0x01 0 64k", "flush")
    mapped = subprocess.run(
        ["nbdinfo", "--map", served.unix_uri("disk")], capture_output=True, text=True, timeout=60, check=True
    )
    assert "data" in mapped.stdout
    after, families = scrape(served)

    grown = value(after, "thinblock_export_bytes_total", **key) - value(before, "thinblock_export_bytes_total", **key)
    assert grown >= MiB
    assert value(after, "thinblock_export_ops_total", **key) - value(before, "thinblock_export_ops_total", **key) >= 16
    read = {**key, "op": "read"}
    assert value(after, "thinblock_export_bytes_total", **read) >= 64 << 10
    assert value(after, "thinblock_export_ops_total", export="disk", pool=pool, op="flush") >= 1
    assert value(after, "thinblock_export_ops_total", export="disk", pool=pool, op="block_status") >= 1
    assert value(after, "thinblock_export_bytes_total", export="disk", pool=pool, op="block_status") >= 32 * MiB
    check_histogram(after, "thinblock_export_latency_seconds", **key)
    check_histogram(after, "thinblock_pool_commit_latency_seconds", pool=pool)
    assert value(after, "thinblock_pool_commits_total", pool=pool) > value(
        before, "thinblock_pool_commits_total", pool=pool
    )
    assert families["thinblock_export_latency_seconds"].type == "histogram"
    assert families["thinblock_export_ops"].type == "counter"
    assert families["thinblock_pool_used_bytes"].type == "gauge"
    assert value(after, "thinblock_nbd_connections_accepted_total", pool=pool) >= 1

    status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
    for name in ("size", "used", "free", "reserved", "available"):
        assert value(after, f"thinblock_pool_{name}_bytes", pool=pool) == status[f"{name}_bytes"], name
    assert status["used_bytes"] >= MiB
    assert value(after, "thinblock_pool_granted_bytes", pool=pool) == 0
    assert value(after, "thinblock_pool_host_free_bytes", pool=pool) > 0


def test_failures_are_counted_by_errno(tmp_path: Path) -> None:
    """A write the pool has no room for counts as ENOSPC (on the export and the pool),
    and a read past the end that the server refuses before it runs as EINVAL."""
    with served_pool(tmp_path, "1M", {"disk": "8M"}, "--metrics", "127.0.0.1:0") as server:
        h = connect(server, strict=False)
        with pytest.raises(nbd.Error) as full:
            h.pwrite(b"\1" * (2 * MiB), 0)
        assert full.value.errno == "ENOSPC"
        with pytest.raises(nbd.Error) as beyond:
            h.pread(4096, 8 * MiB)
        assert beyond.value.errno == "EINVAL"
        h.shutdown()
        samples, _ = scrape(server)
    key = {"pool": server.pool, "export": "disk"}
    assert value(samples, "thinblock_export_errors_total", **key, op="write", errno="ENOSPC") == 1
    assert value(samples, "thinblock_export_errors_total", **key, op="read", errno="EINVAL") == 1
    assert value(samples, "thinblock_pool_enospc_total", pool=server.pool) == 1
    assert value(samples, "thinblock_export_bytes_total", **key, op="write") == 0  # failed: no bytes


def test_refusals_are_counted_by_limit(tmp_path: Path) -> None:
    """Past --max-connections the newcomer is refused, and counted under that limit.
    (A bare port: the endpoint is on 127.0.0.1, which scrape() checks.)"""
    with served_pool(tmp_path, "64M", {"disk": "32M"}, "--metrics", "0", "--max-connections", "1") as server:
        first = connect(server)
        with pytest.raises(nbd.Error):
            connect(server)
        samples, _ = scrape(server)
        assert value(samples, "thinblock_nbd_connections", pool=server.pool) == 1
        first.shutdown()
    assert value(samples, "thinblock_nbd_refusals_total", pool=server.pool, reason="max-connections") == 1
    assert value(samples, "thinblock_nbd_connections_accepted_total", pool=server.pool) == 1


@pytest.mark.parametrize("bad", ["nonsense", "127.0.0.1:70000", "::1:9000", "host:", "[::1:9000"])
def test_bad_metrics_address_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    proc = thinblock("serve", pool, "--metrics", bad, check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("thinblock: error:") and "--metrics" in last and "[HOST:]PORT" in last, proc.stderr


def test_metrics_port_in_use_is_one_sentence(tmp_path: Path) -> None:
    """A taken port: one sentence naming the address, exit 1, the pool left as it was."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = thinblock("serve", pool, "--socket", str(tmp_path / "s.sock"), "--metrics", str(port), check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"thinblock: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
    )
    assert "ready" not in proc.stdout
    thinblock("pool", "check", pool)


def test_metrics_on_ipv6_loopback(tmp_path: Path) -> None:
    with served_pool(tmp_path, "64M", {"disk": "32M"}, "--metrics", "[::1]:0") as server:
        assert server.metrics_url is not None and server.metrics_url.startswith("http://[::1]:")
        with urllib.request.urlopen(server.metrics_url, timeout=30) as reply:
            text = reply.read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "thinblock_pool_size_bytes" in names


def test_parse_address() -> None:
    assert parse_address("9750") == ("127.0.0.1", 9750)
    assert parse_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_address("[::1]:9750") == ("::1", 9750)
    for bad in ("", "x", ":1", "[]:1", "::1:1", "1:65536"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_rados_lease_events(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A takeover shows on both servers: the taker broke the lock, fenced the holder
    and acquired the lease; the holder's next renewal finds the lease lost, and it
    stops (counting `lost` on the way: docs/monitoring.md)."""
    locator = new_rados_locator(request, "metrics")
    thinblock("pool", "create", locator, "--size", "256M")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    os.environ["THINBLOCK_RADOS_LEASE_S"] = "3"  # renewed every second
    try:
        first = Server(locator, "--socket", str(tmp_path / "a.sock"), "--metrics", "0", workdir=tmp_path / "a")
        held, _ = scrape(first)
        assert value(held, "thinblock_lease_events_total", pool=locator, event="acquired") == 1
        second = Server(
            locator, "--socket", str(tmp_path / "b.sock"), "--metrics", "0", "--takeover", workdir=tmp_path / "b"
        )
    finally:
        del os.environ["THINBLOCK_RADOS_LEASE_S"]
    try:
        taker, _ = scrape(second)
        for event in ("acquired", "lock_broken", "fenced_holder"):
            assert value(taker, "thinblock_lease_events_total", pool=locator, event=event) == 1, event
        first.proc.wait(timeout=60)  # its next renewal finds the lease lost: it stops by itself
        log = first.log.read_text()
        assert "its lease is lost" in log and "Traceback" not in log, log
    finally:
        second.stop()
        first.stop()


def test_grafana_dashboard_uses_only_served_metrics(served: Server) -> None:
    """Every series contrib/grafana/thinblock.json queries is one the server declares."""
    dashboard = json.loads((Path(__file__).parent.parent / "contrib" / "grafana" / "thinblock.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert any("histogram_quantile" in e for e in exprs)
    _, families = scrape(served)
    named = {m for e in exprs for m in re.findall(r"thinblock_[a-z_]+", e)}
    assert len(named) >= 15
    for metric in sorted(named):
        assert re.sub(r"_(total|bucket|count|sum)$", "", metric) in families, metric


def test_writes_through_an_attached_device_are_counted(env: Path) -> None:  # noqa: F811 (the fixture)
    """The served pool's FUSE mount (attach) counts in the same export handle as NBD:
    1 MiB written to the loop device shows as write bytes of that export."""
    with served_pool(env, "64M", {"disk": "32M"}, "--metrics", "0") as server:
        dev = thinblock("attach", server.pool, "disk").stdout.strip()
        try:
            fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
            try:
                buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT wants
                buf.write(b"\x5a" * MiB)
                assert os.pwritev(fd, [buf], 0) == MiB
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            thinblock("detach", dev)
        samples, _ = scrape(server)
    key = {"pool": server.pool, "export": "disk"}
    assert value(samples, "thinblock_export_bytes_total", **key, op="write") >= MiB
    assert value(samples, "thinblock_export_ops_total", **key, op="flush") >= 1


def test_authz_refusals_are_counted(tmp_path: Path) -> None:
    """Under --tls-authz, a client certificate asking for an export its grant does
    not cover is refused, and counted as an authz refusal."""
    pki = PKI(tmp_path / "pki")
    backup = pki.client("backup", "/CN=backup")
    rules = tmp_path / "authz"
    rules.write_text("backup ro disk\n")
    rules.chmod(0o600)
    with served_pool(
        tmp_path, "64M", {"disk": "16M", "other": "16M"}, *pki.serve_args(rules), "--metrics", "0"
    ) as server:
        port = server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0]
        allowed = nbd.NBD()
        allowed.set_tls(nbd.TLS_REQUIRE)
        allowed.set_tls_certificates(str(backup))
        allowed.connect_uri(f"nbds://localhost:{port}/disk")
        allowed.shutdown()
        refused = nbd.NBD()
        refused.set_tls(nbd.TLS_REQUIRE)
        refused.set_tls_certificates(str(backup))
        with pytest.raises(nbd.Error):
            refused.connect_uri(f"nbds://localhost:{port}/other")
        samples, _ = scrape(server)
    assert value(samples, "thinblock_nbd_refusals_total", pool=server.pool, reason="authz") == 1


def test_latency_buckets_count_a_bound_as_within_it() -> None:
    """Prometheus's le is "less than or equal": a request of exactly 1 ms is in le=0.001."""
    h = Histogram()
    for seconds in (0.001, 10.0, 10.5):
        h.observe(seconds)
    assert h.buckets[LATENCY_BUCKETS_S.index(0.001)] == 1
    assert h.buckets[LATENCY_BUCKETS_S.index(10.0)] == 1 and h.buckets[-1] == 1  # +Inf
    stats = ExportStats()  # its request path bins the same way
    stats.done("read", 1, perf_counter() - 20.0)  # started 20 s ago: beyond 10 s
    stats.failed("read", 28)
    counts = stats.snapshot()["read"]
    assert counts.latency.buckets[-1] == 1 and counts.latency.count == 1
    assert counts.errors == {"ENOSPC": 1} and counts.ops == 2 and counts.bytes == 1


def test_refusals_name_the_limit() -> None:
    class Occupant:
        def readable(self) -> bool:
            return True  # never silent: never displaced

        def displace(self) -> None:
            raise AssertionError("displaced")

    rules = Admission(AdmissionLimits(2, 8, 1, 1))
    assert isinstance(rules.admit("a", Occupant()), Slot)
    per_address = rules.admit("a", Occupant())
    assert isinstance(per_address, Refusal) and per_address.limit == "max-connections-per-address"
    assert isinstance(rules.admit("b", Occupant()), Slot)
    total = rules.admit("c", Occupant())
    assert isinstance(total, Refusal) and total.limit == "max-connections"


def metrics_address(server: Server) -> tuple[str, int]:
    assert server.metrics_url is not None, "the server printed no metrics line"
    host, port = server.metrics_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return host, int(port)


def test_idle_connections_do_not_grow_the_server(served: Server) -> None:
    """A client opening many connections and sending nothing gets at most MAX_SCRAPES
    of them served at once (each newer one displaces the oldest, which is closed), so
    the server's threads stay bounded; once it lets go, scrapes are answered again."""
    address = metrics_address(served)
    tasks = Path(f"/proc/{served.proc.pid}/task")
    before = len(list(tasks.iterdir()))
    idle = [socket.create_connection(address, timeout=30) for _ in range(MAX_SCRAPES + 24)]
    try:
        # The server closes one connection for each beyond its limit: wait for that
        # (without the limit, each of them holds a thread and hears nothing).
        closed: set[int] = set()
        deadline = time.monotonic() + 30
        while len(closed) < 24 and time.monotonic() < deadline:
            ready, _, _ = select.select([s for i, s in enumerate(idle) if i not in closed], [], [], 1.0)
            for s in ready:
                assert s.recv(1) == b""
                closed.add(idle.index(s))
        assert len(closed) >= 24, f"only {len(closed)} of the idle connections beyond the limit were closed"
        # A displaced connection's thread gives its slot back just before it ends: the
        # last one may still be leaving as its successor starts.
        deadline = time.monotonic() + 30
        while len(list(tasks.iterdir())) > before + MAX_SCRAPES:
            assert time.monotonic() < deadline, f"{len(list(tasks.iterdir())) - before} threads for the connections"
            time.sleep(0.05)
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30
    while True:  # the held connections' threads see their EOF and give their slots back
        try:
            samples, _ = scrape(served)
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, "no scrape was answered after the idle connections closed"
            time.sleep(0.1)
    assert value(samples, "thinblock_pool_size_bytes", pool=served.pool) == 64 * MiB


class Trickle:
    """Slowloris: connections that each send a request's first line, then one header
    byte every half second, from a thread of their own (each byte well within any
    timeout per receive); a connection the server hangs up on is noted and dropped."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.socks = [socket.create_connection(address, timeout=30) for _ in range(count)]
        self.changed = threading.Condition()
        self.rounds = 0  # header bytes sent to every connection still open
        self.closed: set[int] = set()  # indexes of the connections the server hung up on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trickle", daemon=True)

    def __enter__(self) -> Trickle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()

    def wait(self, predicate: Callable[[], bool]) -> bool:
        """Whether predicate came true within 30 s (checked after every round)."""
        with self.changed:
            return self.changed.wait_for(predicate, 30)

    def _run(self) -> None:
        for s in self.socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: slow\r\nX-Slow: ")
        while not self._stop.wait(0.5):
            with self.changed:
                for i, s in enumerate(self.socks):
                    if i in self.closed:
                        continue
                    try:
                        ready, _, _ = select.select([s], [], [], 0)
                        if ready and s.recv(1) == b"":  # it never answers a request still arriving
                            raise ConnectionError
                        s.send(b"a")
                    except OSError:
                        self.closed.add(i)
                self.rounds += 1
                self.changed.notify_all()


def test_slow_requests_do_not_lock_out_a_scrape(served: Server) -> None:
    """MAX_SCRAPES connections trickling their headers (a byte every half second, so
    no timeout per receive ever fires) hold every slot; a real scrape still gets its
    answer at its first try, by displacing the oldest of them, which is closed."""
    with Trickle(metrics_address(served), MAX_SCRAPES) as slow:
        assert slow.wait(lambda: slow.rounds >= 2), "the slow connections did not get going"
        assert not slow.closed  # all of them held, none cut yet
        samples, _ = scrape(served)  # one try: before the fix, closed at once for ever
        assert value(samples, "thinblock_pool_size_bytes", pool=served.pool) == 64 * MiB
        assert slow.wait(lambda: 0 in slow.closed), "the oldest slow connection was not displaced"


def test_a_trickled_request_is_cut_at_its_deadline(served: Server) -> None:
    """One connection trickling its headers, with slots to spare: the server hangs up
    once SCRAPE_TIMEOUT_S (10 s) have passed in all, well within the 30 s waited
    (before the fix: never, as each byte came well within the timeout per receive)."""
    with Trickle(metrics_address(served), 1) as slow:
        assert slow.wait(lambda: bool(slow.closed)), f"still open after {slow.rounds} header bytes, one every 0.5 s"
    samples, _ = scrape(served)
    assert value(samples, "thinblock_pool_size_bytes", pool=served.pool) == 64 * MiB
