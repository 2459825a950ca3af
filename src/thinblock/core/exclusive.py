"""Exclusive blocks: how each volume's count is kept without walking its pages.

A mapped block is exclusive to its volume when its mapping page has refcount 1
(no snapshot or clone shares the page) and its dblock has refcount 1 (no other
page points at it); shared = mapped - exclusive. `VolumeRow.exclusive_blocks`
is always a lower bound of that, and exact when fresh:

  * a volume's own changes are counted where they happen (Volume._set_entry): a
    fresh dblock in a page it holds alone +1, an exclusive entry unmapped or
    replaced -1; a page copy-on-write changes nothing, since both pages then
    hold every dblock;
  * snapshot, clone, rollback and adopt set both sides exactly (core/snapshot.py);
  * sharing that drops where nobody can say who gained (a dblock's count reaching
    1 by someone's overwrite, trim or removal; a page's last sharer left with
    dblocks of count 1) bumps SpaceMap.sharing_epoch, O(1).

A count is fresh when it is stamped (exclusive_epoch) with the current epoch, or
when it equals the volume's mapped blocks (nothing left to gain). A stale one
is recounted (`count_exclusive`, vectorised) only when someone asks for the
figure or a reservation decision would otherwise fail. The epoch and the stamps
are committed, so a reopened pool knows which counts it can trust.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, "array[int]"]


def count_exclusive(pages: Iterable[tuple[int, Buffer]], refcounts: Buffer) -> int:
    """Exclusive mapped entries of one volume's pages, given as (page refcount,
    uint64 entries), against the pool's uint32 dblock refcounts. Entries whose
    dblock lies beyond the refcounts count as shared (check reports them)."""
    alone = [np.frombuffer(entries, dtype=np.uint64) for refcount, entries in pages if refcount == 1]
    if not alone:
        return 0
    counts = np.frombuffer(refcounts, dtype=np.uint32)
    try:
        entries = np.concatenate(alone)
        dblocks = entries[entries != 0] >> np.uint64(3)
        dblocks = dblocks[dblocks < len(counts)]
        return int(np.count_nonzero(counts[dblocks.astype(np.intp)] == 1))
    finally:
        # The views pin their arrays' buffers (an array.array cannot grow while one
        # exists): drop them now, even when a traceback keeps this frame alive.
        del counts, alone
