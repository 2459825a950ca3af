"""The pool: physical space shared by thin volumes, and its one transaction.

The pool owns the data store, the metadata store, the space map and the page
cache. It collects every metadata change in memory and writes them all in
one SQLite transaction on `commit()` (on flush, FUA, and at least once a
second from a background thread). Freed dblocks are punched in the data store
only after the commit that freed them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from typing import Any

from thinblock.datastore import DataStore, FallbackStore, FileStore
from thinblock.errors import NoSpaceError, PoolBusyError, ThinblockError
from thinblock.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, STATE_MASK, BlockState, Page
from thinblock.metadata import DB_NAME, RESERVE_FULL, MetadataStore, Transaction, VolumeRow, reserve_blocks
from thinblock.sizes import format_size
from thinblock.space_policy import SpacePolicy, parse_low_water
from thinblock.spacemap import SpaceMap, to_runs
from thinblock.volume import Volume

DEFAULT_BLOCK_SIZE = 64 << 10
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 16 << 20
SECTOR_BYTES = 512
# Largest volume: loff_t (FUSE, loop) and qemu's int64 sizes cap at 2**63 - 1; stay a
# multiple of the largest block size below that.
MAX_VOLUME_BYTES = (1 << 63) - MAX_BLOCK_SIZE
COMMIT_INTERVAL_S = 1.0
# Data is synced on flush/FUA and at least this often (the kernel's own dirty-expire time).
DATA_SYNC_INTERVAL_S = 30.0
DETECT_ZEROES = ("off", "on", "unmap")
log = logging.getLogger("thinblock.pool")
DATA_FILE = "data"
LOCK_FILE = "lock"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


def validate_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ThinblockError(
            f"invalid volume name {name!r}: use 1-128 letters, digits, '_', '.', '+', '-', not starting with '.', '+' or '-'"
        )


def validate_volume_size(size_bytes: int) -> None:
    if size_bytes <= 0 or size_bytes % SECTOR_BYTES:
        raise ThinblockError(f"invalid volume size {size_bytes}: must be a positive multiple of {SECTOR_BYTES} bytes")
    if size_bytes > MAX_VOLUME_BYTES:
        raise ThinblockError(
            f"volume size {format_size(size_bytes)} is beyond the largest thinblock supports ({format_size(MAX_VOLUME_BYTES)})"
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


def read_status(path: str) -> dict[str, Any]:
    """Committed figures without locking the pool (mkfs reads these while the pool is attached)."""
    meta = _open_meta(path, readonly=True)
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


def _open_meta(path: str, *, readonly: bool) -> MetadataStore:
    db = os.path.join(path, DB_NAME)
    if not os.path.isdir(path):
        raise ThinblockError(f"no pool at {path}: not a directory")
    if not os.path.exists(db):
        raise ThinblockError(f"no pool at {path}: {DB_NAME} is missing")
    return MetadataStore.open(db, readonly=readonly)


def _lock(path: str, purpose: str) -> int:
    """Take the pool's exclusive lock (a flock on POOL/lock naming its holder)."""
    lock_fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock_fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(lock_fd)
        raise PoolBusyError(f"pool {path} is already held by another thinblock process (pid {holder})") from None
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()} {purpose or ' '.join(sys.argv[:2])}".strip().encode() + b"\n", 0)
    return lock_fd


@contextlib.contextmanager
def held_lock(path: str) -> Iterator[None]:
    """The pool's lock without opening it (restore, repair): refused while it is served."""
    if not os.path.isdir(path):
        raise ThinblockError(f"no pool at {path}: not a directory")
    fd = _lock(path, "thinblock restore/repair")
    try:
        yield
    finally:
        os.close(fd)


