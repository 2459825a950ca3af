"""rbd's incremental diffs out (export-diff) and in (import-diff, all or nothing),
and "rbd image v2" streams in, with their snapshots."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from thinblock.core.delta import changed_extents, changed_ranges
from thinblock.core.pool import SECTOR_BYTES, Pool, validate_name
from thinblock.core.registry import STAGING_PREFIX
from thinblock.core.snapshot import adopt, publish_staged, stage, stage_empty
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.formats import rbd
from thinblock.progress import ProgressFn
from thinblock.sizes import format_size
from thinblock.transfer.common import (
    CHUNK,
    IN_FLIGHT,
    WINDOW,
    Progress,
    WriteBehind,
    bound_size,
    data_extents,
    elapsed,
    put,
    read_extents,
    stable,
    visible,
)
from thinblock.transfer.images import StreamReader, StreamWriter


def diff_name(pool: Pool, snap: Volume) -> str:
    """A snapshot's name in an rbd diff: rbd's snapshots belong to an image, so
    VOLUME@SNAP is written as SNAP when VOLUME is the volume it was taken of."""
    origin = pool.volume_by_id(snap.row.origin_id)
    if origin is not None and snap.name.startswith(origin.name + "@"):
        return snap.name[len(origin.name) + 1 :]
    return snap.name


def snapshot_name(volume: str, snap: str, what: str) -> str:
    """VOLUME@SNAP, the name rbd snapshot SNAP takes on import, or ThinblockError saying
    that the rbd name is what cannot be used: rbd allows names thinblock does not (a
    timestamp's ':', a space), and the bare rule named only VOLUME@SNAP, as if the
    user had typed it. `what` starts the sentence ("the diff ends at")."""
    full = f"{volume}@{snap}"
    try:
        validate_name(full, "snapshot")
    except ThinblockError as exc:
        raise ThinblockError(
            f"{what} snapshot {snap!r}, which cannot be snapshot {full!r} here ({exc}): rename it where it was taken"
            " (rbd snap rename) and export again"
        ) from None
    return full


def find_snapshot(pool: Pool, image: Volume, name: str, why: str) -> Volume:
    """The snapshot of image that a diff calls `name`, as rbd finds an image's snapshot:
    image@name, or a snapshot called name. Either way it must have been taken of image
    itself (its origin_id, which renames keep): a snapshot of another volume, of a
    snapshot, or the one image was cloned from holds another history, and a diff from
    it would be applied to image's copies as if it were image's, silently wrong. The
    name written for it (diff_name) must be no other snapshot's of image, or a copy
    could hold that one under it. Both ends of a diff resolve names this way:
    export-diff's --from-snap and import-diff's 'f' record. Otherwise ThinblockError,
    in one sentence; `why` ends the one for a name not found."""
    with pool.lock:
        named = [pool.visible_volume(n) for n in (name, f"{image.name}@{name}")]
        snaps = [v for v in named if v is not None and v.row.kind == "snapshot"]
        ours = [v for v in snaps if v.row.origin_id == image.row.id]
        if not ours and snaps:
            origin = pool.volume_by_id(snaps[0].row.origin_id)
            of = f"{origin.row.kind} {origin.name}" if origin is not None else "a volume since removed"
            raise ThinblockError(
                f"snapshot {snaps[0].name} was taken of {of}, not of {image.row.kind} {image.name}: a diff goes from a"
                " snapshot of a volume to a later state of that same volume, as an rbd diff's are of one image"
            )
        if not ours:
            raise ThinblockError(
                f"{image.row.kind} {image.name} has no snapshot {name!r} (looked for {image.name}@{name} and a snapshot"
                f" {name} taken of {image.name}) in pool {pool.path}{why}"
            )
        base = ours[0]
        short = diff_name(pool, base)
        twins = sorted(
            v.name
            for v in pool.visible().values()
            if v is not base
            and v.row.kind == "snapshot"
            and v.row.origin_id == image.row.id
            and diff_name(pool, v) == short
        )
        if twins:
            raise ThinblockError(
                f"snapshots {base.name} and {twins[0]} of {image.row.kind} {image.name} would both be {short!r} in an rbd"
                " diff, so a copy could hold either under that name: rename one"
            )
        return base


def export_diff(
    pool: Pool, name: str, from_snap: str | None, out: StreamWriter, progress: ProgressFn, *, version: int = 1
) -> dict[str, Any]:
    """Write what changed from snapshot from_snap to `name` (a snapshot, or a volume as of
    now) as an rbd diff stream: 'w' for changed data, 'z' for ranges that changed to
    zeros. Without from_snap, everything the volume holds as data. From metadata: only
    the changed data is read."""
    start = time.monotonic()
    with stable(pool, name) as vol:
        named = visible(pool, name)
        image = named if named.row.kind == "volume" else pool.volume_by_id(named.row.origin_id) or named
        base = None
        if from_snap is not None:
            base = find_snapshot(pool, image, from_snap, " to diff from")
        if base is not None:
            # Past the end of a volume shrunk since base, the ranges read as zeros, but
            # they are no part of the image: the size record says where it ends, and
            # records beyond it are malformed (as rbd's diff_iterate stops at the
            # to-snapshot's size).
            end = vol.size_bytes
            extents = [(o, min(n, end - o), not zero) for o, n, zero in changed_extents(base, vol) if o < end]
        else:
            extents = [e for e in data_extents(vol) if e[2]]
        data_total = sum(n for _, n, data in extents if data)
        zero_total = sum(n for _, n, data in extents if not data)
        tell = Progress(progress, data_total)
        encoder = rbd.DiffEncoder(version)
        head = encoder.header()
        if base is not None:
            head += encoder.from_snap(diff_name(pool, base))
        if named.row.kind == "snapshot":
            head += encoder.to_snap(diff_name(pool, named))
        head += encoder.size(vol.size_bytes)
        out.write(head)
        written = len(head)

        for offset, n, got in read_extents(vol, extents, tell):
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
        "seconds": elapsed(start),
    }


def _events(decoder: rbd.DiffDecoder | rbd.ImageDecoder, reader: StreamReader, tell: Progress) -> Iterator[rbd.Event]:
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
    """A diff's data records applied to a volume, IN_FLIGHT writes at once; a record
    that overlaps one in flight waits for it, so records apply in the stream's order."""

    def __init__(self, vol: Volume) -> None:
        self.vol = vol
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="thinblock-diff")
        self.flight: deque[tuple[int, int, Future[tuple[int, int]]]] = deque()
        self.behind = WriteBehind(vol.pool)
        self.data_at = 0  # where the payload of the current 'w' record goes next
        self.written = self.zeroed = 0

    def apply(self, event: rbd.Event) -> None:
        """A 'w' record (Data, then its Payload) or a 'z' record (Zero); others are not data."""
        if isinstance(event, rbd.Data):
            self.data_at = event.offset
        elif isinstance(event, rbd.Payload):
            offset, n = self.data_at, len(event.data)
            self._wait_overlapping(offset, n)
            self.flight.append((offset, n, self.pool.submit(put, self.vol, offset, event.data, True, self.behind)))
            self.data_at += n
            self.written += n
        elif isinstance(event, rbd.Zero):
            self._wait_overlapping(event.offset, event.length)
            self.vol.write_zeroes(event.offset, event.length)
            self.zeroed += event.length

    def _wait_overlapping(self, offset: int, n: int) -> None:
        while len(self.flight) >= WINDOW:
            self.flight.popleft()[2].result()
        for o, k, future in list(self.flight):
            if o < offset + n and offset < o + k:
                future.result()
        while self.flight and self.flight[0][2].done():
            self.flight.popleft()[2].result()

    def drain(self) -> None:
        while self.flight:
            self.flight.popleft()[2].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def import_diff(
    pool: Pool,
    name: str,
    reader: StreamReader,
    progress: ProgressFn,
    *,
    total: int = 0,
    force: bool = False,
    allow_resize: bool = False,
    max_size_bytes: int | None = None,
) -> dict[str, Any]:
    """Apply an rbd diff stream (v1 or v2) to volume `name`, all or nothing.

    The volume must have the diff's from-snapshot (VOLUME@SNAP, or a snapshot SNAP of
    it) and be unchanged since it (force applies it anyway); a diff with no
    from-snapshot starts from an empty image, so a volume holding data needs force.
    The diff is applied to a staging volume sharing the volume's blocks; only a
    stream read whole and well-formed is then adopted, with the to-snapshot taken,
    in one commit (core/snapshot.adopt). Anything else changes nothing.

    A diff is untrusted: its size record resizes the volume only with allow_resize
    (rbd import-diff resizes silently, so a 16 MiB volume could become 8 EiB), and
    then never beyond max_size_bytes or the largest volume."""
    start = time.monotonic()
    vol = visible(pool, name, "volume")
    with pool.lock:
        pool.refuse_if_busy(vol, "import a diff into")
    # A diff without a size record keeps the volume's size, as rbd import-diff does.
    decoder = rbd.DiffDecoder(image_size_bytes=vol.size_bytes)
    tell = Progress(progress, total)
    stream = _events(decoder, reader, tell)
    first: rbd.Event | None = None
    for event in stream:
        if isinstance(event, rbd.FromSnap | rbd.ToSnap | rbd.Size):
            continue
        first = event
        break
    size = decoder.size_bytes if decoder.size_bytes is not None else vol.size_bytes
    if size % SECTOR_BYTES or not size:
        raise ThinblockError(f"the rbd diff's image size {size} is not a positive whole number of 512-byte sectors")
    if size != vol.size_bytes:
        if not allow_resize:
            raise ThinblockError(
                f"the diff is of a {format_size(size)} ({size} bytes) image and volume {name} is"
                f" {format_size(vol.size_bytes)}: pass --allow-resize to let the diff resize it (as rbd import-diff"
                " does), or resize the volume first"
            )
        bound_size(size, max_size_bytes, f"the rbd diff's image size (resizing volume {name})")
    base = None
    if decoder.from_snap is not None:
        base = find_snapshot(pool, vol, decoder.from_snap, ": the diff starts from it")
    to_name = snapshot_name(name, decoder.to_snap, "the diff ends at") if decoder.to_snap is not None else None
    if to_name is not None:
        with pool.lock:
            pool.check_new_name(to_name, "snapshot")
    # The volume as the job starts (a staged snapshot, sharing every block): it is what
    # the checks below look at, and a write to the volume after it, before the diff is
    # adopted, refuses the adoption instead of being silently discarded by it.
    mark = stage(pool, vol, "import-diff-start", kind="snapshot")
    staging: Volume | None = None
    applier: _Applier | None = None
    try:
        if base is not None:
            changed = sum(n for _, n in changed_ranges(base, mark))
            if changed and not force:
                raise ThinblockError(
                    f"volume {name} has changed since snapshot {base.name} ({format_size(changed)} differ): the"
                    " diff would mix with those changes. Roll it back to the snapshot first, or pass --force"
                )
        else:
            mapped = (mark.row.data_blocks + mark.row.zeroed_blocks) * pool.block_size
            if mapped and not force:
                raise ThinblockError(
                    f"the diff has no from-snapshot (it starts from an empty image) and volume {name} holds data"
                    f" ({format_size(mapped)} mapped): pass --force to apply it anyway"
                )
        staging = stage(pool, vol, "import-diff")
        applier = _Applier(staging)
        if staging.size_bytes != size:
            staging.resize(size)
        for event in itertools.chain([first] if first is not None else [], stream):
            applier.apply(event)
        if decoder.rest() or reader.read(1):
            raise rbd.StreamError(f"malformed rbd diff at byte {decoder.offset}: bytes follow its end ('e') record")
        applier.drain()
        staging.flush()
        snap = adopt(pool, name, staging, to_name, unchanged_since=mark)
    except BaseException:
        if applier is not None:
            applier.close()
        for left in (staging, mark):
            if left is not None:
                with contextlib.suppress(Exception):
                    pool.remove_volume(left.name)
        raise
    applier.close()
    with contextlib.suppress(Exception):
        pool.remove_volume(mark.name)
    tell.end()
    return {
        "volume": name,
        "from_snap": base.name if base is not None else None,
        "to_snap": snap.name if snap is not None else None,
        "size_bytes": size,
        "written_bytes": applier.written,
        "zeroed_bytes": applier.zeroed,
        "stream_bytes": decoder.offset,
        "seconds": elapsed(start),
    }


