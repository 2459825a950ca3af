"""The pool: physical space shared by thin volumes, and its one transaction.

The pool owns the data store, the metadata store, the space map and the page
cache. It collects every metadata change in memory and writes them all in
one SQLite transaction on `commit()` (on flush, FUA, and at least once a
second from a background thread), after a data sync: no metadata is durable
before the data it points at. A commit that fails puts back everything it took,
so the next one retries it; the committer never dies. Freed dblocks are
punched in the data store only after the commit that freed them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from typing import Any

from thinblock.core.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, STATE_MASK, BlockState, Page
from thinblock.core.space_policy import SpacePolicy, parse_low_water
from thinblock.core.spacemap import SpaceMap, to_runs
from thinblock.core.volume import Volume
from thinblock.errors import (
    CommitError,
    CorruptionError,
    FreedSpacePending,
    NoSpaceError,
    PoolBusyError,
    ThinblockError,
    is_no_space,
)
from thinblock.meta.sqlite import DB_NAME, RESERVE_FULL, MetadataStore, Transaction, VolumeRow, reserve_blocks
from thinblock.sizes import format_size
from thinblock.store.file import DataStore, FallbackStore, FileStore
from thinblock.store.hostspace import SLACK_FILE, HostSpace, beyond_file_limit, default_slack_bytes

DEFAULT_BLOCK_SIZE = 64 << 10
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 16 << 20
SECTOR_BYTES = 512
# Largest volume: loff_t (FUSE, loop) and qemu's int64 sizes cap at 2**63 - 1; stay a
# multiple of the largest block size below that.
MAX_VOLUME_BYTES = (1 << 63) - MAX_BLOCK_SIZE
COMMIT_INTERVAL_S = 1.0
COMMIT_RETRY_MAX_S = 5.0  # longest wait between retries of a failing commit
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


def data_store_path(path: str, superblock: dict[str, Any]) -> str:
    """Where a pool's data lives: its raw device, or the sparse file in its directory."""
    return str(superblock.get("data_path") or os.path.join(path, DATA_FILE))


def check_data_size(store: DataStore, size_bytes: int, data_path: str) -> None:
    """A data store shorter than the pool would serve its missing tail as zeros: refuse."""
    have = store.size_bytes
    if have < size_bytes:
        raise CorruptionError(
            f"data store {data_path} holds {format_size(have)} but the pool is {format_size(size_bytes)}:"
            " it was truncated or replaced. Refusing to serve what it lost as zeros; put the right file back,"
            " or run 'thinblock pool repair' to extend it and drop the mappings it lost"
        )


def _lock(path: str, purpose: str) -> int:
    """Take the pool's exclusive lock (a flock on POOL/lock naming its holder)."""
    try:
        lock_fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ThinblockError(f"cannot open pool {path} for writing: {exc.strerror}") from None
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


@dataclasses.dataclass
class _Built:
    """A transaction being written, with the dirty sets it took (put back if it fails)."""

    txn: Transaction
    pages: set[int]
    page_refs: set[int]
    roots: set[tuple[int, int]]
    volumes: set[Volume]
    deleted_volumes: list[int]


