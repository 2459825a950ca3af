"""Snapshots, clones and rollback: sharing root tables, never copying blocks.

A snapshot copies its volume's root table and takes one more reference on
every mapping page: O(pages), independent of how many blocks are mapped. The
first write to a shared page copies the page (Volume._writable_page); the
first write to a shared dblock copies the block, or only its untouched bytes
for a partial write (Volume.write). A snapshot holds its volume's whole range
(shared: reads go on, writes wait) and then the pool lock, so a snapshot of a
live volume is the state between requests: every write that completed is in
it, none in flight is. It is committed (data synced first) before the call
returns, with no lock held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from thinblock.core.delta import changed_ranges
from thinblock.core.pool import Pool, validate_volume_size
from thinblock.core.reservation import target_blocks
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.sizes import format_size


def _weigh(pool: Pool, vol: Volume, what: str) -> None:
    """Refuse (ENOSPC) a share of vol's blocks its reservation cannot cover (call under
    the pool lock). The share takes everything vol owned alone: vol's set-aside grows to
    the whole reservation, which the pool must be able to hold. That is also what keeps
    a fully reserved volume's thinblock:guaranteed ranges true: a share that cannot set
    the space aside is refused, never taken."""
    if vol.row.reserve_bytes:
        why = " to keep every write to it sure of space" if vol.fully_reserved() else ""
        pool.accounts.check_reservable(vol, pool.accounts.reserve_target(vol), what, why=why)


def share_into(pool: Pool, vol: Volume, name: str, kind: str, *, staging: bool = False) -> Volume:
    """A new volume or read-only snapshot holding vol's contents (call under the pool
    lock, after _weigh): vol owns nothing alone from now on."""
    new = pool.add_volume(name, vol.size_bytes, vol.row.detect_zeroes, sharing=vol, kind=kind, staging=staging)
    if kind == "snapshot":
        new.row.origin_id = vol.row.id
        new.readonly = True
    _share_counted(pool, vol, new)
    return new


@contextlib.contextmanager
def _pool_step(pool: Pool) -> Iterator[None]:
    """A job's change of the volume table (a staging volume made, published, adopted):
    for an owner per volume, a pool-level step on counts that follow the store's, as
    every administration verb is (admin/verbs.run_validated); nothing otherwise."""
    with pool.pool_step():
        pool.catch_up()
        yield


def _share_counted(pool: Pool, *volumes: Volume) -> None:
    """Volumes that now hold the same pages (share_contents) own nothing alone: their
    exclusive counts are exactly 0 (core/exclusive.py)."""
    for vol in volumes:
        pool.accounts.set_exclusive(vol, 0)


def create_snapshot(pool: Pool, source: str, name: str) -> Volume:
    """A read-only snapshot of a volume or of another snapshot."""
    with pool.quiesced(source, exclusive=False) as vol, pool.lock:
        pool.check_new_name(name, "snapshot")  # a bad name is refused before a reservation is weighed
        _weigh(pool, vol, "snapshot")
        snap = share_into(pool, vol, name, "snapshot")
    pool.commit()
    return snap


def stage(pool: Pool, source: Volume, purpose: str, *, kind: str = "volume") -> Volume:
    """A hidden volume (or read-only snapshot) sharing source's contents, for work that
    must not show until it is done (import-diff) or must read one moment (export of a
    live volume). It is taken between requests, as a snapshot is, and weighed against
    source's reservation the same way. A staged volume will replace source (adopt), so
    the blocks it gains count toward source's reservation (core/reservation.py); a
    staged snapshot replaces nothing. Its name starts with STAGING_PREFIX, which user
    names cannot; one left behind by a crash is removed when the pool is next opened.
    Committed."""
    with _pool_step(pool):
        with source.ranges.hold_all(exclusive=False), pool.lock:
            if source.removed:
                raise ThinblockError(f"no volume {source.name!r} in pool {pool.path}")
            _weigh(pool, source, purpose)
            staged = share_into(pool, source, pool.staging_name(purpose), kind, staging=True)
            if kind == "volume":
                pool.accounts.stand_in(staged, source)
        try:
            pool.commit()
        except BaseException:
            # The copy is in memory, pending: take it away again before anything uses
            # it, so no later commit writes it (a failing layer below may fail this too).
            with contextlib.suppress(Exception):
                pool.remove_volume(staged.name)
            raise
    return staged


def stage_empty(
    pool: Pool, purpose: str, size_bytes: int, detect_zeroes: str, replacing: Volume | None = None
) -> Volume:
    """A hidden, empty volume for a job that builds a volume's whole contents (import):
    it shows under its real name only when `publish_staged` (or `adopt`) says so, so
    a job that dies leaves nothing that looks like a volume. Like every staging
    volume, one left behind is removed when the pool is next opened. Not committed:
    the job's own writes and commits carry it. replacing: the existing volume it will
    replace (adopt), whose reservation its blocks count toward (core/reservation.py),
    so an import that fits the volume's set-aside never fails for want of space."""
    validate_volume_size(size_bytes)
    with _pool_step(pool):
        with pool.lock:
            staged = pool.add_volume(pool.staging_name(purpose), size_bytes, detect_zeroes, staging=True)
            if replacing is not None:
                pool.accounts.stand_in(staged, replacing)
        if pool.owner is not None:
            # Its row exists before a grant is taken for it (no grant of a volume that
            # does not exist is left if the job dies): nothing to sync, it is empty.
            pool.commit()
    return staged


