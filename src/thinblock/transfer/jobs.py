"""import, export, export-diff, import-diff and sparsify, run on an open pool.

Each job runs in the process that holds the pool: the command itself when no
one else does, or the server, which gets the command's open files over the
control socket (admin/control.py). Jobs call the volume verbs of core/volume.py
and nothing below them, so every rule of the block contract still holds; they
report through a ProgressFn, which may raise to cancel them.

Zeros are free in both directions: what a source says is a hole or reads zero is
never read, all-zero blocks are never written, and what the pool knows reads
zero is never read from its data store. Work runs IN_FLIGHT requests at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from thinblock.core.delta import changed_extents, changed_ranges
from thinblock.core.mapping import BlockState
from thinblock.core.pool import SECTOR_BYTES, Pool
from thinblock.core.snapshot import adopt, create_snapshot
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.formats import rbd
from thinblock.progress import ProgressFn
from thinblock.sizes import format_size
from thinblock.transfer.images import RandomSink, RandomSource, StreamReader, StreamWriter
from thinblock.zeros import is_zero

CHUNK = 1 << 20  # bytes per request to a source, a sink or a volume
IN_FLIGHT = 8  # requests running at once
WINDOW = 4 * IN_FLIGHT  # requests started ahead of the one being finished (ordered output)
SPARSIFY_STEP = 16 << 20
WRITEBACK_STEP = 64 << 20  # bulk writes ask the store to start writing back this often
_T = TypeVar("_T")
_R = TypeVar("_R")


class _Progress:
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


def _ordered(fn: Callable[[_T], _R], items: Iterable[_T]) -> Iterator[_R]:
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


def _run_all(fn: Callable[[_T], object], items: Iterable[_T]) -> None:
    for _ in _ordered(fn, items):
        pass


def _chunks(offset: int, length: int, step: int = CHUNK) -> Iterator[tuple[int, int]]:
    """[offset, +length) cut at multiples of step (so pieces start on block boundaries)."""
    end = offset + length
    while offset < end:
        stop = min(end, (offset // step + 1) * step)
        yield offset, stop - offset
        offset = stop


def _block_runs(offset: int, data: bytes, block_size: int) -> Iterator[tuple[int, int, bool]]:
    """(offset, length, zero) runs of data, cut on block boundaries of the volume."""
    view = memoryview(data)
    runs: list[list[Any]] = []
    for start, n in _chunks(offset, len(data), block_size):
        zero = is_zero(view[start - offset : start - offset + n])
        if runs and runs[-1][2] == zero:
            runs[-1][1] += n
        else:
            runs.append([start, n, zero])
    for start, n, zero in runs:
        yield start, n, zero


def _data_extents(vol: Volume) -> list[tuple[int, int, bool]]:
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


def visible(pool: Pool, name: str, kind: str | None = None) -> Volume:
    vol = pool.visible_volume(name)
    if vol is None:
        raise ThinblockError(f"no {kind or 'volume or snapshot'} {name!r} in pool {pool.path}")
    if kind is not None and vol.row.kind != kind:
        raise ThinblockError(f"{name!r} is a {vol.row.kind}, not a {kind}")
    return vol


@contextlib.contextmanager
def _stable(pool: Pool, name: str) -> Iterator[Volume]:
    """The volume or snapshot called name, frozen for the job: a snapshot as it is, a
    volume through a staging snapshot of it (one moment, however long the job takes)."""
    vol = visible(pool, name)
    if vol.readonly:
        yield vol
        return
    snap = pool.add_staging(vol, "export", kind="snapshot")
    try:
        yield snap
    finally:
        pool.remove_volume(snap.name)


def _elapsed(start: float) -> float:
    return round(time.monotonic() - start, 3)


# ----- import -------------------------------------------------------------------------


def import_image(
    pool: Pool,
    name: str,
    source: RandomSource | StreamReader,
    progress: ProgressFn,
    *,
    size_bytes: int | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Copy a raw image (a file, an NBD export, a stream) into volume `name`, creating it
    with the source's size unless it exists with that size. Only what the source holds
    as data is read, and only blocks that are not all zero are written. A volume that
    holds data is overwritten only with force (then the source's zeros are written as
    zeros, which costs metadata only). A volume this created is removed on failure."""
    start = time.monotonic()
    stream = isinstance(source, StreamReader)
    size = size_bytes if stream else source.size_bytes  # type: ignore[union-attr]
    with pool.lock:
        vol = pool.visible_volume(name)
        if vol is not None and vol.row.kind != "volume":
            raise ThinblockError(f"{name!r} is a {vol.row.kind}: import into a volume")
        if vol is None and size is None:
            raise ThinblockError(f"importing a stream into a new volume {name} needs its size (--size)")
        if vol is not None:
            if size is not None and size != vol.size_bytes:
                raise ThinblockError(
                    f"volume {name} is {format_size(vol.size_bytes)} ({vol.size_bytes} bytes) and the source"
                    f" {format_size(size)} ({size} bytes): the sizes must match; resize the volume or import"
                    " into a new one"
                )
            size = vol.size_bytes
            mapped = (vol.row.data_blocks + vol.row.zeroed_blocks) * pool.block_size
            if mapped and not force:
                raise ThinblockError(
                    f"volume {name} already holds data ({format_size(mapped)} mapped): pass --force to overwrite it"
                )
            pool.refuse_if_busy(vol, "import into")
    assert size is not None
    if size % SECTOR_BYTES:
        raise ThinblockError(
            f"the source is {size} bytes, not a whole number of {SECTOR_BYTES}-byte sectors: a volume cannot"
            " hold it exactly"
        )
    created = vol is None
    if vol is None:
        vol = pool.create_volume(name, size)
    overwrite = not created
    try:
        if stream:
            assert isinstance(source, StreamReader)
            figures = _import_stream(vol, source, size, overwrite, progress)
        else:
            figures = _import_random(vol, source, overwrite, progress)  # type: ignore[arg-type]
        vol.flush()
    except BaseException:
        if created:
            with contextlib.suppress(Exception):
                pool.remove_volume(name)
        raise
    return {"volume": name, "size_bytes": size, "created": created, **figures, "seconds": _elapsed(start)}