def import_rbd_image(
    pool: Pool,
    name: str,
    reader: StreamReader,
    progress: ProgressFn,
    *,
    total: int = 0,
    max_size_bytes: int | None = None,
) -> dict[str, Any]:
    """Read an "rbd image v2" stream (`rbd export --export-format 2`, or ours) into a
    new volume, as `rbd import` does: its diffs in turn, each that ends at a snapshot
    SNAP followed by taking VOLUME@SNAP, so the snapshots come along; a diff must
    start from the snapshot the one before it ended at. The volume and
    its snapshots are built hidden (staging, as import_image does) and get their
    names together, in one commit, once the stream was read whole: a failure or a
    death leaves none of them. Every size record is bounded by max_size_bytes (and
    the largest volume) before the volume is made or resized."""
    start = time.monotonic()
    with pool.lock:
        if pool.visible_volume(name) is not None:
            raise ThinblockError(
                f"{name!r} exists in pool {pool.path}: an rbd image stream makes a new volume, as rbd import does"
            )
        pool.check_new_name(name)  # refused now, not after the whole stream
    decoder = rbd.ImageDecoder()
    tell = Progress(progress, total)
    vol: Volume | None = None
    applier: _Applier | None = None
    made: list[tuple[Volume, str]] = []  # staged snapshots, with their real names
    snap: str | None = None
    last_snap: str | None = None  # where the last diff ended: the next one starts there
    try:
        for event in _events(decoder, reader, tell):
            if isinstance(event, rbd.Size):
                size = event.size_bytes
                if size % SECTOR_BYTES or not size:
                    raise ThinblockError(f"the rbd image's size {size} is not a positive whole number of sectors")
                bound_size(size, max_size_bytes, "the rbd image stream's size")
                if vol is None:
                    vol = stage_empty(pool, "import", size, "on")
                    applier = _Applier(vol)
                elif size != vol.size_bytes:
                    assert applier is not None
                    applier.drain()
                    vol.resize(size)
            elif isinstance(event, rbd.FromSnap):
                # Each diff starts where the one before it ended (rbd export writes them
                # so); one that starts elsewhere would be applied to the wrong contents.
                if event.name != last_snap:
                    where = f"not at {last_snap!r}, where the diff before it ended" if last_snap else "which it lacks"
                    raise rbd.StreamError(
                        f"malformed rbd image stream at byte {decoder.offset}: a diff starts from snapshot"
                        f" {event.name!r}, {where}"
                    )
            elif isinstance(event, rbd.ToSnap):
                snap = event.name
            elif isinstance(event, rbd.Data | rbd.Payload | rbd.Zero):
                if applier is None:
                    raise rbd.StreamError("malformed rbd image stream: data before any size record")
                applier.apply(event)
            elif isinstance(event, rbd.End):
                if applier is not None:
                    applier.drain()
                if snap is not None:
                    if vol is None:
                        raise rbd.StreamError("malformed rbd image stream: a snapshot of an image with no size")
                    if any(real == f"{name}@{snap}" for _, real in made):
                        raise rbd.StreamError(
                            f"malformed rbd image stream at byte {decoder.offset}: it takes snapshot {snap!r} twice"
                        )
                    with pool.lock:
                        pool.check_new_name(snapshot_name(name, snap, "the rbd image stream takes"), "snapshot")
                    made.append((stage(pool, vol, "import-snap", kind="snapshot"), f"{name}@{snap}"))
                    last_snap, snap = snap, None
        if decoder.rest() or reader.read(1):
            raise rbd.StreamError(f"malformed rbd image stream at byte {decoder.offset}: bytes follow its last diff")
        if vol is None:
            raise rbd.StreamError("malformed rbd image stream: it has no size record")
        vol.flush()
        publish_staged(pool, [(vol, name), *made])
    except BaseException:
        if applier is not None:
            applier.close()
        for gone in [*(staged for staged, _ in reversed(made)), vol]:
            if gone is not None and not gone.removed and gone.name.startswith(STAGING_PREFIX):
                with contextlib.suppress(Exception):
                    pool.remove_volume(gone.name)
        raise
    assert applier is not None
    applier.close()
    tell.end()
    return {
        "volume": name,
        "size_bytes": vol.size_bytes,
        "created": True,
        "snapshots": [snap_name for _, snap_name in made],
        "read_bytes": decoder.offset,
        "written_bytes": applier.written,
        "zero_bytes_skipped": 0,
        "seconds": elapsed(start),
    }
