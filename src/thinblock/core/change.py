"""What one mutating request will do, collected before any of it happens.

A request is planned under the pool lock into a `Change`: the fresh dblocks it
took, the data-store I/O it needs (`IoPlan`), and the mapping entries it will
publish. The I/O then runs with no pool lock held (the request's blocks are
range-locked, see rangelock), and the entries are published only once all of it
succeeded: rule 1 of docs/architecture.md, "an operation that fails changes nothing".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from thinblock.core.runs import add_range
from thinblock.iovec import IOV_MAX

if TYPE_CHECKING:
    from thinblock.store.base import DataStore


class IoPlan:
    """Data-store ranges of one request, merged when contiguous, run in one order:
    space first (preallocate), then zero-ranges, then copies for copy-on-write, then writes."""

    def __init__(self) -> None:
        self.allocs: list[list[int]] = []
        self.zeros: list[list[int]] = []
        self.copies: list[tuple[int, int, int]] = []  # (from, to, length)
        self.writes: list[tuple[int, list[bytes | memoryview], int]] = []

    def __bool__(self) -> bool:
        return bool(self.allocs or self.zeros or self.copies or self.writes)

    def preallocate(self, offset: int, length: int) -> None:
        """Reserve real space for the range (an emulated preallocate writes zeros, so it runs first)."""
        add_range(self.allocs, offset, length)

    def zero(self, offset: int, length: int) -> None:
        """Zero a range before this request's writes land (zero-range, not written zeros)."""
        add_range(self.zeros, offset, length)

    def copy(self, source: int, dest: int, length: int) -> None:
        """Copy bytes another block holds (copy-on-write of a shared block)."""
        if length:
            self.copies.append((source, dest, length))

    def write(self, offset: int, buf: bytes | memoryview) -> None:
        if not len(buf):
            return
        if self.writes:
            start, bufs, length = self.writes[-1]
            if start + length == offset and len(bufs) < IOV_MAX:
                bufs.append(buf)
                self.writes[-1] = (start, bufs, length + len(buf))
                return
        self.writes.append((offset, [buf], len(buf)))

    def run(self, store: DataStore) -> None:
        for offset, length in self.allocs:
            store.preallocate(offset, length)
        for offset, length in self.zeros:
            store.zero(offset, length)
        # The copies' targets and the writes never overlap: one batch, all in flight
        # on a store that can do that (store/base.py's batch verbs).
        writes: list[tuple[int, Sequence[bytes | memoryview]]] = []
        if self.copies:
            copied = store.read_many([(source, length) for source, _, length in self.copies])
            writes += [(dest, [data]) for (_, dest, _), data in zip(self.copies, copied, strict=True)]
        writes += [(offset, bufs) for offset, bufs, _ in self.writes]
        if len(writes) == 1:
            store.pwritev(*writes[0])
        elif writes:
            store.write_many(writes)


class Change:
    """One request's plan: fresh dblocks, I/O, and the entries it will set."""

    __slots__ = ("entries", "fresh", "in_place_zeroed", "io", "runs_of_fresh")

    def __init__(self) -> None:
        self.fresh: list[int] = []
        self.io = IoPlan()
        self.entries: list[tuple[int, int]] = []  # (vblock, new entry)
        self.runs_of_fresh: list[tuple[int, list[int]]] = []  # (first vblock, fresh dblocks) of UNMAPPED runs
        self.in_place_zeroed: list[int] = []  # dblocks of ZEROED blocks written in place

    def __bool__(self) -> bool:
        return bool(self.fresh or self.entries or self.runs_of_fresh or self.io)

    def set(self, vblock: int, entry: int) -> None:
        self.entries.append((vblock, entry))