def publish_staged(pool: Pool, renames: list[tuple[Volume, str]]) -> None:
    """Give staging volumes (and staged snapshots of them) their real names, all in one
    metadata commit: a crash leaves every one of them hidden (removed at the next
    open) or every one visible, never some. The names are checked first; nothing
    changes if one is taken (or invalid)."""
    with _pool_step(pool):
        with pool.lock:
            for staged, name in renames:
                if staged.removed or pool.volumes.get(staged.name) is not staged:
                    raise ThinblockError(f"the staging volume for {name} is gone")
                pool.check_new_name(name, staged.row.kind)
            if len({name for _, name in renames}) != len(renames):
                raise ThinblockError("two staging volumes cannot take one name")
            hidden = [(staged, staged.name) for staged, _ in renames]
            for staged, name in renames:
                with pool.volumes.tallied(staged):  # visible now: into the pool's totals
                    del pool.volumes[staged.name]
                    staged.row.name = name
                    pool.volumes[name] = staged
                pool.txn.mark_volume_dirty(staged)
        try:
            pool.commit()
        except BaseException:
            # The commit that would show them failed: they are hidden again, so the job's
            # cleanup (or the next open) removes them, and no later commit publishes what
            # the job reported as failed.
            with pool.lock:
                for staged, old in hidden:
                    if pool.volumes.get(staged.name) is staged:
                        with pool.volumes.tallied(staged):
                            del pool.volumes[staged.name]
                            staged.row.name = old
                            pool.volumes[old] = staged
                        pool.txn.mark_volume_dirty(staged)
            raise


def clone(pool: Pool, snapshot: str, name: str) -> Volume:
    """A writable volume sharing every block of a snapshot."""
    with pool.lock:
        snap = pool.volume(snapshot, kind="snapshot")
        vol = pool.add_volume(name, snap.size_bytes, snap.row.detect_zeroes, sharing=snap)
        vol.row.origin_id = snap.row.id
        _share_counted(pool, snap, vol)
    pool.commit()
    return vol


def ancestors(pool: Pool, vol: Volume) -> set[int]:
    """Ids of vol and of every volume up its origin chain (as long as they exist)."""
    seen = {vol.row.id}
    current = pool.volume_by_id(vol.row.origin_id)
    while current is not None and current.row.id not in seen:
        seen.add(current.row.id)
        current = pool.volume_by_id(current.row.origin_id)
    return seen


