"""The metadata store's contract: what a pool keeps besides its blocks' bytes.

A metadata store holds the superblock (a small dict of JSON values), the
volumes, each volume's root table, the mapping pages and the refcount pages,
and changes them only by `commit()` of one `Transaction`, atomically. It knows
tables and rows, nothing of the block contract. Check, dump, restore and repair
reach it only through this interface: the walk (`volumes`, `all_roots`,
`all_pages`, `refcount_pages`), `integrity_problems` and `replace`.

Implementations: meta/sqlite.py (the embedded default) and meta/memory.py (for
tests). tests/test_meta_contract.py runs the same suite against each.

Ownership per volume (issue 22; meta/owners.py holds the rules both backends
share, tests/test_meta_owners.py their contract). Several owners, in several
processes, may commit to one store at once:

- A volume is changed only by the owner holding its lease (`claim_volume`): a
  lock that dies with its process, and the volume's owner epoch, bumped by every
  claim. A transaction names the leases it writes under (`Transaction.leases`)
  and is refused whole unless every one still holds (the guarded commit), and
  if it changes the row, root table or removal of a volume (or of a snapshot of
  one) that another live lease holds (`owners.check_volume_writes`).
- Counts that owners share (dblock refcount pages, page refcounts, superblock
  counters) are committed as changes, not values: given the base an owner's
  change was made on, the store writes stored + (new - base), so owners never
  overwrite each other's counts. Freeing is checked against committed state: a
  dblock or page this owner drops to zero must be at zero in the store too, or
  the commit is refused. A page others' changes drop to zero is an orphan
  (`orphans`): the fold (a pool-level step) frees its dblocks.
- Free space reaches an owner in grants (`Transaction.grants`) of blocks at
  count zero that no other grant holds; the store refuses any other.
- Pool-level steps (create, remove, snapshot, clone, grants, the fold) run under
  `pool_lock()`, one at a time across processes, and never around data I/O.
  Ids come from `reserve_ids`, in ranges no two owners share.

The RADOS store has them too (meta/rados_leases.py, meta/rados_shared.py) while
its process shares the pool (RadosLocation.own_shared); a process holding a
RADOS pool whole refuses them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from thinblock.errors import PoolBusyError, ThinblockError

# Format 3 added the kept exclusive-block counters (VolumeRow.exclusive_blocks and
# exclusive_epoch, the superblock's sharing_epoch) and allows compact mapping pages;
# older formats are upgraded when opened for writing, newer ones are refused.
FORMAT_VERSION = 3


def check_format(version: object, where: str) -> int:
    """The metadata format, or one sentence refusing one this thinblock does not know."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ThinblockError(f"{where} has metadata format {version!r}, which is not a thinblock format")
    if version > FORMAT_VERSION:
        raise ThinblockError(
            f"{where} has metadata format {version}, newer than this thinblock's {FORMAT_VERSION}:"
            " open it with the thinblock that made it, or a newer one"
        )
    return version


def initial_superblock(superblock: dict[str, Any]) -> dict[str, Any]:
    """A new pool's superblock: the format and transaction 0, then the given keys."""
    return {"format_version": FORMAT_VERSION, "transaction_id": 0, **superblock}


@dataclass
class VolumeRow:
    id: int
    name: str
    size_bytes: int
    detect_zeroes: str
    created: float
    data_blocks: int = 0
    zeroed_blocks: int = 0
    pinned_blocks: int = 0
    kind: str = "volume"  # or "snapshot" (read-only)
    # The volume a snapshot was taken of, the snapshot a clone came from; for a staging
    # volume of an import or import-diff, the volume it will replace (core/reservation.py).
    origin_id: int | None = None
    reserve_bytes: int = 0  # RESERVE_FULL follows the size
    low_water: float | None = None  # percent of the size left unmapped
    on_low_water: str | None = None
    # Mapped blocks this volume holds alone (page and dblock refcount 1): always a lower
    # bound, exact when exclusive_epoch is the pool's sharing_epoch or the count equals
    # the mapped blocks (core/volume.py says how it is kept). -1: never known exactly.
    exclusive_blocks: int = 0
    exclusive_epoch: int = -1


RESERVE_FULL = -1


class VolumeBusyError(PoolBusyError):
    """Another owner holds the volume's lease."""


@dataclass(frozen=True)
class Lease:
    """One owner's hold on one volume: who, and the volume's owner epoch it took."""

    volume_id: int
    owner: str
    epoch: int


