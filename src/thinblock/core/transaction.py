"""The open transaction: every metadata change made since the last commit, in memory.

The mapping pages in use (a cache of the committed ones, plus new and changed
ones), the refcounts of pages not loaded, and the dirty sets: which pages,
page counts, root entries and volume rows the next commit writes. A commit
(core/commit.py) takes it whole with `build()` and either `settle()`s it or
`put_back()` what it took, so a failed commit changes nothing here (rule 2).

It knows pages and rows, and one rule of the block contract: a page's last
reference frees its dblocks, and a page left to one holder makes its dblocks
candidates for writing in place (SpaceMap.decref and became_exclusive). All of
it is read and changed under the pool lock; only the store reads of pages run
outside any commit (meta/base.py's contract).
"""

from __future__ import annotations

import dataclasses
import threading
from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from thinblock.core.mapping import Page
from thinblock.core.spacemap import SpaceMap
from thinblock.errors import ThinblockError
from thinblock.meta.base import MetadataStore, Transaction

if TYPE_CHECKING:
    from thinblock.core.volume import Volume

_T = TypeVar("_T")
PAGE_IDS_AT_ONCE = 1 << 16  # owner mode: page ids reserved from the store at a time


def _all_found(wanted: list[int], found: dict[int, _T]) -> dict[int, _T]:
    """A batch read's answer, or ThinblockError naming a wanted page it lacks."""
    if len(found) != len(wanted):
        page_id = next(pid for pid in wanted if pid not in found)
        raise ThinblockError(f"mapping page {page_id} is referenced but missing (run 'thinblock pool check')")
    return found


@dataclasses.dataclass
class Built:
    """A transaction being written, with the dirty sets it took (put back if it fails)."""

    txn: Transaction
    pages: set[int]
    page_refs: set[int]
    roots: set[tuple[int, int]]
    volumes: set[Volume]
    deleted_volumes: list[int]