def _put(vol: Volume, offset: int, data: bytes, overwrite: bool) -> tuple[int, int]:
    """Write data's non-zero blocks; its zero blocks only when overwriting, as metadata.
    Returns (bytes written, zero bytes)."""
    written = zero = 0
    for start, n, is_zero_run in _block_runs(offset, data, vol.block_size):
        if is_zero_run:
            zero += n
            if overwrite:
                vol.write_zeroes(start, n)
        else:
            vol.write(start, memoryview(data)[start - offset : start - offset + n])
            written += n
    return written, zero


def _import_random(vol: Volume, source: RandomSource, overwrite: bool, progress: ProgressFn) -> dict[str, int]:
    extents = list(source.extents())
    data_total = sum(n for _, n, data in extents if data)
    tell = _Progress(progress, data_total)
    if overwrite:
        for offset, n, data in extents:
            if not data:
                vol.write_zeroes(offset, n)
    totals = [0, 0]
    lock = threading.Lock()

    def copy(piece: tuple[int, bytes]) -> None:
        offset, got = piece
        written, zero = _put(vol, offset, got, overwrite)
        with lock:
            before = totals[0]
            totals[0] += written
            totals[1] += zero
            crossed = totals[0] // WRITEBACK_STEP != before // WRITEBACK_STEP
        if crossed:
            vol.pool.start_writeback()  # the final sync then waits for the tail only
        tell.add(len(got))

    # Reads come in order from the source (overlapping on the wire, for NBD); the
    # writes into the volume run IN_FLIGHT at once.
    _run_all(copy, source.stream(piece for offset, n, data in extents if data for piece in _chunks(offset, n)))
    tell.end()
    return {"read_bytes": data_total, "written_bytes": totals[0], "zero_bytes_skipped": totals[1]}


def _import_stream(
    vol: Volume, source: StreamReader, size: int, overwrite: bool, progress: ProgressFn
) -> dict[str, int]:
    tell = _Progress(progress, size)
    totals = [0, 0]
    lock = threading.Lock()

    def pieces() -> Iterator[tuple[int, bytes]]:
        offset = 0
        while True:
            data = source.read(CHUNK - offset % CHUNK)
            if not data:
                break
            if offset + len(data) > size:
                raise ThinblockError(f"the stream holds more than volume {vol.name}'s {size} bytes")
            yield offset, data
            offset += len(data)
        if offset < size and overwrite:
            vol.write_zeroes(offset, size - offset)
        totals.append(offset)

    def copy(piece: tuple[int, bytes]) -> None:
        offset, data = piece
        written, zero = _put(vol, offset, data, overwrite)
        with lock:
            totals[0] += written
            totals[1] += zero
        tell.add(len(data))

    _run_all(copy, pieces())
    tell.end()
    return {"read_bytes": totals[2], "written_bytes": totals[0], "zero_bytes_skipped": totals[1]}


