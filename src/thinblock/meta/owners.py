"""The rules of several owners' commits to one metadata store (meta/base.py's
ownership contract), in one place for every backend that has them.

A store applies a transaction in four steps, all inside its atomic commit:
`check_leases` (the guarded commit), `check_volume_writes` (an owner writes
only what no other lease holds), then each shared count through `counts`
and `refcount_page` (stored + (new - base), with freeing checked against the
stored value), then `check_grants`. Each raises OSError naming what it refused,
and the store then rolls the whole commit back.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable

import numpy as np

from thinblock.meta.base import Grant, Lease, Transaction

REFCOUNT_ENTRIES = 1024  # uint32 counts per refcount page (core/spacemap.py's page)


def refused(message: str, code: int = errno.EIO) -> OSError:
    return OSError(code, f"metadata commit refused: {message}")


def check_leases(leases: Iterable[Lease], current: Callable[[int], tuple[str, int] | None]) -> None:
    """Every lease must be the volume's current one (current: volume id -> the
    (owner, epoch) the store records, None when unowned)."""
    for lease in leases:
        now = current(lease.volume_id)
        if now != (lease.owner, lease.epoch):
            holder = "nobody" if now is None else f"{now[0]} (epoch {now[1]})"
            raise refused(
                f"volume {lease.volume_id}'s lease of epoch {lease.epoch} ({lease.owner}) is lost;"
                f" it is now held by {holder}",
                errno.ESTALE,
            )


# (kind, origin id) of a volume row: what links a snapshot to the volume it was taken of.
Link = tuple[str, int | None]


def check_volume_writes(
    txn: Transaction,
    stored: Callable[[int], Link | None],
    holder: Callable[[int], tuple[str, int] | None],
) -> None:
    """A commit under leases (an owner's) writes no volume row, root table entry or
    removal of a volume that a lease it does not name holds: the core's
    Pool.check_may_change, kept by the store too, so that an owner that bypasses it
    (a bug, a caller of the store itself) changes nothing of another's volume.

    stored: volume id -> its committed (kind, origin id), None when absent; holder:
    volume id -> the (owner, epoch) of the live lease holding it, None when nobody
    live does. Pool-level steps of a process owning no volume (create, remove,
    clone, the fold, a dependent's origin, a stale exclusive count) name no lease
    and are not refused here: their rule is the pool-level lock.

    A snapshot has no lease of its own: its roots and its removal (and a new
    snapshot's row) are the volume's it was taken of, found through the origins of
    snapshots, as core/pool.py's base_volume_id does. An existing snapshot's row
    alone is not: another volume's owner rewrites it legitimately (a clone's
    rollback to the snapshot sets the snapshot's exclusive count to zero).

    Mapping pages are not checked: which volumes hold a page is known only from the
    root tables, which have no index by page id, so telling a page's volumes would
    cost a scan of every root table per commit (meta/sqlite.py); a page no root of
    another's volume names is harmless until a root entry names it, and that is
    checked here."""
    if not txn.leases:
        return
    named = {(lease.volume_id, lease.owner, lease.epoch) for lease in txn.leases}
    new: dict[int, Link] = {row.id: (row.kind, row.origin_id) for row in txn.volumes}
    links: dict[int, Link | None] = {}
    foreign: dict[int, tuple[str, int] | None] = {}

    def committed(vid: int) -> Link | None:
        if vid not in links:
            links[vid] = stored(vid)
        return links[vid]

    def link(vid: int) -> Link | None:  # the committed row first: a rewrite cannot unlink it
        got = committed(vid)
        return got if got is not None else new.get(vid)

    def base(vid: int) -> int | None:
        seen = {vid}
        got = link(vid)
        while got is not None and got[0] == "snapshot":
            origin = got[1]
            if origin is None or origin in seen:
                return None
            seen.add(origin)
            vid, got = origin, link(origin)
        return vid

    def check(vid: int, what: str, *, through_origin: bool = True) -> None:
        for target in {vid, base(vid) if through_origin else vid}:
            if target is None:
                continue
            if target not in foreign:
                now = holder(target)
                foreign[target] = None if now is None or (target, *now) in named else now
            held = foreign[target]
            if held is not None:
                whose = "it is" if target == vid else f"it is a snapshot of volume {target},"
                mine = ", ".join(f"volume {lease.volume_id} (epoch {lease.epoch})" for lease in txn.leases)
                raise refused(
                    f"{what} of volume {vid} is not this owner's to change: {whose} held by {held[0]}"
                    f" (epoch {held[1]}), and this commit names the leases of {mine}",
                    errno.EPERM,
                )

    for row in txn.volumes:
        check(row.id, "the row", through_origin=committed(row.id) is None)  # a new snapshot's: its volume's
    for vid in txn.deleted_volumes:
        check(vid, "the removal")
    for vid in sorted({vid for vid, _index in txn.roots}):
        check(vid, "the root table")


def _counts(blob: bytes | None) -> np.ndarray:
    if not blob:
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(blob, dtype=np.uint32).astype(np.int64)


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate([a, np.zeros(n - len(a), dtype=np.int64)])


def counts_of(blob: bytes | None, n: int) -> np.ndarray:
    """A refcount blob as exactly n int64 counts (missing ones are zero, extra ones cut)."""
    return _padded(_counts(blob), n)[:n]


def refcount_page(
    index: int, stored: bytes | None, new: bytes, base: bytes | None, granted: np.ndarray | None = None
) -> bytes:
    """The refcount page to store. Without a base, new itself. With one, stored +
    (new - base), refused if a count would go below zero, if a dblock this owner
    freed (base > 0, new 0) is still counted by another owner's commit, or if a
    dblock at zero in the store would become counted outside the commit's own grants
    (granted: the page's dblocks in grants of its leases), which is how a block
    could end up in use twice. A stale base is no reason to refuse: a dblock another
    owner counts already may gain references from anyone sharing it."""
    if base is None:
        return new
    if len(new) < len(base):  # a shorter view (the last page of a smaller pool): its tail is unchanged
        new = new + base[len(new) :]
    n = max(len(new), len(base), len(stored or b"")) // 4
    s, b, w = (counts_of(x, n) for x in (stored, base, new))
    result = s + w - b
    first = index * REFCOUNT_ENTRIES
    below = np.flatnonzero(result < 0)
    if below.size:
        raise refused(f"dblock {first + int(below[0])}'s refcount would go below zero (stored {int(s[below[0]])})")
    still = np.flatnonzero((w == 0) & (b > 0) & (result != 0))
    if still.size:
        raise refused(
            f"dblock {first + int(still[0])} is still referenced ({int(result[still[0]])}) by another owner:"
            " this commit may not free it"
        )
    if granted is not None:
        # The mask spans a whole page; a pool smaller than one stores shorter pages.
        mine = _padded(granted.astype(np.int64), n)[:n].astype(bool)
        taken = np.flatnonzero((s == 0) & (result > 0) & ~mine)
        if taken.size:
            raise refused(
                f"dblock {first + int(taken[0])} is free, and in no grant this commit holds: it may not be taken"
            )
    if result.size and int(result.max()) > 0xFFFFFFFF:
        raise refused(f"a refcount of refcount page {index} would overflow")
    return bytes(result.astype(np.uint32).tobytes())


USED = "used_blocks"  # kept by the store itself in shared commits (used_after)


def nonzero_change(stored: bytes | None, result: bytes) -> int:
    """How many more dblocks are counted (nonzero) in result than in stored: what a
    refcount page's change does to the pool's used blocks. Derived here, from the
    counts themselves, because no owner sees a block reach zero through the sum of
    several owners' changes (each drops one of two references on its own view)."""
    n = max(len(result), len(stored or b"")) // 4
    before, after = (counts_of(x, n) for x in (stored, result))
    return int(np.count_nonzero(after)) - int(np.count_nonzero(before))


def used_after(stored: object, change: int) -> int:
    """The pool's used blocks after a shared commit whose refcount pages changed it by change."""
    if not isinstance(stored, int | None):
        raise refused(f"superblock {USED} is not a counter")
    result = int(stored or 0) + change
    if result < 0:
        raise refused(f"superblock {USED} would go below zero")
    return result


def page_count(page_id: int, stored: int | None, new: int, base: int | None, *, deleting: bool) -> int:
    """A mapping page's refcount to store: new without a base, else stored + (new -
    base). A page this commit deletes must reach zero; one with a base must exist."""
    if base is None:
        return new
    if stored is None:
        raise refused(f"mapping page {page_id} changed from count {base} no longer exists")
    result = stored + new - base
    if result < 0:
        raise refused(f"mapping page {page_id}'s refcount would go below zero (stored {stored})")
    if deleting and result != 0:
        raise refused(f"mapping page {page_id} is still referenced ({result}) by another owner: it may not be deleted")
    return result


def counter(key: str, stored: object, new: object, base: int | None) -> object:
    """A superblock value to store: new, or for a counter with a base, stored + (new - base)."""
    if base is None:
        return new
    if key == USED:
        raise refused(f"superblock {USED} is counted by the store in shared commits, not sent as a change")
    if not isinstance(new, int) or not isinstance(stored, int | None):
        raise refused(f"superblock {key} is not a counter")
    result = int(stored or 0) + new - base
    if result < 0:
        raise refused(f"superblock {key} would go below zero")
    return result


def check_grants(
    txn: Transaction,
    held: list[Grant],
    n_blocks: int,
    refcount_of: Callable[[int, int], np.ndarray],
) -> list[Grant]:
    """The grants held after txn: returned ones must be held; new ones must lie in the
    pool, overlap no other grant, and cover only blocks at count zero as committed
    (refcount_of(start, count): the stored counts, this commit's own changes applied)."""
    after = list(held)
    leased = {(lease.volume_id, lease.epoch) for lease in txn.leases}
    for g in txn.returned_grants:
        if g not in after:
            raise refused(f"grant {g.start}+{g.count} of volume {g.volume_id} is not held")
        if (g.volume_id, g.epoch) not in leased and (g.volume_id, g.epoch) not in txn.fenced:
            raise refused(
                f"grant {g.start}+{g.count} is volume {g.volume_id}'s (epoch {g.epoch}): only its holder"
                " returns it, or a recovery that fences its lease"
            )
        after.remove(g)
    for g in txn.grants:
        if g.count < 1 or g.start < 0 or g.start + g.count > n_blocks:
            raise refused(f"grant {g.start}+{g.count} lies outside the pool's {n_blocks} blocks")
        if (g.volume_id, g.epoch) not in leased:
            raise refused(f"grant {g.start}+{g.count} is for volume {g.volume_id} epoch {g.epoch}, not a lease held")
        for other in after:
            if g.start < other.start + other.count and other.start < g.start + g.count:
                raise refused(
                    f"grant {g.start}+{g.count} overlaps volume {other.volume_id}'s grant {other.start}+{other.count}"
                )
        busy = np.flatnonzero(refcount_of(g.start, g.count))
        if busy.size:
            raise refused(f"grant {g.start}+{g.count} covers dblock {g.start + int(busy[0])}, which is in use")
        after.append(g)
    return after


def granted_mask(txn: Transaction, held: Iterable[Grant], index: int) -> np.ndarray:
    """Which dblocks of refcount page `index` lie in a grant of one of txn's leases
    (held before it, or taken by it): where its owner may allocate."""
    leased = {(lease.volume_id, lease.epoch) for lease in txn.leases}
    first = index * REFCOUNT_ENTRIES
    mask = np.zeros(REFCOUNT_ENTRIES, dtype=bool)
    for g in [*held, *txn.grants]:
        if (g.volume_id, g.epoch) in leased:
            lo, hi = max(g.start, first), min(g.start + g.count, first + REFCOUNT_ENTRIES)
            if lo < hi:
                mask[lo - first : hi - first] = True
    return mask


def refcounts_in(pages: dict[int, bytes], start: int, count: int) -> np.ndarray:
    """Counts of dblocks [start, start + count) from refcount pages (absent: zero)."""
    out = np.zeros(count, dtype=np.int64)
    for index in range(start // REFCOUNT_ENTRIES, (start + count - 1) // REFCOUNT_ENTRIES + 1):
        counts = _counts(pages.get(index))
        base = index * REFCOUNT_ENTRIES
        lo, hi = max(start, base), min(start + count, base + REFCOUNT_ENTRIES)
        got = counts[lo - base : hi - base]
        out[lo - start : lo - start + len(got)] = got
    return out


def refcount_pages_for(start: int, count: int) -> range:
    return range(start // REFCOUNT_ENTRIES, (start + count - 1) // REFCOUNT_ENTRIES + 1)


def absolute(
    txn: Transaction,
    superblock: dict[str, object],
    pages: dict[int, tuple[int, bytes] | None],
    refcount_pages: dict[int, bytes],
    page_refcounts: dict[int, int],
) -> Transaction:
    """txn once its shared counts are resolved (the values to store, stored + new -
    base): what a one-owner commit writes, with no ownership verb left in it."""
    return Transaction(
        superblock=superblock,
        volumes=txn.volumes,
        deleted_volumes=txn.deleted_volumes,
        roots=txn.roots,
        pages=pages,
        refcount_pages=refcount_pages,
        page_refcounts=page_refcounts,
    )
