"""The pool: thin volumes sharing physical space, and the administration of them.

A Pool is opened on a Location (backends/): its metadata store, its data store
(under the one fallback layer) and its ownership. Its parts live in their own
modules: the commit pipeline (commit.py), space and reservations (space.py),
out-of-space policy events (space_policy.py); the block contract itself is in
volume.py. This module keeps the registry of volumes and the administration
verbs, which take a volume's whole range (rangelock) before the pool lock, and
commit with neither held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from thinblock.backends import Location, Ownership, locate
from thinblock.core.commit import Committer
from thinblock.core.mapping import PAGE_ENTRIES
from thinblock.core.owner import VolumeOwner, owner_name
from thinblock.core.pool_settings import grow_shared, set_policy_shared
from thinblock.core.pool_steps import grant_figures, pool_room, recover_stale_grants, reservation_claims
from thinblock.core.registry import STAGING_PREFIX, VolumeRegistry
from thinblock.core.reservation import replaced_id, target_blocks
from thinblock.core.space import SpaceAccounts
from thinblock.core.space_policy import SpacePolicy, parse_low_water
from thinblock.core.spacemap import SpaceMap
from thinblock.core.transaction import OpenTransaction
from thinblock.core.volume import Volume
from thinblock.errors import CorruptionError, OpError, PoolBusyError, ThinblockError, UncleanCloseError, UsageError
from thinblock.meta.base import (
    FORMAT_VERSION,
    RESERVE_FULL,
    Lease,
    MetadataStore,
    Transaction,
    VolumeRow,
    check_format,
)
from thinblock.progress import ProgressFn
from thinblock.runtime import require_socket_room
from thinblock.sizes import format_exact, format_size
from thinblock.stats import PoolStats
from thinblock.steps import Step, timed
from thinblock.store.base import DataStore
from thinblock.store.fallback import FallbackStore
from thinblock.store.file import FileStore
from thinblock.store.owned import OwnedStore, claim, device_pool_limit

DEFAULT_BLOCK_SIZE = 64 << 10
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 16 << 20
SECTOR_BYTES = 512
# Largest volume: loff_t (FUSE, loop) and qemu's int64 sizes cap at 2**63 - 1; stay a
# multiple of the largest block size below that.
MAX_VOLUME_BYTES = (1 << 63) - MAX_BLOCK_SIZE
MAX_VOLUME_SHOWN = "8E less 16M"  # MAX_VOLUME_BYTES in words (format_size would round it to 8.0E)
DETECT_ZEROES = ("off", "on", "unmap")
log = logging.getLogger("thinblock.pool")
_T = TypeVar("_T")
# Matched whole (fullmatch): "$" would also match before a trailing newline.
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
# Snapshots may also use '@', so that they can be named like rbd's (vm1@s1); volume
# names never contain it, so VOLUME@SNAP cannot be mistaken for a volume.
_SNAPSHOT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@-]{0,127}")


def validate_name(name: str, kind: str = "volume") -> None:
    if not (_SNAPSHOT_NAME_RE if kind == "snapshot" else _NAME_RE).fullmatch(name):
        extra = ", '@'" if kind == "snapshot" else ""
        raise ThinblockError(
            f"invalid {kind} name {name!r}: use 1-128 letters, digits, '_', '.', '+', '-'{extra},"
            " not starting with '.', '+' or '-'"
        )


def validate_volume_size(size_bytes: int) -> None:
    if size_bytes <= 0 or size_bytes % SECTOR_BYTES:
        raise ThinblockError(
            f"invalid volume size {format_exact(size_bytes)}: must be a positive multiple of {SECTOR_BYTES} bytes"
        )
    if size_bytes > MAX_VOLUME_BYTES:
        raise ThinblockError(
            f"volume size {format_size(size_bytes)} is beyond the largest thinblock supports ({MAX_VOLUME_SHOWN})"
        )


def volume_dict(row: VolumeRow, block_size: int, origin: str | None) -> dict[str, Any]:
    """A volume's figures as of its row (counters kept per commit)."""
    return {
        "name": row.name,
        "kind": row.kind,
        "origin": origin,
        "size_bytes": row.size_bytes,
        "mapped_bytes": (row.data_blocks + row.zeroed_blocks) * block_size,
        "data_bytes": row.data_blocks * block_size,
        "zeroed_bytes": row.zeroed_blocks * block_size,
        "provisioned_bytes": row.pinned_blocks * block_size,
        "detect_zeroes": row.detect_zeroes,
        "reserve": "full" if row.reserve_bytes == RESERVE_FULL else row.reserve_bytes,
        "low_water_percent": row.low_water,
        "created": row.created,
    }


def read_status(locator: str) -> dict[str, Any]:
    """Committed figures without owning the pool (mkfs reads these while the pool is attached)."""
    meta = locate(locator).open_meta(readonly=True)
    try:
        sb = meta.superblock()
        rows = meta.volumes()
        names = {r.id: r.name for r in rows}
        bs = int(sb["block_size"])
        used = int(sb["used_blocks"]) * bs
        return {
            "size_bytes": int(sb["size_bytes"]),
            "block_size": bs,
            "used_bytes": used,
            "free_bytes": int(sb["size_bytes"]) - used,
            "volumes": [volume_dict(r, bs, names.get(r.origin_id or 0)) for r in rows],
        }
    finally:
        meta.close()


def check_data_size(store: DataStore, size_bytes: int, data_name: str) -> None:
    """A data store shorter than the pool would serve its missing tail as zeros: refuse."""
    have = store.size_bytes
    if have < size_bytes:
        raise CorruptionError(
            f"data store {data_name} holds {format_size(have)} but the pool is {format_size(size_bytes)}:"
            " it was truncated or replaced. Refusing to serve what it lost as zeros; put the right file back,"
            " or run 'thinblock pool repair' to extend it and drop the mappings it lost"
        )


def _holds_grants(meta: MetadataStore) -> bool:
    """Whether grants are left in the store (dead owners'): the whole pool's owner then
    takes them back, and punches the free space they held."""
    try:
        stale = meta.grants()
    except ThinblockError:  # a store with one owner per pool has none
        return False
    if stale:
        recover_stale_grants(meta)
    return bool(stale)


