"""The pool-level steps of ownership per volume (meta/base.py's contract): taking a
grant of free blocks, taking back the grants of owners that died, and folding
orphan pages. Each runs under the store's pool-level lock, is short, and is one
guarded commit: a step that fails changes nothing in the store and may simply
be run again.

A grant never hands out what other volumes' reservations set aside
(core/reservation.py's still_needed, from the committed rows, grants and counts):
the free space outside every grant keeps whatever the other owners' grants do not
cover of their volumes' set-asides, and the whole set-aside of every volume
nobody holds. The grantee's own set-asides may be granted to it: its allocation
gate keeps them for its reserved volumes.

Why a grant's blocks are punched by the owner that took it, before it allocates
from them: a block at count zero may still hold bytes an owner wrote but never
committed (it died, or its commit failed and it was killed before retrying).
Once the grant is committed nobody else can be granted those blocks, so its
taker punches them, durably, outside the pool-level lock (no data I/O runs
under that lock), and only then hands them out. That keeps the zero rule
(core/spacemap.py's rule 2) across owners without any owner's recovery scan:
every block an owner allocates from a grant reads zero. A taker that dies
before its punch leaves a stale grant of unpunched free blocks; it is taken
back, and the next taker punches them.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections import Counter
from collections.abc import Callable

import numpy as np

from thinblock.core.mapping import entry_dblock, mapped_pairs
from thinblock.core.reservation import replaced_id, set_aside_blocks, still_needed
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES
from thinblock.errors import ThinblockError
from thinblock.meta.base import Grant, Lease, MetadataStore, Transaction
from thinblock.meta.owners import refcounts_in
from thinblock.store.base import DataStore

log = logging.getLogger("thinblock.pool")


@dataclasses.dataclass
class Folded:
    pages: list[int]  # orphan pages deleted
    freed: list[int]  # dblocks their deletion brought to count zero


def grant_figures(meta: MetadataStore, block_size: int) -> dict[str, int]:
    """`pool status`'s figures of grants: the space owners hold in them, and how much of
    it no block uses yet (zero for a store with one owner per pool, which has none)."""
    try:
        grants = meta.grants()
    except ThinblockError:
        grants = []
    unused = 0
    if grants:  # the counts are read only when some owner holds a grant
        stored = meta.refcount_pages()
        unused = sum(int(np.count_nonzero(refcounts_in(stored, g.start, g.count) == 0)) for g in grants)
    return {
        "granted_bytes": sum(g.count for g in grants) * block_size,
        "granted_unused_bytes": unused * block_size,
    }


def grant_problems(meta: MetadataStore, n_blocks: int, volume_ids: set[int]) -> list[str]:
    """What `pool check` finds wrong with the grants: one outside the pool, two that
    overlap, one for a volume that does not exist (none for a one-owner store)."""
    try:
        grants = sorted(meta.grants(), key=lambda g: g.start)
    except ThinblockError:
        return []
    problems = []
    for g in grants:
        if g.count < 1 or g.start < 0 or g.start + g.count > n_blocks:
            problems.append(
                f"grant {g.start}+{g.count} of volume {g.volume_id} lies outside the pool's {n_blocks} blocks"
            )
        # An owner that removed a volume keeps its lease, and the grants under it, until
        # it stops (its other volumes may be using their blocks): only a dead one's
        # grants for a volume gone are wrong, until the next pool-level step takes them.
        if g.volume_id not in volume_ids and not _live(meta, g):
            problems.append(f"grant {g.start}+{g.count} is held for volume {g.volume_id}, which does not exist")
    reach = grants[0] if grants else None  # the grant reaching furthest so far
    for after in grants[1:]:
        assert reach is not None
        if after.start < reach.start + reach.count:
            problems.append(
                f"grants {reach.start}+{reach.count} (volume {reach.volume_id}) and {after.start}+{after.count}"
                f" (volume {after.volume_id}) overlap: a block could be allocated twice"
            )
        if after.start + after.count > reach.start + reach.count:
            reach = after
    return problems


def _live(meta: MetadataStore, grant: Grant) -> bool:
    try:
        return meta.lease_live(grant.volume_id, grant.epoch)
    except (OSError, ThinblockError):
        return False


def reservation_claims(
    meta: MetadataStore, block_size: int, stored: dict[int, bytes] | None = None
) -> tuple[dict[str | None, int], dict[str, int]]:
    """The pool's reservations as committed, per holder (None: volumes nobody holds):
    the blocks their volumes' reservations set aside, and the blocks at count zero in
    each holder's grants (what its gate keeps for them first). stored: the refcount
    pages, when the caller has read them. Under the pool-level lock, or as a figure."""
    rows = meta.volumes()
    replacing: dict[int, int] = {}
    for row in rows:  # a staging volume's blocks count toward the volume it replaces
        replaced = replaced_id(row)
        if replaced is not None:
            replacing[replaced] = replacing.get(replaced, 0) + row.exclusive_blocks
    set_aside: dict[str | None, int] = {}
    for row in rows:
        if row.kind != "volume" or not row.reserve_bytes:
            continue
        blocks = set_aside_blocks(row, block_size, replacement_blocks=replacing.get(row.id, 0))
        holder = meta.volume_holder(row.id)
        set_aside[holder] = set_aside.get(holder, 0) + blocks
    unused: dict[str, int] = {}
    grants = meta.grants() if set_aside else []
    if grants:
        counts = meta.refcount_pages() if stored is None else stored
        for g in grants:
            holder = meta.volume_holder(g.volume_id)
            if holder is not None:
                idle = int(np.count_nonzero(refcounts_in(counts, g.start, g.count) == 0))
                unused[holder] = unused.get(holder, 0) + idle
    return set_aside, unused


def pool_room(meta: MetadataStore, holder: str, stored: dict[int, bytes] | None = None) -> int:
    """What holder may be granted now (under the pool-level lock): the free blocks outside
    every grant less what other holders' reservations still need of them."""
    sb = meta.superblock()
    block_size = int(sb["block_size"])
    counts = meta.refcount_pages() if stored is None else stored
    free = int(np.count_nonzero(_free_mask(meta, int(sb["size_bytes"]) // block_size, counts)))
    set_aside, unused = reservation_claims(meta, block_size, counts)
    return free - still_needed(set_aside, unused, but=holder)


def _free_mask(meta: MetadataStore, n_blocks: int, stored: dict[int, bytes]) -> np.ndarray:
    """True for each block at count zero in committed state that no grant holds."""
    counts = np.zeros(n_blocks, dtype=np.uint32)
    for index, blob in stored.items():
        start = index * REFCOUNT_PAGE_ENTRIES
        if start >= n_blocks:
            continue
        page = np.frombuffer(blob, dtype=np.uint32)[: n_blocks - start]
        counts[start : start + len(page)] = page
    free: np.ndarray = np.equal(counts, 0)
    for g in meta.grants():
        free[g.start : g.start + g.count] = False
    return free


def take_grant(meta: MetadataStore, store: DataStore, lease: Lease, blocks: int) -> Grant:
    """Up to `blocks` free blocks for lease's volume, the first run of free space
    (shorter when the free space is fragmented): granted under the pool-level lock,
    then punched and synced outside it. ENOSPC, with nothing changed, when no block
    is free outside others' grants; a failed punch or sync gives the grant back.
    Dead owners' grants are taken back first (they may hold all the free space)."""
    grant = grant_blocks(meta, lease, blocks)
    punch_grant(meta, store, lease, grant)
    return grant


def grant_blocks(meta: MetadataStore, lease: Lease, blocks: int) -> Grant:
    """take_grant's pool-level step: the grant committed, its blocks not punched yet."""
    if blocks < 1:
        raise ValueError(f"a grant of {blocks} blocks")
    with meta.pool_lock():
        recover_stale_grants(meta)  # dead owners' grants hold free space: theirs first
        sb = meta.superblock()
        block_size = int(sb["block_size"])
        stored = meta.refcount_pages()
        free = _free_mask(meta, int(sb["size_bytes"]) // block_size, stored)
        starts = np.flatnonzero(free)
        if not starts.size:
            raise OSError(errno.ENOSPC, "the pool has no free block outside the grants other owners hold")
        # What other volumes' reservations still need stays in the free space.
        set_aside, unused = reservation_claims(meta, block_size, stored)
        kept = still_needed(set_aside, unused, but=lease.owner)
        budget = len(starts) - kept
        if budget <= 0:
            raise OSError(
                errno.ENOSPC,
                f"the pool's {len(starts)} free blocks outside the grants other owners hold are set aside"
                f" for other volumes' reservations ({kept} blocks)",
            )
        start = int(starts[0])
        taken = np.flatnonzero(~free[start : start + blocks])
        count = min(int(taken[0]) if taken.size else min(blocks, len(free) - start), budget)
        grant = Grant(lease.volume_id, lease.epoch, start, count)
        meta.commit(Transaction(leases=[lease], grants=[grant]))
    return grant


def punch_grant(
    meta: MetadataStore,
    store: DataStore,
    lease: Lease,
    grant: Grant,
    *,
    before_return: Callable[[], None] | None = None,
) -> None:
    """take_grant's second half, with no pool-level lock held: the grant's blocks
    punched and synced before any is handed out; on failure it is given back (after
    before_return, when given)."""
    try:
        punch_blocks(meta, store, grant)
    except OSError as exc:
        if before_return is not None:
            before_return()
        try:
            return_grant(meta, lease, grant)
        except (OSError, ThinblockError) as again:  # never allocated from: returned on release, or taken back
            log.warning(
                "grant %d+%d of volume %d not given back after a failed punch: %s",
                grant.start,
                grant.count,
                lease.volume_id,
                again,
            )
        raise exc from None


def punch_blocks(meta: MetadataStore, store: DataStore, grant: Grant) -> None:
    """Punch a grant's blocks and sync: what a dead owner wrote there never shows."""
    block_size = int(meta.superblock()["block_size"])
    store.punch(grant.start * block_size, grant.count * block_size)
    store.flush()


def return_grant(meta: MetadataStore, lease: Lease, grant: Grant) -> None:
    """Give back what an owner did not use (when it releases the volume)."""
    with meta.pool_lock():
        meta.commit(Transaction(leases=[lease], returned_grants=[grant]))


def recover_stale_grants(meta: MetadataStore) -> list[Grant]:
    """Take back every grant whose lease is gone. Their blocks a dead owner committed
    keep their counts; the rest are free again, and are punched when next granted."""
    with meta.pool_lock():
        stale = meta.stale_grants()
        if stale:
            # Fenced in the same commit: an owner that lost its lock but still runs
            # would otherwise go on committing into blocks granted to someone else.
            fenced = sorted({(g.volume_id, g.epoch) for g in stale})
            meta.commit(Transaction(returned_grants=stale, fenced=fenced))
        return stale


def fold_orphans(meta: MetadataStore) -> Folded:
    """Delete the pages others' changes left at count zero, and drop their dblocks'
    counts: the step that makes a shared page's last release exact across owners.
    Its commit is checked like any owner's: a page still counted is not deleted, and
    if an owner's commit changed one of those dblocks meanwhile, the store refuses
    the fold (a dblock it would free is still counted) and it is simply run again."""
    with meta.pool_lock():
        orphans = meta.orphans()
        if not orphans:
            return Folded([], [])
        drops: Counter[int] = Counter()
        for _count, blob in meta.pages(orphans).values():
            for entry in mapped_pairs(blob)[1]:
                drops[entry_dblock(entry)] += 1
        stored = meta.refcount_pages()
        bases: dict[int, bytes] = {}
        pages: dict[int, bytes] = {}
        for index in sorted({d // REFCOUNT_PAGE_ENTRIES for d in drops}):
            base = stored.get(index, bytes(4 * REFCOUNT_PAGE_ENTRIES))
            new = np.frombuffer(base, dtype=np.uint32).astype(np.int64)
            for dblock in (d for d in drops if d // REFCOUNT_PAGE_ENTRIES == index):
                new[dblock - index * REFCOUNT_PAGE_ENTRIES] -= drops[dblock]
            bases[index], pages[index] = base, new.astype(np.uint32).tobytes()
        result = meta.commit(
            Transaction(
                pages=dict.fromkeys(orphans),
                page_ref_bases=dict.fromkeys(orphans, 0),
                refcount_pages=pages,
                refcount_bases=bases,
            )
        )
        # What the store holds now, owners' changes since the read included: a dblock
        # their drops and the fold's took to zero together is freed too.
        freed = [
            d
            for d in drops
            if (got := result.refcount_pages.get(d // REFCOUNT_PAGE_ENTRIES)) is not None
            and int(np.frombuffer(got, dtype=np.uint32)[d % REFCOUNT_PAGE_ENTRIES]) == 0
        ]
        return Folded(orphans, sorted(freed))
