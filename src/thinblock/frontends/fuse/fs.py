"""Volumes as files through FUSE (libfuse3 via mfusepy, which, unlike pyfuse3,
passes fallocate and lseek through). Every call maps onto one verb of the
file handle's Export (frontends/export.py):

    read/write          -> read/write          fsync -> flush
    fallocate PUNCH_HOLE|KEEP_SIZE -> trim     ZERO_RANGE|KEEP_SIZE -> write_zeroes(no_hole)
    fallocate 0 / KEEP_SIZE        -> provision   (other modes: EOPNOTSUPP)
    lseek SEEK_DATA/SEEK_HOLE      -> Export.data_runs (ZEROED and UNMAPPED are holes: they read zero)
    statfs              -> pool space (the loop driver offers discard only when statfs works)

The daemon only ever does I/O on the pool's data file, never on its own FUSE
files or loop devices, so it cannot deadlock on itself.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from typing import Any

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy

from thinblock.core.pool import Pool
from thinblock.core.volume import Volume
from thinblock.errors import OpError
from thinblock.frontends.export import Export, errno_of
from thinblock.paths import safe_name_problem

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
SEEK_DATA = 3
SEEK_HOLE = 4
MAX_IO_BYTES = 1 << 20


class VolumeFS(mfusepy.Operations):  # type: ignore[misc]
    """A flat directory: one regular file per volume of the pool."""

    use_ns = True

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.started = time.time_ns()
        self._handles: dict[int, Export] = {}  # open file handles
        self._handles_lock = threading.Lock()
        self._next_fh = 0

    def init_with_config(self, conn: Any, config: Any) -> None:
        # 1 MiB requests (libfuse asks the kernel for max_pages to match).
        if conn is not None:
            conn.max_write = MAX_IO_BYTES

    def _volume(self, path: str) -> Volume:
        name = path.lstrip("/")
        vol = self.pool.visible_volume(name)
        if vol is None or safe_name_problem(name) is not None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return vol

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        base = {"st_uid": 0, "st_gid": 0, "st_atime": self.started, "st_mtime": self.started, "st_ctime": self.started}
        if path == "/":
            return {**base, "st_mode": stat.S_IFDIR | 0o700, "st_nlink": 2, "st_size": 0}
        vol = self._volume(path)
        row = vol.row
        mode = 0o400 if vol.readonly else 0o600
        return {
            **base,
            "st_mode": stat.S_IFREG | mode,
            "st_nlink": 1,
            "st_size": row.size_bytes,
            "st_blocks": (row.data_blocks + row.zeroed_blocks) * self.pool.block_size // 512,
            "st_blksize": min(self.pool.block_size, MAX_IO_BYTES),
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        # A name that cannot be a file (paths.py) is not listed: it never reaches a host path.
        return [".", "..", *sorted(n for n in self.pool.visible() if safe_name_problem(n) is None)]

    def open(self, path: str, flags: int) -> int:
        vol = self._volume(path)
        if vol.readonly and flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        # A loop device keeps its file open: removal and rollback wait for the handle.
        export = Export(self.pool, vol)
        with self._handles_lock:
            self._next_fh += 1
            self._handles[self._next_fh] = export
            return self._next_fh

    def _export(self, path: str, fh: int | None) -> Export:
        export = self._handles.get(fh or 0)
        if export is None or export.gone:
            vol = self._volume(path)  # a call without an open handle (truncate, getattr-like)
            return Export(self.pool, vol, counted=False)
        return export

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OpError as exc:
            raise mfusepy.FuseOSError(errno_of(exc)) from None

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return bytes(self._call(self._export(path, fh).read_clipped, offset, size))

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        export = self._export(path, fh)
        if offset + len(data) > export.size_bytes:
            raise mfusepy.FuseOSError(errno.ENOSPC)  # a volume file never grows by writing
        self._call(export.write, offset, data)
        return len(data)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._call(self._export(path, fh).flush)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) is not a durability point; fsync is

    def release(self, path: str, fh: int) -> int:
        with self._handles_lock:
            export = self._handles.pop(fh, None)
        if export is not None:
            export.close()
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if length != self._volume(path).size_bytes:
            raise mfusepy.FuseOSError(errno.EPERM)  # resize with `thinblock volume resize`
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        export = self._export(path, fh)
        if offset < 0 or size <= 0:
            raise mfusepy.FuseOSError(errno.EINVAL)
        end = min(offset + size, export.size_bytes)
        if mode == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE:
            if end > offset:
                self._call(export.trim, offset, end - offset)
        elif mode == FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE:
            if end > offset:
                self._call(export.write_zeroes, offset, end - offset, no_hole=True)
        elif mode in (0, FALLOC_FL_KEEP_SIZE):
            if offset + size > export.size_bytes and not mode & FALLOC_FL_KEEP_SIZE:
                raise mfusepy.FuseOSError(errno.EFBIG)  # volumes do not grow through fallocate
            if end > offset:
                self._call(export.provision, offset, end - offset)
        else:
            raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
        return 0

    def lseek(self, path: str, offset: int, whence: int, fh: int) -> int:
        export = self._export(path, fh)
        if whence not in (SEEK_DATA, SEEK_HOLE):
            raise mfusepy.FuseOSError(errno.EINVAL)
        if offset < 0 or offset >= export.size_bytes:
            raise mfusepy.FuseOSError(errno.ENXIO)
        pos = offset
        for length, is_data in self._call(export.data_runs, offset, export.size_bytes - offset):
            if is_data == (whence == SEEK_DATA):
                return pos
            pos += length
        if whence == SEEK_HOLE:
            return export.size_bytes  # the end of the file counts as a hole
        raise mfusepy.FuseOSError(errno.ENXIO)

    def statfs(self, path: str) -> dict[str, int]:
        status = self.pool.space_figures()  # statfs is frequent: no page walks here
        frsize = 4096
        return {
            "f_bsize": min(self.pool.block_size, MAX_IO_BYTES),
            "f_frsize": frsize,
            "f_blocks": status["size_bytes"] // frsize,
            "f_bfree": status["free_bytes"] // frsize,
            "f_bavail": status["free_bytes"] // frsize,
            "f_files": len(self.pool.volumes),
            "f_ffree": 0,
            "f_namemax": 255,
        }


class _FUSE(mfusepy.FUSE):  # type: ignore[misc]
    """mfusepy 3.1.1 knows libfuse3's lseek callback but has no wrapper for it yet."""

    def lseek(self, path: bytes | None, offset: int, whence: int, fip: Any) -> int:
        decoded = path.decode(self.encoding, self.errors) if path else "/"
        fh = fip.contents.fh if fip else 0
        return self.operations.lseek(decoded, offset, whence, fh)  # type: ignore[no-any-return]


# Worker threads for FUSE requests: the loop device keeps up to its queue depth in
# flight; more threads than that only wait on the volume's range locks.
FUSE_MAX_THREADS = 16


def mount(pool: Pool, mountpoint: str, *, foreground: bool = True) -> None:
    """Serve the pool's volumes at mountpoint until unmounted (blocks)."""
    _FUSE(
        VolumeFS(pool),
        mountpoint,
        foreground=foreground,
        fsname="thinblock",
        subtype="thinblock",
        direct_io=True,
        default_permissions=True,
        # Both given explicitly: left unset, libfuse 3.14 hands its loop the unset idle
        # limit (-1) and logs "Ignoring invalid max threads value" at every mount.
        max_threads=FUSE_MAX_THREADS,
        max_idle_threads=FUSE_MAX_THREADS,
    )
