"""The pool's size and out-of-space policy on a pool served per volume (issue 22).

A whole pool's owner keeps both in memory and writes them with every commit. Owners
per volume do not write them at all (core/commit.py's shared commits): the store's
superblock is the one copy, changed only here, in pool-level steps (the store's
pool-level lock, one at a time across processes). Each owner *follows* it: its view
of the size (the blocks it may be granted) and of the policy becomes the stored one

- at every grant it takes (owner.py's _gather calls `take_grant_growing`, under the
  pool-level lock, before deciding), so an owner never decides on an old size or
  an old policy when it needs space: a writer held by `wait` asks for a grant each
  time it wakes (at least once a COMMIT_INTERVAL_S), and so sees a grow by then;
- at once, when the command that changed them tells it over its control socket
  (`pool_follow`, admin/follow.py): held writers wake and re-plan now, low-water
  marks are checked against the new figures now.

Growth is crash-safe as on a whole pool: the data store grows first (its owner
header and birth table move past the new blocks, durably, store/owned.py), then
the new size is committed. A crash in between leaves a store larger than the
metadata says; the tail it left behind lies in blocks the next grow adds, so that
grow (or a whole-pool open) clears it before they are counted. Nothing but that
extension of the data store runs under the pool-level lock.

Autogrow is decided under the same lock from the store's figures, never from an
owner's view: an owner grows the pool only when the store has no free block
outside every grant (or its unreserved free share is below the mark), so a
second owner short at the same moment waits for the lock, then finds the blocks
the first one added and is granted them instead of growing again.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import TYPE_CHECKING, Any

from thinblock.core.pool_steps import grant_blocks
from thinblock.core.space_policy import autogrow_target
from thinblock.errors import ThinblockError
from thinblock.meta.base import Grant, Lease, Transaction
from thinblock.sizes import format_size
from thinblock.store.base import DataStore
from thinblock.store.hostspace import beyond_file_limit
from thinblock.store.owned import OwnedStore, births_bytes

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

log = logging.getLogger("thinblock.pool")


def follow_pool(pool: Pool, superblock: dict[str, Any] | None = None) -> dict[str, Any]:
    """This owner's view of the pool's size and policy becomes the store's (superblock:
    read already, under the pool-level lock); held writers wake and plan again.
    Returns the policy's settings (the `pool_follow` control verb's answer)."""
    sb = pool.meta.superblock() if superblock is None else superblock
    size = int(sb["size_bytes"])
    accounts = pool.accounts
    with pool.lock:
        if size > accounts.size_bytes:
            accounts.space.grow(size // pool.block_size)  # owner mode: not ours until granted
            accounts.size_bytes = size
        pool.policy.follow(sb)
        settings = pool.policy.settings()
    pool.wake_space_waiters()
    return settings


def _leases(pool: Pool) -> list[Lease]:
    # An owner's step names its leases: an owner fenced off meanwhile changes nothing.
    return pool.owner.leases() if pool.owner is not None else []


def _owned(store: DataStore) -> OwnedStore | None:
    while not isinstance(store, OwnedStore):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, DataStore):
            return None
        store = inner
    return store


def _extend_store(pool: Pool, stored_bytes: int, size_bytes: int) -> None:
    """Grow the data store (pool-level lock held). Another owner may have moved the
    file's tail since this process read its header: read it again first. A tail left
    past the stored size by a grow that died before its commit is cleared (its blocks
    are about to be counted), as a whole pool's open does."""
    owned = _owned(pool.store)
    try:
        if owned is not None:
            owned.load(stored_bytes + births_bytes(stored_bytes // pool.block_size))
            owned.clear_interrupted_grow(stored_bytes)
        pool.store.grow(size_bytes)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise beyond_file_limit(size_bytes, pool.path) from None
        raise ThinblockError(f"cannot grow the data store of pool {pool.path}: {exc.strerror}") from None


def grow_shared(pool: Pool, size_bytes: int) -> list[str]:
    """Pool.grow on a pool served per volume: a pool-level step. Returns warnings for a
    person (a pool larger than the host can hold)."""
    bs = pool.block_size
    if size_bytes % bs:
        raise ThinblockError(f"pool size must be a multiple of the block size ({format_size(bs)})")
    with pool.meta.pool_lock():
        sb = pool.meta.superblock()
        stored = int(sb["size_bytes"])
        if size_bytes < stored:
            raise ThinblockError(
                f"shrinking a pool is not supported ({format_size(stored)} -> {format_size(size_bytes)})"
            )
        if size_bytes > stored:
            _extend_store(pool, stored, size_bytes)
            pool.meta.commit(Transaction(leases=_leases(pool), superblock={"size_bytes": size_bytes}))
            sb = {**sb, "size_bytes": size_bytes}
            log.info("pool %s grown to %s", pool.path, format_size(size_bytes))
        follow_pool(pool, sb)
    warning = pool.host.capacity_warning(size_bytes, pool.data_path)
    if warning:
        log.warning("%s", warning)
    return [warning] if warning else []


def set_policy_shared(pool: Pool, changes: dict[str, Any]) -> dict[str, Any]:
    """Pool.set_policy on a pool served per volume: a pool-level step. The changes apply
    to the stored policy as followed under the lock (another command's change made
    meanwhile is kept), validated before anything is written."""
    with pool.meta.pool_lock():
        follow_pool(pool)
        with pool.lock:
            before = pool.policy.to_superblock()
            pool.policy.update(changes)
            after = pool.policy.to_superblock()
        try:
            pool.meta.commit(Transaction(leases=_leases(pool), superblock=after))
        except BaseException:
            with pool.lock:
                pool.policy.follow(before)
            raise
    with pool.lock:
        pool.policy.check()
        settings = pool.policy.settings()
    pool.wake_space_waiters()
    return settings


def take_grant_growing(pool: Pool, lease: Lease, blocks: int, short: int) -> Grant:
    """An owner's grant step (pool-level lock held): the size and policy followed first;
    when no block is free outside others' grants and the policy autogrows, the pool
    grows for the `short` blocks the request lacks (up to MAX) and the grant is taken
    from what it added. OSError ENOSPC when there is still none."""
    follow_pool(pool)
    try:
        return grant_blocks(pool.meta, lease, blocks)
    except OSError as exc:
        if exc.errno != errno.ENOSPC or not autogrow_shared(pool, short):
            raise
    return grant_blocks(pool.meta, lease, blocks)


def autogrow_shared(pool: Pool, short_blocks: int, *, below_percent: float | None = None) -> bool:
    """Grow by STEP (enough STEPs for short_blocks) up to MAX, decided from the store's
    figures under the pool-level lock; with below_percent, only while the pool's free
    share as committed is below it (a low-water crossing another owner may have
    answered already). Whether it grew."""
    bs = pool.block_size
    with pool.meta.pool_lock():
        sb = pool.meta.superblock()
        follow_pool(pool, sb)
        autogrow = pool.policy.autogrow
        if autogrow is None or short_blocks <= 0:
            return False
        stored = int(sb["size_bytes"])
        if below_percent is not None:
            free = stored - int(sb.get("used_blocks") or 0) * bs
            if 100.0 * free / stored >= below_percent:
                return False
        maximum = autogrow[1]
        new_size = autogrow_target(autogrow, stored, short_blocks, bs)
        if new_size <= stored:
            return False
        try:
            grow_shared(pool, new_size)
        except (OSError, ThinblockError) as exc:
            log.error("autogrow of pool %s to %s failed: %s", pool.path, format_size(new_size), exc)
            return False
    log.warning("pool %s autogrown to %s (max %s)", pool.path, format_size(new_size), format_size(maximum))
    return True


def autogrow_soon(pool: Pool, below_percent: float) -> None:
    """A low-water crossing seen by an owner, with its pool lock held (no pool-level
    step may start there: that lock comes first): autogrow on a thread of its own."""

    def run() -> None:
        try:
            autogrow_shared(pool, 1, below_percent=below_percent)
        except (OSError, ThinblockError) as exc:  # the pool closed meanwhile, or its store failed
            log.warning("pool %s: autogrow at the low-water mark failed: %s", pool.path, exc)

    threading.Thread(target=run, name="thinblock-autogrow", daemon=True).start()
