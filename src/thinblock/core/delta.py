"""Which byte ranges differ between two volumes or snapshots, from metadata alone.

Like thin_delta and `rbd diff`: no data is read. Two blocks are the same when
their mapping entries point at the same dblock in the same state, or when both
read zeros (UNMAPPED or ZEROED, wherever they are). A page both root tables
share is skipped whole, so the cost follows what changed, not the volume size.
Past the end of the shorter of the two, a volume reads as zeros.
"""

from __future__ import annotations

from array import array

import numpy as np
from numpy.typing import NDArray

from thinblock.core.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, STATE_MASK, BlockState
from thinblock.core.volume import Volume

_DATA = np.uint64(BlockState.DATA)
_EMPTY = array("Q", bytes(8 * PAGE_ENTRIES))
_BATCH_PAGES = 4096  # page pairs compared per numpy call (32 MiB of entries)


def _differing(ea: NDArray[np.uint64], eb: NDArray[np.uint64]) -> NDArray[np.intp]:
    """Where two runs of entries read differently: not equal, and not both zeros
    (UNMAPPED, or ZEROED on any dblock), nor both DATA on one dblock (whatever the pin).
    Only the unequal entries, found in one pass, are judged further."""
    unequal = np.flatnonzero(ea != eb)
    a, b = ea[unequal], eb[unequal]
    state_mask, shift = np.uint64(STATE_MASK), np.uint64(DBLOCK_SHIFT)
    da, db = (a & state_mask) == _DATA, (b & state_mask) == _DATA
    same = (~da & ~db) | (da & db & ((a >> shift) == (b >> shift)))
    differ: NDArray[np.intp] = unequal[~same]
    return differ


def changed_extents(a: Volume, b: Volume, offset: int = 0, length: int | None = None) -> list[tuple[int, int, bool]]:
    """(offset, length, zero) ranges within [offset, offset+length) where a and b
    differ; zero says b reads zeros there (UNMAPPED, ZEROED, or past its end), as
    `rbd diff` marks a range "zero" rather than "data". Neighbours of the same kind
    are merged.

    Both must be volumes of one pool; the caller holds nothing (this takes the pool lock).
    The pages that differ are compared a batch at a time with numpy: the cost is
    O(entries of the pages that differ), with no Python object per block.
    """
    pool = a.pool
    bs = pool.block_size
    vblock_parts: list[NDArray[np.int64]] = []
    zero_parts: list[NDArray[np.bool_]] = []
    with pool.lock:
        end_bytes = max(a.size_bytes, b.size_bytes)
        end = end_bytes if length is None else min(end_bytes, offset + length)
        if end <= offset:
            return []
        first, last = offset // bs, (end - 1) // bs
        page_lo, page_hi = first // PAGE_ENTRIES, last // PAGE_ENTRIES
        indexes = sorted(i for i in set(a.root) | set(b.root) if page_lo <= i <= page_hi)
        pairs = [(i, a.root.get(i), b.root.get(i)) for i in indexes]
        pairs = [(i, pa, pb) for i, pa, pb in pairs if pa != pb]  # one shared page: identical
        for start in range(0, len(pairs), _BATCH_PAGES):
            batch = pairs[start : start + _BATCH_PAGES]
            ea = b"".join(pool.txn.page(pa).entries if pa is not None else _EMPTY for _i, pa, _pb in batch)
            eb = b"".join(pool.txn.page(pb).entries if pb is not None else _EMPTY for _i, _pa, pb in batch)
            fb = np.frombuffer(eb, dtype=np.uint64)
            at = _differing(np.frombuffer(ea, dtype=np.uint64), fb)
            bases = np.array([i for i, _pa, _pb in batch], dtype=np.int64) * PAGE_ENTRIES
            vblocks = bases[at // PAGE_ENTRIES] + at % PAGE_ENTRIES
            inside = (vblocks >= first) & (vblocks <= last)
            vblock_parts.append(vblocks[inside])
            zero_parts.append((fb[at[inside]] & np.uint64(STATE_MASK)) != _DATA)
    if not vblock_parts:
        return []
    vblocks = np.concatenate(vblock_parts)
    zero = np.concatenate(zero_parts)
    if not len(vblocks):
        return []
    # Runs of consecutive blocks of one kind, merged; the first and last clipped to the range.
    breaks = np.flatnonzero((np.diff(vblocks) != 1) | (np.diff(zero) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(vblocks)])) - 1
    ranges: list[tuple[int, int, bool]] = []
    for lo, hi, z in zip(vblocks[starts].tolist(), vblocks[stops].tolist(), zero[starts].tolist(), strict=True):
        o, e = max(offset, lo * bs), min(end, hi * bs + bs)
        ranges.append((o, e - o, bool(z)))
    return ranges


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
