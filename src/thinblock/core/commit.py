"""The commit pipeline: the open transaction, and how it becomes durable.

Every metadata change is collected in memory (dirty pages, roots, volumes) and
written as one transaction of the metadata store by `commit()`: on flush, FUA,
and at least once a second from the background committer. One commit runs at a
time, in three steps: build the transaction under the pool lock (a copy of every
dirty page, the dirty sets taken), write it with no pool lock held (data sync
first, then the metadata: rule 3), and settle under the lock. A failed write
puts everything it took back (rule 2), so the next commit retries exactly what
this one would have written; the committer never dies. Freed dblocks are
punched only after the commit that freed them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from thinblock.core.mapping import BlockState, Page, entry_dblock, entry_state, mapped_pairs
from thinblock.core.spacemap import SpaceMap, to_runs
from thinblock.errors import CommitError, ThinblockError, is_no_space
from thinblock.meta.base import MetadataStore, Transaction
from thinblock.progress import ProgressFn, no_progress
from thinblock.sizes import format_size
from thinblock.stats import PoolStats
from thinblock.steps import timed
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace
from thinblock.store.owned import OwnedStore

if TYPE_CHECKING:
    from thinblock.core.space_policy import SpacePolicy
    from thinblock.core.volume import Volume

COMMIT_INTERVAL_S = 1.0
COMMIT_RETRY_MAX_S = 5.0  # longest wait between retries of a failing commit
log = logging.getLogger("thinblock.pool")
_T = TypeVar("_T")


@dataclasses.dataclass
class _Built:
    """A transaction being written, with the dirty sets it took (put back if it fails)."""

    txn: Transaction
    pages: set[int]
    page_refs: set[int]
    roots: set[tuple[int, int]]
    volumes: set[Volume]
    deleted_volumes: list[int]


def _all_found(wanted: list[int], found: dict[int, _T]) -> dict[int, _T]:
    """A batch read's answer, or ThinblockError naming a wanted page it lacks."""
    if len(found) != len(wanted):
        page_id = next(pid for pid in wanted if pid not in found)
        raise ThinblockError(f"mapping page {page_id} is referenced but missing (run 'thinblock pool check')")
    return found


