"""A metadata store in memory, for tests: the contract of meta/base.py, nothing more.

A commit applies to copies and swaps them in, so a failure (injected by a test
wrapper, or a bad transaction) leaves the store exactly as before.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from thinblock.meta.base import MetadataStore, Transaction, VolumeRow, initial_superblock


@dataclasses.dataclass
class MemoryMetaState:
    """What a memory metadata store holds; it outlives the store objects opened on it."""

    superblock: dict[str, Any]
    volumes: dict[int, VolumeRow] = dataclasses.field(default_factory=dict)
    roots: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    pages: dict[int, tuple[int, bytes]] = dataclasses.field(default_factory=dict)
    refcount_pages: dict[int, bytes] = dataclasses.field(default_factory=dict)
    max_page_id: int = 0


class MemoryMetadata(MetadataStore):
    def __init__(self, state: MemoryMetaState, *, readonly: bool = False) -> None:
        self.state = state
        self.readonly = readonly
        self._lock = threading.Lock()

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

    def commit(self, txn: Transaction) -> None:
        if self.readonly:
            raise OSError(errno.EROFS, "metadata store opened read-only")
        with self._lock:
            s = self.state
            superblock = {**s.superblock, **copy.deepcopy(txn.superblock)}
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
                if page is None:
                    pages.pop(pid, None)
                else:
                    pages[pid] = (page[0], bytes(page[1]))
            for pid, count in txn.page_refcounts.items():
                if pid in pages:
                    pages[pid] = (count, pages[pid][1])
            names = [row.name for row in volumes.values()]
            if len(names) != len(set(names)):
                raise OSError(errno.EIO, "metadata commit failed: two volumes would share a name")
            refcount_pages = {**s.refcount_pages, **{i: bytes(b) for i, b in txn.refcount_pages.items()}}
            high = max([s.max_page_id, *txn.pages])
            self.state.superblock, self.state.volumes, self.state.roots = superblock, volumes, roots
            self.state.pages, self.state.refcount_pages, self.state.max_page_id = pages, refcount_pages, high

    def integrity_problems(self) -> list[str]:
        return []

    def close(self) -> None:
        pass
