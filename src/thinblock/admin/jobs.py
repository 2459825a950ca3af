"""Long administration work that moves data (import, export, rbd diffs, sparsify):
the job verbs, one table for the command line and the control socket alike.

A job verb is verbs.py's kind of verb plus two things a plain one has no use for:
the open files it reads or writes (`fds`, passed over the control socket with
SCM_RIGHTS, so a server reads the command's own standard input or writes the file
the command opened with the command's rights), and a ProgressFn. Arguments are
checked by the same schema as every other verb before anything runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

from thinblock.admin.schema import validate
from thinblock.core.pool import Pool
from thinblock.errors import OpError, PoolBusyError, ThinblockError
from thinblock.progress import ProgressFn
from thinblock.transfer import diffs, imaging
from thinblock.transfer.common import visible
from thinblock.transfer.images import (
    FileSink,
    FileSource,
    NbdSink,
    NbdSource,
    RandomSink,
    RandomSource,
    StreamReader,
    StreamWriter,
    nbd_connector,
)
from thinblock.transfer.qcow2 import open_qcow2
from thinblock.transfer.sparsify import sparsify

Check = Callable[[], None] | None
log = logging.getLogger("thinblock.jobs")
FDS_NEEDED = {"file": 1, "stream": 1, "nbd": 0, "qcow2": 1, "rbd": 1}  # qcow2: plus one per backing file


def _fds(verb: str, fds: list[int], want: int) -> None:
    if len(fds) != want:
        raise ThinblockError(f"{verb} needs {want} open file(s) passed with it, got {len(fds)}")


def _source(kind: str, fds: list[int], source: str, check: Check) -> RandomSource | StreamReader:
    if kind == "file":
        return FileSource(fds[0], source)
    if kind == "stream":
        return StreamReader(fds[0], source, check)
    return NbdSource(source, nbd_connector(uri=source))


def _import(
    pool: Pool,
    fds: list[int],
    progress: ProgressFn,
    check: Check,
    name: str,
    source_kind: str,
    source: str,
    size_bytes: int | None = None,
    force: bool = False,
    max_size_bytes: int | None = None,
    backing: list[str] | None = None,
) -> dict[str, Any]:
    backing = backing or []
    if backing and source_kind != "qcow2":
        raise ThinblockError("a backing chain (--allow-backing) belongs to a qcow2 image")
    _fds("import", fds, FDS_NEEDED[source_kind] + len(backing))
    bound = {"max_size_bytes": max_size_bytes}
    if source_kind == "rbd":  # an "rbd image v2" stream: a new volume, with its snapshots
        if force or size_bytes is not None:
            raise ThinblockError("an rbd image stream makes a new volume of its own size: no --force, no --size")
        with contextlib.closing(StreamReader(fds[0], source, check)) as reader:
            return diffs.import_rbd_image(pool, name, reader, progress, total=_file_size(fds[0]), **bound)
    src: RandomSource | StreamReader
    if source_kind == "qcow2":  # checked, bounded and served here: nothing but these files is read
        src = open_qcow2(fds, source, backing, force=force, max_size_bytes=max_size_bytes)
    else:
        src = _source(source_kind, fds, source, check)
    with contextlib.closing(src):
        result = imaging.import_image(pool, name, src, progress, size_bytes=size_bytes, force=force, **bound)
    if source_kind == "qcow2":
        result["files_read"] = [source, *[entry.split(":", 1)[1] for entry in backing]]
    return result


def _export(
    pool: Pool,
    fds: list[int],
    progress: ProgressFn,
    check: Check,
    name: str,
    dest_kind: str,
    dest: str,
    format: str = "raw",
    fresh: bool = True,
    snapshots: bool = True,
) -> dict[str, Any]:
    _fds("export", fds, FDS_NEEDED[dest_kind])
    vol = visible(pool, name)
    sink: RandomSink | StreamWriter
    if dest_kind == "stream" or (dest_kind == "file" and format == "rbd"):
        sink = StreamWriter(fds[0], dest, check)
    elif dest_kind == "file":
        sink = FileSink(fds[0], dest, vol.size_bytes, fresh=fresh)
    elif dest_kind == "nbd":
        sink = NbdSink(dest, nbd_connector(uri=dest), vol.size_bytes)
    else:
        raise ThinblockError(f"cannot export to a {dest_kind}")
    with contextlib.closing(sink):
        return imaging.export_image(pool, name, sink, progress, fmt=format, snapshots=snapshots)


def _export_diff(
    pool: Pool,
    fds: list[int],
    progress: ProgressFn,
    check: Check,
    name: str,
    dest: str,
    from_snap: str | None = None,
    version: int = 1,
) -> dict[str, Any]:
    _fds("export-diff", fds, 1)
    with contextlib.closing(StreamWriter(fds[0], dest, check)) as out:
        return diffs.export_diff(pool, name, from_snap, out, progress, version=version)


def _import_diff(
    pool: Pool,
    fds: list[int],
    progress: ProgressFn,
    check: Check,
    name: str,
    source: str,
    force: bool = False,
    allow_resize: bool = False,
    max_size_bytes: int | None = None,
) -> dict[str, Any]:
    _fds("import-diff", fds, 1)
    with contextlib.closing(StreamReader(fds[0], source, check)) as reader:
        return diffs.import_diff(
            pool,
            name,
            reader,
            progress,
            total=_file_size(fds[0]),
            force=force,
            allow_resize=allow_resize,
            max_size_bytes=max_size_bytes,
        )


def _file_size(fd: int) -> int:
    """A regular file's size, for progress; 0 for a pipe, whose length is unknown."""
    st = os.fstat(fd)
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _sparsify(pool: Pool, fds: list[int], progress: ProgressFn, check: Check, name: str) -> dict[str, Any]:
    _fds("sparsify", fds, 0)
    return sparsify(pool, name, progress)


