"""BLOCK_STATUS answered in bounded, paced slices, so that clients mapping whole
volumes cannot starve other clients' reads and writes.

The NBD spec lets a BLOCK_STATUS reply describe less than was asked: the
descriptors' lengths may sum to less than the request's length (never more), and
at least one descriptor is sent; clients (libnbd, qemu, nbdcopy) repeat the
request from where the reply ended. So one request here walks at most MAX_PAGES
mapping pages that exist (an absent page is a hole and costs nothing to report,
so a sparse volume is still answered in one reply), sends at most MAX_EXTENTS
descriptors per context, and walks one page at a time, taking the pool lock for
that page only. Every request runs on one server-wide status thread
(`StatusQueue`), which rests after each page for as long as the page took: block
status gets at most half of one core, and between pages the GIL and the pool
lock are free for everyone else's requests. The thread takes the connections'
requests in turn, one from each, not first come first served: a client with
many requests queued delays another client's by at most one request each.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from thinblock.core.mapping import PAGE_ENTRIES
from thinblock.core.runs import Runs
from thinblock.core.volume import Volume

MAX_PAGES = 8  # mapping pages walked per request: 4,096 blocks (256 MiB at 64K blocks)
MAX_EXTENTS = 2048  # descriptors per context in one reply (16 KiB)
PACE = 1.0  # rest after a page this many times as long as the page took
REQ_ONE_BLOCKS = 16  # the first window of a REQ_ONE walk, in blocks (it doubles from there)

log = logging.getLogger("thinblock.nbd")
Extents = list[tuple[int, int]]  # (length, flags)
ContextWalk = Callable[[str, int, int], Extents]  # (context name, offset, length) -> extents


def slice_ends(volumes: Iterable[Volume], offset: int, length: int, max_pages: int = MAX_PAGES) -> list[int]:
    """Where the slices of [offset, offset+length) end: each slice holds at most one
    mapping page present in any of `volumes` (and the hole before it), and there are
    at most max_pages of them; the walk stops early (a shorter reply) past that. A
    range with no page present is one slice."""
    vols = list(volumes)
    end = offset + length
    if not vols or length <= 0:
        return [end]
    pool = vols[0].pool
    page_bytes = pool.block_size * PAGE_ENTRIES
    page_lo, page_hi = offset // page_bytes, (end - 1) // page_bytes
    with pool.lock:
        present = {i for vol in vols for i in vol.root if page_lo <= i <= page_hi}
    first = heapq.nsmallest(max_pages + 1, present)
    ends = [min(end, (i + 1) * page_bytes) for i in first[:max_pages]]
    if len(first) <= max_pages:  # the rest of the range holds no page: it joins the last slice
        if ends:
            ends[-1] = end
        else:
            ends.append(end)
    return ends


def bounded_status(
    walk: ContextWalk,
    contexts: dict[int, str],
    volumes: Iterable[Volume],
    offset: int,
    length: int,
    *,
    req_one: bool = False,
    pace: bool = True,
) -> list[tuple[int, Extents]]:
    """Each context's extents from offset on, as far as the bounds reach: (context id,
    extents) per context, every list non-empty and covering at most `length` bytes.
    With req_one (NBD_CMD_FLAG_REQ_ONE) each list is the first extent alone."""
    vols = list(volumes)
    runs: dict[int, Runs[int]] = {ctx_id: Runs() for ctx_id in contexts}

    def first_extents_known() -> bool:
        return all(len(r.items) > 1 for r in runs.values())

    # REQ_ONE asks for the first extent only, and qemu sets it on every request: the
    # walk goes in windows of REQ_ONE_BLOCKS blocks, doubling, and stops at the first
    # window that ends every context's first extent, instead of walking a whole page.
    window = REQ_ONE_BLOCKS * vols[0].pool.block_size if vols else length
    pos = offset
    for stop in slice_ends(vols, offset, length):
        started = time.monotonic()
        while pos < stop:
            end = min(stop, pos + window) if req_one else stop
            for ctx_id, name in contexts.items():
                add = runs[ctx_id].add
                for n, flags in walk(name, pos, end - pos):
                    add(n, flags)
            pos = end
            if req_one and first_extents_known():
                break
            window *= 2
        if pace:
            time.sleep((time.monotonic() - started) * PACE)
        if req_one and first_extents_known():
            break  # every first extent is complete
        if any(len(r.items) >= MAX_EXTENTS for r in runs.values()):
            break
    limit = 1 if req_one else MAX_EXTENTS
    return [(ctx_id, r.pairs()[:limit]) for ctx_id, r in runs.items()]


class StatusQueue:
    """The one status thread, and its queues: one per connection, served in turn."""

    def __init__(self) -> None:
        self._queues: dict[object, deque[Callable[[], object]]] = {}  # in turn order
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="thinblock-nbd-status", daemon=True)
        self._thread.start()

    def submit(self, owner: object, job: Callable[[], object]) -> None:
        """Run job on the status thread, in owner's turn (owner: its connection)."""
        with self._cond:
            self._queues.setdefault(owner, deque()).append(job)
            self._cond.notify()

    def _next(self) -> Callable[[], object] | None:
        with self._cond:
            while not self._queues:
                if self._closed:
                    return None
                self._cond.wait()
            owner, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            del self._queues[owner]
            if jobs:  # to the back of the line
                self._queues[owner] = jobs
            return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                job()
            except Exception:  # the job answered its client (or could not); the thread goes on
                log.exception("block status request failed")

    def shutdown(self) -> None:
        """Run what is queued, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