def _format_owner(location: Location) -> None:
    """A new pool's data store gets its owner header (generation 0) and an empty birth table."""
    meta = location.open_meta(readonly=True)  # as the backend wrote it (RADOS adds the data prefix)
    try:
        sb = meta.superblock()
    finally:
        meta.close()
    store = location.owned_store(sb, location.open_data(sb))
    try:
        tid = int(sb["transaction_id"])
        store.format(
            store.fresh_layout(int(sb["size_bytes"]), str(sb["pool_uuid"]), location.data_owner(), tid, since=0)
        )
        store.flush()
    finally:
        store.close()


@contextlib.contextmanager
def owned(locator: str | Location, purpose: str) -> Iterator[Location]:
    """Own a pool without opening it (restore, repair): refused while it is served."""
    location = locate(locator)
    ownership = location.own(purpose)
    try:
        yield location
    finally:
        ownership.release()


class Pool:
    """An open pool. Use `Pool.create` / `Pool.open`. Volumes' verbs, commit() and
    the administration methods may be called from any thread.

    It is made of collaborators that each hold one rule: the open transaction
    (core/transaction.py: pages, dirty sets, page refcounts), the committer that
    makes it durable (core/commit.py), the space accounts (core/space.py: the free
    map, reservations, the allocation gate) and the volume registry
    (core/registry.py). The pool itself keeps the administration verbs, which take
    a volume's whole range (rangelock) before the pool lock, and commit with
    neither held."""

    def __init__(
        self,
        location: Location,
        meta: MetadataStore,
        store: DataStore,
        ownership: Ownership,
        *,
        autocommit: bool,
        progress: ProgressFn | None = None,
        owned: OwnedStore | None = None,
        adopted_uuid: str | None = None,
        leases: dict[int, Lease] | None = None,
        owner_label: str = "",
    ) -> None:
        self.location = location
        self.path = location.name
        self.meta = meta
        self.store = store
        self.owned = owned
        self._ownership = ownership
        # Held to plan and to publish requests, to build and settle commits; never
        # across data I/O or a sync (see volume.py and commit.py).
        self.lock = threading.RLock()
        # volume id -> when this owner handed it over (give_up): a server claiming volumes
        # nobody holds leaves it to its taker a while (frontends/nbd/workers.py).
        self.handed_over: dict[int, float] = {}
        self.stats = PoolStats()  # commits, ENOSPC results, requests per export (metrics)
        sb = meta.superblock()
        self.block_size = int(sb["block_size"])
        size_bytes = int(sb["size_bytes"])
        stored_counts = meta.refcount_pages()
        space = SpaceMap(size_bytes // self.block_size, stored_counts)
        space.sharing_epoch = int(sb.get("sharing_epoch") or 0)
        # Owner mode (core/owner.py): this process owns only the volumes it holds leases
        # of, and shares the pool with other owners; None: it owns the whole pool.
        self.owner: VolumeOwner | None = None
        if leases is not None:
            self.owner = VolumeOwner(self, owner_label)
            self.owner.adopt(leases)
            space.allocate_from_grants(stored_counts)
            owned = self.owned = None  # the data store's header and birth table are the whole-pool owner's
        del stored_counts
        self.txn = OpenTransaction(meta, space, self.volume_by_id, shared=self.owner is not None)
        self.host = location.host(sb)
        self.host.take_slack()
        self.data_path = location.data_name(sb)
        self.policy = SpacePolicy(self, sb)
        self.accounts = SpaceAccounts(
            path=self.path,
            lock=self.lock,
            block_size=self.block_size,
            size_bytes=size_bytes,
            space=space,
            store=store,
            host=self.host,
            data_path=self.data_path,
            txn=self.txn,
            policy=self.policy,
            commit=self.commit,
            kick_commit=self.kick_commit,
            commit_failure=lambda: self.committer.commit_failure,
        )
        self.committer = Committer(
            path=self.path,
            lock=self.lock,
            meta=meta,
            store=store,
            owned=owned,
            txn=self.txn,
            accounts=self.accounts,
            policy=self.policy,
            host=self.host,
            stats=self.stats,
            transaction_id=int(sb["transaction_id"]),
        )
        self._next_volume_id = meta.max_volume_id() + 1
        if self.owner is not None:
            self.committer.leases = self.owner.leases
            self.committer.fold_orphans = self.owner.fold
            self.committer.give_back_idle = self.owner.give_back_idle
            self.committer.sharing_base = space.sharing_epoch
            self.accounts.owner = self.owner
            self.txn.reserve_page_ids = lambda count: self.meta.reserve_ids("page", count)
            self.txn.top_up_page_ids(self.lock)  # ids ready before the first request
            # Volume ids from now on come from reserve_ids: its counter starts above every
            # id ever used here, so an id a removed volume had is never given again (a
            # row another owner still holds in memory by that id would be overwritten).
            meta.reserve_ids("volume", 1)
        # Root tables load on first use (Volume.root), not all of them here.
        self.volumes = VolumeRegistry(
            (Volume(self, row) for row in meta.volumes()), retally=self.accounts.retally_set_aside
        )
        for vol in self.volumes.values():
            self.accounts.retally_set_aside(vol)
        for vol in list(self.volumes.values()):  # a staging volume left behind (dropped at open)
            replaced = self.volume_by_id(replaced_id(vol.row))
            if replaced is not None:
                self.accounts.stand_in(vol, replaced)
        # dblocks of ZEROED blocks that a failed write may have reached: they may not
        # read zero below, so the next write into one writes the whole block.
        self.unclean_zeroed: set[int] = set()
        self.warnings: list[str] = []  # for the person who opened it (pool create, grow)
        # Told (name, new size) once a volume's new size is committed, with no lock held:
        # whoever shows the volumes elsewhere (a FUSE mount and the loop devices on its
        # files, fuse/fs.py). What each returns are warnings for the command that resized.
        self.size_watchers: list[Callable[[str, int], list[str]]] = []
        if self.owner is not None:
            # Free blocks are punched by whoever is granted them, so an owner needs no scan
            # of free space; its volumes' ZEROED blocks are zeroed again. The pool stays
            # marked unclean: an owner never punches what it freed outside its grants, so
            # whoever next opens the whole pool punches free space first.
            self.owner.rezero()
            self.committer.write_metadata(Transaction(superblock={"clean": False}))
            if autocommit:
                self.start_committer()
            return
        had_grants = _holds_grants(meta)  # owners per volume were here: punch free space first
        if not sb.get("clean", True) or had_grants:
            self.committer.recover_free_space(progress)
        # An older pool is upgraded by this first commit (SQLite migrated its tables on
        # opening; rows of other stores read the new fields' defaults).
        opened: dict[str, object] = {"clean": False, "format_version": FORMAT_VERSION}
        if adopted_uuid is not None:  # an older pool's data store got its header: name it here
            self.store.flush()
            opened["pool_uuid"] = adopted_uuid
        self.committer.write_metadata(Transaction(superblock=opened))
        if owned is not None:  # a generation a crash kept from the data store: record it now
            owned.write_header(self.committer.transaction_id)
        if autocommit:
            self.start_committer()

    # ----- the collaborators' figures and verbs, for frontends and commands -------------

    @property
    def size_bytes(self) -> int:
        return self.accounts.size_bytes

    @property
    def commit_failure(self) -> str | None:
        """Why commits fail, while they do (None when they succeed)."""
        return self.committer.commit_failure

    def commit(self) -> None:
        """Make everything completed so far durable (Committer.commit)."""
        self.committer.commit()

    def flush(self) -> None:
        self.committer.commit()

    def kick_commit(self) -> None:
        """Commit soon rather than within the interval (freed space the host needs)."""
        self.committer.kick_commit()

    def between_commits(self, read: Callable[[MetadataStore], _T]) -> _T:
        """Run read on the metadata store while no commit runs (Committer.between_commits)."""
        return self.committer.between_commits(read)

    def space_figures(self) -> dict[str, int]:
        return self.accounts.space_figures()

    def host_figures(self) -> dict[str, Any]:
        return self.accounts.host_figures()

    def grow(self, size_bytes: int, *, commit: bool = True) -> list[str]:
        """Grow the pool online (SpaceAccounts.grow; per volume, a pool-level step)."""
        if self.owner is not None:
            return grow_shared(self, size_bytes)
        return self.accounts.grow(size_bytes, commit=commit)

    def settle_frees(self) -> None:
        self.accounts.settle_frees()

    def wake_space_waiters(self) -> None:
        self.accounts.wake_space_waiters()

    def cancel_waits(self) -> None:
        """Shutting down: requests held by the wait policy get ENOSPC now."""
        self.accounts.cancel_waits()

    def start_writeback(self) -> None:
        """Bulk work's hint to the data store: start writing out what it holds dirty
        (DataStore.start_writeback), so the next commit's sync waits for little."""
        self.store.start_writeback()

    def start_committer(self) -> None:
        """Commit in the background, at least once a second (a pool opened without
        autocommit, by a command, takes this for long work: the data written so far
        goes to disk while more is written, instead of all in the final sync)."""
        self.committer.start()

    # ----- opening and creating -------------------------------------------------

    @classmethod
    def create(
        cls,
        locator: str | Location,
        size_bytes: int | None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        data_path: str | None = None,
        object_size: int | None = None,
    ) -> Pool:
        """Make a new pool (a directory with a sparse data file, or over a raw device;
        or wherever the locator's backend puts it) and open it. All or nothing."""
        location = locate(locator)
        if block_size < MIN_BLOCK_SIZE or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
            raise ThinblockError(
                f"invalid block size {format_exact(block_size)}: must be a power of two from {format_size(MIN_BLOCK_SIZE)}"
                f" to {format_size(MAX_BLOCK_SIZE)}"
            )
        if location.exists():
            raise ThinblockError(f"a pool already exists at {location.name}")
        runtime = location.runtime_path()
        if runtime is not None:  # a pool that could be made but never served is refused now
            require_socket_room(runtime, location.shorter_runtime_path)
        if object_size is not None and not location.takes_object_size:
            raise ThinblockError("--object-size applies to pools in Ceph (rados:CEPHPOOL/NAME)")
        if data_path is not None:
            data_path = os.path.abspath(data_path)
            probe = FileStore(data_path, readonly=True)
            device_bytes = probe.size_bytes
            probe.close()
            limit = device_pool_limit(device_bytes, block_size)  # the rest holds the owner header
            if size_bytes is None:
                size_bytes = limit
            elif size_bytes > limit:
                raise ThinblockError(
                    f"--size {format_size(size_bytes)} exceeds what {data_path} ({format_size(device_bytes)}) holds"
                    f" beside the pool's header and birth table ({format_size(limit)})"
                )
        if size_bytes is None:
            raise UsageError(
                "pool create needs --size (only a pool over a device or file given with --data takes its size)"
            )
        if size_bytes < block_size or size_bytes % block_size:
            raise ThinblockError(
                f"invalid pool size {format_size(size_bytes)}: must be a positive multiple of the block size"
                f" ({format_size(block_size)}), at least one block"
            )
        superblock = {
            "pool_uuid": uuid.uuid4().hex,
            "block_size": block_size,
            "size_bytes": size_bytes,
            "page_entries": PAGE_ENTRIES,
            "data_path": data_path,
            "used_blocks": 0,
            "created": time.time(),
            "clean": True,
        }
        if object_size is not None:
            superblock["object_size"] = object_size
        location.create(superblock, size_bytes, data_path)
        try:
            _format_owner(location)
            pool = cls.open(location)
        except BaseException:
            location.remove_created()
            raise
        warning = pool.host.capacity_warning(size_bytes, pool.data_path)
        if warning:
            pool.warnings.append(warning)
        return pool

    @classmethod
    def open(
        cls,
        locator: str | Location,
        *,
        autocommit: bool = True,
        purpose: str = "",
        takeover: bool = False,
        progress: ProgressFn | None = None,
        volumes: list[str] | None = None,
    ) -> Pool:
        """Open a pool for reading and writing; only one process may own it so.

        purpose ("thinblock serve", ...) is what a refused second opener is told;
        takeover fences a live holder off first (pools in Ceph); progress is told how
        the recovery after an unclean shutdown goes, when there is one. With volumes,
        own only those (their leases), sharing the pool with other such owners
        (core/owner.py); an empty list owns none (pool-level steps only)."""
        location = locate(locator)
        try:
            with timed(log, f"pool {location.name}: opening") as step:
                if volumes is not None:
                    return cls._open_shared(location, autocommit, purpose, volumes, step)
                return cls._open(location, autocommit, purpose, takeover, progress, step)
        except OSError as exc:
            if isinstance(exc, OpError):  # the pool's own errors are sentences already
                raise
            # The layer below failed while opening (EIO from the disk, a commit of
            # the metadata refused): one sentence, and the pool as it was.
            raise ThinblockError(
                f"cannot open pool {location.name}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename else "")
                + "; the storage under it fails (see the system log), nothing was changed"
            ) from None

    @classmethod
    def _open(
        cls,
        location: Location,
        autocommit: bool,
        purpose: str,
        takeover: bool,
        progress: ProgressFn | None,
        step: Step,
    ) -> Pool:
        meta = location.open_meta(readonly=False)
        step.mark("metadata opened")
        try:
            ownership = location.own(purpose, takeover=takeover)
        except BaseException:
            meta.close()
            raise
        step.mark("ownership taken")
        try:
            sb = meta.superblock()
            check_format(sb.get("format_version"), f"pool {location.name}")  # before anything is written
            owned = location.owned_store(sb, location.open_data(sb))
            store = FallbackStore(owned)
            try:
                data_name = location.data_name(sb)
                check_data_size(store, int(sb["size_bytes"]), data_name)  # a truncation says so first
                adopted = claim(owned, sb, location.data_owner(), location.name, data_name)
                check_data_size(store, int(sb["size_bytes"]), data_name)  # blocks end where the tail begins
                owned.clear_interrupted_grow(int(sb["size_bytes"]))
                step.mark("data store opened")
                pool = cls(
                    location,
                    meta,
                    store,
                    ownership,
                    autocommit=autocommit,
                    progress=progress,
                    owned=owned,
                    adopted_uuid=adopted,
                )
            except BaseException:
                store.close()
                raise
        except BaseException:
            meta.close()
            ownership.release()
            raise
        step.mark("metadata loaded")
        try:
            pool._drop_stale_staging()
        except BaseException:
            pool.close()
            raise
        return pool

    @classmethod
    def _open_shared(cls, location: Location, autocommit: bool, purpose: str, names: list[str], step: Step) -> Pool:
        meta = location.open_meta(readonly=False)
        try:
            ownership = location.own_shared(purpose)
        except BaseException:
            meta.close()
            raise
        leases: dict[int, Lease] = {}
        try:
            sb = meta.superblock()
            check_format(sb.get("format_version"), f"pool {location.name}")
            if sb.get("pool_uuid") is None:
                raise ThinblockError(f"pool {location.name} was made by an older thinblock: serve it whole once first")
            rows = {row.name: row for row in meta.volumes()}
            ids: dict[str, int] = {}
            for name in dict.fromkeys(names):
                row = rows.get(name)
                if row is None or name.startswith(STAGING_PREFIX):
                    raise ThinblockError(f"no volume {name!r} in pool {location.name}")
                if row.kind != "volume":
                    raise ThinblockError(
                        f"{name!r} is a {row.kind}, not a volume: a snapshot is served by the server of the volume it was taken of"
                    )
                ids[name] = row.id
            label = owner_name(purpose)
            # Under the pool-level lock: a command's step that found these volumes unheld
            # has committed by then, and what is loaded below is what it left.
            with meta.pool_lock():
                leases = VolumeOwner.claim(meta, ids, label)
            step.mark("leases taken")
            owned = location.owned_store(sb, location.open_data(sb))
            store = FallbackStore(owned)
            try:
                data_name = location.data_name(sb)
                check_data_size(store, int(sb["size_bytes"]), data_name)
                claim(owned, sb, location.data_owner(), location.name, data_name)  # a check only: it has a uuid
                pool = cls(
                    location,
                    meta,
                    store,
                    ownership,
                    autocommit=autocommit,
                    owned=owned,
                    leases=leases,
                    owner_label=label,
                )
            except BaseException:
                store.close()
                raise
        except BaseException:
            for lease in leases.values():
                with contextlib.suppress(Exception):
                    meta.release_volume(lease)
            meta.close()
            ownership.release()
            raise
        step.mark("metadata loaded")
        assert pool.owner is not None
        try:
            pool.owner.drop_stale_staging()
        except (OSError, ThinblockError) as exc:  # left for the next open
            log.warning("pool %s: removing staging volumes left by interrupted jobs failed: %s", pool.path, exc)
        return pool

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- volumes ----------------------------------------------------------------

    def volume(self, name: str, *, kind: str | None = None) -> Volume:
        """The volume or snapshot called name; with kind, it must be of that kind."""
        vol = self.volumes.get(name)
        if vol is None:
            raise ThinblockError(f"no {kind or 'volume'} {name!r} in pool {self.path}")
        if kind is not None and vol.row.kind != kind:
            raise ThinblockError(f"{name!r} is a {vol.row.kind}, not a {kind}")
        return vol

    def visible(self) -> dict[str, Volume]:
        """The volumes and snapshots clients and commands see: all but staging ones."""
        return {name: v for name, v in self.volumes.items() if not name.startswith(STAGING_PREFIX)}

    def visible_volume(self, name: str) -> Volume | None:
        """The volume or snapshot called name, unless it is a staging one (or missing)."""
        return None if name.startswith(STAGING_PREFIX) else self.volumes.get(name)

    def give_up(self, name: str, hang_up: Callable[[Volume], int]) -> int:
        """An owner per volume hands one of its volumes over (`serve --volume NAME
        --takeover` elsewhere asked): no new client may open it from now on, hang_up
        ends those it has (the NBD server's, letting their requests finish; how many),
        what it wrote is committed, its grants go back, its lease is released; the
        other volumes are not touched. On failure it is served here as before."""
        vol = self.volume(name, kind="volume")
        owner = self.owner
        if owner is None or not owner.owns(vol):
            raise ThinblockError(f"volume {name} is not this server's to hand over")
        owner.leave(vol.row.id)
        owner.quiesce_prefetch()  # a grant taken ahead of need under vol's lease: in, or not at all
        try:
            clients = hang_up(vol)
            clients += hang_up(vol)  # one that opened it while the first were hung up
            with self.pool_step(), vol.ranges.hold_all(exclusive=True):
                owner.release_volume(vol.row.id)
                with self.lock:  # its set-aside is kept by the grant steps from now on
                    self.accounts.retally_set_aside(vol)
        except BaseException:
            owner.stay(vol.row.id)
            owner.allow_prefetch()
            raise
        owner.allow_prefetch()
        # What this owner's grants kept for the volume's reservation is the next holder's:
        # the free space must hold it again, so whole idle grants go back now, margin none.
        owner.give_back_idle(margin=False)
        self.handed_over[vol.row.id] = time.monotonic()
        log.info("pool %s: volume %s handed over (%d client(s) closed)", self.path, name, clients)
        return clients

    def watch_ownership_lost(self, lost: Callable[[str], None]) -> None:
        """lost(why) is called if this process's hold on the pool is lost while it runs
        (a Ceph pool held whole, taken over from it: backends/base.py Ownership.watch_lost)."""
        self._ownership.watch_lost(lost)

    def claim_volume(self, name: str) -> Volume:
        """An owner per volume takes the lease of a volume nobody holds and serves it from
        now on, as if it had been claimed at open (core/claim.py); VolumeBusyError naming
        the holder otherwise. A claim that fails releases the lease."""
        from thinblock.core.claim import claim_volume  # it builds on this module

        return claim_volume(self, name)

    def serves(self, vol: Volume) -> bool:
        """Whether this process serves vol: every volume when it owns the whole pool; an
        owner per volume serves its own volumes and the snapshots taken of them."""
        owner = self.owner
        if owner is None:
            return True
        if owner.owns(vol):
            return True
        if vol.row.kind != "snapshot":
            return False
        base = self.base_volume_id(vol)
        return base is not None and owner.owns_id(base)

    def served_elsewhere(self, vol: Volume) -> str:
        """Why this process does not serve vol, naming who does when the store knows."""
        try:
            holder = self.meta.volume_holder(vol.row.id)
        except (OSError, ThinblockError):
            holder = None
        where = f"it is served by {holder}" if holder else "no server holds it now"
        return f"{vol.row.kind} {vol.name} is not served here ({self.owner.name if self.owner else ''}): {where}"

    def staging_name(self, purpose: str) -> str:
        """A fresh name for a staging volume (snapshot.stage): one no user name can be."""
        return f"{STAGING_PREFIX}{purpose}.{self._next_volume_id}"

    def _drop_stale_staging(self) -> None:
        for name in [n for n in self.volumes if n.startswith(STAGING_PREFIX)]:
            log.info("pool %s: removing staging volume %s left by an interrupted command", self.path, name)
            self.remove_volume(name)

    def volume_by_id(self, volume_id: int | None) -> Volume | None:
        """The volume or snapshot with this id (None for None or a removed one): O(1)."""
        return None if volume_id is None else self.volumes.by_id.get(volume_id)

    def create_volume(self, name: str, size_bytes: int, *, detect_zeroes: str = "on") -> Volume:
        validate_volume_size(size_bytes)
        if detect_zeroes not in DETECT_ZEROES:
            raise ThinblockError(f"invalid detect_zeroes {detect_zeroes!r}: use one of {', '.join(DETECT_ZEROES)}")
        with self.lock:
            vol = self.add_volume(name, size_bytes, detect_zeroes)
        self.commit()
        return vol

    @contextlib.contextmanager
    def quiesced(self, name: str, *, kind: str | None = None, exclusive: bool = True) -> Iterator[Volume]:
        """The volume with its whole range held: no request on it is in flight, and
        (exclusive) none starts. Take the pool lock inside, never around this."""
        vol = self.volume(name, kind=kind)
        self.check_may_change(vol)
        with vol.ranges.hold_all(exclusive=exclusive):
            if vol.removed:
                raise ThinblockError(f"no {kind or 'volume'} {name!r} in pool {self.path}")
            yield vol

    def add_volume(
        self,
        name: str,
        size_bytes: int,
        detect_zeroes: str,
        *,
        sharing: Volume | None = None,
        kind: str = "volume",
        staging: bool = False,
    ) -> Volume:
        """A new, empty volume row; with `sharing`, holding that volume's contents (see share_contents).
        The name is checked before any page reference is taken (staging names are the pool's own)."""
        if not staging:
            self.check_new_name(name, kind)
        elif name in self.volumes:
            raise ThinblockError(f"staging volume {name} exists already")
        if sharing is not None:  # the one store read of a share: a failure leaves nothing behind
            self.txn.load_refcounts(sharing.root.values())
        if self.owner is not None:  # an id no other owner gets
            self._next_volume_id = self.meta.reserve_ids("volume", 1)
            if staging:  # a job's: held by this owner from before its row exists
                self.owner.claim_staging(self._next_volume_id)
        row = VolumeRow(self._next_volume_id, name, size_bytes, detect_zeroes, time.time(), kind=kind)
        self._next_volume_id += 1
        vol = Volume(self, row, {})
        self.volumes[name] = vol
        self.volumes.tally(vol, True)
        self.txn.mark_volume_dirty(vol)
        if sharing is not None:
            self.share_contents(vol, sharing)
        return vol

    @contextlib.contextmanager
    def pool_step(self) -> Iterator[None]:
        """Around an administration verb: for an owner per volume, the store's pool-level
        lock, so that steps of several owners (names, ids, shares) run one at a time;
        nothing for the whole pool's owner."""
        if self.owner is None:
            yield
            return
        with self.meta.pool_lock():
            try:
                yield
            finally:
                self.accounts.pool_room = None  # the room catch_up found holds only in this step

    def counts_current(self) -> bool:
        """Whether this process's view of the shared counts is the store's: always for
        the whole pool's owner; for an owner per volume, only inside a pool-level step
        after catch_up (others' commits move them meanwhile)."""
        return self.owner is None or self.accounts.pool_room is not None

    def catch_up(self) -> None:
        """An owner per volume, at a pool-level step: its views of the shared counts (block
        and page refcounts) follow the store's, between commits, so that what the step
        decides (free a page, share it, copy it) counts what every owner committed."""
        if self.owner is None:
            return

        owner = self.owner

        def follow(meta: MetadataStore) -> None:
            stored = meta.refcount_pages()
            # What a reservation this step grows may take (SpaceAccounts.check_reservable).
            room = pool_room(meta, owner.name, stored)
            with self.lock:
                self.accounts.space.refresh(stored)
                self.txn.catch_up()
                self.accounts.pool_room = room

        self.between_commits(follow)

    def base_volume_id(self, vol: Volume) -> int | None:
        """The volume a snapshot was taken of, through snapshots of snapshots (its owner
        owns it); a volume's own id; None when the chain ends at a removed one."""
        seen: set[int] = set()
        while vol.row.kind == "snapshot":
            origin = self.volume_by_id(vol.row.origin_id)
            if origin is None or origin.row.id in seen:
                return None
            seen.add(origin.row.id)
            vol = origin
        return vol.row.id

    def check_may_change(self, vol: Volume) -> None:
        """An owner per volume changes only what is its own: its volumes, the snapshots
        taken of them; and, owning no volume at all (a command's pool-level step, under
        the pool-level lock), what no live owner holds. Otherwise PoolBusyError naming
        the owner (the command line sends the verb there instead: admin/access.py)."""
        owner = self.owner
        if owner is None or owner.owns(vol):
            return
        origin = self.base_volume_id(vol) if vol.row.kind == "snapshot" else None
        if origin is not None and origin in owner.owned_ids():
            return
        if vol.name.startswith(STAGING_PREFIX) and not self.meta.volume_holder(vol.row.id):
            # A staging volume left by a job that died (its maker held its lease): any
            # step may remove it, unless the volume it was staged from is another's.
            origin = origin if origin is not None and self.meta.volume_holder(origin) else None
            if origin is None:
                return
        if not owner.owned_ids():
            held = [vid for vid in (vol.row.id, origin) if vid is not None and self.meta.volume_holder(vid)]
            if not held:
                return
        raise PoolBusyError(self.served_elsewhere(vol).replace("is not served here", "cannot be changed here"))

    def _refuse_foreign_dependents(self, vol: Volume) -> None:
        """An owner per volume removes a volume only when it may rewrite the rows of all
        that came from it (their origin becomes none): none is another live owner's,
        and none was made since it opened (its view of those rows would be stale)."""
        owner = self.owner
        if owner is None:
            return
        for row in self.meta.volumes():
            if row.origin_id != vol.row.id or row.name.startswith(STAGING_PREFIX):
                continue
            known = self.volume_by_id(row.id)
            holder = self.meta.volume_holder(row.id)
            if known is None or (holder is not None and not owner.owns(known)):
                raise PoolBusyError(
                    f"cannot remove {vol.row.kind} {vol.name} here: {row.kind} {row.name}, which came from it,"
                    f" is {'served by ' + holder if holder else 'newer than this server'}; remove it with the pool"
                    " served whole, or remove that one first"
                )

    def check_new_name(self, name: str, kind: str = "volume") -> None:
        """A name a new volume or snapshot may take, or ThinblockError."""
        validate_name(name, kind)
        # An owner per volume also asks the store: another owner's volume may have been
        # made since this one opened (under pool_step, none can be made meanwhile).
        if name in self.volumes or (self.owner is not None and any(row.name == name for row in self.meta.volumes())):
            raise ThinblockError(f"a volume or snapshot named {name!r} already exists in pool {self.path}")

    def share_contents(self, vol: Volume, source: Volume) -> None:
        """vol (with an empty root table) takes source's size and contents by sharing
        every mapping page by its refcount alone: O(pages), no page is loaded, no block
        copied. The counts are read first, in one batch, so a failing read changes nothing."""
        self.txn.share_root(vol, source)
        row, src = vol.row, source.row
        with self.volumes.tallied(vol):
            row.size_bytes = src.size_bytes
            row.data_blocks, row.zeroed_blocks = src.data_blocks, src.zeroed_blocks
            row.pinned_blocks = src.pinned_blocks
        self.txn.mark_volume_dirty(vol)

    def remove_volume(self, name: str, *, kind: str | None = None) -> dict[str, Any]:
        """Remove a volume or snapshot (any order): pages and dblocks lose one
        reference; space returns when the last goes. Returns what happened, including
        the dependents (snapshots of it, clones of it): they keep every byte, and
        their origin becomes none."""
        with self.quiesced(name, kind=kind) as vol, self.lock:
            self.refuse_if_busy(vol, "remove")
            self._refuse_foreign_dependents(vol)
            used_before = self.accounts.space.used_blocks
            dependents = self.drop_volume(vol)
            freed = used_before - self.accounts.space.used_blocks
        self.commit()
        return {"name": name, "kind": vol.row.kind, "freed_bytes": freed * self.block_size, "dependents": dependents}

    def rename_volume(self, name: str, new_name: str, *, kind: str) -> dict[str, Any]:
        """Rename a volume or snapshot (lvrename, rbd rename), refused while a client
        has it open: an NBD client or an attached device knows it by its old name.
        Everything else stays: origins and dependents link by id, so lineage holds."""
        if name.startswith(STAGING_PREFIX):  # the pool's own, never the user's
            raise ThinblockError(f"no {kind} {name!r} in pool {self.path}")
        with self.quiesced(name, kind=kind) as vol, self.lock:
            if new_name == name:
                raise ThinblockError(f"{kind} {name} is already called {new_name}")
            self.check_new_name(new_name, kind)
            self.refuse_if_busy(vol, "rename")
            # As rbd's snapshots go with their image: a volume's snapshots named VOLUME@SNAP
            # (taken of it) become NEW@SNAP, all checked before anything is renamed.
            carried = [
                (snap, new_name + snap.name[len(name) :])
                for snap in self.volumes.values()
                if kind == "volume"
                and snap.row.kind == "snapshot"
                and snap.row.origin_id == vol.row.id
                and snap.name.startswith(f"{name}@")
            ]
            for snap, snap_name in carried:
                self.check_new_name(snap_name, "snapshot")
                self.refuse_if_busy(snap, f"rename {vol.row.kind} {name}, which renames its")
            for item, item_name in [(vol, new_name), *carried]:
                del self.volumes[item.name]
                item.row.name = item_name
                self.volumes[item_name] = item
                self.txn.mark_volume_dirty(item)
        self.commit()
        result: dict[str, Any] = {"kind": kind, "old_name": name, "name": new_name}
        if carried:
            result["snapshots"] = [{"old_name": name + n[len(new_name) :], "name": n} for _s, n in carried]
        return result

    def drop_volume(self, vol: Volume) -> list[dict[str, Any]]:
        """Take vol out of the pool (call under the pool lock, with its range held): its
        pages lose a reference, and its dependents' origin becomes none (returned)."""
        # An owner per volume rewrites a dependent it does not serve whole: from the
        # store's row, not its own view, which another process may have changed since
        # (pool_step holds the pool-level lock; _refuse_foreign_dependents refused live
        # owners' ones). What it serves, its own view is the authority for.
        foreign: dict[int, VolumeRow] = {}
        mine: set[int] = set()
        if self.owner is not None:
            mine = {v.row.id for v in self.volumes.values() if v.row.origin_id == vol.row.id and self.serves(v)}
            foreign = {row.id: row for row in self.meta.volumes() if row.id not in mine}
        self.txn.release_root(vol)
        self.volumes.tally(vol, False)
        del self.volumes[vol.name]
        vol.removed = True
        self.accounts.retally_set_aside(vol)  # its set-aside goes with it
        dependents = []
        for other in sorted(self.volumes.values(), key=lambda v: v.name):
            if other.row.origin_id == vol.row.id:  # lineage ends here; the blocks stay shared
                if self.owner is not None and other.row.id not in mine and not self._follow_stored(other, foreign):
                    continue
                if other.row.origin_id != vol.row.id:
                    continue  # it was given another origin meanwhile
                other.row.origin_id = None
                self.txn.mark_volume_dirty(other)
                if not other.name.startswith(STAGING_PREFIX):  # the pool's own: a job's, no one's dependent
                    dependents.append({"name": other.name, "kind": other.row.kind, "origin": None})
        self.txn.forget_volume(vol)
        return dependents

    def _follow_stored(self, other: Volume, foreign: dict[int, VolumeRow]) -> bool:
        """drop_volume's rewrite of a dependent this owner does not serve: its row becomes
        the stored one (renamed meanwhile: found under its new name). False if it is gone."""
        stored = foreign.get(other.row.id)
        if stored is None:
            return False
        with self.volumes.tallied(other):
            if stored.name != other.name:
                del self.volumes[other.name]
                self.volumes[stored.name] = other
            for column in dataclasses.fields(stored):
                setattr(other.row, column.name, getattr(stored, column.name))
        return True

    def refuse_if_busy(self, vol: Volume, what: str) -> None:
        if vol.users:
            shown = sorted(vol.holders)
            named = ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
            raise PoolBusyError(
                f"cannot {what} {vol.row.kind} {vol.name}: it is open by {vol.users} client(s): {named}"
            )

    def resize_volume(self, name: str, size_bytes: int, *, allow_shrink: bool = False) -> list[str]:
        """Grow a volume, or shrink it (discarding the cut-off part) when allow_shrink
        and no client has it open: like rbd resize, a shrink must be asked for. Then the
        size watchers are told (an attached loop device grows, as a mapped rbd image
        does); what they could not do is returned as warnings, the resize stands."""
        validate_volume_size(size_bytes)
        with self.quiesced(name, kind="volume") as vol:
            old_bytes = vol.size_bytes
            with self.lock:
                if size_bytes < vol.size_bytes:
                    if not allow_shrink:
                        raise ThinblockError(
                            f"shrinking volume {name} from {format_size(vol.size_bytes)} to {format_size(size_bytes)}"
                            " discards everything past the new end: pass --allow-shrink to do it"
                        )
                    self.refuse_if_busy(vol, "shrink")
                if vol.row.reserve_bytes == RESERVE_FULL and size_bytes > vol.size_bytes:
                    accounts = self.accounts
                    extra = target_blocks(RESERVE_FULL, size_bytes, self.block_size) - accounts.reserve_target(vol)
                    accounts.check_reservable(vol, accounts.set_aside(vol) + extra, "grow")
            vol.resize_held(size_bytes)
        self.commit()
        return self.tell_size_watchers(name, size_bytes) if size_bytes != old_bytes else []

    def tell_size_watchers(self, name: str, size_bytes: int) -> list[str]:
        """Tell the size watchers a volume is now size_bytes; their warnings. A watcher
        that fails is a warning too: the resize is done and committed by now."""
        warnings: list[str] = []
        for watcher in list(self.size_watchers):
            try:
                warnings += watcher(name, size_bytes)
            except Exception as exc:
                log.exception("telling %s of volume %s's new size failed", watcher, name)
                warnings.append(
                    f"volume {name} is now {format_size(size_bytes)}, but telling its devices failed: {exc}"
                )
        return warnings

    def set_detect_zeroes(self, name: str, mode: str) -> None:
        if mode not in DETECT_ZEROES:
            raise ThinblockError(f"invalid detect_zeroes {mode!r}: use one of {', '.join(DETECT_ZEROES)}")
        with self.lock:
            vol = self.volume(name, kind="volume")
            self.check_may_change(vol)
            vol.row.detect_zeroes = mode
            self.txn.mark_volume_dirty(vol)
        self.commit()

    def set_low_water(self, name: str, percent: float | str | None, command: str | None) -> None:
        """A volume's low-water mark: a percentage of its size left unmapped, or none."""
        percent = parse_low_water(percent)
        with self.lock:
            vol = self.volume(name, kind="volume")
            self.check_may_change(vol)
            vol.row.low_water = percent
            vol.row.on_low_water = command
            self.policy.rearm(vol)
            self.txn.mark_volume_dirty(vol)
        self.commit()

    def set_policy(self, changes: dict[str, Any]) -> None:
        """Change the out-of-space policy (see space_policy); validated before anything changes.
        Per volume, a pool-level step every owner follows (core/pool_settings.py)."""
        if self.owner is not None:
            set_policy_shared(self, changes)
            return
        with self.lock:
            self.policy.update(changes)
            self.txn.touch()
        self.commit()
        with self.lock:
            self.policy.check()
        self.wake_space_waiters()

    def status(self) -> dict[str, Any]:
        """Live figures of the pool, from kept counters: O(1) in the number of volumes
        (`volume_info` gives each volume's)."""
        # An owner per volume shows the pool's used count as every owner committed it (its
        # own view may be behind), read before the pool lock: no store read under it.
        committed = self.meta.superblock().get("used_blocks") if self.owner is not None else None
        # ... and the set-asides of the volumes other holders hold or nobody does, as
        # committed (its own it counts itself: they may be newer).
        others_reserved = 0
        if self.owner is not None:
            set_aside, _unused = reservation_claims(self.meta, self.block_size)
            others_reserved = sum(n for holder, n in set_aside.items() if holder is None or holder != self.owner.name)
        with self.lock:
            self.accounts.refresh_reserved()  # the few reserved volumes with stale counts: exact set-asides
            figures = self.space_figures()
            if committed is not None:
                used = int(committed) * self.block_size
                figures.update(used_bytes=used, free_bytes=self.size_bytes - used)
                figures["reserved_bytes"] += others_reserved * self.block_size
                figures["available_bytes"] = max(0, figures["free_bytes"] - figures["reserved_bytes"])
            return {
                **figures,
                **self.host_figures(),
                "block_size": self.block_size,
                **self.volumes.totals.figures(self.block_size),
                **grant_figures(self.meta, self.block_size),
                **self.policy.settings(),
            }

    def volume_info(self, vol: Volume, names: dict[int, str] | None = None) -> dict[str, Any]:
        """One volume's figures from its kept counters (a stale exclusive count is
        recounted first). names: volume id -> name, when the caller has it (listings)."""
        with self.lock:
            origin: str | None = None
            if vol.row.origin_id is not None:
                if names is not None:
                    origin = names.get(vol.row.origin_id)
                else:
                    found = self.volume_by_id(vol.row.origin_id)
                    origin = found.name if found else None
            exclusive, shared = vol.usage()
            return {
                **volume_dict(vol.row, self.block_size, origin),
                "exclusive_bytes": exclusive * self.block_size,
                "shared_bytes": shared * self.block_size,
                "reserved_bytes": self.accounts.set_aside(vol) * self.block_size,
                "open_clients": vol.users,
            }

    def open_clients(self) -> dict[str, int]:
        """name -> open clients of each volume and snapshot this process serves."""
        with self.lock:
            return {name: vol.users for name, vol in self.visible().items() if self.serves(vol)}

    def volume_list(self, kind: str | None = None) -> list[dict[str, Any]]:
        """volume_info of every visible volume and snapshot (of one kind), by name:
        O(volumes), plus a recount of each stale exclusive count."""
        with self.lock:
            names = {v.row.id: v.name for v in self.volumes.values()}
            return [
                self.volume_info(v, names)
                for _, v in sorted(self.visible().items())
                if kind is None or v.row.kind == kind
            ]

    def set_reserve(self, name: str, reserve_bytes: int) -> None:
        """Set a volume's reservation (bytes, RESERVE_FULL or 0 for none)."""
        if reserve_bytes < RESERVE_FULL:
            raise ThinblockError(f"invalid reservation {reserve_bytes}")
        accounts = self.accounts
        with self.lock:
            vol = self.volume(name, kind="volume")
            # An owner per volume: only its own volumes' (the command line sends it to the
            # owner: admin/access.py), in a pool-level step that commits it (run_verb), so
            # every later grant step sees the new set-aside.
            self.check_may_change(vol)
            for owner in (vol, *vol.replacements):  # exact counts: the decision may fail
                owner.fresh_exclusive()
            accounts.check_reservable(vol, accounts.set_aside(vol, reserve_bytes), "reserve space for")
            vol.row.reserve_bytes = reserve_bytes
            accounts.retally_set_aside(vol)
            self.txn.mark_volume_dirty(vol)
        self.commit()
        self.wake_space_waiters()

    def close(self) -> None:
        """Commit and release everything; the pool object is unusable afterwards.

        If the last commit fails, the pool is left marked unclean (the next open
        recovers it like after a crash) and UncleanCloseError is raised after cleanup."""
        failure: Exception | None = None
        if self.committer.closed.is_set():
            return
        step = contextlib.ExitStack()
        if self.owner is not None:
            self.owner.quiesce_prefetch()  # before any lock: a grant taken ahead of need needs them
            # Giving grants back takes the pool-level lock, and a pool-level step (another
            # owner's ask for idle grants answered here) takes it before this pool's
            # lock: so does the close, or the two wait on each other for ever. The data
            # is synced first, outside it, as an administration verb's is (verbs.py).
            with contextlib.suppress(Exception):  # the commit below says what failed
                self.commit()
            try:
                step.enter_context(self.meta.pool_lock())
            except (OSError, ThinblockError) as exc:  # what is not given back waits for the next step
                log.warning("pool %s: closing without the pool-level lock: %s", self.path, exc)
        with step, self.lock:
            if self.committer.closed.is_set():
                return
            try:
                self.commit()
                # The final commit's punches and header write were issued after its data
                # sync: durable before "clean" says no free block needs punching.
                self.store.flush()
                # ZEROED dblocks a failed write reached are re-zeroed by the next open's
                # recovery, and a write still in flight (its fresh dblocks unpublished,
                # committed as free) may yet land in a free block: leave the pool marked
                # unclean for those, so the next open punches free space again.
                if self.owner is not None:  # the pool stays unclean (see __init__)
                    for problem in self.owner.release():
                        log.warning("pool %s: %s", self.path, problem)
                elif not self.unclean_zeroed and not self.accounts.space.unpublished:
                    self.committer.write_metadata(Transaction(superblock={"clean": True}))
            except Exception as exc:
                # One sentence for the caller (the command line prints it), never a
                # traceback: a fenced or failing store is an ordinary end.
                cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                failure = UncleanCloseError(
                    f"pool {self.path} closed without its final commit ({cause}): the next open recovers it,"
                    " as after a crash"
                )
            self.committer.closed.set()
            self.accounts.cancel_waits()
            step.close()  # the pool-level lock goes before the store it is held in
            self.store.close()
            self.meta.close()
            self._ownership.release()
        self.committer.join()
        if failure is not None:
            raise failure