JOBS: dict[str, Callable[..., Any]] = {
    "import": _import,
    "export": _export,
    "export_diff": _export_diff,
    "import_diff": _import_diff,
    "volume_sparsify": _sparsify,
}


def run_job(
    pool: Pool,
    verb: str,
    args: dict[str, Any],
    fds: list[int],
    progress: ProgressFn,
    check: Check | None = None,
) -> Any:
    """Run one job verb on an open pool. The fds are the job's from here on: closed
    when it ends, whatever happens. check, called while the job waits on a stream,
    raises when whoever asked for it went away."""
    try:
        validate(verb, args)
        if pool.owner is not None:
            check_owned(pool, str(args["name"]))
        return JOBS[verb](pool, list(fds), progress, check, **args)
    except OSError as exc:
        if isinstance(exc, OpError):  # the pool's own refusals keep their errno
            raise
        # The file, stream or NBD peer outside the pool failed (a full disk, EIO, a
        # closed pipe): one sentence, like every other error.
        where = f" ({exc.filename})" if exc.filename else ""
        raise ThinblockError(f"{verb.replace('_', '-')} failed: {exc.strerror or exc}{where}") from None
    finally:
        close_fds(fds)
        if pool.owner is not None:
            _settle(pool)


def check_owned(pool: Pool, name: str) -> None:
    """An owner per volume runs a job only on what it serves: one of its volumes, or a
    snapshot of one (the command line sends a job to the owner of its volume, and runs
    one on a volume nobody holds, or a new one, itself: admin/access.py)."""
    owner = pool.owner
    assert owner is not None  # run_job asks only an owner per volume
    vol = pool.visible_volume(name)
    if vol is None:
        if owner.owned_ids() and any(r.name == name for r in pool.meta.volumes()):
            raise PoolBusyError(f"volume {name} is not served here ({owner.name}): it is newer than this server")
        return  # a new volume (import), or none: the job says which
    if owner.owned_ids() and not pool.serves(vol):  # owning none: the command's own pool-level opening
        raise PoolBusyError(pool.served_elsewhere(vol))


def _settle(pool: Pool) -> None:
    """After a job of an owner per volume: its changes committed, the leases of the
    staging volumes it made and dropped are given up (a server runs many jobs)."""
    assert pool.owner is not None
    try:
        pool.commit()
        pool.owner.forget_staging()
    except (OSError, ThinblockError) as exc:  # kept until the owner closes
        log.warning("pool %s: after a job: %s", pool.path, exc)


def close_fds(fds: list[int]) -> None:
    """Close open files handed over for a job, whatever state they are in."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
