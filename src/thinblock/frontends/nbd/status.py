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
(`NBDServer.status_executor`), which rests after each page for as long as the
page took: block status gets at most half of one core, and between pages the GIL
and the pool lock are free for everyone else's requests.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

from thinblock.core.mapping import PAGE_ENTRIES
from thinblock.core.runs import Runs
from thinblock.core.volume import Volume

MAX_PAGES = 8  # mapping pages walked per request: 4,096 blocks (256 MiB at 64K blocks)
MAX_EXTENTS = 2048  # descriptors per context in one reply (16 KiB)
PACE = 1.0  # rest after a page this many times as long as the page took

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
    runs: dict[int, Runs[int]] = {ctx_id: Runs() for ctx_id in contexts}
    pos = offset
    for stop in slice_ends(volumes, offset, length):
        started = time.monotonic()
        for ctx_id, name in contexts.items():
            add = runs[ctx_id].add
            for n, flags in walk(name, pos, stop - pos):
                add(n, flags)
        pos = stop
        if pace:
            time.sleep((time.monotonic() - started) * PACE)
        if req_one and all(len(r.items) > 1 for r in runs.values()):
            break  # every first extent is complete
        if any(len(r.items) >= MAX_EXTENTS for r in runs.values()):
            break
    limit = 1 if req_one else MAX_EXTENTS
    return [(ctx_id, r.pairs()[:limit]) for ctx_id, r in runs.items()]
