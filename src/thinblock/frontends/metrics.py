"""`serve --metrics`: the server's counters as Prometheus text on /metrics.

The counting is done elsewhere with plain integers (thinblock.stats: the export
handle, the commit pipeline, the NBD server, the RADOS lease); this module only
reads them at scrape time, through one custom collector in a registry of its
own (never prometheus_client's global one, so several servers in one process,
or tests, never collide). A scrape copies counters under their small locks and
asks the pool for its cheap space figures; it never walks mapping pages, and
holds the pool lock only as long as `space_figures()` does.

Names follow the node and Ceph exporters: prefix thinblock_, base units (bytes,
seconds), counters ending in _total, latency as histograms; labels pool,
export, op, errno, reason, event.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector

from thinblock.stats import LATENCY_BUCKETS_S, LEASE_EVENTS, Histogram

if TYPE_CHECKING:
    from thinblock.core.pool import Pool
    from thinblock.frontends.nbd.server import NBDServer

log = logging.getLogger("thinblock.metrics")

DEFAULT_HOST = "127.0.0.1"
# prometheus_client's own start_http_server gives every connection a thread with no
# timeout: one client opening connections and sending nothing grows the server's
# threads without end. Here a few scrapes run at once, each within a deadline, so the
# endpoint stays bounded. A timeout per receive alone is not enough: a client sending
# a header byte every second would hold its slot for ever, and MAX_SCRAPES of them the
# whole endpoint. So a connection gets SCRAPE_TIMEOUT_S in all (Prometheus's own default
# scrape timeout: a scrape taking longer is one it has given up on), and when every slot
# is taken a newcomer displaces the oldest connection whose request has not arrived in
# full (a real scraper sends its request at once), as NBD admission displaces silent
# handshakes. Only when all of them are being answered is the newcomer closed at once.
MAX_SCRAPES = 8
SCRAPE_TIMEOUT_S = 10.0
# How long a newcomer waits for a displaced connection's thread to end (it is in a
# receive that the hang-up ends at once): the thread count never passes MAX_SCRAPES.
DISPLACE_WAIT_S = 5.0


def parse_address(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[V6]:PORT` (port 0: any free port); the host defaults
    to 127.0.0.1. ValueError with a sentence for anything else."""
    host, sep, port = text.rpartition(":")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            host = ""  # unbalanced brackets: refused below
        else:
            host = host[1:-1]
    elif ":" in host:
        host = ""  # a bare IPv6 address is ambiguous with its port: it needs brackets
    if (sep and not host) or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"invalid address {text!r}: use [HOST:]PORT, e.g. 9750, 127.0.0.1:9750 or [::1]:9750")
    return host or DEFAULT_HOST, int(port)


def _histogram(name: str, help_text: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, help_text, labels=labels)


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, +Inf last, as the exposition format wants them."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), h.buckets, strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
    return out