class Pool:
    """An open pool. Use `Pool.create` / `Pool.open`. Volumes' verbs, commit() and
    the administration methods may be called from any thread."""

    def __init__(self, path: str, meta: MetadataStore, store: DataStore, lock_fd: int, *, autocommit: bool) -> None:
        self.path = path
        self.meta = meta
        self.store = store
        self._lock_fd = lock_fd
        self.lock = threading.RLock()
        self.meta_lock = threading.Lock()  # the metadata store's connection: commits and page loads
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
        # dblocks of ZEROED blocks that a failed write may have reached: they may not
        # read zero below, so the next write into one writes the whole block.
        self.unclean_zeroed: set[int] = set()
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
        self.last_commit = time.monotonic()
        self._committing = False
        self._commit_idle = threading.Condition(self.lock)
        self._kick = threading.Event()
        self.commit_failure: str | None = None  # why commits fail, while they do
        self.host = HostSpace(
            path,
            int(sb.get("metadata_slack_bytes") or default_slack_bytes(self.size_bytes)),
            data_on_device=bool(sb.get("data_path")),
        )
        self.host.take_slack()
        self.data_path = data_store_path(path, sb)
        self.warnings: list[str] = []  # for the person who opened it (pool create, grow)
        self._closed = threading.Event()
        self._waits_cancelled = threading.Event()
        self._committer: threading.Thread | None = None
        if not sb.get("clean", True):
            self._recover_free_space()
        self.recount_owned()
        self._write_metadata(Transaction(superblock={"clean": False}))
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
        # All or nothing: whatever this creates is removed again if any step fails.
        made_dir = not os.path.exists(path)
        made: list[str] = []
        try:
            os.makedirs(path, exist_ok=True)
            if data_path is None:
                data_file = os.path.join(path, DATA_FILE)
                with open(data_file, "xb") as f:
                    made.append(data_file)
                    try:
                        f.truncate(size_bytes)
                    except OSError as exc:
                        if exc.errno == errno.EFBIG:
                            raise beyond_file_limit(size_bytes, path) from None
                        raise
            else:
                # Allocatable blocks must read zero (see spacemap): clear the device once.
                device = FallbackStore(FileStore(data_path))
                try:
                    device.punch(0, size_bytes)
                    device.flush()
                finally:
                    device.close()
            made += [os.path.join(path, DB_NAME + suffix) for suffix in ("", "-wal", "-shm")]
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
                    "metadata_slack_bytes": default_slack_bytes(size_bytes),
                },
            )
            meta.close()
            made += [os.path.join(path, name) for name in (SLACK_FILE, LOCK_FILE)]
            pool = cls.open(path)
        except BaseException as exc:
            if made_dir:
                shutil.rmtree(path, ignore_errors=True)
            else:
                for name in made:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
            if isinstance(exc, OSError) and not isinstance(exc, ThinblockError):
                raise ThinblockError(f"cannot create pool {path}: {exc.strerror or exc}") from exc
            raise
        warning = pool.host.capacity_warning(size_bytes, pool.data_path)
        if warning:
            pool.warnings.append(warning)
        return pool

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
        try:
            sb = meta.superblock()
            data_path = data_store_path(path, sb)
            store = FallbackStore(FileStore(data_path))
            try:
                check_data_size(store, int(sb["size_bytes"]), data_path)
                return cls(path, meta, store, lock_fd, autocommit=autocommit)
            except BaseException:
                store.close()
                raise
        except BaseException:
            meta.close()
            os.close(lock_fd)
            raise

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
        self.check_new_name(name)
        row = VolumeRow(self._next_volume_id, name, size_bytes, detect_zeroes, time.time())
        self._next_volume_id += 1
        vol = Volume(self, row, {})
        self.volumes[name] = vol
        self.mark_volume_dirty(vol)
        if sharing is not None:
            self.share_contents(vol, sharing)
        return vol

    def check_new_name(self, name: str) -> None:
        """A name a new volume or snapshot may take, or ThinblockError."""
        validate_name(name)
        if name in self.volumes:
            raise ThinblockError(f"a volume or snapshot named {name!r} already exists in pool {self.path}")

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

    def grow(self, size_bytes: int, *, commit: bool = True) -> list[str]:
        """Grow the pool online; shrinking is refused. Returns warnings for a person
        (a pool larger than the host can hold). Autogrow passes commit=False: it runs
        in the middle of a request, which must keep the pool lock (the next commit
        records the new size)."""
        with self.lock:
            if size_bytes % self.block_size:
                raise ThinblockError(f"pool size must be a multiple of the block size ({format_size(self.block_size)})")
            if size_bytes < self.size_bytes:
                raise ThinblockError(
                    f"shrinking a pool is not supported ({format_size(self.size_bytes)} -> {format_size(size_bytes)})"
                )
            if size_bytes == self.size_bytes:
                return []
            try:
                self.store.grow(size_bytes)
            except OSError as exc:
                if exc.errno == errno.EFBIG:
                    raise beyond_file_limit(size_bytes, self.path) from None
                raise ThinblockError(f"cannot grow the data store of pool {self.path}: {exc.strerror}") from None
            warning = self.host.capacity_warning(size_bytes, self.data_path)
            self.space.grow(size_bytes // self.block_size)
            self.size_bytes = size_bytes
            self.dirty = True
            if commit:
                self.commit()
            log.info("pool %s grown to %s", self.path, format_size(size_bytes))
            if warning:
                log.warning("%s", warning)
            self.wake_space_waiters()
            return [warning] if warning else []

    def reserve(self, n_blocks: int, vol: Volume | None = None) -> None:
        """Ensure n_blocks can be allocated now for vol, or raise NoSpaceError (nothing changed).

        vol may use its own set-aside; everyone else's stays untouched. While commits
        fail, or while the host is full (the metadata slack is out), nothing new is
        allocated: the open transaction must not grow beyond what one commit can write."""
        if self.commit_failure is not None:
            raise NoSpaceError(f"pool {self.path} takes no new space while its commits fail: {self.commit_failure}")
        if self.host.slack_released:
            self.kick_commit()
            raise NoSpaceError(
                f"the host filesystem under pool {self.path} is full: new space is refused until freed space returns"
            )
        others = self.reserved_blocks() - (self.set_aside(vol) if vol is not None else 0)
        if n_blocks <= self.space.allocatable_blocks - others:
            return
        if others and self.owned_stale:
            self.recount_owned()
            return self.reserve(n_blocks, vol)
        if n_blocks <= self.space.free_blocks - others:
            # Freed blocks become usable once committed, punched and synced: the caller
            # commits twice with the pool lock released, then plans again.
            raise FreedSpacePending(f"pool {self.path}: {n_blocks} blocks are free once freed space is committed")
        if self.policy.autogrow_for(n_blocks + others - self.space.free_blocks):
            return self.reserve(n_blocks, vol)
        raise NoSpaceError(
            f"pool {self.path} is out of space: {n_blocks} blocks needed,"
            f" {max(0, self.space.free_blocks - others)} free"
            + (f" ({others} reserved by other volumes)" if others else "")
        )

    def settle_frees(self) -> None:
        """Make the blocks freed so far allocatable: one commit punches them, the next
        one's data sync makes the punch durable (call without holding the pool lock)."""
        try:
            self.commit()
            self.commit()
        except CommitError as exc:
            raise NoSpaceError(f"pool {self.path} cannot reuse freed space: {exc.strerror}") from exc

    def return_fresh(self, blocks: list[int]) -> None:
        """Fresh dblocks a failed operation took go back (see SpaceMap.unallocate)."""
        if blocks:
            self.space.unallocate(blocks)
            self.dirty = True

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

    def host_figures(self) -> dict[str, Any]:
        """The layer below: what it can still take, and whether commits are healthy."""
        return {
            "host_free_bytes": self.host.host_free_bytes(),
            "metadata_slack_bytes": 0 if self.host.slack_released else self.host.slack_bytes,
            "commit_failure": self.commit_failure,
        }

    def status(self) -> dict[str, Any]:
        """Live figures; volumes with exclusive/shared bytes (walks their pages)."""
        with self.lock:
            self._fresh_owned()
            return {
                **self.space_figures(),
                **self.host_figures(),
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
            with self.meta_lock:
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
    # One commit at a time (`_committing`), in three steps: build the transaction
    # under the pool lock (a copy of every dirty page, the dirty sets taken), write
    # it outside the lock (data sync first, then the metadata: rule 3), and settle
    # under the lock. A failed write puts everything it took back (rule 2), so the
    # next commit retries exactly what this one would have written.

    def commit(self) -> None:
        """Make everything completed so far durable: data first, then the metadata
        that points at it, atomically (DESIGN.md's flush). Raises CommitError (ENOSPC
        when the layer below is full, else EIO) and changes nothing in memory if it
        fails; what it would have written stays pending."""
        with self.lock:
            while self._committing:
                self._commit_idle.wait()
            if self._closed.is_set():
                return
            self._committing = True
        try:
            self._commit_once()
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
        try:
            self.store.flush()
            if built is not None:
                self._write_metadata(built.txn)
        except Exception as exc:
            with self.lock:
                if built is not None:
                    self._put_back(built)
            raise self._commit_failed(exc) from exc
        with self.lock:
            self.space.release_synced(synced_frees)
            if built is not None:
                self._settle(built)
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
                "used_blocks": self.space.used_blocks,
                "size_bytes": self.size_bytes,
                **self.policy.to_superblock(),
            },
            volumes=[dataclasses.replace(v.row) for v in self._dirty_volumes],
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

    def close(self) -> None:
        """Commit and release everything; the pool object is unusable afterwards.

        If the last commit fails, the pool is left marked unclean (the next open
        recovers it like after a crash) and the failure is raised after cleanup."""
        failure: Exception | None = None
        with self.lock:
            if self._closed.is_set():
                return
            try:
                self.commit()
                # ZEROED dblocks a failed write reached are re-zeroed by the next open's
                # recovery: leave the pool marked unclean for that.
                if not self.unclean_zeroed:
                    self._write_metadata(Transaction(superblock={"clean": True}))
            except Exception as exc:
                failure = exc
                log.error("pool %s closed without a final commit: %s", self.path, exc)
            self._closed.set()
            self._waits_cancelled.set()
            self.wake_space_waiters()
            self.store.close()
            self.meta.close()
            os.close(self._lock_fd)
        self._kick.set()
        if self._committer is not None and self._committer is not threading.current_thread():
            self._committer.join()
        if failure is not None:
            raise failure
