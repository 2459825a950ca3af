"""Fault injection: a data store and a metadata store that fail at the Nth call.

`FaultyStore` is a filter over any DataStore (nbdkit's error filter, in
spirit); `FaultyMeta` wraps the pool's metadata store and fails commits, the
reads of pages, page refcounts, root tables and volume rows, and the claim
and release of leases. A
fault is armed for one call index among the chosen verbs and fires once:

- "eio": the call raises EIO and does nothing;
- "enospc": the call raises ENOSPC and does nothing (a full host);
- "short": a pwritev writes only part of its bytes, then raises ENOSPC
  (what a filling disk does); other verbs raise ENOSPC.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thinblock.meta.base import CommitResult, Lease, Transaction
from thinblock.store.base import DataStore, FilterStore

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

STORE_VERBS = ("pread", "pwritev", "punch", "zero", "preallocate", "flush")
KINDS = ("eio", "enospc", "short")


@dataclass
class Fault:
    verbs: tuple[str, ...]
    after: int  # calls of those verbs that still succeed first
    kind: str
    fired: bool = False
    times: int = 1  # how many calls fail once it fires


def _error(kind: str, what: str) -> OSError:
    code = errno.EIO if kind == "eio" else errno.ENOSPC
    return OSError(code, f"injected {os.strerror(code)} in {what}")


class _Armed:
    def __init__(self) -> None:
        self.fault: Fault | None = None

    def arm(self, fault: Fault | None) -> None:
        self.fault = fault

    @property
    def fired(self) -> bool:
        return self.fault is not None and self.fault.fired

    def _hit(self, verb: str) -> Fault | None:
        fault = self.fault
        if fault is None or fault.times <= 0 or verb not in fault.verbs:
            return None
        if fault.after > 0:
            fault.after -= 1
            return None
        fault.fired = True
        fault.times -= 1
        return fault


class FaultyStore(_Armed, FilterStore):
    """A DataStore filter that fails one chosen call."""

    def __init__(self, inner: DataStore) -> None:
        _Armed.__init__(self)
        FilterStore.__init__(self, inner)

    def _check(self, verb: str) -> None:
        fault = self._hit(verb)
        if fault is not None:
            raise _error(fault.kind, verb)

    def pread(self, offset: int, length: int) -> bytes:
        self._check("pread")
        return self.inner.pread(offset, length)

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        fault = self._hit("pwritev")
        if fault is not None:
            if fault.kind == "short":
                data = b"".join(bytes(b) for b in buffers)
                if len(data) > 1:
                    self.inner.pwritev(offset, [data[: len(data) // 2]])
            raise _error(fault.kind, "pwritev")
        self.inner.pwritev(offset, buffers)

    def punch(self, offset: int, length: int) -> None:
        self._check("punch")
        self.inner.punch(offset, length)

    def zero(self, offset: int, length: int) -> None:
        self._check("zero")
        self.inner.zero(offset, length)

    def preallocate(self, offset: int, length: int) -> None:
        self._check("preallocate")
        self.inner.preallocate(offset, length)

    def flush(self) -> None:
        self._check("flush")
        self.inner.flush()

    # The batch verbs run item by item through pread/pwritev above, so a fault can hit
    # any read or write of a batch (FilterStore would hand the batch to the inner store).

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return DataStore.read_many(self, ranges)

    def write_many(self, writes: Sequence[tuple[int, Sequence[bytes | memoryview]]]) -> None:
        DataStore.write_many(self, writes)


class FaultyMeta(_Armed):
    """The pool's metadata store with commits that fail on command (everything else passes through)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def commit(self, txn: Transaction) -> CommitResult:
        fault = self._hit("commit")
        if fault is not None:
            raise _error(fault.kind, "metadata commit")
        result: CommitResult = self.inner.commit(txn)
        return result

    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        """The batch read of page counts (snapshots and removals) fails on command too."""
        fault = self._hit("page_refcounts")
        if fault is not None:
            raise _error(fault.kind, "page refcount read")
        result: dict[int, int] = self.inner.page_refcounts(page_ids)
        return result

    def page(self, page_id: int) -> tuple[int, bytes] | None:
        """A single page's read (a page the cache misses) fails on command too."""
        fault = self._hit("page")
        if fault is not None:
            raise _error(fault.kind, "page read")
        result: tuple[int, bytes] | None = self.inner.page(page_id)
        return result

    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        """The batch read of pages (a snapshot's removal) fails on command too."""
        fault = self._hit("pages")
        if fault is not None:
            raise _error(fault.kind, "page read")
        result: dict[int, tuple[int, bytes]] = self.inner.pages(page_ids)
        return result

    def roots(self, volume_id: int) -> dict[int, int]:
        """A root table's read (a runtime claim reads its volume's again) fails on command too."""
        fault = self._hit("roots")
        if fault is not None:
            raise _error(fault.kind, "root table read")
        result: dict[int, int] = self.inner.roots(volume_id)
        return result

    def volumes(self) -> Any:
        """The volume rows' read (a runtime claim, a pool-level step) fails on command too."""
        fault = self._hit("volumes")
        if fault is not None:
            raise _error(fault.kind, "volume table read")
        return self.inner.volumes()

    def claim_volumes(self, volume_ids: Sequence[int], owner: str) -> dict[int, Lease]:
        """Taking leases (an owner's open, a runtime claim) fails on command too: none taken."""
        fault = self._hit("claim_volumes")
        if fault is not None:
            raise _error(fault.kind, "lease claim")
        result: dict[int, Lease] = self.inner.claim_volumes(volume_ids, owner)
        return result

    def release_volume(self, lease: Lease) -> None:
        """Giving a lease up fails on command too, as the contract allows: the lease is
        given up all the same, and only its record's update fails (meta/base.py)."""
        fault = self._hit("release_volume")
        self.inner.release_volume(lease)
        if fault is not None:
            raise _error(fault.kind, "lease release")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def install(pool: Pool, *, meta: FaultyMeta | None = None, store: DataStore | None = None) -> None:
    """Put a faulty store under an open pool: every collaborator that holds the
    metadata store (the open transaction's reads, the committer) or the data store
    (requests, the committer's syncs and punches, growth) gets the wrapper."""
    if meta is not None:
        pool.meta = pool.txn.meta = pool.committer.meta = meta  # type: ignore[assignment]
    if store is not None:
        pool.store = pool.committer.store = pool.accounts.store = store
