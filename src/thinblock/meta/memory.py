"""A metadata store in memory, for tests: the contract of meta/base.py, nothing more.

A commit applies to copies and swaps them in, so a failure (injected by a test
wrapper, or a bad transaction) leaves the store exactly as before. Several store
objects opened on one state stand for several processes: a lease is held by the
store object that claimed it, and dies when that object is closed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import itertools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from thinblock.meta import owners
from thinblock.meta.base import (
    CommitResult,
    Grant,
    Lease,
    MetadataStore,
    Transaction,
    VolumeBusyError,
    VolumeRow,
    initial_superblock,
)

_instances = itertools.count(1)


@dataclasses.dataclass
class MemoryMetaState:
    """What a memory metadata store holds; it outlives the store objects opened on it."""

    superblock: dict[str, Any]
    volumes: dict[int, VolumeRow] = dataclasses.field(default_factory=dict)
    roots: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    pages: dict[int, tuple[int, bytes]] = dataclasses.field(default_factory=dict)
    refcount_pages: dict[int, bytes] = dataclasses.field(default_factory=dict)
    max_page_id: int = 0
    # Ownership: volume id -> (owner, epoch, the store object holding it); the last
    # epoch of every volume ever claimed; the grants; the pool-level lock.
    leases: dict[int, tuple[str, int, int]] = dataclasses.field(default_factory=dict)
    epochs: dict[int, int] = dataclasses.field(default_factory=dict)
    grants: list[Grant] = dataclasses.field(default_factory=list)
    pool_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # One lock for the state, shared by every store object on it: objects on one state
    # stand for owners in several processes, whose commits must not interleave.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class MemoryMetadata(MetadataStore):
    def __init__(self, state: MemoryMetaState, *, readonly: bool = False) -> None:
        self.state = state
        self.readonly = readonly
        self._lock = state.lock
        self._instance = next(_instances)

    @classmethod
    def create(cls, superblock: dict[str, Any]) -> MemoryMetadata:
        return cls(MemoryMetaState(initial_superblock(superblock)))

    def superblock(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.state.superblock)

    def volumes(self) -> list[VolumeRow]:
        with self._lock:
            return [dataclasses.replace(v) for v in sorted(self.state.volumes.values(), key=lambda v: v.name)]

    def roots(self, volume_id: int) -> dict[int, int]:
        with self._lock:
            return {index: pid for (vid, index), pid in self.state.roots.items() if vid == volume_id}

    def all_roots(self) -> Iterator[tuple[int, int, int]]:
        with self._lock:
            rows = [(vid, index, pid) for (vid, index), pid in self.state.roots.items()]
        yield from rows

    def page(self, page_id: int) -> tuple[int, bytes] | None:
        with self._lock:
            return self.state.pages.get(page_id)

    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        with self._lock:
            pages = self.state.pages
            return {pid: pages[pid][0] for pid in page_ids if pid in pages}

    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        with self._lock:
            pages = self.state.pages
            return {pid: pages[pid] for pid in page_ids if pid in pages}

    def all_pages(self) -> Iterator[tuple[int, int, bytes]]:
        with self._lock:
            rows = [(pid, ref, blob) for pid, (ref, blob) in self.state.pages.items()]
        yield from rows

    def max_page_id(self) -> int:
        with self._lock:
            return max([self.state.max_page_id, *self.state.pages])

    def max_volume_id(self) -> int:
        with self._lock:
            return max(self.state.volumes, default=0)

    def refcount_pages(self) -> dict[int, bytes]:
        with self._lock:
            return dict(self.state.refcount_pages)

    def commit(self, txn: Transaction) -> CommitResult:
        if self.readonly:
            raise OSError(errno.EROFS, "metadata store opened read-only")
        with self._lock:
            s = self.state
            owners.check_leases(txn.leases, self._current)
            owners.check_volume_writes(txn, self._link, self._current)  # every lease here is live
            fenced = {vid for vid, epoch in txn.fenced if (held := s.leases.get(vid)) is not None and held[1] == epoch}
            result = CommitResult()
            superblock = copy.deepcopy(s.superblock)
            for name, value in copy.deepcopy(txn.superblock).items():
                base = txn.counter_bases.get(name)
                superblock[name] = owners.counter(name, superblock.get(name), value, base)
                if base is not None:
                    result.counters[name] = int(superblock[name])
            volumes, roots, pages = dict(s.volumes), dict(s.roots), dict(s.pages)
            for vid in txn.deleted_volumes:
                volumes.pop(vid, None)
                roots = {key: pid for key, pid in roots.items() if key[0] != vid}
            for row in txn.volumes:
                volumes[row.id] = dataclasses.replace(row)
            for key, pid in txn.roots.items():
                if pid is None:
                    roots.pop(key, None)
                else:
                    roots[key] = pid
            for pid, page in txn.pages.items():
                stored = s.pages.get(pid)
                base = txn.page_ref_bases.get(pid)
                count = owners.page_count(
                    pid,
                    None if stored is None else stored[0],
                    0 if page is None else page[0],
                    base,
                    deleting=page is None,
                )
                if page is None:
                    pages.pop(pid, None)
                else:
                    pages[pid] = (count, bytes(page[1]))
                if base is not None and page is not None:
                    result.page_refcounts[pid] = count
            for pid, new in txn.page_refcounts.items():
                if pid in pages:
                    base = txn.page_ref_bases.get(pid)
                    count = owners.page_count(pid, pages[pid][0], new, base, deleting=False)
                    pages[pid] = (count, pages[pid][1])
                    if base is not None:
                        result.page_refcounts[pid] = count
                elif pid in txn.page_ref_bases:
                    owners.page_count(pid, None, new, txn.page_ref_bases[pid], deleting=False)
            names = [row.name for row in volumes.values()]
            if len(names) != len(set(names)):
                raise OSError(errno.EIO, "metadata commit failed: two volumes would share a name")
            refcount_pages = dict(s.refcount_pages)
            used_change = 0
            for index, blob in txn.refcount_pages.items():
                base_blob = txn.refcount_bases.get(index)
                granted = None if base_blob is None else owners.granted_mask(txn, s.grants, index)
                refcount_pages[index] = owners.refcount_page(
                    index, s.refcount_pages.get(index), bytes(blob), base_blob, granted
                )
                if base_blob is not None:
                    used_change += owners.nonzero_change(s.refcount_pages.get(index), refcount_pages[index])
                if base_blob is not None:
                    result.refcount_pages[index] = refcount_pages[index]
            n_blocks = int(superblock.get("size_bytes", 0)) // int(superblock.get("block_size", 1) or 1)
            grants = owners.check_grants(
                txn, s.grants, n_blocks, lambda start, count: owners.refcounts_in(refcount_pages, start, count)
            )
            result.orphans = sorted(pid for pid in result.page_refcounts if result.page_refcounts[pid] == 0)
            high = max([s.max_page_id, *txn.pages])
            if txn.refcount_bases:
                superblock[owners.USED] = owners.used_after(superblock.get(owners.USED), used_change)
                result.counters[owners.USED] = int(superblock[owners.USED])
            self.state.superblock, self.state.volumes, self.state.roots = superblock, volumes, roots
            self.state.pages, self.state.refcount_pages, self.state.max_page_id = pages, refcount_pages, high
            self.state.grants = grants
            for vid in fenced:
                del self.state.leases[vid]
            return result

    # ----- ownership per volume ------------------------------------------------------

    def _link(self, volume_id: int) -> owners.Link | None:
        row = self.state.volumes.get(volume_id)
        return None if row is None else (row.kind, row.origin_id)

    def _current(self, volume_id: int) -> tuple[str, int] | None:
        held = self.state.leases.get(volume_id)
        return None if held is None else (held[0], held[1])

    def claim_volume(self, volume_id: int, owner: str) -> Lease:
        with self._lock:
            held = self.state.leases.get(volume_id)
            if held is not None:
                raise VolumeBusyError(f"volume {volume_id} is owned by {held[0]}")
            epoch = self.state.epochs.get(volume_id, 0) + 1
            self.state.epochs[volume_id] = epoch
            self.state.leases[volume_id] = (owner, epoch, self._instance)
            return Lease(volume_id, owner, epoch)

    def release_volume(self, lease: Lease) -> None:
        with self._lock:
            held = self.state.leases.get(lease.volume_id)
            if held is not None and held[:2] == (lease.owner, lease.epoch):
                del self.state.leases[lease.volume_id]

    def volume_holder(self, volume_id: int) -> str | None:
        with self._lock:
            held = self.state.leases.get(volume_id)
            return None if held is None else held[0]

    def recorded_holders(self) -> dict[int, str]:
        with self._lock:
            return {vid: held[0] for vid, held in self.state.leases.items()}

    def lease_live(self, volume_id: int, epoch: int) -> bool:
        with self._lock:
            held = self.state.leases.get(volume_id)
            return held is not None and held[1] == epoch

    @contextlib.contextmanager
    def pool_lock(self) -> Iterator[None]:
        with self.state.pool_lock:
            yield

    def grants(self) -> list[Grant]:
        with self._lock:
            return list(self.state.grants)

    def orphans(self) -> list[int]:
        with self._lock:
            return sorted(pid for pid, (count, _) in self.state.pages.items() if count == 0)

    def integrity_problems(self) -> list[str]:
        return []

    def close(self) -> None:
        """Like a process's end: every lease this store object holds dies with it."""
        with self._lock:
            for vid in [v for v, held in self.state.leases.items() if held[2] == self._instance]:
                del self.state.leases[vid]
