"""Where block bytes live, behind one small contract (borgstore / nbdkit style).

A data store is a flat byte space addressed by offset. It *declares* what it
does natively (`capabilities()`): each of punch, zero and preallocate is NATIVE or
NONE. `FallbackStore` (store/fallback.py) is the single place where a NONE
operation is emulated, and it reports those as EMULATE; no caller ever skips
one silently. The contract suite in tests/test_store_contract.py runs against
every store in `thinblock.store.STORES`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

OPTIONAL_VERBS = ("punch", "zero", "preallocate")


class Support(enum.Enum):
    """How a store does an optional operation."""

    NATIVE = "native"  # the store does it itself
    EMULATE = "emulate"  # FallbackStore does it with other verbs
    NONE = "none"  # the store cannot: calling it raises NotSupportedError and changes nothing


class DataStore(ABC):
    """The contract every data store keeps.

    Offsets and lengths are bytes; callers only ever pass ranges inside
    `size_bytes`. Every method may be called from many threads at once, for
    ranges that do not overlap. A method the store declares NONE raises
    NotSupportedError and changes nothing; so does a NATIVE one that the layer
    below turns out to refuse (the store then declares it NONE from then on).
    A failure of the layer below is an OSError with its errno (ENOSPC, EIO).
    """

    @property
    @abstractmethod
    def size_bytes(self) -> int:
        """Current size of the byte space."""

    @abstractmethod
    def pread(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`."""

    @abstractmethod
    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        """Write the buffers back to back from `offset`, all of them."""

    @abstractmethod
    def punch(self, offset: int, length: int) -> None:
        """Give the range's space back to the layer below; it then reads zeros."""

    @abstractmethod
    def zero(self, offset: int, length: int) -> None:
        """Make the range read zeros and keep its space allocated."""

    @abstractmethod
    def preallocate(self, offset: int, length: int) -> None:
        """Reserve real space for the range; its contents are unspecified."""

    @abstractmethod
    def flush(self) -> None:
        """Make every completed write durable."""

    @abstractmethod
    def grow(self, new_size_bytes: int) -> None:
        """Make the byte space at least new_size_bytes, or raise ThinblockError."""

    def write_behind(self, offset: int, data: bytes) -> None:
        """A small write that need not be complete when this returns, only by the
        next flush (the owner header after a commit). The default writes at once."""
        self.pwritev(offset, [data])

    def start_writeback(self) -> None:  # noqa: B027 (optional: doing nothing is a valid answer)
        """A hint, no promise: start moving completed writes to the layer below now,
        without waiting, so that a later flush has little left to do (bulk copies
        call it as they go). Stores without such a thing do nothing."""

    @abstractmethod
    def capabilities(self) -> dict[str, Support]:
        """For each of OPTIONAL_VERBS: NATIVE or NONE (EMULATE from FallbackStore)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store's resources."""

    @property
    def queue_depth(self) -> int:
        """How many operations the store wants in flight: 1 for a local disk (a request
        runs at once, on the thread that read it), more for a remote store whose
        latency only concurrency hides."""
        return 1

    @property
    def reserves_space(self) -> bool:
        """Whether preallocate and zero set real space aside in the layer below. A store
        that cannot (RADOS has no reservation) says so here, declares the verbs NATIVE
        and documents what they do instead; the pool's own accounting still sets the
        space aside."""
        return True

    # Batch verbs: a store with many operations in flight (a remote one) overrides
    # these; the defaults run one after another.

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """pread of each (offset, length), results in order; all or an exception."""
        return [self.pread(offset, length) for offset, length in ranges]

    def write_many(self, writes: Sequence[tuple[int, Sequence[bytes | memoryview]]]) -> None:
        """pwritev of each (offset, buffers); the ranges do not overlap. Returns once all
        completed; on failure some may have landed (the caller treats them as garbage)."""
        for offset, buffers in writes:
            self.pwritev(offset, buffers)


class FilterStore(DataStore):
    """A layer over another store that passes every verb to it (nbdkit's filter
    holding `next`): subclasses override only what they change. The batch verbs go
    to the inner store's batch verbs, so a filter that changes pread or pwritev must
    change read_many and write_many too (DataStore's defaults run them item by item)."""

    def __init__(self, inner: DataStore) -> None:
        self.inner = inner

    @property
    def size_bytes(self) -> int:
        return self.inner.size_bytes

    def pread(self, offset: int, length: int) -> bytes:
        return self.inner.pread(offset, length)

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        self.inner.pwritev(offset, buffers)

    def punch(self, offset: int, length: int) -> None:
        self.inner.punch(offset, length)

    def zero(self, offset: int, length: int) -> None:
        self.inner.zero(offset, length)

    def preallocate(self, offset: int, length: int) -> None:
        self.inner.preallocate(offset, length)

    def flush(self) -> None:
        self.inner.flush()

    def grow(self, new_size_bytes: int) -> None:
        self.inner.grow(new_size_bytes)

    def write_behind(self, offset: int, data: bytes) -> None:
        self.inner.write_behind(offset, data)

    def start_writeback(self) -> None:
        self.inner.start_writeback()

    def capabilities(self) -> dict[str, Support]:
        return self.inner.capabilities()

    @property
    def queue_depth(self) -> int:
        return self.inner.queue_depth

    @property
    def reserves_space(self) -> bool:
        return self.inner.reserves_space

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.inner.read_many(ranges)

    def write_many(self, writes: Sequence[tuple[int, Sequence[bytes | memoryview]]]) -> None:
        self.inner.write_many(writes)

    def close(self) -> None:
        self.inner.close()
