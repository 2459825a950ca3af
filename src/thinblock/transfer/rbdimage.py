"""A volume out as rbd's "rbd image v2" stream, with its snapshots, as
`rbd export --export-format 2` writes it, so that `rbd import --export-format 2`
(and thinblock's own import, transfer/diffs.py) makes the image and its snapshots.

The stream is the image header, then one "rbd diff v2" stream per snapshot,
oldest first (empty -> s1, s1 -> s2, ...), each ending at its snapshot ('t'),
and a last one from the newest snapshot to the volume as it is now. Each diff
comes from metadata (core/delta.py): only what changed is read, and ranges that
changed to zeros are 'z' records, never bytes.

Which snapshots ride along (rbd's images have a flat list of snapshots; ours
have a lineage):
- a volume's: the snapshots taken of it, ordered by when they were taken;
- a snapshot's (VOLUME@SNAP): those of its volume up to and including it; the
  stream's last diff ends at it, so the image's head holds its bytes;
- a snapshot taken of a snapshot holds that snapshot's bytes and has no place
  in rbd: it is left out, and the result says so;
- a clone is exported whole (flattened, as rbd export does for a clone), with
  its own snapshots; the snapshot it was cloned from belongs to its origin
  volume and is not carried.
`snapshots=False` writes the one diff of the named volume or snapshot, and the
result names the snapshots it left out.

Every snapshot carried is read through a hidden copy taken at the start (as a
live volume is, through common.stable), so a snapshot removed while the export
runs changes nothing in the stream.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from thinblock.core.delta import changed_extents
from thinblock.core.pool import Pool
from thinblock.core.snapshot import stage
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.formats import rbd
from thinblock.progress import ProgressFn
from thinblock.transfer.common import Progress, block_runs, data_extents, elapsed, read_extents, stable, visible
from thinblock.transfer.images import StreamWriter

Extent = tuple[int, int, bool]  # (offset, length, data): data False where the range reads zeros


def lineage(pool: Pool, image: Volume) -> list[Volume]:
    """The snapshots taken of image, oldest first (call under the pool lock)."""
    snaps = [v for v in pool.visible().values() if v.row.kind == "snapshot" and v.row.origin_id == image.row.id]
    return sorted(snaps, key=lambda v: (v.row.created, v.row.id))


def rbd_snap_name(image: Volume, snap: Volume) -> str:
    """A snapshot's name in the stream: rbd's snapshots belong to their image, so
    VOLUME@SNAP is SNAP there, and a snapshot named otherwise keeps its name."""
    prefix = image.name + "@"
    return snap.name[len(prefix) :] if snap.name.startswith(prefix) else snap.name


@dataclass
class _Plan:
    """What goes into the stream: the snapshots carried (oldest first), whether the
    last diff ends at the named snapshot, and what was left out and why."""

    image: Volume | None = None
    snaps: list[Volume] = field(default_factory=list)
    ends_at_snapshot: bool = False
    left_out: list[dict[str, str]] = field(default_factory=list)


def _plan(pool: Pool, named: Volume, snapshots: bool) -> _Plan:
    """Which snapshots of `named` the stream carries (call under the pool lock)."""
    plan = _Plan()
    if named.row.kind == "volume":
        image, chain = named, lineage(pool, named)
    else:
        origin = pool.volume_by_id(named.row.origin_id)
        if origin is None or origin.row.kind != "volume":
            return plan  # a snapshot of a snapshot, or one whose volume is gone: an image of its own
        image = origin
        chain = lineage(pool, origin)
        chain = chain[: chain.index(named) + 1]  # named is one of them: a visible snapshot of origin
    plan.image = image
    if not snapshots:
        before = chain[:-1] if named.row.kind == "snapshot" else chain
        plan.left_out = [{"name": s.name, "why": "--no-snapshots"} for s in before]
        return plan
    plan.snaps, plan.ends_at_snapshot = chain, named.row.kind == "snapshot"
    ids = {s.row.id for s in chain}
    for v in sorted(pool.visible().values(), key=lambda v: v.name):
        if v.row.kind == "snapshot" and v.row.origin_id in ids:
            origin_name = next(s.name for s in chain if s.row.id == v.row.origin_id)
            plan.left_out.append({"name": v.name, "why": f"a snapshot of snapshot {origin_name}; rbd has none"})
    seen: dict[str, str] = {}
    for s in chain:
        rbd_name = rbd_snap_name(image, s)
        if rbd_name in seen:
            raise ThinblockError(
                f"snapshots {seen[rbd_name]} and {s.name} of {image.name} would both be called {rbd_name!r} in the"
                " rbd stream: rename one, or pass --no-snapshots"
            )
        seen[rbd_name] = s.name
    return plan


@contextlib.contextmanager
def _frozen(pool: Pool, snaps: list[Volume]) -> Iterator[list[Volume]]:
    """Hidden copies of snaps for the length of the job (a snapshot removed meanwhile
    keeps its bytes in its copy); removed at the end, whatever happened."""
    copies: list[Volume] = []
    try:
        for s in snaps:
            copies.append(stage(pool, s, "export", kind="snapshot"))
        yield copies
    finally:
        for copy in reversed(copies):
            with contextlib.suppress(Exception):
                pool.remove_volume(copy.name)


def _extents(base: Volume | None, vol: Volume) -> list[Extent]:
    """What the diff from base (None: an empty image) to vol must say: ranges of data
    to read, and (from a snapshot) ranges that changed to zeros. All inside vol's size."""
    if base is None:
        return [e for e in data_extents(vol) if e[2]]
    end = vol.size_bytes
    out: list[Extent] = []
    for offset, n, zero in changed_extents(base, vol):
        n = min(n, end - offset)
        if n > 0:
            out.append((offset, n, not zero))
    return out


