"""Volumes as files through FUSE (libfuse3 via mfusepy, which, unlike pyfuse3,
passes fallocate and lseek through). Every call maps onto one verb of the
file handle's Export (frontends/export.py):

    read/write          -> read/write          fsync -> flush
    fallocate PUNCH_HOLE|KEEP_SIZE -> trim     ZERO_RANGE|KEEP_SIZE -> write_zeroes(no_hole)
    fallocate 0 / KEEP_SIZE        -> provision   (other modes: EOPNOTSUPP)
    lseek SEEK_DATA/SEEK_HOLE      -> Export.data_runs (ZEROED and UNMAPPED are holes: they read zero)
    statfs              -> pool space (the loop driver offers discard only when statfs works)

The daemon only ever does I/O on the pool's data file, never on its own FUSE
files or loop devices, so it cannot deadlock on itself. After a resize (a
control-socket verb, on another thread, with no pool lock held) it tells the
kernel the file's new size (fuse_invalidate_path: the attributes it caches for
attr_timeout) and the loop devices on the file theirs (fuse/loopsize.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
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
from thinblock.frontends.fuse.loopsize import follow_size
from thinblock.paths import safe_name_problem

log = logging.getLogger("thinblock.fuse")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
SEEK_DATA = 3
SEEK_HOLE = 4
MAX_IO_BYTES = 1 << 20

# libfuse3's fuse_invalidate_path (since 3.1), which mfusepy 3.1.1 does not wrap: the
# kernel drops what it caches of a path's attributes, so the next stat asks us.
_libfuse = getattr(mfusepy, "_libfuse", None)
_invalidate_path = getattr(_libfuse, "fuse_invalidate_path", None)
if _invalidate_path is not None:
    _invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    _invalidate_path.restype = ctypes.c_int


def _opener() -> str:
    """Who opens a volume's file, for refusals to name: losetup's open is the loop
    device's handle, held after losetup exits."""
    if _libfuse is None:
        return "a handle on its file in the FUSE mount"
    pid = int(_libfuse.fuse_get_context().contents.pid)
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = "?"
    if comm == "losetup":
        return f"a loop device on its file in the FUSE mount (attached by losetup, pid {pid})"
    return f"its file in the FUSE mount, opened by pid {pid} ({comm})"


class VolumeFS(mfusepy.Operations):  # type: ignore[misc]
    """A flat directory: one regular file per volume of the pool."""

    use_ns = True

    def __init__(self, pool: Pool, mountpoint: str | None = None, only: str | None = None) -> None:
        self.pool = pool
        self.mountpoint = mountpoint  # resolved; None: no loop devices are told of resizes
        # An owner per volume mounts each volume it serves on its own (fuse/attach.py):
        # then only that one is a file here.
        self.only = only
        self.started = time.time_ns()
        self._handles: dict[int, Export] = {}  # open file handles
        self._handles_lock = threading.Lock()
        self._next_fh = 0
        self._fuse: int | None = None  # libfuse's struct fuse, from init until destroy
        self._fuse_lock = threading.Lock()

    def init_with_config(self, conn: Any, config: Any) -> None:
        # 1 MiB requests (libfuse asks the kernel for max_pages to match).
        if conn is not None:
            conn.max_write = MAX_IO_BYTES
        if _libfuse is not None:
            with self._fuse_lock:
                self._fuse = _libfuse.fuse_get_context().contents.fuse
        if self.mountpoint is not None:
            self.pool.size_watchers.append(self.volume_resized)

    def destroy(self, path: str) -> None:
        self.forget_pool_watch()
        with self._fuse_lock:
            self._fuse = None  # freed once this returns

    def forget_pool_watch(self) -> None:
        with contextlib.suppress(ValueError):
            self.pool.size_watchers.remove(self.volume_resized)

    def volume_resized(self, name: str, size_bytes: int) -> list[str]:
        """A size watcher (Pool.size_watchers): the volume's file and every loop device
        on it show size_bytes; warnings for devices that do not."""
        if self.mountpoint is None or safe_name_problem(name) is not None:
            return []
        path = os.path.join(self.mountpoint, name)

        def refresh() -> None:
            self._invalidate(name)
            os.stat(path)  # the kernel takes the new size from our getattr

        self._invalidate(name)  # even with no device on it: a stat shows the new size at once
        warnings = follow_size(path, size_bytes, refresh)
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def _invalidate(self, name: str) -> None:
        with self._fuse_lock:
            if self._fuse is not None and _invalidate_path is not None:
                # -ENOENT when the kernel holds nothing of the file: nothing to drop.
                _invalidate_path(self._fuse, ("/" + name).encode())

    def _volume(self, path: str) -> Volume:
        name = path.lstrip("/")
        vol = self.pool.visible_volume(name)
        if vol is None or safe_name_problem(name) is not None or self.only not in (None, name):
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
        names = self.pool.visible() if self.only is None else [n for n in self.pool.visible() if n == self.only]
        return [".", "..", *sorted(n for n in names if safe_name_problem(n) is None)]

    def open(self, path: str, flags: int) -> int:
        vol = self._volume(path)
        if vol.readonly and flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        # A loop device keeps its file open: removal and rollback wait for the handle.
        export = Export(self.pool, vol, holder=_opener())
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


def mount(pool: Pool, mountpoint: str, *, foreground: bool = True, only: str | None = None) -> None:
    """Serve the pool's volumes (or only the one named) at mountpoint until unmounted (blocks)."""
    mountpoint = os.path.realpath(mountpoint)  # as the kernel names a loop device's backing file
    fs = VolumeFS(pool, mountpoint, only)
    try:
        _FUSE(
            fs,
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
    finally:
        fs.forget_pool_watch()  # however the mount ended