class ThinblockCollector(Collector):
    """Everything one server shows, read when scraped."""

    def __init__(self, pool: Pool, server: NBDServer | None = None) -> None:
        self.pool = pool
        self.server = server

    def collect(self) -> Iterator[Metric]:
        yield from self._exports()
        yield from self._pool()
        if self.server is not None:
            yield from self._server(self.server)
        yield from self._lease()

    def _exports(self) -> Iterator[Metric]:
        pool = self.pool.path
        labels = ["pool", "export", "op"]
        ops = CounterMetricFamily(
            "thinblock_export_ops", "Requests on an export, by kind (failed ones too)", labels=labels
        )
        nbytes = CounterMetricFamily(
            "thinblock_export_bytes", "Bytes covered by the requests that succeeded, by kind", labels=labels
        )
        errors = CounterMetricFamily(
            "thinblock_export_errors", "Requests that failed, by kind and errno name", labels=[*labels, "errno"]
        )
        latency = _histogram(
            "thinblock_export_latency_seconds", "Time from a request's start to its result, by kind", labels
        )
        for export, stats in sorted(self.pool.stats.exports().items()):
            for op, counts in sorted(stats.snapshot().items()):
                key = [pool, export, op]
                ops.add_metric(key, counts.ops)
                nbytes.add_metric(key, counts.bytes)
                for name, n in sorted(counts.errors.items()):
                    errors.add_metric([*key, name], n)
                latency.add_metric(key, _buckets(counts.latency), counts.latency.sum_s)
        yield from (ops, nbytes, errors, latency)

    def _pool(self) -> Iterator[Metric]:
        pool = self.pool
        figures = pool.space_figures()  # counters only: no page walk
        host_free = pool.host.host_free_bytes()
        gauges = {
            "size": ("The pool's size", figures["size_bytes"]),
            "used": ("Space taken by data and provisioned blocks", figures["used_bytes"]),
            "free": ("Space not taken (reserved space included)", figures["free_bytes"]),
            "reserved": ("Free space set aside for volumes' reservations", figures["reserved_bytes"]),
            "available": ("Free space not set aside: what any volume can still take", figures["available_bytes"]),
            "granted": (
                "Free space handed out to volume owners in grants: always 0 until volumes are"
                " owned one by one (the whole pool is owned by this server)",
                0,
            ),
        }
        for name, (help_text, value) in gauges.items():
            g = GaugeMetricFamily(f"thinblock_pool_{name}_bytes", help_text, labels=["pool"])
            g.add_metric([pool.path], value)
            yield g
        g = GaugeMetricFamily(
            "thinblock_pool_host_free_bytes",
            "What the filesystem under the pool can still take (absent for raw devices and RADOS)",
            labels=["pool"],
        )
        if host_free is not None:
            g.add_metric([pool.path], host_free)
        yield g
        g = GaugeMetricFamily(
            "thinblock_pool_commit_failing", "1 while the pool's commits fail (it retries on its own)", labels=["pool"]
        )
        g.add_metric([pool.path], 1 if pool.commit_failure is not None else 0)
        yield g
        commits, failures, commit_latency, enospc = pool.stats.commit_snapshot()
        counters = {
            "commits": ("Commits that made the open transaction durable", commits),
            "commit_failures": ("Commits that failed (retried; nothing acknowledged is lost)", failures),
            "enospc": ("Requests that ended with ENOSPC (after any wait --when-full allows)", enospc),
            "low_water_events": ("Low-water marks crossed (pool, host and volume marks)", pool.policy.fired_count),
        }
        for name, (help_text, value) in counters.items():
            c = CounterMetricFamily(f"thinblock_pool_{name}", help_text, labels=["pool"])
            c.add_metric([pool.path], value)
            yield c
        h = _histogram(
            "thinblock_pool_commit_latency_seconds", "Time a commit takes: data sync, then metadata", ["pool"]
        )
        h.add_metric([pool.path], _buckets(commit_latency), commit_latency.sum_s)
        yield h

    def _server(self, server: NBDServer) -> Iterator[Metric]:
        accepted, refusals = server.stats.snapshot()
        with server.lock:
            current = len(server.sessions)
        g = GaugeMetricFamily("thinblock_nbd_connections", "NBD connections open now", labels=["pool"])
        g.add_metric([self.pool.path], current)
        yield g
        c = CounterMetricFamily("thinblock_nbd_connections_accepted", "NBD connections admitted", labels=["pool"])
        c.add_metric([self.pool.path], accepted)
        yield c
        c = CounterMetricFamily(
            "thinblock_nbd_refusals",
            "NBD connections or exports refused: by the limit met (its option's name) or authz",
            labels=["pool", "reason"],
        )
        for reason, n in sorted(refusals.items()):
            c.add_metric([self.pool.path, reason], n)
        yield c

    def _lease(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "thinblock_lease_events",
            "RADOS pool lease events: acquired, lock_broken, fenced_holder, renew_failed, lost, released",
            labels=["pool", "event"],
        )
        for (pool, event), n in sorted(LEASE_EVENTS.snapshot().items()):
            c.add_metric([pool, event], n)
        yield c