class CommitPipeline:
    """The pool's transaction (a part of Pool; see core/pool.py for its state)."""

    path: str
    meta: MetadataStore
    store: DataStore
    owned: OwnedStore | None  # the data store's owner header and birth table
    lock: threading.RLock
    meta_lock: threading.Lock
    block_size: int
    size_bytes: int
    transaction_id: int
    space: SpaceMap
    pages: dict[int, Page]
    page_refs: dict[int, int]
    volumes: dict[str, Volume]
    policy: SpacePolicy
    host: HostSpace
    stats: PoolStats
    dirty: bool
    last_commit: float
    commit_failure: str | None
    _next_page_id: int
    _dirty_pages: set[int]
    _dirty_page_refs: set[int]
    _dirty_roots: set[tuple[int, int]]
    _touched: set[tuple[Volume, int]]
    _dirty_volumes: set[Volume]
    _deleted_volumes: list[int]
    _committing: bool
    _commit_idle: threading.Condition
    _kick: threading.Event
    _closed: threading.Event

    if TYPE_CHECKING:  # provided by SpaceAccounts, and by Pool's registry

        def wake_space_waiters(self) -> None: ...

        def volume_by_id(self, volume_id: int | None) -> Volume | None: ...

    # ----- pages (used by Volume) ---------------------------------------------------

    def page(self, page_id: int) -> Page:
        page = self.pages.get(page_id)
        if page is None:
            # Not under meta_lock: page reads never wait for a commit (meta/base.py's
            # contract). A page missing from the cache is committed and unchanged since.
            found = self.meta.page(page_id)
            if found is None:
                raise ThinblockError(f"mapping page {page_id} is referenced but missing (run 'thinblock pool check')")
            # A count changed (or read) while the page was not loaded is the authority:
            # from now on the Page holds it.
            page = Page.from_blob(page_id, self.page_refs.pop(page_id, found[0]), found[1])
            self.pages[page_id] = page
        return page

    # Page refcounts are known without a page's entries: a loaded Page holds its own
    # count; page_refs holds the counts of pages not loaded that were read in a batch
    # (load_refcounts) or changed since. A page in neither is committed and unchanged.

    def load_refcounts(self, page_ids: Iterable[int]) -> None:
        """Know the refcount of every page of page_ids, in one batch read of the store for
        those not known yet; a page that does not exist raises, with nothing changed."""
        # Once each: callers pass several root tables, which share pages.
        missing = [pid for pid in dict.fromkeys(page_ids) if pid not in self.pages and pid not in self.page_refs]
        if not missing:
            return
        found = _all_found(missing, self.meta.page_refcounts(missing))
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

    def new_page(self, entries: array[int] | None = None) -> Page:
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

    # ----- transactions -----------------------------------------------------------
    # One commit at a time (`_committing`), in three steps: build the transaction
    # under the pool lock (a copy of every dirty page, the dirty sets taken), write
    # it outside the lock (data sync first, then the metadata: rule 3), and settle
    # under the lock. A failed write puts everything it took back (rule 2), so the
    # next commit retries exactly what this one would have written.

    def between_commits(self, read: Callable[[MetadataStore], _T]) -> _T:
        """Run read on the metadata store while no commit runs or starts (a dump sees
        one committed state); requests go on meanwhile, only commits wait."""
        with self.lock:
            while self._committing:
                self._commit_idle.wait()
            self._committing = True
        try:
            return read(self.meta)
        finally:
            with self.lock:
                self._committing = False
                self._commit_idle.notify_all()

    def commit(self) -> None:
        """Make everything completed so far durable: data first, then the metadata
        that points at it, atomically (docs/architecture.md's flush). Raises CommitError (ENOSPC
        when the layer below is full, else EIO) and changes nothing in memory if it
        fails; what it would have written stays pending."""
        with self.lock:
            while self._committing:
                self._commit_idle.wait()
            if self._closed.is_set():
                return
            self._committing = True
        started = time.perf_counter()
        try:
            self._commit_once()
        except BaseException:
            self.stats.commit_failed(time.perf_counter() - started)
            raise
        else:
            self.stats.committed(time.perf_counter() - started)
        finally:
            with self.lock:
                self._committing = False
                self._commit_idle.notify_all()

    def _commit_once(self) -> None:
        with self.lock:
            self._drop_empty_pages()
            built = self._build_transaction() if self.dirty else None
            synced_frees = len(self.space.unsynced_free)  # punched before this sync: free after it
            new_frees = len(self.space.pending_free)  # freed in this transaction: punched after it
            generation = self.transaction_id
            births = self.space.take_births() if built is not None else []
            exclusive = set(self.space.newly_exclusive) if built is not None else set()
        try:
            if self.owned is not None and births:
                self.owned.write_births(births, generation)  # made durable by the sync below
            self.store.flush()
            if built is not None:
                self._write_metadata(built.txn)
        except Exception as exc:
            with self.lock:
                if built is not None:
                    self._put_back(built)
                self.space.births[:0] = births
            raise self._commit_failed(exc) from exc
        if built is not None and self.owned is not None:
            try:  # after the metadata, durable with the next sync: see store/owned.py
                self.owned.write_header(generation)
            except OSError as exc:
                log.warning("pool %s: recording generation %d in the data store failed: %s", self.path, generation, exc)
        with self.lock:
            self.space.release_synced(synced_frees)
            if built is not None:
                self._settle(built)
                self.space.newly_exclusive -= exclusive  # durable now: writable in place
            punch = self.space.take_pending(new_frees if built is not None else 0)
            self.last_commit = time.monotonic()
        # Only now may freed blocks go back to the layer below; they become allocatable
        # after the next data sync has made the punch durable (spacemap's rule 2).
        punched = []
        try:
            for start, count in punch:
                self.store.punch(start * self.block_size, count * self.block_size)
                punched.append((start, count))
        except OSError as exc:
            log.error("pool %s: punching freed blocks failed (%s); retried after the next commit", self.path, exc)
        with self.lock:
            self.space.punched(punch, punched)
            if self.commit_failure is not None:
                log.warning("pool %s: commits succeed again; nothing acknowledged was lost", self.path)
                self.commit_failure = None
            self.host.after_commit()
            if synced_frees or punched:
                self.wake_space_waiters()
            self.policy.check()

    def _build_transaction(self) -> _Built:
        self.transaction_id += 1
        txn = Transaction(
            superblock={
                "transaction_id": self.transaction_id,
                "used_blocks": self.space.durable_used_blocks,
                "size_bytes": self.size_bytes,
                "sharing_epoch": self.space.sharing_epoch,  # what the rows' exclusive_epoch stamps mean
                **self.policy.to_superblock(),
            },
            volumes=[dataclasses.replace(v.row) for v in self._dirty_volumes],
            deleted_volumes=list(self._deleted_volumes),
            refcount_pages=self.space.take_dirty_pages(),
            page_refcounts={pid: self.page_refcount(pid) for pid in self._dirty_page_refs - self._dirty_pages},
        )
        for vid, page_index in self._dirty_roots:
            # By id, not a table of every volume's root: that would cost O(volumes) per
            # commit and load every lazy root table (a dirty root's volume has its loaded).
            vol = self.volume_by_id(vid)
            if vol is not None:
                txn.roots[(vid, page_index)] = vol.root.get(page_index)
        for page_id in self._dirty_pages:
            page = self.pages[page_id]
            txn.pages[page_id] = None if page.refcount == 0 else (page.refcount, page.to_blob())
        built = _Built(
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

    def _put_back(self, built: _Built) -> None:
        """A failed commit: everything it took is dirty again, merged with what came since."""
        self.transaction_id -= 1
        self._dirty_pages |= built.pages
        self._dirty_page_refs |= built.page_refs
        self._dirty_roots |= built.roots
        self._dirty_volumes |= {v for v in built.volumes if not v.removed}
        self._deleted_volumes = built.deleted_volumes + self._deleted_volumes
        self.space.dirty_pages.update(built.txn.refcount_pages)
        self.dirty = True

    def _settle(self, built: _Built) -> None:
        """A commit succeeded: pages it deleted leave the cache (ids are never reused)."""
        for page_id, blob in built.txn.pages.items():
            if blob is None and page_id not in self._dirty_pages:
                self.pages.pop(page_id, None)
                self.page_refs.pop(page_id, None)

    def _write_metadata(self, txn: Transaction) -> None:
        """One atomic metadata commit; when the host is full, the metadata slack is
        given up once and the commit retried (see hostspace)."""
        try:
            with self.meta_lock:
                self.meta.commit(txn)
        except Exception as exc:
            if not (is_no_space(exc) and self.host.release_slack()):
                raise
            with self.meta_lock:
                self.meta.commit(txn)

    def _commit_failed(self, exc: Exception) -> CommitError:
        error = CommitError(self.path, exc)
        if self.commit_failure is None:
            log.error("%s", error.strerror)
        self.commit_failure = error.strerror
        return error

    def _recover_free_space(self, progress: ProgressFn | None = None) -> None:
        """After an unclean shutdown, restore the two zero rules: free blocks and
        ZEROED blocks' dblocks may hold bytes written but never committed (a write
        into them ran, the commit recording it did not). Punch the free ones, zero
        the ZEROED ones, durably. progress counts their bytes: the free ones, then the ZEROED."""
        with timed(log, f"pool {self.path}: recovery after an unclean close") as step:
            runs = self.space.free_runs()
            total = sum(count for _, count in runs)
            done = 0
            tell = progress or no_progress
            for start, count in runs:
                self.store.punch(start * self.block_size, count * self.block_size)
                done += count
                tell(done * self.block_size, total * self.block_size)
            step.mark("punched %d free extents (%s)", len(runs), format_size(total * self.block_size))
            zeroed = sorted(
                {
                    entry_dblock(entry)
                    for _pid, _ref, blob in self.meta.all_pages()
                    for entry in mapped_pairs(blob)[1]
                    if entry_state(entry) == BlockState.ZEROED
                }
            )
            step.mark("found %d ZEROED blocks", len(zeroed))
            total += len(zeroed)
            for start, count in to_runs(zeroed):
                self.store.zero(start * self.block_size, count * self.block_size)
                done += count
                tell(done * self.block_size, total * self.block_size)
            step.mark("re-zeroed %d ZEROED blocks", len(zeroed))
            self.store.flush()
            step.mark("data store synced")

    def _drop_empty_pages(self) -> None:
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

    def flush(self) -> None:
        self.commit()

    def kick_commit(self) -> None:
        """Commit soon rather than within the interval (freed space the host needs)."""
        self._kick.set()

    def _commit_loop(self) -> None:
        """Commit at least once a second. It never dies: a failure is logged once (by
        commit), retried with a growing delay, and its end is logged too."""
        delay = COMMIT_INTERVAL_S / 4
        while not self._closed.is_set():
            kicked = self._kick.wait(delay)
            self._kick.clear()
            if self._closed.is_set():
                return
            space = self.space
            pending = self.dirty or space.pending_free or space.unsynced_free or self.host.slack_released
            if not pending or (not kicked and time.monotonic() - self.last_commit < COMMIT_INTERVAL_S):
                continue
            try:
                self.commit()
            except Exception:
                delay = min(max(delay * 2, 0.5), COMMIT_RETRY_MAX_S)
            else:
                delay = COMMIT_INTERVAL_S / 4