@dataclass(frozen=True)
class Grant:
    """Free blocks [start, start + count) handed to the owner of a volume's lease."""

    volume_id: int
    epoch: int
    start: int
    count: int


@dataclass
class Transaction:
    """Everything one commit writes; filled by the pool, applied atomically.

    Without bases every value is absolute (one owner). With a base, the value is
    a change: the store writes stored + (new - base) (meta/owners.py)."""

    superblock: dict[str, object] = field(default_factory=dict)
    volumes: list[VolumeRow] = field(default_factory=list)
    deleted_volumes: list[int] = field(default_factory=list)
    roots: dict[tuple[int, int], int | None] = field(default_factory=dict)  # None deletes
    pages: dict[int, tuple[int, bytes] | None] = field(default_factory=dict)  # None deletes
    refcount_pages: dict[int, bytes] = field(default_factory=dict)
    page_refcounts: dict[int, int] = field(default_factory=dict)  # refcount-only changes (snapshots)
    # Ownership (see the module's docstring): the leases this commit writes under,
    # the bases of shared counts, and grants taken and given back.
    leases: list[Lease] = field(default_factory=list)
    refcount_bases: dict[int, bytes] = field(default_factory=dict)  # refcount page -> blob changed from
    page_ref_bases: dict[int, int] = field(default_factory=dict)  # page -> count changed from
    counter_bases: dict[str, int] = field(default_factory=dict)  # superblock int -> value changed from
    grants: list[Grant] = field(default_factory=list)
    returned_grants: list[Grant] = field(default_factory=list)
    # (volume id, epoch) of leases judged dead (their lock is gone): the store forgets
    # that owner, so that a process still running on one is refused (ESTALE) from now on.
    fenced: list[tuple[int, int]] = field(default_factory=list)

    def shared(self) -> bool:
        """Whether it uses any of the ownership verbs (a one-owner store refuses those)."""
        return bool(
            self.leases
            or self.refcount_bases
            or self.page_ref_bases
            or self.counter_bases
            or self.grants
            or self.returned_grants
            or self.fenced
        )