def export_rbd_image(
    pool: Pool, name: str, out: StreamWriter, progress: ProgressFn, *, snapshots: bool = True
) -> dict[str, Any]:
    """Write volume or snapshot `name` as an "rbd image v2" stream, with its snapshots
    (module docstring: which ones). A live volume is written as of one moment."""
    start = time.monotonic()
    with pool.lock:
        plan = _plan(pool, visible(pool, name), snapshots)
    with stable(pool, name) as head, _frozen(pool, plan.snaps) as copies:
        # (state, its name in the stream): each diff ends at one; None is the image's head.
        ends: list[tuple[Volume, str | None]] = []
        if plan.image is not None:
            ends = [(c, rbd_snap_name(plan.image, s)) for c, s in zip(copies, plan.snaps, strict=True)]
        if not plan.ends_at_snapshot:
            ends.append((head, None))
        steps: list[tuple[Volume | None, str | None, Volume, str | None, list[Extent]]] = []
        base: Volume | None = None
        base_name: str | None = None
        for vol, to_name in ends:
            steps.append((base, base_name, vol, to_name, _extents(base, vol)))
            base, base_name = vol, to_name
        data_total = sum(n for *_, extents in steps for _, n, data in extents if data)
        tell = Progress(progress, data_total)
        encoder = rbd.DiffEncoder(2)
        head_bytes = rbd.image_header(diffs=len(steps))
        out.write(head_bytes)
        stream = len(head_bytes)
        written = zeroed = 0
        for base, from_name, vol, to_name, extents in steps:
            record = encoder.header()
            if from_name is not None:
                record += encoder.from_snap(from_name)
            if to_name is not None:
                record += encoder.to_snap(to_name)
            record += encoder.size(vol.size_bytes)
            out.write(record)
            stream += len(record)
            for offset, n, got in read_extents(vol, extents, tell):
                runs = [(offset, n, True)] if got is None else block_runs(offset, got, vol.block_size)
                for o, k, zero in runs:
                    if zero and base is None:
                        continue  # the image starts out empty: its zeros need no record
                    if zero:
                        record = encoder.zero(o, k)
                        out.write(record)
                        stream += len(record)
                        zeroed += k
                        continue
                    assert got is not None
                    record = encoder.data(o, k)
                    out.write(record)
                    out.write(memoryview(got)[o - offset : o - offset + k])
                    stream += len(record) + k
                    written += k
            out.write(encoder.end())
            stream += 1
        out.finish()
        tell.end()
        size = head.size_bytes
    return {
        "name": name,
        "size_bytes": size,
        "format": "rbd",
        "read_bytes": data_total,
        "written_bytes": written,
        "zeroed_bytes": zeroed,
        "snapshots": [step[3] for step in steps if step[3] is not None],
        "left_out": plan.left_out,
        "diffs": len(steps),
        "stream_bytes": stream,
        "seconds": elapsed(start),
    }