# ----- export -------------------------------------------------------------------------


def export_image(
    pool: Pool, name: str, sink: RandomSink | StreamWriter, progress: ProgressFn, *, fmt: str = "raw"
) -> dict[str, Any]:
    """Copy a volume or snapshot out: to a raw file or NBD export (holes stay holes, or
    are sent as zeroes), or as a stream: raw (every byte), or rbd's "rbd image v2"
    export format, which `rbd import` reads. A live volume is copied as of one moment."""
    start = time.monotonic()
    if fmt not in ("raw", "rbd"):
        raise ThinblockError(f"unknown export format {fmt!r}: raw or rbd")
    with _stable(pool, name) as vol:
        extents = _data_extents(vol)
        data_total = sum(n for _, n, data in extents if data)
        tell = _Progress(progress, data_total)
        size = vol.size_bytes

        def read(piece: tuple[int, int, bool]) -> tuple[int, int, bytes | None]:
            offset, n, data = piece
            got = vol.read(offset, n) if data else None
            if data:
                tell.add(n)
            return offset, n, got

        pieces = (
            (o, n, data)
            for offset, length, data in extents
            for o, n in _chunks(offset, length, CHUNK if data else 1 << 62)
        )
        written = 0
        if isinstance(sink, StreamWriter):
            encoder = rbd.DiffEncoder(2)
            if fmt == "rbd":
                sink.write(rbd.image_header() + encoder.header() + encoder.size(size))
            for offset, n, got in _ordered(read, pieces):
                if fmt == "raw":
                    if got is None:
                        sink.zeros(n)
                    else:
                        sink.write(got)
                        written += n
                    continue
                if got is None:
                    continue
                for o, k, zero in _block_runs(offset, got, vol.block_size):
                    if not zero:
                        sink.write(encoder.data(o, k))
                        sink.write(memoryview(got)[o - offset : o - offset + k])
                        written += k
            if fmt == "rbd":
                sink.write(encoder.end())
        else:
            if fmt != "raw":
                raise ThinblockError("--format rbd writes a stream: give a file name or -, not an NBD URI")
            lock = threading.Lock()
            counts = [0]

            def put(piece: tuple[int, int, bool]) -> None:
                offset, n, got = read(piece)
                if got is None:
                    sink.zero(offset, n)
                    return
                for o, k, zero in _block_runs(offset, got, vol.block_size):
                    if zero:
                        sink.zero(o, k)
                    else:
                        sink.write(o, got[o - offset : o - offset + k])
                        with lock:
                            counts[0] += k

            _run_all(put, pieces)
            written = counts[0]
        sink.finish()
        tell.end()
    return {
        "name": name,
        "size_bytes": size,
        "format": fmt,
        "read_bytes": data_total,
        "written_bytes": written,
        "seconds": _elapsed(start),
    }


# ----- rbd diffs ----------------------------------------------------------------------


def diff_name(pool: Pool, snap: Volume) -> str:
    """A snapshot's name in an rbd diff: rbd's snapshots belong to an image, so
    VOLUME@SNAP is written as SNAP when VOLUME is the volume it was taken of."""
    origin = pool.volume_by_id(snap.row.origin_id)
    if origin is not None and snap.name.startswith(origin.name + "@"):
        return snap.name[len(origin.name) + 1 :]
    return snap.name


def find_snapshot(pool: Pool, vol: Volume, name: str, *, exact_first: bool) -> Volume | None:
    """A snapshot of vol known in a diff as `name`: VOLUME@name, or a snapshot called
    name (taken of vol, unless exact_first: the name a user typed is taken as it is)."""
    exact = pool.visible_volume(name)
    qualified = pool.visible_volume(f"{vol.name}@{name}")
    if exact is not None and exact.row.kind == "snapshot" and exact_first:
        return exact
    if qualified is not None and qualified.row.kind == "snapshot":
        return qualified
    if exact is not None and exact.row.kind == "snapshot" and exact.row.origin_id == vol.row.id:
        return exact
    return None