@dataclass
class CommitResult:
    """What a commit left in the store, for the counts it changed from a base: the
    owner's view of them is refreshed from this (others' changes included)."""

    refcount_pages: dict[int, bytes] = field(default_factory=dict)
    page_refcounts: dict[int, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    orphans: list[int] = field(default_factory=list)  # pages others' changes left at zero


class MetadataStore(ABC):
    """One pool's metadata. Reads may run from several threads at once; commits
    are one at a time (the pool serialises them)."""

    @abstractmethod
    def superblock(self) -> dict[str, Any]:
        """The superblock as of the last commit (format_version, block_size,
        size_bytes, transaction_id and the pool's settings)."""

    @abstractmethod
    def volumes(self) -> list[VolumeRow]:
        """Every volume and snapshot, sorted by name."""

    @abstractmethod
    def roots(self, volume_id: int) -> dict[int, int]:
        """One volume's root table: page index -> page id."""

    @abstractmethod
    def all_roots(self) -> Iterator[tuple[int, int, int]]:
        """(volume id, page index, page id) of every root table entry."""

    @abstractmethod
    def page(self, page_id: int) -> tuple[int, bytes] | None:
        """(refcount, entries blob) of a mapping page, or None if it does not exist."""

    @abstractmethod
    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        """Page id -> refcount of those of page_ids that exist, read in batches without
        their entries (a snapshot shares every page of a volume by their counts alone)."""

    @abstractmethod
    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        """Page id -> (refcount, entries blob) of those of page_ids that exist: page() in
        batches (a snapshot's removal needs the entries of every page it leaves alone)."""

    @abstractmethod
    def all_pages(self) -> Iterator[tuple[int, int, bytes]]:
        """(page id, refcount, entries blob) of every mapping page."""

    @abstractmethod
    def max_page_id(self) -> int:
        """The largest page id ever committed (0 for none): new ids go above it."""

    @abstractmethod
    def max_volume_id(self) -> int:
        """The largest volume id committed (0 for none)."""

    @abstractmethod
    def refcount_pages(self) -> dict[int, bytes]:
        """Refcount page index -> blob of uint32 counts."""

    @abstractmethod
    def commit(self, txn: Transaction) -> CommitResult:
        """Apply the whole transaction atomically, or nothing of it. A failure is an
        OSError (ENOSPC when the layer below is full, else EIO; ESTALE when a lease it
        names was lost) and leaves the store exactly as before; the same transaction
        may be committed again."""

    # ----- ownership per volume (module docstring); one-owner stores refuse ----------

    def _one_owner(self) -> ThinblockError:
        return ThinblockError(f"{type(self).__name__} keeps one owner per pool: it has no per-volume leases")

    def claim_volume(self, volume_id: int, owner: str) -> Lease:
        """Take the volume's lease for owner (a name saying which process, where), its
        epoch one above the last; VolumeBusyError naming the holder if it is held."""
        raise self._one_owner()

    def release_volume(self, lease: Lease) -> None:
        """Give the lease up (its grants should be returned first); a lost one is a no-op.
        The lease is given up even when this raises: a failure leaves at most its record
        naming the owner, which the next claim overwrites (so the owner stops serving
        the volume either way, and two owners never both hold it)."""
        raise self._one_owner()

    def claim_volumes(self, volume_ids: Sequence[int], owner: str) -> dict[int, Lease]:
        """claim_volume for each (a server's start), all or none: VolumeBusyError if
        one is held, and then none is taken. A store may do it in one step."""
        taken: dict[int, Lease] = {}
        try:
            for vid in volume_ids:
                taken[vid] = self.claim_volume(vid, owner)
        except BaseException:
            for lease in taken.values():
                with contextlib.suppress(OSError, ThinblockError):
                    self.release_volume(lease)
            raise
        return taken

    def release_volumes(self, leases: Sequence[Lease]) -> None:
        """release_volume for each (a server's stop), every one tried; the first failure
        is raised after. A store may do it in one step."""
        failed: BaseException | None = None
        for lease in leases:
            try:
                self.release_volume(lease)
            except (OSError, ThinblockError) as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def volume_holder(self, volume_id: int) -> str | None:
        """The owner holding the volume's lease, or None when nobody live holds it."""
        raise self._one_owner()

    def lease_live(self, volume_id: int, epoch: int) -> bool:
        """Whether the lease of that epoch is still held by a live owner."""
        raise self._one_owner()

    def recorded_holders(self) -> dict[int, str]:
        """volume id -> the owner recorded for each lease taken and not given back, in
        one read: a hint for listings of thousands (a holder that died since is still
        named; volume_holder says who lives)."""
        raise self._one_owner()

    def fence_volume(self, volume_id: int) -> str:
        """Take the volume's lease from a holder that does not answer (serve --takeover):
        fence it off so that it can write nothing more, and free the lease for a claim;
        returns who was fenced. A store whose live holder cannot be fenced refuses."""
        raise ThinblockError(f"{type(self).__name__} cannot fence a live holder of a volume off")

    def watch_leases(self, lost: Callable[[int, str], None]) -> None:
        """Have lost(volume id, why) called (from another thread) when a lease this store
        holds is lost while held: on RADOS, once another took it after it lapsed, or this
        client was fenced off. A store whose leases last as long as their process (an
        OFD lock) never calls it."""
        return

    def pool_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held for one pool-level step: one at a time across every owner and process.
        Owners' guarded commits go on meanwhile (their changes commute)."""
        raise self._one_owner()

    def grants(self) -> list[Grant]:
        """Every grant held, live or not."""
        raise self._one_owner()

    def orphans(self) -> list[int]:
        """Pages at refcount zero that still exist: what the fold frees."""
        raise self._one_owner()

    def stale_grants(self) -> list[Grant]:
        """Grants whose lease is gone (its owner died or released without returning them):
        the next pool-level step takes them back, punching what was written into them."""
        return [g for g in self.grants() if not self.lease_live(g.volume_id, g.epoch)]

    def reserve_ids(self, kind: str, count: int) -> int:
        """The first of `count` ids ("page" or "volume") that no owner has or will get
        (a pool-level step: it takes pool_lock(), which a caller may hold already)."""
        if kind not in ("page", "volume") or count < 1:
            raise ValueError(f"reserve_ids({kind!r}, {count})")
        key = f"next_{kind}_id"
        with self.pool_lock():
            stored = self.superblock().get(key)
            high = self.max_page_id() if kind == "page" else self.max_volume_id()
            first = max(int(stored or 0), high + 1)
            self.commit(Transaction(superblock={key: first + count}))
        return first

    @abstractmethod
    def integrity_problems(self) -> list[str]:
        """What the store's own consistency check finds (empty when sound)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; it is unusable afterwards."""
