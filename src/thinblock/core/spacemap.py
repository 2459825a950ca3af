"""Data-block reference counts and free space, in memory, with two strict rules.

1. A dblock whose last reference goes in the open transaction stays busy until
   that transaction is committed (dm persistent-data's rule). Otherwise a crash
   could leave committed metadata pointing at a block already handed to someone
   else, or punched to zeros.
2. After that commit the block is punched in the layer below, and it stays busy
   until that punch is durable (the next data sync). So every allocatable block
   reads zero even after a power loss, and a block that enters use never needs
   zeroing: no stale bytes of its previous owner can ever show.

A freed block therefore moves: referenced -> pending (open transaction) ->
punching -> unsynced (punched, not yet durable) -> free. A punch that fails
sends it back to pending. Fresh blocks a failed operation took go back the
same way (`unallocate`): the failed write may have reached them.

A fresh block is counted (refcount 1, used) from the moment it is handed out,
so that nothing else takes it, but until the mapping entry that points at it is
published (`published`) no page of the open transaction refers to it. A commit
in between (the background committer, while a write's data I/O runs) must not
record it: `take_dirty_pages` and `durable_used_blocks` leave unpublished fresh
blocks out, as if still free. Otherwise a crash right after that commit left a
refcount that nothing maps and a used count above what is referenced (`pool
check`: "leaked space"), which bulk jobs, with many writes in flight all the
time, hit on nearly every kill.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from thinblock.core.mapping import DBLOCK_SHIFT
from thinblock.errors import CorruptionError
from thinblock.meta.owners import REFCOUNT_ENTRIES, counts_of

REFCOUNT_PAGE_ENTRIES = REFCOUNT_ENTRIES
_PAGES_AT_ONCE = 1024  # became_exclusive: mapping pages walked in one numpy array (4 MiB)


class SpaceMap:
    """Refcounts of every dblock of the pool, and the allocator over them."""

    def __init__(self, n_blocks: int, refcount_pages: dict[int, bytes] | None = None) -> None:
        self.refcounts = array("I", bytes(4 * n_blocks))
        for index, blob in (refcount_pages or {}).items():
            chunk = array("I")
            chunk.frombytes(blob)
            start = index * REFCOUNT_PAGE_ENTRIES
            if start >= n_blocks:
                if any(chunk):
                    raise CorruptionError(f"refcount page {index} lies beyond the pool's {n_blocks} blocks")
                continue
            chunk = chunk[: n_blocks - start]
            self.refcounts[start : start + len(chunk)] = chunk
        # busy[d] is 1 while d is referenced or freed-but-uncommitted: the allocator's view.
        self.busy = busy_map(self.refcounts)
        self.used_blocks = n_blocks - self.busy.count(0)
        self.pending_free: list[int] = []
        self.unsynced_free: list[int] = []
        self.punching: list[int] = []  # between take_pending and punched
        self.dirty_pages: set[int] = set()
        self.unpublished: set[int] = set()  # handed out by allocate, in no mapping entry yet
        # (start, count) runs of dblocks that got a new owner since the last commit was
        # built: allocated, or exclusive again. The commit records them in the data
        # store's birth table (store/owned.py), for repair --accept-rollback.
        self.births: list[tuple[int, int]] = []
        # dblocks whose last sharer went in the open transaction: until the commit that
        # records it is durable they are still shared on disk (a crash brings the sharer
        # back), so they are copied on write, never written in place (rule 4).
        self.newly_exclusive: set[int] = set()
        # Bumped whenever sharing drops where nobody can say who gained: a dblock's
        # count reaching 1, a page's last sharer left holding dblocks of count 1. A
        # volume's kept exclusive count stamped with an older epoch may be low
        # (core/volume.py). Pool sets it from the superblock.
        self.sharing_epoch = 0
        self._cursor = 0
        # Owner mode (one of several owners of the pool, core/owner.py): None until
        # allocate_from_grants. Then only blocks of this owner's grants are ever free
        # here, and the counts are a view: what the store held when last seen (bases)
        # plus this owner's changes since, committed as changes (meta/owners.py).
        self.grant_mask: bytearray | None = None
        self.bases: dict[int, bytes] = {}
        self.idle = 0  # owner mode: blocks of the grants allocatable now

    @property
    def n_blocks(self) -> int:
        return len(self.refcounts)

    @property
    def free_blocks(self) -> int:
        """Blocks that are or will be free after the next commit."""
        return self.n_blocks - self.used_blocks

    @property
    def allocatable_blocks(self) -> int:
        """Blocks that can be handed out right now (pending and unsynced frees excluded)."""
        if self.grant_mask is not None:
            return self.idle
        return self.n_blocks - self.used_blocks - len(self.pending_free) - len(self.unsynced_free) - len(self.punching)

    def grow(self, n_blocks: int) -> None:
        extra = n_blocks - self.n_blocks
        if extra > 0:
            self.refcounts.extend(array("I", bytes(4 * extra)))
            if self.grant_mask is None:
                self.busy.extend(bytes(extra))
            else:  # owner mode: the new blocks are the pool's, allocatable here once granted
                self.busy.extend(b"\x01" * extra)
                self.grant_mask.extend(bytes(extra))

    def allocate(self, count: int) -> list[int]:
        """Hand out `count` free dblocks, as contiguous as the free space allows.

        The caller has checked allocatable_blocks; each block starts with refcount 1.
        """
        blocks: list[int] = []
        cursor = self._cursor
        wrapped = False
        while len(blocks) < count:
            start = self.busy.find(0, cursor)
            if start < 0:
                if wrapped:
                    raise CorruptionError("space map ran out of free blocks it counted as free")
                wrapped, cursor = True, 0
                continue
            end = self.busy.find(1, start)
            if end < 0:
                end = self.n_blocks
            end = min(end, start + count - len(blocks))
            self.busy[start:end] = b"\x01" * (end - start)
            for dblock in range(start, end):
                self.refcounts[dblock] = 1
            blocks.extend(range(start, end))
            self.births.append((start, end - start))
            self.dirty_pages.update(range(start // REFCOUNT_PAGE_ENTRIES, (end - 1) // REFCOUNT_PAGE_ENTRIES + 1))
            cursor = end
        self._cursor = cursor
        self.used_blocks += count
        self.idle -= count if self.grant_mask is not None else 0
        self.unpublished.update(blocks)
        return blocks

    def published(self, blocks: list[int]) -> None:
        """Fresh blocks from allocate are now in mapping entries of the open transaction:
        the next commit records their references (with those entries)."""
        self.unpublished.difference_update(blocks)
        self.dirty_pages.update(dblock // REFCOUNT_PAGE_ENTRIES for dblock in blocks)

    @property
    def durable_used_blocks(self) -> int:
        """used_blocks as a commit records it: without unpublished fresh blocks."""
        return self.used_blocks - len(self.unpublished)

    def incref(self, dblock: int) -> None:
        self.refcounts[dblock] += 1
        self.dirty_pages.add(dblock // REFCOUNT_PAGE_ENTRIES)

    def decref(self, dblock: int) -> None:
        count = self.refcounts[dblock]
        if count == 0:
            raise CorruptionError(f"dblock {dblock} released more often than referenced")
        self.refcounts[dblock] = count - 1
        self.dirty_pages.add(dblock // REFCOUNT_PAGE_ENTRIES)
        if count == 2:  # its last sharer may write it in place once this is committed
            self.births.append((dblock, 1))
            self.newly_exclusive.add(dblock)
            self.sharing_epoch += 1
        elif count == 1:
            self.used_blocks -= 1
            # An owner punches and reuses only blocks of its own grants: one outside them
            # is free in the pool once committed, and whoever is granted it next punches it
            # (core/pool_steps.py). Punching it here could wipe what that owner wrote.
            if self.grant_mask is None or self.grant_mask[dblock]:
                self.pending_free.append(dblock)

    def unallocate(self, blocks: list[int]) -> None:
        """Give back fresh blocks a failed operation took (refcount 1, in no page).

        The failed I/O may have written into them, so they take the freed-block path
        (punched after the next commit, free after the next data sync) rather than
        becoming allocatable at once: allocatable blocks must read zero."""
        for dblock in blocks:
            if self.refcounts[dblock] != 1:
                raise CorruptionError(f"dblock {dblock} given back with {self.refcounts[dblock]} references")
            self.unpublished.discard(dblock)
            self.decref(dblock)

    def take_births(self) -> list[tuple[int, int]]:
        """The births since the last call (a failed commit puts them back in front)."""
        out, self.births = self.births, []
        return out

    def is_shared(self, dblock: int) -> bool:
        """Whether a write must copy the dblock: shared now, or in committed state."""
        return self.refcounts[dblock] > 1 or dblock in self.newly_exclusive

    def became_exclusive(self, pages: Sequence[array[int]]) -> None:
        """Pages whose last sharer went (their dblocks keep one reference, through them):
        the same rule as decref's, for the dblocks a page alone references. pages are
        the pages' mapping entries (0 is unmapped). A snapshot's removal hands every
        page it leaves alone in one call: numpy walks them a thousand pages at a time,
        not one Python step an entry (a dblock already newly exclusive may come again:
        the set keeps it once, a repeated birth records the same generation)."""
        for at in range(0, len(pages), _PAGES_AT_ONCE):
            entries = np.frombuffer(b"".join(pages[at : at + _PAGES_AT_ONCE]), dtype=np.uint64)
            dblocks = entries[entries != 0] >> np.uint64(DBLOCK_SHIFT)
            if not len(dblocks):
                continue
            # A view of the counts for this call only: a live export would stop grow() resizing them.
            counts = np.frombuffer(self.refcounts, dtype=np.uint32)
            alone = dblocks[counts[dblocks] == 1].tolist()
            del counts
            self.births.extend((dblock, 1) for dblock in alone)
            self.newly_exclusive.update(alone)
            if alone:  # the volume left holding them gained exclusive blocks (core/exclusive.py)
                self.sharing_epoch += 1

    def take_dirty_pages(self) -> dict[int, bytes]:
        """Refcount pages changed since the last call, as blobs to persist; unpublished
        fresh blocks read 0 in them (see the module's docstring; `published` marks
        their pages dirty again)."""
        hidden: dict[int, list[int]] = {}
        for dblock in self.unpublished:
            index = dblock // REFCOUNT_PAGE_ENTRIES
            if index in self.dirty_pages:
                hidden.setdefault(index, []).append(dblock - index * REFCOUNT_PAGE_ENTRIES)
        out = {}
        for index in sorted(self.dirty_pages):
            start = index * REFCOUNT_PAGE_ENTRIES
            chunk = self.refcounts[start : start + REFCOUNT_PAGE_ENTRIES]
            for slot in hidden.get(index, ()):
                chunk[slot] = 0
            out[index] = chunk.tobytes()
        self.dirty_pages.clear()
        return out

    def take_pending(self, count: int) -> list[tuple[int, int]]:
        """After the commit that freed them: the first `count` pending frees, as
        (start, count) runs to punch; they stay busy until `punched`."""
        blocks = sorted(self.pending_free[:count])
        del self.pending_free[:count]
        self.punching.extend(blocks)
        return to_runs(blocks)

    def punched(self, taken: list[tuple[int, int]], done: list[tuple[int, int]]) -> None:
        """The punches of `taken` that succeeded (`done`, a prefix) become unsynced (free
        after the next data sync); the others are pending again, punched after the next commit."""
        self.punching.clear()
        ours = self.grant_mask  # owner mode: a block whose grant went back is the pool's now
        for start, count in done:
            self.unsynced_free.extend(d for d in range(start, start + count) if ours is None or ours[d])
        for start, count in taken[len(done) :]:
            self.pending_free[:0] = [d for d in range(start, start + count) if ours is None or ours[d]]

    def release_synced(self, count: int) -> None:
        """After a data sync: the first `count` unsynced frees (punched before it) are free."""
        ours = self.grant_mask
        for dblock in self.unsynced_free[:count]:
            if ours is None:
                self.busy[dblock] = 0
            elif ours[dblock] and self.busy[dblock]:  # still in a grant of ours
                self.busy[dblock] = 0
                self.idle += 1
        del self.unsynced_free[:count]

    # ----- owner mode (core/owner.py) ----------------------------------------------

    def allocate_from_grants(self, stored: dict[int, bytes]) -> None:
        """From now on allocate only from grants (add_grant); stored: the refcount pages
        the counts were read from, the bases of this owner's changes."""
        self.grant_mask = bytearray(self.n_blocks)
        self.busy[:] = b"\x01" * self.n_blocks
        self.idle = 0
        self.bases = dict(stored)

    def add_grant(self, start: int, count: int, stored: dict[int, bytes]) -> None:
        """Blocks [start, start + count), granted to this owner and punched durably, may be
        allocated; stored: the store's refcount pages as of the grant (this view of the
        pages the grant lies in may be older: others may have freed its blocks since)."""
        assert self.grant_mask is not None
        first, last = start // REFCOUNT_PAGE_ENTRIES, (start + count - 1) // REFCOUNT_PAGE_ENTRIES
        self.refresh({i: stored.get(i, b"") for i in range(first, last + 1)})
        self.grant_mask[start : start + count] = b"\x01" * count
        for dblock in range(start, start + count):
            if self.refcounts[dblock] == 0 and self.busy[dblock]:
                self.busy[dblock] = 0
                self.idle += 1

    def drop_grant(self, start: int, count: int) -> set[int]:
        """The grant leaves this owner: none of its blocks is allocatable here now.
        Returns the blocks that were allocatable (restore_grant's argument if the
        grant stays ours after all)."""
        assert self.grant_mask is not None
        self.grant_mask[start : start + count] = bytes(count)
        idle = set()
        for dblock in range(start, start + count):
            if not self.busy[dblock]:
                self.busy[dblock] = 1
                self.idle -= 1
                idle.add(dblock)
        gone = set(range(start, start + count))
        self.pending_free = [d for d in self.pending_free if d not in gone]
        self.unsynced_free = [d for d in self.unsynced_free if d not in gone]
        return idle

    def restore_grant(self, start: int, count: int, idle: set[int]) -> None:
        """A grant drop_grant took stays ours (giving it back failed): the blocks that were
        allocatable are again; every other block at count zero here (freed since, or
        waiting for its punch at the drop) takes the freed-block path, so it is
        committed free, punched and synced before it is handed out (rules 1 and 2)."""
        assert self.grant_mask is not None
        self.grant_mask[start : start + count] = b"\x01" * count
        for dblock in range(start, start + count):
            if self.refcounts[dblock] or dblock in self.unpublished:
                continue
            if dblock in idle and self.busy[dblock]:
                self.busy[dblock] = 0
                self.idle += 1
            elif self.busy[dblock]:
                self.pending_free.append(dblock)

    def uncommitted_in(self, start: int, count: int) -> bool:
        """Owner mode: whether a count of [start, start + count) differs from the store's
        as last seen, that is, has a change no commit has carried yet."""
        view = np.frombuffer(self.refcounts, dtype=np.uint32)
        for index in range(start // REFCOUNT_PAGE_ENTRIES, (start + count - 1) // REFCOUNT_PAGE_ENTRIES + 1):
            first = index * REFCOUNT_PAGE_ENTRIES
            lo, hi = max(start, first), min(start + count, first + REFCOUNT_PAGE_ENTRIES, self.n_blocks)
            base = counts_of(self.bases.get(index, b""), hi - first)[lo - first :]
            if bool(np.any(view[lo:hi].astype(np.int64) != base)):
                return True
        return False

    def refcount_bases(self, pages: dict[int, bytes]) -> dict[int, bytes]:
        """The base of each of pages: the store's blob as last seen (zeros if none)."""
        empty = bytes(4 * REFCOUNT_PAGE_ENTRIES)
        return {i: self.bases.get(i) or empty[: len(blob)] for i, blob in pages.items()}

    def refresh(self, stored: dict[int, bytes], sent: dict[int, bytes] | None = None) -> None:
        """The store holds stored for these refcount pages now (a commit's result, with
        sent what it sent; or a fresh read): this view becomes stored plus the changes
        made here since (since the commit was built, or since the last base)."""
        for index, blob in stored.items():
            start = index * REFCOUNT_PAGE_ENTRIES
            end = min(start + REFCOUNT_PAGE_ENTRIES, self.n_blocks)
            if end <= start:
                continue
            n = end - start
            view = np.frombuffer(self.refcounts, dtype=np.uint32)[start:end].astype(np.int64)
            before = (sent or {}).get(index)
            if before is None:
                before = self.bases.get(index, b"")
            mine = view - counts_of(before, n)
            new = counts_of(blob, n) + mine
            if int(new.min(initial=0)) < 0:
                raise CorruptionError(f"refcount page {index}: the store's counts fell below this owner's references")
            self.used_blocks += int(np.count_nonzero(new)) - int(np.count_nonzero(view))
            self.refcounts[start:end] = array("I", new.astype(np.uint32).tobytes())
            self.bases[index] = blob

    def free_runs(self) -> list[tuple[int, int]]:
        """Every allocatable block, as (start, count) runs."""
        runs = []
        start = self.busy.find(0)
        while start >= 0:
            end = self.busy.find(1, start)
            end = self.n_blocks if end < 0 else end
            runs.append((start, end - start))
            start = self.busy.find(0, end)
        return runs


_ONE_IF_NONZERO = bytes([0] + [1] * 255)


def busy_map(refcounts: array[int]) -> bytearray:
    """1 for each nonzero refcount, 0 for each zero one, without a Python step per block
    (every command that opens a pool builds it: at 10^6 blocks, 28 ms block by block, 14 ms here).
    A count is nonzero when any of its four bytes is: the four byte lanes are OR-ed as
    big integers, then each byte becomes 0 or 1."""
    raw = refcounts.tobytes()
    width = refcounts.itemsize
    merged = 0
    for lane in range(width):
        merged |= int.from_bytes(raw[lane::width], "little")
    return bytearray(merged.to_bytes(len(refcounts), "little").translate(_ONE_IF_NONZERO))


def to_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as (start, count) runs."""
    runs: list[tuple[int, int]] = []
    for dblock in blocks:
        if runs and runs[-1][0] + runs[-1][1] == dblock:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((dblock, 1))
    return runs
