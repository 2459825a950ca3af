"""Which byte ranges differ between two volumes or snapshots, from metadata alone.

Like thin_delta and `rbd diff`: no data is read. Two blocks are the same when
their mapping entries point at the same dblock in the same state, or when both
read zeros (UNMAPPED or ZEROED, wherever they are). A page both root tables
share is skipped whole, so the cost follows what changed, not the volume size.
Past the end of the shorter of the two, a volume reads as zeros.
"""

from __future__ import annotations

from array import array

from thinblock.core.mapping import PAGE_ENTRIES, BlockState, entry_dblock, entry_state
from thinblock.core.volume import Volume

_DATA = int(BlockState.DATA)
_EMPTY = array("Q", bytes(8 * PAGE_ENTRIES))


def _same(a: int, b: int) -> bool:
    if a == b:
        return True
    # Both read zeros (UNMAPPED, or ZEROED on any dblock), else the dblock decides.
    if entry_state(a) != _DATA and entry_state(b) != _DATA:
        return True
    return (entry_state(a) == entry_state(b) == _DATA) and entry_dblock(a) == entry_dblock(b)


def changed_extents(a: Volume, b: Volume, offset: int = 0, length: int | None = None) -> list[tuple[int, int, bool]]:
    """(offset, length, zero) ranges within [offset, offset+length) where a and b
    differ; zero says b reads zeros there (UNMAPPED, ZEROED, or past its end), as
    `rbd diff` marks a range "zero" rather than "data". Neighbours of the same kind
    are merged.

    Both must be volumes of one pool; the caller holds nothing (this takes the pool lock).
    """
    pool = a.pool
    bs = pool.block_size
    with pool.lock:
        end_bytes = max(a.size_bytes, b.size_bytes)
        end = end_bytes if length is None else min(end_bytes, offset + length)
        if end <= offset:
            return []
        first, last = offset // bs, (end - 1) // bs
        page_lo, page_hi = first // PAGE_ENTRIES, last // PAGE_ENTRIES
        indexes = sorted(i for i in set(a.root) | set(b.root) if page_lo <= i <= page_hi)
        blocks: list[tuple[int, bool]] = []
        for page_index in indexes:
            pa, pb = a.root.get(page_index), b.root.get(page_index)
            if pa == pb:
                continue  # one shared page: identical
            ea = pool.page(pa).entries if pa is not None else _EMPTY
            eb = pool.page(pb).entries if pb is not None else _EMPTY
            if ea == eb:
                continue
            base = page_index * PAGE_ENTRIES
            lo, hi = max(first - base, 0), min(last - base, PAGE_ENTRIES - 1)
            blocks.extend((base + i, entry_state(eb[i]) != _DATA) for i in range(lo, hi + 1) if not _same(ea[i], eb[i]))
    ranges: list[list[int]] = []
    for vblock, zero in blocks:
        start, stop = max(offset, vblock * bs), min(end, vblock * bs + bs)
        if ranges and ranges[-1][0] + ranges[-1][1] == start and ranges[-1][2] == zero:
            ranges[-1][1] += stop - start
        else:
            ranges.append([start, stop - start, zero])
    return [(o, n, bool(z)) for o, n, z in ranges]


def changed_ranges(a: Volume, b: Volume, offset: int = 0, length: int | None = None) -> list[tuple[int, int]]:
    """changed_extents without the zero flag: (offset, length), neighbours merged."""
    merged: list[list[int]] = []
    for o, n, _zero in changed_extents(a, b, offset, length):
        if merged and merged[-1][0] + merged[-1][1] == o:
            merged[-1][1] += n
        else:
            merged.append([o, n])
    return [(o, n) for o, n in merged]


def delta_dict(a: Volume, b: Volume) -> dict[str, object]:
    """`thinblock delta --json`: each range says whether b reads zeros there."""
    ranges = changed_extents(a, b)
    return {
        "from": a.name,
        "to": b.name,
        "from_size_bytes": a.size_bytes,
        "to_size_bytes": b.size_bytes,
        "block_size": a.pool.block_size,
        "changed_bytes": sum(n for _, n, _ in ranges),
        "zero_bytes": sum(n for _, n, z in ranges if z),
        "ranges": [{"offset": o, "length": n, "zero": z} for o, n, z in ranges],
    }