class OpenTransaction:
    """One owner's uncommitted metadata changes, and the page cache they live in."""

    def __init__(
        self,
        meta: MetadataStore,
        space: SpaceMap,
        volume_by_id: Callable[[int], Volume | None],
        *,
        shared: bool = False,
    ) -> None:
        self.meta = meta  # page and root reads only: commits go through core/commit.py
        self.space = space
        self._volume_by_id = volume_by_id
        self.pages: dict[int, Page] = {}
        # Page refcounts are known without a page's entries: a loaded Page holds its own
        # count; page_refs holds the counts of pages not loaded that were read in a batch
        # (load_refcounts) or changed since. A page in neither is committed and unchanged.
        self.page_refs: dict[int, int] = {}
        self._next_page_id = meta.max_page_id() + 1
        # Owner mode (core/owner.py, shared): page ids come in ranges no other owner gets
        # (reserve_page_ids), and page counts are committed as changes from the count
        # this owner last saw in the store (page_bases, kept only then).
        self.shared = shared
        self.reserve_page_ids: Callable[[int], int] | None = None
        self._page_id_end = 0
        self._spare_page_ids: list[int] = []  # first ids of ranges reserved ahead (top_up_page_ids)
        self.page_bases: dict[int, int] = {}
        self._dirty_pages: set[int] = set()
        self._dirty_page_refs: set[int] = set()  # refcount changed, entries not
        self._dirty_roots: set[tuple[int, int]] = set()
        self._touched: set[tuple[Volume, int]] = set()  # pages that may have become empty
        self._dirty_volumes: set[Volume] = set()
        self._deleted_volumes: list[int] = []
        self.dirty = False  # anything at all to commit, superblock changes included

    def touch(self) -> None:
        """Something outside the tables changed (the superblock's size or policy): commit it."""
        self.dirty = True

    # ----- pages --------------------------------------------------------------------

    def page(self, page_id: int) -> Page:
        page = self.pages.get(page_id)
        if page is None:
            # Not under the commit's lock: page reads never wait for a commit (meta/base.py's
            # contract). A page missing from the cache is committed and unchanged since.
            found = self.meta.page(page_id)
            if found is None:
                raise ThinblockError(f"mapping page {page_id} is referenced but missing (run 'thinblock pool check')")
            # A count changed (or read) while the page was not loaded is the authority:
            # from now on the Page holds it.
            self._seen(page_id, found[0])
            page = Page.from_blob(page_id, self.page_refs.pop(page_id, found[0]), found[1])
            self.pages[page_id] = page
        return page

    def _seen(self, page_id: int, count: int) -> None:
        """Owner mode: a page's count as read from the store, the base of our changes."""
        if self.shared:
            self.page_bases.setdefault(page_id, count)

    def _forget(self, page_id: int) -> None:
        """A page leaves the cache: deleted, or referenced by nobody any more."""
        self.pages.pop(page_id, None)
        self.page_refs.pop(page_id, None)
        self.page_bases.pop(page_id, None)

    def drop_cached(self, page_ids: Iterable[int]) -> None:
        """These pages may have changed in the store behind this cache (core/claim.py):
        their entries leave it, to be read again when next used; their counts stay
        (this owner's view, with its base). A page changed here and not committed is
        this owner's alone, so current: it stays."""
        for page_id in page_ids:
            page = self.pages.get(page_id)
            if page is None or page_id in self._dirty_pages:
                continue
            del self.pages[page_id]
            self.page_refs[page_id] = page.refcount

    def load_refcounts(self, page_ids: Iterable[int]) -> None:
        """Know the refcount of every page of page_ids, in one batch read of the store for
        those not known yet; a page that does not exist raises, with nothing changed."""
        # Once each: callers pass several root tables, which share pages.
        missing = [pid for pid in dict.fromkeys(page_ids) if pid not in self.pages and pid not in self.page_refs]
        if not missing:
            return
        found = _all_found(missing, self.meta.page_refcounts(missing))
        for pid, count in found.items():
            self._seen(pid, count)
        self.page_refs.update(found)

    def load_pages(self, page_ids: Iterable[int]) -> None:
        """page() for every page of page_ids, those not loaded read in one batch; a page
        that does not exist raises, with nothing loaded."""
        missing = [pid for pid in dict.fromkeys(page_ids) if pid not in self.pages]
        if not missing:
            return
        found = _all_found(missing, self.meta.pages(missing))
        pages = [Page.from_blob(pid, self.page_refs.get(pid, count), blob) for pid, (count, blob) in found.items()]
        for page in pages:  # all decoded first: a damaged one leaves the cache as it was
            self._seen(page.page_id, found[page.page_id][0])
            self.page_refs.pop(page.page_id, None)
            self.pages[page.page_id] = page

    def page_refcount(self, page_id: int) -> int:
        page = self.pages.get(page_id)
        if page is not None:
            return page.refcount
        if page_id not in self.page_refs:
            self.load_refcounts([page_id])
        return self.page_refs[page_id]

    def share_pages(self, page_ids: Iterable[int]) -> None:
        """One more root-table reference to each page, without loading any (call
        load_refcounts first: a snapshot shares 10^5 pages here, so this is one loop)."""
        ids = list(page_ids)
        pages, refs = self.pages, self.page_refs
        for page_id in ids:
            page = pages.get(page_id)
            if page is not None:
                page.refcount += 1
            else:
                refs[page_id] += 1
        self._dirty_page_refs.update(ids)
        self.dirty = True

    def top_up_page_ids(self, lock: threading.RLock) -> None:
        """Owner mode: keep a range of page ids reserved ahead, so that new_page (under
        the pool lock) never waits for the store's pool-level lock. Call with no lock held."""
        if self.reserve_page_ids is None:
            return
        with lock:
            short = not self._spare_page_ids
        if short:
            first = self.reserve_page_ids(PAGE_IDS_AT_ONCE)
            with lock:
                self._spare_page_ids.append(first)

    def ensure_page_id(self) -> None:
        """Owner mode: make sure new_page has an id to give, before anything changes (a
        reservation that fails must leave the request's state as it was). Reserved
        ahead by the committer; inline only when a burst used a whole range up."""
        if self.reserve_page_ids is not None and self._next_page_id >= self._page_id_end:
            first = self._spare_page_ids.pop(0) if self._spare_page_ids else self.reserve_page_ids(PAGE_IDS_AT_ONCE)
            self._next_page_id, self._page_id_end = first, first + PAGE_IDS_AT_ONCE

    def catch_up(self) -> None:
        """Owner mode, between commits: the counts of every page known here follow the
        store's (others' changes included): a pool-level step decides on them (a
        snapshot's removal frees a page only at zero, a share counts from the truth).
        A page the store no longer has, and that nothing here changed, leaves the cache."""
        known = [*self.pages, *self.page_refs]
        stored = self.meta.page_refcounts(known)
        dirty = self._dirty_pages | self._dirty_page_refs
        for page_id in known:
            base = self.page_bases.get(page_id)
            now = stored.get(page_id)
            if now is None:
                if page_id not in dirty and base is not None:
                    self._forget(page_id)
                continue
            if base is None:
                continue  # made here, never committed
            page = self.pages.get(page_id)
            if page is not None:
                page.refcount = now + page.refcount - base
            else:
                self.page_refs[page_id] = now + self.page_refs[page_id] - base
            self.page_bases[page_id] = now

    def new_page(self, entries: array[int] | None = None) -> Page:
        self.ensure_page_id()
        page = Page(self._next_page_id, 1, entries)
        self._next_page_id += 1
        self.pages[page.page_id] = page
        self._dirty_pages.add(page.page_id)
        self.dirty = True
        return page

    def release_page(self, page_id: int, left_alone: list[array[int]] | None = None) -> None:
        """Drop one root-table reference to a page; the last one frees its dblocks. Only
        then, or when one sharer is left, are its entries needed (and the page loaded).
        With left_alone, the entries of a page left to one sharer go there, for the
        caller to hand to SpaceMap.became_exclusive with the others, in one call."""
        count = self.page_refcount(page_id)
        if count > 2 and page_id not in self.pages:
            self.page_refs[page_id] = count - 1
            self._dirty_page_refs.add(page_id)
            self.dirty = True
            return
        page = self.page(page_id)
        page.refcount -= 1
        if page.refcount == 0:
            for entry in page.entries:
                if entry:
                    self.space.decref(entry >> 3)
            self._dirty_pages.add(page_id)
        else:
            if page.refcount == 1:  # its last sharer may write its blocks in place once committed
                if left_alone is None:
                    self.space.became_exclusive([page.entries])
                else:
                    left_alone.append(page.entries)
            self._dirty_page_refs.add(page_id)
        self.dirty = True

    def release_root(self, vol: Volume) -> None:
        """Drop every page of vol's root table (the table ends empty). The store reads come
        first (the counts in one batch, then the pages whose entries the release needs),
        so a failing read changes nothing."""
        self.load_refcounts(vol.root.values())
        self.load_pages([pid for pid in vol.root.values() if self.page_refcount(pid) <= 2])
        vid = vol.row.id
        left_alone: list[array[int]] = []
        for page_index in list(vol.root):
            self.release_page(vol.root.pop(page_index), left_alone)
            self._dirty_roots.add((vid, page_index))
        # After the loop: a dblock a freed page also held is alone by then too (decref
        # made it newly exclusive already; the set keeps it once).
        self.space.became_exclusive(left_alone)
        self.dirty = True

    def share_root(self, vol: Volume, source: Volume) -> None:
        """vol's (empty) root table becomes source's, every page shared by its count alone."""
        self.load_refcounts(source.root.values())
        self.share_pages(source.root.values())
        vol.root.update(source.root)
        vid = vol.row.id
        self._dirty_roots.update((vid, page_index) for page_index in vol.root)
        self.dirty = True

    # ----- what changed ---------------------------------------------------------------

    def page_changed(self, vol: Volume, page_index: int, page: Page) -> None:
        """An entry of vol's page changed: the page, the volume's counters and maybe emptiness."""
        self._dirty_pages.add(page.page_id)
        self._touched.add((vol, page_index))
        self._dirty_volumes.add(vol)
        self.dirty = True

    def mark_root_dirty(self, vol: Volume, page_index: int) -> None:
        self._dirty_roots.add((vol.row.id, page_index))
        self.dirty = True

    def mark_volume_dirty(self, vol: Volume) -> None:
        self._dirty_volumes.add(vol)
        self.dirty = True

    def forget_volume(self, vol: Volume) -> None:
        """vol was removed (its root released first): its row goes, nothing else of it is written."""
        self._dirty_volumes.discard(vol)
        self._touched = {t for t in self._touched if t[0] is not vol}
        self._dirty_roots = {r for r in self._dirty_roots if r[0] != vol.row.id}
        self._deleted_volumes.append(vol.row.id)
        self.dirty = True

    def drop_empty_pages(self) -> None:
        """Pages that became empty and are held by their volume alone leave its root table."""
        for vol, page_index in self._touched:
            page_id = vol.root.get(page_index)
            if page_id is None:
                continue
            page = self.pages[page_id]
            if page.refcount == 1 and page.is_empty():
                del vol.root[page_index]
                page.refcount = 0
                self._dirty_pages.add(page_id)
                self.mark_root_dirty(vol, page_index)

    # ----- handing it to a commit -------------------------------------------------------

    def build(self, superblock: dict[str, object]) -> Built:
        """Everything open as one Transaction, the dirty sets taken (call under the pool lock)."""
        txn = Transaction(
            superblock=superblock,
            volumes=[dataclasses.replace(v.row) for v in self._dirty_volumes],
            deleted_volumes=list(self._deleted_volumes),
            refcount_pages=self.space.take_dirty_pages(),
            page_refcounts={pid: self.page_refcount(pid) for pid in self._dirty_page_refs - self._dirty_pages},
        )
        for vid, page_index in self._dirty_roots:
            # By id, not a table of every volume's root: that would cost O(volumes) per
            # commit and load every lazy root table (a dirty root's volume has its loaded).
            vol = self._volume_by_id(vid)
            if vol is not None:
                txn.roots[(vid, page_index)] = vol.root.get(page_index)
        for page_id in self._dirty_pages:
            page = self.pages[page_id]
            txn.pages[page_id] = None if page.refcount == 0 else (page.refcount, page.to_blob())
        if self.shared:  # owner mode: counts go as changes from what was seen
            txn.page_ref_bases = {
                pid: self.page_bases[pid] for pid in (*txn.pages, *txn.page_refcounts) if pid in self.page_bases
            }
        built = Built(
            txn,
            self._dirty_pages,
            self._dirty_page_refs,
            self._dirty_roots,
            self._dirty_volumes,
            self._deleted_volumes,
        )
        self._dirty_pages, self._dirty_page_refs, self._dirty_roots = set(), set(), set()
        self._dirty_volumes, self._deleted_volumes = set(), []
        self._touched.clear()
        self.dirty = False
        return built

    def put_back(self, built: Built) -> None:
        """A failed commit: everything it took is dirty again, merged with what came since."""
        self._dirty_pages |= built.pages
        self._dirty_page_refs |= built.page_refs
        self._dirty_roots |= built.roots
        self._dirty_volumes |= {v for v in built.volumes if not v.removed}
        self._deleted_volumes = built.deleted_volumes + self._deleted_volumes
        self.space.dirty_pages.update(built.txn.refcount_pages)
        self.dirty = True

    def settle(self, built: Built, stored: dict[int, int] | None = None) -> None:
        """A commit succeeded: pages it deleted leave the cache (ids are never reused).
        Owner mode: stored holds the counts the store keeps now of the pages it changed
        from a base (others' changes included); this view follows them."""
        for page_id, blob in built.txn.pages.items():
            if blob is None and page_id not in self._dirty_pages:
                self._forget(page_id)
        if not self.shared:
            return
        txn = built.txn
        for page_id, page_blob in txn.pages.items():
            if page_blob is not None and page_id not in txn.page_ref_bases:
                self.page_bases[page_id] = page_blob[0]  # new here: stored as sent
        for page_id, now in (stored or {}).items():
            sent_page = txn.pages.get(page_id)
            sent = sent_page[0] if sent_page is not None else txn.page_refcounts.get(page_id, now)
            page = self.pages.get(page_id)
            current = page.refcount if page is not None else self.page_refs.get(page_id, sent)
            count = now + current - sent
            if count == 0:  # nobody references it now: the fold deletes it (core/pool_steps.py)
                self._forget(page_id)
                continue
            if page is not None:
                page.refcount = count
            elif page_id in self.page_refs:
                self.page_refs[page_id] = count
            self.page_bases[page_id] = now