class Pool:
    """An open pool. Use `Pool.create` / `Pool.open`; all methods are thread-safe."""

    def __init__(self, path: str, meta: MetadataStore, store: DataStore, lock_fd: int, *, autocommit: bool) -> None:
        self.path = path
        self.meta = meta
        self.store = store
        self._lock_fd = lock_fd
        self.lock = threading.RLock()
        sb = meta.superblock()
        self.block_size = int(sb["block_size"])
        self.size_bytes = int(sb["size_bytes"])
        self.transaction_id = int(sb["transaction_id"])
        self.space = SpaceMap(self.size_bytes // self.block_size, meta.refcount_pages())
        self.pages: dict[int, Page] = {}
        self._next_page_id = meta.max_page_id() + 1
        self._next_volume_id = meta.max_volume_id() + 1
        self.volumes: dict[str, Volume] = {}
        for row in meta.volumes():
            self.volumes[row.name] = Volume(self, row, meta.roots(row.id))
        self.policy = SpacePolicy(self, sb)
        self.owned_stale = False  # some volume may own more blocks alone than it counts
        # Writers held by the wait policy sleep on this; grow, frees and removals wake them.
        self.space_changed = threading.Condition(self.lock)
        # Changes of the open transaction.
        self._dirty_pages: set[int] = set()
        self._dirty_page_refs: set[int] = set()  # refcount changed, entries not
        self._dirty_roots: set[tuple[int, int]] = set()
        self._touched: set[tuple[Volume, int]] = set()
        self._dirty_volumes: set[Volume] = set()
        self._deleted_volumes: list[int] = []
        self.dirty = False
        self.last_commit = self.last_data_sync = time.monotonic()
        self._closed = threading.Event()
        self._waits_cancelled = threading.Event()
        self._committer: threading.Thread | None = None
        if not sb.get("clean", True):
            self._recover_free_space()
        self.recount_owned()
        self.meta.commit(Transaction(superblock={"clean": False}))
        if autocommit:
            self._committer = threading.Thread(target=self._commit_loop, name="thinblock-commit", daemon=True)
            self._committer.start()

    # ----- opening and creating -------------------------------------------------

    @classmethod
    def create(
        cls, path: str, size_bytes: int | None, *, block_size: int = DEFAULT_BLOCK_SIZE, data_path: str | None = None
    ) -> Pool:
        """Make a new pool directory with a sparse data file (or over a raw device)."""
        if block_size < MIN_BLOCK_SIZE or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
            raise ThinblockError(
                f"invalid block size {block_size}: must be a power of two from {format_size(MIN_BLOCK_SIZE)}"
                f" to {format_size(MAX_BLOCK_SIZE)}"
            )
        if os.path.exists(os.path.join(path, DB_NAME)):
            raise ThinblockError(f"a pool already exists at {path}")
        if data_path is not None:
            data_path = os.path.abspath(data_path)
            probe = FileStore(data_path)
            device_bytes = probe.size_bytes
            probe.close()
            if size_bytes is None:
                size_bytes = device_bytes - device_bytes % block_size
            elif size_bytes > device_bytes:
                raise ThinblockError(
                    f"--size {format_size(size_bytes)} exceeds {data_path} ({format_size(device_bytes)})"
                )
        if size_bytes is None:
            raise ThinblockError("a pool in a sparse file needs --size")
        if size_bytes < block_size or size_bytes % block_size:
            raise ThinblockError(
                f"invalid pool size {size_bytes}: must be a positive multiple of the block size ({format_size(block_size)})"
            )
        os.makedirs(path, exist_ok=True)
        if data_path is None:
            with open(os.path.join(path, DATA_FILE), "xb") as f:
                f.truncate(size_bytes)
        else:
            # Allocatable blocks must read zero (see spacemap): clear the device once.
            device = FallbackStore(FileStore(data_path))
            try:
                device.punch(0, size_bytes)
                device.flush()
            finally:
                device.close()
        meta = MetadataStore.create(
            os.path.join(path, DB_NAME),
            {
                "block_size": block_size,
                "size_bytes": size_bytes,
                "page_entries": PAGE_ENTRIES,
                "data_path": data_path,
                "used_blocks": 0,
                "created": time.time(),
                "clean": True,
            },
        )
        meta.close()
        return cls.open(path)

    @classmethod
    def open(cls, path: str, *, autocommit: bool = True, purpose: str = "") -> Pool:
        """Open a pool for reading and writing; only one process may hold it so.

        purpose ("thinblock serve", ...) is what a refused second opener is told."""
        meta = _open_meta(path, readonly=False)
        try:
            lock_fd = _lock(path, purpose)
        except PoolBusyError:
            meta.close()
            raise
        sb = meta.superblock()
        data_path = sb.get("data_path") or os.path.join(path, DATA_FILE)
        store = FallbackStore(FileStore(str(data_path)))
        return cls(path, meta, store, lock_fd, autocommit=autocommit)

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

    def volume_by_id(self, volume_id: int | None) -> Volume | None:
        return next((v for v in self.volumes.values() if v.row.id == volume_id), None)

    def create_volume(self, name: str, size_bytes: int, *, detect_zeroes: str = "on") -> Volume:
        validate_volume_size(size_bytes)
        if detect_zeroes not in DETECT_ZEROES:
            raise ThinblockError(f"invalid detect_zeroes {detect_zeroes!r}: use one of {', '.join(DETECT_ZEROES)}")
        with self.lock:
            vol = self.add_volume(name, size_bytes, detect_zeroes)
            self.commit()
            return vol

    def add_volume(self, name: str, size_bytes: int, detect_zeroes: str, *, sharing: Volume | None = None) -> Volume:
        """A new, empty volume row; with `sharing`, holding that volume's contents (see share_contents).
        The name is checked before any page reference is taken."""
        validate_name(name)
        if name in self.volumes:
            raise ThinblockError(f"a volume or snapshot named {name!r} already exists in pool {self.path}")
        row = VolumeRow(self._next_volume_id, name, size_bytes, detect_zeroes, time.time())
        self._next_volume_id += 1
        vol = Volume(self, row, {})
        self.volumes[name] = vol
        self.mark_volume_dirty(vol)
        if sharing is not None:
            self.share_contents(vol, sharing)
        return vol

    def share_contents(self, vol: Volume, source: Volume) -> None:
        """vol (with an empty root table) takes source's size and contents by sharing
        every mapping page: O(pages), no block is copied."""
        for page_id in source.root.values():
            self.page(page_id).refcount += 1
            self._dirty_page_refs.add(page_id)
        vol.root.update(source.root)
        for page_index in vol.root:
            self.mark_root_dirty(vol, page_index)
        row, src = vol.row, source.row
        row.size_bytes = src.size_bytes
        row.data_blocks, row.zeroed_blocks, row.pinned_blocks = src.data_blocks, src.zeroed_blocks, src.pinned_blocks
        self.mark_volume_dirty(vol)

    def remove_volume(self, name: str, *, kind: str | None = None) -> None:
        """Remove a volume or snapshot (any order): pages and dblocks lose one
        reference; space returns when the last goes."""
        with self.lock:
            vol = self.volume(name, kind=kind)
            self.refuse_if_busy(vol, "remove")
            self.release_root(vol)
            del self.volumes[name]
            vol.removed = True
            for other in self.volumes.values():
                if other.row.origin_id == vol.row.id:  # lineage ends here; the blocks stay shared
                    other.row.origin_id = None
                    self.mark_volume_dirty(other)
            self._dirty_volumes.discard(vol)
            self._touched = {t for t in self._touched if t[0] is not vol}
            self._dirty_roots = {r for r in self._dirty_roots if r[0] != vol.row.id}
            self._deleted_volumes.append(vol.row.id)
            self.dirty = True
            self.recount_owned()
            self.commit()

    def refuse_if_busy(self, vol: Volume, what: str) -> None:
        if vol.users:
            raise PoolBusyError(
                f"cannot {what} {vol.row.kind} {vol.name}: it is open by {vol.users} client(s)"
                " (NBD connections or an attached loop device)"
            )

    def release_root(self, vol: Volume) -> None:
        """Drop every page of vol's root table (the table ends empty)."""
        for page_index in list(vol.root):
            self.release_page(vol.root.pop(page_index))
            self.mark_root_dirty(vol, page_index)

    def resize_volume(self, name: str, size_bytes: int) -> None:
        validate_volume_size(size_bytes)
        with self.lock:
            vol = self.volume(name, kind="volume")
            if vol.row.reserve_bytes == RESERVE_FULL and size_bytes > vol.size_bytes:
                extra = reserve_blocks(RESERVE_FULL, size_bytes, self.block_size) - self.reserve_target(vol)
                self.check_reservable(vol, self.set_aside(vol) + extra, "grow")
            vol.resize(size_bytes)
            self.commit()

    def set_detect_zeroes(self, name: str, mode: str) -> None:
        if mode not in DETECT_ZEROES:
            raise ThinblockError(f"invalid detect_zeroes {mode!r}: use one of {', '.join(DETECT_ZEROES)}")
        with self.lock:
            vol = self.volume(name, kind="volume")
            vol.row.detect_zeroes = mode
            self.mark_volume_dirty(vol)
            self.commit()

    def set_low_water(self, name: str, percent: float | str | None, command: str | None) -> None:
        """A volume's low-water mark: a percentage of its size left unmapped, or none."""
        percent = parse_low_water(percent)
        with self.lock:
            vol = self.volume(name, kind="volume")
            vol.row.low_water = percent
            vol.row.on_low_water = command
            self.policy.rearm(vol)
            self.mark_volume_dirty(vol)
            self.commit()

    def set_policy(self, changes: dict[str, Any]) -> None:
        """Change the out-of-space policy (see space_policy); validated before anything changes."""
        with self.lock:
            self.policy.update(changes)
            self.dirty = True
            self.commit()
            self.policy.check()
            self.wake_space_waiters()

    # ----- reservations -------------------------------------------------------------
    # A volume with a reservation of R blocks may own R blocks exclusively without
    # ever failing with ENOSPC (ZFS refreservation). The pool sets aside what it does
    # not own yet: max(0, R - owned). A snapshot shares everything the volume owned,
    # so it raises the set-aside to R and is refused when the pool cannot hold that.

    def reserve_target(self, vol: Volume) -> int:
        return reserve_blocks(vol.row.reserve_bytes, vol.size_bytes, self.block_size)

    def set_aside(self, vol: Volume) -> int:
        return max(0, self.reserve_target(vol) - vol.owned_blocks) if vol.row.reserve_bytes else 0

    def reserved_blocks(self) -> int:
        return sum(self.set_aside(v) for v in self.volumes.values() if v.row.reserve_bytes)

    def recount_owned(self) -> None:
        """Exact exclusive-block counts of reserved volumes. The I/O path keeps a lower
        bound (it cannot see a block it shared become another volume's alone), which
        only over-reserves; decisions that could fail recount first when it is stale."""
        for vol in self.volumes.values():
            if vol.row.reserve_bytes:
                vol.owned_blocks = vol.usage()[0]
        self.owned_stale = False

    def _fresh_owned(self) -> None:
        if self.owned_stale:
            self.recount_owned()

    def check_reservable(self, vol: Volume, new_set_aside: int, what: str, freed: int = 0) -> None:
        """Refuse (ENOSPC, nothing changed) when vol's set-aside cannot grow to new_set_aside."""
        self._fresh_owned()
        extra = new_set_aside - self.set_aside(vol)
        available = self.space.free_blocks + freed - self.reserved_blocks()
        if extra > available:
            raise NoSpaceError(
                f"cannot {what} {vol.name}: its reservation needs {format_size(extra * self.block_size)} more"
                f" set aside and the pool has {format_size(max(0, available) * self.block_size)} unreserved free"
            )

    def set_reserve(self, name: str, reserve_bytes: int) -> None:
        """Set a volume's reservation (bytes, RESERVE_FULL or 0 for none)."""
        if reserve_bytes < RESERVE_FULL:
            raise ThinblockError(f"invalid reservation {reserve_bytes}")
        with self.lock:
            vol = self.volume(name, kind="volume")
            vol.owned_blocks = vol.usage()[0]
            target = max(0, reserve_blocks(reserve_bytes, vol.size_bytes, self.block_size) - vol.owned_blocks)
            self.check_reservable(vol, target if reserve_bytes else 0, "reserve space for")
            vol.row.reserve_bytes = reserve_bytes
            self.mark_volume_dirty(vol)
            self.commit()
            self.wake_space_waiters()

    # ----- space ------------------------------------------------------------------

    def grow(self, size_bytes: int) -> None:
        """Grow the pool online; shrinking is refused."""
        with self.lock:
            if size_bytes % self.block_size:
                raise ThinblockError(f"pool size must be a multiple of the block size ({format_size(self.block_size)})")
            if size_bytes < self.size_bytes:
                raise ThinblockError(
                    f"shrinking a pool is not supported ({format_size(self.size_bytes)} -> {format_size(size_bytes)})"
                )
            if size_bytes == self.size_bytes:
                return
            self.store.grow(size_bytes)
            self.space.grow(size_bytes // self.block_size)
            self.size_bytes = size_bytes
            self.dirty = True
            self.commit()
            log.info("pool %s grown to %s", self.path, format_size(size_bytes))
            self.wake_space_waiters()

    def reserve(self, n_blocks: int, vol: Volume | None = None) -> None:
        """Ensure n_blocks can be allocated now for vol, or raise NoSpaceError (nothing changed).

        vol may use its own set-aside; everyone else's stays untouched."""
        others = self.reserved_blocks() - (self.set_aside(vol) if vol is not None else 0)
        if n_blocks <= self.space.allocatable_blocks - others:
            return
        if others and self.owned_stale:
            self.recount_owned()
            return self.reserve(n_blocks, vol)
        if n_blocks <= self.space.free_blocks - others:
            # Freed blocks become usable once committed, punched and synced: two commits.
            self.commit()
            self.commit()
            if n_blocks <= self.space.allocatable_blocks - others:
                return
        if self.policy.autogrow_for(n_blocks + others - self.space.free_blocks):
            return self.reserve(n_blocks, vol)
        raise NoSpaceError(
            f"pool {self.path} is out of space: {n_blocks} blocks needed,"
            f" {max(0, self.space.free_blocks - others)} free"
            + (f" ({others} reserved by other volumes)" if others else "")
        )

    def wait_for_space(self, deadline: float) -> bool:
        """Under the wait policy, sleep (pool lock released) until space may have
        appeared; False once the deadline passed or the pool closes."""
        with self.space_changed:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._waits_cancelled.is_set():
                return False
            self.space_changed.wait(min(remaining, COMMIT_INTERVAL_S))
            return not self._waits_cancelled.is_set()

    def wake_space_waiters(self) -> None:
        """Space may have appeared (growth, frees, smaller set-asides, shutdown): requests
        held by the wait policy re-plan."""
        with self.space_changed:
            self.space_changed.notify_all()

    def cancel_waits(self) -> None:
        """Shutting down: requests held by the wait policy get ENOSPC now."""
        self._waits_cancelled.set()
        self.wake_space_waiters()  # under the condition's lock: no waiter misses it

    def space_figures(self) -> dict[str, int]:
        """Pool space in bytes, cheap (no page walks): what statfs and low-water marks need.
        Set-asides are as counted; status() recounts stale ones first."""
        with self.lock:
            bs = self.block_size
            used = self.space.used_blocks * bs
            reserved = self.reserved_blocks() * bs
            return {
                "size_bytes": self.size_bytes,
                "used_bytes": used,
                "free_bytes": self.size_bytes - used,
                "reserved_bytes": reserved,
                "available_bytes": max(0, self.size_bytes - used - reserved),
            }

    def status(self) -> dict[str, Any]:
        """Live figures; volumes with exclusive/shared bytes (walks their pages)."""
        with self.lock:
            self._fresh_owned()
            return {
                **self.space_figures(),
                "block_size": self.block_size,
                "virtual_bytes": sum(v.size_bytes for v in self.volumes.values() if v.row.kind == "volume"),
                **self.policy.settings(),
                "volumes": [self.volume_info(v) for _, v in sorted(self.volumes.items())],
            }

    def volume_info(self, vol: Volume) -> dict[str, Any]:
        origin = self.volume_by_id(vol.row.origin_id)
        exclusive, shared = vol.usage()
        return {
            **volume_dict(vol.row, self.block_size, origin.name if origin else None),
            "exclusive_bytes": exclusive * self.block_size,
            "shared_bytes": shared * self.block_size,
            "reserved_bytes": self.set_aside(vol) * self.block_size,
            "open_clients": vol.users,
        }

    # ----- pages (used by Volume) ---------------------------------------------------

    def page(self, page_id: int) -> Page:
        page = self.pages.get(page_id)
        if page is None:
            found = self.meta.page(page_id)
            if found is None:
                raise ThinblockError(f"mapping page {page_id} is referenced but missing (run 'thinblock pool check')")
            page = Page.from_blob(page_id, *found)
            self.pages[page_id] = page
        return page

    def new_page(self, entries: array[int] | None = None) -> Page:
        page = Page(self._next_page_id, 1, entries)
        self._next_page_id += 1
        self.pages[page.page_id] = page
        self._dirty_pages.add(page.page_id)
        self.dirty = True
        return page

    def release_page(self, page_id: int) -> None:
        """Drop one root-table reference to a page; the last one frees its dblocks."""
        page = self.page(page_id)
        page.refcount -= 1
        if page.refcount == 0:
            for entry in page.entries:
                if entry:
                    self.space.decref(entry >> 3)
            self._dirty_pages.add(page_id)
        else:
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

    def commit(self, *, sync_data: bool = True) -> None:
        """Commit the open transaction atomically.

        With sync_data (flush, FUA, pool and volume commands), every completed
        write is made durable first, so the commit covers data and metadata
        (DESIGN.md's flush). Without it (the once-a-second background commit),
        only metadata is written: unflushed data may still be lost on power
        failure, but never replaced by another volume's bytes, because blocks
        are reused only once their punch is durable (see spacemap).
        """
        if sync_data and (self.dirty or self.space.unsynced_free) and not self._closed.is_set():
            # Most dirty data is synced here without holding the pool lock, so requests
            # keep running; the sync under the lock below then has little left to do.
            self.store.flush()
        with self.lock:
            if sync_data:
                punched_before = len(self.space.unsynced_free)
                self.store.flush()
                self.last_data_sync = time.monotonic()
                self.space.release_synced(punched_before)
            if not self.dirty:
                self.last_commit = time.monotonic()
                return
            self._drop_empty_pages()
            self.transaction_id += 1
            txn = Transaction(
                superblock={
                    "transaction_id": self.transaction_id,
                    "used_blocks": self.space.used_blocks,
                    "size_bytes": self.size_bytes,
                    **self.policy.to_superblock(),
                },
                volumes=[v.row for v in self._dirty_volumes],
                deleted_volumes=list(self._deleted_volumes),
                refcount_pages=self.space.take_dirty_pages(),
                page_refcounts={pid: self.pages[pid].refcount for pid in self._dirty_page_refs - self._dirty_pages},
            )
            roots_by_id = {v.row.id: v.root for v in self.volumes.values()}
            for vid, page_index in self._dirty_roots:
                if vid in roots_by_id:
                    txn.roots[(vid, page_index)] = roots_by_id[vid].get(page_index)
            for page_id in self._dirty_pages:
                page = self.pages[page_id]
                if page.refcount == 0:
                    txn.pages[page_id] = None
                    del self.pages[page_id]
                else:
                    txn.pages[page_id] = (page.refcount, page.to_blob())
            self.meta.commit(txn)
            self._dirty_pages.clear()
            self._dirty_page_refs.clear()
            self._dirty_roots.clear()
            self._touched.clear()
            self._dirty_volumes.clear()
            self._deleted_volumes.clear()
            self.dirty = False
            self.last_commit = time.monotonic()
            # Only now may freed blocks go back to the layer below; they become
            # allocatable after the next data sync has made the punch durable.
            for start, count in self.space.take_pending():
                self.store.punch(start * self.block_size, count * self.block_size)
            if sync_data and punched_before:
                self.wake_space_waiters()
            self.policy.check()

    def _recover_free_space(self) -> None:
        """After an unclean shutdown, restore the two zero rules: free blocks and
        ZEROED blocks' dblocks may hold bytes written but never committed (a write
        into them ran, the commit recording it did not). Punch the free ones, zero
        the ZEROED ones, durably."""
        runs = self.space.free_runs()
        for start, count in runs:
            self.store.punch(start * self.block_size, count * self.block_size)
        zeroed = sorted(
            {
                entry >> DBLOCK_SHIFT
                for _pid, _ref, blob in self.meta.all_pages()
                for entry in Page.from_blob(0, 0, blob).entries
                if entry & STATE_MASK == BlockState.ZEROED
            }
        )
        for start, count in to_runs(zeroed):
            self.store.zero(start * self.block_size, count * self.block_size)
        self.store.flush()
        log.info(
            "pool %s was not closed cleanly: punched %d free extents, re-zeroed %d ZEROED blocks",
            self.path,
            len(runs),
            len(zeroed),
        )

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

    def _commit_loop(self) -> None:
        while not self._closed.wait(COMMIT_INTERVAL_S / 4):
            now = time.monotonic()
            sync = now - self.last_data_sync >= DATA_SYNC_INTERVAL_S
            if (self.dirty and now - self.last_commit >= COMMIT_INTERVAL_S) or (sync and self.space.unsynced_free):
                with self.lock:
                    if self._closed.is_set():
                        return
                    self.commit(sync_data=sync)

    def close(self) -> None:
        """Commit and release everything; the pool object is unusable afterwards."""
        with self.lock:
            if self._closed.is_set():
                return
            self.commit()
            self.meta.commit(Transaction(superblock={"clean": True}))
            self._closed.set()
            self._waits_cancelled.set()
            self.wake_space_waiters()
            self.store.close()
            self.meta.close()
            os.close(self._lock_fd)
        if self._committer is not None and self._committer is not threading.current_thread():
            self._committer.join()
