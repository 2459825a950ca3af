"""Plain counters of what a running server does, for whoever wants to show them.

The pool, the export handle, the NBD server and the RADOS lease count here with
the standard library only: a few integer additions under an uncontended lock,
no exporter imported. frontends/metrics.py reads these at scrape time and turns
them into Prometheus families; nothing else walks pages or takes the pool lock
for a scrape. Latency is kept as a histogram of fixed buckets (10 us .. 10 s),
so quantiles can be computed by the monitoring system across servers.
"""

from __future__ import annotations

import errno
import threading
from bisect import bisect_left
from collections import Counter
from time import perf_counter

# Upper bounds (seconds) of the latency buckets: 1-2.5-5 steps from 10 us to 10 s,
# the range from a page-cache hit to a stalled layer below; +Inf is implied.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005,
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0,
)  # fmt: skip


class Histogram:
    """Observations counted per bucket (not cumulative), with their count and sum.
    Not locked: its owner holds a lock while it observes and while it is read."""

    __slots__ = ("buckets", "count", "sum_s")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # the last one is +Inf
        self.count = 0
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.count += 1
        self.sum_s += seconds

    def copy(self) -> Histogram:
        h = Histogram()
        h.buckets = list(self.buckets)
        h.count = self.count
        h.sum_s = self.sum_s
        return h


def errno_name(code: int) -> str:
    """ENOSPC for 28; a number for a code this system has no name for."""
    return errno.errorcode.get(code, str(code))


class OpCounts:
    """One kind of request on one export: how many, how many bytes, how long, and
    the failures by errno name."""

    __slots__ = ("bytes", "errors", "latency", "ops")

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.latency = Histogram()
        self.errors: Counter[str] = Counter()


class ExportStats:
    """Every request on one export (a volume by name), whichever frontend or
    connection made it; the export handle (frontends/export.py) feeds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, OpCounts] = {}

    def _kind(self, kind: str) -> OpCounts:
        counts = self._ops.get(kind)
        if counts is None:
            counts = self._ops[kind] = OpCounts()
        return counts

    def done(self, kind: str, nbytes: int, started: float) -> None:
        """A request that succeeded; started is its time.perf_counter() at the start.
        (On every request's path: Histogram.observe is written out here.)"""
        seconds = perf_counter() - started
        i = bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            counts = self._ops.get(kind) or self._kind(kind)
            counts.ops += 1
            counts.bytes += nbytes
            latency = counts.latency
            latency.buckets[i] += 1
            latency.count += 1
            latency.sum_s += seconds

    def failed(self, kind: str, code: int, started: float | None = None) -> None:
        """A request that failed with errno code (started None: refused before it ran,
        so it took no time worth measuring)."""
        seconds = None if started is None else perf_counter() - started
        with self._lock:
            counts = self._kind(kind)
            counts.ops += 1
            counts.errors[errno_name(code)] += 1
            if seconds is not None:
                counts.latency.observe(seconds)

    def snapshot(self) -> dict[str, OpCounts]:
        """A consistent copy, for a scrape."""
        with self._lock:
            out = {}
            for kind, c in self._ops.items():
                copy = OpCounts()
                copy.ops, copy.bytes, copy.latency, copy.errors = c.ops, c.bytes, c.latency.copy(), Counter(c.errors)
                out[kind] = copy
            return out


class PoolStats:
    """What one open pool counts: its commits, ENOSPC results, and (once metrics are
    wanted: enable_exports) the requests on each of its exports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.commits = 0
        self.commit_failures = 0
        self.commit_latency = Histogram()
        self.enospc = 0
        self._exports: dict[str, ExportStats] | None = None

    def enable_exports(self) -> None:
        """Count requests per export from now on (off by default: no cost unless shown)."""
        with self._lock:
            if self._exports is None:
                self._exports = {}

    def export(self, name: str) -> ExportStats | None:
        """The counters of export name, or None while requests are not counted."""
        with self._lock:
            if self._exports is None:
                return None
            stats = self._exports.get(name)
            if stats is None:
                stats = self._exports[name] = ExportStats()
            return stats

    def exports(self) -> dict[str, ExportStats]:
        with self._lock:
            return dict(self._exports or {})

    def committed(self, seconds: float) -> None:
        with self._lock:
            self.commits += 1
            self.commit_latency.observe(seconds)

    def commit_failed(self, seconds: float) -> None:
        with self._lock:
            self.commit_failures += 1
            self.commit_latency.observe(seconds)

    def no_space(self) -> None:
        """A request ended with ENOSPC (after any wait the out-of-space policy allows)."""
        with self._lock:
            self.enospc += 1

    def commit_snapshot(self) -> tuple[int, int, Histogram, int]:
        """(commits, commit failures, commit latency, ENOSPC results), consistent."""
        with self._lock:
            return self.commits, self.commit_failures, self.commit_latency.copy(), self.enospc


class ServerStats:
    """What the NBD server counts: connections accepted, and refused by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted = 0
        self.refusals: Counter[str] = Counter()

    def accept(self) -> None:
        with self._lock:
            self.accepted += 1

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refusals[reason] += 1

    def snapshot(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.accepted, dict(self.refusals)


class EventCounts:
    """Events of a process keyed by (pool, event): the RADOS lease's, which happen
    while a pool opens, before any server that could hold them exists."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, pool: str, event: str) -> None:
        with self._lock:
            self._counts[(pool, event)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


# Lease events of this process: acquired, lock_broken, fenced_holder, renew_failed,
# lost, released (backends/rados.py).
LEASE_EVENTS = EventCounts()