def export_diff(
    pool: Pool, name: str, from_snap: str | None, out: StreamWriter, progress: ProgressFn, *, version: int = 1
) -> dict[str, Any]:
    """Write what changed from snapshot from_snap to `name` (a snapshot, or a volume as of
    now) as an rbd diff stream: 'w' for changed data, 'z' for ranges that changed to
    zeros. Without from_snap, everything the volume holds as data. From metadata: only
    the changed data is read."""
    start = time.monotonic()
    with _stable(pool, name) as vol:
        named = visible(pool, name)
        image = named if named.row.kind == "volume" else pool.volume_by_id(named.row.origin_id) or named
        base = None
        if from_snap is not None:
            base = find_snapshot(pool, image, from_snap, exact_first=True)
            if base is None:
                raise ThinblockError(
                    f"no snapshot {from_snap!r} (nor {image.name}@{from_snap}) in pool {pool.path} to diff from"
                )
        if base is not None:
            extents = [(o, n, not zero) for o, n, zero in changed_extents(base, vol)]
        else:
            extents = [e for e in _data_extents(vol) if e[2]]
        data_total = sum(n for _, n, data in extents if data)
        zero_total = sum(n for _, n, data in extents if not data)
        tell = _Progress(progress, data_total)
        encoder = rbd.DiffEncoder(version)
        head = encoder.header()
        if base is not None:
            head += encoder.from_snap(diff_name(pool, base))
        if named.row.kind == "snapshot":
            head += encoder.to_snap(diff_name(pool, named))
        head += encoder.size(vol.size_bytes)
        out.write(head)
        written = len(head)

        def read(piece: tuple[int, int, bool]) -> tuple[int, int, bytes | None]:
            offset, n, data = piece
            if not data:
                return offset, n, None
            got = vol.read(offset, n)
            tell.add(n)
            return offset, n, got

        pieces = (
            (o, k, data) for offset, n, data in extents for o, k in _chunks(offset, n, CHUNK if data else 1 << 62)
        )
        for offset, n, got in _ordered(read, pieces):
            record = encoder.zero(offset, n) if got is None else encoder.data(offset, n)
            out.write(record)
            written += len(record)
            if got is not None:
                out.write(got)
                written += n
        out.write(encoder.end())
        out.finish()
        tell.end()
        size = vol.size_bytes
    return {
        "name": name,
        "from_snap": diff_name(pool, base) if base is not None else None,
        "to_snap": diff_name(pool, named) if named.row.kind == "snapshot" else None,
        "version": version,
        "size_bytes": size,
        "data_bytes": data_total,
        "zero_bytes": zero_total,
        "stream_bytes": written + 1,
        "seconds": _elapsed(start),
    }


def _events(decoder: rbd.DiffDecoder | rbd.ImageDecoder, reader: StreamReader, tell: _Progress) -> Iterator[rbd.Event]:
    """The decoder's events, fed from the reader, up to the stream's last end record;
    a stream that ends before it is the decoder's truncation error."""
    while True:
        event = decoder.next_event()
        if isinstance(event, rbd.NeedData):
            chunk = reader.read(CHUNK)
            if not chunk:
                raise decoder.truncated()
            decoder.feed(chunk)
            tell.add(len(chunk))
            continue
        yield event
        if isinstance(event, rbd.End) and decoder.done:
            return


