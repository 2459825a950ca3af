"""The commit pipeline: how the open transaction becomes durable.

Every metadata change is collected in the open transaction (core/transaction.py)
and written as one transaction of the metadata store by `commit()`: on flush,
FUA, and at least once a second from the background committer. One commit runs
at a time, in three steps: build the transaction under the pool lock (a copy of
every dirty page, the dirty sets taken), write it with no pool lock held (data
sync first, then the metadata: rule 3), and settle under the lock. A failed
write puts everything it took back (rule 2), so the next commit retries exactly
what this one would have written; the committer never dies. Freed dblocks are
punched only after the commit that freed them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from thinblock.core.mapping import BlockState, entry_dblock, entry_state, mapped_pairs
from thinblock.core.spacemap import SpaceMap, to_runs
from thinblock.core.transaction import Built, OpenTransaction
from thinblock.errors import CommitError, ThinblockError, is_no_space
from thinblock.meta.base import CommitResult, Lease, MetadataStore, Transaction
from thinblock.progress import ProgressFn, no_progress
from thinblock.sizes import format_size
from thinblock.stats import PoolStats
from thinblock.steps import timed
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace
from thinblock.store.owned import OwnedStore

if TYPE_CHECKING:
    from thinblock.core.space import SpaceAccounts
    from thinblock.core.space_policy import SpacePolicy

COMMIT_INTERVAL_S = 1.0
COMMIT_RETRY_MAX_S = 5.0  # longest wait between retries of a failing commit
log = logging.getLogger("thinblock.pool")
_T = TypeVar("_T")


class Committer:
    """Writes one owner's open transaction to the metadata store, one commit at a time."""

    def __init__(
        self,
        *,
        path: str,
        lock: threading.RLock,
        meta: MetadataStore,
        store: DataStore,
        owned: OwnedStore | None,
        txn: OpenTransaction,
        accounts: SpaceAccounts,
        policy: SpacePolicy,
        host: HostSpace,
        stats: PoolStats,
        transaction_id: int,
    ) -> None:
        self.path = path
        self.lock = lock  # the pool lock: the open transaction is built and settled under it
        self.meta_lock = threading.Lock()  # one metadata commit at a time
        self.meta = meta
        self.store = store
        self.owned = owned  # the data store's owner header and birth table
        self.txn = txn
        self.accounts = accounts
        self.space: SpaceMap = accounts.space
        self.policy = policy
        self.host = host
        self.stats = stats
        self.block_size = accounts.block_size
        self.transaction_id = transaction_id
        self.last_commit = time.monotonic()
        self.commit_failure: str | None = None  # why commits fail, while they do
        self._committing = False
        self._commit_idle = threading.Condition(lock)
        self._kick = threading.Event()
        self.closed = threading.Event()
        self._thread: threading.Thread | None = None
        # Owner mode (core/owner.py): the leases every commit is guarded by; counts are
        # then sent as changes from what this owner last saw (meta/owners.py).
        self.leases: Callable[[], list[Lease]] | None = None
        self.fold_orphans: Callable[[], None] | None = None  # the pool-level fold (core/owner.py)
        self.sharing_base = 0
        self._fold_wanted = False
        self.give_back_idle: Callable[[], None] | None = None  # owner mode: idle grants back

    def start(self) -> None:
        """Commit in the background, at least once a second."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._commit_loop, name="thinblock-commit", daemon=True)
            self._thread.start()

    def join(self) -> None:
        """After closed is set: wait for the background committer to end."""
        self._kick.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ----- transactions -----------------------------------------------------------
    # One commit at a time (`_committing`), in three steps: build the transaction
    # under the pool lock (a copy of every dirty page, the dirty sets taken), write
    # it outside the lock (data sync first, then the metadata: rule 3), and settle
    # under the lock. A failed write puts everything it took back (rule 2), so the
    # next commit retries exactly what this one would have written.

    def between_commits(self, read: Callable[[MetadataStore], _T]) -> _T:
        """Run read on the metadata store while no commit runs or starts (a dump sees
        one committed state); requests go on meanwhile, only commits wait."""
        claimed = False
        try:
            with self.lock:
                while self._committing:
                    self._commit_idle.wait()
                self._committing = claimed = True
            return read(self.meta)
        finally:
            if claimed:
                self._give_turn_back()

    def commit(self) -> None:
        """Make everything completed so far durable: data first, then the metadata
        that points at it, atomically (docs/architecture.md's flush). Raises CommitError (ENOSPC
        when the layer below is full, else EIO) and changes nothing in memory if it
        fails; what it would have written stays pending."""
        # The turn is claimed inside the try that gives it back: an exception between
        # the two (a Ctrl-C lands at any bytecode) would leave every later commit,
        # the one at close too, waiting for it forever.
        claimed = False
        try:
            with self.lock:
                while self._committing:
                    self._commit_idle.wait()
                if self.closed.is_set():
                    return
                self._committing = claimed = True
            started = time.perf_counter()
            try:
                self._commit_once()
            except BaseException:
                self.stats.commit_failed(time.perf_counter() - started)
                raise
            self.stats.committed(time.perf_counter() - started)
        finally:
            if claimed:
                self._give_turn_back()
        if self.leases is not None:
            self._between_owners()

    def _between_owners(self) -> None:
        """Owner mode, after a commit, outside its turn and every lock (these take the
        store's pool-level lock, which a pool-level step may hold while it waits for a
        commit): fold the orphan pages it left, and reserve page ids ahead."""
        if self._fold_wanted and self.fold_orphans is not None:
            self._fold_wanted = False
            self.fold_orphans()
        try:
            self.txn.top_up_page_ids(self.lock)
        except (OSError, ThinblockError) as exc:
            log.warning("pool %s: reserving page ids failed: %s", self.path, exc)
        if self.give_back_idle is not None:
            self.give_back_idle()

    def _give_turn_back(self) -> None:
        with self.lock:
            self._committing = False
            self._commit_idle.notify_all()

    def _commit_once(self) -> None:
        with self.lock:
            self.txn.drop_empty_pages()
            built = self._build() if self.txn.dirty else None
            synced_frees = len(self.space.unsynced_free)  # punched before this sync: free after it
            new_frees = len(self.space.pending_free)  # freed in this transaction: punched after it
            generation = self.transaction_id
            births = self.space.take_births() if built is not None else []
            exclusive = set(self.space.newly_exclusive) if built is not None else set()
        result = CommitResult()
        try:
            if self.owned is not None and births:
                self.owned.write_births(births, generation)  # made durable by the sync below
            self.store.flush()
            if built is not None:
                result = self.write_metadata(built.txn)
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
                if self.leases is not None:
                    self._follow_store(built, result)
                self.txn.settle(built, result.page_refcounts)
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
                self.accounts.wake_space_waiters()
            self.policy.check()
        if result.orphans:
            self._fold_wanted = True

    def _build(self) -> Built:
        self.transaction_id += 1
        if self.leases is not None:
            return self._build_shared()
        return self.txn.build(
            {
                "transaction_id": self.transaction_id,
                "used_blocks": self.space.durable_used_blocks,
                "size_bytes": self.accounts.size_bytes,
                "sharing_epoch": self.space.sharing_epoch,  # what the rows' exclusive_epoch stamps mean
                **self.policy.to_superblock(),
            }
        )

    def _build_shared(self) -> Built:
        """Owner mode: the open transaction as changes. Counters go as changes from what
        was last seen; the pool's size, policy and used count are not this owner's to
        write (the store derives the used count from the refcounts)."""
        epoch = self.space.sharing_epoch
        built = self.txn.build({"transaction_id": self.transaction_id, "sharing_epoch": epoch})
        txn = built.txn
        txn.counter_bases = {"transaction_id": self.transaction_id - 1, "sharing_epoch": self.sharing_base}
        txn.refcount_bases = self.space.refcount_bases(txn.refcount_pages)
        assert self.leases is not None
        txn.leases = self.leases()
        return built

    def _follow_store(self, built: Built, result: CommitResult) -> None:
        """Owner mode, after a commit: this view follows what the store holds now."""
        txn = built.txn
        self.space.refresh(result.refcount_pages, txn.refcount_pages)
        self.transaction_id = result.counters.get("transaction_id", self.transaction_id)
        sent = int(txn.superblock["sharing_epoch"])  # type: ignore[call-overload]
        stored = result.counters.get("sharing_epoch", sent)
        self.space.sharing_epoch = stored + self.space.sharing_epoch - sent
        self.sharing_base = stored

    def _put_back(self, built: Built) -> None:
        self.transaction_id -= 1
        self.txn.put_back(built)

    def write_metadata(self, txn: Transaction) -> CommitResult:
        """One atomic metadata commit; when the host is full, the metadata slack is
        given up once and the commit retried (see hostspace)."""
        try:
            with self.meta_lock:
                return self.meta.commit(txn)
        except Exception as exc:
            if not (is_no_space(exc) and self.host.release_slack()):
                raise
            with self.meta_lock:
                return self.meta.commit(txn)

    def _commit_failed(self, exc: Exception) -> CommitError:
        error = CommitError(self.path, exc)
        if self.commit_failure is None:
            log.error("%s", error.strerror)
        self.commit_failure = error.strerror
        return error

    def recover_free_space(self, progress: ProgressFn | None = None) -> None:
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

    def flush(self) -> None:
        self.commit()

    def kick_commit(self) -> None:
        """Commit soon rather than within the interval (freed space the host needs)."""
        self._kick.set()

    def _commit_loop(self) -> None:
        """Commit at least once a second. It never dies: a failure is logged once (by
        commit), retried with a growing delay, and its end is logged too."""
        delay = COMMIT_INTERVAL_S / 4
        while not self.closed.is_set():
            kicked = self._kick.wait(delay)
            self._kick.clear()
            if self.closed.is_set():
                return
            space = self.space
            pending = self.txn.dirty or space.pending_free or space.unsynced_free or self.host.slack_released
            if not pending or (not kicked and time.monotonic() - self.last_commit < COMMIT_INTERVAL_S):
                continue
            try:
                self.commit()
            except Exception:
                delay = min(max(delay * 2, 0.5), COMMIT_RETRY_MAX_S)
            else:
                delay = COMMIT_INTERVAL_S / 4
