"""What every transfer job shares: a progress counter, requests in flight in order,
cutting ranges into requests and data into zero and non-zero block runs, and a
volume frozen for the length of a job."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from thinblock.core.mapping import BlockState
from thinblock.core.pool import MAX_VOLUME_BYTES, Pool
from thinblock.core.snapshot import stage
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.progress import ProgressFn
from thinblock.sizes import format_size
from thinblock.zeros import is_zero

CHUNK = 1 << 20  # bytes per request to a source, a sink or a volume
IN_FLIGHT = 8  # requests running at once
WINDOW = 4 * IN_FLIGHT  # requests started ahead of the one being finished (ordered output)
WRITEBACK_STEP = 64 << 20  # bulk writes ask the store to start writing back this often
_T = TypeVar("_T")
_R = TypeVar("_R")


class Progress:
    """A thread-safe byte counter in front of a ProgressFn, telling it at most ten
    times a second (and always at the end)."""

    def __init__(self, fn: ProgressFn, total: int) -> None:
        self.fn, self.total = fn, total
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        fn(0, total)

    def add(self, n: int) -> None:
        with self._lock:  # fn is called by one thread at a time
            self.done += n
            now = time.monotonic()
            if now - self._last >= 0.1:
                self._last = now
                self.fn(self.done, self.total)

    def end(self) -> None:
        with self._lock:
            self.fn(self.done, max(self.total, self.done))


def ordered(fn: Callable[[_T], _R], items: Iterable[_T]) -> Iterator[_R]:
    """fn over items on IN_FLIGHT threads, results in the items' order; at most WINDOW
    started ahead. A failure stops what has not started and is raised in order."""
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="thinblock-job") as pool:
        pending: deque[Future[_R]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= WINDOW:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def run_all(fn: Callable[[_T], object], items: Iterable[_T]) -> None:
    for _ in ordered(fn, items):
        pass


def chunks(offset: int, length: int, step: int = CHUNK) -> Iterator[tuple[int, int]]:
    """[offset, +length) cut at multiples of step (so pieces start on block boundaries)."""
    end = offset + length
    while offset < end:
        stop = min(end, (offset // step + 1) * step)
        yield offset, stop - offset
        offset = stop


def block_runs(offset: int, data: bytes, block_size: int) -> Iterator[tuple[int, int, bool]]:
    """(offset, length, zero) runs of data, cut on block boundaries of the volume."""
    view = memoryview(data)
    runs: list[list[Any]] = []
    for start, n in chunks(offset, len(data), block_size):
        zero = is_zero(view[start - offset : start - offset + n])
        if runs and runs[-1][2] == zero:
            runs[-1][1] += n
        else:
            runs.append([start, n, zero])
    for start, n, zero in runs:
        yield start, n, zero


def data_extents(vol: Volume) -> list[tuple[int, int, bool]]:
    """(offset, length, data) runs of a volume, from its metadata: DATA or not."""
    out: list[tuple[int, int, bool]] = []
    pos = 0
    for n, state in vol.block_status(0, vol.size_bytes):
        data = state is BlockState.DATA
        if out and out[-1][2] == data:
            out[-1] = (out[-1][0], out[-1][1] + n, data)
        else:
            out.append((pos, n, data))
        pos += n
    return out


def read_extents(
    vol: Volume, extents: Iterable[tuple[int, int, bool]], tell: Progress
) -> Iterator[tuple[int, int, bytes | None]]:
    """(offset, length, bytes) of each (offset, length, data) extent of vol, in order:
    data cut into CHUNK requests read IN_FLIGHT at once (each counted by tell), a
    range that is not data handed on whole as None, with no read."""

    def read(piece: tuple[int, int, bool]) -> tuple[int, int, bytes | None]:
        offset, n, data = piece
        if not data:
            return offset, n, None
        got = vol.read(offset, n)
        tell.add(n)
        return offset, n, got

    pieces = ((o, k, data) for offset, n, data in extents for o, k in (chunks(offset, n) if data else [(offset, n)]))
    return ordered(read, pieces)


class WriteBehind:
    """Counts bytes written to a pool and, every WRITEBACK_STEP of them, asks its data
    store to start writing back (Pool.start_writeback), so a bulk job's final sync
    waits for the tail only, not for everything. Thread-safe."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.written = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            before = self.written
            self.written += n
            crossed = self.written // WRITEBACK_STEP != before // WRITEBACK_STEP
        if crossed:
            self.pool.start_writeback()


def visible(pool: Pool, name: str, kind: str | None = None) -> Volume:
    vol = pool.visible_volume(name)
    if vol is None:
        raise ThinblockError(f"no {kind or 'volume or snapshot'} {name!r} in pool {pool.path}")
    if kind is not None and vol.row.kind != kind:
        raise ThinblockError(f"{name!r} is a {vol.row.kind}, not a {kind}")
    return vol


@contextlib.contextmanager
def stable(pool: Pool, name: str) -> Iterator[Volume]:
    """The volume or snapshot called name, frozen for the job: a snapshot as it is, a
    volume through a staging snapshot of it (one moment, however long the job takes)."""
    vol = visible(pool, name)
    if vol.readonly:
        yield vol
        return
    snap = stage(pool, vol, "export", kind="snapshot")
    try:
        yield snap
    finally:
        pool.remove_volume(snap.name)


def elapsed(start: float) -> float:
    return round(time.monotonic() - start, 3)


def put(vol: Volume, offset: int, data: bytes, overwrite: bool, behind: WriteBehind) -> tuple[int, int]:
    """Write data's non-zero blocks; its zero blocks only when overwriting, as metadata.
    Returns (bytes written, zero bytes)."""
    written = zero = 0
    for start, n, is_zero_run in block_runs(offset, data, vol.block_size):
        if is_zero_run:
            zero += n
            if overwrite:
                vol.write_zeroes(start, n)
        else:
            vol.write(start, memoryview(data)[start - offset : start - offset + n])
            written += n
    behind.add(written)
    return written, zero


def bound_size(size_bytes: int, max_size_bytes: int | None, what: str) -> None:
    """One sentence for a size an untrusted source claims beyond --max-size, or beyond
    the largest volume thinblock supports; called before any work starts."""
    if max_size_bytes is not None and size_bytes > max_size_bytes:
        why = f"--max-size {format_size(max_size_bytes)}"
    elif size_bytes > MAX_VOLUME_BYTES:
        why = f"the largest volume thinblock supports ({MAX_VOLUME_BYTES} bytes)"
    else:
        return
    raise ThinblockError(f"{what} is {format_size(size_bytes)} ({size_bytes} bytes), beyond {why}: refused")