class _Applier:
    """Writes of a diff into a staging volume, IN_FLIGHT at once; a record that
    overlaps one in flight waits for it, so records apply in the stream's order."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="thinblock-diff")
        self.flight: deque[tuple[int, int, Future[None]]] = deque()
        self.written = 0

    def _wait_overlapping(self, offset: int, n: int) -> None:
        while len(self.flight) >= WINDOW:
            self.flight.popleft()[2].result()
        for o, k, future in list(self.flight):
            if o < offset + n and offset < o + k:
                future.result()
        while self.flight and self.flight[0][2].done():
            self.flight.popleft()[2].result()

    def write(self, offset: int, data: bytes) -> None:
        self._wait_overlapping(offset, len(data))
        self.flight.append((offset, len(data), self.pool.submit(self._write, offset, data)))
        self.written += len(data)

    def _write(self, offset: int, data: bytes) -> None:
        _put(self.vol, offset, data, True)

    def zero(self, offset: int, n: int) -> None:
        self._wait_overlapping(offset, n)
        self.vol.write_zeroes(offset, n)

    def drain(self) -> None:
        while self.flight:
            self.flight.popleft()[2].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def import_diff(
    pool: Pool, name: str, reader: StreamReader, progress: ProgressFn, *, total: int = 0, force: bool = False
) -> dict[str, Any]:
    """Apply an rbd diff stream (v1 or v2) to volume `name`, all or nothing.

    The volume must have the diff's from-snapshot (VOLUME@SNAP, or a snapshot SNAP of
    it) and be unchanged since it (force applies it anyway); a diff with no
    from-snapshot starts from an empty image, so a volume holding data needs force.
    The diff is applied to a staging volume sharing the volume's blocks; only a
    stream read whole and well-formed is then adopted, with the to-snapshot taken,
    in one commit (core/snapshot.adopt). Anything else changes nothing."""
    start = time.monotonic()
    vol = visible(pool, name, "volume")
    with pool.lock:
        pool.refuse_if_busy(vol, "import a diff into")
    decoder = rbd.DiffDecoder()
    tell = _Progress(progress, total)
    stream = _events(decoder, reader, tell)
    first: rbd.Event | None = None
    for event in stream:
        if isinstance(event, rbd.FromSnap | rbd.ToSnap | rbd.Size):
            continue
        first = event
        break
    if decoder.size_bytes is None:
        raise ThinblockError("the rbd diff has no size ('s') record: rbd export-diff always writes one")
    size = decoder.size_bytes
    if size % SECTOR_BYTES or not size:
        raise ThinblockError(f"the rbd diff's image size {size} is not a positive whole number of 512-byte sectors")
    base = None
    if decoder.from_snap is not None:
        base = find_snapshot(pool, vol, decoder.from_snap, exact_first=False)
        if base is None:
            raise ThinblockError(
                f"volume {name} has no snapshot {decoder.from_snap!r} (looked for {name}@{decoder.from_snap} and a"
                f" snapshot {decoder.from_snap} of {name}): the diff starts from it"
            )
        changed = sum(n for _, n in changed_ranges(base, vol))
        if changed and not force:
            raise ThinblockError(
                f"volume {name} has changed since snapshot {base.name} ({format_size(changed)} differ): the diff"
                " would mix with those changes. Roll it back to the snapshot first, or pass --force"
            )
    else:
        mapped = (vol.row.data_blocks + vol.row.zeroed_blocks) * pool.block_size
        if mapped and not force:
            raise ThinblockError(
                f"the diff has no from-snapshot (it starts from an empty image) and volume {name} holds data"
                f" ({format_size(mapped)} mapped): pass --force to apply it anyway"
            )
    to_name = f"{name}@{decoder.to_snap}" if decoder.to_snap is not None else None
    if to_name is not None:
        with pool.lock:
            pool.check_new_name(to_name, "snapshot")
    staging = pool.add_staging(vol, "import-diff")
    applier = _Applier(staging)
    zeroed = 0
    try:
        if staging.size_bytes != size:
            staging.resize(size)
        data_at = 0
        for event in _chain([first] if first is not None else [], stream):
            if isinstance(event, rbd.Data):
                data_at = event.offset
            elif isinstance(event, rbd.Payload):
                applier.write(data_at, event.data)
                data_at += len(event.data)
            elif isinstance(event, rbd.Zero):
                applier.zero(event.offset, event.length)
                zeroed += event.length
        if decoder.rest() or reader.read(1):
            raise rbd.StreamError(f"malformed rbd diff at byte {decoder.offset}: bytes follow its end ('e') record")
        applier.drain()
        staging.flush()
        snap = adopt(pool, name, staging, to_name)
    except BaseException:
        applier.close()
        with contextlib.suppress(Exception):
            pool.remove_volume(staging.name)
        raise
    applier.close()
    tell.end()
    return {
        "volume": name,
        "from_snap": base.name if base is not None else None,
        "to_snap": snap.name if snap is not None else None,
        "size_bytes": size,
        "written_bytes": applier.written,
        "zeroed_bytes": zeroed,
        "stream_bytes": decoder.offset,
        "seconds": _elapsed(start),
    }


def import_rbd_image(
    pool: Pool, name: str, reader: StreamReader, progress: ProgressFn, *, total: int = 0
) -> dict[str, Any]:
    """Read an "rbd image v2" stream (`rbd export --export-format 2`, or ours) into a
    new volume, as `rbd import` does: its diffs in turn, each that ends at a snapshot
    SNAP followed by taking VOLUME@SNAP, so the snapshots come along. A failure
    removes the volume and the snapshots it made."""
    start = time.monotonic()
    with pool.lock:
        if pool.visible_volume(name) is not None:
            raise ThinblockError(
                f"{name!r} exists in pool {pool.path}: an rbd image stream makes a new volume, as rbd import does"
            )
    decoder = rbd.ImageDecoder()
    tell = _Progress(progress, total)
    vol: Volume | None = None
    applier: _Applier | None = None
    made: list[str] = []
    snap: str | None = None
    data_at = written = 0
    try:
        for event in _events(decoder, reader, tell):
            if isinstance(event, rbd.Size):
                size = event.size_bytes
                if size % SECTOR_BYTES or not size:
                    raise ThinblockError(f"the rbd image's size {size} is not a positive whole number of sectors")
                if vol is None:
                    vol = pool.create_volume(name, size)
                    applier = _Applier(vol)
                elif size != vol.size_bytes:
                    assert applier is not None
                    applier.drain()
                    vol.resize(size)
            elif isinstance(event, rbd.ToSnap):
                snap = event.name
            elif isinstance(event, rbd.Data | rbd.Payload | rbd.Zero):
                if applier is None:
                    raise rbd.StreamError("malformed rbd image stream: data before any size record")
                if isinstance(event, rbd.Data):
                    data_at = event.offset
                elif isinstance(event, rbd.Payload):
                    applier.write(data_at, event.data)
                    data_at += len(event.data)
                    written += len(event.data)
                else:
                    applier.zero(event.offset, event.length)
            elif isinstance(event, rbd.End):
                if applier is not None:
                    applier.drain()
                if snap is not None:
                    if vol is None:
                        raise rbd.StreamError("malformed rbd image stream: a snapshot of an image with no size")
                    create_snapshot(pool, name, f"{name}@{snap}")
                    made.append(f"{name}@{snap}")
                    snap = None
        if decoder.rest() or reader.read(1):
            raise rbd.StreamError(f"malformed rbd image stream at byte {decoder.offset}: bytes follow its last diff")
        if vol is None:
            raise rbd.StreamError("malformed rbd image stream: it has no size record")
        vol.flush()
    except BaseException:
        if applier is not None:
            applier.close()
        for gone in [*reversed(made), name if vol is not None else None]:
            if gone is not None:
                with contextlib.suppress(Exception):
                    pool.remove_volume(gone)
        raise
    assert applier is not None
    applier.close()
    tell.end()
    return {
        "volume": name,
        "size_bytes": vol.size_bytes,
        "created": True,
        "snapshots": made,
        "read_bytes": decoder.offset,
        "written_bytes": written,
        "zero_bytes_skipped": 0,
        "seconds": _elapsed(start),
    }


def _chain(first: list[rbd.Event], rest: Iterator[rbd.Event]) -> Iterator[rbd.Event]:
    yield from first
    yield from rest


# ----- sparsify -----------------------------------------------------------------------


def sparsify(pool: Pool, name: str, progress: ProgressFn) -> dict[str, Any]:
    """Give back the space of a volume's blocks that hold only zeros (Volume.sparsify),
    online: clients may keep using the volume. Blocks shared with a snapshot or clone
    stay as they are and are counted apart (freeing them would free nothing)."""
    start = time.monotonic()
    vol = visible(pool, name)
    if vol.readonly:
        raise ThinblockError(
            f"{name} is a snapshot, and snapshots are read-only: sparsify the volume (blocks it shares with the"
            " snapshot stay shared)"
        )
    free_before = pool.space_figures()["free_bytes"]
    extents = [e for e in _data_extents(vol) if e[2]]
    tell = _Progress(progress, sum(n for _, n, _ in extents))
    totals = [0, 0, 0, 0]
    lock = threading.Lock()

    def step(piece: tuple[int, int]) -> None:
        result = vol.sparsify(*piece)  # each step holds its own range: steps run side by side
        with lock:
            for i, value in enumerate(result):
                totals[i] += value
        tell.add(piece[1])

    _run_all(step, (piece for offset, n, _data in extents for piece in _chunks(offset, n, SPARSIFY_STEP)))
    pool.settle_frees()  # the freed blocks are punched and free before this returns
    tell.end()
    return {
        "volume": name,
        "data_bytes": totals[0],
        "unmapped_bytes": totals[1],
        "zeroed_bytes": totals[2],
        "shared_zero_bytes": totals[3],
        "freed_bytes": pool.space_figures()["free_bytes"] - free_before,
        "seconds": _elapsed(start),
    }