def rollback(pool: Pool, volume: str, snapshot: str) -> None:
    """Make a volume's contents and size those of a snapshot (what it owned alone is freed)."""
    with pool.quiesced(volume, kind="volume") as vol, pool.lock:
        snap = pool.volume(snapshot, kind="snapshot")
        if vol.row.id not in ancestors(pool, snap) and snap.row.id not in ancestors(pool, vol):
            raise ThinblockError(
                f"snapshot {snap.name} is not in the lineage of volume {vol.name}: roll back only to a snapshot"
                " taken of it (or of one of its snapshots), or to the snapshot it was cloned from"
            )
        pool.refuse_if_busy(vol, "roll back")
        if vol.row.reserve_bytes:
            exclusive = vol.fresh_exclusive()
            # After rollback the volume owns nothing alone, at the snapshot's size.
            target = target_blocks(vol.row.reserve_bytes, snap.size_bytes, pool.block_size)
            pool.accounts.check_reservable(vol, target, "roll back", freed=exclusive)
        # Releasing first is safe: the snapshot holds its own reference to every page it uses.
        # Both tables' counts are read before anything changes (a failing read changes nothing).
        pool.txn.load_refcounts([*vol.root.values(), *snap.root.values()])
        pool.txn.release_root(vol)
        pool.share_contents(vol, snap)
        _share_counted(pool, vol, snap)
    pool.commit()


def adopt(
    pool: Pool,
    volume: str,
    staging: Volume,
    snapshot: str | None,
    *,
    verb: str = "import a diff into",
    unchanged_since: Volume | None = None,
) -> Volume | None:
    """Make a volume's contents and size those of a staging volume built beside it
    (import-diff), take the snapshot `snapshot` of the result, and drop the staging
    volume: all in one metadata commit, so a crash leaves the volume as it was or
    as the staging volume made it, never in between. Refused while clients have the
    volume open (they would see its contents change under them); verb names the job
    in that refusal ("cannot import into volume vm: ..."). With unchanged_since (a
    staged snapshot of the volume taken with the staging volume), refused too if the
    volume was written since: adopting would silently discard those writes, which
    their clients were told had been done."""
    with _pool_step(pool):
        with pool.quiesced(volume, kind="volume") as vol, staging.ranges.hold_all(exclusive=True), pool.lock:
            pool.refuse_if_busy(vol, verb)
            if unchanged_since is not None:
                written = sum(n for _, n in changed_ranges(unchanged_since, vol))
                resized = vol.size_bytes != unchanged_since.size_bytes
                if written or resized:
                    what = f"{format_size(written)} differ" if written else ""
                    if resized:
                        sizes = (
                            f"resized from {format_size(unchanged_since.size_bytes)} to {format_size(vol.size_bytes)}"
                        )
                        what = f"{what}, {sizes}" if what else sizes
                    raise ThinblockError(
                        f"cannot {verb} volume {volume}: it was written while the job ran ({what}), and finishing the"
                        " job would discard those writes; nothing was changed: stop the writer and run it again"
                    )
            if snapshot is not None:
                pool.check_new_name(snapshot, "snapshot")
                _weigh(pool, vol, "snapshot")
            pool.txn.load_refcounts([*vol.root.values(), *staging.root.values()])  # before anything changes
            # The pages vol will hold alone once its own are released and staging dropped: the
            # recount below (and staging's release) reads them, so they are read now.
            old = set(vol.root.values())
            pool.txn.load_pages(
                [pid for pid in staging.root.values() if pool.txn.page_refcount(pid) - (pid in old) == 1]
            )
            pool.txn.release_root(vol)
            pool.share_contents(vol, staging)
            pool.drop_volume(staging)
            # vol holds staging's pages alone now, as staging did: counted once, O(its pages)
            # like the share itself.
            pool.accounts.set_exclusive(vol, vol.recount_exclusive())
            snap = share_into(pool, vol, snapshot, "snapshot") if snapshot is not None else None
        pool.commit()
    return snap