class _QuietHandler(WSGIRequestHandler):
    """One request per connection (wsgiref's way), with a timeout, logging nothing."""

    timeout = SCRAPE_TIMEOUT_S  # a backstop: the server's deadline cuts the connection first

    def parse_request(self) -> bool:
        # The request line and headers are in: from here on the connection is answered, and
        # no newcomer displaces it. False (no reply) if it was cut while they arrived: their
        # end was then the hang-up, not the blank line.
        server = self.server
        assert isinstance(server, _BoundedServer)
        return super().parse_request() and server.answering(self.request)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Connection:
    """One admitted connection, as the server's deadline and displacement see it."""

    __slots__ = ("answering", "cut", "started_s")

    def __init__(self) -> None:
        self.started_s = time.monotonic()
        self.answering = False  # its request arrived in full: it may no longer be displaced
        self.cut = False  # hung up on by the server (deadline or displacement)


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most MAX_SCRAPES of them at once, each cut at
    SCRAPE_TIMEOUT_S; a newcomer displaces the oldest whose request is still arriving."""

    request_queue_size = 64  # socketserver's 5 drops a burst's SYNs: clients wait seconds to retry

    def server_activate(self) -> None:
        self._held = threading.Condition()
        # Every admitted socket until its thread lets it go, oldest first. A socket leaves
        # before it is closed, under the lock the hang-ups take, so no hang-up ever reaches
        # a closed socket's number reused by another file.
        self._connections: dict[socket.socket, _Connection] = {}
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(request):
            self.shutdown_request(request)  # busy: the scraper tries again next interval
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def _admit(self, request: socket.socket) -> bool:
        with self._held:
            if len(self._connections) >= MAX_SCRAPES:
                victim = next((sock for sock, c in self._connections.items() if not c.answering and not c.cut), None)
                if victim is None:
                    return False
                self._cut(victim)
                if not self._held.wait_for(lambda: len(self._connections) < MAX_SCRAPES, DISPLACE_WAIT_S):
                    return False
            self._connections[request] = _Connection()
            return True

    def answering(self, request: socket.socket) -> bool:
        """The connection's request arrived in full: it is answered, never displaced.
        False if the server hung up on it first."""
        with self._held:
            connection = self._connections.get(request)
            if connection is None or connection.cut:
                return False
            connection.answering = True
            return True

    def service_actions(self) -> None:
        # serve_forever calls this after every accept and at least every half second: the
        # deadline, counted from the accept, for the request and the reply alike.
        now = time.monotonic()
        with self._held:
            for sock, connection in self._connections.items():
                if not connection.cut and now - connection.started_s >= SCRAPE_TIMEOUT_S:
                    self._cut(sock)

    def _cut(self, sock: socket.socket) -> None:
        """Hang up on an admitted connection (the lock held): its thread's receive or send
        ends at once, and the thread gives its slot back as it leaves."""
        self._connections[sock].cut = True
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def _forget(self, request: Any) -> None:
        with self._held:
            if self._connections.pop(request, None) is not None:
                self._held.notify_all()

    def shutdown_request(self, request: Any) -> None:
        self._forget(request)  # before the close: see _connections
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client timing out, cut or hanging up mid-request is not the server's fault, and
        # socketserver's default prints a traceback on stderr for each. (The collector's own
        # errors are wsgiref's: a 500 reply.)
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("metrics connection from %s ended: %s", client_address, exc)
        else:
            log.exception("metrics connection from %s failed", client_address)


class _BoundedServer6(_BoundedServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """/metrics over HTTP on its own threads, until close()."""

    def __init__(self, pool: Pool, server: NBDServer | None, host: str, port: int) -> None:
        """Binds at once (OSError if it cannot); requests are counted from now on."""
        pool.stats.enable_exports()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ThinblockCollector(pool, server))
        server_class = _BoundedServer6 if ":" in host else _BoundedServer
        self._httpd = make_server(host, port, make_wsgi_app(self.registry), server_class, _QuietHandler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="thinblock-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port = int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
