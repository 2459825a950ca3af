"""What every frontend does for a client, written once: the export handle.

An NBD connection and a FUSE file handle are both one client's use of one
volume. Both open an `Export`, which counts the client (removal and rollback
refuse while any is open), refuses writes to read-only exports, clips reads at
the end of the volume, says what errno a failure is, and turns block states
into the views clients ask for: allocation (NBD base:allocation's HOLE and ZERO),
the space guarantee (thinblock:guaranteed) and data (SEEK_DATA/SEEK_HOLE). It also
counts every request by kind, bytes, latency and errno (thinblock.stats), so no
frontend counts on its own. The frontends only translate protocols.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, TypeVar

from thinblock.core.mapping import BlockState
from thinblock.core.runs import Runs
from thinblock.errors import ReadOnlyError

if TYPE_CHECKING:
    from thinblock.core.pool import Pool
    from thinblock.core.volume import Volume

_T = TypeVar("_T")


def errno_of(exc: BaseException) -> int:
    """The errno a client is given for a failed request (EIO for anything unexpected)."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


class Export:
    """One client's open volume. Close it exactly once (close() is idempotent)."""

    def __init__(
        self, pool: Pool, volume: Volume, *, read_only: bool = False, counted: bool = True, holder: str = "a client"
    ) -> None:
        """counted=False: one call made without an open handle (FUSE may), not a client.
        holder: who this is, as a refusal to remove or roll back the volume names it."""
        self.pool = pool
        self.holder = holder
        self.volume = volume
        self.read_only = read_only or volume.readonly
        self._open = counted
        # The counters of this export's requests; None unless metrics are served.
        self.stats = pool.stats.export(volume.name)
        # Snapshots this client compares the volume with (NBD thinblock:changed:NAME),
        # by the context's name, bound once when the client starts using the export:
        # a later snapshot that takes the name (remove and retake, rename) is another
        # snapshot, and comparing with it would hide changes. None: there was none.
        self.compared: dict[str, Volume | None] = {}
        if counted:
            with pool.lock:
                volume.holders[holder] += 1

    def close(self) -> None:
        with self.pool.lock:
            if self._open:
                self._open = False
                holders = self.volume.holders
                holders[self.holder] -= 1
                if holders[self.holder] <= 0:
                    del holders[self.holder]

    @property
    def name(self) -> str:
        return self.volume.name

    @property
    def size_bytes(self) -> int:
        return self.volume.size_bytes

    @property
    def gone(self) -> bool:
        return self.volume.removed

    def _writable(self) -> Volume:
        if self.read_only:
            raise ReadOnlyError(f"export {self.volume.name} is read-only")
        return self.volume

    # ----- counting -----------------------------------------------------------------
    # Request kinds: read, write, trim, zero, provision, flush, block_status, cache.

    def counted(self, kind: str, nbytes: int, run: Callable[[], _T]) -> _T:
        """run() as one request of kind, counted (bytes only when it succeeds). The
        verbs below use it; a frontend only for work it does itself (an NBD block
        status walks several metadata contexts through allocation() and guaranteed())."""
        stats = self.stats
        if stats is None:
            return run()
        started = perf_counter()
        try:
            result = run()
        except BaseException as exc:
            stats.failed(kind, errno_of(exc), started)
            raise
        stats.done(kind, nbytes, started)
        return result

    def refused(self, kind: str, code: int) -> None:
        """A request the frontend rejected before running it (a range past the end, a
        bad flag): counted as a failure with that errno."""
        if self.stats is not None:
            self.stats.failed(kind, code)

    # ----- the verbs --------------------------------------------------------------

    def read(self, offset: int, length: int) -> bytes:
        return self.counted("read", length, lambda: self.volume.read(offset, length))

    def read_clipped(self, offset: int, length: int) -> bytes:
        """A file read: short at the end of the volume, empty beyond it."""
        length = max(0, min(length, self.volume.size_bytes - offset))
        return self.counted("read", length, lambda: self.volume.read(offset, length) if length else b"")

    def read_sparse(self, offset: int, length: int) -> list[tuple[int, int, bytes | None]]:
        return self.counted("read", length, lambda: self.volume.read_sparse(offset, length))

    def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        self.counted("write", len(data), lambda: self._writable().write(offset, data, fua=fua))

    def trim(self, offset: int, length: int, *, fua: bool = False) -> None:
        self.counted("trim", length, lambda: self._writable().trim(offset, length, fua=fua))

    def write_zeroes(
        self, offset: int, length: int, *, no_hole: bool = False, fast: bool = False, fua: bool = False
    ) -> None:
        self.counted(
            "zero",
            length,
            lambda: self._writable().write_zeroes(offset, length, no_hole=no_hole, fast=fast, fua=fua),
        )

    def provision(self, offset: int, length: int, *, fua: bool = False) -> None:
        self.counted("provision", length, lambda: self._writable().provision(offset, length, fua=fua))

    def cache(self, offset: int, length: int) -> None:
        """A prefetch hint: the data store is a local file or RADOS, nothing to warm."""
        self.counted("cache", length, lambda: None)

    def flush(self) -> None:
        self.counted("flush", 0, self.volume.flush)

    # ----- what clients are told about allocation -------------------------------------

    def allocation(self, offset: int, length: int) -> list[tuple[int, bool, bool]]:
        """(length, hole, zero) runs, as qemu-nbd and rbd report them: every mapped block
        is allocated (hole clear), shared or not; zero: the range reads zeros (UNMAPPED,
        ZEROED). Which ranges are sure to take writes on a full pool is a separate
        question, answered by guaranteed()."""
        runs = Runs(
            (n, (state is BlockState.UNMAPPED, state is not BlockState.DATA))
            for n, state in self.volume.block_status(offset, length)
        )
        return [(n, hole, zero) for n, (hole, zero) in runs.pairs()]

    def guaranteed(self, offset: int, length: int) -> list[tuple[int, bool]]:
        """(length, guaranteed) runs: a write there never fails with ENOSPC
        (Volume.guaranteed_status keeps that rule); never on a read-only export."""
        if self.read_only:
            return [(length, False)] if length else []
        return self.volume.guaranteed_status(offset, length)

    def data_runs(self, offset: int, length: int) -> list[tuple[int, bool]]:
        """(length, is_data) runs for SEEK_DATA/SEEK_HOLE: only DATA may read non-zero
        (counted as a block status request)."""
        return self.counted(
            "block_status",
            length,
            lambda: Runs(
                (n, state is BlockState.DATA) for n, state in self.volume.block_status(offset, length)
            ).pairs(),
        )
