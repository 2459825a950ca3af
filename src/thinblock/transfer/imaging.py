"""import and export of whole images: raw files, streams, NBD, qcow2 (through
qemu-nbd) and rbd's "rbd image v2" stream on the way out (transfer/rbdimage.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from thinblock.core.pool import SECTOR_BYTES, Pool
from thinblock.core.registry import STAGING_PREFIX
from thinblock.core.snapshot import adopt, publish_staged, stage_empty
from thinblock.core.volume import Volume
from thinblock.errors import NoSpaceError, ThinblockError
from thinblock.progress import ProgressFn
from thinblock.sizes import format_size
from thinblock.transfer.common import (
    CHUNK,
    Progress,
    WriteBehind,
    block_runs,
    bound_size,
    chunks,
    data_extents,
    elapsed,
    put,
    read_extents,
    run_all,
    stable,
)
from thinblock.transfer.images import RandomSink, RandomSource, StreamReader, StreamWriter
from thinblock.transfer.rbdimage import export_rbd_image


def import_image(
    pool: Pool,
    name: str,
    source: RandomSource | StreamReader,
    progress: ProgressFn,
    *,
    size_bytes: int | None = None,
    force: bool = False,
    max_size_bytes: int | None = None,
) -> dict[str, Any]:
    """Copy a raw image (a file, an NBD export, a stream) into volume `name`, creating it
    with the source's size unless it exists with that size. Only what the source holds
    as data is read, and only blocks that are not all zero are written. A volume that
    holds data is overwritten only with force.

    The image is built in a hidden staging volume (snapshot.stage_empty), which
    becomes the volume only once the whole source is in and flushed, in one metadata
    commit: a new volume is given its name (publish_staged), an existing one has its
    contents swapped for the staging volume's (adopt). A job that fails, is cancelled
    or dies (SIGKILL, a power cut) leaves no volume that looks whole: nothing new, or
    the old volume as it was; a staging volume left behind goes at the next open.
    So an existing volume's old contents keep their space until the swap. A size
    beyond max_size_bytes (or the largest volume) is refused before anything starts."""
    start = time.monotonic()
    stream = isinstance(source, StreamReader)
    size = size_bytes if stream else source.size_bytes  # type: ignore[union-attr]
    if size is not None:
        bound_size(size, max_size_bytes, "the size given (--size)" if stream else f"the source {source.name}")
    with pool.lock:
        vol = _import_target(pool, name, size, force)
    if vol is not None:
        size = vol.size_bytes
    if size is None:
        raise ThinblockError(f"importing a stream into a new volume {name} needs its size (--size)")
    if size % SECTOR_BYTES:
        raise ThinblockError(
            f"the source is {size} bytes, not a whole number of {SECTOR_BYTES}-byte sectors: a volume cannot"
            " hold it exactly"
        )
    created = vol is None
    held = 0 if vol is None else vol.mapped_blocks * pool.block_size  # kept until the swap
    staged = stage_empty(pool, "import", size, vol.row.detect_zeroes if vol is not None else "on", vol)
    try:
        if stream:
            assert isinstance(source, StreamReader)
            figures = _import_stream(staged, source, size, progress)
        else:
            figures = _import_random(staged, source, progress)  # type: ignore[arg-type]
        staged.flush()  # the data and its mapping are durable before the volume shows
        if created:
            publish_staged(pool, [(staged, name)])
        else:
            adopt(pool, name, staged, None, verb="import into")
    except BaseException as exc:
        if not staged.removed and staged.name.startswith(STAGING_PREFIX):
            with contextlib.suppress(Exception):
                pool.remove_volume(staged.name)
        if isinstance(exc, NoSpaceError) and held:
            raise NoSpaceError(
                f"{exc.strerror}: volume {name} keeps its old contents ({format_size(held)} mapped) until the"
                " import is complete, so the pool needs room for both"
            ) from exc
        raise
    return {"volume": name, "size_bytes": size, "created": created, **figures, "seconds": elapsed(start)}


def _import_target(pool: Pool, name: str, size: int | None, force: bool) -> Volume | None:
    """The existing volume an import goes into (None: a new one), or why it may not
    (call under the pool lock)."""
    vol = pool.visible_volume(name)
    if vol is None:
        pool.check_new_name(name)  # refused now, not after the whole copy
        return None
    if vol.row.kind != "volume":
        raise ThinblockError(f"{name!r} is a {vol.row.kind}: import into a volume")
    if size is not None and size != vol.size_bytes:
        raise ThinblockError(
            f"volume {name} is {format_size(vol.size_bytes)} ({vol.size_bytes} bytes) and the source"
            f" {format_size(size)} ({size} bytes): the sizes must match; resize the volume or import"
            " into a new one"
        )
    mapped = (vol.row.data_blocks + vol.row.zeroed_blocks) * pool.block_size
    if mapped and not force:
        raise ThinblockError(
            f"volume {name} already holds data ({format_size(mapped)} mapped): pass --force to overwrite it"
        )
    pool.refuse_if_busy(vol, "import into")
    return vol


def _import_random(vol: Volume, source: RandomSource, progress: ProgressFn) -> dict[str, int]:
    extents = list(source.extents())
    data_total = sum(n for _, n, data in extents if data)
    tell = Progress(progress, data_total)
    behind = WriteBehind(vol.pool)
    zeros = [0]
    lock = threading.Lock()

    def copy(piece: tuple[int, bytes]) -> None:
        offset, got = piece
        _written, zero = put(vol, offset, got, False, behind)
        with lock:
            zeros[0] += zero
        tell.add(len(got))

    # Reads come in order from the source (overlapping on the wire, for NBD); the
    # writes into the (empty, staging) volume run IN_FLIGHT at once.
    run_all(copy, source.stream(piece for offset, n, data in extents if data for piece in chunks(offset, n)))
    tell.end()
    return {"read_bytes": data_total, "written_bytes": behind.written, "zero_bytes_skipped": zeros[0]}


def _import_stream(vol: Volume, source: StreamReader, size: int, progress: ProgressFn) -> dict[str, int]:
    tell = Progress(progress, size)
    behind = WriteBehind(vol.pool)
    zeros = [0]
    lock = threading.Lock()

    read = 0  # bytes of the stream so far: the next piece's offset

    def pieces() -> Iterator[tuple[int, bytes]]:
        nonlocal read
        while True:
            data = source.read(CHUNK - read % CHUNK)
            if not data:
                break
            if read + len(data) > size:
                raise ThinblockError(f"the stream holds more than the volume's {size} bytes")
            yield read, data
            read += len(data)
            tell.add(len(data))

    def copy(piece: tuple[int, bytes]) -> None:
        offset, data = piece
        _written, zero = put(vol, offset, data, False, behind)
        with lock:
            zeros[0] += zero

    run_all(copy, pieces())
    if read < size:
        # A pipe that ends early most often means its producer failed half way
        # (xz -dc, curl, ssh), and a shell pipeline reports only our exit status: taking
        # the rest as zeros would pass off a cut image as whole, and the swap would throw
        # away what an existing volume held. Files must match the volume's size too.
        raise ThinblockError(
            f"the stream ended after {read} bytes, short of the volume's {format_size(size)} ({size} bytes):"
            " nothing was imported; a stream must hold the whole volume (for a smaller image, import it"
            f" with --size {read} and then grow the volume with 'volume resize')"
        )
    tell.end()
    return {"read_bytes": read, "written_bytes": behind.written, "zero_bytes_skipped": zeros[0]}


# ----- export -------------------------------------------------------------------------


def export_image(
    pool: Pool,
    name: str,
    sink: RandomSink | StreamWriter,
    progress: ProgressFn,
    *,
    fmt: str = "raw",
    snapshots: bool = True,
) -> dict[str, Any]:
    """Copy a volume or snapshot out: to a raw file or NBD export (holes stay holes, or
    are sent as zeroes), or as a stream: raw (every byte), or rbd's "rbd image v2"
    export format, which `rbd import` reads, with the volume's snapshots unless
    snapshots is False (transfer/rbdimage.py). A live volume is copied as of one moment."""
    start = time.monotonic()
    if fmt not in ("raw", "rbd"):
        raise ThinblockError(f"unknown export format {fmt!r}: raw or rbd")
    if fmt != "raw" and not isinstance(sink, StreamWriter):
        raise ThinblockError("--format rbd writes a stream: give a file name or -, not an NBD URI")
    if fmt == "rbd":
        assert isinstance(sink, StreamWriter)
        return export_rbd_image(pool, name, sink, progress, snapshots=snapshots)
    with stable(pool, name) as vol:
        extents = data_extents(vol)
        data_total = sum(n for _, n, data in extents if data)
        tell = Progress(progress, data_total)
        size = vol.size_bytes
        written = 0
        if isinstance(sink, StreamWriter):
            for _offset, n, got in read_extents(vol, extents, tell):
                if got is None:
                    sink.zeros(n)
                else:
                    sink.write(got)
                    written += n
        else:
            # Reads IN_FLIGHT at once; the sink keeps its own requests in flight.
            for offset, n, got in read_extents(vol, extents, tell):
                if got is None:
                    sink.zero(offset, n)
                    continue
                for o, k, zero in block_runs(offset, got, vol.block_size):
                    if zero:
                        sink.zero(o, k)
                    else:
                        sink.write(o, got[o - offset : o - offset + k])
                        written += k
        sink.finish()
        tell.end()
    return {
        "name": name,
        "size_bytes": size,
        "format": fmt,
        "read_bytes": data_total,
        "written_bytes": written,
        "seconds": elapsed(start),
    }
